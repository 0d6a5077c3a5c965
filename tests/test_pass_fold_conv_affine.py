"""fold_conv_affine: conv(x, w, b) * a + s with constant per-channel a and s (an inference-mode batch
norm as imported from ONNX) becomes one convolution with scaled weights and a shifted bias; every
other form is left alone. Each case against the program's NumPy evaluation before the pass."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.fold import fold_constants
from ingot.passes.fold_conv_affine import fold_conv_affine

X = (1, 6, 9, 7)
M = 10


def build(tail, bias=True, groups=1, extra_reader=False, n=1):
    """(program, feeds): x -> conv (3x3, pad 1) -> tail(g, y) [-> and exp(y) as a second output]."""
    rng = np.random.default_rng(7)
    g = ingot.Graph()
    x = g.placeholder((n,) + X[1:], name="x")
    w = rng.standard_normal((M, 6 // groups, 3, 3)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32) if bias else None
    y = g.conv(x, w, b, pads=((1, 1), (1, 1)), groups=groups)
    targets = [tail(g, y, rng)] + ([g.exp(y)] if extra_reader else [])
    program = Program([t.node for t in targets], [], dict(g.constants))
    program, _ = fold_constants(program)
    feeds = {"x": rng.standard_normal((n,) + X[1:]).astype(np.float32)}
    return program, feeds


def channel(rng, shape=(1, M, 1, 1), low=0.5, high=2.0):
    return rng.uniform(low, high, shape).astype(np.float32)


def batch_norm(g, y, rng):   # as importers/onnx_nn.py writes one with constant statistics
    return y * g.reshape(g.constant(channel(rng, (M,))), (M, 1, 1)) + g.reshape(g.constant(channel(rng, (M,), -1, 1)),
                                                                             (M, 1, 1))


def ops(program):
    return [n.op for n in program.nodes() if n.op not in (Op.CONSTANT, Op.PLACEHOLDER)]


FOLDED = {
    "batch_norm": batch_norm,
    "scale_only": lambda g, y, rng: y * g.constant(channel(rng)),
    "constant_first": lambda g, y, rng: g.constant(channel(rng, (M, 1, 1))) * y,
    "shift_sub": lambda g, y, rng: y - g.constant(channel(rng, (1, M, 1, 1), -1, 1)),
    "shift_first": lambda g, y, rng: g.constant(channel(rng, (M, 1, 1), -1, 1)) + y,
    "scalar": lambda g, y, rng: (y * 0.5 + 0.25),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("tail", list(FOLDED))
def test_folds_into_one_convolution(tail, groups, bias):
    program, feeds = build(FOLDED[tail], bias=bias, groups=groups)
    want = evaluate(program, feeds)
    out, changed = fold_conv_affine(program)
    assert changed and ops(out) == [Op.CONV]
    got = evaluate(out, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    conv = out.outputs[0]
    assert all(s.attrs["key"] in out.constants for s in conv.src[1:])
    assert len(out.constants) == len(conv.src) - 1     # the weights folded over are gone


def test_first_convolution_of_a_batch_norm_chain_only_once():
    """conv * a + s, then * a2 + s2 again: all four fold (rounds until none is left)."""
    def twice(g, y, rng):
        return batch_norm(g, batch_norm(g, y, rng), rng)
    program, feeds = build(twice)
    out, changed = fold_conv_affine(program)
    assert changed and ops(out) == [Op.CONV]
    np.testing.assert_allclose(evaluate(out, feeds)[0], evaluate(program, feeds)[0], rtol=1e-5, atol=1e-5)


LEFT = {
    "fed_multiplier": None,   # built below: the multiplier is a placeholder
    "full_shape": lambda g, y, rng: y * g.constant(channel(rng, (1, M, 9, 7))),
    "spatial_vector": lambda g, y, rng: y * g.constant(channel(rng, (1, 1, 1, 7))),
    "constant_minus_conv": lambda g, y, rng: g.constant(channel(rng, (M, 1, 1))) - y,
    "divide": lambda g, y, rng: y / g.constant(channel(rng)),
}


@pytest.mark.parametrize("tail", [t for t in LEFT if LEFT[t] is not None])
def test_other_forms_are_left(tail):
    program, feeds = build(LEFT[tail])
    out, changed = fold_conv_affine(program)
    assert not changed and Op.CONV in ops(out) and len(ops(out)) == 2


def test_a_fed_multiplier_is_left():
    g = ingot.Graph()
    x = g.placeholder(X, name="x")
    a = g.placeholder((1, M, 1, 1), name="a")
    y = g.conv(x, np.ones((M, 6, 1, 1), np.float32)) * a
    out, changed = fold_conv_affine(Program([y.node], [], dict(g.constants)))
    assert not changed


def test_a_convolution_read_twice_is_left():
    program, feeds = build(batch_norm, extra_reader=True)
    out, changed = fold_conv_affine(program)
    assert not changed and ops(out).count(Op.CONV) == 1 and Op.MUL in ops(out)


def test_a_broadcast_that_widens_the_output_is_left():
    """A [2, M, 1, 1] multiplier over a batch-1 output makes a batch of 2: not a per-channel map."""
    program, feeds = build(lambda g, y, rng: y * g.constant(channel(rng, (2, M, 1, 1))))
    out, changed = fold_conv_affine(program)
    assert not changed


def test_a_convolution_that_is_an_output_is_left():
    rng = np.random.default_rng(1)
    g = ingot.Graph()
    x = g.placeholder(X, name="x")
    y = g.conv(x, rng.standard_normal((M, 6, 1, 1)).astype(np.float32))
    z = y * g.constant(channel(rng))
    out, changed = fold_conv_affine(Program([y.node, z.node], [], dict(g.constants)))
    assert not changed


def test_compile_folds_an_onnx_style_batch_norm():
    """Through the whole pipeline: one convolution step, the same numbers as the unfolded reference."""
    program, feeds = build(batch_norm)
    rng = np.random.default_rng(7)
    g = ingot.Graph()
    x = g.placeholder(X, name="x")
    w = rng.standard_normal((M, 6, 3, 3)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    z = batch_norm(g, g.conv(x, w, b, pads=((1, 1), (1, 1))), rng)
    exe = g.compile(targets=[z])
    assert ("fold_conv_affine", True) in exe.history
    want = evaluate(program, feeds)[0]
    np.testing.assert_allclose(exe.run({"x": feeds["x"]})[0], want, rtol=1e-4, atol=1e-4)
