"""fuse_glu: silu(gate) * up read only by a quantized matmul becomes one FUSED op (the down GEMV)."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op
from ingot.passes.fuse_glu import fuse_glu
from fusion_helpers import assert_same_on_cpu, kinds, quantized_weight


def glu_graph(rows=2, extra_reader=False):
    g = ingot.Graph()
    gate = g.placeholder((rows, 64), name="gate")
    up = g.placeholder((rows, 64), name="up")
    h = g.silu(gate) * up
    y = g.matmul(h, quantized_weight(g, 64, 40))
    return g, g.compile(targets=[y, g.exp(h)] if extra_reader else [y])


def feeds(rows=2):
    rng = np.random.default_rng(3)
    return {"gate": rng.standard_normal((rows, 64)).astype(np.float32), "up": rng.standard_normal((rows, 64)).astype(np.float32)}


def test_silu_mul_into_the_gemv():
    g, exe = glu_graph()
    after, changed = fuse_glu(exe.program)
    assert changed and kinds(after) == {"glu_gemv": 1}
    assert not any(n.op in (Op.SILU, Op.MUL, Op.QUANTIZED_MATMUL) for n in after.nodes())
    assert_same_on_cpu(exe, after, feeds())


@pytest.mark.parametrize("why", ["product read elsewhere", "too many rows"])
def test_left_alone(why):
    g, exe = glu_graph(rows=20 if why == "too many rows" else 2, extra_reader=why == "product read elsewhere")
    after, changed = fuse_glu(exe.program, words_max_rows=16)
    assert not changed and not kinds(after)
