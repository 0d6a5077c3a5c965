"""fuse_add_rms_norm: a residual add and the rms_norm reading it become one FUSED op writing both."""
import numpy as np

import ingot
from ingot.ir import Op
from ingot.passes.fuse_add_rms_norm import fuse_add_rms_norm
from fusion_helpers import assert_same_on_cpu, kinds


def test_add_then_norm_is_one_op_with_two_outputs():
    g = ingot.Graph()
    a = g.placeholder((5, 48), name="a")
    b = g.placeholder((5, 48), name="b")
    s = a + b
    y = g.rms_norm(s, g.constant(np.linspace(0.5, 1.5, 48).astype(np.float32)), 1e-5)
    exe = g.compile(targets=[y, s * 2.0])       # the sum is read again: the residual stream
    after, changed = fuse_add_rms_norm(exe.program)
    assert changed and kinds(after) == {"add_rms_norm": 1}
    assert not any(n.op in (Op.ADD, Op.RMS_NORM) for n in after.nodes())
    rng = np.random.default_rng(4)
    assert_same_on_cpu(exe, after, {"a": rng.standard_normal((5, 48)).astype(np.float32),
                                    "b": rng.standard_normal((5, 48)).astype(np.float32)})


def test_a_broadcast_add_is_left_alone():
    g = ingot.Graph()
    a = g.placeholder((5, 48), name="a")
    b = g.placeholder((48,), name="b")
    exe = g.compile(targets=[g.rms_norm(a + b, None, 1e-5)])
    after, changed = fuse_add_rms_norm(exe.program)
    assert not changed
