"""The word-layout dp4a GEMV with x in 1, 2 or 3 bytes (LIMBS) and x pre-quantized by its own launch
(XQ), against a float64 reference (marker `cuda`).

Runs where torch sees a GPU; CI skips it. `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it under
Triton's interpreter (the dp4a then runs byte by byte), so the shapes stay small but awkward: K not a
multiple of 32, N not a multiple of 128, 1/3/4/11 rows.

The tolerance is the rounding of x, element by element: y_n - ref_n = sum_k (X_k d - x_k) * w_kn, and

    LIMBS 1, 2:  |X d - x| <= d / 2, d = max|x| over the block of 32 / qmax (127, 32767)
    LIMBS 3:     |X d - x| <= max|x| of the row * 2**-22 (a power-of-two step below 2**-21 * the tile's max)

so |y_n - ref_n| <= sum_k step_k * (v_kn |s_kn| + |b_kn|) (+ float32 rounding, 2e-6 of the same sum
over |x|). The relative errors on Gaussian x are then about 5e-3 (LIMBS 1), 2e-5 (LIMBS 2), < 1e-6 (3).
"""
from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

_INTERPRET = require_cuda()
import torch  # noqa: E402
from test_cuda import DEVICE, FORMATS, make_weight, rel_err, rng_for  # noqa: E402

from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.options import CudaOptions  # noqa: E402

QMAX = {1: 127.0, 2: 32767.0}
# about 6x the expected relative error (docstring), a norm-wise sanity check; the element-wise rounding bound is
# the test. 2 limbs 2e-4: the SiLU(gate) * x prologue's x of wide range gave 1.10e-4 on the H100 (230x150, one
# row, xq-self) with every element inside its bound
REL = {1: 3e-2, 2: 2e-4, 3: 2e-6}
CASES = [  # (format, (K, N, block along K or None for per-column), rows)
    (FORMATS[0], (230, 150, 32), 1), (FORMATS[1], (193, 300, 64), 3), (FORMATS[2], (256, 130, None), 4),
    (FORMATS[3], (296, 78, 32), 3), (FORMATS[1], (193, 300, 64), 11),   # 11 rows: three programs of 4 rows down M
]


def words_weight(rng, fmt, shape) -> qmm.QuantizedWeight:
    qdtype, zero_point, bias, lut = fmt
    k, n, block = shape
    q, params, _ = make_weight(rng, qdtype, k, n, block, zero_point, bias, lut, False)
    plist = [params[name] for name in ("scale", "zero_point", "bias") if name in params]
    attrs = dict(qdtype=qdtype, mode="affine", has_zero_point=zero_point, has_bias=bias)
    w = qmm.prepare_weight(q, plist, attrs, DEVICE, words=True)
    assert w.words and w.group % 32 == 0
    return w


def rounding_bound(x: torch.Tensor, w: qmm.QuantizedWeight, limbs: int, residual: torch.Tensor | None) -> torch.Tensor:
    """The largest |y - ref| that rounding x to LIMBS bytes can cause, per output element (module docstring)."""
    x = x.double().cpu()
    rows, k = x.shape
    if limbs == 3:
        step = x.abs().amax(dim=1, keepdim=True).expand(rows, k) * 2.0 ** -22
    else:
        padded = torch.nn.functional.pad(x.abs(), (0, -k % 32)).reshape(rows, -1, 32)
        step = (padded.amax(dim=2) / (2 * QMAX[limbs])).repeat_interleave(32, dim=1)[:, :k]
    g = torch.arange(k) // w.group
    magnitude = w.values().double().cpu() * w.scale.double().cpu()[g, : w.n].abs()      # v |s| + |b|
    if w.bias is not None:
        magnitude += w.bias.double().cpu()[g, : w.n].abs()
    floats = x.abs() @ magnitude + (residual.double().abs().cpu() if residual is not None else 0.0)
    return step @ magnitude * 1.001 + 2e-6 * floats


def check(got, x, w, limbs, residual=None, what=""):
    want = x.double().cpu() @ qmm.dequantize(w).double().cpu()
    if residual is not None:
        want += residual.double().cpu()
    got = got.double().cpu()
    assert got.shape == want.shape
    excess = (got - want).abs() - rounding_bound(x, w, limbs, residual)
    assert excess.max() <= 0, f"{what}: {int((excess > 0).sum())} elements past the rounding bound, by up to {excess.max()}"
    assert rel_err(got, want) < REL[limbs], (what, rel_err(got, want))


XQ_MODES = {"x-in-gemv": dict(XQ=False), "xq": dict(XQ=True), "xq-self": dict(XQ=True, XQ_SELF=True)}


@pytest.mark.parametrize("xq", list(XQ_MODES))
@pytest.mark.parametrize("limbs", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[1][0]}x{c[1][1]}-rows{c[2]}" for c in CASES])
def test_words_gemv_limbs(case, limbs, xq):
    """Every LIMBS with x rounded in the GEMV, pre-quantized by its own launch, or pre-quantized by each
    program for its split (xq-self); one split and several (atomics, tickets), with the SiLU(gate) * x
    prologue and the residual epilogue."""
    fmt, shape, rows = case
    k, n, _ = shape
    rng = rng_for(f"xq{case}{limbs}{xq}")
    w = words_weight(rng, fmt, shape)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32) * 3).to(DEVICE)
    for config in (dict(SPLIT=1), dict(SPLIT=3, REDUCE=1), dict(SPLIT=3, REDUCE=2, ROWS=4)):
        got = qmm.quantized_matmul(x, w, config=dict(config, KERNEL="words", LIMBS=limbs, **XQ_MODES[xq]))
        check(got, x, w, limbs, what=str(config))
    gate = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(DEVICE)
    residual = torch.from_numpy(rng.standard_normal((rows, n)).astype(np.float32)).to(DEVICE)
    gated = (gate.double() * torch.sigmoid(gate.double())) * x.double()
    for config, res in ((dict(SPLIT=1), residual), (dict(SPLIT=3), residual), (dict(SPLIT=2, REDUCE=1), None)):
        got = torch.empty(rows, n, device=DEVICE)
        qmm._words_gemv(x, w, got, dict(config, LIMBS=limbs, **XQ_MODES[xq]), x_gate=gate, residual=res)
        check(got, gated, w, limbs, res, what=f"glu {config} residual={res is not None}")


def test_xq_same_as_rounding_in_the_gemv():
    """LIMBS 1/2 round x per block of 32 the same way in both paths: the same integers, the same y up
    to float32 summation order."""
    rng = rng_for("xq-same")
    w = words_weight(rng, FORMATS[1], (230, 150, 32))
    x = torch.from_numpy(rng.standard_normal((3, 230)).astype(np.float32)).to(DEVICE)
    for limbs in (1, 2):
        a = qmm.quantized_matmul(x, w, config=dict(KERNEL="words", LIMBS=limbs, XQ=False, SPLIT=1))
        b = qmm.quantized_matmul(x, w, config=dict(KERNEL="words", LIMBS=limbs, XQ=True, SPLIT=1))
        assert rel_err(a.cpu(), b.cpu()) < 1e-6, (limbs, rel_err(a.cpu(), b.cpu()))


@pytest.mark.parametrize("xq", [False, True], ids=["x-in-gemv", "xq"])
def test_words_gemv_half_inputs(xq):
    """float16 x and y (bfloat16: the GPU run; Triton's interpreter mishandles it)."""
    rng = rng_for(f"xq-half{xq}")
    w = words_weight(rng, FORMATS[0], (193, 300, 64))
    dtypes = [torch.float16] + ([] if _INTERPRET else [torch.bfloat16])
    for dtype in dtypes:
        x = torch.from_numpy(rng.standard_normal((3, 193)).astype(np.float32)).to(DEVICE).to(dtype)
        got = qmm.quantized_matmul(x, w, config=dict(KERNEL="words", LIMBS=2, XQ=xq))
        assert got.dtype == dtype
        want = x.double().cpu() @ qmm.dequantize(w).double().cpu()
        assert rel_err(got.float().cpu(), want) < (1e-3 if dtype == torch.float16 else 1e-2)   # y stored in x's dtype


def test_defaults_from_the_options(monkeypatch):
    """No LIMBS/XQ in the config: options.gemv_limbs, and XQ for weights of options.xq_min_bytes and more."""
    rng = rng_for("xq-defaults")
    w = words_weight(rng, FORMATS[0], (230, 150, 32))
    x = torch.from_numpy(rng.standard_normal((1, 230)).astype(np.float32)).to(DEVICE)
    calls = []
    quantize = qmm.xq._quantize_x
    monkeypatch.setattr(qmm.xq, "_quantize_x", lambda *a, **kw: calls.append(a[2]) or quantize(*a, **kw))
    for limbs in (1, 3):
        for min_bytes, want_xq in ((w.nbytes + 1, False), (w.nbytes, True)):
            options = CudaOptions(gemv_limbs=limbs, xq_min_bytes=min_bytes)
            assert qmm.gemv_takes_xq(1, w, options=options) == (limbs if want_xq else 0)
            calls.clear()
            got = qmm.quantized_matmul(x, w, config=dict(SPLIT=1), options=options)
            want = qmm.quantized_matmul(x, w, config=dict(SPLIT=1, LIMBS=limbs, XQ=want_xq))
            assert calls == [limbs] * (2 if want_xq else 0)         # the default call, then the explicit one
            assert torch.equal(got, want)


def test_resident_programs_and_the_one_wave_split():
    """Hopper's register file: 64K a multiprocessor, 256 to a warp; WAVES=0 splits K until the programs
    fill the multiprocessors once (Llama-3-8B gate+up: 56 column blocks of 4 warps)."""
    assert qmm.resident_programs(100, 4) == 4          # 104 registers a thread: 3328 a warp, 13312 a program
    assert qmm.resident_programs(168, 4) == 3
    assert qmm.resident_programs(255, 4) == 2
    assert qmm.resident_programs(32, 1) == 32          # the 32-program limit, not registers
    assert qmm.resident_programs(32, 4) == 16          # the 64-warp limit
    gate_up = types.SimpleNamespace(n=28672, q=torch.empty(512, 1))
    assert qmm.words_gemv_config(gate_up, 1, 132, waves=0, regs=100)["SPLIT"] == 4 * 132 // 56
    assert qmm.words_gemv_config(gate_up, 1, 132, waves=0)["SPLIT"] == qmm.words_gemv_config(gate_up, 1, 132)["SPLIT"]
    # tb="auto": one block a tile where even a tile per program leaves multiprocessors idle (SmolLM2's qkv)
    qkv = types.SimpleNamespace(n=960, q=torch.empty(72, 1))
    assert qmm.words_gemv_config(qkv, 1, 132, tb="auto")["TB"] == 1
    assert qmm.words_gemv_config(qkv, 1, 132, tb="auto")["SPLIT"] == 18
    assert qmm.words_gemv_config(gate_up, 1, 132, tb="auto")["TB"] == 2


def test_one_wave_split_results():
    """WAVES=0: the first launch takes the default split and records the kernel's registers (a GPU
    only), the next ones the one-wave split; both equal the default's result."""
    rng = rng_for("xq-one-wave")
    w = words_weight(rng, FORMATS[0], (2048, 300, 32))
    x = torch.from_numpy(rng.standard_normal((1, 2048)).astype(np.float32)).to(DEVICE)
    want = qmm.quantized_matmul(x, w, config=dict(LIMBS=2, XQ=False))
    for _ in range(2):
        got = qmm.quantized_matmul(x, w, config=dict(LIMBS=2, XQ=False, WAVES=0))
        assert rel_err(got.cpu(), want.cpu()) < 1e-6


@pytest.mark.parametrize("zero_in_xq", [True, False], ids=["zeroed-by-xq", "memset"])
def test_split_output_zeroed_by_the_quantize_launch(zero_in_xq):
    """XQ with splits added atomically (REDUCE 1): the quantize launch zeroes a contiguous y (no memset
    between it and the GEMV), a memset zeroes any other; y's old contents (NaN) never reach the sums,
    call after call into the same y, and an output that overlaps x is left to the memset."""
    rng = rng_for("xq-zero")
    w = words_weight(rng, FORMATS[0], (1000, 300, 32))
    x = torch.from_numpy(rng.standard_normal((2, 1000)).astype(np.float32)).to(DEVICE)
    y = torch.full((2, 300 if zero_in_xq else 320), float("nan"), device=DEVICE)[:, :300]   # rows apart: a memset
    for _ in range(2):
        qmm.quantized_matmul(x, w, out=y, config=dict(KERNEL="words", LIMBS=2, XQ=True, SPLIT=5, REDUCE=1))
        check(y, x, w, 2, what="y zeroed before the splits add into it")
        y.fill_(float("nan"))
    both = torch.zeros(1300, device=DEVICE)
    assert qmm._overlaps(both[1000:], both[:1000]) is False and qmm._overlaps(both[999:], both[:1000])
    assert qmm._overlaps(both.view(13, 100)[:, :50], both[60:90])   # a span, first to last element: conservative
    assert qmm._overlaps(both[5:10], None, both[9:20])


def test_self_rounding_equals_the_quantize_launch():
    """xq-self stores the same words, scales and block sums as the quantize launch (each split's
    blocks, by every column program of the split), so y is the same up to the order of the sums."""
    rng = rng_for("xq-self-same")
    w = words_weight(rng, FORMATS[1], (1000, 300, 32))
    x = torch.from_numpy(rng.standard_normal((3, 1000)).astype(np.float32)).to(DEVICE)
    for limbs in (1, 2, 3):
        want = qmm.quantized_matmul(x, w, config=dict(KERNEL="words", LIMBS=limbs, XQ=True, SPLIT=1))
        stored = [t.clone() for t in qmm.xq_buffers(3, 1000, limbs, x.device).values() if torch.is_tensor(t)]
        qmm.xq_buffers(3, 1000, limbs, x.device)["xq_ptr"].fill_(-1)
        got = qmm.quantized_matmul(x, w, config=dict(KERNEL="words", LIMBS=limbs, XQ=True, XQ_SELF=True, SPLIT=4,
                                                     REDUCE=1))
        again = [t for t in qmm.xq_buffers(3, 1000, limbs, x.device).values() if torch.is_tensor(t)]
        for name, a, b in zip(("words", "scales", "sums"), stored, again):   # the first column block's copy
            if limbs == 3 and name == "sums":   # float sums of x, in the layout of another warp count
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), limbs
            else:
                assert torch.equal(a, b), (name, limbs)
        assert rel_err(got.cpu(), want.cpu()) < 1e-6, (limbs, rel_err(got.cpu(), want.cpu()))


def test_gemv_zeroes_the_next_gemvs_output():
    """`zero=`: a GEMV's programs zero the split-K output of the GEMV after it, which then adds into
    it without a memset (ZEROED); NaN left in that output never reaches its sums."""
    rng = rng_for("xq-zero-next")
    w1 = words_weight(rng, FORMATS[0], (320, 1000, 32))
    w2 = words_weight(rng, FORMATS[0], (1000, 200, 32))
    x = torch.from_numpy(rng.standard_normal((2, 320)).astype(np.float32)).to(DEVICE)
    y1 = torch.empty(2, 1000, device=DEVICE)
    y2 = torch.full((2, 200), float("nan"), device=DEVICE)
    for _ in range(2):
        qmm._words_gemv(x, w1, y1, dict(LIMBS=2, XQ=True, XQ_SELF=True, SPLIT=2, REDUCE=1), zero=y2)
        assert torch.equal(y2.cpu(), torch.zeros(2, 200))
        check(y1, x, w1, 2, what="the first GEMV")
        qmm._words_gemv(y1, w2, y2, dict(LIMBS=2, XQ=True, XQ_SELF=True, SPLIT=3, REDUCE=1, ZEROED=True))
        check(y2, y1, w2, 2, what="the second GEMV, into the zeroed output")
        y2.fill_(float("nan"))


def test_xq_workspace_allocated_once():
    """The pre-quantized x lives in one workspace per device and stream: a second call (same size or
    smaller) reuses it, so a CUDA graph captured after an eager run never allocates."""
    rng = rng_for("xq-workspace")
    w = words_weight(rng, FORMATS[0], (230, 150, 32))
    x = torch.from_numpy(rng.standard_normal((4, 230)).astype(np.float32)).to(DEVICE)
    qmm.quantized_matmul(x, w, config=dict(KERNEL="words", LIMBS=3, XQ=True, SPLIT=1))
    key = qmm._stream_key(x.device)
    words, floats = qmm._XQ_WORKSPACE[key]
    pointers = (words.data_ptr(), floats.data_ptr())
    for rows, limbs in ((4, 3), (1, 2), (3, 1)):
        got = qmm.quantized_matmul(x[:rows], w, config=dict(KERNEL="words", LIMBS=limbs, XQ=True, SPLIT=1))
        check(got, x[:rows], w, limbs, what=f"rows {rows} limbs {limbs}")
        words, floats = qmm._XQ_WORKSPACE[key]
        assert (words.data_ptr(), floats.data_ptr()) == pointers


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="needs CUDA graphs")
def test_xq_in_a_graph_captured_on_a_fresh_stream():
    """torch captures on a side stream that has no workspace yet: the capture allocates it (from the
    graph's pool) and the replays equal the eager result."""
    rng = rng_for("xq-graph")
    w = words_weight(rng, FORMATS[0], (296, 130, 32))
    x = torch.from_numpy(rng.standard_normal((1, 296)).astype(np.float32)).to(DEVICE)
    config = dict(KERNEL="words", XQ=True)
    qmm.quantized_matmul(x, w, config=dict(config))   # the first launch learns the kernel's registers,
    eager = qmm.quantized_matmul(x, w, config=dict(config))   # which set the split the capture uses too
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qmm.quantized_matmul(x, w, config=dict(config))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(y, eager, rtol=1e-6, atol=1e-6)   # split-K atomics: any order


@pytest.mark.parametrize("self_round", [False, True], ids=["xq-launch", "xq-self"])
@pytest.mark.parametrize("tb", [1, 2])
def test_early_weight_tile_same_result(self_round, tb):
    """EARLY_W (the first weight tile loaded before the wait on the kernel ahead) changes when a load
    is issued, not what is computed: bit-equal to the same launch without (one split, no atomics),
    over several tiles and a ragged end."""
    rng = rng_for(f"early-w{self_round}{tb}")
    w = words_weight(rng, FORMATS[1], (1000, 390, 32))
    x = torch.from_numpy(rng.standard_normal((2, 1000)).astype(np.float32)).to(DEVICE)
    base = dict(KERNEL="words", LIMBS=2, XQ=True, XQ_SELF=self_round, SPLIT=1, TB=tb)
    want = qmm.quantized_matmul(x, w, config=dict(base, EARLY_W=False))
    got = qmm.quantized_matmul(x, w, config=dict(base, EARLY_W=True))
    assert torch.equal(got, want)
    check(got, x, w, 2, what="early weight tile")
    split = qmm.quantized_matmul(x, w, config=dict(base, EARLY_W=True, SPLIT=3, REDUCE=2))
    assert rel_err(split.cpu(), want.cpu()) < 1e-6


@pytest.mark.skipif(os.environ.get("INGOT_CUDA_DEVICE") == "cpu", reason="needs CUDA graphs")
def test_early_weight_tile_in_a_captured_graph(monkeypatch):
    """A GEMV captured into a graph loads its first weight tile early by default (EARLY_W); the
    replays, each after a kernel that rewrites x, equal the eager result of the new x."""
    rng = rng_for("early-w-graph")
    w = words_weight(rng, FORMATS[1], (1000, 600, 32))
    x = torch.from_numpy(rng.standard_normal((1, 1000)).astype(np.float32)).to(DEVICE)
    source = x.clone()
    seen = []
    launch = qmm._qgemv_words_kernel.run
    monkeypatch.setattr(qmm._qgemv_words_kernel, "run",
                        lambda *a, **k: (seen.append(k.get("EARLY_W")), launch(*a, **k))[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(source * 2.0)
        y = qmm.quantized_matmul(x, w, config=dict(KERNEL="words", XQ=True, XQ_SELF=True))
    assert True in seen, seen
    for scale in (3.0, -1.0):
        source.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        want = qmm.quantized_matmul(source * 2.0, w, config=dict(KERNEL="words", XQ=True, XQ_SELF=True))
        # split-K atomics add in any order: an element near zero may differ past allclose's 1e-5 (seen
        # under 9 test workers on an H100, 2026-12-06); an x read before the copy would be off by O(1)
        assert rel_err(y.cpu(), want.cpu()) < 1e-6
