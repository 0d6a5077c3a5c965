"""Each device fusion on the GPU (marker `cuda`): the graphs of the pass tests (tests/test_pass_fuse_*.py)
compiled for cuda run the fused kind as one step of its own (not as its parts) and compute what the
CPU backend computes, outputs and variables. `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it under
Triton's interpreter."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

require_cuda()

import ingot  # noqa: E402
from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.ir import Op  # noqa: E402
from fusion_helpers import quantized_weight, tiny_llama  # noqa: E402

# the word GEMV rounds x to 16 bits per block of 32: as test_cuda.py's quantized tests
RTOL = 2e-4


def run_both(g, targets, feeds, variables=None):
    """(cuda executable, [(cuda, cpu) outputs], [(cuda, cpu) variables]) after one run from the same state."""
    gpu, cpu = g.compile(targets=targets, device="cuda"), g.compile(targets=targets, device="cpu")
    s_gpu, s_cpu = gpu.new_state(), cpu.new_state()
    for name, value in (variables or {}).items():
        s_gpu[name] = value
        s_cpu[name] = value
    outs = list(zip([cuda_backend.to_host(x) for x in gpu.run(feeds, state=s_gpu)], cpu.run(feeds, state=s_cpu)))
    states = [(cuda_backend.to_host(s_gpu[n]), s_cpu[n]) for n in s_cpu]
    return gpu, outs, states


def close(pairs):
    for got, want in pairs:
        scale = max(float(np.abs(want).max()), 1e-3)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale)


def fused_kinds(exe) -> set[str]:
    return {n.attrs["kind"] for n in exe.program.nodes() if n.op == Op.FUSED}


def test_siblings_glu_and_add_rms_norm():
    rng = np.random.default_rng(5)
    g = ingot.Graph()
    x, r = g.placeholder((3, 64), name="x"), g.placeholder((3, 64), name="r")
    a, b = g.placeholder((3, 64), name="a"), g.placeholder((3, 64), name="b")
    q, k = g.matmul(x, quantized_weight(g, 64, 48, seed=1)), g.matmul(x, quantized_weight(g, 64, 16, seed=2))
    down = g.matmul(g.silu(a) * b, quantized_weight(g, 64, 40, seed=3))
    s = x + r
    targets = [q, k, down, g.exp(g.rms_norm(s, None, 1e-5)), s * 2.0]
    feeds = {name: rng.standard_normal((3, 64)).astype(np.float32) for name in "xrab"}
    gpu, outs, _ = run_both(g, targets, feeds)
    close(outs)
    assert fused_kinds(gpu) == {"siblings", "glu_gemv", "add_rms_norm"}, fused_kinds(gpu)
    assert {"qkv", "glu_quantized_matmul", "add_rms_norm"} <= set(gpu.plan.step_names), gpu.plan.step_names


@pytest.mark.parametrize("length", [1, 3])
def test_a_decoder_step_fuses_every_kind_and_equals_the_cpu(length):
    _, feeds = tiny_llama(length)
    from ingot.models import llama
    cfg = llama.LlamaConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, context_length=32)
    model = llama.build(cfg, llama.random_weights(cfg, seed=1))
    gpu, cpu = model.compile(length, "cuda"), model.compile(length, "cpu")
    rng = np.random.default_rng(6)
    s_gpu, s_cpu = gpu.new_state(), cpu.new_state()
    for name in s_cpu:
        value = (0.5 * rng.standard_normal(s_cpu[name].shape)).astype(np.float32)
        s_gpu[name] = value
        s_cpu[name] = value
    got = cuda_backend.to_host(gpu.run(feeds, state=s_gpu)[0])
    want = cpu.run(feeds, state=s_cpu)[0]
    close([(got, want)])
    close([(cuda_backend.to_host(s_gpu[n]), s_cpu[n]) for n in s_cpu])
    kinds = fused_kinds(gpu)
    if length == 1:
        assert kinds == {"norm_gemv", "norm_gemv_glu", "attention_gemv"}, kinds
    else:
        assert {"norm_gemv", "rope_qkv_attention"} <= kinds, kinds
    assert not any(n.endswith(" as parts") for n in gpu.plan.step_names), gpu.plan.step_names


def test_gemma_geglu_runs_in_the_gemv():
    """gelu_tanh(gate) * up (Gemma's GeGLU) computed by the word GEMV as it loads x, alone (glu_gemv) and
    in a Gemma decode step behind the norm and the gate+up GEMV (norm_gemv_glu)."""
    rng = np.random.default_rng(9)
    g = ingot.Graph()
    a, b = g.placeholder((3, 64), name="a"), g.placeholder((3, 64), name="b")
    down = g.matmul(g.gelu(a, approximate="tanh") * b, quantized_weight(g, 64, 40, seed=3))
    gpu, outs, _ = run_both(g, [down], {n: rng.standard_normal((3, 64)).astype(np.float32) for n in "ab"})
    close(outs)
    assert fused_kinds(gpu) == {"glu_gemv"} and "gelu_tanh*mul into the GEMV" in gpu.plan.fusions, gpu.plan.fusions
    from ingot.models import gemma
    cfg = gemma.GemmaConfig(n_layers=2, dim=64, n_heads=2, n_kv_heads=1, ffn_dim=96, vocab_size=50, head_dim=32,
                            context_length=32, qk_norm=True, sliding_window=4, sliding_pattern=2)
    model = gemma.build(cfg, gemma.random_weights(cfg, seed=1))
    gpu, cpu = model.compile(1, "cuda"), model.compile(1, "cpu")
    feeds = {"tokens": np.array([7], np.int32), "pos": np.int32(5), "last": np.int32(0)}
    s_gpu, s_cpu = gpu.new_state(), cpu.new_state()
    for name in s_cpu:
        value = (0.5 * rng.standard_normal(s_cpu[name].shape)).astype(np.float32)
        s_gpu[name] = value
        s_cpu[name] = value
    close([(cuda_backend.to_host(gpu.run(feeds, state=s_gpu)[0]), cpu.run(feeds, state=s_cpu)[0])])
    assert "norm_gemv_glu" in fused_kinds(gpu), fused_kinds(gpu)


def test_a_lone_rope_written_into_the_cache():
    g = ingot.Graph()
    cache = g.variable(np.zeros((1, 2, 16, 8), np.float32), name="k_cache")
    k = g.placeholder((1, 2, 1, 8), name="k")
    pos = g.placeholder((), ingot.int32, name="pos")
    g.assign(cache, g.slice_update(cache, g.rope(k, pos), [0, 0, pos, 0]))
    rng = np.random.default_rng(7)
    feeds = {"k": rng.standard_normal((1, 2, 1, 8)).astype(np.float32), "pos": np.int32(4)}
    gpu, outs, states = run_both(g, [g.exp(k)], feeds, {"k_cache": rng.standard_normal((1, 2, 16, 8)).astype(np.float32)})
    close(outs + states)
    assert fused_kinds(gpu) == {"rope_kv_write"} and "rope_into_cache" in gpu.plan.step_names


def test_a_norm_feeding_a_siblings_group_is_one_gemv():
    """rms_norm -> two quantized matmuls built apart (a siblings op nested in the norm_gemv body): the
    weights come through the nested op's parameters."""
    rng = np.random.default_rng(8)
    g = ingot.Graph()
    a, b = g.placeholder((2, 64), name="a"), g.placeholder((2, 64), name="b")
    h = g.rms_norm(a + b, g.constant((1 + 0.1 * rng.standard_normal(64)).astype(np.float32)), 1e-5)
    outs = [g.matmul(h, quantized_weight(g, 64, 48, seed=4)), g.matmul(h, quantized_weight(g, 64, 32, seed=5))]
    feeds = {"a": rng.standard_normal((2, 64)).astype(np.float32), "b": rng.standard_normal((2, 64)).astype(np.float32)}
    gpu, outs_pairs, _ = run_both(g, outs, feeds)
    close(outs_pairs)
    assert fused_kinds(gpu) == {"norm_gemv"} and "add_rms_norm_gemv" in gpu.plan.step_names, gpu.plan.step_names


def test_a_package_compiled_for_the_cpu_gets_the_cuda_fusions_at_load(tmp_path):
    from ingot.models import llama
    cfg = llama.LlamaConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, context_length=32)
    cpu = llama.build(cfg, llama.random_weights(cfg, seed=1)).compile(1)
    cpu.save(tmp_path / "m.ingot")
    gpu = ingot.load(tmp_path / "m.ingot", device="cuda")
    assert fused_kinds(gpu) == {"norm_gemv", "norm_gemv_glu", "attention_gemv"}, fused_kinds(gpu)
    assert [h for h in gpu.history if h[0] == "fuse_norm_gemv"] == [("fuse_norm_gemv", True)]
    _, feeds = tiny_llama(1)
    close([(cuda_backend.to_host(gpu.run(feeds)[0]), cpu.run(feeds)[0])])


def test_two_variables_swapped_in_one_run():
    """assign(a, b) and assign(b, a): each value is taken before the other variable is written."""
    g = ingot.Graph()
    a = g.variable(np.arange(4, dtype=np.float32), name="a")
    b = g.variable(np.arange(4, dtype=np.float32) * 10, name="b")
    g.assign(a, b)
    g.assign(b, a)
    exe = g.compile(targets=[a + b], device="cuda")
    exe.run({})
    np.testing.assert_array_equal(cuda_backend.to_host(exe.state["a"]), np.arange(4, dtype=np.float32) * 10)
    np.testing.assert_array_equal(cuda_backend.to_host(exe.state["b"]), np.arange(4, dtype=np.float32))
