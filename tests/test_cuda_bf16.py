"""Dense bfloat16 weights on the CUDA backend (marker `cuda`): matmul(x, cast(W_bf16, float32)) multiplies
the bf16 W where it lies (no float32 copy of W, the cast not lowered) and agrees with the CPU backend.

Runs where torch sees a GPU; CI has none and skips this file cleanly, also when torch or triton is
not installed. `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it on the CPU (torch's bf16 GEMM).

Tolerance: the device rounds x to bf16 before the GEMM (float32 accumulation), a relative error of
up to 2^-9 per element of x; summed over K terms of random sign that leaves the product about 1e-3
relative (L2) from the float32 one, plus at most one more bf16 rounding of y where torch.mm has no
out_dtype. We bound it at 1e-2 relative: the bf16 tolerance of STYLE.md, ~5x the expected error.
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

import ingot  # noqa: E402
from ingot import dtypes as dt  # noqa: E402
from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.ir import Op  # noqa: E402
from ingot.models import llama  # noqa: E402

BF16 = dt.bfloat16.storage
RNG = np.random.default_rng()      # fresh inputs every run
SEED = int(RNG.integers(1 << 31))
print(f"test_cuda_bf16 seed {SEED}")
REL = 1e-2                          # bf16-rounded x: see the module docstring


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def bf16_matmul_graph(shape_x, w: np.ndarray):
    g = ingot.Graph()
    x = g.placeholder(shape_x, name="x")
    y = g.matmul(x, g.cast(g.constant(w, name="w"), dt.float32))
    return g, y


def assert_no_float_copy(exe, weight_shapes) -> None:
    """The plan neither lowers the weight's cast nor holds (or caches) a float32 tensor of a weight's shape."""
    plan = exe.plan
    weight_casts = {plan.slot[n.id] for n in exe.program.nodes() if n.op == Op.CAST and n.src[0].op == Op.CONSTANT}
    assert weight_casts
    computed = {s for _, _, outs, _ in plan.steps for s in outs}
    assert not weight_casts & computed, "a weight's cast to float32 was lowered"
    mine = {id(a) for a in exe.program.constants.values()}  # this program's entries of the device constant cache
    cached = [t for key, t in cuda_backend._DEVICE_CONSTANTS.items() if key[0] in mine and isinstance(t, torch.Tensor)]
    held = [t for t in plan.initial if isinstance(t, torch.Tensor)] + cached
    shapes = {tuple(s) for s in weight_shapes}
    copies = [tuple(t.shape) for t in held if t.dtype == torch.float32 and tuple(t.shape) in shapes]
    assert not copies, copies
    assert any(t.dtype == torch.bfloat16 and tuple(t.shape) in shapes for t in cached)


@pytest.mark.parametrize("m,k,n", [(1, 1823, 781), (7, 333, 65), (33, 64, 1), (2, 1, 17)])
def test_bf16_weight_matmul_equals_cpu(m, k, n):
    rng = np.random.default_rng([SEED, m, k, n])
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(BF16)
    x = rng.standard_normal((m, k)).astype(np.float32)
    g, y = bf16_matmul_graph((m, k), w)
    want = g.compile(targets=[y], device="cpu").run({"x": x})[0]
    np.testing.assert_allclose(want, x @ w.astype(np.float32), rtol=1e-5, atol=1e-5)  # the CPU: float32 product
    exe = g.compile(targets=[y], device="cuda")
    got = cuda_backend.to_host(exe.run({"x": x})[0])
    assert got.shape == (m, n) and got.dtype == np.float32
    assert rel_err(got, want) < REL, rel_err(got, want)
    assert [s for s in exe.plan.step_names if s != "matmul"] == []
    assert_no_float_copy(exe, [(k, n)])


def test_bf16_weight_matmul_batched_x():
    """x [B, T, K] @ W [K, N]: the GEMM flattens the leading axes."""
    rng = np.random.default_rng([SEED, 1])
    w = rng.standard_normal((40, 24)).astype(BF16)
    x = rng.standard_normal((3, 5, 40)).astype(np.float32)
    g, y = bf16_matmul_graph((3, 5, 40), w)
    got = cuda_backend.to_host(g.compile(targets=[y], device="cuda").run({"x": x})[0])
    assert got.shape == (3, 5, 24)
    assert rel_err(got, x @ w.astype(np.float32)) < REL


def test_a_cast_with_another_reader_is_still_computed():
    """cast(W) read by a matmul and by an add: the add needs the float32 values, so the cast runs."""
    rng = np.random.default_rng([SEED, 2])
    w = rng.standard_normal((16, 16)).astype(BF16)
    g = ingot.Graph()
    x = g.placeholder((4, 16), name="x")
    wf = g.cast(g.constant(w, name="w"), dt.float32)
    y, z = g.matmul(x, wf), wf + 1.0
    xv = rng.standard_normal((4, 16)).astype(np.float32)
    y_got, z_got = (cuda_backend.to_host(v) for v in g.compile(targets=[y, z], device="cuda").run({"x": xv}))
    assert rel_err(y_got, xv @ w.astype(np.float32)) < REL
    np.testing.assert_array_equal(z_got, w.astype(np.float32) + 1)


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="device memory counters need a GPU")
def test_no_float32_copy_of_the_weight_in_device_memory():
    """A 64 MiB bf16 weight: compiling and running adds its bf16 upload and small buffers, never the
    128 MiB of a float32 copy (not even transiently: the peak is checked)."""
    k, n = 4096, 8192
    w = np.zeros((k, n), BF16)
    g, y = bf16_matmul_graph((2, k), w)
    a = torch.ones((2, 64), dtype=torch.bfloat16, device="cuda")
    a @ a.T                          # cuBLAS's workspace (32 MiB on Hopper, from the caching allocator) first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    exe = g.compile(targets=[y], device="cuda")
    for _ in range(3):
        exe.run({"x": np.ones((2, k), np.float32)})
    torch.cuda.synchronize()
    weight_bytes = k * n * 2
    # a float32 copy would add 2 x weight_bytes (128 MiB); allow small buffers and a second workspace
    assert torch.cuda.max_memory_allocated() - base < weight_bytes + (40 << 20)
    assert_no_float_copy(exe, [(k, n)])


# == a tiny bf16 decoder, CUDA against the CPU backend ================================================

def tiny_bf16_llama(tied: bool):
    cfg = llama.LlamaConfig(n_layers=2, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                            context_length=64, tied_embeddings=tied)
    return llama.build(cfg, llama.random_weights(cfg, seed=SEED % 1000, dense_dtype="bfloat16")), cfg


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_decode_equals_the_cpu_backend(tied):
    model, cfg = tiny_bf16_llama(tied)
    prompt = [5, 17, 250, 3, 99, 42, 7]
    cpu_tokens, cpu_logits, _ = greedy(model, "cpu", prompt, 8)
    gpu_tokens, gpu_logits, dec = greedy(model, "cuda", prompt, 8, forced=cpu_tokens)  # same inputs every step
    for a, b in zip(gpu_logits, cpu_logits):
        assert a.shape == b.shape == (1, cfg.vocab_size)
        assert rel_err(a, b) < 2e-2, rel_err(a, b)
    # greedy agrees wherever the CPU's top-2 margin is larger than the device's error could flip
    for step, b in enumerate(cpu_logits[:-1]):
        top2 = np.sort(b[0])[-2:]
        if top2[1] - top2[0] > 4e-2 * float(np.abs(b).max()):
            assert int(np.argmax(gpu_logits[step])) == cpu_tokens[step], step
    matrices = [v for k, v in llama.random_weights(cfg, seed=SEED % 1000, dense_dtype="bfloat16").items()
                if v.dtype == BF16]
    shapes = [w.shape[::-1] for w in matrices]
    shapes += [(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim), (cfg.dim, 2 * cfg.ffn_dim)]
    assert_no_float_copy(dec, shapes)
    if not _INTERPRET:
        assert dec.plan.capturable, dec.plan.host_syncs   # the bf16 GEMMs keep decode one CUDA graph
    weight_casts = [n for n in dec.program.nodes() if n.op == Op.CAST and n.src[0].op == Op.CONSTANT]
    assert weight_casts and all(n.src[0].dtype == dt.bfloat16 for n in weight_casts)
