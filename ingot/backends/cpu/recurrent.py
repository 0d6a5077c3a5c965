"""The LSTM as one compiled call per layer (numba): the op's NumPy reference (ops/recurrent.py) runs
a dozen NumPy calls per time step and direction. Here, per direction, every step's input projection
(x W^T + both biases) is one register-blocked GEMM and every step's recurrent GEMV (R h) one pass of
the same panels, the gates' pointwise math after it, all inside one kernel call for the layer.

W and R are packed once (where constant) as panels of WIDTH gate columns, k-major ([panels, K,
WIDTH]): the `_panel` intrinsic keeps the sums of 1 or 4 rows x WIDTH columns in vector registers over
the whole k loop, each weight row of the panel read once for those rows. OpenBLAS's sgemm took 0.22
ms for a CRNN layer's 80 x 128 x 512 projection (0.13 here); the GEMV, where the sums lived in memory,
3.3 us a step (2.8: R, 256 KB, streams from L2 every step either way). The projection runs 6 rows a
pass over k in chunks of 128 (4 rows over all k: 141 GFLOP/s, 6 rows over chunks: 162-178, Xeon).

Lowered where the op is float32 with the default activations (sigmoid, tanh, tanh); other LSTMs,
and RNN and GRU, run the reference.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ...ir import Node, Op
from . import conv_amx, matmul_amx
from .nn_kernels import sigmoid as _sigmoid, tanh as _tanh
from .vnni import splat

DEFAULT = ("Sigmoid", "Tanh", "Tanh")
VECTORS = 4              # 16-lane float32 vectors per panel row
WIDTH = 16 * VECTORS     # gate columns per panel
ROWS = 6                 # rows of x per panel pass (then one at a time): 24 sums in registers
DEPTH = 128              # k a panel pass runs over: 32 KB of the panel, read from L1 by each pass of rows


def _panel_of(rows: int, spans: int = 1):
    """_panel for `rows` rows and `spans` panels side by side: the k loop inside one intrinsic, rows x
    spans x WIDTH sums in registers (one row alone waits on 4 chains of multiply-adds: spans of 4 keep 16)."""
    @intrinsic
    def _panel(typingctx, acc, acc_at, acc_stride, w, w_at, k, x, x_at, x_stride):
        """acc[acc_at + r * acc_stride + p * WIDTH + c] += sum over i < k of x[x_at + r * x_stride + i] *
        w[w_at + p * k * WIDTH + i * WIDTH + c] for r < rows, p < spans, c < WIDTH (flat float32 arrays; k >= 1)."""
        sig = types.void(acc, acc_at, acc_stride, w, w_at, k, x, x_at, x_stride)

        def codegen(context, builder, signature, args):
            acc_v, acc_at_v, acc_stride_v, w_v, w_at_v, k_v, x_v, x_at_v, x_stride_v = args
            arr = lambda i, v: context.make_array(signature.args[i])(context, builder, v)  # noqa: E731
            aa, wa, xa = arr(0, acc_v), arr(3, w_v), arr(6, x_v)
            index = k_v.type
            f16x = ir.VectorType(ir.FloatType(), 16)
            const = lambda v: ir.Constant(index, v)  # noqa: E731
            lanes = [(p, v) for p in range(spans) for v in range(VECTORS)]
            ptrs = [[builder.bitcast(builder.gep(aa.data, [builder.add(builder.add(acc_at_v, builder.mul(acc_stride_v, const(r))),
                                                                       const(p * WIDTH + 16 * v))]), f16x.as_pointer())
                     for p, v in lanes] for r in range(rows)]
            first = [[builder.load(ptr, align=4) for ptr in row] for row in ptrs]
            row_at = [builder.add(x_at_v, builder.mul(x_stride_v, const(r))) for r in range(rows)]
            span_at = [builder.add(w_at_v, builder.mul(k_v, const(p * WIDTH))) for p in range(spans)]
            entry = builder.block
            loop = builder.append_basic_block("k_loop")
            done = builder.append_basic_block("k_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            i = builder.phi(index)
            sums = [[builder.phi(f16x) for _ in lanes] for _ in range(rows)]
            i.add_incoming(const(0), entry)
            for r in range(rows):
                for phi, value in zip(sums[r], first[r]):
                    phi.add_incoming(value, entry)
            weights = [builder.load(builder.bitcast(builder.gep(wa.data, [builder.add(builder.add(span_at[p], builder.mul(i, const(WIDTH))),
                                                                                      const(16 * v))]),
                                                    f16x.as_pointer()), align=4) for p, v in lanes]
            new = []
            for r in range(rows):
                xv = splat(builder, builder.load(builder.gep(xa.data, [builder.add(row_at[r], i)]), align=4), f16x)
                new.append([builder.fadd(total, builder.fmul(xv, weight, flags=("contract",)), flags=("contract",))
                            for total, weight in zip(sums[r], weights)])
            following = builder.add(i, const(1))
            i.add_incoming(following, builder.block)
            for r in range(rows):
                for phi, value in zip(sums[r], new[r]):
                    phi.add_incoming(value, builder.block)
            builder.cbranch(builder.icmp_signed("<", following, k_v), loop, done)
            builder.position_at_end(done)
            for r in range(rows):
                for ptr, value in zip(ptrs[r], new[r]):
                    builder.store(value, ptr, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return _panel


SPANS = 4                # panels side by side for one row
_panel_rows, _panel_row, _panel_spans, _panel_pair = _panel_of(ROWS), _panel_of(1), _panel_of(1, SPANS), _panel_of(1, 2)


def pack(w: np.ndarray) -> np.ndarray:
    """w [N, K] (ONNX's W or R of one direction: a row per gate column) as flat panels [ceil(N / WIDTH),
    K, WIDTH], the columns past N zero."""
    n, k = w.shape
    panels = -(-n // WIDTH)
    padded = np.zeros((panels * WIDTH, k), np.float32)
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(panels, WIDTH, k).transpose(0, 2, 1)).reshape(-1)


@njit(cache=True, nogil=True)
def accumulate(acc, acc_at, acc_stride, w, k, x, x_at, x_stride, rows, panels):
    """acc[acc_at + r * acc_stride + c] += sum over i < k of x[x_at + r * x_stride + i] * W[c, i] for r <
    rows, c < panels * WIDTH (acc, w = pack(W), x: flat float32)."""
    if k == 0:
        return
    whole = rows - rows % ROWS
    for q in range(panels):
        for k0 in range(0, k, DEPTH):   # the whole panel (64 KB at k 256) streamed from L2 by each pass did not keep up
            for r in range(0, whole, ROWS):
                _panel_rows(acc, acc_at + r * acc_stride + q * WIDTH, acc_stride, w, (q * k + k0) * WIDTH, min(DEPTH, k - k0), x,
                            x_at + r * x_stride + k0, x_stride)
    for r in range(whole, rows):   # the last rows, one at a time: SPANS panels a pass
        q = 0
        while q + SPANS <= panels:
            _panel_spans(acc, acc_at + r * acc_stride + q * WIDTH, acc_stride, w, q * k * WIDTH, k, x, x_at + r * x_stride, x_stride)
            q += SPANS
        if q + 2 <= panels:   # (an LSTM of hidden 32: its 4H = 128 gate columns, two panels, in 8 chains at once)
            _panel_pair(acc, acc_at + r * acc_stride + q * WIDTH, acc_stride, w, q * k * WIDTH, k, x, x_at + r * x_stride, x_stride)
            q += 2
        while q < panels:
            _panel_row(acc, acc_at + r * acc_stride + q * WIDTH, acc_stride, w, q * k * WIDTH, k, x, x_at + r * x_stride, x_stride)
            q += 1


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")   # no zero-division check: vectorised
def lstm_layer(x, wp, bias, rp, peephole, h0, c0, h, c, lengths, flags, clip, all_gates, staged, y):
    """Every direction of the layer: x [T, B, I] (any layout: copied into staged [T * B * I] first); wp, rp [D, panels * I * WIDTH], [D, panels * H * WIDTH] (pack(W[d]), pack(R[d])); bias [D, panels
    * WIDTH] (input + recurrent, zero past 4H); peephole [D, 3H] (input, output, forget); h0, c0 [D, B, H]: the
    initial states (any layout); h, c [D, B, H]: the last states out; lengths [B] (steps of each sequence; more than
    T: T); flags: reverse_first (direction 0 runs backwards; direction 1 always does), input_forget, projected;
    pre-activations clipped to [-clip, clip]; all_gates [D, T * B, panels * WIDTH]: scratch, or with projected x W^T + biases already in it (AMX's tiles: lstm_step); y [T, D, B, H] gets h,
    zero at and past a sequence's length."""
    seq, d, batch, hidden = y.shape
    size = x.shape[2]
    reverse_first, input_forget, projected = flags[0] != 0, flags[1] != 0, flags[2] != 0
    width = all_gates.shape[2]
    panels = bias.shape[1] // WIDTH
    rows = seq * batch
    # flat arrays and unsigned offsets inside the loops: a slice of an array costs a reference count (two
    # atomic operations; ~150 of them took a microsecond a call), a signed index a wrap test that stops
    # vectorisation (and int64 + uint64 is a float64 in numba: keep the two apart)
    for t in range(seq):   # x as rows of I floats
        for b in range(batch):
            at = np.uintp((t * batch + b) * size)
            for i in range(np.uintp(size)):
                staged[at + i] = x[t, b, i]
    hf, cf, yf = h.reshape(h.size), c.reshape(c.size), y.reshape(y.size)
    for k in range(d):
        for b in range(batch):
            at = np.uintp((k * batch + b) * hidden)
            for j in range(np.uintp(hidden)):
                hf[at + j] = h0[k, b, j]
                cf[at + j] = c0[k, b, j]
    for k in range(d):
        flat = all_gates[k].reshape(rows * width)
        if not projected:
            bk = bias[k]
            for row in range(rows):
                at = np.uintp(row * width)
                for j in range(np.uintp(panels * WIDTH)):
                    flat[at + j] = bk[j]
            accumulate(flat, 0, width, wp[k], size, staged, 0, size, rows, panels)   # x W^T + biases, all steps
        pk = peephole[k]
        hk = hf[k * batch * hidden:]
        for s in range(seq):
            t = seq - 1 - s if (reverse_first or k == 1) else s
            accumulate(flat, t * batch * width, width, rp[k], hidden, hk, 0, hidden, batch, panels)   # + R h
            for b in range(batch):
                at_y = np.uintp(((t * d + k) * batch + b) * hidden)
                if t >= lengths[b]:
                    for j in range(np.uintp(hidden)):
                        yf[at_y + j] = 0.0
                    continue
                at_g = np.uintp((t * batch + b) * width)
                at_h = np.uintp((k * batch + b) * hidden)
                h2, h3 = np.uintp(2 * hidden), np.uintp(3 * hidden)
                h1 = np.uintp(hidden)
                for j in range(np.uintp(hidden)):   # (unsigned: no negative-index wrap, a vector loop)
                    cj = cf[at_h + j]
                    i = _sigmoid(min(max(flat[at_g + j] + pk[j] * cj, -clip), clip))
                    f = _sigmoid(min(max(flat[at_g + h2 + j] + pk[h2 + j] * cj, -clip), clip))
                    if input_forget:
                        f = np.float32(1.0) - i
                    new_c = f * cj + i * _tanh(min(max(flat[at_g + h3 + j], -clip), clip))
                    o = _sigmoid(min(max(flat[at_g + h1 + j] + pk[h1 + j] * new_c, -clip), clip))
                    new_h = o * _tanh(new_c)
                    cf[at_h + j] = new_c
                    hf[at_h + j] = new_h
                    yf[at_y + j] = new_h


def lstm_step(node: Node, out, precision: str = "float32"):
    """The lstm op (float32, default activations) through lstm_layer; None where it does not apply.
    precision: CpuOptions.float32_precision; on AMX hosts the input projections of constant W and bias
    run on the tiles (matmul_amx.py: a CRNN layer's 80 x 128 x 512 in ~30 us against the panels' 130)."""
    a = node.attrs
    d = 2 if a["direction"] == "bidirectional" else 1
    if node.src[0].dtype.name != "float32" or tuple(a["activations"]) != DEFAULT * d:
        return None
    clip = np.float32(a["clip"]) if a.get("clip") is not None else np.float32(np.finfo(np.float32).max)
    input_forget = bool(a.get("input_forget"))
    reverse_first = a["direction"] == "reverse"
    seq, batch, size = node.src[0].type.shape
    hidden = node.src[2].type.shape[-1]
    panels = -(-4 * hidden // WIDTH)
    cache: dict = {}
    all_constant = all(node.src[i].op == Op.CONSTANT for i in (1, 2, 3, 4, 7))

    def made(name, index, make, value):
        """make(value), once where the op's input `index` is a constant (a fed array may change between runs)."""
        if node.src[index].op != Op.CONSTANT:
            return make(value)
        if name not in cache:
            cache[name] = make(value)
        return cache[name]

    def packed(w):
        return np.stack([pack(w[k]) for k in range(d)])

    def biases(bias):
        out = np.zeros((d, panels * WIDTH), np.float32)
        out[:, :4 * hidden] = bias[:, :4 * hidden] + bias[:, 4 * hidden:]
        return out

    def contiguous(a):
        return np.ascontiguousarray(a, np.float32)

    def steps(lengths):
        return np.asarray(lengths).astype(np.int64)

    tiles = precision != "float32" and node.src[1].op == Op.CONSTANT and node.src[3].op == Op.CONSTANT and \
        matmul_amx.fits(seq * batch, size, panels * WIDTH) and conv_amx.available()
    projections = [matmul_amx.step(seq * batch, size, panels * WIDTH, precision) for _ in range(d)] if tiles else []

    def columns(w):   # W [D, 4H, I] as [D, I, panels * WIDTH], zero past 4H: the tiles' weight
        out = np.zeros((d, size, panels * WIDTH), np.float32)
        out[:, :, :4 * hidden] = np.asarray(w, np.float32).transpose(0, 2, 1)
        return out

    flags = np.array([reverse_first, input_forget, tiles], np.int64)
    gates = np.empty((d, seq * batch, panels * WIDTH), np.float32)
    staged = np.empty(seq * batch * size, np.float32)
    fixed: list = []   # the arranged sources, once, where every one is a constant

    def arranged(w, r, bias, lengths, peephole):
        summed = made("bias", 3, biases, bias)
        return ((made("w", 1, packed, w) if not tiles else summed), summed, made("r", 2, packed, r),
                made("peephole", 7, contiguous, peephole), made("lengths", 4, steps, lengths))

    def step(x, w, r, bias, lengths, h0, c0, peephole):
        args = fixed[0] if fixed else arranged(w, r, bias, lengths, peephole)
        if all_constant and not fixed:
            fixed.append(args)
        y = np.empty((seq, d, batch, hidden), np.float32)
        h = np.empty((d, batch, hidden), np.float32)
        c = np.empty((d, batch, hidden), np.float32)
        if tiles:
            x2 = np.ascontiguousarray(x, np.float32).reshape(seq * batch, size)
            weights = made("columns", 1, columns, w)
            for k in range(d):
                projections[k](x2, weights[k], gates[k], args[1][k])
        # (projected: lstm_layer reads no W, so the biases stand in for its packed panels)
        lstm_layer(x if x.dtype == np.float32 else x.astype(np.float32), args[0], args[1], args[2], args[3],
                   h0 if h0.dtype == np.float32 else h0.astype(np.float32), c0 if c0.dtype == np.float32 else c0.astype(np.float32),
                   h, c, args[4], flags, clip, gates, staged, y)
        return y, h, c
    return step
