"""The decode (split-KV) attention kernel against a float64 NumPy softmax (marker `cuda`).

Short and long caches over buffers of 64, 200 and 2048 rows; the split count forced (1, 4, 33, 40)
with the in-kernel merge and with the combine kernel; one launch configuration reused for many
lengths through a device length tensor changed in place (what a CUDA graph replay does), the merge
tickets back at 0 after every call; GQA 1/3/4, Tq 1 and 3, causal, d 64/128, batch 2, `out=`;
the `min_chunk`, `chunk_align` and `precision` choices. Keys at or past `length` hold NaN, so a load
that strays past it fails the test.

    INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1 python -m pytest -q tests/test_cuda_decode_attention.py
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
import triton  # noqa: E402

from ingot.backends.cuda import attention as attn  # noqa: E402

from test_cuda_prefill import DEVICE, TOLERANCE, TORCH_DTYPES, skip_bf16_in_interpreter  # noqa: E402


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, length: int, causal: bool) -> np.ndarray:
    """float64 softmax(q k^T / sqrt(d)) v over the first `length` keys; query t sees key j when
    j <= t + length - Tq (causal); a row that sees no key is zeros."""
    b, hq, tq, d = q.shape
    group = hq // k.shape[1]
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    out = np.zeros((b, hq, tq, v.shape[-1]))
    for h in range(hq):
        keys, values = k64[:, h // group, :length], v64[:, h // group, :length]
        for t in range(tq):
            seen = min(length, t + length - tq + 1) if causal else length
            if seen <= 0:
                continue
            s = np.einsum("bd,bnd->bn", q64[:, h, t], keys[:, :seen]) / np.sqrt(d)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, h, t] = np.einsum("bn,bnd->bd", w, values[:, :seen]) / w.sum(axis=1, keepdims=True)
    return out


def inputs(tag: str, b: int, hq: int, hk: int, tq: int, buffer: int, d: int, length: int, dtype: str):
    """q, k, v on the host (k/v rows at or past `length` NaN) and on the device."""
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    q = rng.standard_normal((b, hq, tq, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, buffer, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, buffer, d)).astype(np.float32)
    k[:, :, length:] = np.nan
    v[:, :, length:] = np.nan
    dev = [torch.from_numpy(x).to(DEVICE, TORCH_DTYPES[dtype]) for x in (q, k, v)]
    host = [x.float().cpu().numpy() for x in dev]   # the values the kernel sees (rounded to dtype)
    return host, dev


def rel_err(got: torch.Tensor, want: np.ndarray) -> float:
    got64 = got.float().cpu().numpy().astype(np.float64)
    assert not np.isnan(got64).any(), "NaN in the output: a load strayed past `length`"
    return float(np.linalg.norm(got64 - want) / max(np.linalg.norm(want), 1e-30))


def check(got: torch.Tensor, want: np.ndarray, dtype: str, what) -> None:
    assert tuple(got.shape) == want.shape, what
    assert got.dtype == TORCH_DTYPES[dtype], what
    if not np.abs(want).any():
        assert not got.float().abs().any().item(), (what, "rows that see no key must be zeros")
        return
    err = rel_err(got, want)
    assert err < TOLERANCE[dtype], (what, err)


def tickets_are_zero(nb_hk: int) -> bool:
    return not attn._qmm_workspace(DEVICE, 0, nb_hk)[1][:nb_hk].any().item()


# == lengths over buffers ==============================================================================

LENGTHS = (0, 1, 5, 63, 64, 65, 127, 128, 129, 300, "full")
BUFFERS = (64, 200, 2048)
LENGTH_CASES = sorted({(buffer, buffer if n == "full" else n) for buffer in BUFFERS for n in LENGTHS
                       if n == "full" or n <= buffer})


@pytest.mark.parametrize("buffer,length", LENGTH_CASES, ids=[f"buf{b}-len{n}" for b, n in LENGTH_CASES])
@pytest.mark.parametrize("length_on_device", [True, False], ids=["dev-len", "int-len"])
def test_decode_over_lengths_and_buffers(buffer, length, length_on_device):
    """SmolLM2's shape (9/3 heads, d 64), the default configuration; the wrapper's split count from the buffer."""
    (q, k, v), dev = inputs(f"len{buffer}-{length}", 1, 9, 3, 1, buffer, 64, length, "float32")
    ln = torch.tensor(length, dtype=torch.int32, device=DEVICE) if length_on_device else length
    got = attn.attention(*dev, length=ln, causal=True)
    check(got, reference(q, k, v, length, True), "float32", (buffer, length))


@pytest.mark.parametrize("config", [dict(), dict(split=4, merge=False), dict(split=4, merge=True)],
                         ids=["default", "combine", "merge"])
@pytest.mark.parametrize("tq", [1, 40], ids=["decode", "flash"])
def test_length_offset_is_added_to_the_device_length(config, tq):
    """length=pos (a device scalar), length_offset=1: the decode kernels add the 1 themselves (a decode
    step's position + 1, no launch for the sum); the flash path adds it before its launch."""
    for length in (1, 64, 65, 300):
        (q, k, v), dev = inputs(f"offset{length}-{tq}", 1, 8, 2, tq, 400, 64, length, "float32")
        pos = torch.tensor(length - 1, dtype=torch.int32, device=DEVICE)
        got = attn.attention(*dev, length=pos, length_offset=1, causal=True, **(config if tq == 1 else {}))
        check(got, reference(q, k, v, length, True), "float32", (config, tq, length))
        assert int(pos) == length - 1   # the caller's scalar is left alone
    got = attn.attention(*dev, length=length - 3, length_offset=3, causal=True)   # an int length too
    check(got, reference(q, k, v, length, True), "float32", "int length")


@pytest.mark.parametrize("hq,hk,buffer,want_split,combine", [(9, 3, 2048, 8, False), (32, 8, 2048, 8, False),
                                                             (32, 8, 4096, 32, True), (9, 3, 200, 4, False),
                                                             (32, 8, 32768, 32, True)],
                         ids=["smollm-2048", "llama-2048", "llama-4096", "smollm-200", "llama-32k"])
def test_decode_splits_launched_from_the_buffer(hq, hk, buffer, want_split, combine, monkeypatch):
    """On 132 multiprocessors: at most decode_merge_splits splits a KV head where the last one merges in
    the kernel (a buffer of at most decode_merge_max_splits key tiles); past that two programs per SM (33
    splits for 8 KV heads), less those the whole buffer's chunks leave without keys (32: chunks of
    128 keys at 4096, 1024 at 32k), merged by the combine kernel. Either way the result is the
    attention over the runtime length."""
    grids, kernels = [], {"decode": attn._decode_kernel, "combine": attn._combine_kernel}

    class Recorded:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            grids.append((self.name, grid))
            return kernels[self.name][grid]
    monkeypatch.setattr(attn.decode, "_sm_count", lambda device: 132)
    monkeypatch.setattr(attn.decode, "_decode_kernel", Recorded("decode"))
    monkeypatch.setattr(attn.decode, "_combine_kernel", Recorded("combine"))
    length = 150
    (q, k, v), dev = inputs(f"splits{hq}-{buffer}", 1, hq, hk, 1, buffer, 64, length, "float32")
    got = attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=True)
    check(got, reference(q, k, v, length, True), "float32", (hq, buffer))
    assert grids[0] == ("decode", (hk, want_split)), grids
    assert (len(grids) == 2) == combine, grids


# == forced split counts, merge in the kernel or the combine kernel ===================================

SPLIT_LENGTHS = (0, 1, 63, 65, 129, 300, 2048)


@pytest.mark.parametrize("split", [1, 4, 33, 40])
@pytest.mark.parametrize("merge", [True, False], ids=["merge", "combine"])
@pytest.mark.parametrize("min_chunk", [None, 0], ids=["min-chunk-auto", "min-chunk-0"])
def test_decode_forced_splits(split, merge, min_chunk):
    for length in SPLIT_LENGTHS:
        (q, k, v), dev = inputs(f"split{split}-{length}", 1, 8, 2, 1, 2048, 64, length, "float32")
        got = attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=True, split=split,
                             merge=merge, min_chunk=min_chunk)
        check(got, reference(q, k, v, length, True), "float32", (split, merge, min_chunk, length))
        assert tickets_are_zero(2), "a merge ticket was left non-zero"


# == one launch configuration, the length changed in place (a CUDA graph replay) ======================

REPLAY_LENGTHS = (5, 300, 0, 64, 129, 1, 700, 65, 128, 0, 2048, 33)


@pytest.mark.parametrize("config", [dict(split=33, merge=True), dict(split=4, merge=True), dict(split=40, merge=False),
                                    dict(split=33, merge=True, min_chunk=0), dict()],
                         ids=["s33-merge", "s4-merge", "s40-combine", "s33-merge-mc0", "default"])
def test_decode_one_launch_many_lengths(config):
    """The same tensors, split and configuration every call; only the device length changes, so the
    launches are those a captured graph replays. Every result is right and the tickets end at 0."""
    buffer = 2048
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 6, 1, 128)).astype(np.float32)
    k = rng.standard_normal((1, 2, buffer, 128)).astype(np.float32)
    v = rng.standard_normal((1, 2, buffer, 128)).astype(np.float32)
    dq, dk, dv = (torch.from_numpy(x.copy()).to(DEVICE) for x in (q, k, v))   # a copy: the host k/v stay finite
    ln = torch.zeros((), dtype=torch.int32, device=DEVICE)
    out = torch.empty((1, 6, 1, 128), device=DEVICE)
    for length in REPLAY_LENGTHS:
        ln.fill_(length)
        dk[:, :, length:] = float("nan")     # what the previous length allowed is now out of bounds
        dv[:, :, length:] = float("nan")
        dk[:, :, :length] = torch.from_numpy(k[:, :, :length]).to(DEVICE)
        dv[:, :, :length] = torch.from_numpy(v[:, :, :length]).to(DEVICE)
        got = attn.attention(dq, dk, dv, length=ln, causal=True, out=out, **config)
        assert got is out
        check(got, reference(q, k, v, length, True), "float32", (config, length))
        assert tickets_are_zero(2), (config, length)


# == shapes and dtypes ==================================================================================

SHAPES = [  # (B, Hq, Hk, Tq, buffer, D, length, causal)
    (1, 4, 4, 1, 200, 64, 65, True),     # GQA 1
    (1, 9, 3, 3, 200, 64, 129, True),    # GQA 3, three query rows (a speculative / chunked decode step)
    (2, 8, 2, 3, 200, 128, 63, True),    # GQA 4, batch 2, d 128
    (1, 8, 2, 1, 300, 128, 300, False),  # full buffer, not causal
    (1, 6, 2, 3, 64, 64, 2, True),       # length < Tq: the first row sees no key
    (2, 4, 1, 1, 200, 128, 0, True),     # length 0: zeros
]


@pytest.mark.parametrize("case", SHAPES, ids=["b{}-h{}/{}-q{}-buf{}-d{}-len{}-{}".format(*c) for c in SHAPES])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_shapes_and_dtypes(case, dtype):
    skip_bf16_in_interpreter(dtype)
    b, hq, hk, tq, buffer, d, length, causal = case
    (q, k, v), dev = inputs(f"shape{case}{dtype}", b, hq, hk, tq, buffer, d, length, dtype)
    want = reference(q, k, v, length, causal)
    for split, merge in ((None, None), (4, True), (33, False)):
        got = attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=causal, split=split,
                             merge=merge)
        check(got, want, dtype, (split, merge))


# == the switches ======================================================================================

SWITCHES = {
    "default": {},
    "min-chunk-0": dict(min_chunk=0),
    "min-chunk-1": dict(min_chunk=1),
    "min-chunk-64": dict(min_chunk=64),
    "min-chunk-200": dict(min_chunk=200),    # not a multiple of the key tile: rounded up
    "min-chunk-4096": dict(min_chunk=4096),  # past the buffer: one split always
    "tf32x3p": dict(precision="tf32x3p"),    # the three tf32 passes as independent dots: float32's bar still
    "align16": dict(chunk_align=16),         # splits of whole 16-key steps, tiles of 64: a tile crosses them
    "align1": dict(chunk_align=1),
}


@pytest.mark.parametrize("name", list(SWITCHES))
@pytest.mark.parametrize("merge", [True, False], ids=["merge", "combine"])
def test_decode_switches(name, merge):
    for length in (0, 5, 64, 129, 500):
        (q, k, v), dev = inputs(f"switch{length}", 1, 9, 3, 1, 500, 64, length, "float32")
        got = attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=True, split=33, merge=merge,
                             **SWITCHES[name])
        check(got, reference(q, k, v, length, True), "float32", (name, merge, length))
        if merge:
            assert tickets_are_zero(3), (name, length)


@pytest.mark.parametrize("align", [1, 16, 48])
@pytest.mark.parametrize("min_chunk", [None, 40])
def test_chunk_align_covers_every_key(align, min_chunk):
    """The splits launched for a buffer (split=None: capped where more could never see keys) cover every
    key when a split's keys are multiples of `chunk_align` rather than of the key tile."""
    for buffer, length in ((100, 100), (100, 37), (500, 500), (500, 1)):
        (q, k, v), dev = inputs(f"align{buffer}-{length}", 1, 8, 2, 1, buffer, 64, length, "float32")
        got = attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=True, chunk_align=align,
                             min_chunk=min_chunk)
        check(got, reference(q, k, v, length, True), "float32", (align, min_chunk, buffer, length))


def test_decode_min_chunk_is_about_32_kb():
    assert attn._decode_min_chunk(128, 128, 4) == 32    # f32 d 128 (one 64-key tile in practice)
    assert attn._decode_min_chunk(64, 64, 4) == 64      # f32 d 64
    assert attn._decode_min_chunk(128, 128, 2) == 64    # bf16 d 128


# == RoPE + the KV write folded into the decode kernel ================================================

def rotate(x: np.ndarray, p: int, half: int, interleaved: bool) -> np.ndarray:
    """RoPE of x [..., D] at position p as the kernels compute it: float64 angles, float32 products."""
    inv = (10000.0 ** (-np.arange(half, dtype=np.float64) * 2 / (2 * half))).astype(np.float32)
    angle = p * inv.astype(np.float64)
    c, s = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    i1 = np.arange(half) * 2 if interleaved else np.arange(half)
    i2 = i1 + 1 if interleaved else i1 + half
    out = x.astype(np.float32).copy()
    a, b = x[..., i1].astype(np.float32), x[..., i2].astype(np.float32)
    out[..., i1], out[..., i2] = a * c - b * s, b * c + a * s
    return out, inv


ROPE_CASES = [  # (B, Hq, Hk, D, HALF, interleaved, buffer, pos, length, split, cache dtype)
    (1, 9, 3, 64, 32, False, 200, 70, 71, None, "float32"),       # SmolLM2's heads, one split
    (2, 8, 2, 128, 64, True, 2048, 1000, 1001, 4, "float32"),    # the new key in split 1 of 4 (chunk 512)
    (1, 4, 1, 64, 16, False, 64, 0, 1, None, "float32"),         # rotary dims 32 of 64, the first token
    (1, 6, 2, 64, 32, False, 300, 40, 5, 33, "float32"),         # position past the length: split 0 writes it
    (1, 6, 2, 64, 32, True, 64, 64, 64, None, "float32"),        # position past the buffer: nothing written
    (1, 8, 2, 128, 64, False, 2048, 2047, 2048, 33, "float32"),  # the last key in the last split, merged
    (1, 8, 2, 128, 64, False, 700, 300, 301, None, "bfloat16"),  # a bf16 cache: the rotated k rounded to it
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=[f"case{i}" for i in range(len(ROPE_CASES))])
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "reread"])
@pytest.mark.parametrize("early", [True, False], ids=["early", "after-wait"])
def test_decode_rotates_q_and_writes_the_new_kv(case, fresh, early):
    """attention(..., rope=) against NumPy: q rotated, the rotated k and v written into the caches at
    the position (and nothing else changed), the output over the first `length` keys of the caches
    as written (the new key among them when position < length). The cos/sin table has the buffer's
    rows (case 4's position is past it: computed in the kernel). The cache rows at the position hold
    NaN before the launch: `fresh` (the new key and value from registers) never loads them, and the
    re-reading kernel loads them only after the write. `early` reads the length, position, table (and
    the first tile) before the kernel's wait: the same results (on the GPU the launch has nothing ahead
    of it that writes them)."""
    b, hq, hk, d, half, interleaved, buffer, pos, length, split, dtype = case
    skip_bf16_in_interpreter(dtype)
    (_, k, v), (_, k_dev, v_dev) = inputs(f"rope{case}", b, hq, hk, 1, buffer, d, length, dtype)
    if pos < buffer:
        k_dev[:, :, pos] = float("nan")
        v_dev[:, :, pos] = float("nan")
    rng = np.random.default_rng(pos)
    q_raw = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
    kn = rng.standard_normal((b, hk, 1, d)).astype(np.float32)
    vn = rng.standard_normal((b, hk, 1, d)).astype(np.float32)
    q_rot, inv = rotate(q_raw, pos, half, interleaved)
    k_want, v_want = k.copy(), v.copy()
    if pos < buffer:
        k_want[:, :, pos] = rotate(kn[:, :, 0], pos, half, interleaved)[0]
        v_want[:, :, pos] = vn[:, :, 0]
    cast = lambda x: torch.from_numpy(x).to(DEVICE, TORCH_DTYPES[dtype])
    k_want, v_want = (cast(x).float().cpu().numpy() for x in (k_want, v_want))   # rounded to the cache's dtype
    rope = attn.RopeWrite(torch.tensor(pos, dtype=torch.int32, device=DEVICE), torch.from_numpy(inv).to(DEVICE),
                          torch.from_numpy(kn).to(DEVICE), torch.from_numpy(vn).to(DEVICE), interleaved,
                          attn.rope_table(inv, buffer, DEVICE))
    got = attn.attention(cast(q_raw), k_dev, v_dev, length=torch.tensor(length, device=DEVICE), causal=True,
                         split=split, rope=rope, fresh=fresh, early=early)
    np.testing.assert_allclose(k_dev.float().cpu().numpy(), k_want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v_dev.float().cpu().numpy(), v_want, rtol=0, atol=0)
    q_seen = cast(q_rot).float().cpu().numpy()
    check(got, reference(q_seen, k_want, v_want, min(length, buffer), True), dtype, case)


def test_decode_rope_with_two_query_rows_runs_the_rope_launch_first():
    """Tq 2 is not the fused kernel's case: `fused.rope_qkv_into` rotates and writes, then the attention."""
    b, hq, hk, d, buffer, pos = 1, 4, 2, 64, 100, 20
    (_, k, v), (_, k_dev, v_dev) = inputs("rope-tq2", b, hq, hk, 2, buffer, d, pos + 2, "float32")
    rng = np.random.default_rng(1)
    q_raw = rng.standard_normal((b, hq, 2, d)).astype(np.float32)
    kn = rng.standard_normal((b, hk, 2, d)).astype(np.float32)
    vn = rng.standard_normal((b, hk, 2, d)).astype(np.float32)
    q_rot = np.stack([rotate(q_raw[:, :, t], pos + t, 32, False)[0] for t in range(2)], axis=2)
    inv = rotate(q_raw, 0, 32, False)[1]
    for t in range(2):
        k[:, :, pos + t] = rotate(kn[:, :, t], pos + t, 32, False)[0]
        v[:, :, pos + t] = vn[:, :, t]
    rope = attn.RopeWrite(torch.tensor(pos, dtype=torch.int32, device=DEVICE), torch.from_numpy(inv).to(DEVICE),
                          torch.from_numpy(kn).to(DEVICE), torch.from_numpy(vn).to(DEVICE), False,
                          attn.rope_table(inv, buffer, DEVICE))
    got = attn.attention(torch.from_numpy(q_raw).to(DEVICE), k_dev, v_dev, length=torch.tensor(pos + 2, device=DEVICE),
                         causal=True, rope=rope)
    np.testing.assert_allclose(k_dev.cpu().numpy()[:, :, :pos + 2], k[:, :, :pos + 2], rtol=1e-6, atol=1e-6)
    check(got, reference(q_rot, k, v, pos + 2, True), "float32", "tq2")


# == the output rounded for the word GEMV after it ====================================================

XQ_CASES = [  # (B, Hq, Hk, D, buffer, length, split, merge, limbs)
    (1, 8, 2, 128, 300, 70, None, None, 2),     # one split writes the output
    (2, 9, 3, 64, 2048, 1000, 4, True, 2),      # four splits, the last merges
    (1, 4, 1, 64, 64, 0, None, None, 1),        # no keys: zeros, x in 8 bits
    (1, 6, 2, 96, 200, 150, None, None, 2),     # d 96: blocks of 32, BLOCK_DV 128 > d: not the kernel's case
    (1, 8, 2, 64, 2048, 700, 40, False, 2),     # the combine kernel writes: not the decode kernel's case
]


@pytest.mark.parametrize("case", [0, 3, 4, "flash"], ids=["rounded", "d96", "combine-kernel", "flash-tiles"])
def test_attention_zeroes_the_next_gemvs_output(case):
    """attention(..., zero=) leaves `zero` zeroed whatever `xq` got: the decode kernel zeroes it in
    its own launch (where it rounds the output, where it cannot: d 96, and ahead of a combine launch),
    the flash path by a memset (G * Tq past DECODE_MAX_ROWS)."""
    b, hq, hk, d, buffer, length, split, merge, limbs = XQ_CASES[case] if case != "flash" else \
        (1, 4, 1, 64, 256, 200, None, None, 2)
    tq = 1 if case != "flash" else attn.DECODE_MAX_ROWS // 4 + 1
    (q, k, v), dev = inputs(f"zero{case}", b, hq, hk, tq, buffer, d, length, "float32")
    for with_xq in (False, True):
        kb = hq * d // 32
        target = attn.XQTarget(torch.full((b, kb * 8 * limbs), -1, dtype=torch.int32, device=DEVICE),
                               *(torch.full((b, kb), float("nan"), device=DEVICE) for _ in range(2)), limbs) \
            if with_xq else None
        zero = torch.full((777,), float("nan"), device=DEVICE)
        out = attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=tq == 1, split=split,
                             merge=merge, xq=target, zero=zero)
        assert not zero.any().item() and not zero.isnan().any().item(), (case, with_xq)
        if tq == 1:
            check(out, reference(q, k, v, length, True), "float32", case)
        if with_xq:
            assert target.written == (case == 0), case


def unfused_rope(dev, q: np.ndarray, hk: int, length: int, buffer: int, rng):
    """A decoder layer's RoPE for attention(rope=) at position length - 1 (new k/v rows from rng), and
    the output the unfused path gives: the RoPE launch writing copies of the caches, then the attention.
    The caches' rows from `length` on are zeroed first (the unfused path reads the same caches)."""
    from ingot.backends.cuda import fused
    b, d = q.shape[0], q.shape[-1]
    for x in dev[1:]:
        x[:, :, length:] = 0.0
    kn, vn = (torch.from_numpy(rng.standard_normal((b, hk, 1, d)).astype(np.float32)).to(DEVICE) for _ in range(2))
    inv = torch.from_numpy(rotate(q, 0, d // 2, False)[1]).to(DEVICE)
    pos = torch.tensor(length - 1, dtype=torch.int32, device=DEVICE)
    k_ref, v_ref = dev[1].clone(), dev[2].clone()
    q_rot = fused.rope_qkv_into(dev[0], kn, vn, pos, inv, k_ref, v_ref, False)
    want_out = attn.attention(q_rot, k_ref, v_ref, length=torch.tensor(length, device=DEVICE), causal=True)
    return attn.RopeWrite(pos, inv, kn, vn, False, attn.rope_table(inv.cpu().numpy(), buffer, DEVICE)), want_out


@pytest.mark.parametrize("case", XQ_CASES, ids=[f"case{i}" for i in range(len(XQ_CASES))])
@pytest.mark.parametrize("with_rope", [False, True], ids=["", "rope"])
def test_decode_stores_its_output_rounded_for_the_gemv(case, with_rope):
    """attention(..., xq=) stores what `_quantize_x` stores for x = the output [B, Hq * D] (limb words
    equal, scales and sums equal) and zeroes `zero`, where the decode kernel writes the output itself;
    elsewhere it says it did not (`written` False) and leaves the buffers alone. With RoPE (q rotated,
    the new k/v written at length - 1: a decoder layer's whole attention) the output is checked against
    the unfused RoPE launch and attention."""
    from ingot.backends.cuda import quantized_matmul as qmm
    b, hq, hk, d, buffer, length, split, merge, limbs = case
    (q, k, v), dev = inputs(f"xq{case}", b, hq, hk, 1, buffer, d, length, "float32")
    rope = None
    if with_rope:
        if length == 0:
            pytest.skip("no position to write at length 0")
        rope, want_out = unfused_rope(dev, q, hk, length, buffer, np.random.default_rng(length))
    kb = hq * d // 32
    xq = torch.full((b, kb * 8 * limbs), -1, dtype=torch.int32, device=DEVICE)
    xd, xs = (torch.full((b, kb), float("nan"), device=DEVICE) for _ in range(2))
    zero = torch.full((1000,), float("nan"), device=DEVICE)
    target = attn.XQTarget(xq, xd, xs, limbs, zero)
    out = attn.attention(*dev, length=torch.tensor(length, device=DEVICE), causal=True, split=split, merge=merge, xq=target,
                         rope=rope)
    if rope is None:
        check(out, reference(q, k, v, length, True), "float32", case)
    else:
        err = float((out - want_out).norm() / want_out.norm())
        assert err < 1e-5, (case, err)
    if not target.written:
        assert case[-2] is False or d % 32 or d != triton.next_power_of_2(d), case
        assert (xq == -1).all().item() and zero.isnan().all().item()
        return
    want = qmm._quantize_x(out.reshape(b, hq * d), None, limbs)
    assert torch.equal(xq, want["xq_ptr"]), "limb words differ from the quantize kernel's"
    assert torch.equal(xd, want["xd_ptr"]) and torch.equal(xs, want["xs_ptr"])
    assert not zero.any().item(), "the GEMV's output was not zeroed"
