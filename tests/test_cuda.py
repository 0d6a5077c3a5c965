"""The CUDA backend against the CPU backend and the NumPy references (marker `cuda`).

Runs where torch sees a GPU (the lent device); CI has none and skips this file cleanly, also when
torch or triton is not installed. `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs the same kernels
under Triton's interpreter on the CPU (slow; for developing without a GPU).

Fresh random inputs of awkward shapes for every kernel; tolerances keyed by dtype (f32 1e-5 widened
where the kernels sum in another order over long reductions, said at each place).
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

_HAVE = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("triton") is not None
if _HAVE:
    import torch
    _INTERPRET = os.environ.get("INGOT_CUDA_DEVICE") == "cpu"
    _HAVE = _INTERPRET or torch.cuda.is_available()
if not _HAVE:
    pytest.skip("needs torch, triton and a CUDA GPU (or INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1)", allow_module_level=True)

import ingot  # noqa: E402
from ingot import dtypes as dt  # noqa: E402
from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.backends.cuda import attention as attn  # noqa: E402
from ingot.backends.cuda import fused  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.ops import nn as nn_ops  # noqa: E402
from ingot.ops import quant as quant_ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import test_ops  # noqa: E402  (the op table and its independent references)

DEVICE = torch.device(cuda_backend.device_name())
RNG = np.random.default_rng()      # fresh inputs every run (METHOD.md: the fast path must be right on any input)
SEED = int(RNG.integers(1 << 31))
print(f"test_cuda seed {SEED}")


def skip_bf16_in_interpreter(dtype) -> None:
    if _INTERPRET and "bfloat16" in str(dtype):
        pytest.skip("Triton's interpreter mishandles bfloat16 (the GPU run checks it)")


def rng_for(tag: str) -> np.random.Generator:
    return np.random.default_rng([SEED, test_ops.seed_of(tag)])


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# == every op of the table on the device ==============================================================

@pytest.mark.parametrize("case", test_ops.CASES, ids=[c.id for c in test_ops.CASES])
def test_op_table_on_cuda(case):
    skip_bf16_in_interpreter(case.id)
    rng = np.random.default_rng([SEED, test_ops.seed_of(case.id)])
    made = [test_ops.make_input(inp, rng) for inp in case.inputs]
    g = ingot.Graph()
    xs = [g.placeholder(inp.shape, inp.dtype, name=f"in{k}") for k, inp in enumerate(case.inputs)]
    built = case.build(g, *xs)
    outs = list(built) if isinstance(built, (list, tuple)) else [built]
    exe = g.compile(targets=outs, device="cuda")
    got = exe.run({f"in{k}": feed for k, (feed, _) in enumerate(made) if f"in{k}" in exe.feed_types})
    got = [cuda_backend.to_host(x) for x in got]
    want = case.reference(*[logical for _, logical in made])
    wants = list(want) if isinstance(want, (list, tuple)) else [want]
    dtypes = case.out if isinstance(case.out, tuple) else (case.out or case.inputs[0].dtype,) * len(outs)
    for i, (actual, expected, dtype) in enumerate(zip(got, wants, dtypes)):
        tol = case.tol if case.tol is not None else test_ops.TOLERANCE.get(dtype.name, 0.0)
        if dtype.name == "float32" and case.id.startswith(("matmul", "quantized_matmul", "sdpa")):
            tol = max(tol, 1e-4)  # long reductions summed in another order (and tf32x3 tiles)
        test_ops.check(actual, expected, dtype, tol, f"{case.id} output {i}", case.atol_by_scale)


# == quantized matmul =================================================================================

FORMATS = [  # (qdtype, zero_point, bias, lut)
    (dt.uint4, False, True, False), (dt.int4, False, False, False), (dt.int4, True, False, False),
    (dt.uint4, True, True, False), (dt.int8, False, False, False), (dt.uint8, True, False, False),
    (dt.int8, False, True, False), (dt.uint4, False, False, True), (dt.int4, False, False, True),
    (dt.uint8, False, False, True), (dt.int8, False, False, True),
]
SHAPES = [  # (K, N, block along K or None for per-column)
    (96, 50, 32), (200, 18, None), (72, 130, 24), (1000, 66, 40), (64, 256, 64), (130, 34, 10),
]


def make_weight(rng, qdtype, k, n, block, zero_point, bias, lut, transpose):
    """Ingot-layout arrays for dequantize(q, ...) of a logical [K, N] (or [N, K] if transpose) weight."""
    lo, hi = test_ops.INT_RANGE[qdtype.name]
    rows, cols = (n, k) if transpose else (k, n)
    values = rng.integers(lo, hi + 1, size=(rows, cols))
    q = dt.pack_int4(values) if qdtype.packed else values.astype(qdtype.numpy)
    nb = 1 if block is None else k // block
    pshape = (n, nb) if transpose else (nb, n)
    params = {}
    if lut:
        groups = (3, 1) if not transpose and k % 3 == 0 else (1, 1)
        table = rng.standard_normal(groups + (2 ** qdtype.bits,)).astype(np.float32) * 0.1
        params["lut"] = table
    else:
        params["scale"] = (rng.random(pshape) * 0.05 + 0.01).astype(np.float32)
        if zero_point:
            params["zero_point"] = rng.integers(lo, hi + 1, size=pshape).astype(np.float32)
        if bias:
            params["bias"] = (rng.standard_normal(pshape) * 0.1).astype(np.float32)
    return q, params, (rows, cols)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f"{f[0].name}{'-zp' if f[1] else ''}{'-bias' if f[2] else ''}{'-lut' if f[3] else ''}"
                                              for f in FORMATS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}b{b}" for k, n, b in SHAPES])
@pytest.mark.parametrize("rows", [1, 3, 16, 37])
def test_quantized_matmul_matches_the_cpu_backend(fmt, shape, rows):
    qdtype, zero_point, bias, lut = fmt
    k, n, block = shape
    if lut and (block is None or k % block):
        block = None
    for transpose in (False, True):
        rng = rng_for(f"qmm{fmt}{shape}{rows}{transpose}")
        q, params, qshape = make_weight(rng, qdtype, k, n, block, zero_point, bias, lut, transpose)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        g = ingot.Graph()
        xp = g.placeholder((rows, k), name="x")
        qc = g.constant(q, dtype=qdtype if qdtype.packed else None)
        if lut:
            w = g.dequantize(qc, lut=g.constant(params["lut"]))
        else:
            w = g.dequantize(qc, **{name: g.constant(p) for name, p in params.items()})
        y = g.matmul(xp, g.transpose(w) if transpose else w)
        got = cuda_backend.to_host(g.compile(targets=[y], device="cuda").run({"x": x})[0])
        want = g.compile(targets=[y], device="cpu").run({"x": x})[0]
        assert got.shape == want.shape == (rows, n)
        assert rel_err(got, want) < 2e-6 if rows <= qmm.GEMV_MAX_ROWS else rel_err(got, want) < 1e-5, \
            f"transpose={transpose}: relative error {rel_err(got, want)}"


@pytest.mark.parametrize("kernel", ["small", "stream"])
@pytest.mark.parametrize("fmt", FORMATS, ids=[str(i) for i in range(len(FORMATS))])
@pytest.mark.parametrize("shape", [(96, 50, 32), (1000, 66, 40), (130, 34, 10), (512, 2100, 128)])
def test_both_gemv_kernels(kernel, fmt, shape):
    """Each GEMV kernel on every format, whatever size would pick it in the wrapper."""
    qdtype, zero_point, bias, lut = fmt
    k, n, block = shape
    rng = rng_for(f"gemv{kernel}{fmt}{shape}")
    q, params, _ = make_weight(rng, qdtype, k, n, None if lut and k % block else block, zero_point, bias, lut, False)
    plist = [params["lut"]] if lut else [params[name] for name in ("scale", "zero_point", "bias") if name in params]
    attrs = dict(qdtype=qdtype, mode="lut" if lut else "affine", has_zero_point=zero_point, has_bias=bias)
    w = qmm.prepare_weight(q, plist, attrs, DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    want = quant_ops.quantized_matmul_reference([cuda_backend.to_host(x), q] + plist, dict(attrs, dtype=dt.float32))
    got = cuda_backend.to_host(qmm.quantized_matmul(x, w, config=dict(KERNEL=kernel)))
    assert rel_err(got, want) < 2e-6, rel_err(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_gemm_half_inputs(dtype):
    skip_bf16_in_interpreter(dtype)
    rng = rng_for(f"qgemm{dtype}")
    k, n, rows = 320, 200, 70
    q, params, _ = make_weight(rng, dt.uint4, k, n, 32, False, True, False, False)
    w = qmm.prepare_weight(q, [params["scale"], params["bias"]],
                           dict(qdtype=dt.uint4, mode="affine", has_bias=True), DEVICE)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    got = qmm.quantized_matmul(x, w).float()
    want = x.float() @ qmm.dequantize(w)
    assert rel_err(got.cpu(), want.cpu()) < 1e-2


def test_quantized_weight_f16_params_only_when_exact():
    rng = rng_for("f16params")
    q, params, _ = make_weight(rng, dt.uint4, 64, 16, 32, False, True, False, False)
    w = qmm.prepare_weight(q, [params["scale"], params["bias"]], dict(qdtype=dt.uint4, mode="affine", has_bias=True), DEVICE)
    assert w.scale.dtype == torch.float32  # random f32 scales do not fit f16
    s16 = params["scale"].astype(np.float16).astype(np.float32)
    w = qmm.prepare_weight(q, [s16, s16], dict(qdtype=dt.uint4, mode="affine", has_bias=True), DEVICE)
    assert w.scale.dtype == torch.float16 or not qmm.PARAMS_F16


# == attention ========================================================================================

ATTENTION = [  # (B, Hq, Hk, Tq, Tk, D, length, causal)
    (1, 9, 3, 1, 37, 64, 20, True), (2, 6, 2, 1, 300, 24, 300, False), (1, 4, 4, 5, 77, 64, 40, True),
    (1, 8, 2, 70, 70, 48, 70, True), (2, 3, 1, 33, 129, 128, 100, False), (1, 2, 1, 1, 1000, 80, 999, True),
    (1, 6, 3, 130, 200, 32, 190, True), (1, 4, 2, 7, 64, 16, 1, True),
]


@pytest.mark.parametrize("case", ATTENTION, ids=["b{}-h{}/{}-q{}-k{}-d{}-len{}-{}".format(*c) for c in ATTENTION])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("length_on_device", [True, False])
def test_attention_matches_the_reference(case, dtype, length_on_device):
    skip_bf16_in_interpreter(dtype)
    b, hq, hk, tq, tk, d, length, causal = case
    rng = rng_for(f"attn{case}{dtype}")
    npd = {"float32": np.float32, "float16": np.float16, "bfloat16": dt.bfloat16.storage}[dtype]
    q = rng.standard_normal((b, hq, tq, d)).astype(npd)
    k = rng.standard_normal((b, hk, tk, d)).astype(npd)
    v = rng.standard_normal((b, hk, tk, d)).astype(npd)
    want = nn_ops.sdpa(q, k, v, length=length, causal=causal).astype(np.float32)
    tq_, tk_, tv_ = (cuda_backend.to_device(a, DEVICE) for a in (q, k, v))
    ln = torch.tensor(length, dtype=torch.int32, device=DEVICE) if length_on_device else length
    got = cuda_backend.to_host(attn.attention(tq_, tk_, tv_, length=ln, causal=causal)).astype(np.float32)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
    assert got.shape == want.shape
    assert rel_err(got, want) < tol, rel_err(got, want)


def test_attention_with_mask_and_scale():
    rng = rng_for("mask")
    q = rng.standard_normal((2, 4, 19, 40)).astype(np.float32)
    k = rng.standard_normal((2, 2, 23, 40)).astype(np.float32)
    v = rng.standard_normal((2, 2, 23, 40)).astype(np.float32)
    mask = rng.random((2, 1, 19, 23)) < 0.7
    mask[0, 0, 3] = False  # a row that sees no key: zeros
    want = nn_ops.sdpa(q, k, v, mask=mask, scale=0.3)
    dev = [cuda_backend.to_device(a, DEVICE) for a in (q, k, v, mask)]
    got = cuda_backend.to_host(attn.attention(*dev[:3], scale=0.3, mask=dev[3]))
    assert np.all(got[0, :, 3] == 0)
    assert rel_err(got, want) < 1e-5


# == fused kernels ====================================================================================

@pytest.mark.parametrize("rows, d", [(1, 576), (7, 100), (3, 4096), (5, 1)])
def test_rms_norm_and_add_rms_norm(rows, d):
    rng = rng_for(f"rms{rows}{d}")
    a, b = (rng.standard_normal((rows, d)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(d).astype(np.float32)
    ta, tb, tw = (cuda_backend.to_device(x, DEVICE) for x in (a, b, w))
    got = cuda_backend.to_host(fused.rms_norm(ta, tw, 1e-5))
    assert rel_err(got, nn_ops.rms_norm(a, w, 1e-5)) < 1e-6
    total, normed = fused.add_rms_norm(ta, tb, tw, 1e-6)
    np.testing.assert_array_equal(cuda_backend.to_host(total), a + b)
    assert rel_err(cuda_backend.to_host(normed), nn_ops.rms_norm(a + b, w, 1e-6)) < 1e-6


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape, rotary, positions", [((1, 9, 1, 64), None, 2047), ((2, 3, 5, 24), 16, 7),
                                                      ((4, 17, 10), None, "vector"), ((1, 2, 3, 6), 2, 0)])
def test_rope(interleaved, shape, rotary, positions):
    rng = rng_for(f"rope{shape}{rotary}{positions}{interleaved}")
    x = rng.standard_normal(shape).astype(np.float32)
    rd = rotary or shape[-1]
    inv = nn_ops.rope_inv_freq(rd, 10000.0)
    pos = rng.integers(0, 5000, shape[-2]).astype(np.int32) if positions == "vector" else np.int32(positions)
    want = nn_ops.rope(x, pos, inv, 10000.0, interleaved, rotary)
    got = fused.rope(cuda_backend.to_device(x, DEVICE), cuda_backend.to_device(pos, DEVICE),
                     cuda_backend.to_device(inv, DEVICE), interleaved)
    np.testing.assert_allclose(cuda_backend.to_host(got), want, rtol=1e-5, atol=1e-5)


def test_slice_write_at_device_starts():
    rng = rng_for("slicewrite")
    cache = rng.standard_normal((2, 3, 50, 7)).astype(np.float32)
    update = rng.standard_normal((2, 3, 4, 7)).astype(np.float32)
    t = cuda_backend.to_device(cache, DEVICE)
    ptr = t.data_ptr()
    fused.slice_write(t, cuda_backend.to_device(update, DEVICE), [0, 0, torch.tensor(31, device=DEVICE), 0])
    cache[:, :, 31:35] = update
    assert t.data_ptr() == ptr
    np.testing.assert_array_equal(cuda_backend.to_host(t), cache)


@pytest.mark.parametrize("fmt", FORMATS[:8], ids=[str(i) for i in range(8)])
@pytest.mark.parametrize("axis", [0, 1])
def test_quantized_gather(fmt, axis):
    qdtype, zero_point, bias, lut = fmt
    rng = rng_for(f"qgather{fmt}{axis}")
    k, n = 96, 50
    q, params, _ = make_weight(rng, qdtype, k, n, None if lut else 32, zero_point, bias, lut, False)
    idx = rng.integers(0, (n if axis == 1 else k), size=(2, 5)).astype(np.int32)
    attrs = dict(qdtype=qdtype, dtype=dt.float32, mode="lut" if lut else "affine", has_zero_point=zero_point,
                 has_bias=bias, axis=axis)
    plist = [params["lut"]] if lut else [params[name] for name in ("scale", "zero_point", "bias") if name in params]
    want = quant_ops.quantized_gather_reference([q] + plist + [idx], attrs)
    w = qmm.prepare_weight(q, plist, dict(attrs, transpose=False), DEVICE)
    got = fused.quantized_gather(w, cuda_backend.to_device(idx, DEVICE), axis, torch.float32)
    np.testing.assert_allclose(cuda_backend.to_host(got), want, rtol=1e-6, atol=1e-6)


def test_generated_region_kernel_silu_mul():
    g = ingot.Graph()
    a = g.placeholder((3, 1537), name="a")
    b = g.placeholder((3, 1537), name="b")
    y = g.silu(a) * b + 1.5
    exe = g.compile(targets=[y], device="cuda")
    assert any(f.startswith("region") for f in exe.plan.fusions), exe.plan.fusions
    rng = rng_for("region")
    av, bv = (rng.standard_normal((3, 1537)).astype(np.float32) for _ in range(2))
    got = cuda_backend.to_host(exe.run({"a": av, "b": bv})[0])
    np.testing.assert_allclose(got, av / (1 + np.exp(-av)) * bv + 1.5, rtol=1e-5, atol=1e-6)


# == the decoder end to end ===========================================================================

def small_llama(n_layers=2, context=96, seed=0):
    from ingot.models import llama
    cfg = llama.LlamaConfig(n_layers=n_layers, dim=96, n_heads=6, n_kv_heads=2, ffn_dim=160, vocab_size=300,
                            context_length=context, tied_embeddings=True)
    return llama.build(cfg, llama.random_weights(cfg, seed=seed)), cfg


def greedy(model, device, prompt, steps):
    pre = model.compile(len(prompt), device)
    dec = model.compile(1, device)
    state = dec.new_state()
    host = dec.backend.to_host
    logits = host(pre.run({"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(len(prompt) - 1)},
                          state=state)[0])
    tokens, all_logits = [], [logits]
    for i in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = host(dec.run({"tokens": np.array([tokens[-1]], np.int32), "pos": np.int32(len(prompt) + i),
                               "last": np.int32(0)}, state=state)[0])
        all_logits.append(logits)
    return tokens, all_logits


def test_greedy_decode_equals_the_cpu_backend():
    model, _ = small_llama()
    prompt = [5, 17, 250, 3, 99, 42, 7]
    cpu_tokens, cpu_logits = greedy(model, "cpu", prompt, 32)
    gpu_tokens, gpu_logits = greedy(model, "cuda", prompt, 32)
    assert gpu_tokens == cpu_tokens
    for a, b in zip(gpu_logits, cpu_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="CUDA graphs need a GPU")
def test_decode_replays_one_cuda_graph_without_recompiling_or_allocating():
    model, cfg = small_llama(n_layers=1)
    dec = model.compile(1, "cuda")
    assert dec.plan.capturable, dec.plan.host_syncs
    state = dec.new_state()
    feeds = lambda p: {"tokens": np.array([p % cfg.vocab_size], np.int32), "pos": np.int32(p), "last": np.int32(0)}  # noqa: E731
    for p in range(3):
        dec.run(feeds(p), state=state)
    torch.cuda.synchronize()
    graphs = dict(dec.plan._graphs)
    compiled = _compiled_kernels()
    assert compiled > 0
    allocated = torch.cuda.memory_stats()["num_alloc_retries"], torch.cuda.memory_stats()["allocation.all.allocated"]
    for p in range(3, 20):
        dec.run(feeds(p), state=state)
    torch.cuda.synchronize()
    assert dec.plan._graphs.keys() == graphs.keys() and all(dec.plan._graphs[k]["graph"] is graphs[k]["graph"] for k in graphs)
    assert _compiled_kernels() == compiled
    after = torch.cuda.memory_stats()
    # one allocation per step remains: the clone of the logits handed to the caller
    assert after["allocation.all.allocated"] - allocated[1] <= 17 * len(dec.output_types)


def _compiled_kernels() -> int:
    """How many kernel binaries Triton holds for our kernels (a recompile adds one)."""
    from triton.runtime.jit import JITFunction
    total = 0
    for module in (qmm, attn, fused):
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", None)
                if caches is not None:
                    total += sum(len(entry[0]) for entry in caches.values())
                else:
                    total += sum(len(c) for c in getattr(fn, "cache", {}).values())
    return total


def test_state_is_on_the_device_and_dlpack_feeds_share_memory():
    g = ingot.Graph()
    x = g.placeholder((4, 5), name="x")
    acc = g.variable(np.zeros((4, 5), np.float32), name="acc")
    g.assign(acc, acc + x)
    y = acc + x
    exe = g.compile(targets=[y], device="cuda")
    assert isinstance(exe.state["acc"], torch.Tensor) and exe.state["acc"].device.type == DEVICE.type
    feed = torch.ones((4, 5), device=DEVICE)
    out = exe.run({"x": feed})[0]
    assert torch.equal(out, feed)
    out = exe.run({"x": feed})[0]
    assert torch.equal(out, 2 * feed)
