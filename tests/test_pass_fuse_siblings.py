"""fuse_siblings: quantized matmuls over one x become one FUSED op with an output each."""
import numpy as np

import ingot
from ingot.ir import Op
from ingot.passes.fuse_siblings import fuse_siblings
from fusion_helpers import assert_same_on_cpu, kinds, quantized_weight


def siblings_graph():
    g = ingot.Graph()
    x = g.placeholder((3, 64), name="x")
    outs = [g.matmul(x, quantized_weight(g, 64, n, seed=i)) for i, n in enumerate((48, 16, 16))]
    return g, g.compile(targets=outs)


def test_three_matmuls_of_one_x_are_one_op():
    g, exe = siblings_graph()
    assert sum(n.op == Op.QUANTIZED_MATMUL for n in exe.program.nodes()) == 3
    after, changed = fuse_siblings(exe.program)
    assert changed and kinds(after) == {"siblings": 1}
    assert not any(n.op == Op.QUANTIZED_MATMUL for n in after.nodes())
    assert_same_on_cpu(exe, after, {"x": np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)})


def test_a_lone_matmul_is_left_alone():
    g = ingot.Graph()
    x = g.placeholder((3, 64), name="x")
    exe = g.compile(targets=[g.matmul(x, quantized_weight(g, 64, 32))])
    after, changed = fuse_siblings(exe.program)
    assert not changed and not kinds(after)
