"""`CudaOptions.prefill_precision="f16"`: the prefill's GEMMs and flash attention round their float32
operands to float16 (11 bits where bfloat16 keeps 8) and sum in float32; the GEMMs first scale each row
of x by a power of two where its largest |x| is outside [2^-6, 2^15) (float16's range and its normal
numbers; quantized_matmul/half_rows.py) (marker `cuda`).

Every route a many-row GEMM takes (the word GEMM, the tile kernel, dequantize + cuBLAS, the scaled-table
kernel) against float64 on awkward shapes, with one row of x at 1e6 (float16 overflows there without the
scaling), one at 1e-6 (subnormal float16: 6 % off without it) and one of zeros. Flash attention and a
Llama graph's prefill under "f16": test_cuda_prefill_bf16.py, beside bf16's.
Bounds: float16 operands carry 2^-11 each, about 2e-4 relative (L2) over K random-sign products; bounded
at 2e-3, and each case must also beat bf16's rounding of the same operands by 3x (a kernel that fell back
to bf16 dots fails).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

if require_cuda():
    pytest.skip("float16 and bfloat16 dots need a GPU (Triton's interpreter computes bf16 dots wrongly)",
                allow_module_level=True)
import torch  # noqa: E402

from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import attention as attn  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.backends.cuda.quantized_matmul import dispatch  # noqa: E402
from ingot.backends.cuda.quantized_matmul.half_rows import half_rows, unscale_rows_  # noqa: E402
from ingot.backends.cuda.quantized_matmul.weights import dequantize  # noqa: E402
from ingot.options import CompileOptions, CudaOptions  # noqa: E402

from test_cuda_prefill_bf16 import F16_REL as REL, SEED, rel  # noqa: E402  (the seed printed there)


def awkward_x(m: int, k: int, seed) -> torch.Tensor:
    """Random rows, with row 1 scaled by 1e6 (past float16's 65504), row 2 zeros and row 3 at 1e-6."""
    g = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng(seed).integers(1 << 31)))
    x = torch.randn(m, k, device="cuda", generator=g)
    x[1] *= 1e6
    x[2] = 0.0
    x[3] *= 1e-6
    return x


def check_rows(got: torch.Tensor, want: torch.Tensor, bf16: torch.Tensor | None = None) -> None:
    """Each row of got within REL of want's (the 1e6 and 1e-6 rows as well as the rest; zeros exact),
    and the whole clearly closer than bf16's."""
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    for r in (0, 1, 3, got.shape[0] - 1):
        assert rel(got[r], want[r]) < REL, r
    assert rel(got, want) < REL
    if bf16 is not None:
        assert rel(got, want) * 3 < rel(bf16, want), (rel(got, want), rel(bf16, want))


def test_half_rows_scales_only_rows_past_the_range():
    x = awkward_x(37, 1000, [SEED, 0])
    x[5, 999] = 40000.0                  # within float16's range, past 2^15: scaled by 1/2
    x[6] = 0.01                          # below 2^-6: scaled up
    x16, inv = half_rows(x)
    assert x16.dtype == torch.float16 and torch.isfinite(x16).all()
    assert float(x16.float().abs().max()) < 2**15
    for r in (1, 3, 6):                  # the largest value of a scaled row lands in [2^14, 2^15)
        assert 2**14 <= float(x16[r].float().abs().max()) < 2**15, r
        assert float(inv[r]) == 2.0 ** (np.frexp(float(x[r].abs().max()))[1] - 1 - 14), r
    assert float(inv[5]) == 2.0 and float(inv[2]) == 1.0 and float(inv[0]) == 1.0 and float(inv[4]) == 1.0
    assert torch.all(torch.log2(inv) == torch.round(torch.log2(inv)))         # powers of two: exact
    back, x64 = x16.double() * inv.double()[:, None], x.double()   # rounded to 11 bits (subnormals: 2^-25)
    assert torch.all((back - x64).abs() <= torch.maximum(2**-11 * x64.abs(), 2**-25 * inv.double()[:, None]))
    y = torch.randn(37, 300, device="cuda")
    want = y * inv[:, None]
    assert torch.equal(unscale_rows_(y, inv), want)


@pytest.mark.parametrize("words", [True, False])
@pytest.mark.parametrize("m,k,n,block", [(17, 96, 80, 32), (40, 4096, 384, 64), (100, 4096, 700, 32),
                                          (130, 200, 66, 8), (513, 320, 1030, 32)])
def test_gemm_f16_against_float64(words, m, k, n, block):
    """Word layout: the word GEMM to 128 rows, then dequantize + cuBLAS; k-major: the tile kernel below
    prefill_dequant_rows (64), then cuBLAS. Forced tile kernel and word-GEMM splits as well."""
    rng = np.random.default_rng([SEED, m, k, n])
    q = rng.integers(0, 256, (k, (n + 1) // 2), dtype=np.uint8)
    scale = rng.random((k // block, n), dtype=np.float32) * 0.02
    bias = -rng.random((k // block, n), dtype=np.float32) * 0.02
    w = qmm.prepare_weight(q, [scale, bias], dict(mode="affine", qdtype=dt.uint4, has_bias=True), "cuda", words=words)
    x = awkward_x(m, k, [SEED, m, k])
    want = x.double() @ dequantize(w).double()
    check_rows(qmm.quantized_matmul(x, w, precision="f16"), want, qmm.quantized_matmul(x, w, precision="bf16"))
    check_rows(qmm.quantized_matmul(x, w, precision="f16", config={"BLOCK_M": 16 if m < 64 else 64}), want)
    if words and m <= 128:
        for split in (1, 7):
            y = torch.full((m, n), float("nan"), device="cuda")
            dispatch._words_gemm(x, w, y, {"SPLIT_K": split, "BLOCK_N": 64 if split == 1 else 256}, "f16")
            check_rows(y, want)


@pytest.mark.parametrize("rows", [7, 130])
def test_scaled_table_gemm_f16(rows):
    """A scaled lookup table (GGUF's IQ types) through a compiled graph under the option."""
    from ingot.graph import Graph

    rng = np.random.default_rng([SEED, rows])
    k, n, block = 96, 74, 32
    q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
    lut = (rng.random(16) * 2 - 1).astype(np.float32)
    scale = (rng.random((k // block, n)) * 0.2 - 0.1).astype(np.float32)
    g = Graph()
    wt = g.dequantize(g.constant(q, dtype=dt.uint4), lut=g.constant(lut), scale=g.constant(scale))
    y = g.matmul(g.placeholder((rows, k), dt.float32, name="x"), wt)
    x = awkward_x(rows, k, [SEED, rows, 1])
    w = lut[dt.unpack_int4(q, n, signed=False)] * np.repeat(scale, block, axis=0)
    want = torch.as_tensor(x.double().cpu().numpy() @ w.astype(np.float64))
    got = {}
    for p in ("f16", "bf16"):
        exe = g.compile(targets=[y], device="cuda", options=CompileOptions(cuda=CudaOptions(prefill_precision=p)))
        got[p] = torch.as_tensor(exe.backend.to_host(exe.run({"x": x.cpu().numpy()})[0]))
    check_rows(got["f16"], want, got["bf16"])


def test_f16_over_a_bf16_cache_keeps_bf16_dots():
    """The option over a bfloat16 cache: the bf16 dots (float16 could not hold every bfloat16 key)."""
    q = torch.randn(1, 8, 300, 64, device="cuda")
    k = torch.randn(1, 2, 400, 64, device="cuda").bfloat16()
    v = torch.randn(1, 2, 400, 64, device="cuda").bfloat16()
    by_option = attn.attention(q, k, v, length=390, causal=True, options=CudaOptions(prefill_precision="f16"))
    assert torch.equal(by_option, attn.attention(q, k, v, length=390, causal=True, precision="bf16"))
