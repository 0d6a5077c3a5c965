"""FFTs over chosen axes with MPSGraph's scaling modes.

norm="none" scales by nothing (in both directions), "size" divides by the transform size,
"unitary" by its square root. So ifft(fft(x), norm="size") == x.
"""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..ir import Op, TensorType
from . import fail, register

NORMS = ("none", "size", "unitary")
# MPSGraph scaling -> the `norm` of numpy.fft / scipy.fft, for the forward and the inverse transforms
FORWARD_NORM = {"none": "backward", "size": "forward", "unitary": "ortho"}
INVERSE_NORM = {"none": "forward", "size": "backward", "unitary": "ortho"}


def _check(op, types, attrs, want):
    (x,) = types
    axes = attrs["axes"]
    if x.dtype not in want or not axes or any(not 0 <= a < x.rank for a in axes) or len(set(axes)) != len(axes):
        raise fail(op, types, f"a {' or '.join(d.name for d in want)} input and distinct axes within its rank, not {axes}")
    if attrs["norm"] not in NORMS:
        raise fail(op, types, f"norm none, size or unitary, not {attrs['norm']!r}")
    return x


def _fft_rule(op):
    def rule(types, attrs):
        x = _check(op, types, attrs, (dt.complex64, dt.float32))
        return TensorType(x.shape, dt.complex64)
    return rule


def _rfft_rule(types, attrs):
    x = _check(Op.RFFT, types, attrs, (dt.float32,))
    shape = list(x.shape)
    last = attrs["axes"][-1]
    shape[last] = None if shape[last] is None else shape[last] // 2 + 1
    return TensorType(shape, dt.complex64)


def _irfft_rule(types, attrs):
    x = _check(Op.IRFFT, types, attrs, (dt.complex64,))
    shape = list(x.shape)
    last = attrs["axes"][-1]
    n = attrs.get("n")
    shape[last] = n if n is not None else (None if shape[last] is None else 2 * (shape[last] - 1))
    return TensorType(shape, dt.float32)


register(Op.FFT, _fft_rule(Op.FFT),
         lambda xs, a: np.fft.fftn(xs[0], axes=a["axes"], norm=FORWARD_NORM[a["norm"]]).astype(np.complex64))
register(Op.IFFT, _fft_rule(Op.IFFT),
         lambda xs, a: np.fft.ifftn(xs[0], axes=a["axes"], norm=INVERSE_NORM[a["norm"]]).astype(np.complex64))
register(Op.RFFT, _rfft_rule,
         lambda xs, a: np.fft.rfftn(xs[0], axes=a["axes"], norm=FORWARD_NORM[a["norm"]]).astype(np.complex64))


def _irfft(xs, a):
    x = xs[0]
    axes = a["axes"]
    s = [x.shape[ax] for ax in axes[:-1]] + [a["n"] if a.get("n") is not None else 2 * (x.shape[axes[-1]] - 1)]
    return np.fft.irfftn(x, s=s, axes=axes, norm=INVERSE_NORM[a["norm"]]).astype(np.float32)


register(Op.IRFFT, _irfft_rule, _irfft)
