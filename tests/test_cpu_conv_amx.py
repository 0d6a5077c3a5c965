"""conv_amx (float32 convolutions as three or six bfloat16 products on AMX tiles) against the NumPy conv
reference on awkward shapes: strides 1-3, dilation, asymmetric pads, odd channel counts, output channels
and rows that fill no tile, 1-D; the epilogue (per-channel operands, a residual) through the compiler;
and the option that keeps the AVX-512 kernels. Skipped where the host has no AMX."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import conv_amx
from ingot.errors import IngotError
from ingot.ops.conv import conv
from ingot.options import CompileOptions, CpuOptions

amx = pytest.mark.skipif(not conv_amx.available(), reason="no AMX tiles on this host")

# C, M, (H, W), (kh, kw), strides, dilations, pads ((top, bottom), (left, right))
CASES = [
    (16, 32, (20, 20), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),
    (9, 17, (9, 17), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1))),
    (33, 50, (11, 23), (5, 5), (2, 2), (1, 1), ((2, 2), (2, 2))),
    (40, 48, (17, 19), (3, 3), (1, 1), (2, 2), ((2, 2), (2, 2))),
    (64, 70, (31, 37), (3, 3), (2, 2), (1, 1), ((0, 1), (1, 0))),   # asymmetric, as TF-style exports pad
    (71, 33, (12, 40), (2, 4), (1, 3), (1, 1), ((0, 0), (1, 2))),
    (24, 16, (8, 9), (3, 1), (3, 1), (2, 1), ((1, 2), (0, 0))),
    (96, 130, (9, 11), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1))),   # several chunks, M past 128
    (10, 64, (5, 40), (1, 7), (1, 1), (1, 3), ((0, 0), (9, 9))),
    (130, 256, (9, 8), (1, 1), (1, 1), (1, 1), ((0, 0), (0, 0))),   # 1x1 with many output channels
]


def _tolerance(want: np.ndarray, precision: str) -> float:
    """bf16x3 drops ~2^-16 of each product (the splits' rounding and lo*lo), bf16x6 ~2^-24: bounds on the
    error against the largest output, with room for float32's own summation error."""
    return (4e-5 if precision == "bf16x3" else 2e-6) * float(np.abs(want).max())


def _graph_conv(x, w, b, strides, dilations, pads, precision, one_d=False):
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    y = g.conv(xi, w, b, strides=strides, dilations=dilations, pads=pads)
    exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(float32_precision=precision)))
    return exe.run({"x": x})[0]


@amx
@pytest.mark.parametrize("precision", ["bf16x3", "bf16x6"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-s{c[4]}-d{c[5]}" for c in CASES])
def test_matches_reference(case, precision):
    c, m, hw, k, strides, dilations, pads = case
    rng = np.random.default_rng(sum(hw) * 31 + c + m)
    x = rng.standard_normal((2, c) + hw).astype(np.float32)
    w = rng.standard_normal((m, c) + k).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    want = conv(x, w, b, strides, dilations, pads, 1)
    got = _graph_conv(x, w, b, strides, dilations, pads, precision)
    assert conv_amx.fits(k[0], k[1], 1, c, m) and conv_amx.worth_it(k[0], k[1], c, m, want.shape[-1] * want.shape[-2])
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want, precision))


@amx
def test_tiles_run_and_drop_no_more_than_bf16x3_allows():
    """The kernel is the one that ran (its result differs from float32's in the bits bf16x3 drops), and
    bf16x6 is within float32's error of the float32 kernels."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 48, 15, 21)).astype(np.float32)
    w = rng.standard_normal((40, 48, 3, 3)).astype(np.float32)
    args = (x, w, None, (1, 1), (1, 1), ((1, 1), (1, 1)))
    exact = _graph_conv(*args, "float32")
    x3, x6 = _graph_conv(*args, "bf16x3"), _graph_conv(*args, "bf16x6")
    scale = float(np.abs(exact).max())
    assert np.abs(x3 - exact).max() > 1e-7 * scale   # not the float32 kernels
    assert np.abs(x3 - exact).max() < 4e-5 * scale
    assert np.abs(x6 - exact).max() < 2e-6 * scale < np.abs(x3 - exact).max()


@amx
def test_one_d():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 20, 77)).astype(np.float32)
    w = rng.standard_normal((36, 20, 5)).astype(np.float32)
    want = conv(x, w, None, (2,), (1,), ((2, 1),), 1)
    got = _graph_conv(x, w, None, (2,), (1,), ((2, 1),), "bf16x3")
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(want, "bf16x3"))


@amx
@pytest.mark.parametrize("n,c,m,hw,stride", [(2, 24, 48, (13, 17), 1), (1, 40, 35, (9, 9), 2)])
def test_epilogue_with_channel_operands_and_a_residual(n, c, m, hw, stride):
    """A folded batch norm, SiLU and a residual add after the conv, as a YOLO's blocks export them."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, c) + hw).astype(np.float32)
    w = (rng.standard_normal((m, c, 3, 3)) * 0.2).astype(np.float32)
    ref = conv(x, w, None, (stride, stride), (1, 1), ((1, 1), (1, 1)), 1)
    r = rng.standard_normal(ref.shape).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (1, m, 1, 1)).astype(np.float32)
    g = ingot.Graph()
    xi, ri = g.placeholder(x.shape, name="x"), g.placeholder(r.shape, name="r")
    y = g.conv(xi, w, strides=(stride, stride), pads=((1, 1), (1, 1))) * g.constant(scale) + 0.5
    z = y * g.sigmoid(y) + ri
    exe = g.compile(targets=[z])
    assert [n.attrs["kind"] for n in exe.program.nodes() if n.op.name == "FUSED"] == ["conv_epilogue"]
    y_ref = ref * scale + 0.5
    want = y_ref / (1 + np.exp(-y_ref)) + r
    np.testing.assert_allclose(exe.run({"x": x, "r": r})[0], want, rtol=0, atol=_tolerance(want, "bf16x3"))


def test_the_option_is_checked():
    with pytest.raises(IngotError, match="float32_precision"):
        CpuOptions(float32_precision="bf16")
    assert CompileOptions.from_json(CompileOptions(cpu=CpuOptions(float32_precision="float32")).to_json()).cpu.float32_precision \
        == "float32"


def test_which_convolutions_take_the_tiles():
    assert conv_amx.fits(3, 3, 1, 16, 16) and not conv_amx.fits(3, 3, 2, 16, 16)
    assert not conv_amx.fits(3, 3, 1, 3, 16) and not conv_amx.fits(3, 3, 1, 16, 8)
    assert not conv_amx.worth_it(3, 3, 16, 16, 15)
    assert conv_amx.worth_it(3, 3, 16, 16, 49) and not conv_amx.worth_it(1, 1, 128, 64, 1600)
    assert conv_amx.worth_it(1, 1, 192, 64, 1600) and not conv_amx.worth_it(1, 1, 576, 96, 49)


def test_schedules_load_only_what_changes():
    """Per tap and chunk: x3 in 10 tile loads for 12 products at either block shape, x6 in 18 for 24."""
    for m_tiles in (1, 2):
        for precision, loads, dps in (("bf16x3", 10, 12), ("bf16x6", 18, 24)):
            ops = conv_amx.schedule(conv_amx.PRODUCTS[precision], m_tiles)
            assert sum(op[0] == "load" for op in ops) <= loads and sum(op[0] == "dp" for op in ops) == dps


def test_chunks_are_equal_and_even():
    for c in range(1, 300):
        chunks, kc = conv_amx.chunking(c)
        assert kc % 2 == 0 and kc <= 32 and chunks * kc >= c and chunks == -(-c // 32)


def test_split_parts_sum_back():
    """The bfloat16 parts of float32 values add back to them within 2^-17 (two parts) and 2^-25 (three)."""
    rng = np.random.default_rng(6)
    a = (rng.standard_normal(4096) * np.exp(rng.uniform(-20, 20, 4096))).astype(np.float32)
    for parts, bound in ((2, 2.0 ** -17), (3, 2.0 ** -25)):
        got = sum(((p.astype(np.uint32) << 16).view(np.float32).astype(np.float64)) for p in conv_amx.split(a, parts))
        assert np.all(np.abs(got - a) <= bound * np.abs(a.astype(np.float64)))


@amx
@pytest.mark.parametrize("precision", ["bf16x3", "bf16x6"])
@pytest.mark.parametrize("lead,k,n", [((37,), 200, 70), ((2, 17), 64, 64), ((3, 5, 7), 96, 130), ((128,), 515, 80),
                                       ((16,), 64, 1000)])
def test_matmul_by_constant_weights(lead, k, n, precision):
    """x [..., K] @ w [K, N] on the tiles (matmul_amx.py): rows, K and N that fill no tile, as the graph's
    output and as an intermediate value; BLAS's exact products with float32_precision "float32"."""
    from ingot.backends.cpu import matmul_amx
    rng = np.random.default_rng(k + n)
    x = rng.standard_normal(lead + (k,)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    rows = int(np.prod(lead))
    assert matmul_amx.fits(rows, k, n)
    want = x @ w
    for intermediate in (False, True):
        g = ingot.Graph()
        xi = g.placeholder(x.shape, name="x")
        y = g.matmul(xi, g.constant(w))
        y = g.tanh(y) if intermediate else y
        ref = np.tanh(want) if intermediate else want
        for prec in (precision, "float32"):
            exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(float32_precision=prec)))
            got = exe.run({"x": x})[0]
            if prec == "float32":
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
            else:
                np.testing.assert_allclose(got, ref, rtol=0, atol=_tolerance(want, prec))
                assert intermediate or np.abs(got - want).max() > 0   # the tiles ran, not BLAS


@amx
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_lstm_input_projection_on_the_tiles(direction):
    """An LSTM with constant W and bias: its input projection x W^T + biases on the tiles (recurrent.py),
    the recurrence as before; within bf16x3's error of the reference, not equal to the float32 panels'."""
    from ingot.backends.cpu import LOWERINGS
    from ingot.ir import Node, Op
    from ingot.options import CpuOptions
    from test_cpu_recurrent import inputs, lstm_node
    sizes, lengths = (20, 2, 70, 40), (20, 13)
    node = lstm_node(direction, sizes=sizes)
    src = list(node.src)
    for i in (1, 3):   # W and the biases as constants
        src[i] = Node(Op.CONSTANT, src[i].type, (), {"key": f"c{i}"})
    node = Node(Op.LSTM, node.type, tuple(src), node.attrs)
    xs = inputs(direction, 11, lengths, sizes)
    want = ingot.ops.reference(Op.LSTM, xs, node.attrs)
    tiles = LOWERINGS[Op.LSTM](node, None, CpuOptions())
    exact = LOWERINGS[Op.LSTM](node, None, CpuOptions(float32_precision="float32"))
    projection = np.einsum("tbi,dgi->tbdg", xs[0], xs[1])
    bound = 2 * _tolerance(projection, "bf16x3")   # the projection's error, at most doubled by the gates
    for _ in range(2):   # the second run reuses the split weights
        got, ref = tiles(*xs), exact(*xs)
        for g, r, w in zip(got, ref, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=bound)
            np.testing.assert_allclose(r, w, rtol=1e-5, atol=1e-5)
        assert any(np.abs(g - r).max() > 0 for g, r in zip(got, ref))
