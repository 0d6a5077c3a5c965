"""ONNX converters for signal processing: DFT, STFT (frames as a strided view), window functions."""
from __future__ import annotations

import numpy as np

from .. import dtypes as dt
from ..errors import IngotError
from ..graph import Tensor
from ..ops import normalize_axis
from .onnx_ops import Context, OnnxNode, converter, onnx_to_ingot_dtype


def _window_values(node: OnnxNode, size: int) -> np.ndarray:
    periodic = node.attr("periodic", 1)
    n = size if periodic else size - 1
    i = np.arange(size, dtype=np.float64)
    if node.op_type == "HannWindow":
        w = np.sin(np.pi * i / n) ** 2
    elif node.op_type == "HammingWindow":
        a0 = 25.0 / 46.0
        w = a0 - (1 - a0) * np.cos(2 * np.pi * i / n)
    else:  # Blackman
        w = 0.42 - 0.5 * np.cos(2 * np.pi * i / n) + 0.08 * np.cos(4 * np.pi * i / n)
    return w


@converter("HannWindow", "HammingWindow", "BlackmanWindow")
def _window(ctx: Context, node: OnnxNode):
    size = int(ctx.constant(node, 0, "size"))
    dtype = onnx_to_ingot_dtype(ctx, node, node.attr("output_datatype", 1))
    return [ctx.g.constant(_window_values(node, size).astype(dtype.numpy))]


def _complex_out(g, y: Tensor) -> Tensor:
    """complex64 [...] -> float32 [..., 2] (real, imaginary), ONNX's layout."""
    shape = tuple(y.shape) + (1,)
    return g.concat([g.reshape(g.real(y), shape), g.reshape(g.imag(y), shape)], axis=-1)


def _complex_in(g, x: Tensor) -> Tensor:
    """ONNX [..., 1] (real) or [..., 2] (real, imaginary) -> float32 [...] or complex64 [...]."""
    shape = tuple(x.shape[:-1])
    if x.shape[-1] == 1:
        return g.reshape(x, shape)
    re, im = g.split(x, 2, axis=-1)
    return g.complex(g.reshape(re, shape), g.reshape(im, shape))


@converter("DFT")
def _dft(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if x.dtype != dt.float32:
        raise ctx.fail(node, f"input of type {x.dtype.name}")
    if node.opset >= 20:
        axis = int(ctx.constant(node, 2, "axis")) if node.input(2) is not None else -2
    else:
        axis = node.attr("axis", 1)
    axis = normalize_axis("DFT", axis, x.ndim)
    if axis == x.ndim - 1:
        raise IngotError("the last axis holds (real, imaginary) and cannot be transformed")
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    signal = _complex_in(g, x)
    n = x.shape[axis]
    if node.input(1) is not None and not (inverse and onesided):
        length = int(ctx.constant(node, 1, "dft_length"))
        if length < n:
            signal = g.slice(signal, [0] * signal.ndim, [None if i != axis else length for i in range(signal.ndim)])
        elif length > n:
            pads = [(0, 0)] * signal.ndim
            pads[axis] = (0, length - n)
            signal = g.pad(signal, pads) if signal.dtype == dt.float32 else g.complex(
                g.pad(g.real(signal), pads), g.pad(g.imag(signal), pads))
    if inverse and onesided:  # Hermitian bins -> a real signal [..., n, 1]
        if signal.dtype != dt.complex64:
            raise ctx.fail(node, "a one-sided inverse of a real input")
        n = int(ctx.constant(node, 1, "dft_length")) if node.input(1) is not None else 2 * (x.shape[axis] - 1)
        y = g.irfft(_complex_in(g, x), axes=(axis,), norm="size", n=n)
        return [g.reshape(y, tuple(y.shape) + (1,))]
    if inverse:
        y = g.ifft(signal, axes=(axis,), norm="size")
    elif onesided and signal.dtype == dt.float32:
        y = g.rfft(signal, axes=(axis,))
    else:
        y = g.fft(signal, axes=(axis,))
        if onesided:
            half = signal.shape[axis] // 2 + 1
            y = g.slice(y, [0] * y.ndim, [None if i != axis else half for i in range(y.ndim)])
    return [_complex_out(g, y)]


@converter("STFT")
def _stft(ctx: Context, node: OnnxNode):
    x = node.inputs[0]
    g = ctx.g
    if x.dtype != dt.float32:
        raise ctx.fail(node, f"input of type {x.dtype.name}")
    step = int(ctx.constant(node, 1, "frame_step"))
    window = node.input(2)
    if node.input(3) is not None:
        frame = int(ctx.constant(node, 3, "frame_length"))
    elif window is not None:
        frame = window.shape[0]
    else:
        raise IngotError("neither a window nor a frame_length")
    onesided = bool(node.attr("onesided", 1))
    batch, length = x.shape[:2]
    frames = 1 + (length - frame) // step
    signal = _complex_in(g, x)  # [B, L] real or complex
    if signal.dtype == dt.complex64:
        re = g.array_view(g.real(signal), (batch, frames, frame), (length, step, 1))
        im = g.array_view(g.imag(signal), (batch, frames, frame), (length, step, 1))
        if window is not None:
            re, im = re * window, im * window
        y = g.fft(g.complex(re, im), axes=(2,))
        if onesided:
            y = g.slice(y, [0, 0, 0], [None, None, frame // 2 + 1])
        return [_complex_out(g, y)]
    framed = g.array_view(signal, (batch, frames, frame), (length, step, 1))
    if window is not None:
        framed = framed * window
    y = g.rfft(framed, axes=(2,)) if onesided else g.fft(framed, axes=(2,))
    return [_complex_out(g, y)]
