"""Mixture-of-experts routing: the ops of ingot/ops/moe.py against NumPy, the fusion of dequantized
experts into quantized_gather_matmul, and the CPU kernels over 3-D GGUF expert tensors of several
types against gguf.quants.dequantize. (The Qwen3-MoE model against transformers: test_families.py.)"""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import ingot
from ingot.errors import IngotError
from ingot.importers.gguf import read_gguf
from ingot.ir import Op
from ingot.models.blocks import Weights
from ingot.models.moe import expert_matrices
from ingot.ops import reference


def test_top_k_is_largest_first_with_ties_to_the_lower_index():
    x = np.array([[0.1, 0.5, 0.2, 0.5, 0.0], [3, 2, 1, 0, -1]], np.float32)
    got = reference(Op.TOP_K, [x], {"k": 3})
    assert got.dtype == np.int32 and got.tolist() == [[1, 3, 2], [0, 1, 2]]
    rng = np.random.default_rng(0)
    y = rng.standard_normal((7, 2, 11)).astype(np.float32)
    idx = reference(Op.TOP_K, [y], {"k": 4})
    np.testing.assert_array_equal(np.take_along_axis(y, idx, -1), -np.sort(-y, axis=-1)[..., :4])


@pytest.mark.parametrize("k", [0, 6])
def test_top_k_refuses_a_k_the_axis_cannot_give(k):
    g = ingot.Graph()
    with pytest.raises(IngotError, match="top_k"):
        g.top_k(g.placeholder((3, 5), name="x"), k)


def test_take_along_axis_matches_numpy_and_checks_indices():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 9)).astype(np.float32)
    idx = rng.integers(0, 9, (5, 3)).astype(np.int32)
    np.testing.assert_array_equal(reference(Op.TAKE_ALONG_AXIS, [x, idx], {"axis": 1}), np.take_along_axis(x, idx, 1))
    with pytest.raises(IngotError, match="take_along_axis: indices span"):
        reference(Op.TAKE_ALONG_AXIS, [x, idx + 9], {"axis": 1})


@pytest.mark.parametrize("rows_per_token", [1, 3])
def test_gather_matmul_reference_is_each_tokens_chosen_experts(rows_per_token):
    rng = np.random.default_rng(2)
    t, j, e, k, n = 7, 3, 5, 13, 6
    x = rng.standard_normal((t, rows_per_token, k)).astype(np.float32)
    w = rng.standard_normal((e, k, n)).astype(np.float32)
    idx = rng.integers(0, e, (t, j)).astype(np.int32)
    got = reference(Op.GATHER_MATMUL, [x, w, idx], {})
    want = np.stack([np.stack([x[a, b if rows_per_token > 1 else 0].astype(np.float64) @ w[idx[a, b]] for b in range(j)])
                     for a in range(t)])
    assert got.shape == (t, j, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(IngotError, match="expert choices span 0..5 but there are 5 experts"):
        reference(Op.GATHER_MATMUL, [x, w, np.where(idx == idx.max(), 5, idx).astype(np.int32)], {})


def _expert_gguf(path, qtype: T, e: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A GGUF holding one expert stack [e, rows, cols] of `qtype`; returns what it dequantizes to."""
    w = (np.random.default_rng(seed).standard_normal((e, rows, cols)) / np.sqrt(cols)).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_tensor("blk.0.ffn_up_exps.weight", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.quants.dequantize(data, qtype).reshape(e, rows, cols)


# Q8_0: int8 GEMV/GEMM kernels; Q4_0: signed 4-bit; Q4_1: 4-bit with bias; MXFP4: a scaled lookup table
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.MXFP4])
@pytest.mark.parametrize("tokens", [1, 5, 23])   # a decode step, a short and a long prompt (GEMM rows)
def test_quantized_experts_run_fused_and_match_the_dequantized_stack(tmp_path, qtype, tokens):
    e, rows, cols, chosen = 5, 34, 96, 3
    dense = _expert_gguf(tmp_path / "experts.gguf", qtype, e, rows, cols)          # [E, out, in]
    model = read_gguf(tmp_path / "experts.gguf")
    g = ingot.Graph()
    x = g.placeholder((tokens, 1, cols), name="x")
    idx = g.placeholder((tokens, chosen), ingot.int32, name="idx")
    y = g.gather_matmul(x, expert_matrices(Weights(g, model.tensors), "blk.0.ffn_up_exps.weight", (e, rows, cols)), idx)
    exe = g.compile(targets=[y], device="cpu")
    ops = [n.op for n in exe.program.nodes()]
    assert Op.QUANTIZED_GATHER_MATMUL in ops and Op.DEQUANTIZE not in ops and Op.GATHER_MATMUL not in ops
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((tokens, 1, cols)).astype(np.float32)
    iv = np.stack([rng.choice(e - 1, chosen, replace=False) for _ in range(tokens)]).astype(np.int32)  # expert 4 idle
    (got,) = exe.run({"x": xv, "idx": iv})
    want = np.einsum("tk,tjnk->tjn", xv[:, 0].astype(np.float64), dense[iv].astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_float_experts_run_as_a_plain_gather_matmul():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3 * 8, 16)).astype(np.float32)        # [E * out, in], as a float GGUF stack reads
    g = ingot.Graph()
    x = g.placeholder((4, 2, 16), name="x")
    idx = g.placeholder((4, 2), ingot.int32, name="idx")
    y = g.gather_matmul(x, expert_matrices(Weights(g, {"w": w}), "w", (3, 8, 16)), idx)
    exe = g.compile(targets=[y], device="cpu")
    assert Op.GATHER_MATMUL in [n.op for n in exe.program.nodes()]
    xv, iv = rng.standard_normal((4, 2, 16)).astype(np.float32), np.array([[0, 2], [1, 0], [2, 2], [1, 1]], np.int32)
    (got,) = exe.run({"x": xv, "idx": iv})
    np.testing.assert_allclose(got, np.einsum("tjk,tjnk->tjn", xv, w.reshape(3, 8, 16)[iv]), rtol=1e-5, atol=1e-5)


def test_expert_stack_of_the_wrong_shape_is_refused(tmp_path):
    _expert_gguf(tmp_path / "experts.gguf", T.Q8_0, 4, 8, 32)
    model = read_gguf(tmp_path / "experts.gguf")
    with pytest.raises(IngotError, match=r"ffn_up_exps.weight has shape \(32, 32\), expected the rows of \[5, 8, 32\]"):
        expert_matrices(Weights(ingot.Graph(), model.tensors, "m.gguf"), "blk.0.ffn_up_exps.weight", (5, 8, 32))


@pytest.mark.parametrize("up_type", [T.Q8_0, T.Q4_0])
def test_gate_and_up_experts_side_by_side_when_their_formats_allow(tmp_path, up_type):
    """Same format: one [E, in, 2 out] stack (one routed matmul for gate and up); else one each.
    Either way the routed products are those of the dequantized stacks."""
    e, rows, cols = 4, 6, 64
    rng = np.random.default_rng(5)
    dense = {}
    writer = gguf.GGUFWriter(str(tmp_path / "two.gguf"), "qwen3moe")
    for name, qtype in (("gate", T.Q8_0), ("up", up_type)):
        data = gguf.quants.quantize(rng.standard_normal((e, rows, cols)).astype(np.float32), qtype)
        writer.add_tensor(f"{name}.weight", data, raw_shape=data.shape, raw_dtype=qtype)
        dense[name] = gguf.quants.dequantize(data, qtype).reshape(e, rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    g = ingot.Graph()
    stacks = expert_matrices(Weights(g, read_gguf(tmp_path / "two.gguf").tensors), ["gate.weight", "up.weight"],
                             [(e, rows, cols)] * 2)
    if up_type == T.Q8_0:
        assert not isinstance(stacks, list) and stacks.shape == (e, cols, 2 * rows)
        stacks = [stacks]
    else:
        assert [s.shape for s in stacks] == [(e, cols, rows)] * 2
    x, idx = g.placeholder((3, 1, cols), name="x"), g.placeholder((3, 2), ingot.int32, name="idx")
    exe = g.compile(targets=[g.gather_matmul(x, s, idx) for s in stacks], device="cpu")
    xv, iv = rng.standard_normal((3, 1, cols)).astype(np.float32), np.array([[0, 3], [2, 1], [3, 0]], np.int32)
    got = np.concatenate(exe.run({"x": xv, "idx": iv}), axis=-1)
    want = np.concatenate([np.einsum("tk,tjnk->tjn", xv[:, 0], dense[n][iv]) for n in ("gate", "up")], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
