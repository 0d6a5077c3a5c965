"""fuse_conv_epilogue: a convolution and the elementwise ops after it (activations as ONNX exports
them, a residual add) become one FUSED op, which the CPU backend runs per output tile."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op
from ingot.passes.fuse_conv_epilogue import fuse_conv_epilogue
from fusion_helpers import assert_same_on_cpu, kinds

X = (2, 8, 13, 11)


def relu(g, y):
    return g.maximum(y, 0.0)


def silu(g, y):
    return y * g.sigmoid(y)


def hard_swish(g, y):
    return y * g.minimum(g.maximum(y * (1 / 6) + 0.5, 0.0), 1.0)


def leaky(g, y):
    return g.where(y < 0.0, y * 0.1, y)


def per_channel_scale(g, y):   # after a ReLU: a scale right after the conv folds into its weights (fold_conv_affine)
    return g.maximum(y, 0.0) * g.constant(np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(1, 12, 1, 1)) + 0.25


ACTIVATIONS = {"relu": relu, "silu": silu, "hard_swish": hard_swish, "leaky": leaky, "per_channel": per_channel_scale}


def conv_graph(epilogue, groups=1, residual=False, extra_reader=False, bias=True, m=12):
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder(X, name="x")
    w = rng.standard_normal((m, 8 // groups, 3, 3)).astype(np.float32) * 0.3
    b = rng.standard_normal(m).astype(np.float32) if bias else None
    y = g.conv(x, w, b, strides=(2, 1), pads=((1, 1), (1, 1)), groups=groups)
    z = epilogue(g, y)
    if residual:
        r = g.placeholder(tuple(y.shape), name="r")
        z = z + r
    targets = [z, g.exp(y)] if extra_reader else [z]
    return g.compile(targets=targets, options=ingot.CompileOptions(fusions=frozenset())), tuple(y.shape)


def feeds(out_shape, residual=False):
    rng = np.random.default_rng(1)
    f = {"x": rng.standard_normal(X).astype(np.float32)}
    if residual:
        f["r"] = rng.standard_normal(out_shape).astype(np.float32)
    return f


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("groups,residual", [(1, False), (2, True)])
def test_epilogue_joins_the_conv(name, groups, residual):
    exe, out_shape = conv_graph(ACTIVATIONS[name], groups, residual)
    after, changed = fuse_conv_epilogue(exe.program)
    assert changed and kinds(after) == {"conv_epilogue": 1}
    assert [n.op for n in after.nodes() if n.op not in (Op.PLACEHOLDER, Op.CONSTANT)] == [Op.FUSED]
    assert_same_on_cpu(exe, after, feeds(out_shape, residual))


def test_depthwise_with_silu():
    exe, out_shape = conv_graph(silu, groups=8, bias=False, m=8)
    after, changed = fuse_conv_epilogue(exe.program)
    assert changed and kinds(after) == {"conv_epilogue": 1}
    assert_same_on_cpu(exe, after, feeds(out_shape))


def test_conv_read_elsewhere_stays_alone():
    exe, _ = conv_graph(silu, extra_reader=True)
    after, changed = fuse_conv_epilogue(exe.program)
    assert not changed and not kinds(after)


def test_odd_shaped_operand_stops_the_epilogue():
    def odd(g, y):   # a row vector along the last axis is neither per channel nor the output's shape
        return g.maximum(y, 0.0) + g.constant(np.arange(y.shape[-1], dtype=np.float32))
    exe, out_shape = conv_graph(odd)
    after, changed = fuse_conv_epilogue(exe.program)
    (op,) = [n for n in after.nodes() if n.op == Op.FUSED]
    assert [n.op for n in op.attrs["body"].nodes if n.op != Op.PLACEHOLDER] == [Op.CONV, Op.MAXIMUM]
    assert_same_on_cpu(exe, after, feeds(out_shape))


def test_compiled_for_the_cpu_by_default_and_named_in_options():
    g = ingot.Graph()
    x = g.placeholder(X, name="x")
    y = silu(g, g.conv(x, np.ones((4, 8, 1, 1), np.float32)))
    fused = g.compile(targets=[y])
    assert kinds(fused.program) == {"conv_epilogue": 1}
    plain = g.compile(targets=[y], options=ingot.CompileOptions(fusions=frozenset()))
    assert not kinds(plain.program)
    xs = feeds(None)
    np.testing.assert_allclose(fused.run(xs)[0], plain.run(xs)[0], rtol=1e-5, atol=1e-6)
