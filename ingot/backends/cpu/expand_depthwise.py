"""The FUSED "expand_depthwise" op (passes/fuse_expand_depthwise.py): a pointwise conv (+ epilogue) whose
output only a depthwise conv (+ epilogue) reads, as one kernel.

conv_depthwise transposes its NCHW input into a padded [H', W', 16] buffer per block of 16 channels.
Here the pointwise conv computes that buffer itself, the rows the depthwise bands need as they need them:
GROUP blocks of 16 output channels x R consecutive input positions per tile (R = WIDE, 4, 2, 1; a block
left over alone, R = 16, 8, 4, 2, 1; conv_pointwise's arithmetic, lanes are channels), bias and epilogue in
registers, each position stored straight into its place in its block's padded buffer (a table of offsets: a
tile may span rows), then the depthwise conv of each block of the group. The expanded tensor is never
written as NCHW nor read back (MobileNet's expand layers are its largest tensors).
"""
from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...ir import Node, Op
from ...options import DEFAULT_CPU, CpuOptions
from ...passes.fuse_conv_epilogue import operand_form
from ...passes.fuse_squeeze_excite import conv_of
from . import conv, conv_depthwise, conv_pointwise, conv_spatial, team
from .conv_spatial import _I64, _i64, _lane_mask, _vptr, apply_steps, epilogue_reads


with open(os.path.abspath(__file__), "rb") as _f:   # the generated kernels' cache key: the intrinsics here
    REVISION = hashlib.sha256(_f.read()).hexdigest()[:16] + conv_pointwise.REVISION


def _row_tile_intrinsic(r_n: int, blocked: bool, steps, operands):
    """tile(xp, offs, x, x_at, p_n, w, w_at, n_c, bias, c0, lanes, ops): for r < r_n, xp[offs[x_at + r] : +16] =
    epilogue(bias[c0 : +16] + sum over c < n_c of w[w_at + 16 c : +16] * x[x_at + c * p_n + r]) (lanes:
    channels c0 + l, those < lanes real; offs: each input position's place in the padded buffer; blocked:
    x channel-blocked, conv_pointwise.fma_rows)."""
    @intrinsic
    def tile(typingctx, xp, offs, x, x_at, p_n, w, w_at, n_c, bias, c0, lanes, ops):
        sig = types.void(xp, offs, x, x_at, p_n, w, w_at, n_c, bias, c0, lanes, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, fa, xa, wa, ba = arr(0), arr(1), arr(2), arr(5), arr(8)
            x_at_v, p_v, w_at_v, n_v, c0_v, lanes_v = (_i64(builder, args[i]) for i in (3, 4, 6, 7, 9, 10))
            finals = conv_pointwise.fma_rows(builder, xa.data, wa.data, x_at_v, p_v, w_at_v, n_v, r_n, blocked)
            bias_v = builder.load(_vptr(builder, ba.data, c0_v), align=4)
            read = epilogue_reads(context, builder, operands, signature.args[11], args[11], c0_v,
                                  channels=_lane_mask(builder, lanes_v, 0)) if steps else {}
            for r, f in enumerate(finals):
                value = builder.fadd(f, bias_v)
                if steps:
                    value = apply_steps(builder, steps, operands, read, value)
                at = _i64(builder, builder.load(builder.gep(fa.data, [builder.add(x_at_v, ir.Constant(_I64, r))])))
                builder.store(value, _vptr(builder, oa.data, at), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return tile


def _group_tile_intrinsic(r_n: int, blocks: int, blocked: bool, steps, operands):
    """tile(xp, xp_step, offs, x, x_at, p_n, w, w_at, w_step, n_c, bias, c0, m_n, ops): `blocks` blocks of 16
    channels side by side, each into its own padded buffer: for b < blocks, r < r_n,
    xp[b * xp_step + offs[x_at + r] : +16] = epilogue(bias[c0 + 16 b : +16] + sum over c < n_c of
    w[w_at + b * w_step + 16 c : +16] * x[x_at + c * p_n + r]) (lanes: channels c0 + 16 b + l, those < m_n
    real). Per input channel `blocks` weight vectors and r_n broadcasts feed blocks * r_n multiply-adds (one
    block: 1 + r_n loads for r_n)."""
    @intrinsic
    def tile(typingctx, xp, xp_step, offs, x, x_at, p_n, w, w_at, w_step, n_c, bias, c0, m_n, ops):
        sig = types.void(xp, xp_step, offs, x, x_at, p_n, w, w_at, w_step, n_c, bias, c0, m_n, ops)

        def codegen(context, builder, signature, args):
            arr = lambda i: context.make_array(signature.args[i])(context, builder, args[i])  # noqa: E731
            oa, fa, xa, wa, ba = arr(0), arr(2), arr(3), arr(6), arr(10)
            xp_step_v, x_at_v, p_v, w_at_v, w_step_v, n_v, c0_v, m_n_v = \
                (_i64(builder, args[i]) for i in (1, 4, 5, 7, 8, 9, 11, 12))
            finals = conv_pointwise._tile_sums(builder, xa, wa, x_at_v, p_v, w_at_v, w_step_v, n_v, r_n, blocks, blocked)
            ats = [_i64(builder, builder.load(builder.gep(fa.data, [builder.add(x_at_v, ir.Constant(_I64, r))])))
                   for r in range(r_n)]
            for b in range(blocks):
                cb = builder.add(c0_v, ir.Constant(_I64, 16 * b))
                bias_v = builder.load(_vptr(builder, ba.data, cb), align=4)
                read = epilogue_reads(context, builder, operands, signature.args[13], args[13], cb,
                                      channels=_lane_mask(builder, builder.sub(m_n_v, cb), 0)) if steps else {}
                base = builder.mul(xp_step_v, ir.Constant(_I64, b))
                for r in range(r_n):
                    value = builder.fadd(finals[b * r_n + r], bias_v)
                    if steps:
                        value = apply_steps(builder, steps, operands, read, value)
                    builder.store(value, _vptr(builder, oa.data, builder.add(base, ats[r])), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return tile


@functools.cache
def row_tile_for(r_n: int, key: str, blocked: bool = False):
    return _row_tile_intrinsic(r_n, blocked, *conv_spatial.SPECS[key])


@functools.cache
def group_tile_for(r_n: int, blocks: int, key: str, blocked: bool = False):
    return _group_tile_intrinsic(r_n, blocks, blocked, *conv_spatial.SPECS[key])


GROUP, WIDE = 2, 8   # blocks of 16 channels a pass and positions a tile: 2 weight loads + 8 broadcasts, 16 FMAs


_DRIVER = """import numpy as np
from numba import njit

from ingot.backends.cpu.conv_depthwise import _transpose_out, tile_for
from ingot.backends.cpu.expand_depthwise import group_tile_for, row_tile_for

# every tile width conv_depthwise.positions() may pick: a new image width needs no other kernel
tile4, tile5, tile6, tile7, tile8 = (tile_for({kh}, {kw}, {stride}, r, {key_b!r}, {blocked_out}) for r in (4, 5, 6, 7, 8))
row16, row8, row4, row2, row1 = (row_tile_for(r, {key_a!r}, {blocked_in}) for r in (16, 8, 4, 2, 1))
GROUP = {group}
wide, group4, group2, group1 = (group_tile_for(r, GROUP, {key_a!r}, {blocked_in}) for r in ({wide}, 4, 2, 1))
BLOCKED_IN, BLOCKED_OUT = {blocked_in}, {blocked_out}
{tiles_of_row}

@njit(cache=True, nogil=True)
def kernel(x, wa, ba, w, bias, sh, ph, pw, out, ops, xp, ot, offs, m_n, r_n):
    # x [C, H, W] (blocked: [C / 16, H, W * 16]): the pointwise conv's input; wa [M rounded up to 16 / 16, C,
    # 16], ba [M rounded up]; w [M / 16, kh * kw * 16], bias [M / 16, 16]: the depthwise conv's
    # (conv_depthwise.arrange_weights), m_n: M; out [M, OH, OW] (blocked:
    # [M / 16, OH, OW * 16]); xp, ot: conv_depthwise's scratch; offs [H * W]: input position y * W + x's
    # offset in xp, ((y + ph) * wp + pw + x) * 16; r_n: output positions per tile (conv_depthwise.positions)
    c_n = wa.shape[1]
    h = x.shape[1]
    wd = x.shape[2] // 16 if BLOCKED_IN else x.shape[2]
    oh = out.shape[1]
    ow = out.shape[2] // 16 if BLOCKED_OUT else out.shape[2]
    kh, kw, s = {kh}, {kw}, {stride}
    taps = kh * kw
    wp = max(wd + pw, s * (ow - 1) + kw)
    p_n = oh * ow
    hw = h * wd
    band = max(1, 2048 // wp)
    xf = x.reshape(x.size)
    of = out.reshape(out.size)
    waf = wa.reshape(wa.size)
    xp_n = xp.size // GROUP
    blk = 0
    while blk < wa.shape[0]:   # GROUP blocks of 16 channels a pass, each its own padded buffer; the rest one a pass
        nb = GROUP if blk + GROUP <= wa.shape[0] else 1
        c0 = blk * 16
        w_at = blk * c_n * 16
        y_in = 0
        for oy0 in range(0, oh, band):
            oy1 = min(oh, oy0 + band)
            need = min(h, (oy1 - 1) * sh - ph + kh)
            q, q_end = y_in * wd, need * wd   # the pointwise conv's positions of rows y_in..need, into xp
            if nb == GROUP:
                while q + {wide} <= q_end:
                    wide(xp, xp_n, offs, xf, q, hw, waf, w_at, c_n * 16, c_n, ba, c0, m_n, ops)
                    q += {wide}
                while q + 4 <= q_end:
                    group4(xp, xp_n, offs, xf, q, hw, waf, w_at, c_n * 16, c_n, ba, c0, m_n, ops)
                    q += 4
                if q + 2 <= q_end:
                    group2(xp, xp_n, offs, xf, q, hw, waf, w_at, c_n * 16, c_n, ba, c0, m_n, ops)
                    q += 2
                if q < q_end:
                    group1(xp, xp_n, offs, xf, q, hw, waf, w_at, c_n * 16, c_n, ba, c0, m_n, ops)
            else:
                lanes = min(16, m_n - c0)
                while q + 16 <= q_end:
                    row16(xp, offs, xf, q, hw, waf, w_at, c_n, ba, c0, lanes, ops)
                    q += 16
                if q + 8 <= q_end:
                    row8(xp, offs, xf, q, hw, waf, w_at, c_n, ba, c0, lanes, ops)
                    q += 8
                if q + 4 <= q_end:
                    row4(xp, offs, xf, q, hw, waf, w_at, c_n, ba, c0, lanes, ops)
                    q += 4
                if q + 2 <= q_end:
                    row2(xp, offs, xf, q, hw, waf, w_at, c_n, ba, c0, lanes, ops)
                    q += 2
                if q < q_end:
                    row1(xp, offs, xf, q, hw, waf, w_at, c_n, ba, c0, lanes, ops)
            y_in = max(y_in, need)
            for j in range(nb):
                cj = c0 + 16 * j
                lanes = min(16, m_n - cj)
                xpj = xp[j * xp_n:(j + 1) * xp_n]
                wt, bt = w[cj // 16], bias[cj // 16]
                for oy in range(oy0, oy1):
                    tiles_of_row(ot, of, xpj, oy * sh * wp, oy * ow, wp, s, wt, bt, cj, lanes, ops, oy, ow, r_n, p_n)
                if not BLOCKED_OUT:
                    end = oy1 * ow
                    for p0 in range(oy0 * ow, end, 16):
                        _transpose_out(of, cj * p_n + p0, p_n, ot, p0 * 16, lanes, min(16, end - p0))
        blk += nb
"""


def driver(kh: int, kw: int, stride: int, steps_a, steps_b, operands, blocked_in: bool = False,
           blocked_out: bool = False):
    """The kernel for this window and these epilogues (steps over the shared operand list), its input and
    output NCHW or channel-blocked (ops/layout.py); the tile width is an argument (conv_depthwise.driver's)."""
    key_a, key_b = conv_spatial.steps_key(steps_a, operands), conv_spatial.steps_key(steps_b, operands)
    conv_spatial.epilogue_for(key_a, steps_a, operands)
    conv_spatial.epilogue_for(key_b, steps_b, operands)
    source = _DRIVER.format(kh=kh, kw=kw, stride=stride, key_a=key_a, key_b=key_b, group=GROUP, wide=WIDE,
                            blocked_in=blocked_in, blocked_out=blocked_out, tiles_of_row=conv_depthwise.TILES_OF_ROW)
    return conv_spatial.load(f"# expand_depthwise {REVISION}\n{source}", "kernel", "cpu_expand_depthwise")


def _parts(node: Node):
    """(conv, input index of its weights, of its bias or None, steps [(node, [(form, i)])]) of one of the
    two convs in the fused body, inputs numbered as the fused op's."""
    conv, epilogue = conv_of(node)

    def outer(s: Node) -> int:
        if node.op == Op.FUSED:
            s = node.src[s.attrs["param"]]
        return s.attrs["param"]
    slot = {conv.id: ("value", 0)}
    steps = []
    out_shape = tuple(conv.type.shape)
    for k, n in enumerate(epilogue):
        refs = []
        for s in n.src:
            refs.append(slot[s.id] if s.id in slot else (operand_form(tuple(s.type.shape), out_shape), outer(s)))
        slot[n.id] = ("step", k)
        steps.append((n, refs))
    return conv, outer(conv.src[1]), outer(conv.src[2]) if len(conv.src) > 2 else None, steps


def _part_constants(w_a, b_a, w_b, b_b, *rest) -> tuple:
    """Output channels m0:m1 of the pointwise and depthwise weights, arranged for the kernel, and the
    epilogue operands (rest: the operands' arrays, then (m0, m1, M, kh * kw, the operands' forms))."""
    *arrays, (m0, m1, m, taps, forms) = rest
    wa, ba = conv_pointwise.arrange_weights(np.asarray(w_a, np.float32)[m0:m1],
                                            None if b_a is None else np.asarray(b_a, np.float32).reshape(-1)[m0:m1])
    wb, bb = conv_depthwise.arrange_weights(np.asarray(w_b, dtype=np.float32).reshape(m, taps)[m0:m1],
                                            None if b_b is None else np.asarray(b_b, dtype=np.float32).reshape(-1)[m0:m1])
    ops = tuple(np.ascontiguousarray(a, dtype=np.float32).reshape(-1)[m0:m1] if form == "channel" else
                np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for form, a in zip(forms, arrays))
    return wa, ba, wb, bb, ops


def expand_depthwise_lowering(node: Node, out, options: CpuOptions = DEFAULT_CPU, blocked_in: bool = False,
                              blocked_out: bool = False):
    """The step; blocked_in, blocked_out: the image read, the output written channel-blocked (ops/layout.py,
    the FUSED "blocked" op of backends/cpu/blocked.py). With options.threads > 1, a large one of one image
    runs as parts of consecutive expanded channels on the pool (each its own pointwise rows, depthwise
    tiles and scratch: the channels are independent), as conv.threaded_step splits a conv."""
    body = node.attrs["body"]
    members = [n for n in body.nodes if n.op in (Op.CONV, Op.FUSED)]
    if len(members) != 2 or any(conv_of(m) is None for m in members):
        return None
    (conv_a, wa_i, ba_i, steps_a), (conv_b, wb_i, bb_i, steps_b) = _parts(members[0]), _parts(members[1])
    operands = list(dict.fromkeys((form, i) for _, refs in steps_a + steps_b for form, i in refs
                                  if form in ("scalar", "channel")))
    if not conv_spatial.supported(steps_a, operands) or not conv_spatial.supported(steps_b, operands):
        return None
    x_src = members[0].src[0]
    x_index = x_src.attrs["param"]
    n_img, c = conv_a.src[0].type.shape[:2]
    m = conv_a.type.shape[1]
    in_hw, out_hw = tuple(conv_a.type.shape[2:]), tuple(conv_b.type.shape[2:])
    kh, kw = conv_b.src[1].type.shape[2:]
    (sh, sw), ((ph, _), (pw, _)) = conv_b.attrs["strides"], conv_b.attrs["pads"]
    kernel = driver(kh, kw, sw, steps_a, steps_b, operands, blocked_in, blocked_out)
    r_n = conv_depthwise.positions(out_hw[1])
    xp_n, ot_n = conv_depthwise.scratch_sizes(kh, kw, sw, in_hw, out_hw, sh, ph, pw)
    if blocked_out:   # the output's last tile only
        ot_n = (conv_depthwise.positions(out_hw[1]) + 32) * 16
    wp = max(in_hw[1] + pw, sw * (out_hw[1] - 1) + kw)   # as the kernel's
    ys, xs_ = np.divmod(np.arange(in_hw[0] * in_hw[1], dtype=np.int64), in_hw[1])
    offs = ((ys + ph) * wp + pw + xs_) * 16
    x_shape = (n_img, -(-c // 16), in_hw[0], in_hw[1] * 16) if blocked_in else (n_img, c, *in_hw)
    y_shape = (n_img, -(-m // 16), out_hw[0], out_hw[1] * 16) if blocked_out else (n_img, m, *out_hw)
    out_shape = (n_img, -(-m // 16), *out_hw, 16) if blocked_out else tuple(node.type.shape)
    macs = m * (in_hw[0] * in_hw[1] * c + out_hw[0] * out_hw[1] * kh * kw)
    parts = min(options.resolved_threads, m // conv.SPLIT_UNIT) if n_img == 1 and macs >= conv.PARALLEL_MIN_MACS else 1
    cuts = [0, m] if parts < 2 else \
        [conv.SPLIT_UNIT * round(m * p / parts / conv.SPLIT_UNIT) for p in range(parts)] + [m]
    # per part: its scratch (reused across runs: the pages stay mapped), then its arranged weights and operands
    scratch = [(np.zeros(xp_n * GROUP, np.float32), np.empty(ot_n, np.float32)) for _ in cuts[1:]]
    arranged: dict = {}

    def part_constants(inputs, m0: int, m1: int) -> tuple:   # (shared by every executable of these constants)
        return conv.arranged_once(_part_constants, inputs[wa_i], None if ba_i is None else inputs[ba_i], inputs[wb_i],
                                  None if bb_i is None else inputs[bb_i], *(inputs[i] for _, i in operands),
                                  key=((m0, m1, m, kh * kw, tuple(form for form, _ in operands)),))

    def run_part(x, fixed, ys, m_part: int, xp, ot) -> None:
        wa, ba, wb, bb, ops = fixed
        for n in range(n_img):
            kernel(x[n], wa, ba, wb, bb, sh, ph, pw, ys[n], ops, xp, ot, offs, m_part, r_n)

    def step(*inputs):
        fixed = arranged.get("fixed")
        if fixed is None:   # weights and operands are constants (the pass's condition): arranged once
            fixed = arranged["fixed"] = [part_constants(inputs, m0, m1) for m0, m1 in zip(cuts, cuts[1:])]
        xs = np.ascontiguousarray(inputs[x_index], dtype=np.float32).reshape(x_shape)
        y = out if out is not None else np.empty(out_shape, np.float32)
        ys = y.reshape(y_shape)
        if len(cuts) == 2:
            run_part(xs, fixed[0], ys, m, *scratch[0])
            return y
        team.run_parts(run_part, [(xs, f, ys[:, m0 // 16:-(-m1 // 16)] if blocked_out else ys[:, m0:m1], m1 - m0, *t)
                                  for f, t, m0, m1 in zip(fixed, scratch, cuts, cuts[1:])], options.resolved_threads)
        return y
    return step


FUSED_LOWERINGS = {"expand_depthwise": expand_depthwise_lowering}
