"""The CUDA backend against the CPU backend and the NumPy references (marker `cuda`).

Runs where torch sees a GPU (the lent device); CI has none and skips this file cleanly, also when
torch or triton is not installed. `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs the same kernels
under Triton's interpreter on the CPU (slow; for developing without a GPU).

Fresh random inputs of awkward shapes for every kernel; tolerances keyed by dtype (f32 1e-5 widened
where the kernels sum in another order over long reductions, said at each place).
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
from ingot.ir import Op  # noqa: E402
from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.backends.cuda import attention as attn  # noqa: E402
from ingot.backends.cuda import fused  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.ops import nn as nn_ops  # noqa: E402
from ingot.ops import quant as quant_ops  # noqa: E402
from ingot.options import CudaOptions  # noqa: E402

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
@pytest.mark.parametrize("rows", [1, 3, 16, 37, 131])   # 131: W dequantized for cuBLAS (prefill_dequant_rows)
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
        # the dp4a GEMV (4-bit affine, few rows) rounds x to 16-bit integers per block of 32 by default:
        # ~2e-5 relative on Gaussian x (LIMBS=3, 22 bits per tile: the float32 tolerances)
        words = qdtype.bits == 4 and not lut and rows <= qmm.WORDS_MAX_ROWS and CudaOptions().gemv_limbs < 3
        tol = 1e-4 if words else (2e-6 if rows <= qmm.GEMV_MAX_ROWS else 1e-5)
        assert rel_err(got, want) < tol, f"transpose={transpose}: relative error {rel_err(got, want)}"


@pytest.mark.parametrize("rows", [17, 40, 100])
@pytest.mark.parametrize("words", [False, True])
def test_tensor_core_gemm_splits_k_for_few_rows(rows, words):
    """Up to 128 rows the tensor-core kernel splits K (partial tiles added into a zeroed float32 y) so a
    batched decode step streams W from every multiprocessor; the sums equal the unsplit kernel's to
    float32 rounding and the float64 product of the dequantized weight, for the default split and forced
    ones (uneven: the last split shorter), and into a float16 output (a float32 staging tile)."""
    k, n = 992, 200   # 31 groups of 32
    rng = rng_for(f"splitk{rows}{words}")
    q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
    scale = rng.random((k // 32, n), dtype=np.float32) * 0.02
    bias = rng.random((k // 32, n), dtype=np.float32) * -0.02
    attrs = {"mode": "affine", "qdtype": dt.uint4, "has_bias": True, "transpose": False}
    w = qmm.prepare_weight(q, [scale, bias], attrs, DEVICE, words=words)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(DEVICE)
    want = (x.double().cpu() @ qmm.dequantize(w).double().cpu())
    assert qmm.gemm_config(rows, w, torch.float32, "tf32x3", sms=132)["SPLIT_K"] > 1
    opts = CudaOptions(prefill_dequant_rows=0, words_max_rows=1)
    for config in (None, dict(BLOCK_M=32 if rows <= 32 else 64, SPLIT_K=1), dict(BLOCK_M=64, SPLIT_K=3)):
        got = qmm.quantized_matmul(x, w, config=config, options=opts)
        assert rel_err(got.double().cpu(), want) < 1e-5, (config, rel_err(got.double().cpu(), want))
    half = torch.empty(rows, n, dtype=torch.float16, device=DEVICE)
    qmm.quantized_matmul(x, w, out=half, config=dict(BLOCK_M=64, SPLIT_K=5), options=opts)
    assert rel_err(half.double().cpu(), want) < 2e-3


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


@pytest.mark.parametrize("rows", [1, 3, 5, 16])
@pytest.mark.parametrize("fmt", FORMATS[:4], ids=[str(i) for i in range(4)])
@pytest.mark.parametrize("shape", [(96, 50, 32), (4128, 300, 32), (512, 2100, 128), (448, 1030, 64)])
def test_words_gemv(rows, fmt, shape):
    """The dp4a GEMV over the word layout, 1-16 rows, every 4-bit affine format, with its tile, row and
    split variants; the small GEMV and the tensor-core kernel on the same layout."""
    qdtype, zero_point, bias, lut = fmt
    k, n, block = shape
    rng = rng_for(f"words{fmt}{shape}{rows}")
    q, params, _ = make_weight(rng, qdtype, k, n, block, zero_point, bias, lut, False)
    plist = [params[name] for name in ("scale", "zero_point", "bias") if name in params]
    attrs = dict(qdtype=qdtype, mode="affine", has_zero_point=zero_point, has_bias=bias)
    w = qmm.prepare_weight(q, plist, attrs, DEVICE, words=True)
    assert w.words and w.q.dtype == torch.int32
    assert torch.equal(w.values(), qmm.prepare_weight(q, plist, attrs, DEVICE).values())
    x = torch.randn(rows, k, device=DEVICE)
    want = (x.double() @ qmm.dequantize(w).double())
    configs = [{}, dict(SPLIT=1), dict(ROWS=4), dict(PREFETCH=False, SPLIT=3), dict(num_warps=1, WAVES=4),
               dict(REDUCE=2), dict(TB=1), dict(TB="auto", ROWS=2), dict(TB=2, LIMBS=3)]
    # x is rounded to CudaOptions.gemv_limbs bytes: 3, 22-bit integers per tile (a few float32 roundings of
    # the tile's largest element); 2, 16 bits per block of 32 (about 2e-5 on Gaussian x); 1, 8 bits (about
    # 5e-3). tests/test_cuda_gemv_xq.py checks each against its rounding bound.
    for config in configs:
        got = qmm.quantized_matmul(x, w, config=dict(config, KERNEL="words"))
        limit = {3: 2e-6, 2: 1e-4, 1: 3e-2}[config.get("LIMBS", CudaOptions().gemv_limbs)]
        assert rel_err(got.cpu(), want.cpu()) < limit, (config, rel_err(got.cpu(), want.cpu()))
    got = qmm.quantized_matmul(x[:1], w, config=dict(KERNEL="small"))
    assert rel_err(got.cpu(), want[:1].cpu()) < 2e-6
    got = qmm.quantized_matmul(x, w, config=dict(BLOCK_M=16))
    assert rel_err(got.cpu(), want.cpu()) < 1e-5
    dense = qmm.dequantize(w)      # the cuBLAS path's copy: v * s + b, one FMA rounding on the GPU (two in torch)
    torch.testing.assert_close(qmm.dispatch.dequantize_into(w, torch.float32), dense, rtol=1e-6,
                               atol=1e-6 * float(dense.abs().max()))
    # the gated unit in the prologue and the residual in the epilogue (split-K tickets and one split)
    gate, residual = torch.randn(rows, k, device=DEVICE), torch.randn(rows, n, device=DEVICE)
    want = ((gate * torch.sigmoid(gate)) * x).double() @ qmm.dequantize(w).double() + residual.double()
    for config in ({}, dict(SPLIT=1), dict(SPLIT=5)):
        got = torch.empty(rows, n, device=DEVICE)
        qmm._words_gemv(x, w, got, dict(config), x_gate=gate, residual=residual)
        limit = {3: 2e-6, 2: 1e-4, 1: 3e-2}[CudaOptions().gemv_limbs]
        assert rel_err(got.cpu(), want.cpu()) < limit, (config, rel_err(got.cpu(), want.cpu()))


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
    assert w.scale.dtype == torch.float16


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


@pytest.mark.parametrize("case", ATTENTION[:3], ids=["0", "1", "2"])
def test_decode_attention_with_the_combine_kernel(case):
    """Both decode paths: partials then a combine kernel (many splits), and the last split merging
    the splits that saw keys (the default up to MERGE_MAX_SPLITS)."""
    b, hq, hk, tq, tk, d, length, causal = case
    rng = rng_for(f"combine{case}")
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, d)))
    want = nn_ops.sdpa(q, k, v, length=length, causal=causal)
    dev = [cuda_backend.to_device(a, DEVICE) for a in (q, k, v)]
    for merge, split in ((False, 7), (True, 7), (True, 40), (True, 1)):   # 40: most splits see no keys
        got = cuda_backend.to_host(attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=causal,
                                                  merge=merge, split=split))
        assert rel_err(got, want) < 1e-5, (merge, split, rel_err(got, want))


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


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_qkv_into_the_caches(interleaved):
    rng = rng_for(f"ropeqkv{interleaved}")
    q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 3, 1, 64)).astype(np.float32) for _ in range(2))
    caches = [rng.standard_normal((1, 3, 50, 64)).astype(np.float32) for _ in range(2)]
    inv = nn_ops.rope_inv_freq(64, 10000.0)
    pos = 37
    tk, tv = (cuda_backend.to_device(c, DEVICE) for c in caches)
    got_q = fused.rope_qkv_into(*(cuda_backend.to_device(a, DEVICE) for a in (q, k, v)),
                                torch.tensor(pos, dtype=torch.int32, device=DEVICE), cuda_backend.to_device(inv, DEVICE),
                                tk, tv, interleaved)
    p = np.int32(pos)
    np.testing.assert_allclose(cuda_backend.to_host(got_q), nn_ops.rope(q, p, inv, 10000.0, interleaved, None), rtol=1e-5, atol=1e-5)
    caches[0][:, :, pos:pos + 1] = nn_ops.rope(k, p, inv, 10000.0, interleaved, None)
    caches[1][:, :, pos:pos + 1] = v
    np.testing.assert_allclose(cuda_backend.to_host(tk), caches[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cuda_backend.to_host(tv), caches[1])


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
    zero = torch.full((3000,), float("nan"), device=DEVICE)   # the next GEMV's output, zeroed by the same launch
    got = fused.quantized_gather(w, cuda_backend.to_device(idx, DEVICE), axis, torch.float32, zero=zero)
    np.testing.assert_allclose(cuda_backend.to_host(got), want, rtol=1e-6, atol=1e-6)
    assert not zero.any().item() and not zero.isnan().any().item()


@pytest.mark.parametrize("last", [0, 3, -1])
def test_a_runtime_slice_spanning_its_axis_is_its_input(last, monkeypatch):
    """x[last:last + 1] of a one-row x: the backend clamps runtime starts (no host check), so the slice
    is x itself, any `last`: no row gather runs (index_select would raise here)."""
    g = ingot.Graph()
    x = g.placeholder((1, 70), name="x")
    i = g.placeholder((), dt.int32, name="i")
    sl = g.slice(x, [i, 0], size=[1, None])
    exe = g.compile(targets=[sl * 2.0, sl], device="cuda")
    slice_of = lambda plan: next(n for n in plan.nodes if n.op == Op.SLICE)  # noqa: E731
    assert cuda_backend.identity_slice(slice_of(exe.plan))
    xv = rng_for("wholeslice").standard_normal((1, 70)).astype(np.float32)
    xd = cuda_backend.to_device(xv, DEVICE)
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: pytest.fail("the slice gathered its row"))
    doubled, same = exe.run({"x": xd, "i": np.int32(last)})
    monkeypatch.undo()
    np.testing.assert_array_equal(cuda_backend.to_host(doubled), xv * 2)
    np.testing.assert_array_equal(cuda_backend.to_host(same), xv)
    wider = g.slice(g.placeholder((4, 70), name="y"), [i, 0], size=[1, None])   # a real row pick stays one
    assert not cuda_backend.identity_slice(slice_of(g.compile(targets=[wider], device="cuda").plan))


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


def test_greedy_decode_equals_the_cpu_backend():
    model, _ = small_llama()
    prompt = [5, 17, 250, 3, 99, 42, 7]
    cpu_tokens, cpu_logits, _ = greedy(model, "cpu", prompt, 32)
    gpu_tokens, gpu_logits, _ = greedy(model, "cuda", prompt, 32)
    assert gpu_tokens == cpu_tokens
    for a, b in zip(gpu_logits, cpu_logits):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="CUDA graphs need a GPU")
def test_decode_replays_one_cuda_graph_without_recompiling_or_allocating():
    """The decode loop: one captured graph replayed, no Triton compile, and no allocation at all (device,
    pinned host) once the logits go into a caller's buffer; fresh tensors cost one allocation a step."""
    model, cfg = small_llama(n_layers=1)
    dec = model.compile(1, "cuda")
    assert dec.plan.capturable, dec.plan.host_syncs
    state = dec.new_state()
    feeds = lambda p: {"tokens": np.array([p % cfg.vocab_size], np.int32), "pos": np.int32(p), "last": np.int32(0)}  # noqa: E731
    logits = torch.empty(tuple(dec.output_types[0].shape), device=DEVICE)
    for p in range(3):
        dec.run(feeds(p), state=state, outputs=[logits])
    torch.cuda.synchronize()
    graphs = dict(dec.plan._graphs)
    assert len(graphs) == 1
    compiled = _compiled_kernels()
    assert compiled > 0
    before = torch.cuda.memory_stats()
    host_before = _host_allocations()
    for p in range(3, 20):
        out = dec.run(feeds(p), state=state, outputs=[logits])
        assert out[0] is logits
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    assert dec.plan._graphs.keys() == graphs.keys() and all(dec.plan._graphs[k]["graph"] is graphs[k]["graph"] for k in graphs)
    assert _compiled_kernels() == compiled
    assert after["allocation.all.allocated"] == before["allocation.all.allocated"]
    assert after["segment.all.allocated"] == before["segment.all.allocated"]   # no cudaMalloc
    assert _host_allocations() == host_before
    for p in range(20, 25):  # without outputs=: one allocation per step, the logits handed to the caller
        dec.run(feeds(p), state=state)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - after["allocation.all.allocated"] == 5


def _host_allocations() -> int:
    """Pinned host allocations torch has made (0 where this torch does not count them)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return int(stats().get("num_host_alloc", 0)) if stats else 0


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


# == interop: DLPack and the caller's stream ==========================================================

def _doubler(shape):
    g = ingot.Graph()
    x = g.placeholder(shape, name="x")
    y = g.mul(x, g.constant(np.float32(2.0))) + 1.0
    return g.compile(targets=[y], device="cuda")


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="needs a GPU")
def test_dlpack_round_trip_with_torch_shares_memory():
    exe = _doubler((3, 257))
    for _ in range(3):  # eager, capture, replay
        x = torch.randn(3, 257, device=DEVICE)
        dst = torch.empty(3, 257, device=DEVICE)
        (out,) = exe.run({"x": x}, outputs=[dst])
        assert exe.plan.last_feed_pointers == {"x": x.data_ptr()}       # the feed read where it lies
        assert out.data_ptr() == dst.data_ptr()                           # the result written into the caller's array
        assert torch.from_dlpack(out).data_ptr() == dst.data_ptr()       # and handed back without a copy
        torch.testing.assert_close(dst, 2 * x + 1)
    (fresh,) = exe.run({"x": x})
    assert torch.from_dlpack(fresh.__dlpack__()).data_ptr() == fresh.data_ptr()
    torch.testing.assert_close(fresh, 2 * x + 1)


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="needs a GPU")
def test_dlpack_with_cupy():
    cp = pytest.importorskip("cupy")
    exe = _doubler((5, 33))
    for _ in range(3):
        x = cp.random.standard_normal((5, 33), dtype=cp.float32)
        dst = cp.empty((5, 33), dtype=cp.float32)
        (out,) = exe.run({"x": x}, outputs=[dst])
        assert exe.plan.last_feed_pointers == {"x": x.data.ptr}
        assert out.data_ptr() == dst.data.ptr
        cp.testing.assert_allclose(dst, 2 * x + 1, rtol=1e-6)


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="needs a GPU")
def test_dlpack_with_jax():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax sees no GPU")
    exe = _doubler((4, 9))
    x = jax.device_put(jax.numpy.arange(36, dtype=jax.numpy.float32).reshape(4, 9), gpu)
    (out,) = exe.run({"x": x})
    back = jax.dlpack.from_dlpack(out)
    assert back.unsafe_buffer_pointer() == out.data_ptr()
    np.testing.assert_allclose(np.asarray(back), 2 * np.arange(36, dtype=np.float32).reshape(4, 9) + 1)


def test_a_call_is_captured_with_the_step_and_a_rebind_captures_anew():
    """A call's executable runs inside the caller's step, so the step stays one CUDA graph (adapters on a
    decode step); the graphs are keyed by the executables bound, so after a re-bind the new one runs,
    and binding the old one back replays its graph."""
    def adapter(scale):
        g = ingot.Graph()
        return g.compile(targets=[g.placeholder((2, 4), name="h") * scale], device="cuda")

    g = ingot.Graph()
    x = g.placeholder((2, 4), name="x")
    h = g.exp(x)
    (a,) = g.call("adapter", [h], [ingot.TensorType((2, 4))])
    first, other = adapter(2.0), adapter(10.0)
    exe = g.compile(targets=[a + h], device="cuda", callables={"adapter": first})
    assert not exe.plan.host_syncs, exe.plan.host_syncs
    xv = np.zeros((2, 4), np.float32)
    for bound, want in ((first, 3.0), (other, 11.0), (first, 3.0)):
        exe.bind("adapter", bound)
        for _ in range(4):   # eager, captured, replayed
            np.testing.assert_allclose(cuda_backend.to_host(exe.run({"x": xv})[0]), np.full((2, 4), want))
    if DEVICE.type == "cuda":
        assert [e["callees"] for e in exe.plan._graphs.values()] == [(first,), (other,)]


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="needs a GPU")
def test_run_on_the_callers_stream_is_ordered_with_its_work():
    """The caller writes the feed on its stream after a long spin, without a sync; Ingot runs on that
    stream (eager, capture, replay) and must see the write. On any other stream it would read the
    old contents."""
    exe = _doubler((1 << 20,))
    x = torch.zeros(1 << 20, device=DEVICE)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    for value in (3.0, 5.0, 7.0, 11.0):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # tens of milliseconds of spinning ahead of the write
            x.fill_(value)
        (out,) = exe.run({"x": x}, stream=stream)
        stream.synchronize()
        assert torch.all(out == 2 * value + 1), (value, out[:4])
    assert exe.plan._graphs, "the replays ran through a captured graph"
    cp = pytest.importorskip("cupy")  # a CuPy stream works as well
    cstream = cp.cuda.Stream(non_blocking=True)
    with torch.cuda.stream(torch.cuda.ExternalStream(cstream.ptr)):
        torch.cuda._sleep(20_000_000)
        x.fill_(13.0)
    (out,) = exe.run({"x": x}, stream=cstream)
    cstream.synchronize()
    assert torch.all(out == 27.0)
