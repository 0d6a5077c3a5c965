"""passes/block_channels.py + backends/cpu/blocked.py: chains of 1x1 and depthwise convs kept in the
channel-blocked layout (ops/layout.py) between their kernels. Checks the layout ops against NumPy, which
convs the pass blocks (a chain's inner edges only: no conversion node left, a program output and a
non-conv reader read NCHW), and the compiled chains against the same graph without the pass and against
NumPy, on awkward shapes: channels not a multiple of 16, odd rows, stride 2, a one-pixel image, batch 2,
a residual add."""
import numpy as np
import pytest

import ingot
from ingot.errors import IngotError
from ingot.ir import Node, Op, TensorType
from ingot.ops import infer_type
from ingot.ops.conv import conv
from ingot.ops.layout import block_channels, unblock_channels
from ingot.options import CompileOptions
from ingot.passes.block_channels import _few_lanes_wasted
from ingot.passes.device import FUSIONS

from fusion_helpers import kinds

WITHOUT = CompileOptions(fusions=frozenset(FUSIONS["cpu"]) - {"block_channels"})


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 17, 3, 5), (1, 32, 4, 4), (2, 5, 7)])
def test_layout_ops_round_trip(shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    xb = block_channels(x)
    c = shape[1]
    assert xb.shape == (shape[0], -(-c // 16)) + shape[2:] + (16,)
    for ch in range(c):
        np.testing.assert_array_equal(xb[:, ch // 16, ..., ch % 16], x[:, ch])
    assert not xb[:, -1, ..., c % 16 or 16:].any()   # the padding lanes are zeros
    np.testing.assert_array_equal(unblock_channels(xb, c), x)
    t = infer_type(Op.BLOCK_CHANNELS, [TensorType(shape)], {})
    assert t == TensorType(xb.shape) and infer_type(Op.UNBLOCK_CHANNELS, [t], {"channels": c}) == TensorType(shape)


def test_unblock_rejects_a_channel_count_of_other_blocks():
    with pytest.raises(IngotError, match="unblock_channels"):
        infer_type(Op.UNBLOCK_CHANNELS, [TensorType((1, 2, 3, 16))], {"channels": 40})


def hard_swish(g, y):
    return y * g.minimum(g.maximum(y + 3.0, 0.0), 6.0) * (1 / 6)


def np_hard_swish(y):
    return y * np.clip(y + 3, 0, 6) / 6


def chain(shape, widths, k, stride):
    """x -> [1x1 + hard-swish -> depthwise k stride + ReLU -> 1x1 (+ the block input where shapes allow)]
    per width pair -> a last 1x1; the graph and its NumPy reference."""
    rng = np.random.default_rng(sum(shape) + sum(map(sum, widths)))
    layers = []
    c = shape[1]
    for expand, out in widths:
        layers.append((rng.standard_normal((expand, c, 1, 1)).astype(np.float32) * 0.4,
                       rng.standard_normal(expand).astype(np.float32),
                       rng.standard_normal((expand, 1, k, k)).astype(np.float32) * 0.4,
                       rng.standard_normal(expand).astype(np.float32),
                       rng.standard_normal((out, expand, 1, 1)).astype(np.float32) * 0.3))
        c = out
    last = rng.standard_normal((19, c, 1, 1)).astype(np.float32) * 0.3
    pad = ((k // 2, k // 2), (k // 2, k // 2))
    g = ingot.Graph()
    x = g.placeholder(shape, name="x")
    h = x
    for i, (wa, ba, wd, bd, wp) in enumerate(layers):
        s = stride if i == 0 else 1
        a = hard_swish(g, g.conv(h, wa, ba))
        d = g.maximum(g.conv(a, wd, bd, strides=(s, s), pads=pad, groups=wa.shape[0]), 0.0)
        p = g.conv(d, wp)
        h = p + h if tuple(p.shape) == tuple(h.shape) else p
    y = g.conv(h, last)

    def reference(xv):
        hv = xv
        for i, (wa, ba, wd, bd, wp) in enumerate(layers):
            s = stride if i == 0 else 1
            av = np_hard_swish(conv(hv, wa, ba, (1, 1), (1, 1), ((0, 0), (0, 0)), 1))
            dv = np.maximum(conv(av, wd, bd, (s, s), (1, 1), pad, wa.shape[0]), 0.0)
            pv = conv(dv, wp, None, (1, 1), (1, 1), ((0, 0), (0, 0)), 1)
            hv = pv + hv if pv.shape == hv.shape else pv
        return conv(hv, last, None, (1, 1), (1, 1), ((0, 0), (0, 0)), 1)
    return g, y, reference


@pytest.mark.parametrize("shape,widths,k,stride", [
    ((1, 16, 28, 28), [(72, 32), (88, 32)], 3, 2),     # MobileNet's: a residual between two blocked 1x1 convs
    ((2, 5, 9, 13), [(20, 16), (33, 16)], 5, 2),         # channels past a block, odd rows, batch 2
    ((1, 24, 1, 1), [(40, 24), (48, 24)], 3, 1),         # a one-pixel image
    ((1, 3, 3, 7), [(18, 35), (35, 35)], 3, 1),          # 1x1 convs to 35 channels of 21 positions
])
def test_blocked_chain_matches_numpy_and_the_plain_program(shape, widths, k, stride):
    g, y, reference = chain(shape, widths, k, stride)
    exe = g.compile(targets=[y])
    plain = g.compile(targets=[y], options=WITHOUT)
    assert kinds(exe.program)["blocked"] >= 3 and "blocked" not in kinds(plain.program)
    nodes = exe.program.nodes()
    assert not any(n.op in (Op.BLOCK_CHANNELS, Op.UNBLOCK_CHANNELS) for n in nodes)   # inside the fused ops only
    assert all(o.type.rank == 4 for o in exe.program.outputs)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    want = reference(x)
    tol = dict(rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    for _ in range(2):   # the second run reuses the arranged weights and the scratch
        got = exe.run({"x": x})[0]
        np.testing.assert_allclose(got, want, **tol)
        np.testing.assert_allclose(got, plain.run({"x": x})[0], **tol)


def _blocked_sides(node: Node) -> tuple[bool, bool]:
    """(image read blocked, output written blocked) of a FUSED blocked node."""
    (out,) = node.attrs["body"].outputs
    inner = out.src[0] if out.op == Op.BLOCK_CHANNELS else out
    return any(s.op == Op.UNBLOCK_CHANNELS for s in inner.src), out.op == Op.BLOCK_CHANNELS


def test_chain_ends_read_and_write_nchw():
    """The first conv reads the NCHW placeholder, the last writes the NCHW output; a conv also read by a
    non-conv (here tanh) writes NCHW."""
    rng = np.random.default_rng(3)
    w1, w2, w3 = (rng.standard_normal(s).astype(np.float32) for s in ((24, 8, 1, 1), (24, 1, 3, 3), (32, 24, 1, 1)))
    g = ingot.Graph()
    x = g.placeholder((1, 8, 6, 6), name="x")
    a = g.conv(x, w1)
    b = g.conv(a, w2, pads=((1, 1), (1, 1)), groups=24)   # fused with a: expand_depthwise
    c = g.conv(b, w3)
    d = g.conv(c, rng.standard_normal((16, 32, 1, 1)).astype(np.float32))
    exe = g.compile(targets=[d, g.tanh(c)])
    sides = [_blocked_sides(n) for n in exe.program.nodes() if n.op == Op.FUSED and n.attrs["kind"] == "blocked"]
    assert sides == [(False, True), (True, False)]   # expand_depthwise -> c; c NCHW for tanh, d unblocked
    xv = rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
    plain = g.compile(targets=[d, g.tanh(c)], options=WITHOUT)
    for got, want in zip(exe.run({"x": xv}), plain.run({"x": xv})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_a_lone_conv_is_left_alone():
    g = ingot.Graph()
    x = g.placeholder((1, 20, 5, 5), name="x")
    exe = g.compile(targets=[g.conv(x, np.ones((18, 20, 1, 1), np.float32))])
    assert "blocked" not in kinds(exe.program)


def test_a_1x1_conv_wasting_more_lanes_in_blocks_stays_nchw():
    assert not _few_lanes_wasted(24, 28 * 28)   # 24 of 32 lanes; 784 positions fill 49 vectors
    assert _few_lanes_wasted(16, 56 * 56) and _few_lanes_wasted(96, 49) and _few_lanes_wasted(24, 1)


def test_a_depthwise_conv_alone_in_the_chain():
    """expand_depthwise -> a depthwise conv of its own (blocked in and out) -> 1x1 -> 1x1, batch 2."""
    rng = np.random.default_rng(6)
    ws = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in
          ((33, 20, 1, 1), (33, 1, 3, 3), (33, 1, 5, 5), (32, 33, 1, 1), (16, 32, 1, 1))]
    b = rng.standard_normal(33).astype(np.float32)
    g = ingot.Graph()
    x = g.placeholder((2, 20, 11, 9), name="x")
    a = g.conv(g.conv(x, ws[0]), ws[1], strides=(2, 2), pads=((1, 1), (1, 1)), groups=33)
    d = g.maximum(g.conv(a, ws[2], b, pads=((2, 2), (2, 2)), groups=33), 0.0)
    y = g.conv(g.conv(d, ws[3]), ws[4])
    exe = g.compile(targets=[y])
    sides = [_blocked_sides(n) for n in exe.program.nodes() if n.op == Op.FUSED and n.attrs["kind"] == "blocked"]
    assert sides == [(False, True), (True, True), (True, True), (True, False)]
    xv = rng.standard_normal((2, 20, 11, 9)).astype(np.float32)
    none = ((0, 0), (0, 0))
    av = conv(conv(xv, ws[0], None, (1, 1), (1, 1), none, 1), ws[1], None, (2, 2), (1, 1), ((1, 1), (1, 1)), 33)
    dv = np.maximum(conv(av, ws[2], b, (1, 1), (1, 1), ((2, 2), (2, 2)), 33), 0.0)
    want = conv(conv(dv, ws[3], None, (1, 1), (1, 1), none, 1), ws[4], None, (1, 1), (1, 1), none, 1)
    np.testing.assert_allclose(exe.run({"x": xv})[0], want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_expand_depthwise_blocked_out_in_bands():
    """expand_depthwise (blocks in pairs, rows in several bands: 151 wide, 8-position tiles) writing blocked for a depthwise conv
    after it: a row's last tile running past a block's end must not overwrite the next block's first rows."""
    rng = np.random.default_rng(7)
    ws = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((40, 8, 1, 1), (40, 1, 3, 3), (40, 1, 3, 3))]
    g = ingot.Graph()
    x = g.placeholder((1, 8, 30, 151), name="x")
    a = g.conv(g.conv(x, ws[0]), ws[1], pads=((1, 1), (1, 1)), groups=40)
    y = g.conv(a, ws[2], pads=((1, 1), (1, 1)), groups=40)
    exe = g.compile(targets=[y])
    sides = [_blocked_sides(n) for n in exe.program.nodes() if n.op == Op.FUSED and n.attrs["kind"] == "blocked"]
    assert sides == [(False, True), (True, False)]
    xv = rng.standard_normal((1, 8, 30, 151)).astype(np.float32)
    same = ((1, 1), (1, 1))
    av = conv(conv(xv, ws[0], None, (1, 1), (1, 1), ((0, 0), (0, 0)), 1), ws[1], None, (1, 1), (1, 1), same, 40)
    want = conv(av, ws[2], None, (1, 1), (1, 1), same, 40)
    np.testing.assert_allclose(exe.run({"x": xv})[0], want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
