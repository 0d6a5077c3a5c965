"""The lstm op (ops/recurrent.py) on the device: no host round trip, so an ONNX model with an LSTM
(a CRNN recogniser, Silero-style voice activity) is captured as one CUDA graph.

Every step's input projection is one cuBLAS matmul (cuda.float32_precision) over all T steps and
both directions, before the recurrence. The recurrence then runs one launch per time step: a
program per (direction, tile of batch rows, tile of hidden units) computes its units' four gates
from the whole previous hidden state (h @ R^T for its rows of R), the gates' pointwise math and the
masking by sequence length, and writes its slice of the new h, c and y. The hidden state ping-pongs between two buffers (every
program reads all of the old h while others write the new one); c is updated in place (each program
owns its elements). Float32 throughout; the default activations (sigmoid, tanh, tanh), with clip,
input_forget and peepholes. Other activations, rnn and gru keep the host reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ir import Op
from ...ops.recurrent import DEFAULT_ACTIVATIONS, _directions
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
def _lstm_step_kernel(proj_ptr, r_ptr, peep_ptr, h_in_ptr, h_out_ptr, c_ptr, y_ptr, len_ptr, s, T, B, H, clip,
                      FIRST_REVERSE: tl.constexpr, HAS_CLIP: tl.constexpr, INPUT_FORGET: tl.constexpr,
                      BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    # proj [D, T, B, 4H] (input projection and both biases), r [D, 4H, H], peep [D, 3H], h/c [D, B, H],
    # y [T, D, B, H], len [B] int32; all contiguous. Gates in ONNX's order: i, o, f, c.
    d = tl.program_id(0)
    rows = tl.program_id(1) * BB + tl.arange(0, BB)
    units = tl.program_id(2) * BH + tl.arange(0, BH)
    n_dirs = tl.num_programs(0)
    t = s
    if FIRST_REVERSE or d == 1:
        t = T - 1 - s
    row_ok, unit_ok = rows < B, units < H
    ok = row_ok[:, None] & unit_ok[None, :]
    acc_i = tl.zeros((BB, BH), tl.float32)
    acc_o = tl.zeros((BB, BH), tl.float32)
    acc_f = tl.zeros((BB, BH), tl.float32)
    acc_c = tl.zeros((BB, BH), tl.float32)
    h_rows = h_in_ptr + (d * B + rows) * H
    r_dir = r_ptr + d * 4 * H * H
    for k0 in range(0, H, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < H
        hk = tl.load(h_rows[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)[:, None, :]
        r_mask = unit_ok[:, None] & k_ok[None, :]
        r_at = r_dir + units[:, None] * H + ks[None, :]
        acc_i += tl.sum(hk * tl.load(r_at, mask=r_mask, other=0.0)[None, :, :], axis=2)
        acc_o += tl.sum(hk * tl.load(r_at + H * H, mask=r_mask, other=0.0)[None, :, :], axis=2)
        acc_f += tl.sum(hk * tl.load(r_at + 2 * H * H, mask=r_mask, other=0.0)[None, :, :], axis=2)
        acc_c += tl.sum(hk * tl.load(r_at + 3 * H * H, mask=r_mask, other=0.0)[None, :, :], axis=2)
    p_at = proj_ptr + ((d * T + t) * B + rows[:, None]) * 4 * H + units[None, :]
    gi = acc_i + tl.load(p_at, mask=ok, other=0.0)
    go = acc_o + tl.load(p_at + H, mask=ok, other=0.0)
    gf = acc_f + tl.load(p_at + 2 * H, mask=ok, other=0.0)
    gc = acc_c + tl.load(p_at + 3 * H, mask=ok, other=0.0)
    state_at = (d * B + rows[:, None]) * H + units[None, :]
    c = tl.load(c_ptr + state_at, mask=ok, other=0.0)
    h = tl.load(h_in_ptr + state_at, mask=ok, other=0.0)
    pi = tl.load(peep_ptr + d * 3 * H + units, mask=unit_ok, other=0.0)[None, :]
    po = tl.load(peep_ptr + d * 3 * H + H + units, mask=unit_ok, other=0.0)[None, :]
    pf = tl.load(peep_ptr + d * 3 * H + 2 * H + units, mask=unit_ok, other=0.0)[None, :]
    i = tl.sigmoid(_clip(gi + pi * c, clip, HAS_CLIP))
    if INPUT_FORGET:
        f = 1.0 - i
    else:
        f = tl.sigmoid(_clip(gf + pf * c, clip, HAS_CLIP))
    new_c = f * c + i * _tanh(_clip(gc, clip, HAS_CLIP))
    o = tl.sigmoid(_clip(go + po * new_c, clip, HAS_CLIP))
    new_h = o * _tanh(new_c)
    live = (t < tl.load(len_ptr + rows, mask=row_ok, other=0))[:, None]
    tl.store(c_ptr + state_at, tl.where(live, new_c, c), mask=ok)
    tl.store(h_out_ptr + state_at, tl.where(live, new_h, h), mask=ok)
    tl.store(y_ptr + ((t * n_dirs + d) * B + rows[:, None]) * H + units[None, :], tl.where(live, new_h, 0.0), mask=ok)


def lstm(x, w, r, bias, lengths, h0, c0, peep, *, first_reverse: bool, clip: float | None, input_forget: bool):
    """ops/recurrent.py's lstm (default activations) on the device: (y [T, D, B, H], h [D, B, H], c [D, B, H])."""
    seq, batch, size = x.shape
    dirs, hidden = r.shape[0], r.shape[-1]
    f32 = torch.float32
    proj = torch.matmul(x.to(f32).reshape(1, seq * batch, size), w.to(f32).transpose(1, 2))      # [D, T*B, 4H]
    proj = (proj + (bias[:, :4 * hidden] + bias[:, 4 * hidden:]).to(f32)[:, None, :]).contiguous()
    r = r.to(f32).contiguous()
    peep = peep.to(f32).contiguous()
    hs = [h0.to(f32).contiguous().clone(), torch.empty((dirs, batch, hidden), dtype=f32, device=x.device)]
    c = c0.to(f32).contiguous().clone()
    y = torch.empty((seq, dirs, batch, hidden), dtype=f32, device=x.device)
    lens = torch.clamp(lengths, max=seq).to(torch.int32).contiguous()
    bb = min(16, triton.next_power_of_2(max(batch, 1)))
    bh = min(32, triton.next_power_of_2(max(hidden, 1)))
    bk = min(32, triton.next_power_of_2(max(hidden, 1)))
    grid = (dirs, triton.cdiv(batch, bb), triton.cdiv(hidden, bh))
    for s in range(seq if batch and hidden else 0):
        _lstm_step_kernel[grid](proj, r, peep, hs[s % 2], hs[(s + 1) % 2], c, y, lens, s, seq, batch, hidden,
                                float(clip or 0.0), FIRST_REVERSE=first_reverse, HAS_CLIP=clip is not None,
                                INPUT_FORGET=bool(input_forget), BB=bb, BH=bh, BK=bk, num_warps=4)
    if not (batch and hidden):
        y.zero_()
    out = (y, hs[seq % 2] if batch and hidden else hs[0], c)
    return tuple(o.to(x.dtype) for o in out)


@lowering(Op.LSTM)
def _lstm(ctx: Lowering) -> StepFn:
    a = ctx.node.attrs
    d = _directions(a)
    if tuple(a.get("activations", ())) != DEFAULT_ACTIVATIONS[Op.LSTM] * d:   # (sigmoid and tanh take no alpha)
        return host_reference(ctx)   # other activation functions: the reference, on the host
    kw = dict(first_reverse=a["direction"] == "reverse", clip=a.get("clip"), input_forget=bool(a.get("input_forget")))
    return with_float32_precision(ctx, lambda x, w, r, bias, lengths, h0, c0, peep:
                                  lstm(x, w, r, bias, lengths, h0, c0, peep, **kw))
