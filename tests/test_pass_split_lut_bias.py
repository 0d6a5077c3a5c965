"""split_lut_bias: a scaled table's bias (lut4:bB:offset) leaves quantized_matmul and quantized_gather
for a float matmul of x's block sums (a gather of its entries); tables without a bias are untouched,
and the numbers before and after agree (the NumPy references, passes.evaluate)."""
import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.fuse_dequant import fuse_dequantize
from ingot.passes.split_lut_bias import split_lut_bias


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
def test_only_biased_tables_change_and_the_numbers_stay(with_bias, transpose):
    rng = np.random.default_rng(5)
    k, n, block = 96, 9 if transpose else 8, 32
    codes = rng.integers(0, 16, (n, k) if transpose else (k, n)).astype(np.uint8)
    table = np.sort(rng.standard_normal(16)).astype(np.float32).reshape(1, 1, 16)
    pshape = (n, k // block) if transpose else (k // block, n)
    scale = rng.uniform(0.5, 2, pshape).astype(np.float16)
    bias = rng.standard_normal(pshape).astype(np.float16)
    g = ingot.Graph()
    x = g.placeholder((2, 3, k), name="x")
    idx = g.placeholder((2, 2), ingot.int32, name="idx")
    w = g.dequantize(g.constant(dt.pack_int4(codes), dtype=dt.uint4), lut=table, scale=scale,
                     bias=bias if with_bias else None, axis=1 if transpose else 0, block_size=block)
    y = g.matmul(x, g.transpose(w, (1, 0)) if transpose else w)
    rows = g.gather(w, idx, axis=0 if transpose else 1)
    fused, _ = fuse_dequantize(Program([y.node, rows.node], [], dict(g.constants)))
    after, changed = split_lut_bias(fused)
    assert changed is with_bias
    tables = [nd for nd in after.nodes() if nd.op in (Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER)]
    assert len(tables) == 2 and not any(nd.attrs.get("has_bias") for nd in tables)
    assert len([nd for nd in after.nodes() if nd.op == Op.MATMUL]) == (1 if with_bias else 0)
    assert split_lut_bias(after)[1] is False                    # nothing left to split
    feeds = {"x": rng.standard_normal((2, 3, k)).astype(np.float32), "idx": np.array([[7, 0], [3, 3]], np.int32)}
    for a, b in zip(evaluate(fused, feeds), evaluate(after, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_dynamic_input_is_one_sentence():
    g = ingot.Graph()
    x = g.placeholder((None, 64), name="x")
    w = g.dequantize(g.constant(np.zeros((64, 4), np.uint8), dtype=dt.uint4), lut=np.zeros((1, 1, 16), np.float32),
                     scale=np.ones((2, 8), np.float16), bias=np.ones((2, 8), np.float16), axis=0, block_size=32)
    fused, _ = fuse_dequantize(Program([g.matmul(x, w).node], [], dict(g.constants)))
    with pytest.raises(ingot.IngotError, match="needs static shapes"):
        split_lut_bias(fused)


def test_cuda_pipeline_splits_and_the_cpu_pipeline_keeps_the_bias():
    from ingot.compiler import run_pipeline

    rng = np.random.default_rng(6)
    codes = rng.integers(0, 16, (64, 8)).astype(np.uint8)
    g = ingot.Graph()
    x = g.placeholder((1, 64), name="x")
    idx = g.placeholder((2,), ingot.int32, name="idx")
    w = g.dequantize(g.constant(dt.pack_int4(codes), dtype=dt.uint4),
                     lut=np.sort(rng.standard_normal(16)).astype(np.float32).reshape(1, 1, 16),
                     scale=rng.uniform(0.5, 2, (2, 8)).astype(np.float16), bias=rng.standard_normal((2, 8)).astype(np.float16),
                     axis=0, block_size=32)
    program = Program([g.matmul(x, w).node, g.gather(w, idx, axis=1).node], [], dict(g.constants))
    types = {"x": ingot.TensorType((1, 64), ingot.float32), "idx": ingot.TensorType((2,), ingot.int32)}
    feeds = {"x": rng.standard_normal((1, 64)).astype(np.float32), "idx": np.array([1, 7], np.int32)}
    for device, split in (("cuda", True), ("cpu", False)):
        after, history = run_pipeline(program, device=device, feed_types=types)
        assert dict(history).get("split_lut_bias", False) is split
        tables = [nd for nd in after.nodes() if nd.op in (Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER)]
        assert len(tables) == 2 and all(bool(nd.attrs.get("has_bias")) is not split for nd in tables)
        for a, b in zip(evaluate(program, feeds), evaluate(after, feeds)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
