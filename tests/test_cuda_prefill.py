"""The prefill (flash) attention kernel against a float64 NumPy softmax (marker `cuda`).

Every variant switch of `attention()`'s flash path, on and off, over awkward shapes: query and key
counts off the block sizes, Tq != Tk with `length` short of the buffer (an int and a device
scalar), GQA groups 1, 3, 4, d 64/80/128, causal and not, additive and bool masks, rows that see
no key (zeros). Keys past `length` hold NaN, so a load that strays past it fails the test.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_prefill.py
"""
from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

_INTERPRET = require_cuda()
import torch  # noqa: E402

from ingot.backends import cuda as cuda_backend  # noqa: E402
from ingot.backends.cuda import attention as attn  # noqa: E402

DEVICE = torch.device(cuda_backend.device_name())
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}

CASES = [  # (B, Hq, Hk, Tq, Tk, D, length, causal); G * Tq > 64, so the flash kernel runs, not decode
    (1, 2, 2, 77, 77, 64, 77, True),       # square causal, one block and a remainder
    (1, 3, 1, 130, 200, 80, 190, True),    # GQA 3, length < buffer, d 80 (column masks)
    (2, 4, 1, 65, 130, 128, 130, False),   # GQA 4, not causal
    (1, 4, 1, 200, 260, 64, 250, True),    # several query and key blocks
    (1, 2, 1, 130, 140, 64, 100, True),    # length < Tq: the first 30 rows see no key
    (1, 2, 2, 70, 96, 128, 0, True),       # length 0: every row zeros
]
VARIANTS = {
    "default": {},
    "one-stage": dict(split_stages=False),
    "light-first": dict(heavy_first=False),
    "heads-axis0": dict(heads_on_axis0=True),
    "tma": dict(tma=True),
    "m64-n32-w4": dict(block_m=64, block_n=32, num_warps=4),
    "m128-n128": dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    # the Hopper kernel (flash_sm90); elsewhere, and for float32 or d 80, the flash kernel runs instead
    "gluon": dict(gluon=True),                               # 128-key tiles, 3 stages
    "gluon-n64-s2": dict(gluon=dict(block_n=64, stages=2)),
    "gluon-n64-s4": dict(gluon=dict(block_n=64, stages=4)),
}


def reference(q, k, v, length, causal, mask=None, scale=None) -> np.ndarray:
    """softmax(q k^T * scale + mask) v in float64, keys < length, causal j <= t + length - Tq; rows with no key: 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    group = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s = q @ np.swapaxes(k, -1, -2) * (scale if scale is not None else 1.0 / np.sqrt(d))
    t, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    ok = np.broadcast_to(j < length, (tq, tk))
    if causal:
        ok = ok & (j <= t + length - tq)
    if mask is not None:
        s = s + (np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask)
    s = np.where(ok, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    return np.where(total > 0, (e / np.where(total > 0, total, 1.0)) @ v, 0.0)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def skip_bf16_in_interpreter(dtype: str) -> None:
    if _INTERPRET and dtype == "bfloat16":
        pytest.skip("Triton's interpreter mishandles bfloat16 (the GPU run checks it)")


def inputs(case, dtype: str, seed: int):
    """q, k, v rounded to `dtype` (float64 copies for the reference) and their device tensors, NaN past `length`."""
    b, hq, hk, tq, tk, d, length, _ = case
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(shape) for shape in ((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, d))]
    dev = [torch.tensor(a, dtype=TORCH_DTYPES[dtype]) for a in host]
    host = [a.double().numpy() for a in dev]          # what the kernel sees, exactly
    for a in dev[1:]:
        a[..., length:, :] = float("nan")               # keys past the length: garbage the kernel must not read
    return host, [a.to(DEVICE) for a in dev]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("case", CASES, ids=["b{}-h{}/{}-q{}-k{}-d{}-len{}-{}".format(*c) for c in CASES])
@pytest.mark.parametrize("length_on_device", [False, True], ids=["len-int", "len-tensor"])
def test_prefill_matches_the_reference(case, dtype, variant, length_on_device):
    skip_bf16_in_interpreter(dtype)
    if variant == "m128-n128" and dtype == "float32" and case[5] > 64:
        pytest.skip("f32 128x128 tiles of d > 64 exceed the H200's shared memory (the f32 defaults are smaller)")
    length, causal = case[6], case[7]
    (q, k, v), (tq, tk, tv) = inputs(case, dtype, seed=zlib.crc32(repr((case, dtype)).encode()))
    want = reference(q, k, v, length, causal)
    ln = torch.tensor(length, dtype=torch.int32, device=DEVICE) if length_on_device else length
    got = attn.attention(tq, tk, tv, length=ln, causal=causal, **VARIANTS[variant])
    assert got.shape == want.shape
    assert got.dtype == TORCH_DTYPES[dtype]
    got = cuda_backend.to_host(got).astype(np.float64)
    assert np.all(np.isfinite(got))
    no_key = length <= 0 or (causal and length < case[3])
    if no_key:                                          # rows t < Tq - length see no key: exactly zeros
        assert np.all(got[..., : case[3] - max(length, 0), :] == 0)
    assert rel_err(got, want) < TOLERANCE[dtype], rel_err(got, want)


@pytest.mark.parametrize("variant", ["default", "one-stage", "tma"])
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("kind", ["additive", "bool"])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_with_a_mask(kind, dtype, variant, causal):
    """A mask keeps every key tile on the masked path; a bool row of all False gives zeros."""
    skip_bf16_in_interpreter(dtype)
    case = (2, 3, 1, 70, 90, 64, 85, causal)
    (q, k, v), (tq, tk, tv) = inputs(case, dtype, seed=7)
    rng = np.random.default_rng(8)
    if kind == "bool":
        mask = rng.random((2, 1, 70, 90)) < 0.7
        mask[0, 0, 69] = False                           # the last row sees no key
    else:
        mask = rng.standard_normal((2, 3, 70, 90))
        mask[1, 2, :, 5] = -np.inf
    want = reference(q, k, v, 85, causal, mask=mask, scale=0.3)
    got = attn.attention(tq, tk, tv, length=85, causal=causal, scale=0.3, mask=torch.tensor(mask).to(DEVICE),
                         **VARIANTS[variant])
    got = cuda_backend.to_host(got).astype(np.float64)
    if kind == "bool":
        assert np.all(got[0, :, 69] == 0)
    assert rel_err(got, want) < TOLERANCE[dtype], rel_err(got, want)


@pytest.mark.parametrize("split_stages", [False, True])
def test_prefill_with_a_negative_scale(split_stages):
    """A negative scale: the unmasked stage takes the row maximum from the raw minimum."""
    case = (1, 2, 1, 130, 150, 64, 140, True)
    (q, k, v), (tq, tk, tv) = inputs(case, "float32", seed=9)
    want = reference(q, k, v, 140, True, scale=-0.2)
    got = cuda_backend.to_host(attn.attention(tq, tk, tv, length=140, causal=True, scale=-0.2,
                                              split_stages=split_stages))
    assert rel_err(got, want) < TOLERANCE["float32"], rel_err(got, want)


def test_prefill_default_tiles():
    """The default tiles: 128x64 with 8 warps for 16-bit d <= 128; small no-spill tiles for f32 and d > 128;
    the arguments given win."""
    assert attn._flash_config(False, 128, None, None, None, None) == (128, 64, 8, 3)
    assert attn._flash_config(True, 128, None, None, None, None) == (32, 16, 4, 2)
    assert attn._flash_config(True, 256, None, None, None, None)[:2] == (16, 16)
    assert attn._flash_config(False, 256, None, None, None, None)[0] == 32
    assert attn._flash_config(False, 64, 64, 32, None, 4) == (64, 32, 4, 4)


@pytest.mark.parametrize("length_on_device", [False, True], ids=["len-int", "len-tensor"])
def test_prefill_default_takes_the_hopper_kernel_from_2048_rows(monkeypatch, length_on_device):
    """From CudaOptions.prefill_hopper_min_rows query rows, 16-bit inputs of head dim 128 take `flash_sm90` (on sm_90; elsewhere, the
    flash kernel), GQA 2 with a length short of the buffer and NaN past it, against the reference."""
    if _INTERPRET:
        pytest.skip("2048 query rows take minutes in Triton's interpreter (the GPU run checks it)")
    from ingot.backends.cuda import flash_sm90
    calls = []
    real = flash_sm90.flash_sm90
    monkeypatch.setattr(flash_sm90, "flash_sm90", lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1])
    case = (1, 4, 2, 2048, 2100, 128, 2060, True)
    (q, k, v), (tq, tk, tv) = inputs(case, "bfloat16", seed=11)
    length = torch.tensor(2060, dtype=torch.int32, device=DEVICE) if length_on_device else 2060
    got = cuda_backend.to_host(attn.attention(tq, tk, tv, length=length, causal=True)).astype(np.float64)
    want = reference(q, k, v, 2060, True)
    assert rel_err(got, want) < TOLERANCE["bfloat16"], rel_err(got, want)
    hopper = DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE)[0] == 9
    assert len(calls) == (1 if hopper else 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", ["gluon", "gluon-n64-s2"])
def test_hopper_kernel_on_strided_inputs_with_more_blocks_than_multiprocessors(variant, causal):
    """q, k and v as [B, T, H, D] storage seen as [B, H, T, D] (no stride steps from one head to the next across
    the batch), and 2 x 8 heads x 9 query blocks = 144 blocks, more than an H200's 132 multiprocessors, so
    the Hopper kernel's programs walk several blocks (its q buffer and K/V ring reused across them, and a
    last round of 12 blocks in which most programs have none)."""
    if _INTERPRET:
        pytest.skip("1100 query rows take minutes in Triton's interpreter (the GPU run checks it)")
    b, hq, hk, tq, tk, d, length = 2, 8, 2, 1100, 1150, 128, 1120
    rng = np.random.default_rng(12)
    host = [rng.standard_normal(shape) for shape in ((b, tq, hq, d), (b, tk, hk, d), (b, tk, hk, d))]
    dev = [torch.tensor(a, dtype=torch.bfloat16) for a in host]
    host = [a.double().numpy().transpose(0, 2, 1, 3) for a in dev]
    for a in dev[1:]:
        a[:, length:] = float("nan")
    tq_, tk_, tv_ = (a.to(DEVICE).transpose(1, 2) for a in dev)
    assert not tq_.is_contiguous() and tq_.stride(0) != hq * tq_.stride(1)
    want = reference(*host, length, causal)
    got = cuda_backend.to_host(attn.attention(tq_, tk_, tv_, length=length, causal=causal, **VARIANTS[variant]))
    assert rel_err(got.astype(np.float64), want) < TOLERANCE["bfloat16"], rel_err(got.astype(np.float64), want)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_float32_queries_over_a_bfloat16_cache(causal):
    """A bf16 KV cache under float32 queries (the model's bf16 cache option): the keys and values are
    widened exactly, so the result is float32-level against the same bf16 values widened."""
    rng = np.random.default_rng(zlib.crc32(f"mixed{causal}".encode()))
    q = torch.tensor(rng.standard_normal((1, 4, 150, 64)), dtype=torch.float32, device=DEVICE)
    k = torch.tensor(rng.standard_normal((1, 2, 170, 64)), dtype=torch.float32, device=DEVICE).bfloat16()
    v = torch.tensor(rng.standard_normal((1, 2, 170, 64)), dtype=torch.float32, device=DEVICE).bfloat16()
    got = attn.attention(q, k, v, length=160, causal=causal)
    assert got.dtype == torch.float32
    want = reference(q.cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(), 160, causal)
    err = np.linalg.norm(got.cpu().numpy() - want) / np.linalg.norm(want)
    assert err < TOLERANCE["float32"], err
