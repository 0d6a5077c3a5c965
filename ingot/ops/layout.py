"""The channel-blocked layout the CPU's conv kernels keep between layers (passes/block_channels.py).

    block_channels(x [N, C, *S])                      -> [N, ceil(C / 16), *S, 16]
    unblock_channels(xb [N, ceil(C / 16), *S, 16], channels=C) -> [N, C, *S]

Channel c of x is lane c % 16 of block c // 16; the lanes past C in the last block are zeros. Each
position's 16 channels are one vector, so a 1x1 conv's tile of 16 output channels stores its
accumulators as they are and a depthwise conv reads its taps without a transpose (onnxruntime's NCHWc).

    >>> import numpy as np
    >>> x = np.arange(2 * 17 * 3, dtype=np.float32).reshape(2, 17, 3)
    >>> xb = block_channels(x)
    >>> xb.shape, float(xb[0, 1, 2, 0]), float(xb[0, 1, 2, 1])
    ((2, 2, 3, 16), 50.0, 0.0)
    >>> bool((unblock_channels(xb, 17) == x).all())
    True
"""
from __future__ import annotations

import numpy as np

from ..ir import Op, TensorType
from . import fail, register

BLOCK = 16   # channels a block: one 512-bit vector of float32


def block_channels(x: np.ndarray) -> np.ndarray:
    n, c = x.shape[:2]
    blocks = -(-c // BLOCK)
    padded = np.zeros((n, blocks * BLOCK) + x.shape[2:], x.dtype)
    padded[:, :c] = x
    moved = np.moveaxis(padded.reshape((n, blocks, BLOCK) + x.shape[2:]), 2, -1)
    return np.ascontiguousarray(moved)


def unblock_channels(xb: np.ndarray, channels: int) -> np.ndarray:
    n, blocks = xb.shape[:2]
    plain = np.moveaxis(xb, -1, 2).reshape((n, blocks * BLOCK) + xb.shape[2:-1])
    return np.ascontiguousarray(plain[:, :channels])


def _block_rule(types, attrs):
    (x,) = types
    if x.rank < 3 or x.shape[1] is None:
        raise fail(Op.BLOCK_CHANNELS, types, "one tensor [N, C, ...] of rank >= 3 with a known C")
    return TensorType((x.shape[0], -(-x.shape[1] // BLOCK)) + tuple(x.shape[2:]) + (BLOCK,), x.dtype)


def _unblock_rule(types, attrs):
    (xb,) = types
    c = attrs.get("channels")
    if xb.rank < 4 or xb.shape[-1] != BLOCK or not isinstance(c, int) or c < 1 or xb.shape[1] != -(-c // BLOCK):
        raise fail(Op.UNBLOCK_CHANNELS, types, f"one tensor [N, ceil(channels / {BLOCK}), ..., {BLOCK}] and "
                   f"channels (an int, got {c!r})")
    return TensorType((xb.shape[0], c) + tuple(xb.shape[2:-1]), xb.dtype)


register(Op.BLOCK_CHANNELS, _block_rule, lambda xs, attrs: block_channels(np.asarray(xs[0])))
register(Op.UNBLOCK_CHANNELS, _unblock_rule, lambda xs, attrs: unblock_channels(np.asarray(xs[0]), attrs["channels"]))
