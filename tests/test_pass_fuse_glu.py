"""fuse_glu: act(gate) * up read only by a quantized matmul becomes one FUSED op (the down GEMV), act
silu (SwiGLU) or gelu with the tanh approximation (GeGLU, Gemma)."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op
from ingot.passes.fuse_glu import fuse_glu
from fusion_helpers import assert_same_on_cpu, kinds, quantized_weight


ACTIVATIONS = {"silu": lambda g, x: g.silu(x), "gelu_tanh": lambda g, x: g.gelu(x, approximate="tanh"),
               "gelu": lambda g, x: g.gelu(x)}


def glu_graph(rows=2, extra_reader=False, activation="silu"):
    g = ingot.Graph()
    gate = g.placeholder((rows, 64), name="gate")
    up = g.placeholder((rows, 64), name="up")
    h = ACTIVATIONS[activation](g, gate) * up
    y = g.matmul(h, quantized_weight(g, 64, 40))
    return g, g.compile(targets=[y, g.exp(h)] if extra_reader else [y])


def feeds(rows=2):
    rng = np.random.default_rng(3)
    return {"gate": rng.standard_normal((rows, 64)).astype(np.float32), "up": rng.standard_normal((rows, 64)).astype(np.float32)}


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_product_into_the_gemv(activation):
    g, exe = glu_graph(activation=activation)
    after, changed = fuse_glu(exe.program)
    assert changed and kinds(after) == {"glu_gemv": 1}
    assert not any(n.op in (Op.SILU, Op.GELU, Op.MUL, Op.QUANTIZED_MATMUL) for n in after.nodes())
    assert_same_on_cpu(exe, after, feeds())


def test_exact_gelu_is_not_a_gate_the_gemv_computes():
    g, exe = glu_graph(activation="gelu")
    after, changed = fuse_glu(exe.program)
    assert not changed and not kinds(after)


@pytest.mark.parametrize("why", ["product read elsewhere", "too many rows"])
def test_left_alone(why):
    g, exe = glu_graph(rows=20 if why == "too many rows" else 2, extra_reader=why == "product read elsewhere")
    after, changed = fuse_glu(exe.program, words_max_rows=16)
    assert not changed and not kinds(after)
