"""Winograd F(2x2, 3x3) 3x3 convolutions (backends/cpu/conv_winograd.py) against the NumPy conv reference:
the kernel on awkward shapes (H or W of 1 to 3, odd sizes, channels not multiples of 16 or of the GEMM
tile's 6 rows, blocks of tile rows) with guard values around the output; through the compiler with each
epilogue (none, bias, SiLU, SiLU + residual, ReLU), a planned concat slot, two images, two threads; the
option that picks it; and the error against the direct kernel on YOLO's shapes."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import conv as conv_module
from ingot.backends.cpu import conv_winograd
from ingot.errors import IngotError
from ingot.ops.conv import conv
from ingot.options import CompileOptions, CpuOptions

pytestmark = pytest.mark.skipif(not conv_winograd.AVAILABLE, reason="the kernels need AVX-512")

PADS = ((1, 1), (1, 1))
KERNEL_CASES = [  # C, M, H, W
    (1, 1, 1, 1), (3, 5, 1, 7), (5, 3, 2, 2), (17, 19, 3, 1), (16, 16, 3, 3), (20, 33, 5, 7), (24, 13, 9, 31),
    (32, 6, 33, 17), (48, 70, 20, 20), (130, 12, 11, 5),
]


def _reference(x, w, b):
    return conv(x.astype(np.float64), w.astype(np.float64), None if b is None else b.astype(np.float64),
                (1, 1), (1, 1), PADS, 1)


def _relative(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("c,m,h,w", KERNEL_CASES)
def test_kernel_matches_reference(c, m, h, w):
    rng = np.random.default_rng(c * 31 + m * 7 + h + w)
    x = rng.standard_normal((c, h, w)).astype(np.float32)
    wt = rng.standard_normal((m, c, 3, 3)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    kernel = conv_winograd.driver((), [], m)
    guard = 37
    flat = np.full(m * h * w + 2 * guard, 1234.5, np.float32)
    out = flat[guard:guard + m * h * w].reshape(m, h, w)
    buffers = conv_winograd.Buffers(c, m, h, w)
    kernel(x, conv_winograd.arrange_weights(wt), b, out, (), *buffers.args())
    assert np.all(flat[:guard] == 1234.5) and np.all(flat[-guard:] == 1234.5)
    assert _relative(out, _reference(x[None], wt, b)[0]) < 2e-6


def test_blocks_of_tile_rows():
    """An input of more tile rows than a block holds (several blocks, the last one short) is still exact."""
    c, m, h, w = 64, 64, 45, 41
    assert conv_winograd.Buffers(c, m, h, w).rblock < (h + 1) // 2
    rng = np.random.default_rng(2)
    x = rng.standard_normal((c, h, w)).astype(np.float32)
    wt = rng.standard_normal((m, c, 3, 3)).astype(np.float32)
    out = np.empty((m, h, w), np.float32)
    conv_winograd.driver((), [], m)(x, conv_winograd.arrange_weights(wt), np.zeros(m, np.float32), out, (),
                                 *conv_winograd.Buffers(c, m, h, w).args())
    assert _relative(out, _reference(x[None], wt, None)[0]) < 2e-6


def _silu(v):
    return v / (1 + np.exp(-v))


EPILOGUES = {
    "none": (lambda g, y, r: y, lambda y, r: y),
    "silu": (lambda g, y, r: y * g.sigmoid(y), lambda y, r: _silu(y)),
    "silu_residual": (lambda g, y, r: y * g.sigmoid(y) + r, lambda y, r: _silu(y) + r),
    "relu_residual": (lambda g, y, r: g.maximum(y + r, 0.0), lambda y, r: np.maximum(y + r, 0)),
}


def _compiled(n, c, m, h, w, epilogue, bias=True, threads=1, channels=1, concat=False, seed=0):
    rng = np.random.default_rng(n + c + m + h + w)
    wt = (rng.standard_normal((m, c, 3, 3)) * 0.2).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32) if bias else None
    build, ref = EPILOGUES[epilogue]
    g = ingot.Graph()
    xi = g.placeholder((n, c, h, w), name="x")
    ri = g.placeholder((n, m, h, w), name="r")
    y = build(g, g.conv(xi, wt, b, pads=PADS), ri)
    if concat:   # the conv writes its slot of the concat's planned buffer
        y = g.concat([y, g.exp(ri)], 1)
    exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(
        threads=threads, float32_precision="float32", winograd_channels=channels)))
    rng = np.random.default_rng([seed, n + c + m + h + w])
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    r = rng.standard_normal((n, m, h, w)).astype(np.float32)
    want = ref(_reference(x, wt, b), r)
    if concat:
        want = np.concatenate([want, np.exp(r)], 1)
    return exe, {k: v for k, v in {"x": x, "r": r}.items() if k in exe.feed_order}, want


@pytest.fixture
def counted(monkeypatch):
    """Every conv size (MIN_MACS 0), and a count of the Winograd steps built."""
    monkeypatch.setattr(conv_winograd, "MIN_MACS", 0)
    built = []
    step = conv_module._winograd_step
    monkeypatch.setattr(conv_module, "_winograd_step", lambda *a, **k: built.append(1) or step(*a, **k))
    return built


@pytest.mark.parametrize("epilogue", sorted(EPILOGUES))
@pytest.mark.parametrize("n,c,m,h,w,bias", [(1, 19, 21, 7, 9, True), (2, 16, 33, 3, 2, False),
                                            (1, 5, 3, 1, 1, True), (1, 24, 16, 18, 37, False)])
def test_compiled_epilogues(counted, epilogue, n, c, m, h, w, bias):
    exe, feeds, want = _compiled(n, c, m, h, w, epilogue, bias)
    assert counted, "the conv did not take the Winograd step"
    got = exe.run(feeds)[0]
    assert got.shape == want.shape
    assert _relative(got, want) < 1e-5
    # new inputs: the second run takes the arguments bound by the first (one image)
    feeds2 = {k: -2 * v for k, v in feeds.items()}
    exe2, _, want2 = _compiled(n, c, m, h, w, epilogue, bias)
    want2 = exe2.run(feeds2)[0]   # (a fresh executable's first, unbound run)
    assert _relative(exe.run(feeds2)[0], want2) < 1e-6 and _relative(want2, want) > 1e-3


def test_compiled_concat_slot_and_threads(counted):
    exe, feeds, want = _compiled(1, 32, 48, 40, 40, "silu", concat=True)
    assert counted
    names = [getattr(fn, "__qualname__", "") for fn, _, _ in exe.plan.steps]
    assert "_winograd_step.<locals>.step" in names, names
    assert _relative(exe.run(feeds)[0], want) < 1e-5
    _, feeds2, want2 = _compiled(1, 32, 48, 40, 40, "silu", concat=True, seed=1)
    assert _relative(exe.run(feeds2)[0], want2) < 1e-5   # the bound arguments (a planned output), new input
    exe, feeds, want = _compiled(1, 64, 64, 40, 40, "silu_residual", threads=2)   # two parts of 32 channels
    assert len(counted) >= 3
    for _ in range(2):
        assert _relative(exe.run(feeds)[0], want) < 1e-5


def test_option_picks_it(counted):
    _compiled(1, 15, 32, 8, 8, "none", channels=16)   # 15 input channels < 16
    _compiled(1, 32, 32, 8, 8, "none", channels=0)    # never
    assert not counted
    _compiled(1, 16, 16, 8, 8, "none", channels=16)
    assert counted
    with pytest.raises(IngotError, match="winograd_channels"):
        CpuOptions(winograd_channels=-1)


def test_default_size_threshold():
    """Below MIN_MACS (a small conv) the direct kernels stay; YOLO's 16 x 80 x 80 -> 16 runs here."""
    assert not conv_winograd.fits(3, 3, (1, 1), (1, 1), PADS, 1, 32, 32, 10, 10, 16)
    assert conv_winograd.fits(3, 3, (1, 1), (1, 1), PADS, 1, 16, 16, 80, 80, 16)
    assert not conv_winograd.fits(3, 3, (2, 2), (1, 1), PADS, 1, 64, 64, 80, 80, 16)
    assert not conv_winograd.fits(3, 3, (1, 1), (1, 1), ((1, 1), (0, 1)), 1, 64, 64, 80, 80, 16)
    assert not conv_winograd.fits(3, 3, (1, 1), (2, 2), PADS, 1, 64, 64, 80, 80, 16)
    assert not conv_winograd.fits(3, 3, (1, 1), (1, 1), PADS, 2, 64, 64, 80, 80, 16)


@pytest.mark.parametrize("c,m,hw", [(64, 64, 40), (128, 128, 20), (16, 16, 80)])
def test_close_to_the_direct_kernel(c, m, hw):
    """On YOLO's shapes the Winograd conv is within 1e-5 (relative to the largest output) of the direct one."""
    rng = np.random.default_rng(c)
    x = rng.standard_normal((1, c, hw, hw)).astype(np.float32)
    wt = (rng.standard_normal((m, c, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    outs = []
    for channels in (0, 16):
        g = ingot.Graph()
        xi = g.placeholder(x.shape, name="x")
        y = g.conv(xi, wt, b, pads=PADS)
        exe = g.compile(targets=[y * g.sigmoid(y)], options=CompileOptions(cpu=CpuOptions(
            threads=1, float32_precision="float32", winograd_channels=channels)))
        outs.append(exe.run({"x": x})[0])
    assert _relative(outs[1], outs[0]) < 1e-5
