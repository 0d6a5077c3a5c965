"""fuse_norms: written-out RMSNorm and GELU (as ONNX exporters write T5 and BERT) become rms_norm and gelu."""
import math

import numpy as np
import pytest

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.fuse_norms import fuse_norms

SHAPE = (3, 5, 37)


def ops_of(program: Program) -> list[Op]:
    return [n.op for n in program.nodes()]


def rms_graph(form: str, weight: str, rng):
    g = ingot.Graph()
    x = g.placeholder(SHAPE, name="x")
    square = {"mul": x * x, "pow": g.pow(x, g.constant(np.float32(2)))}["pow" if form == "pow" else "mul"]
    ms = g.mean(square, axis=-1, keepdims=True) + g.constant(np.float32(1e-6))
    y = {"recip": x * (g.constant(np.float32(1)) / g.sqrt(ms)), "div": x / g.sqrt(ms), "rsqrt": g.rsqrt(ms) * x,
         "pow": x * (g.constant(np.float32(1)) / g.sqrt(ms))}[form]
    w = rng.standard_normal(SHAPE[-1]).astype(np.float32)
    if weight == "vector":
        y = g.constant(w) * y
    elif weight == "broadcast":
        y = y * g.constant(w.reshape(1, 1, -1))
    return g, y, w if weight != "none" else None


@pytest.mark.parametrize("form", ["recip", "div", "rsqrt", "pow"])
@pytest.mark.parametrize("weight", ["none", "vector", "broadcast"])
def test_rms_norm_forms_become_one_op(form, weight):
    rng = np.random.default_rng(len(form) + len(weight))
    g, y, w = rms_graph(form, weight, rng)
    program = Program([y.node], [], dict(g.constants))
    x = rng.standard_normal(SHAPE).astype(np.float32) * 3
    out, changed = fuse_norms(program)
    assert changed
    assert ops_of(out).count(Op.RMS_NORM) == 1 and Op.SQRT not in ops_of(out) and Op.RSQRT not in ops_of(out)
    assert Op.MEAN not in ops_of(out) and Op.MUL not in ops_of(out)
    (norm,) = [n for n in out.nodes() if n.op == Op.RMS_NORM]
    assert len(norm.src) == (1 if w is None else 2)
    got = evaluate(out, {"x": x})[0]
    xd = x.astype(np.float64)
    want = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6) * (1 if w is None else w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, evaluate(program, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_a_mean_over_another_axis_or_another_tensor_is_left_alone():
    g = ingot.Graph()
    x, z = g.placeholder(SHAPE, name="x"), g.placeholder(SHAPE, name="z")
    eps = g.constant(np.float32(1e-6))
    other_axis = x / g.sqrt(g.mean(x * x, axis=1, keepdims=True) + eps)
    other_tensor = x / g.sqrt(g.mean(z * z, axis=-1, keepdims=True) + eps)
    program = Program([other_axis.node, other_tensor.node], [], dict(g.constants))
    out, changed = fuse_norms(program)
    assert not changed and Op.RMS_NORM not in ops_of(out)


def tanh_gelu(g, x, form):
    cube = {"mul": x * x * x, "pow": g.pow(x, g.constant(np.float32(3)))}["pow" if form == "pow" else "mul"]
    c = g.constant(np.float32(math.sqrt(2 / math.pi)))
    tail = g.tanh(c * (x + g.constant(np.float32(0.044715)) * cube)) + g.constant(np.float32(1))
    half = g.constant(np.float32(0.5))
    return {"t5": (x * half) * tail, "pow": (x * half) * tail, "right": (x * tail) * half, "inner": x * (half * tail)}[form]


@pytest.mark.parametrize("form", ["t5", "pow", "right", "inner"])
def test_tanh_gelu_forms_become_one_op(form):
    g = ingot.Graph()
    x = g.placeholder(SHAPE, name="x")
    y = tanh_gelu(g, x, form)
    program = Program([y.node], [], dict(g.constants))
    out, changed = fuse_norms(program)
    assert changed and ops_of(out).count(Op.GELU) == 1 and Op.TANH not in ops_of(out)
    (gelu,) = [n for n in out.nodes() if n.op == Op.GELU]
    assert gelu.attrs["approximate"] == "tanh"
    xv = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32) * 3
    xd = xv.astype(np.float64)
    want = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(evaluate(out, {"x": xv})[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["bert", "times", "right", "inner"])
def test_erf_gelu_forms_become_one_op(form):
    """0.5 x (1 + erf(x / sqrt 2)) as torch.onnx writes nn.GELU (div, erf, add, mul, mul), or with x * (1 / sqrt 2)."""
    g = ingot.Graph()
    x = g.placeholder(SHAPE, name="x")
    scaled = x * g.constant(np.float32(1 / math.sqrt(2))) if form == "times" else x / g.constant(np.float32(math.sqrt(2)))
    tail = g.erf(scaled) + g.constant(np.float32(1))
    half = g.constant(np.float32(0.5))
    y = {"bert": half * (tail * x), "times": (x * half) * tail, "right": (x * tail) * half, "inner": x * (half * tail)}[form]
    out, changed = fuse_norms(Program([y.node], [], dict(g.constants)))
    assert changed and ops_of(out).count(Op.GELU) == 1 and Op.ERF not in ops_of(out)
    (gelu,) = [n for n in out.nodes() if n.op == Op.GELU]
    assert gelu.attrs["approximate"] == "none"
    xv = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32) * 3
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in xv.astype(np.float64).reshape(-1)]).reshape(SHAPE)
    np.testing.assert_allclose(evaluate(out, {"x": xv})[0], want, rtol=1e-5, atol=1e-6)
    exe = g.compile(targets=[y])   # the CPU's gelu kernel, in the default pipeline
    assert Op.ERF not in [n.op for n in exe.program.nodes()]
    np.testing.assert_allclose(exe.run({"x": xv})[0], want, rtol=1e-5, atol=1e-6)


def test_an_erf_gelu_of_another_scale_is_left_alone():
    g = ingot.Graph()
    x = g.placeholder(SHAPE, name="x")
    y = (x * (g.erf(x / g.constant(np.float32(1.3))) + g.constant(np.float32(1)))) * g.constant(np.float32(0.5))
    out, changed = fuse_norms(Program([y.node], [], dict(g.constants)))
    assert not changed and Op.GELU not in ops_of(out)


def test_a_gelu_with_another_constant_is_left_alone():
    g = ingot.Graph()
    x = g.placeholder(SHAPE, name="x")
    tail = g.tanh(g.constant(np.float32(0.7)) * (x + g.constant(np.float32(0.044715)) * x * x * x)) + g.constant(np.float32(1))
    y = (x * g.constant(np.float32(0.5))) * tail
    out, changed = fuse_norms(Program([y.node], [], dict(g.constants)))
    assert not changed and Op.GELU not in ops_of(out)


def test_compiled_cpu_gelu_tanh_and_rms_norm_match_the_written_out_graph():
    rng = np.random.default_rng(5)
    g, y, _ = rms_graph("recip", "vector", rng)
    z = tanh_gelu(g, y, "t5")
    exe = g.compile(targets=[z])
    ops = [n.op for n in exe.program.nodes()]
    assert Op.RMS_NORM in ops and Op.GELU in ops and Op.TANH not in ops
    xv = rng.standard_normal(SHAPE).astype(np.float32)
    want = evaluate(Program([z.node], [], dict(g.constants)), {"x": xv})[0]
    np.testing.assert_allclose(exe.run({"x": xv})[0], want, rtol=1e-5, atol=1e-6)
