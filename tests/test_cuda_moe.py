"""Mixture-of-experts routing on the CUDA backend (marker `cuda`): `_expert_gemv_kernel`
(quantized_gather_matmul) against the NumPy reference on awkward shapes, for GGUF's Q8_0/Q4_0/Q4_1
expert stacks and its scaled tables (IQ4_XS, MXFP4), Ingot's int4 with zero points and a 4-bit lookup table; top_k, take_along_axis and
gather_matmul as device ops, with no host sync (the whole Qwen3-MoE model: test_cuda_families.py). Skips cleanly without
torch, triton or a GPU; `INGOT_CUDA_DEVICE=cpu TRITON_INTERPRET=1` runs it under Triton's interpreter.
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

import ingot  # noqa: E402
from ingot import dtypes as dt  # noqa: E402
from ingot.ir import Op  # noqa: E402
from ingot.models.blocks import Weights  # noqa: E402
from ingot.models.moe import expert_matrices  # noqa: E402
from ingot.ops import reference  # noqa: E402
from ingot.quant.formats import QuantizedTensor  # noqa: E402


def _gguf_stack(tmp_path, qtype_name: str, e: int, rows: int, cols: int):
    gguf = pytest.importorskip("gguf")
    from ingot.importers.gguf import read_gguf
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype == gguf.GGMLQuantizationType.IQ4_XS:   # gguf cannot quantize it: valid random blocks
        from test_gguf_quants import random_blocks
        data = random_blocks(np.random.default_rng(0), qtype, e * rows, cols).reshape(e, rows, -1)
    else:
        w = (np.random.default_rng(0).standard_normal((e, rows, cols)) / np.sqrt(cols)).astype(np.float32)
        data = gguf.quants.quantize(w, qtype)
    writer = gguf.GGUFWriter(str(tmp_path / "experts.gguf"), "qwen3moe")
    writer.add_tensor("w", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_gguf(tmp_path / "experts.gguf").tensors["w"]


def _ingot_stack(kind: str, e: int, rows: int, cols: int) -> QuantizedTensor:
    """Ingot's own 4-bit forms as GGUF-row stacks [E * rows, cols]: int4 with zero points, a 16-entry table,
    or a scaled one."""
    rng = np.random.default_rng(1)
    q = dt.pack_int4(rng.integers(0, 16, (e * rows, cols)))
    if kind == "lut4":
        lut = np.sort(rng.standard_normal(16)).astype(np.float32).reshape(1, 1, 16) * 0.1
        return QuantizedTensor(q, dt.uint4, (e * rows, cols), cols, None, lut=lut)
    if kind == "scaled4":   # a scaled table as GGUF's IQ4_NL/MXFP4 imports hold it, without gguf
        lut = np.sort(rng.standard_normal(16)).astype(np.float32).reshape(1, 1, 16)
        scale = (rng.random((e * rows, cols // 32)) * 0.1 - 0.05).astype(np.float32)
        return QuantizedTensor(q, dt.uint4, (e * rows, cols), 32, scale, lut=lut)
    scale = (rng.random((e * rows, cols // 16)) * 0.05 + 0.01).astype(np.float32)
    zero = rng.integers(0, 16, (e * rows, cols // 16)).astype(np.float32)
    return QuantizedTensor(q, dt.uint4, (e * rows, cols), 16, scale, zero_point=zero)


def _routed_graph(stack, e, rows, cols, tokens, chosen, per_choice):
    g = ingot.Graph()
    x = g.placeholder((tokens, chosen if per_choice else 1, cols), name="x")
    idx = g.placeholder((tokens, chosen), ingot.int32, name="idx")
    return g, g.gather_matmul(x, expert_matrices(Weights(g, {"w": stack}), "w", (e, rows, cols)), idx)


# rows = N of each expert: 34 and 70 (not multiples of the 64-column block), cols = K: 96 and 160
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "int4_zero", "lut4", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("tokens, per_choice", [(1, False), (5, False), (3, True)])
def test_expert_kernel_matches_the_reference(tmp_path, kind, tokens, per_choice):
    e, rows, chosen = 5, 34 if kind not in ("Q4_1", "MXFP4") else 70, 3
    cols = {"Q4_0": 160, "IQ4_XS": 256}.get(kind, 96)
    stack = _ingot_stack(kind, e, rows, cols) if kind in ("int4_zero", "lut4") else _gguf_stack(tmp_path, kind, e, rows, cols)
    g, y = _routed_graph(stack, e, rows, cols, tokens, chosen, per_choice)
    exe = g.compile(targets=[y], device="cuda")
    node = next(n for n in exe.program.nodes() if n.op == Op.QUANTIZED_GATHER_MATMUL)
    assert not exe.plan.host_syncs, exe.plan.host_syncs          # the kernel, not the host fallback
    rng = np.random.default_rng(2)
    xv = rng.standard_normal((tokens, chosen if per_choice else 1, cols)).astype(np.float32)
    iv = np.stack([rng.choice([0, 1, 3, 4], chosen, replace=False) for _ in range(tokens)]).astype(np.int32)  # 2 idle
    got = exe.backend.to_host(exe.run({"x": xv, "idx": iv})[0])
    consts = [exe.program.constants[s.attrs["key"]] for s in node.src[2:]]
    want = reference(Op.QUANTIZED_GATHER_MATMUL, [xv, iv, *consts], node.attrs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


# a prompt: 37 tokens x 3 choices = 111 rows (from GROUPED_MIN_ROWS on: the grouped GEMM), about 28 for each
# of 4 experts (several BLOCK_M tiles each, padded), expert 2 idle
@pytest.mark.parametrize("kind", ["int4_zero", "lut4", "scaled4", "Q8_0", "Q4_1", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("per_choice", [False, True])
def test_grouped_expert_gemm_matches_the_reference(tmp_path, kind, per_choice):
    from ingot.backends.cuda.quantized_matmul.experts import GROUPED_MIN_ROWS
    e, rows, chosen, tokens = 5, 70 if kind != "Q8_0" else 34, 3, 37
    assert tokens * chosen >= GROUPED_MIN_ROWS
    cols = {"IQ4_XS": 256}.get(kind, 96)
    stack = _ingot_stack(kind, e, rows, cols) if kind in ("int4_zero", "lut4", "scaled4") else \
        _gguf_stack(tmp_path, kind, e, rows, cols)
    g, y = _routed_graph(stack, e, rows, cols, tokens, chosen, per_choice)
    exe = g.compile(targets=[y], device="cuda")
    node = next(n for n in exe.program.nodes() if n.op == Op.QUANTIZED_GATHER_MATMUL)
    assert not exe.plan.host_syncs, exe.plan.host_syncs
    rng = np.random.default_rng(4)
    xv = rng.standard_normal((tokens, chosen if per_choice else 1, cols)).astype(np.float32)
    iv = np.stack([rng.choice([0, 1, 3, 4], chosen, replace=False) for _ in range(tokens)]).astype(np.int32)
    got = exe.backend.to_host(exe.run({"x": xv, "idx": iv})[0])
    consts = [exe.program.constants[s.attrs["key"]] for s in node.src[2:]]
    want = reference(Op.QUANTIZED_GATHER_MATMUL, [xv, iv, *consts], node.attrs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    cpu = g.compile(targets=[y], device="cpu").run({"x": xv, "idx": iv})[0]
    np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_group_rows_sorts_every_row_into_its_experts_tiles():
    """group_rows: each (token, choice) row once, in a tile of its own expert; padding R; tiles past the
    last expert's marked E."""
    import torch

    from ingot.backends.cuda.quantized_matmul.experts import group_rows
    rng = np.random.default_rng(6)
    idx = rng.choice([0, 2, 3, 6], (29, 2)).astype(np.int32)      # experts 1, 4, 5 idle; one with > 16 rows
    idx[:20, 0] = 3
    e, bm, r = 7, 16, idx.size
    ids, tile_e = (t.cpu().numpy() for t in group_rows(torch.as_tensor(idx), e, bm))
    assert len(tile_e) == -(-r // bm) + min(e, r) and len(ids) == len(tile_e) * bm
    real = ids[ids < r]
    assert sorted(real.tolist()) == list(range(r))
    tiles = np.repeat(tile_e, bm)
    assert np.array_equal(tiles[ids < r], idx.reshape(-1)[real])    # each row in a tile of its expert
    assert np.all(ids[tiles == e] == r)                             # unused tiles hold padding only
    assert np.all(np.diff(tile_e) >= 0)


def test_routing_ops_run_on_the_device_as_the_reference():
    """top_k (ties to the lower index), take_along_axis and gather_matmul over float experts, no host sync."""
    rng = np.random.default_rng(5)
    g = ingot.Graph()
    p = g.placeholder((6, 8), name="p")
    x = g.placeholder((6, 1, 16), name="x")
    w = rng.standard_normal((8, 16, 12)).astype(np.float32)
    chosen = g.top_k(p, 3)
    weight = g.take_along_axis(p, chosen, axis=-1)
    y = g.gather_matmul(x, g.constant(w), chosen) * g.reshape(weight, (6, 3, 1))
    exe = g.compile(targets=[chosen, y], device="cuda")
    assert not exe.plan.host_syncs, exe.plan.host_syncs
    pv = rng.standard_normal((6, 8)).astype(np.float32)
    pv[0, 5] = pv[0, 2] = pv[0].max() + 1                               # a tie: index 2 first
    xv = rng.standard_normal((6, 1, 16)).astype(np.float32)
    got_idx, got_y = (exe.backend.to_host(v) for v in exe.run({"p": pv, "x": xv}))
    want_idx = reference(Op.TOP_K, [pv], {"k": 3})
    np.testing.assert_array_equal(got_idx, want_idx)
    assert got_idx[0, :2].tolist() == [2, 5]
    want = np.einsum("tk,tjkn->tjn", xv[:, 0], w[want_idx]) * np.take_along_axis(pv, want_idx, -1)[..., None]
    np.testing.assert_allclose(got_y, want, rtol=1e-4, atol=1e-4)
