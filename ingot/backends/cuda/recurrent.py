"""The recurrent ops (ops/recurrent.py: rnn, lstm, gru) on the device: no host round trip, so an ONNX
model with recurrent layers (a CRNN recogniser, Silero-style voice activity) is captured as one CUDA
graph.

Every step's input projection is one cuBLAS matmul (cuda.float32_precision) over all T steps and
both directions, before the recurrence. The recurrence then runs one launch per time step: a
program per (direction, tile of batch rows, tile of hidden units) computes its units' four gates
from the whole previous hidden state (h @ R^T for its rows of R), the gates' pointwise math and the
masking by sequence length, and writes its slice of the new h, c and y. The hidden state ping-pongs between two buffers (every
program reads all of the old h while others write the new one); c is updated in place (each program
owns its elements). A GRU whose reset gate applies before the recurrent product
(linear_before_reset = 0, ONNX's default) needs every unit's reset gate first: two launches a step.
Float32 throughout; the default activations of each op, with clip, and lstm's input_forget and
peepholes. Other activations keep the host reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ir import Op
from ...ops.recurrent import DEFAULT_ACTIVATIONS, GATES, _directions
from .lowerings import Lowering, StepFn, host_reference, lowering, with_float32_precision


@triton.jit
def _clip(x, clip, HAS_CLIP: tl.constexpr):
    if HAS_CLIP:
        x = tl.minimum(tl.maximum(x, -clip), clip)
    return x


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gate(h_rows, row_ok, r_gate, units, unit_ok, H, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    """[BB, BH]: h[rows] @ R_gate[units]^T, R_gate [H, H] row-major (one gate's rows of R). With BK >= H
    one load and no loop, so a step's gates load together (a loop's trip count is not known here)."""
    if BK >= H:
        ks = tl.arange(0, BK)
        k_ok = ks < H
        hk = tl.load(h_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        rk = tl.load(r_gate + units[:, None] * H + ks[None, :], mask=unit_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.sum(hk[:, None, :] * rk[None, :, :], axis=2)
    else:
        acc = tl.zeros((BB, BH), tl.float32)
        for k0 in range(0, H, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < H
            hk = tl.load(h_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            rk = tl.load(r_gate + units[:, None] * H + ks[None, :], mask=unit_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(hk[:, None, :] * rk[None, :, :], axis=2)
    return acc


@triton.jit
def _step_tile(s, T, B, H, FIRST_REVERSE: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr):
    """This program's direction d, time step t of step s, batch rows and hidden units (and their masks)."""
    d = tl.program_id(0)
    rows = tl.program_id(1) * BB + tl.arange(0, BB)
    units = tl.program_id(2) * BH + tl.arange(0, BH)
    t = s
    if FIRST_REVERSE or d == 1:
        t = T - 1 - s
    row_ok, unit_ok = rows < B, units < H
    return d, t, rows, units, row_ok, unit_ok, row_ok[:, None] & unit_ok[None, :]


@triton.jit
def _step_kernel(proj_ptr, r_ptr, extra_ptr, h_in_ptr, h_out_ptr, c_ptr, y_ptr, len_ptr, s, T, B, H, clip,
                 KIND: tl.constexpr, G: tl.constexpr, FIRST_REVERSE: tl.constexpr, HAS_CLIP: tl.constexpr,
                 INPUT_FORGET: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    # One time step of every direction. proj [D, T, B, G*H]: the input projection and the biases
    # outside the recurrent product; r [D, G*H, H]; h/c [D, B, H]; y [T, D, B, H]; len [B] int32; all
    # contiguous. KIND 0 rnn (gate h), 1 lstm (gates i, o, f, c; extra = peepholes [D, 3H]), 2 gru
    # with linear_before_reset (gates z, r, h; extra = the recurrent bias of h [D, H]), 3 the second
    # launch of a gru without it (h_in = r * h, c = z: _gru_reset_kernel's outputs). G: the op's gates.
    d, t, rows, units, row_ok, unit_ok, ok = _step_tile(s, T, B, H, FIRST_REVERSE, BB, BH)
    n_dirs = tl.num_programs(0)
    h_rows = h_in_ptr + (d * B + rows) * H
    r_dir = r_ptr + d * G * H * H
    p_at = proj_ptr + ((d * T + t) * B + rows[:, None]) * G * H + units[None, :]
    state_at = (d * B + rows[:, None]) * H + units[None, :]
    if KIND == 0:
        h = tl.load(h_in_ptr + state_at, mask=ok, other=0.0)
        new_h = _tanh(_clip(tl.load(p_at, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_dir, units, unit_ok, H, BB, BH, BK),
                            clip, HAS_CLIP))
    elif KIND == 1:
        h = tl.load(h_in_ptr + state_at, mask=ok, other=0.0)
        c = tl.load(c_ptr + state_at, mask=ok, other=0.0)
        gi = tl.load(p_at, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_dir, units, unit_ok, H, BB, BH, BK)
        go = tl.load(p_at + H, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_dir + H * H, units, unit_ok, H, BB, BH, BK)
        gf = tl.load(p_at + 2 * H, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_dir + 2 * H * H, units, unit_ok, H,
                                                                BB, BH, BK)
        gc = tl.load(p_at + 3 * H, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_dir + 3 * H * H, units, unit_ok, H,
                                                                BB, BH, BK)
        pi = tl.load(extra_ptr + d * 3 * H + units, mask=unit_ok, other=0.0)[None, :]
        po = tl.load(extra_ptr + d * 3 * H + H + units, mask=unit_ok, other=0.0)[None, :]
        pf = tl.load(extra_ptr + d * 3 * H + 2 * H + units, mask=unit_ok, other=0.0)[None, :]
        i = tl.sigmoid(_clip(gi + pi * c, clip, HAS_CLIP))
        if INPUT_FORGET:
            f = 1.0 - i
        else:
            f = tl.sigmoid(_clip(gf + pf * c, clip, HAS_CLIP))
        new_c = f * c + i * _tanh(_clip(gc, clip, HAS_CLIP))
        o = tl.sigmoid(_clip(go + po * new_c, clip, HAS_CLIP))
        new_h = o * _tanh(new_c)
    elif KIND == 2:
        h = tl.load(h_in_ptr + state_at, mask=ok, other=0.0)
        z = tl.sigmoid(_clip(tl.load(p_at, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_dir, units, unit_ok, H, BB, BH, BK),
                             clip, HAS_CLIP))
        r = tl.sigmoid(_clip(tl.load(p_at + H, mask=ok, other=0.0) +
                             _gate(h_rows, row_ok, r_dir + H * H, units, unit_ok, H, BB, BH, BK), clip, HAS_CLIP))
        rh = _gate(h_rows, row_ok, r_dir + 2 * H * H, units, unit_ok, H, BB, BH, BK) + \
            tl.load(extra_ptr + d * H + units, mask=unit_ok, other=0.0)[None, :]
        candidate = _tanh(_clip(tl.load(p_at + 2 * H, mask=ok, other=0.0) + r * rh, clip, HAS_CLIP))
        new_h = (1.0 - z) * candidate + z * h
    else:
        h = tl.load(extra_ptr + state_at, mask=ok, other=0.0)      # the old h (h_in holds r * h)
        z = tl.load(c_ptr + state_at, mask=ok, other=0.0)
        p_h = proj_ptr + ((d * T + t) * B + rows[:, None]) * 3 * H + 2 * H + units[None, :]
        r_h = r_ptr + d * 3 * H * H + 2 * H * H
        candidate = _tanh(_clip(tl.load(p_h, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_h, units, unit_ok, H, BB, BH, BK),
                                clip, HAS_CLIP))
        new_h = (1.0 - z) * candidate + z * h
    live = (t < tl.load(len_ptr + rows, mask=row_ok, other=0))[:, None]
    if KIND == 1:
        tl.store(c_ptr + state_at, tl.where(live, new_c, c), mask=ok)
    tl.store(h_out_ptr + state_at, tl.where(live, new_h, h), mask=ok)
    tl.store(y_ptr + ((t * n_dirs + d) * B + rows[:, None]) * H + units[None, :], tl.where(live, new_h, 0.0), mask=ok)


@triton.jit
def _gru_reset_kernel(proj_ptr, r_ptr, h_in_ptr, z_ptr, rh_ptr, s, T, B, H, clip, FIRST_REVERSE: tl.constexpr,
                      HAS_CLIP: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    # The first launch of a gru step without linear_before_reset: z and r * h for _step_kernel's KIND 3.
    d, t, rows, units, row_ok, unit_ok, ok = _step_tile(s, T, B, H, FIRST_REVERSE, BB, BH)
    h_rows = h_in_ptr + (d * B + rows) * H
    r_dir = r_ptr + d * 3 * H * H
    p_at = proj_ptr + ((d * T + t) * B + rows[:, None]) * 3 * H + units[None, :]
    state_at = (d * B + rows[:, None]) * H + units[None, :]
    z = tl.sigmoid(_clip(tl.load(p_at, mask=ok, other=0.0) + _gate(h_rows, row_ok, r_dir, units, unit_ok, H, BB, BH, BK),
                         clip, HAS_CLIP))
    r = tl.sigmoid(_clip(tl.load(p_at + H, mask=ok, other=0.0) +
                         _gate(h_rows, row_ok, r_dir + H * H, units, unit_ok, H, BB, BH, BK), clip, HAS_CLIP))
    tl.store(z_ptr + state_at, z, mask=ok)
    tl.store(rh_ptr + state_at, r * tl.load(h_in_ptr + state_at, mask=ok, other=0.0), mask=ok)


KINDS = {Op.RNN: 0, Op.LSTM: 1, Op.GRU: 2}


def step_tiles(batch: int, hidden: int) -> tuple[int, int, int]:
    """(BB, BH, BK): batch rows, hidden units and K columns of a program's tile."""
    bb = min(16, triton.next_power_of_2(max(batch, 1)))
    bh = min(32, triton.next_power_of_2(max(hidden, 1)))
    bk = min(32 if bb <= 4 else 16, bh)     # the [BB, BH, BK] product in registers: 168 of them at 16 x 32 x 32
    return bb, bh, bk


def recurrent(op: Op, x, w, r, bias, lengths, h0, c0=None, peep=None, *, first_reverse: bool, clip: float | None,
              input_forget: bool = False, linear_before_reset: bool = False,
              tiles: tuple[int, int, int, int] | None = None):
    """ops/recurrent.py's rnn, lstm or gru (default activations) on the device: (y [T, D, B, H], h [D, B, H])
    and for lstm c [D, B, H]. tiles: (BB, BH, BK, warps) instead of step_tiles' and 4 warps."""
    seq, batch, size = x.shape
    dirs, hidden = r.shape[0], r.shape[-1]
    g = GATES[op]
    f32, device = torch.float32, x.device
    bias = bias.to(f32)
    wb, rb = bias[:, :g * hidden], bias[:, g * hidden:]
    if op == Op.GRU and linear_before_reset:   # the recurrent bias of h is inside r * (...): kept apart
        outside, extra = torch.cat([wb[:, :2 * hidden] + rb[:, :2 * hidden], wb[:, 2 * hidden:]], 1), rb[:, 2 * hidden:]
    else:
        outside, extra = wb + rb, (peep if op == Op.LSTM else bias)
    proj = torch.matmul(x.to(f32).reshape(1, seq * batch, size), w.to(f32).transpose(1, 2))      # [D, T*B, G*H]
    proj = (proj + outside[:, None, :]).contiguous()
    r = r.to(f32).contiguous()
    extra = extra.to(f32).contiguous()
    hs = [h0.to(f32).contiguous().clone(), torch.empty((dirs, batch, hidden), dtype=f32, device=device)]
    c = c0.to(f32).contiguous().clone() if op == Op.LSTM else hs[1]
    y = torch.zeros((seq, dirs, batch, hidden), dtype=f32, device=device)
    lens = torch.clamp(lengths, max=seq).to(torch.int32).contiguous()
    bb, bh, bk, warps = tiles or (step_tiles(batch, hidden) + (4,))
    grid = (dirs, triton.cdiv(batch, bb), triton.cdiv(hidden, bh))
    kw = dict(FIRST_REVERSE=first_reverse, HAS_CLIP=clip is not None, BB=bb, BH=bh, BK=bk, num_warps=warps)
    two_launches = op == Op.GRU and not linear_before_reset
    if two_launches:
        z, rh = (torch.empty((dirs, batch, hidden), dtype=f32, device=device) for _ in range(2))
    for s in range(seq if batch and hidden else 0):
        h_in, h_out = hs[s % 2], hs[(s + 1) % 2]
        if two_launches:
            _gru_reset_kernel[grid](proj, r, h_in, z, rh, s, seq, batch, hidden, float(clip or 0.0), **kw)
            _step_kernel[grid](proj, r, h_in, rh, h_out, z, y, lens, s, seq, batch, hidden, float(clip or 0.0), KIND=3,
                               G=g, INPUT_FORGET=False, **kw)
        else:
            _step_kernel[grid](proj, r, extra, h_in, h_out, c, y, lens, s, seq, batch, hidden, float(clip or 0.0),
                               KIND=KINDS[op], G=g, INPUT_FORGET=bool(input_forget), **kw)
    h_last = hs[seq % 2] if batch and hidden else hs[0]
    out = (y, h_last) + ((c,) if op == Op.LSTM else ())
    return tuple(o.to(x.dtype) for o in out)


@lowering(Op.RNN, Op.LSTM, Op.GRU)
def _recurrent(ctx: Lowering) -> StepFn:
    op, a = ctx.node.op, ctx.node.attrs
    if tuple(a.get("activations", ())) != DEFAULT_ACTIVATIONS[op] * _directions(a):   # (sigmoid, tanh take no alpha)
        return host_reference(ctx)   # other activation functions: the reference, on the host
    kw = dict(first_reverse=a["direction"] == "reverse", clip=a.get("clip"), input_forget=bool(a.get("input_forget")),
              linear_before_reset=bool(a.get("linear_before_reset")))
    return with_float32_precision(ctx, lambda *xs: recurrent(op, *xs, **kw))
