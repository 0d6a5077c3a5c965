"""GGUF's weight formats on the CUDA backend (marker `cuda`): dense quantized matmuls of every GGUF type
as Ingot imports it, one row (decode) and many (prefill), against the NumPy reference and the CPU
backend, with no host fallback. The scaled tables (IQ4_NL/XS, the IQ2/IQ3/IQ1 grids, MXFP4: mode
"scaled_lut") run gguf_kernels.py; the affine imports (Q2_K, Q3_K, the K-quants, TQ*) the int4/int8
kernels. The first tests build Ingot's scaled tables with NumPy (no gguf: they run on the device
machine too); the last converts real GGUF blocks of every type (skipped without gguf). Skips cleanly
without torch, triton or a GPU; `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it under Triton's
interpreter.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

require_cuda()

from ingot import dtypes as dt  # noqa: E402
from ingot.graph import Graph  # noqa: E402
from ingot.ir import Op  # noqa: E402
from ingot.ops import reference  # noqa: E402

ROWS = (1, 5, 33)      # decode (the GEMV), a few rows and a prefill tile and a bit (the GEMM)


def _scaled_table(rng, k: int, n: int, block: int, bits: int = 4, transpose: bool = False):
    """Ingot's scaled table as a GGUF import holds it: codes, one float32 table, a float32 scale per
    block of K. k-major q [K, N] (blocks along axis 0), or [N, K] (blocks along axis 1) with transpose."""
    entries = 2 ** bits
    values = rng.integers(0, entries, (n, k) if transpose else (k, n))
    q = dt.pack_int4(values) if bits == 4 else values.astype(np.uint8)
    lut = np.sort(rng.standard_normal(entries)).astype(np.float32).reshape(1, 1, entries)
    scale = (rng.random((n, k // block) if transpose else (k // block, n)) * 0.2 - 0.1).astype(np.float32)
    return q, dt.uint4 if bits == 4 else dt.uint8, lut, scale


def _matmul(q, qdtype, lut, scale, rows: int, k: int, transpose: bool):
    g = Graph()
    w = g.dequantize(g.constant(q, dtype=qdtype), lut=g.constant(lut), scale=g.constant(scale))
    if transpose:
        w = g.transpose(w, (1, 0))
    x = g.placeholder((rows, k), dt.float32, name="x")
    return g, g.matmul(x, w)


def _check(g, y, x, want=None):
    exe = g.compile(targets=[y], device="cuda")
    nodes = [n for n in exe.program.nodes() if n.op == Op.QUANTIZED_MATMUL]
    assert nodes, "the dequantize was fused into a quantized matmul"
    assert not exe.plan.host_syncs, exe.plan.host_syncs          # the kernels, not the host fallback
    got = exe.backend.to_host(exe.run({"x": x})[0])
    if want is None:
        node = nodes[0]
        want = reference(Op.QUANTIZED_MATMUL, [x] + [exe.program.constants[s.attrs["key"]] for s in node.src[1:]],
                         node.attrs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    cpu = g.compile(targets=[y], device="cpu").run({"x": x})[0]
    np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    return got


# K = 3 blocks of 32, 5 of 16 (not multiples of 256 or of the kernels' tiles); N = 2 * 37 and 2 * 99
# (odd multiples of the 4-bit packing), 37 with one code a byte (a 256-entry table)
@pytest.mark.parametrize("k, n, block, bits", [(96, 74, 32, 4), (80, 198, 16, 4), (48, 37, 16, 8)])
@pytest.mark.parametrize("rows", ROWS)
def test_scaled_table_matmul_matches_the_reference(k, n, block, bits, rows):
    rng = np.random.default_rng(k + n + rows)
    q, qdtype, lut, scale = _scaled_table(rng, k, n, block, bits)
    g, y = _matmul(q, qdtype, lut, scale, rows, k, transpose=False)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = lut.reshape(-1)[dt.unpack_int4(q, n, signed=False) if bits == 4 else q] * np.repeat(scale, block, axis=0)
    _check(g, y, x, x @ w)


@pytest.mark.parametrize("rows", [1, 7])
def test_scaled_table_matmul_transposed(rows):
    """matmul(x, transpose(dequantize(q))) over q [N, K] (a tied embedding as the LM head); N = 37 odd."""
    rng = np.random.default_rng(rows)
    k, n = 96, 37
    q, qdtype, lut, scale = _scaled_table(rng, k, n, 32, transpose=True)
    g, y = _matmul(q, qdtype, lut, scale, rows, k, transpose=True)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = lut.reshape(-1)[dt.unpack_int4(q, k, signed=False)] * np.repeat(scale, 32, axis=1)     # [N, K]
    _check(g, y, x, x @ w.T)


@pytest.mark.parametrize("axis", [0, 1])
def test_scaled_table_gather_and_dequantize(axis):
    """A scaled-table embedding (quantized_gather) and a dequantize that nothing fuses, on the device."""
    rng = np.random.default_rng(3)
    q, qdtype, lut, scale = _scaled_table(rng, 64, 38, 16)
    g = Graph()
    w = g.dequantize(g.constant(q, dtype=qdtype), lut=g.constant(lut), scale=g.constant(scale))
    idx = g.placeholder((5,), dt.int32, name="idx")
    rows = g.gather(w, idx, axis=axis)
    exe = g.compile(targets=[rows, w * 2.0], device="cuda")
    assert not exe.plan.host_syncs, exe.plan.host_syncs
    iv = np.array([0, 3, 63 if axis == 0 else 37, 1, 3], np.int32)
    got, dense = (exe.backend.to_host(v) for v in exe.run({"idx": iv}))
    want = lut.reshape(-1)[dt.unpack_int4(q, 38, signed=False)] * np.repeat(scale, 16, axis=0)
    np.testing.assert_array_equal(dense, want * np.float32(2.0))
    np.testing.assert_array_equal(got, np.take(want, iv, axis=axis))


# the K-quants' f16 fields (d, dmin) that test_gguf_quants.random_blocks leaves random: made finite here
K_QUANT_F16 = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(scope="module")
def gguf_types():
    gguf = pytest.importorskip("gguf")   # the device machine has no gguf: skipped there
    from ingot.importers.gguf_blocks import QUANT
    return gguf, sorted(QUANT, key=lambda t: t.name)


def test_every_gguf_type_multiplies_on_the_device(tmp_path, gguf_types):
    """Every type Ingot imports, converted from random GGUF blocks: 1 and 33 rows against
    gguf.quants.dequantize, both backends, no host fallback."""
    gguf, types = gguf_types
    from test_gguf_quants import random_blocks, write_gguf

    from ingot.importers import read_gguf
    for qtype in types:
        rng = np.random.default_rng(int(qtype))
        bs = gguf.GGML_QUANT_SIZES[qtype][0]
        k = bs * (3 if bs == 32 else 1)                              # 96 for the blocks of 32, else one block
        try:                                                         # N = 6 rows of GGUF
            raw = gguf.quants.quantize(rng.standard_normal((6, k)).astype(np.float32), qtype)
        except NotImplementedError:                                  # random blocks with finite f16 scales
            raw = random_blocks(rng, qtype, 6, k)
            blocks = raw.reshape(6, k // bs, -1)
            for off in K_QUANT_F16.get(qtype.name, ()):
                blocks[:, :, off:off + 2] = (rng.standard_normal((6, k // bs, 1)) * 0.02).astype(np.float16).view(np.uint8)
        t = read_gguf(write_gguf(tmp_path / f"{qtype.name}.gguf", [("w", raw, qtype)])).tensors["w"].to_k_major()
        g = Graph()
        qc = g.constant(t.q, dtype=t.qdtype)
        if t.lut is not None:
            w = g.dequantize(qc, lut=g.constant(t.lut), scale=g.constant(t.scale), axis=0, block_size=t.block_size)
        else:
            extra = {"bias": g.constant(t.bias)} if t.bias is not None else {}
            w = g.dequantize(qc, scale=g.constant(t.scale), axis=0, block_size=t.block_size, **extra)
        want_w = gguf.quants.dequantize(raw, qtype).T                # [K, N]
        for rows in (1, 33):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            xp = g.placeholder((rows, k), dt.float32, name=f"x{rows}")
            y = g.matmul(xp, w)
            exe = g.compile(targets=[y], device="cuda")
            assert not exe.plan.host_syncs, (qtype.name, exe.plan.host_syncs)
            got = exe.backend.to_host(exe.run({f"x{rows}": x})[0])
            want = x @ want_w
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()),
                                       err_msg=qtype.name)


def test_a_model_of_scaled_tables_decodes_on_the_device_as_on_the_cpu():
    """A tiny Llama whose every matrix (the tied embedding too) is a scaled table, as an IQ4_XS file's:
    the fused decode steps (sibling, norm and GLU GEMVs) leave these weights to gguf_kernels.py; prefill
    and 3 decode steps match the CPU backend with no host sync."""
    from ingot.models import llama
    from ingot.quant.formats import QuantizedTensor
    lut = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 1, 16) ** 3

    def matrix(rng, rows, cols):   # GGUF's row-major form [out, in], blocks of 32 along in
        q = dt.pack_int4(rng.integers(0, 16, (rows, cols)))
        scale = (rng.random((rows, cols // 32)) * 0.1 / np.sqrt(cols / 64) + 0.01).astype(np.float32)
        return QuantizedTensor(q, dt.uint4, (rows, cols), 32, scale, lut=lut)
    cfg = llama.LlamaConfig(2, 64, 4, 2, 96, 160, context_length=32, tied_embeddings=True)
    model = llama.build(cfg, llama.random_weights(cfg, matrix=matrix))
    runs = {}
    for device in ("cuda", "cpu"):
        pre, dec = model.compile(5, device), model.compile(1, device)
        if device == "cuda":
            assert not pre.plan.host_syncs and not dec.plan.host_syncs, (pre.plan.host_syncs, dec.plan.host_syncs)
        state, host = dec.new_state(), dec.backend.to_host
        logits = [host(pre.run({"tokens": np.arange(1, 6, dtype=np.int32), "pos": np.int32(0), "last": np.int32(4)},
                               state=state)[0])]
        for i in range(3):
            logits.append(host(dec.run({"tokens": np.array([7 * i + 2], np.int32), "pos": np.int32(5 + i),
                                        "last": np.int32(0)}, state=state)[0]))
        runs[device] = np.stack(logits)
    np.testing.assert_allclose(runs["cuda"], runs["cpu"], rtol=1e-4, atol=1e-4 * float(np.abs(runs["cpu"]).max()))
