"""Two-level block parameters read as they are stored (the :k quantization formats, on the CPU).

A :k weight's scale and bias are an unsigned code per block times a float16 unit per super-block
of S blocks; the model builder writes each as a dequantize of constants (models/blocks.py), so a
package loaded for the CPU keeps them as stored (ingot.quant.formats.TwoLevelParams):

    quantized_matmul(x, q, dequantize(codes_s, units_s), dequantize(codes_b, units_b))
        -> quantized_matmul(x, q, codes_s, units_s, codes_b, units_b, two_level=S)

and likewise quantized_gather (a tied embedding). The fused op's parameters are (codes, units)
pairs whose float32 products are the parameters (ops/quant.two_level_products, its reference), so
the GEMV multiplies code by unit where it reads a block's parameters and no float copy of them is
ever made: in memory a :k weight takes the bytes its codes and units take.
"""
from __future__ import annotations

from .. import dtypes as dt
from ..errors import IngotError
from ..ir import Node, Op, Program
from ..ops import infer_type
from . import Context, graph_rewrite


def _two_level_param(p: Node) -> int | None:
    """S when p = dequantize(codes uint8 [nb, N], scale=units float16 [nb / S, N]) of constants, to float32."""
    if p.op != Op.DEQUANTIZE or p.attrs.get("mode") != "affine" or p.attrs.get("has_zero_point") \
            or p.attrs.get("has_bias") or p.dtype != dt.float32 or len(p.src) != 2:
        return None
    codes, units = p.src
    if codes.op != Op.CONSTANT or units.op != Op.CONSTANT or codes.dtype != dt.uint8 or units.dtype != dt.float16 \
            or codes.type.rank != 2 or units.type.rank != 2 or not codes.type.static or not units.type.static:
        return None
    (nb, n), (n_super, n_units) = codes.type.shape, units.type.shape
    if n_units != n or n_super == 0 or nb % n_super:
        return None
    return nb // n_super


def _fuse(node: Node, ctx: Context) -> Node | None:
    attrs = node.attrs
    if attrs.get("mode") != "affine" or attrs.get("has_zero_point") or attrs.get("two_level") \
            or (node.op == Op.QUANTIZED_MATMUL and attrs.get("transpose")):
        return None
    if node.op == Op.QUANTIZED_MATMUL:   # (x, q, *params)
        lead, params, tail = node.src[:2], node.src[2:], ()
    else:                                # quantized_gather(q, *params, idx)
        lead, params, tail = node.src[:1], node.src[1:-1], node.src[-1:]
    supers = {_two_level_param(p) for p in params}
    if len(supers) != 1 or None in supers:
        return None
    fused_attrs = dict(attrs, two_level=supers.pop())
    src = tuple(lead) + tuple(s for p in params for s in p.src) + tuple(tail)
    try:
        if infer_type(node.op, [s.type for s in src], fused_attrs) != node.type:
            return None
    except IngotError:
        return None
    return Node(node.op, node.type, src, fused_attrs, node.name)


def fuse_two_level(program: Program) -> tuple[Program, bool]:
    """Fold two-level parameters' dequantize into the quantized matmul or gather that reads them;
    returns (program, changed)."""
    return graph_rewrite(program, [((Op.QUANTIZED_MATMUL,), _fuse), ((Op.QUANTIZED_GATHER,), _fuse)], "fuse_two_level")
