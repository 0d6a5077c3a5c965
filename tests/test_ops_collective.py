"""all_reduce and all_gather (ops/collective.py): type rules, the one-rank reference, and the
reference over every rank's input, on awkward shapes. (Over real ranks: test_tensor_parallel.py.)"""
import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.errors import IngotError
from ingot.ir import Op, TensorType
from ingot.ops import infer_type, reference
from ingot.ops.collective import reference_ranks


@pytest.mark.parametrize("shape, axis, world, out", [((7, 13), 1, 3, (7, 39)), ((7, 13), 0, 2, (14, 13)),
                                                     ((None, 5), -1, 4, (None, 20)), ((None, 5), 0, 4, (None, 5))])
def test_all_gather_type(shape, axis, world, out):
    t = infer_type(Op.ALL_GATHER, [TensorType(shape, dt.float32)], {"world": world, "axis": axis})
    assert t == TensorType(out, dt.float32)


@pytest.mark.parametrize("dtype", [dt.float32, dt.bfloat16, dt.int32])
def test_all_reduce_keeps_the_type(dtype):
    t = TensorType((3, None, 5), dtype)
    assert infer_type(Op.ALL_REDUCE, [t], {"world": 2, "reduce": "sum"}) == t


@pytest.mark.parametrize("op, attrs, words", [
    (Op.ALL_REDUCE, {"world": 0}, "world"), (Op.ALL_REDUCE, {"world": 2, "reduce": "max"}, "reduce"),
    (Op.ALL_GATHER, {"world": 2, "axis": 2}, "axis 2 is out of range"), (Op.ALL_REDUCE, {"world": True}, "world")])
def test_bad_attributes_are_refused(op, attrs, words):
    with pytest.raises(IngotError, match=words):
        infer_type(op, [TensorType((3, 4))], attrs)


def test_bool_and_scalars_are_refused():
    with pytest.raises(IngotError, match="one tensor of"):
        infer_type(Op.ALL_REDUCE, [TensorType((3,), dt.bool_)], {"world": 2})
    with pytest.raises(IngotError, match="rank >= 1"):
        infer_type(Op.ALL_GATHER, [TensorType(())], {"world": 2, "axis": 0})


def test_one_rank_is_a_copy_and_more_need_the_others():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = reference(Op.ALL_REDUCE, [x], {"world": 1, "reduce": "sum"})
    assert np.array_equal(y, x) and y is not x
    with pytest.raises(IngotError, match="needs the other ranks' inputs"):
        reference(Op.ALL_GATHER, [x], {"world": 2, "axis": 0})


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_reference_over_ranks(world, dtype):
    rng = np.random.default_rng(world)
    xs = [(rng.standard_normal((7, 13)) * 50).astype(dtype) for _ in range(world)]
    summed = reference_ranks(Op.ALL_REDUCE, xs, {"world": world, "reduce": "sum"})
    gathered = reference_ranks(Op.ALL_GATHER, xs, {"world": world, "axis": 1})
    for r in range(world):
        assert summed[r].dtype == dtype and gathered[r].shape == (7, 13 * world)
        np.testing.assert_allclose(summed[r], np.sum(np.stack(xs).astype(np.float64), axis=0), rtol=1e-5)
        np.testing.assert_array_equal(gathered[r][:, 13 * r:13 * (r + 1)], xs[r])
    with pytest.raises(IngotError, match="inputs for a world"):
        reference_ranks(Op.ALL_REDUCE, xs[:-1] if world > 1 else xs * 2, {"world": world})


def test_collectives_are_neither_folded_nor_merged():
    g = ingot.Graph()
    c = g.constant(np.ones((2, 3), np.float32))
    a = g.op(Op.ALL_REDUCE, [c], {"world": 1, "reduce": "sum"})
    b = g.op(Op.ALL_REDUCE, [c], {"world": 1, "reduce": "sum"})
    exe = g.compile(targets=[a + b])
    assert sum(n.op == Op.ALL_REDUCE for n in exe.program.nodes()) == 2
    np.testing.assert_array_equal(exe.run({})[0], np.full((2, 3), 2, np.float32))
