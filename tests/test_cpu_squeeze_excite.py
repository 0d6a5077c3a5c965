"""fuse_squeeze_excite + backends/cpu/squeeze_excite.py: global pool, two 1x1 convs with their
activations, channel scale as one FUSED op and one kernel, against NumPy on awkward shapes."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op
from fusion_helpers import kinds


def hard_sigmoid(g, y):
    return g.maximum(g.minimum(y * (1 / 6) + 0.5, 1.0), 0.0)


def np_hard_sigmoid(y):
    return np.clip(y / 6 + 0.5, 0.0, 1.0)


def se_graph(shape, hidden, gate="hard", swap=False, conv_bias=True, extra_reader=False):
    """x -> x * gate(fc2(relu(fc1(mean(x))))), and the same in NumPy."""
    rng = np.random.default_rng(0)
    n, c = shape[:2]
    w1 = rng.standard_normal((hidden, c, 1, 1)).astype(np.float32) * 0.5
    w2 = rng.standard_normal((c, hidden, 1, 1)).astype(np.float32) * 0.5
    b1 = rng.standard_normal(hidden).astype(np.float32)
    b2 = rng.standard_normal(c).astype(np.float32)
    g = ingot.Graph()
    x = g.placeholder(shape, name="x")
    m = g.mean(x, (2, 3), keepdims=True)
    if conv_bias:
        h = g.conv(m, w1, b1)
    else:   # PaddlePaddle's exports: the bias as a per-channel add after the conv
        h = g.conv(m, w1) + g.constant(b1.reshape(1, hidden, 1, 1))
    h = g.maximum(h, 0.0)
    s = g.conv(h, w2, b2)
    s = hard_sigmoid(g, s) if gate == "hard" else g.sigmoid(s)
    y = s * x if swap else x * s
    targets = [y, g.exp(m)] if extra_reader else [y]
    exe = g.compile(targets=targets)

    def reference(xv):
        mv = xv.astype(np.float64).mean(axis=(2, 3))
        hv = np.maximum(mv @ w1.reshape(hidden, c).T + b1, 0.0)
        sv = hv @ w2.reshape(c, hidden).T + b2
        sv = np_hard_sigmoid(sv) if gate == "hard" else 1 / (1 + np.exp(-sv))
        return xv * sv[:, :, None, None]
    return exe, reference


@pytest.mark.parametrize("shape,hidden,gate,swap,conv_bias", [
    ((1, 16, 56, 56), 8, "hard", False, True),
    ((2, 13, 7, 5), 5, "hard", True, False),     # odd channels, batch 2, the scale on the left
    ((1, 9, 1, 2), 3, "sigmoid", False, True),   # two positions
    ((1, 33, 3, 17), 1, "sigmoid", True, False),
])
def test_squeeze_excite_is_one_step_and_matches_numpy(shape, hidden, gate, swap, conv_bias):
    exe, reference = se_graph(shape, hidden, gate, swap, conv_bias)
    assert kinds(exe.program) == {"squeeze_excite": 1}
    assert not [n for n in exe.program.nodes() if n.op in (Op.MEAN, Op.MUL, Op.CONV)]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 3
    for _ in range(2):   # the second run reuses the arranged weights
        np.testing.assert_allclose(exe.run({"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)


def test_pool_read_elsewhere_stays_unfused():
    exe, reference = se_graph((1, 8, 5, 5), 4, extra_reader=True)
    assert "squeeze_excite" not in kinds(exe.program)
    x = np.random.default_rng(2).standard_normal((1, 8, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)


def test_fusion_can_be_left_out():
    g_opts = ingot.CompileOptions(fusions=frozenset({"conv_epilogue"}))
    rng = np.random.default_rng(3)
    g = ingot.Graph()
    x = g.placeholder((1, 4, 3, 3), name="x")
    s = g.conv(g.maximum(g.conv(g.mean(x, (2, 3), keepdims=True), rng.standard_normal((2, 4, 1, 1)).astype(np.float32)), 0.0),
               rng.standard_normal((4, 2, 1, 1)).astype(np.float32))
    exe = g.compile(targets=[x * g.sigmoid(s)], options=g_opts)
    assert "squeeze_excite" not in kinds(exe.program)
