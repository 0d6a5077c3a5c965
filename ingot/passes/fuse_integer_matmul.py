"""ONNX's integer matmul sums (MatMulInteger, QLinearMatMul: importers/onnx_integer.py) as one FUSED
"integer_matmul" op, which the CPU backend runs on 8-bit x in int32 (backends/cpu/int8_matmul.py).

The importer writes them as float32 matmuls of whole numbers, exact by construction:
    cast(quantized_matmul(cast(x, f32) [- cast(x_zero, f32)], w, scale=1 [, w_zero]), int32)
with x 8-bit, x_zero one 8-bit value (or a whole float32 constant) and w a constant 8-bit weight. The pass matches that chain
(scale all ones, zero points whole), copies the cast and subtraction into the body (other matmuls
may read them too), and leaves any other quantized_matmul alone. Where the int32 sum is only read
as cast(sum, float32) * s, s a float32 scalar (MatMulInteger's output scaled by x_scale * w_scale),
the cast and product (and s's own product where only this reads it) join the body: the kernel writes
the scaled float32 result, three steps fewer per matmul. The fused op's value is the exact
int32 sum; the body evaluates to it wherever its float32 sums are exact, which the importer ensured.
"""
from __future__ import annotations

import numpy as np

from ..ir import Op, Program, consumers
from .fusion import Match, fuse_matches

EIGHT_BIT = ("int8", "uint8")


def _constant(program: Program, node):
    return program.constants.get(node.attrs.get("key")) if node.op == Op.CONSTANT else None


def _eight_bit_cast(node) -> bool:
    return node.op == Op.CAST and node.dtype.name == "float32" and node.src[0].dtype.name in EIGHT_BIT


def fuse_integer_matmul(program: Program) -> tuple[Program, bool]:
    """Replace each integer matmul chain by a FUSED node; returns (program, changed)."""
    nodes = program.nodes()
    users = consumers(nodes)
    roots = {n.id for n in program.roots}
    matches = []
    for c in nodes:
        if c.op != Op.CAST or c.dtype.name != "int32" or c.src[0].op != Op.QUANTIZED_MATMUL:
            continue
        mm = c.src[0]
        a = mm.attrs
        if a.get("mode") != "affine" or a.get("transpose") or a.get("has_bias") or a["qdtype"].name not in EIGHT_BIT \
                or mm.id in roots or len(users[mm.id]) != 1 or not mm.type.static or mm.type.rank < 2:
            continue
        w, scale, zero = mm.src[1], _constant(program, mm.src[2]), None
        if w.op != Op.CONSTANT or scale is None or not np.all(np.asarray(scale) == 1):
            continue
        if a.get("has_zero_point"):
            zero = _constant(program, mm.src[3])
            if zero is None or not np.all(np.asarray(zero, np.float64) == np.round(np.asarray(zero, np.float64))):
                continue
        n = w.type.shape[1]
        if any(p.type.size not in (1, n) or (p.type.rank == 2 and p.type.shape[0] != 1) for p in mm.src[2:]):
            continue   # per column or per tensor only: one block along k
        xs, members = mm.src[0], []
        if xs.op == Op.SUB:
            cx, cz = xs.src
            z = _constant(program, cz)
            if not _eight_bit_cast(cx) or not cz.type.static or cz.type.size != 1:
                continue
            if _eight_bit_cast(cz):
                cz2 = cz.replace()
                members = [cz2]
            elif z is not None and float(np.asarray(z).reshape(-1)[0]) == round(float(np.asarray(z).reshape(-1)[0])) \
                    and -128 <= float(np.asarray(z).reshape(-1)[0]) <= 255:   # a zero point known at import, folded
                cz2, members = cz, []
            else:
                continue
            cx2 = cx.replace()
            xs2 = xs.replace(src=(cx2, cz2))
            members = [cx2] + members + [xs2]
        elif _eight_bit_cast(xs):
            xs2 = xs.replace()
            members = [xs2]
        else:
            continue
        mm2 = mm.replace(src=(xs2,) + mm.src[1:])
        c2 = c.replace(src=(mm2,))
        members += [mm2, c2]
        epilogue = _scaled_epilogue(c, c2, users, roots)
        if epilogue is None:
            matches.append(Match("integer_matmul", members, [c], computed=[c2]))
        else:
            matches.append(Match("integer_matmul", members + epilogue[0], [epilogue[1]], computed=[epilogue[0][-1]]))
    return fuse_matches(program, matches)


def _scalar_f32(node) -> bool:
    return node.dtype.name == "float32" and node.type.static and node.type.size == 1 and node.type.rank <= 1


def _scaled_epilogue(c, c2, users, roots):
    """(members, output) for cast(c, float32) * s with s a float32 scalar (x_scale * w_scale: taken in too
    where nothing else reads it), the output that of the cast; None where c is not read that way."""
    (cf,) = users[c.id] if len(users[c.id]) == 1 else (None,)
    if cf is None or cf.op != Op.CAST or cf.dtype.name != "float32" or c.id in roots or cf.id in roots:
        return None
    (mul,) = users[cf.id] if len(users[cf.id]) == 1 else (None,)
    if mul is None or mul.op != Op.MUL or mul.type != cf.type:
        return None
    s = mul.src[1] if mul.src[0] is cf else mul.src[0]
    if s is cf or not _scalar_f32(s):
        return None
    cf2 = cf.replace(src=(c2,))
    members = [cf2]
    if s.op == Op.MUL and len(users[s.id]) == 1 and s.id not in roots and all(_scalar_f32(t) for t in s.src):
        s = s.replace()
        members.append(s)
    mul2 = mul.replace(src=(cf2, s) if mul.src[0] is cf else (s, cf2))
    return members + [mul2], mul
