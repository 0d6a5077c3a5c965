"""Convolutions on the CPU: CONV and the FUSED "conv_epilogue" op (passes/fuse_conv_epilogue.py).

1-D and 2-D float32 convolutions run in tiles of whole output rows, so what a tile touches stays in
cache:
- a 1x1 convolution with stride 1 and no padding multiplies the weights by the input itself (BLAS);
- a depthwise one (a group per channel) runs a direct kernel, vectorised along the output row;
- any other gathers the tile's input windows into a reused buffer (`_im2col`, padding as zeros: no
  padded copy of the input), then multiplies by BLAS straight into the output.
Every EPILOGUE_ELEMENTS outputs, the bias and the epilogue (the elementwise ops the fusion pass gave
the op: an activation, a residual add) run on the tiles just computed, while they are in cache.
3-D and other dtypes use the reference.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
from numba import njit

from ... import codegen
from ...ir import Node, Op, TensorType
from ...ops import REGISTRY
from ...ops.fused import Body
from ...passes.fuse_conv_epilogue import operand_form
from ...options import DEFAULT_CPU, CpuOptions
from . import conv1d_small, conv_amx, conv_depthwise, conv_kernels, conv_pointwise, conv_spatial, conv_winograd, team

TILE_ELEMENTS = 1 << 16       # floats of gathered windows per tile (256 KB): L2-sized
EPILOGUE_ELEMENTS = 1 << 17   # outputs the epilogue takes at a time: NumPy calls long enough to pay
                              # for their own cost, still in L2 (per tile it cost YOLO 7 of 29 ms)


# Inner loops index with unsigned integers: an index computed from a signed offset makes numba wrap
# negative indices per element, which keeps LLVM from vectorising (CPU time on this VM: im2col copy
# 1.0 -> 4.7-7.2 Gelem/s, depthwise 3x3 2.5 -> 13.8 GFLOP/s).

@njit(cache=True, nogil=True)
def _im2col(x, kh, kw, sh, sw, dh, dw, ph, pw, ow, oy0, oy1, cols):
    """cols[(c, i, j), (oy - oy0) * ow + ox] = x[c, oy * sh + i * dh - ph, ox * sw + j * dw - pw], zero
    outside x; x [C, H, W], output rows oy0..oy1."""
    c_n, h, w = x.shape
    us = np.uintp(sw)
    r = 0
    for c in range(c_n):
        for i in range(kh):
            for j in range(kw):
                off = j * dw - pw
                lo = max(0, (-off + sw - 1) // sw)           # the first ox with ox * sw + off >= 0
                hi = max(lo, min(ow, (w - 1 - off) // sw + 1) if w - 1 - off >= 0 else 0)
                s0, n = np.uintp(lo * sw + off), np.uintp(hi - lo)
                dst = cols[r]
                for oy in range(oy0, oy1):
                    iy = oy * sh + i * dh - ph
                    base = np.uintp((oy - oy0) * ow)
                    if iy < 0 or iy >= h:
                        for t in range(np.uintp(ow)):
                            dst[base + t] = 0.0
                        continue
                    xrow = x[c, iy]
                    for t in range(np.uintp(lo)):
                        dst[base + t] = 0.0
                    d0 = base + np.uintp(lo)
                    if sw == 1:
                        for t in range(n):
                            dst[d0 + t] = xrow[s0 + t]
                    else:
                        for t in range(n):
                            dst[d0 + t] = xrow[s0 + t * us]
                    for t in range(np.uintp(hi), np.uintp(ow)):
                        dst[base + t] = 0.0
                r += 1


@njit(cache=True, nogil=True, fastmath=True)
def _depthwise(x, w, sh, sw, dh, dw, ph, pw, oy0, oy1, out):
    """out[c, oy, :] for oy in oy0..oy1 = the channel's window sums, one tap at a time over the rows;
    x [C, H, W], w [C, kh, kw], out [C, OH, OW]."""
    c_n, h, wd = x.shape
    kh, kw = w.shape[1], w.shape[2]
    ow = out.shape[2]
    us = np.uintp(sw)
    for c in range(c_n):
        plane = out[c]
        for oy in range(oy0, oy1):
            row = plane[oy]
            for t in range(np.uintp(ow)):
                row[t] = 0.0
        for i in range(kh):
            for j in range(kw):
                wv = w[c, i, j]
                off = j * dw - pw
                lo = max(0, (-off + sw - 1) // sw)
                hi = min(ow, (wd - 1 - off) // sw + 1) if wd - 1 - off >= 0 else 0
                if hi <= lo:
                    continue
                s0, d0, n = np.uintp(lo * sw + off), np.uintp(lo), np.uintp(hi - lo)
                for oy in range(oy0, oy1):
                    iy = oy * sh + i * dh - ph
                    if iy < 0 or iy >= h:
                        continue
                    row, xrow = plane[oy], x[c, iy]
                    if sw == 1:
                        for t in range(n):
                            row[d0 + t] += wv * xrow[s0 + t]
                    else:
                        for t in range(n):
                            row[d0 + t] += wv * xrow[s0 + t * us]


# -- the epilogue: elementwise ops on a tile [channels, columns] -----------------------------------

def _sigmoid(x, out):
    np.negative(x, out=out)
    np.exp(out, out=out)
    out += 1.0
    return np.reciprocal(out, out=out)


_IN_PLACE = {Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide, Op.MAXIMUM: np.maximum,
             Op.MINIMUM: np.minimum, Op.NEG: np.negative, Op.EXP: np.exp, Op.TANH: np.tanh, Op.ABS: np.abs,
             Op.SQRT: np.sqrt, Op.LOG: np.log, Op.SIGMOID: _sigmoid}


class Epilogue:
    """The body's ops after the convolution, as steps over a tile. Each source of a step is the
    convolution's value, an earlier step, or one of the fused op's inputs read as a scalar, a
    per-channel column or a tile of a tensor of the output's shape (e.g. a residual)."""

    def __init__(self, body: Body | None, conv: Node | None):
        self.steps: list[tuple[Node, list[tuple[str, int]]]] = []
        self.kernel = None   # the steps as one generated numba loop, where they have no transcendental op
        self.spatial_ok = True   # conv_spatial can apply the steps in its store
        if body is None:
            return
        slot = {conv.id: ("value", 0)}
        out_shape = conv.type.shape
        for n in body.nodes:
            if n.op == Op.PLACEHOLDER or n is conv:
                continue
            refs = []
            for s in n.src:
                if s.id in slot:
                    refs.append(slot[s.id])
                elif s.op == Op.PLACEHOLDER:
                    refs.append((operand_form(s.type.shape, out_shape), s.attrs["param"]))
                else:
                    raise AssertionError(f"conv epilogue: {s.op.name.lower()} is neither a member nor an input")
            slot[n.id] = ("step", len(self.steps))
            self.steps.append((n, refs))
        self.kernel = _compiled(self.steps) or conv_kernels.special_epilogue(self.steps)   # SiLU: a vector exp
        params = {n.attrs["param"]: n for n in body.nodes if n.op == Op.PLACEHOLDER}
        self.spatial_ok = conv_spatial.supported(self.steps, self.operands) and all(
            params[i].dtype.name == "float32" for _, i in self.operands)

    def run(self, tile: np.ndarray, inputs, n: int, m0: int, m1: int, c0: int, c1: int, scratch: dict) -> None:
        """Apply the steps to tile (out[n, m0:m1] flattened, columns c0:c1), writing the last one into it."""
        if not self.steps:
            return
        vals = []
        last = len(self.steps) - 1
        for k, (node, refs) in enumerate(self.steps):
            args = []
            for form, i in refs:
                if form == "value":
                    args.append(tile)
                elif form == "step":
                    args.append(vals[i])
                elif form == "scalar":
                    args.append(inputs[i].reshape(()))
                elif form == "channel":
                    args.append(inputs[i].reshape(-1)[m0:m1, None])
                else:
                    args.append(inputs[i][n, m0:m1].reshape(m1 - m0, -1)[:, c0:c1])
            fn = _IN_PLACE.get(node.op)
            if fn is not None and node.dtype.name == tile.dtype.name:
                out = tile if k == last else scratch.setdefault((k, tile.shape), np.empty(tile.shape, tile.dtype))
                vals.append(fn(*args, out=out))
            else:
                value = REGISTRY[node.op].reference(args, node.attrs)
                if k == last:
                    tile[...] = value
                vals.append(value)

    def run_compiled(self, slab: np.ndarray, bias, inputs, n: int, m0: int, m1: int) -> None:
        """Bias and steps in one pass over a whole C-contiguous slab out[n, m0:m1] as [M, P]."""
        args = []
        for form, i in self.operands:
            a = inputs[i]
            if form == "scalar":
                args.append(a.reshape(-1)[0])
            elif form == "channel":
                args.append(a.reshape(-1)[m0:m1])
            else:
                args.append(np.ascontiguousarray(a[n, m0:m1]).reshape(m1 - m0, -1))
        self.kernel(slab, bias[m0:m1] if bias is not None else _NO_BIAS, bias is not None, *args)

    @property
    def operands(self) -> list[tuple[str, int]]:
        return _operands(self.steps)


def _operands(steps) -> list[tuple[str, int]]:
    """The fused op's inputs the steps read (form, input index), in order of first use."""
    seen: dict[int, str] = {}
    for _, refs in steps:
        for form, i in refs:
            if form in ("scalar", "channel", "full"):
                seen.setdefault(i, form)
    return [(form, i) for i, form in seen.items()]


_NO_BIAS = np.zeros(0, np.float32)
_ARRANGED: dict[tuple, Any] = {}


def arranged_once(make: Callable, *arrays: np.ndarray | None, key: tuple = ()) -> Any:
    """make(*arrays, *key) for constant arrays, made once per (make, key, the arrays by identity) while the arrays
    live. The executables a model compiles per input shape hold the same constant arrays
    (importers.onnx._share_constants): each new shape's first run arranged every weight again
    (PP-OCRv4's detector: ~1.6 ms). make: a module's function (not a closure: the entry lives as long as
    the arrays); key: its other arguments (hashable), all else the result depends on."""
    entry = (make, key) + tuple(id(a) for a in arrays)
    made = _ARRANGED.get(entry)
    if made is None:
        made = make(*arrays, *key)
        if all(a is None or isinstance(a, np.ndarray) for a in arrays):   # (what a weak reference can follow)
            _ARRANGED[entry] = made
            for a in arrays:
                if a is not None:
                    weakref.finalize(a, _ARRANGED.pop, entry, None)
    return made
_EXPR = {Op.ADD: "({0} + {1})", Op.SUB: "({0} - {1})", Op.MUL: "({0} * {1})", Op.DIV: "({0} / {1})",
         Op.MAXIMUM: "_max({0}, {1})", Op.MINIMUM: "_min({0}, {1})", Op.NEG: "(-{0})", Op.ABS: "abs({0})",
         Op.LESS: "({0} < {1})", Op.LESS_EQUAL: "({0} <= {1})", Op.GREATER: "({0} > {1})",
         Op.GREATER_EQUAL: "({0} >= {1})", Op.EQUAL: "({0} == {1})", Op.NOT_EQUAL: "({0} != {1})",
         Op.WHERE: "({1} if {0} else {2})"}


@njit(inline="always")
def _max(a, b):
    return a if a > b or a != a else b   # NaN in either propagates, as np.maximum


@njit(inline="always")
def _min(a, b):
    return a if a < b or a != a else b


def _compiled(steps) -> object | None:
    """The steps as one numba loop over [M, P] (generated, cached on disk by its source), or None where
    a step is transcendental: numba has no vector exp here (no SVML), NumPy's ufuncs do."""
    if not steps or any(node.op not in _EXPR or node.dtype.name not in ("float32", "bool") for node, _ in steps):
        return None
    lines, operands = [], {i: form for form, i in _operands(steps)}
    hoist = []
    for i, form in operands.items():
        if form == "channel":
            hoist.append(f"        c{i} = a{i}[m]")
        elif form == "full":
            hoist.append(f"        f{i} = a{i}[m]")
    for k, (node, refs) in enumerate(steps):
        args = []
        for form, i in refs:
            args.append({"value": "v", "step": f"s{i}", "scalar": f"a{i}", "channel": f"c{i}", "full": f"f{i}[t]"}[form])
        lines.append(f"            s{k} = {_EXPR[node.op].format(*args)}")
    params = "".join(f", a{i}" for i in operands)
    source = "\n".join([
        "import numpy as np", "from numba import njit", "from ingot.backends.cpu.conv import _max, _min", "", "",
        "@njit(cache=True, nogil=True)",
        f"def epilogue(slab, bias, has_bias{params}):",
        "    for m in range(slab.shape[0]):",
        "        row = slab[m]",
        "        b = bias[m] if has_bias else np.float32(0.0)",
        *hoist,
        "        for t in range(np.uintp(row.shape[0])):",
        "            v = row[t] + b",
        *lines,
        f"            row[t] = s{len(steps) - 1}", ""])
    return codegen.load(source, "epilogue", "cpu_epilogues")


# -- the step ---------------------------------------------------------------------------------------

def fast(conv: Node) -> bool:
    """The kernels here take 1-D and 2-D float32 convolutions with static shapes."""
    return conv.dtype.name == "float32" and conv.type.rank in (3, 4) and conv.type.static and \
        all(s.type.static for s in conv.src)


def conv_step(conv: Node, out: np.ndarray | None, epilogue: Epilogue, x_index: int = 0, w_index: int = 1,
              b_index: int | None = None, constant_w: bool = False, constant_b: bool = False,
              constants: frozenset = frozenset(), precision: str = "float32", threads: int = 1,
              winograd_channels: int = 0):
    """A step computing conv (+ bias, + epilogue) from the step's inputs (the fused op's sources, or
    the conv's own); constant_w: the weights are a constant, arranged for the kernels once. precision:
    CpuOptions.float32_precision (on AMX hosts, kxk windows run on the tiles: conv_amx.py). threads:
    CpuOptions.threads; a large conv of one image runs as that many steps of its output channels, or of its
    output rows (threaded_step). winograd_channels: CpuOptions.winograd_channels (conv_winograd.py)."""
    if threads > 1:
        split = threaded_step(conv, out, epilogue, x_index, w_index, b_index, threads, lambda part, target=None: conv_step(
            part, target, epilogue, x_index, w_index, b_index, constant_w, constant_b, constants, precision,
            winograd_channels=winograd_channels))
        if split is not None:
            return split
    a = conv.attrs
    one_d = conv.type.rank == 3
    strides, dilations, pads = a["strides"], a["dilations"], a["pads"]
    if one_d:
        strides, dilations, pads = (1,) + tuple(strides), (1,) + tuple(dilations), ((0, 0),) + tuple(pads)
    (sh, sw), (dh, dw), ((ph, _), (pw, _)) = strides, dilations, pads
    groups = a["groups"]
    out_shape = tuple(conv.type.shape)
    n_img, m = out_shape[:2]
    oh, ow = (1, out_shape[2]) if one_d else out_shape[2:]
    w_shape = conv.src[1].type.shape
    cg = w_shape[1]
    kh, kw = (1, w_shape[2]) if one_d else w_shape[2:]
    mg = m // groups
    depthwise = cg == 1 and mg == 1 and groups > 1
    blocked = depthwise and conv_kernels.blocked_fits(kh, kw, oh, ow)
    pointwise = kh == kw == 1 and sh == sw == 1 and ph == pw == 0 and pads[0][1] == pads[1][1] == 0
    direct = not depthwise and not pointwise and conv_kernels.direct_fits(kh, kw, groups, ow, conv.src[0].type.shape[-1] if not one_d else 0)  # no im2col
    constant = constant_w and (b_index is None or constant_b)
    small = conv1d_small.small_step(conv, out, epilogue, x_index, w_index, b_index, constant, constants) if one_d else None
    if small is not None:   # a short 1-D output: one compiled call (conv1d_small.py)
        return small
    if precision != "float32" and epilogue.spatial_ok and not depthwise and conv_amx.fits(kh, kw, groups, cg, m) \
            and conv_amx.worth_it(kh, kw, cg, m, oh * ow) and conv_amx.available():
        return _amx_step(conv, out, epilogue, x_index, w_index, b_index, constant, constants, precision,
                         (sh, sw, dh, dw, ph, pw))
    if epilogue.spatial_ok and not one_d and \
            conv_winograd.fits(kh, kw, (sh, sw), (dh, dw), pads, groups, cg, m, oh, ow, winograd_channels):
        return _winograd_step(conv, out, epilogue, x_index, w_index, b_index, constant_w, constants, constant_b)
    strided = _strided_pointwise(kh, kw, (sh, sw), pads, groups)   # its strided positions gathered, then as stride 1
    subsample = (sh, sw) if strided else None
    if epilogue.spatial_ok and (pointwise or strided) and groups == 1 and conv_pointwise.better_than_positions(m, oh * ow):
        return _spatial_step(conv, out, epilogue, x_index, w_index, b_index, constant, None, "channels", constants,
                             subsample)
    if epilogue.spatial_ok and (pointwise or strided) and groups == 1 and oh * ow >= 16:   # narrower: BLAS's GEMV wins
        return _spatial_step(conv, out, epilogue, x_index, w_index, b_index, constant, None, constants=constants,
                             subsample=subsample)
    if epilogue.spatial_ok and depthwise and conv_depthwise.fits(kh, kw, (sh, sw), (dh, dw), epilogue.operands):
        return conv_depthwise.depthwise_step(conv, out, epilogue, x_index, w_index, b_index, constant, (sh, sw, ph, pw),
                                             constants, _operand)
    if epilogue.spatial_ok and depthwise and conv_spatial.depthwise_fits(kh, kw, (sh, sw)):
        return _spatial_step(conv, out, epilogue, x_index, w_index, b_index, constant, (sw, sh, dh, dw, ph, pw),
                             constants=constants)
    if epilogue.spatial_ok and conv_spatial.rows_window_fits(kh, kw, groups, (sh, sw), cg, ow, m) and \
            not (direct and _direct_better(cg * kh * kw, m, sh, ow)):
        return _spatial_step(conv, out, epilogue, x_index, w_index, b_index, constant, (sh, dh, dw, ph, pw), "rows",
                             constants)
    if direct:   # a column window runs as a row one (conv_kernels._columns)
        columns = conv_kernels._columns(kh, kw, ow, conv.src[0].type.shape[-1] if not one_d else 0)
        window = (kw, kh) if columns else (kh, kw)
        direct_kernel = conv_kernels.direct_kernel(*window, *((sh, dh) if columns else (sw, dw)),
                                                   *((epilogue.steps, epilogue.operands) if epilogue.spatial_ok else ((), ())))
        if epilogue.spatial_ok and window == (kh, kw) and groups == 1:
            return _direct_step(conv, out, epilogue, x_index, w_index, b_index, constant_w, constants, direct_kernel,
                                (sh, sw, dh, dw, ph, pw), constant_b)
    k = cg * kh * kw
    rows = max(1, min(oh, TILE_ELEMENTS // max(1, (k if not pointwise else cg) * ow)))
    scratch: dict = {}
    weights: dict = {}

    def step(*inputs):
        x, w = inputs[x_index], inputs[w_index]
        bias = inputs[b_index] if b_index is not None else None
        if one_d:
            x = x.reshape(x.shape[0], x.shape[1], 1, x.shape[2])
        x = np.ascontiguousarray(x)
        y = out if out is not None else np.empty(out_shape, np.float32)
        y4 = y.reshape(n_img, m, oh, ow)
        # the weights as [groups, M / groups, C / groups * kh * kw] (depthwise: [C, kh, kw])
        wk = weights.get("w") if constant_w else None
        if wk is None:
            wk = conv_kernels.direct_weights(w.reshape(m, cg, kh, kw)) if direct else \
                np.ascontiguousarray(w.reshape(m, kh, kw) if depthwise else w.reshape(groups, mg, k))
            if constant_w:
                weights["w"] = wk
        cols = scratch.get("cols")
        if cols is None and not (pointwise or depthwise or direct):
            cols = scratch["cols"] = np.empty((k, rows * ow), np.float32)
        for n in range(n_img):
            for g in range(1 if depthwise else groups):
                m0, m1 = (0, m) if depthwise else (g * mg, (g + 1) * mg)
                xg = x[n] if depthwise else x[n, g * cg:(g + 1) * cg]
                flat = y4[n, m0:m1].reshape(m1 - m0, oh * ow)
                done = 0   # columns the bias and epilogue have run on
                for oy0 in range(0, oh, rows):
                    oy1 = min(oh, oy0 + rows)
                    c0, c1 = oy0 * ow, oy1 * ow
                    tile = flat[:, c0:c1]
                    if blocked:   # the whole output at once (conv_kernels.py), then the tiles' epilogues
                        if oy0 == 0:
                            conv_kernels.depthwise_blocked(xg, wk, sh, sw, dh, dw, ph, pw, y4[n])
                    elif direct:
                        if oy0 == 0 and epilogue.spatial_ok:   # bias and epilogue in the kernel
                            conv_kernels.conv_direct(xg, wk, kh, kw, sh, sw, dh, dw, ph, pw, y4[n], bias, direct_kernel,
                                                     tuple(_operand(inputs[i], f, n) for f, i in epilogue.operands), scratch)
                            break
                        if oy0 == 0:
                            conv_kernels.conv_direct(xg, wk, kh, kw, sh, sw, dh, dw, ph, pw, y4[n], None, direct_kernel,
                                                     scratch=scratch)
                    elif depthwise:
                        _depthwise(xg, wk, sh, sw, dh, dw, ph, pw, oy0, oy1, y4[n])
                    elif pointwise:
                        np.matmul(wk[g], xg.reshape(cg, oh * ow)[:, c0:c1], out=tile)
                    else:
                        _im2col(xg, kh, kw, sh, sw, dh, dw, ph, pw, ow, oy0, oy1, cols)
                        np.matmul(wk[g], cols[:, :c1 - c0], out=tile)
                    if epilogue.kernel is not None:
                        if oy1 == oh:
                            epilogue.run_compiled(flat, bias, inputs, n, m0, m1)
                    elif (c1 - done) * (m1 - m0) >= EPILOGUE_ELEMENTS or oy1 == oh:
                        span = flat[:, done:c1]
                        if bias is not None:
                            span += bias[m0:m1, None]
                        epilogue.run(span, inputs, n, m0, m1, done, c1, scratch)
                        done = c1
        return y
    return step


PARALLEL_MIN_MACS = 1 << 23   # multiply-adds below which a conv stays on one thread (~70 us: a split gained nothing)
SPLIT_UNIT = 16               # output channels a part holds a multiple of (16-channel vectors; conv_amx takes 16 too)


def threaded_step(conv: Node, out: np.ndarray | None, epilogue: Epilogue, x_index: int, w_index: int,
                  b_index: int | None, threads: int, build, blocked_in: bool = False, blocked_out: bool = False):
    """conv (one image, groups 1 or depthwise) as `threads` convs of consecutive output channels, each the
    step build(its own conv) makes (conv_step's, or a blocked op's: backends/cpu/blocked.py), run together
    on the spinning team (team.run_parts) into their channels of one output: an image's channels (or 16-channel
    blocks) are contiguous, so each part writes a plain array. Where build(conv) is the direct kernel walking
    its input row by row (step.bands), bands of output rows of that one step instead (_bands_step); with
    too few channels, bands of a narrowed conv each (_rows_step). None where the conv is too small, or a
    part's kernel is BLAS's (which threads itself: CpuPlan.blas). blocked_in, blocked_out: the input (read
    by a depthwise part), the output and residuals channel-blocked (ops/layout.py)."""
    _, n_img, m, spatial, c, _, kh, kw = _shapes(conv)
    groups = conv.attrs["groups"]
    depthwise = groups > 1 and groups == c == m
    if n_img != 1 or (groups > 1 and not depthwise) or \
            m * spatial[0] * spatial[1] * (c // groups) * kh * kw < PARALLEL_MIN_MACS * (1 if groups == 1 else 1 / 16):
        return None
    if out is not None and not out.flags.c_contiguous:   # (the parts write views of it)
        return None
    if groups == 1 and conv.type.rank == 4 and not (blocked_in or blocked_out):
        whole = build(conv)
        if getattr(whole, "bands", False) and spatial[0] >= 2 * threads:
            return _bands_step(whole, out, tuple(conv.type.shape), spatial[0], threads)
    parts = min(threads, m // SPLIT_UNIT)
    if parts < 2:
        return _rows_step(conv, out, epilogue, x_index, threads, build) \
            if groups == 1 and conv.type.rank == 4 and not (blocked_in or blocked_out) else None
    cuts = [SPLIT_UNIT * round(m * p / parts / SPLIT_UNIT) for p in range(parts)] + [m]
    steps = []
    for m0, m1 in zip(cuts, cuts[1:]):
        step = build(_part(conv, m0, m1, depthwise))
        if not getattr(step, "splits", False):
            return None
        steps.append(step)
    full = {i for form, i in epilogue.operands if form == "full"}
    channel = {i for form, i in epilogue.operands if form == "channel"}
    out_shape = (1, -(-m // 16), *conv.type.shape[2:], 16) if blocked_out else tuple(conv.type.shape)

    def channels(a, m0: int, m1: int, blocked: bool):
        return a[:, m0 // 16:-(-m1 // 16)] if blocked else a[:, m0:m1]

    def part_inputs(inputs, m0: int, m1: int) -> list:
        ins = list(inputs)
        ins[w_index] = inputs[w_index][m0:m1]
        if b_index is not None:
            ins[b_index] = np.asarray(inputs[b_index]).reshape(-1)[m0:m1]
        if depthwise:
            ins[x_index] = channels(inputs[x_index], m0, m1, blocked_in)
        for i in channel:
            ins[i] = np.asarray(inputs[i]).reshape(-1)[m0:m1]
        for i in full:
            ins[i] = channels(inputs[i], m0, m1, blocked_out)
        return ins

    def step(*inputs):
        y = out if out is not None else np.empty(out_shape, np.float32)
        team.run_parts(_run_part, [(s, part_inputs(inputs, m0, m1), channels(y, m0, m1, blocked_out))
                                   for s, m0, m1 in zip(steps, cuts, cuts[1:])], threads)
        return y
    return step


def _bands_step(whole, out: np.ndarray | None, out_shape: tuple, oh: int, threads: int):
    """One step of the direct kernel as `threads` bands of consecutive output rows, run together on the
    spinning team, each writing its rows of the one output (the kernel indexes them in place: no copy)."""
    cuts = [oh * p // threads for p in range(threads + 1)]

    def step(*inputs):
        y = out if out is not None else np.empty(out_shape, np.float32)
        team.run_parts(_run_band_part, [(whole, inputs, y, (oy0, oy1, i))
                                        for i, (oy0, oy1) in enumerate(zip(cuts, cuts[1:]))], threads)
        return y
    return step


def _run_band_part(step, inputs, y, band) -> None:
    step(*inputs, into=y, band=band)


def _run_part(step, inputs, y) -> None:
    step(*inputs, into=y)


def _rows_step(conv: Node, out: np.ndarray | None, epilogue: Epilogue, x_index: int, threads: int, build):
    """A 2-D conv of too few output channels for two channel parts (a stem's 3 -> 16, YOLO's 16 -> 16) as
    convs of consecutive output rows, each over its band of input rows with its own padding, into a buffer
    of its own then copied into its rows of the output (an image's rows of a channel are not contiguous
    across channels). None where the rows are too few or a part's kernel is BLAS's."""
    out_shape, _, m, (oh, ow), _, (h, _), kh, _ = _shapes(conv)
    (sh, _), (dh, _), ((ph, _), pw) = conv.attrs["strides"], conv.attrs["dilations"], conv.attrs["pads"]
    parts = min(threads, oh // 8)
    if parts < 2:
        return None
    cuts = [oh * p // parts for p in range(parts + 1)]
    bands, steps = [], []
    for oy0, oy1 in zip(cuts, cuts[1:]):
        iy0, iy1 = oy0 * sh - ph, (oy1 - 1) * sh - ph + (kh - 1) * dh + 1   # the input rows the band's windows read
        r0, r1 = max(iy0, 0), min(iy1, h)
        x = conv.src[0]
        part = conv.replace(
            type=TensorType((1, m, oy1 - oy0, ow), conv.dtype),
            src=(x.replace(type=TensorType((1, x.type.shape[1], r1 - r0, x.type.shape[3]), x.dtype)),) + conv.src[1:],
            attrs=dict(conv.attrs, pads=((r0 - iy0, iy1 - r1), pw)))
        buffer = np.empty((1, m, oy1 - oy0, ow), np.float32)
        step = build(part, buffer)
        if not getattr(step, "splits", False):
            return None
        bands.append((oy0, oy1, r0, r1))
        steps.append(step)
    full = [i for form, i in epilogue.operands if form == "full"]

    def step(*inputs):
        y = out if out is not None else np.empty(out_shape, np.float32)
        argsets = []
        for s, (oy0, oy1, r0, r1) in zip(steps, bands):
            ins = list(inputs)
            ins[x_index] = inputs[x_index][:, :, r0:r1]
            for i in full:
                ins[i] = inputs[i][:, :, oy0:oy1]
            argsets.append((s, ins, y[:, :, oy0:oy1]))
        team.run_parts(_run_band, argsets, threads)
        return y
    return step


def _run_band(step, inputs, band) -> None:
    np.copyto(band, step(*inputs))


def _part(conv: Node, m0: int, m1: int, depthwise: bool) -> Node:
    """conv's output channels m0:m1 as a conv of its own (a depthwise one's input channels with them)."""
    def narrowed(node: Node, axis: int) -> Node:
        shape = list(node.type.shape)
        shape[axis] = m1 - m0
        return node.replace(type=TensorType(shape, node.dtype))

    src = [narrowed(conv.src[0], 1) if depthwise else conv.src[0], narrowed(conv.src[1], 0)] + \
        [narrowed(b, 0) for b in conv.src[2:]]
    attrs = dict(conv.attrs, groups=m1 - m0) if depthwise else conv.attrs
    return conv.replace(type=TensorType((1, m1 - m0) + tuple(conv.type.shape[2:]), conv.dtype), src=src, attrs=attrs)


def _bindable(n_img: int, out: np.ndarray | None, operands, constants: frozenset, constant_w: bool,
              b_index: int | None, constant_b: bool) -> tuple[bool, bool]:
    """(the epilogue's operands all constants read once, the step's kernel arguments kept from its first
    call): the second where there is one image, a planned output and every operand but x a constant."""
    fixed_ops = all(form != "full" and i in constants for form, i in operands)
    binds = n_img == 1 and out is not None and constant_w and (b_index is None or constant_b or b_index in constants) \
        and fixed_ops
    return fixed_ops, binds


def _direct_step(conv: Node, out: np.ndarray | None, epilogue: Epilogue, x_index: int, w_index: int,
                 b_index: int | None, constant_w: bool, constants: frozenset, kernel, window: tuple,
                 constant_b: bool = False):
    """conv_kernels' direct kernel called straight from the step, bias and epilogue in it: what conv_step's
    loop and conv_direct redo each call (views, the padded size, the operands' tuple) done once (~8 us a
    call of a 0.3 ms conv). window: (sh, sw, dh, dw, ph, pw). With one image, a planned output and every
    operand but x a constant, the kernel's other arguments are kept from the first call (_bound_once)."""
    out_shape, n_img, m, spatial, c, in_spatial, kh, kw = _shapes(conv)
    padded = np.zeros(conv_kernels.padded_size(c, *in_spatial, *spatial, kh, kw, *window), np.float32)
    no_bias = np.zeros(-(-m // 16) * 16, np.float32)
    operands = epilogue.operands
    fixed_ops, binds = _bindable(n_img, out, operands, constants, constant_w, b_index, constant_b)
    cache: dict = {}
    image = (c, *in_spatial)

    pads = {0: padded}   # a band's padded input, by its part (threaded_step's row parts run at once)

    def step(*inputs, into=None, band=None):
        bound = cache.get("bound")
        if bound is not None and into is None and band is None:
            kernel(np.ascontiguousarray(inputs[x_index]).reshape(image), *bound)
            return out
        wk = cache.get("w") if constant_w else None
        if wk is None:
            wk = arranged_once(_direct_weights, inputs[w_index], key=((m, c, kh, kw),)) if constant_w else \
                _direct_weights(inputs[w_index], (m, c, kh, kw))
            if constant_w:
                cache["w"] = wk
        bias = no_bias if b_index is None else np.ascontiguousarray(inputs[b_index], dtype=np.float32).reshape(-1)
        x = np.ascontiguousarray(inputs[x_index]).reshape(n_img, c, *in_spatial)
        y = into if into is not None else out if out is not None else np.empty(out_shape, np.float32)
        y4 = y.reshape(n_img, m, *spatial)
        oy0, oy1, part = band if band is not None else (0, spatial[0], 0)
        xp = pads.get(part)
        if xp is None:
            xp = pads.setdefault(part, np.zeros_like(padded))
        for n in range(n_img):
            kernel(x[n], wk, bias, *window, y4[n], _image_operands(cache, inputs, operands, n, fixed_ops), xp, oy0, oy1)
        if binds and into is None and band is None:
            whole = np.concatenate([bias, no_bias[bias.size:]])   # whole blocks of 16: the kernel pads it no more
            cache["bound"] = (wk, whole, *window, y4[0], cache["ops"], xp, oy0, oy1)
        return y
    step.splits = True   # Ingot's own kernel (not BLAS's), writing `into` where given (threaded_step)
    # bands of output rows (band=(oy0, oy1, part)) where the kernel walks the input row by row: each reads
    # its rows of the input once, where parts of channels each copied all of it into their padding
    step.bands = conv_kernels.rows_first(c, *in_spatial, *spatial, kh, kw, *window, m)
    return step


def _winograd_step(conv: Node, out: np.ndarray | None, epilogue: Epilogue, x_index: int, w_index: int,
                   b_index: int | None, constant_w: bool, constants: frozenset, constant_b: bool):
    """conv_winograd's kernel, bias and epilogue in it; with one image, a planned output and every operand but
    x a constant, the kernel's other arguments kept from the first call (as _direct_step's)."""
    out_shape, n_img, m, spatial, c, in_spatial, _, _ = _shapes(conv)
    kernel = conv_winograd.driver(epilogue.steps, epilogue.operands, m)
    buffers = conv_winograd.Buffers(c, m, *in_spatial)
    no_bias = np.zeros(m, np.float32)
    operands = epilogue.operands
    fixed_ops, binds = _bindable(n_img, out, operands, constants, constant_w, b_index, constant_b)
    cache: dict = {}

    def step(*inputs, into=None):
        bound = cache.get("bound")
        if bound is not None and into is None:
            kernel(np.ascontiguousarray(inputs[x_index], dtype=np.float32).reshape(c, *in_spatial), *bound,
                   *buffers.args())
            return out
        u = cache.get("w") if constant_w else None
        if u is None:
            u = arranged_once(conv_winograd.arrange_weights, inputs[w_index]) if constant_w else \
                conv_winograd.arrange_weights(inputs[w_index])
            if constant_w:
                cache["w"] = u
        bias = no_bias if b_index is None else np.ascontiguousarray(inputs[b_index], dtype=np.float32).reshape(-1)
        x = np.ascontiguousarray(inputs[x_index], dtype=np.float32).reshape(n_img, c, *in_spatial)
        y = into if into is not None else out if out is not None else np.empty(out_shape, np.float32)
        y4 = y.reshape(n_img, m, *spatial)
        for n in range(n_img):
            kernel(x[n], u, bias, y4[n], _image_operands(cache, inputs, operands, n, fixed_ops), *buffers.args())
        if binds and into is None:
            cache["bound"] = (u, bias, y4[0], cache["ops"])
        return y
    step.splits = True   # Ingot's own kernel (not BLAS's), writing `into` where given (threaded_step)
    return step


def _direct_weights(w: np.ndarray, shape: tuple) -> np.ndarray:
    return conv_kernels.direct_weights(np.asarray(w, np.float32).reshape(shape))


def _amx_step(conv: Node, out: np.ndarray | None, epilogue: Epilogue, x_index: int, w_index: int,
              b_index: int | None, constant: bool, constants: frozenset, precision: str, window: tuple):
    """conv_amx's kernel (AMX tiles, `precision` "bf16x3" or "bf16x6"), bias and epilogue in it; constant:
    the weights (and bias) are constants, split once. window: (sh, sw, dh, dw, ph, pw)."""
    out_shape, n_img, m, (oh, ow), c, (h, w), kh, kw = _shapes(conv)
    sh, sw, dh, dw, ph, pw = window
    g = conv_amx.Geometry(c, h, w, m, kh, kw, sh, sw, dh, dw, ph, pw, oh, ow, precision)
    kernel = conv_amx.driver(g.kc, precision, epilogue.steps, epilogue.operands)
    planes = g.planes()
    scratch = np.zeros(1024 + 16, np.float32)   # four accumulators; an epilogue run's masked lanes read past
    operands = epilogue.operands
    fixed_ops = all(form != "full" and i in constants for form, i in operands)
    cache: dict = {}

    def step(*inputs, into=None):
        arranged = cache.get("w") if constant else None
        if arranged is None:
            arranged = g.weights(inputs[w_index], inputs[b_index] if b_index is not None else None)
            if constant:
                cache["w"] = arranged
        x = np.ascontiguousarray(inputs[x_index], dtype=np.float32).reshape(n_img, c, h, w)
        y = into if into is not None else out if out is not None else np.empty(out_shape, np.float32)
        y4 = y.reshape(n_img, m, oh, ow)
        for n in range(n_img):
            kernel(x[n], planes, g.parts, g.part_size, sh, sw, ph, pw, g.wq, g.pl, g.chunks, (kh - 1) * dh,
                   *arranged, g.offs, g.n_tiles, g.band, y4[n], scratch,
                   _image_operands(cache, inputs, operands, n, fixed_ops))
        return y
    step.splits = True   # Ingot's own kernel (not BLAS's), writing `into` where given (threaded_step)
    return step


def _shapes(conv: Node) -> tuple:
    """(output shape, images, output channels, output (H, W), input channels, input (H, W), kh, kw) of a 1-D
    or 2-D conv, a 1-D one as H = 1."""
    out_shape = tuple(conv.type.shape)
    n_img, m = out_shape[:2]
    spatial = tuple(out_shape[2:]) if len(out_shape) == 4 else (1,) + tuple(out_shape[2:])
    x_shape = conv.src[0].type.shape
    c, in_spatial = x_shape[1], (tuple(x_shape[2:]) if len(x_shape) == 4 else (1,) + tuple(x_shape[2:]))
    w_shape = conv.src[1].type.shape
    kh, kw = (w_shape[2], w_shape[3]) if len(w_shape) == 4 else (1, w_shape[2])
    return out_shape, n_img, m, spatial, c, in_spatial, kh, kw


def _strided_pointwise(kh: int, kw: int, strides, pads, groups: int) -> bool:
    """A 1 x 1 convolution with a stride above 1 and no padding (a ResNet block's shortcut): the input's
    strided positions copied out, then the pointwise kernel (DBNet's 16 x 80 x 80 -> 32 x 40 x 40: 0.11 ms
    through conv_direct, which copies all the input and stores tiles of 8 columns for 16 taps)."""
    return kh == kw == 1 and groups == 1 and any(s > 1 for s in strides) and not any(a or b for a, b in pads)


def _direct_better(reduction: int, m: int, stride: int, ow: int) -> bool:
    """Where conv_spatial's row kernel would take a kxk conv at the edge of its range (C * kh * kw =
    SMALL_REDUCTION, 16 channels of 3 x 3) to 16 or more outputs: conv_direct wins at stride 2 and on rows
    narrower than the row kernel's tile (CPU ms in the model, rows -> direct: 16 x 160 x 160 -> 32 stride 2
    0.80 -> 0.75, 16 x 80 x 80 -> 32 stride 2 0.235 -> 0.186, 16 x 40 x 40 -> 32 0.188 -> 0.171; 16 x 80 x 80
    -> 16 stride 1 stays: 0.311 there, 0.335 direct)."""
    return reduction >= conv_spatial.SMALL_REDUCTION and m >= 16 and (stride == 2 or ow < conv_spatial.TILE)


def _spatial_step(conv: Node, out: np.ndarray | None, epilogue: Epilogue, x_index: int, w_index: int,
                  b_index: int | None, constant: bool, window: tuple | None, kind: str = "depthwise",
                  constants: frozenset = frozenset(), subsample: tuple | None = None, blocked_in: bool = False,
                  blocked_out: bool = False):
    """conv_spatial's kernel, the bias and epilogue applied before the store: a pointwise conv (groups 1,
    window None; kind "channels": conv_pointwise's kernel), else a depthwise one, window (column stride,
    row stride, dh, dw, ph, pw), or (kind "rows") a kxk one of few channels, window (stride, dh, dw, ph, pw).
    subsample (sh, sw): a pointwise conv with these strides, run on the input's strided positions.
    blocked_in, blocked_out (kind "channels"): the input, the output channel-blocked (ops/layout.py)."""
    assert kind == "channels" or not (blocked_in or blocked_out)
    out_shape = tuple(conv.type.shape)
    n_img, m = out_shape[:2]
    spatial = out_shape[2:] if len(out_shape) == 4 else (1,) + out_shape[2:]
    c = conv.src[0].type.shape[1]
    in_spatial = conv.src[0].type.shape[2:] if len(out_shape) == 4 else (1,) + conv.src[0].type.shape[2:]
    if subsample:
        in_spatial = spatial
    operands = epilogue.operands
    w_shape = conv.src[1].type.shape
    size = (w_shape[2], w_shape[3]) if len(w_shape) == 4 else (1, w_shape[2])
    depthwise = window if kind == "depthwise" else None
    if kind == "channels":   # conv_pointwise: 16 output channels a vector
        kernel = conv_pointwise.driver(epilogue.steps, operands, blocked_in, blocked_out)
    else:
        kernel = conv_spatial.driver(*size, epilogue.steps, operands, depthwise[0] if depthwise else 0,
                                     window[0] if window and kind == "rows" else 0)
    arrange = conv_pointwise.arrange_weights if kind == "channels" else conv_spatial.arrange_weights
    arranged: dict = {}
    x_shape = (n_img, c, *in_spatial) if window else (n_img, c, int(np.prod(in_spatial)))
    y_shape = (n_img, m, *spatial) if window else (n_img, m, int(np.prod(spatial)))
    if blocked_in:
        x_shape = (n_img, -(-c // 16), int(np.prod(in_spatial)) * 16)
    if blocked_out:
        y_shape = (n_img, -(-m // 16), int(np.prod(spatial)) * 16)
        out_shape = (n_img, -(-m // 16), *conv.type.shape[2:], 16)
    tail = tuple(window[1:]) if window else ()
    after = (m,) if blocked_out else ()   # the blocked kernel takes the output channels last
    # operands that are constants (a folded batch norm's scale, an activation's bounds) are read once
    fixed_ops = all(form != "full" and i in constants for form, i in operands)
    # one image, a planned output, constant weights and operands: the kernel's other arguments kept from the
    # first call (~1.5 us a call of Python, YOLO's and DBNet's ~20 such steps a run)
    binds = n_img == 1 and out is not None and constant and fixed_ops

    def step(*inputs, into=None):
        bound = arranged.get("bound")
        if bound is not None and into is None:
            x = inputs[x_index]
            if subsample:
                x = x[:, :, ::subsample[0], ::subsample[1]] if x.ndim == 4 else x[:, :, ::subsample[-1]]
            kernel(np.ascontiguousarray(x, dtype=np.float32).reshape(x_shape[1:]), *bound)
            return out
        x, w = inputs[x_index], inputs[w_index]
        bias = inputs[b_index] if b_index is not None else None
        wk = arranged.get("w") if constant else None
        if wk is None:
            if depthwise:
                wk = (np.ascontiguousarray(w, dtype=np.float32).reshape(m, -1),
                      np.zeros(m, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32))
            else:
                wk = arranged_once(arrange, w, bias) if constant else arrange(w, bias)
            if constant:
                arranged["w"] = wk
        if subsample:
            x = x[:, :, ::subsample[0], ::subsample[1]] if x.ndim == 4 else x[:, :, ::subsample[-1]]
        xs = np.ascontiguousarray(x, dtype=np.float32).reshape(x_shape)
        y = into if into is not None else out if out is not None else np.empty(out_shape, np.float32)
        ys = y.reshape(y_shape)
        for n in range(n_img):
            kernel(xs[n], wk[0], wk[1], *tail, ys[n], _image_operands(arranged, inputs, operands, n, fixed_ops), *after)
        if binds and into is None:
            arranged["bound"] = (wk[0], wk[1], *tail, ys[0], arranged["ops"], *after)
        return y
    step.splits = True   # Ingot's own kernel (not BLAS's), writing `into` where given (threaded_step)
    return step


def _image_operands(cache: dict, inputs, operands, n: int, fixed: bool) -> tuple:
    """Image n's epilogue operands (`_operand` of each); fixed (every operand a constant, none per image):
    made once and kept in cache["ops"]."""
    ops = cache.get("ops") if fixed else None
    if ops is None:
        ops = tuple(_operand(inputs[i], form, n) for form, i in operands)
        if fixed:
            cache["ops"] = ops
    return ops


def _operand(a: np.ndarray, form: str, n: int) -> np.ndarray:
    """An epilogue operand as conv_spatial reads it: a 1-D float32 array (scalar: [1]; channel: [M]; full:
    image n's values)."""
    if form == "full":
        a = a[n]
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1)


def conv_lowering(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    if not fast(node):
        return None
    return conv_step(node, out, Epilogue(None, None), b_index=2 if len(node.src) > 2 else None,
                     constant_w=node.src[1].op == Op.CONSTANT,
                     constant_b=len(node.src) > 2 and node.src[2].op == Op.CONSTANT, precision=options.float32_precision,
                     threads=options.resolved_threads, winograd_channels=options.winograd_channels)


def conv_epilogue_lowering(node: Node, out, options: CpuOptions = DEFAULT_CPU):
    """The FUSED "conv_epilogue" op: its body's conv, then the rest of the body per tile."""
    body: Body = node.attrs["body"]
    (conv,) = body.find(Op.CONV)
    if not fast(conv) or node.type.shape != conv.type.shape or node.dtype.name != "float32":
        return None
    index = [s.attrs["param"] for s in conv.src]
    return conv_step(conv, out, Epilogue(body, conv), index[0], index[1], index[2] if len(index) > 2 else None,
                     constant_w=node.src[index[1]].op == Op.CONSTANT,
                     constant_b=len(index) > 2 and node.src[index[2]].op == Op.CONSTANT,
                     constants=frozenset(i for i, s in enumerate(node.src) if s.op == Op.CONSTANT),
                     precision=options.float32_precision, threads=options.resolved_threads,
                     winograd_channels=options.winograd_channels)


FUSED_LOWERINGS = {"conv_epilogue": conv_epilogue_lowering}
