"""RMSNorm (and the residual add before it) folded into the word-layout GEMV's prologue (marker `cuda`).

Kernel level: `qmm.rms_norm_matmul` against float64 rms_norm then matmul with the dequantized weight,
for 1-4 rows, K not a multiple of the 64-k tile or of the norm's 1024-float step, with and without the
add (the stored sum checked exactly) and the norm weight g, x rounded in the GEMV or pre-quantized by
its own launch (XQ), one split and several (atomics, tickets). The tolerance is test_cuda_gemv_xq.py's
per-element rounding bound on the normalised x: the kernel rounds (x [+ y]) * g per block and
multiplies the sums by the row's 1 / rms, so the rounding step relative to the block is the same.

Graph level: a random-weight Llama decoded greedily with the norm_gemv fusion on and off (the fusion
entries, logits against the CPU backend, the same tokens), and a sibling group (two quantized matmuls
over one normalised x) whose add has another reader.

Runs where torch sees a GPU; `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it under Triton's interpreter.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import greedy, require_cuda  # noqa: E402

_INTERPRET = require_cuda()
import torch  # noqa: E402
from test_cuda import DEVICE, FORMATS, make_weight, rel_err, rng_for, small_llama  # noqa: E402
from test_cuda_gemv_xq import check, words_weight  # noqa: E402

import ingot  # noqa: E402
from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.options import CudaOptions  # noqa: E402

EPS = 1e-5
CASES = [  # (format, (K, N, block along K), rows, LIMBS)
    (FORMATS[0], (576, 130, 32), 1, 2), (FORMATS[1], (960, 200, 64), 3, 2), (FORMATS[3], (4128, 96, 32), 2, 3),
    (FORMATS[0], (230, 150, 32), 4, 1),
]
# (add, g, split config): each of add / g with and without, split-K on and off for each
VARIANTS = [(False, False, dict(SPLIT=1)), (False, True, dict(SPLIT=3, REDUCE=1)), (True, False, dict(SPLIT=3, REDUCE=2)),
            (True, True, dict(SPLIT=1))]


def normalised(h: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    h = h.double().cpu()
    out = h / torch.sqrt((h * h).mean(dim=1, keepdim=True) + EPS)
    return out * g.double().cpu() if g is not None else out


XQ_MODES = {"x-in-gemv": dict(XQ=False), "xq": dict(XQ=True), "xq-self": dict(XQ=True, XQ_SELF=True)}


@pytest.mark.parametrize("xq", list(XQ_MODES))
@pytest.mark.parametrize("case", CASES, ids=[f"{c[1][0]}x{c[1][1]}-rows{c[2]}-limbs{c[3]}" for c in CASES])
def test_norm_prologue_matches_numpy(case, xq):
    """x rounded in the GEMV, by the quantize launch (which runs the norm and the add), or by each
    program for its split (xq-self: every program reads its rows whole for their rms)."""
    fmt, shape, rows, limbs = case
    k, n, _ = shape
    rng = rng_for(f"norm-gemv{case}{xq}")
    w = words_weight(rng, fmt, shape)
    a = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32) * 3).to(DEVICE)
    b = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(DEVICE)
    g = torch.from_numpy((1 + 0.3 * rng.standard_normal(k)).astype(np.float32)).to(DEVICE)
    for add, with_g, config in VARIANTS:
        what = f"add={add} g={with_g} {config}"
        got = qmm.rms_norm_matmul(a, w, g if with_g else None, EPS, add=b if add else None,
                                  config=dict(config, LIMBS=limbs, **XQ_MODES[xq]))
        if add:
            total, got = got
            assert total.shape == a.shape and total.dtype == torch.float32
            assert torch.equal(total.cpu(), (a + b).cpu()), what            # float32 a + b, each element once
        assert got.shape == (rows, n) and got.dtype == torch.float32
        check(got, normalised(a + b if add else a, g if with_g else None), w, limbs, what=what)


@pytest.mark.parametrize("parts", [True, False], ids=["parts", "whole-row"])
def test_norm_quantize_launch_by_parts_or_whole_rows(parts):
    """The quantize launch with a norm: each program its own blocks and their sum of squares, the GEMV
    adding a row's parts for 1 / rms (rows of options.xq_norm_parts_min_k and more), or every program
    reading its row whole (shorter rows); more programs a row than a power of two (K 4128: 33 of 4
    blocks), split-K both ways, 1-4 rows."""
    options = CudaOptions(xq_norm_parts_min_k=4128 if parts else 4129)
    assert CudaOptions().xq_norm_parts_min_k <= 4128
    rng = rng_for(f"norm-gemv-parts{parts}")
    w = words_weight(rng, FORMATS[3], (4128, 96, 32))
    for rows, config in ((1, dict(SPLIT=1)), (3, dict(SPLIT=3, REDUCE=1)), (4, dict(SPLIT=2, REDUCE=2))):
        a = torch.from_numpy(rng.standard_normal((rows, 4128)).astype(np.float32) * 3).to(DEVICE)
        b = torch.from_numpy(rng.standard_normal((rows, 4128)).astype(np.float32)).to(DEVICE)
        g = torch.from_numpy((1 + 0.3 * rng.standard_normal(4128)).astype(np.float32)).to(DEVICE)
        total, got = qmm.rms_norm_matmul(a, w, g, EPS, add=b, config=dict(config, XQ=True, LIMBS=2), options=options)
        assert torch.equal(total.cpu(), (a + b).cpu()), (rows, config)
        check(got, normalised(a + b, g), w, 2, what=f"rows={rows} {config}")


def test_norm_prologue_takes_xq_by_the_options_threshold(monkeypatch):
    """Without XQ in the config, weights of options.xq_min_bytes and more run the norm in the quantize kernel."""
    rng = rng_for("norm-gemv-threshold")
    w = words_weight(rng, FORMATS[0], (576, 130, 32))
    a, b = (torch.from_numpy(rng.standard_normal((2, 576)).astype(np.float32)).to(DEVICE) for _ in range(2))
    calls = []
    quantize = qmm.xq._quantize_x
    monkeypatch.setattr(qmm.xq, "_quantize_x", lambda *args, **kw: calls.append(args) or quantize(*args, **kw))
    for min_bytes, want_xq in ((w.nbytes + 1, False), (w.nbytes, True)):
        options = CudaOptions(xq_min_bytes=min_bytes)
        calls.clear()
        total, got = qmm.rms_norm_matmul(a, w, None, EPS, add=b, config=dict(SPLIT=1), options=options)
        assert len(calls) == int(want_xq) and all(c[3] is not None for c in calls)
        assert torch.equal(total.cpu(), (a + b).cpu())
        check(got, normalised(a + b, None), w, options.gemv_limbs, what=f"xq={want_xq}")


def test_self_rounding_norm_gemv_zeroes_the_next_output():
    """`zero=` with the norm and the add in the GEMV that rounds its own x: the next GEMV's output is
    zeroed by the same launch, and an output handed in zeroed (`out=`, ZEROED) takes the split-K sums."""
    rng = rng_for("norm-gemv-zero")
    w = words_weight(rng, FORMATS[1], (960, 200, 64))
    a, b = (torch.from_numpy(rng.standard_normal((3, 960)).astype(np.float32)).to(DEVICE) for _ in range(2))
    zero = torch.full((1234,), float("nan"), device=DEVICE)
    out = torch.zeros(3, 200, device=DEVICE)
    total, got = qmm.rms_norm_matmul(a, w, None, EPS, add=b, zero=zero, out=out,
                                     config=dict(SPLIT=3, REDUCE=1, XQ=True, XQ_SELF=True, ZEROED=True))
    assert got.data_ptr() == out.data_ptr() and not zero.any().item(), "the next GEMV's output was not zeroed"
    check(got, normalised(a + b, None), w, CudaOptions().gemv_limbs, what="into the zeroed output")


# == the plan =========================================================================================

def _without_norm_gemv(switch: str):
    """CompileOptions with every CUDA fusion but norm_gemv for switch "0"; the defaults for "1"."""
    from ingot.compiler import FUSIONS
    from ingot.options import CompileOptions
    return None if switch == "1" else CompileOptions(fusions=frozenset(FUSIONS["cuda"]) - {"norm_gemv"})


def _decode(switch: str):
    model, _ = small_llama()                   # a fresh graph: compiled executables are cached per graph
    prompt = [5, 17, 250, 3, 99, 42, 7]
    cpu_tokens, cpu_logits, _ = greedy(model, "cpu", prompt, 4)
    tokens, logits, dec = greedy(model, "cuda", prompt, 4, forced=cpu_tokens, options=_without_norm_gemv(switch))
    for step, (got, want) in enumerate(zip(logits, cpu_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")   # as test_cuda.py's decode
    assert [int(np.argmax(x)) for x in logits[:-1]] == cpu_tokens     # greedy: the same tokens
    return dec, model


def test_llama_decode_with_the_norm_in_the_gemv():
    dec, model = _decode("1")
    fusions, names = dec.plan.fusions, dec.plan.step_names
    layers = model.config.n_layers
    # layer 0's attention norm reads the embedding (no add); every later norm follows a residual add, the
    # output one too: row `last` of a one-row step spans its axis, so it is the last add's sum itself
    assert fusions.count("add+rms_norm into the GEMV") == 2 * layers, fusions
    assert fusions.count("rms_norm into the GEMV") == 1, fusions
    assert not {"rms_norm", "add_rms_norm"} & set(names), names
    # the FFN's norm step may run on through the down GEMV ("+glu_gemv": weights under qmm.SELF_XQ_BYTES)
    base = [n.removesuffix("+glu_gemv") for n in names]
    assert base.count("add_rms_norm_gemv") == 2 * layers and base.count("rms_norm_gemv") == 1, names
    prefill = model.compile(17, "cuda")          # past the word GEMV's 16 rows: the tensor-core kernel ...
    assert "add+rms_norm into the GEMV" not in prefill.plan.fusions and "add_rms_norm" in prefill.plan.step_names
    assert prefill.plan.fusions.count("rms_norm into the GEMV") == 1   # ... but the output norm of row `last`


def test_llama_decode_with_the_switch_off():
    dec, _ = _decode("0")
    assert not any("rms_norm into the GEMV" in f for f in dec.plan.fusions), dec.plan.fusions
    assert "add+rms_norm" in dec.plan.fusions and "rms_norm" in dec.plan.step_names


@pytest.mark.parametrize("switch", ["1", "0"])
def test_sibling_group_after_an_add_with_another_reader(switch):
    """h = a + b read by a float matmul and by rms_norm feeding two quantized matmuls (one GEMV over the
    concatenated weight): one step writes h and both outputs."""
    rng = rng_for(f"norm-gemv-siblings{switch}")
    rows, k = 3, 96
    g = ingot.Graph()
    a, b = g.placeholder((rows, k), name="a"), g.placeholder((rows, k), name="b")
    h = a + b
    normed = g.rms_norm(h, g.constant((1 + 0.1 * rng.standard_normal(k)).astype(np.float32)), EPS)
    outs = []
    for n in (64, 40):
        q, params, _ = make_weight(rng, FORMATS[0][0], k, n, 32, False, True, False, False)
        w = g.dequantize(g.constant(q, dtype=FORMATS[0][0]), **{name: g.constant(p) for name, p in params.items()})
        outs.append(g.matmul(normed, w))
    outs.append(g.matmul(h, g.constant(rng.standard_normal((k, 5)).astype(np.float32))))
    exe = g.compile(targets=outs, device="cuda", options=_without_norm_gemv(switch))
    feeds = {"a": rng.standard_normal((rows, k)).astype(np.float32), "b": rng.standard_normal((rows, k)).astype(np.float32)}
    got = [cuda_backend.to_host(x) for x in exe.run(feeds)]
    want = g.compile(targets=outs, device="cpu").run(feeds)
    for x, y in zip(got, want):   # the word GEMV rounds x to 16 bits per block of 32: as test_cuda.py's quantized tests
        assert x.shape == y.shape and rel_err(x, y) < 1e-4, rel_err(x, y)
    folded = "add+rms_norm into the GEMV" in exe.plan.fusions
    assert folded == (switch == "1"), exe.plan.fusions
    assert "2 sibling quantized matmuls" in exe.plan.fusions
    if folded:
        assert "add_rms_norm_gemv" in exe.plan.step_names and "add_rms_norm" not in exe.plan.step_names
