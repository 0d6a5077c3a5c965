"""Shape rules, by hypothesis (derandomised): the TensorType the builder infers equals what NumPy
produces on real arrays (and what the CPU executable returns); bad inputs raise ingot.IngotError
whose message names the op and the shapes of its inputs.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ingot
from ingot import IngotError, TensorType

F32, I8, I32, BOOL = ingot.float32, ingot.int8, ingot.int32, ingot.bool_
RULES = settings(derandomize=True, max_examples=50, deadline=None)
DTYPE_OF = {np.dtype(np.float32): F32, np.dtype(np.bool_): BOOL, np.dtype(np.int32): I32}

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=5)


def real(shape, dtype=np.float32) -> np.ndarray:
    """An array of the shape with distinct values, so a wrong element shows up too."""
    return np.arange(math.prod(shape), dtype=dtype).reshape(shape)


def numpy_type(array) -> TensorType:
    array = np.asarray(array)
    return TensorType(array.shape, DTYPE_OF[array.dtype])


def run_on_cpu(g: ingot.Graph, out: ingot.Tensor, feeds: dict) -> np.ndarray:
    (result,) = g.compile(targets=[out], device="cpu").run(feeds)
    return result


def shape_text(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def assert_names(error: pytest.ExceptionInfo, op: str, *input_shapes) -> None:
    message = str(error.value)
    assert message.startswith(op), f"message does not start with the op {op!r}: {message}"
    for shape in input_shapes:
        assert shape_text(shape) in message, f"message does not name the input shape {shape_text(shape)}: {message}"


# -- broadcasting ---------------------------------------------------------------------------------
BROADCASTING = {
    "add": (lambda g, a, b: g.add(a, b), np.add),
    "mul": (lambda g, a, b: a * b, np.multiply),
    "maximum": (lambda g, a, b: g.maximum(a, b), np.maximum),
    "less": (lambda g, a, b: a < b, np.less),
    "where": (lambda g, a, b: g.where(a > 2.0, a, b), lambda a, b: np.where(a > 2.0, a, b)),
}


@RULES
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, max_side=5),
       op=st.sampled_from(sorted(BROADCASTING)))
def test_broadcasting_matches_numpy(shapes, op):
    build, reference = BROADCASTING[op]
    (sa, sb), a, b = shapes.input_shapes, real(shapes.input_shapes[0]), real(shapes.input_shapes[1]) * 0.5
    g = ingot.Graph()
    out = build(g, g.placeholder(sa, name="a"), g.placeholder(sb, name="b"))
    want = reference(a, b)
    assert out.type == numpy_type(want)
    got = run_on_cpu(g, out, {"a": a, "b": b})
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@st.composite
def clashing_shapes(draw):
    """Two shapes that do not broadcast: one axis (counted from the right) of sizes > 1 that differ."""
    a = list(draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5)))
    b = list(a[len(a) - draw(st.integers(1, len(a))):])  # a suffix of a, so only the clash matters
    axis = draw(st.integers(1, len(b)))
    a[-axis] = draw(st.integers(2, 6))
    b[-axis] = draw(st.integers(2, 6).filter(lambda n: n != a[-axis]))
    return (tuple(a), tuple(b)) if draw(st.booleans()) else (tuple(b), tuple(a))


@RULES
@given(pair=clashing_shapes(), op=st.sampled_from(["add", "sub", "mul", "maximum", "less", "equal", "broadcast_to"]))
def test_shapes_that_do_not_broadcast_raise_naming_op_and_shapes(pair, op):
    with pytest.raises(ValueError):
        np.broadcast_shapes(*pair)  # the strategy is right: NumPy refuses them too
    g = ingot.Graph()
    a = g.placeholder(pair[0], name="a")
    with pytest.raises(IngotError) as error:
        if op == "broadcast_to":
            g.broadcast_to(a, pair[1])
        else:
            getattr(g, op)(a, g.placeholder(pair[1], name="b"))
    if op == "broadcast_to":  # one input; the target shape is an attribute
        assert_names(error, op, pair[0])
        assert str(pair[1]) in str(error.value)
    else:
        assert_names(error, op, *pair)


@RULES
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6), data=st.data())
def test_an_integer_index_out_of_range_raises_naming_the_shape(shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    index = data.draw(st.sampled_from([shape[axis], shape[axis] + 3, -shape[axis] - 1]))
    with pytest.raises(IndexError):
        np.zeros(shape)[(slice(None),) * axis + (index,)]
    g = ingot.Graph()
    x = g.placeholder(shape, name="x")
    with pytest.raises(IngotError) as error:
        x[(slice(None),) * axis + (index,)]
    assert_names(error, "indexing", shape)


# -- reshape --------------------------------------------------------------------------------------
@st.composite
def grouped(draw, factors):
    """The factors in a random order, multiplied together in random consecutive groups: a shape of their product."""
    order = draw(st.permutations(factors))
    if not order:
        return ()
    cuts = sorted(draw(st.sets(st.integers(1, len(order) - 1), max_size=len(order) - 1))) if len(order) > 1 else []
    bounds = [0] + cuts + [len(order)]
    return tuple(math.prod(order[i:j]) for i, j in zip(bounds, bounds[1:]))


@st.composite
def reshapes(draw):
    factors = draw(st.lists(st.integers(1, 5), max_size=6))
    source, target = draw(grouped(factors)), list(draw(grouped(factors)))
    if target and draw(st.booleans()):
        target[draw(st.integers(0, len(target) - 1))] = -1
    return source, tuple(target)


@RULES
@given(case=reshapes())
def test_reshape_matches_numpy(case):
    source, target = case
    x = real(source)
    g = ingot.Graph()
    out = g.reshape(g.placeholder(source, name="x"), target)
    want = x.reshape(target)
    assert out.type == numpy_type(want)
    np.testing.assert_array_equal(run_on_cpu(g, out, {"x": x}), want)


@RULES
@given(case=reshapes(), extra=st.integers(2, 5), minus_one=st.booleans())
def test_reshape_to_a_wrong_size_raises_naming_op_and_shape(case, extra, minus_one):
    source, _ = case
    size = math.prod(source)
    # a -1 beside a known part that does not divide the size, or a known total that differs
    bad = (size + 1, -1) if minus_one else source + (extra,)
    with pytest.raises(ValueError):
        np.zeros(source).reshape(bad)
    g = ingot.Graph()
    with pytest.raises(IngotError) as error:
        g.reshape(g.placeholder(source, name="x"), bad)
    assert_names(error, "reshape", source)


# -- transpose ------------------------------------------------------------------------------------
@st.composite
def permuted(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=5, min_side=1, max_side=4))
    perm = draw(st.permutations(range(len(shape))))
    negative = draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    return shape, tuple(p - len(shape) if neg else p for p, neg in zip(perm, negative))


@RULES
@given(case=permuted())
def test_transpose_matches_numpy(case):
    shape, perm = case
    x = real(shape)
    g = ingot.Graph()
    out = g.transpose(g.placeholder(shape, name="x"), perm)
    want = np.transpose(x, perm)
    assert out.type == numpy_type(want)
    np.testing.assert_array_equal(run_on_cpu(g, out, {"x": x}), want)


@RULES
@given(shape=hnp.array_shapes(min_dims=2, max_dims=5, min_side=1, max_side=4), repeat=st.booleans(), data=st.data())
def test_transpose_with_a_repeated_or_missing_axis_raises_naming_op_and_shape(shape, repeat, data):
    perm = list(data.draw(st.permutations(range(len(shape)))))
    if repeat:
        i = data.draw(st.integers(0, len(perm) - 1))
        perm[i] = perm[data.draw(st.integers(0, len(perm) - 1).filter(lambda j: j != i))]
    else:
        perm = perm[:-1]
    with pytest.raises(ValueError):
        np.transpose(np.zeros(shape), perm)
    g = ingot.Graph()
    with pytest.raises(IngotError) as error:
        g.transpose(g.placeholder(shape, name="x"), perm)
    assert_names(error, "transpose", shape)


# -- concat ---------------------------------------------------------------------------------------
@st.composite
def concats(draw):
    base = list(draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4)))
    axis = draw(st.integers(-len(base), len(base) - 1))
    lengths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    return [tuple(n if i == axis % len(base) else d for i, d in enumerate(base)) for n in lengths], axis


@RULES
@given(case=concats())
def test_concat_matches_numpy(case):
    parts, axis = case
    arrays = [real(s) + 100 * k for k, s in enumerate(parts)]
    g = ingot.Graph()
    out = g.concat([g.placeholder(s, name=f"x{k}") for k, s in enumerate(parts)], axis=axis)
    want = np.concatenate(arrays, axis=axis)
    assert out.type == numpy_type(want)
    np.testing.assert_array_equal(run_on_cpu(g, out, {f"x{k}": a for k, a in enumerate(arrays)}), want)


@RULES
@given(case=concats(), data=st.data())
def test_concat_of_mismatched_shapes_raises_naming_op_and_shapes(case, data):
    parts, axis = case
    rank = len(parts[0])
    other = data.draw(st.integers(0, rank - 1))
    if other == axis % rank or data.draw(st.booleans()):
        bad = parts[0] + (2,)  # another rank
    else:
        bad = tuple(d + 1 if i == other else d for i, d in enumerate(parts[0]))  # another size off the axis
    shapes = parts + [bad]
    with pytest.raises(ValueError):
        np.concatenate([np.zeros(s) for s in shapes], axis=axis)
    g = ingot.Graph()
    with pytest.raises(IngotError) as error:
        g.concat([g.placeholder(s, name=f"x{k}") for k, s in enumerate(shapes)], axis=axis)
    assert_names(error, "concat", *shapes)


# -- slice ----------------------------------------------------------------------------------------
bound = st.one_of(st.none(), st.integers(-9, 9))


@st.composite
def slices(draw):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=7))
    index = tuple(slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2, 3, -1, -2, -3]))) for _ in shape)
    return shape, index


@RULES
@given(case=slices(), indexing=st.booleans())
def test_slice_matches_numpy(case, indexing):
    shape, index = case
    x = real(shape)
    g = ingot.Graph()
    t = g.placeholder(shape, name="x")
    out = t[index] if indexing else g.slice(t, [s.start for s in index], [s.stop for s in index],
                                             [1 if s.step is None else s.step for s in index])
    want = x[index]
    assert out.type == numpy_type(want)
    np.testing.assert_array_equal(run_on_cpu(g, out, {"x": x}), want)


@RULES
@given(shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6), data=st.data())
def test_indexing_dynamic_axes_matches_numpy_once_compiled(shape, data):
    index = tuple(data.draw(st.one_of(st.integers(-d, d - 1), st.sampled_from([slice(None), slice(None, None, -2)])))
                  for d in shape)
    # indexed axes dynamic, and one kept axis (dropping axes is a reshape, which allows one dynamic dim)
    kept = [i for i, item in enumerate(index) if isinstance(item, slice)]
    declared = tuple(None if isinstance(item, int) or kept[:1] == [i] else d for i, (d, item) in enumerate(zip(shape, index)))
    x = real(shape)
    g = ingot.Graph()
    out = g.placeholder(declared, name="x")[index]
    want = x[index]
    assert out.ndim == want.ndim
    exe = g.compile(feeds={"x": TensorType(shape, F32)}, targets=[out], device="cpu")
    assert exe.output_types == [numpy_type(want)]
    np.testing.assert_array_equal(exe.run({"x": x})[0], want)


@RULES
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=7), data=st.data())
def test_slice_with_runtime_starts_and_sizes_matches_numpy(shape, data):
    sizes = [data.draw(st.integers(0, d)) for d in shape]
    starts = [data.draw(st.integers(0, d - n)) for d, n in zip(shape, sizes)]
    fed = [s - d if data.draw(st.booleans()) and s > 0 else s for s, d in zip(starts, shape)]  # negative: from the end
    x = real(shape)
    g = ingot.Graph()
    positions = [g.placeholder((), I32, name=f"s{i}") for i in range(len(shape))]
    out = g.slice(g.placeholder(shape, name="x"), positions, size=sizes)
    want = x[tuple(slice(s, s + n) for s, n in zip(starts, sizes))]
    assert out.type == numpy_type(want)
    feeds = {"x": x, **{f"s{i}": np.int32(s) for i, s in enumerate(fed)}}
    np.testing.assert_array_equal(run_on_cpu(g, out, feeds), want)


@RULES
@given(shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6), data=st.data())
def test_slice_update_that_does_not_fit_raises_naming_op_and_shapes(shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    update = list(data.draw(st.tuples(*[st.integers(1, d) for d in shape])))
    start = [data.draw(st.integers(0, d - n)) for d, n in zip(shape, update)]
    runtime = data.draw(st.booleans())
    if runtime:  # too long for the axis at any start
        update[axis] = shape[axis] + data.draw(st.integers(1, 3))
    else:  # too long for its start, or a negative start
        start[axis] = data.draw(st.sampled_from([shape[axis] - update[axis] + 1, -1]))
    g = ingot.Graph()
    x, u = g.placeholder(shape, name="x"), g.placeholder(tuple(update), name="u")
    if runtime:
        start[axis] = g.placeholder((), I32, name="p")
    with pytest.raises(IngotError) as error:
        g.slice_update(x, u, start)
    assert_names(error, "slice_update", shape, tuple(update))


# -- matmul ---------------------------------------------------------------------------------------
@st.composite
def matmuls(draw):
    batch = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4)).input_shapes
    m, k, n = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    a = (k,) if draw(st.booleans()) else batch[0] + (m, k)
    b = (k,) if draw(st.booleans()) else batch[1] + (k, n)
    return a, b


@RULES
@given(case=matmuls())
def test_matmul_matches_numpy(case):
    sa, sb = case
    a, b = real(sa) * 0.25, real(sb) * 0.5  # small integers times powers of two: exact in float32
    g = ingot.Graph()
    out = g.placeholder(sa, name="a") @ g.placeholder(sb, name="b")
    want = np.matmul(a, b)
    assert out.type == numpy_type(want)
    got = run_on_cpu(g, out, {"a": a, "b": b})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


@st.composite
def clashing_matmuls(draw):
    m, k, n = draw(st.integers(1, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    if draw(st.booleans()):  # batch dimensions that do not broadcast
        batch_a, batch_b = draw(clashing_shapes())
        return batch_a + (m, k), batch_b + (k, n)
    other = k + draw(st.integers(1, 3))  # inner dimensions that differ
    batch = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=2, max_side=4)).input_shapes
    a = (k,) if draw(st.booleans()) else batch[0] + (m, k)
    b = (other,) if draw(st.booleans()) else batch[1] + (other, n)
    return a, b


@RULES
@given(case=clashing_matmuls())
def test_matmul_of_shapes_that_do_not_fit_raises_naming_op_and_shapes(case):
    sa, sb = case
    with pytest.raises(ValueError):
        np.matmul(np.zeros(sa), np.zeros(sb))
    g = ingot.Graph()
    a, b = g.placeholder(sa, name="a"), g.placeholder(sb, name="b")
    with pytest.raises(IngotError) as error:
        a @ b
    assert_names(error, "matmul", sa, sb)


def test_matmul_error_names_both_shapes_for_the_briefs_example():
    g = ingot.Graph()
    with pytest.raises(IngotError) as error:
        g.matmul(g.placeholder((2, 3), name="a"), g.placeholder((4, 5), name="b"))
    assert_names(error, "matmul", (2, 3), (4, 5))


# -- dequantize -----------------------------------------------------------------------------------
@RULES
@given(length=st.integers(2, 40), other=st.integers(1, 6), axis=st.integers(0, 1), data=st.data())
def test_dequantize_with_a_block_size_that_does_not_divide_raises(length, other, axis, data):
    block = data.draw(st.integers(1, length + 3).filter(lambda b: length % b != 0) | st.integers(-2, 0))
    shape = (length, other) if axis == 0 else (other, length)
    g = ingot.Graph()
    q = g.placeholder(shape, I8, name="q")
    with pytest.raises(IngotError) as error:
        g.dequantize(q, scale=np.ones(max(1, length // max(block, 1)), np.float32), axis=axis, block_size=block)
    assert_names(error, "dequantize", shape)


@RULES
@given(length=st.integers(1, 40), other=st.integers(1, 6), dynamic=st.booleans(), data=st.data())
def test_dequantize_per_block_shape_matches_numpy(length, other, dynamic, data):
    divisors = [b for b in range(1, length + 1) if length % b == 0]
    block = data.draw(st.sampled_from(divisors))
    q = (real((length, other), np.int32) % 256 - 128).astype(np.int8)
    scale = np.linspace(0.5, 2.0, length // block).astype(np.float32)
    g = ingot.Graph()
    declared = (None, None) if dynamic else (length, other)  # dynamic: the fit is checked when compiled
    out = g.dequantize(g.placeholder(declared, I8, name="q"), scale=scale, axis=0, block_size=block)
    want = q.astype(np.float32) * np.repeat(scale, block)[:, None]
    exe = g.compile(feeds={"q": TensorType((length, other), I8)}, targets=[out], device="cpu")
    assert exe.output_types == [numpy_type(want)]
    if not dynamic:
        assert out.type == numpy_type(want)
    np.testing.assert_array_equal(exe.run({"q": q})[0], want)
