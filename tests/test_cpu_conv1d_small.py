"""conv1d_small (short 1-D convolutions, one compiled call with the epilogue) through the compiler against
the NumPy conv reference on awkward shapes: odd channels, strides, padding, dilation, groups, output
lengths 1-16, and epilogues (ReLU, clip, scale and shift, sigmoid, tanh, a filterbank's log(1 + |x|), exp of a
scaled value); longer outputs keep conv.py's
path and must agree too."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import conv1d_small
from ingot.ops.conv import conv

# (C, M, L_in, k, stride, dilation, (pad before, pad after), groups)
CASES = [(1, 258, 576, 256, 128, 1, (0, 0), 1),      # Silero's STFT: 3 columns
         (129, 128, 3, 3, 1, 1, (1, 1), 1),
         (128, 64, 3, 3, 2, 1, (1, 1), 1),           # stride 2 -> 2 columns
         (64, 64, 2, 3, 2, 1, (1, 1), 1),            # -> 1 column
         (128, 1, 1, 1, 1, 1, (0, 0), 1),            # the output conv: one value
         (7, 5, 9, 3, 2, 2, (2, 1), 1),              # dilation, unequal padding
         (6, 9, 5, 2, 1, 1, (0, 3), 3),              # groups, padding past the end
         (5, 5, 4, 3, 1, 1, (1, 1), 5),              # depthwise
         (3, 4, 20, 5, 1, 1, (2, 2), 1)]             # 20 columns: beyond MAX_LENGTH


def relu(g, y):
    return g.maximum(y, 0.0), lambda r: np.maximum(r, 0)


def clip(g, y):
    return g.minimum(g.maximum(y, -0.5), 0.75), lambda r: np.clip(r, -0.5, 0.75)


def affine(g, y):
    return 0.5 - (y * 2.0 + 1.0), lambda r: 0.5 - (r * 2 + 1)


def sigmoid(g, y):
    return g.sigmoid(y), lambda r: 1 / (1 + np.exp(-r))


def tanh(g, y):
    return g.tanh(y - 0.25), lambda r: np.tanh(r - 0.25)


def log_abs(g, y):
    return g.log(g.abs(y) + 1.0), lambda r: np.log(np.abs(r) + 1)


def exp(g, y):
    return g.exp(y * 0.5), lambda r: np.exp(r * 0.5)


EPILOGUES = {"none": lambda g, y: (y, lambda r: r), "relu": relu, "clip": clip, "affine": affine, "sigmoid": sigmoid,
             "tanh": tanh, "log_abs": log_abs, "exp": exp}


PARAMS = [(case, e) for case in CASES for e in ("none", "relu", "sigmoid")] + \
    [(CASES[5], e) for e in ("clip", "affine", "tanh", "log_abs", "exp")] + \
    [(CASES[0], "log_abs")]   # every epilogue on the two-image shape; the filterbank's


@pytest.mark.parametrize("case,epilogue", PARAMS,
                         ids=[f"c{c[0]}m{c[1]}l{c[2]}k{c[3]}s{c[4]}d{c[5]}g{c[7]}-{e}" for c, e in PARAMS])
def test_matches_reference(case, epilogue, monkeypatch):
    c, m, l_in, k, stride, dilation, pads, groups = case
    rng = np.random.default_rng(c * 31 + m)
    n = 2 if case[:3] == (7, 5, 9) else 1
    x = rng.standard_normal((n, c, l_in)).astype(np.float32)
    w = (rng.standard_normal((m, c // groups, k)) / np.sqrt(c // groups * k)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    taken = []
    small_step = conv1d_small.small_step
    monkeypatch.setattr(conv1d_small, "small_step", lambda *a: taken.append(s := small_step(*a)) or s)
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    y, ref = EPILOGUES[epilogue](g, g.conv(xi, g.constant(w), g.constant(b), (stride,), (dilation,), (pads,), groups))
    exe = g.compile(targets=[y])
    want = ref(conv(x, w, b, (stride,), (dilation,), (pads,), groups))
    length = want.shape[2]
    assert (length <= conv1d_small.MAX_LENGTH) == any(s is not None for s in taken)
    for _ in range(2):   # the second run reuses the arranged weights
        np.testing.assert_allclose(exe.run({"x": x})[0], want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
