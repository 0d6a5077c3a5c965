"""Conv steps whose operands other than the input are constants and whose output is planned keep the
kernel's other arguments from their first call (conv._direct_step, conv._spatial_step): later runs on
new inputs still equal the NumPy reference, awkward channel counts (a bias padded to blocks of 16)."""
import numpy as np

import ingot
from ingot.ops.conv import conv
from ingot.options import CompileOptions, CpuOptions

FLOAT32 = CompileOptions(cpu=CpuOptions(threads=1, float32_precision="float32"))


def _silu(v):
    return v / (1 + np.exp(-v))


def test_bound_steps_follow_new_inputs():
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((40, 24, 3, 3)) * 0.2).astype(np.float32)   # direct kernel: 16 + 16 + 8 outputs
    b1 = rng.standard_normal(40).astype(np.float32)
    w2 = (rng.standard_normal((21, 40, 1, 1)) * 0.2).astype(np.float32)   # pointwise
    b2 = rng.standard_normal(21).astype(np.float32)
    w3 = (rng.standard_normal((19, 21, 1, 1)) * 0.2).astype(np.float32)   # pointwise, stride 2 (subsampled)
    b3 = rng.standard_normal(19).astype(np.float32)
    g = ingot.Graph()
    x = g.placeholder((1, 24, 13, 17), name="x")
    y = g.conv(x, w1, b1, pads=((1, 1), (1, 1)))
    y = y * g.sigmoid(y)
    y = g.maximum(g.conv(y, w2, b2), 0.0)
    y = g.conv(y, w3, b3, strides=(2, 2))
    y = g.concat([y, y], 1)   # (so that every conv's output is a planned buffer)
    exe = g.compile(targets=[y], options=FLOAT32)
    names = [getattr(fn, "__qualname__", "") for fn, _, _ in exe.plan.steps]
    assert names.count("_direct_step.<locals>.step") == 1 and names.count("_spatial_step.<locals>.step") == 2, names
    for seed in range(3):   # the first run binds; the later ones take the bound path
        xv = np.random.default_rng(seed).standard_normal((1, 24, 13, 17)).astype(np.float32)
        h = conv(xv, w1, b1, (1, 1), (1, 1), ((1, 1), (1, 1)), 1)
        h = np.maximum(conv(_silu(h), w2, b2, (1, 1), (1, 1), ((0, 0), (0, 0)), 1), 0)
        want = conv(h, w3, b3, (2, 2), (1, 1), ((0, 0), (0, 0)), 1)
        want = np.concatenate([want, want], 1)
        got = exe.run({"x": xv})[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
