"""The CPU's integer matmul (backends/cpu/int8_matmul.py: VPDPBUSD, or exact float32 chunks without VNNI)
against the int64 NumPy reference, on awkward shapes and the extremes of each 8-bit type; and the
FUSED integer_matmul op the pass makes of ONNX's DynamicQuantizeLinear -> MatMulInteger chain."""
import numpy as np
import pytest

from ingot.backends.cpu import int8_amx, int8_matmul
from ingot.backends.cpu.int8_matmul import IntegerMatmul, reference

# (VNNI, AMX tiles): exact float32 chunks, VPDPBUSD, and where the host has them AMX-INT8's tiles
KERNELS = [(False, False)] + ([(True, False)] if int8_matmul.AVAILABLE else []) + \
    ([(True, True)] if int8_matmul.AVAILABLE and int8_amx.available() else [])
RANGE = {np.int8: (-128, 128), np.uint8: (0, 256)}


def ints(rng, shape, dtype):
    return rng.integers(*RANGE[dtype], shape).astype(dtype)


@pytest.mark.parametrize("vnni", KERNELS)
@pytest.mark.parametrize("x_type,w_type", [(np.uint8, np.int8), (np.int8, np.uint8), (np.int8, np.int8),
                                           (np.uint8, np.uint8)])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (5, 37, 19), (3, 2, 3, ), (16, 512, 48), (7, 1100, 33), (10, 64, 35),
                                   (21, 96, 16), (16, 70, 100), (17, 129, 33)])   # (2 m rows: the tiles from m = 16)
def test_integer_matmul_matches_reference(vnni, x_type, w_type, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = ints(rng, (2, m, k), x_type), ints(rng, (k, n), w_type)
    x_zero, w_zero = ints(rng, (), x_type), ints(rng, (n,), w_type)
    kernel = IntegerMatmul(w, w_zero.astype(np.int64), vnni_kernel=vnni[0], tiles=vnni[1])
    got = kernel(x, x_zero)
    assert got.dtype == np.int32 and got.shape == (2, m, n)
    want = reference(x, x_zero, w, w_zero)
    np.testing.assert_array_equal(got, want)
    scaled = kernel(x, x_zero, scale=np.float32(0.37))   # the epilogue cast(sum, float32) * scale, bit for bit
    assert scaled.dtype == np.float32 and scaled.shape == (2, m, n)
    np.testing.assert_array_equal(scaled, want.astype(np.float32) * np.float32(0.37))
    s0, s1 = np.array(0.37, np.float32), np.array([1.9e-3], np.float32)   # the fused op's two scales, one call
    fused = kernel.scaled(x, np.asarray(x_zero), s0, s1)
    np.testing.assert_array_equal(fused, want.astype(np.float32) * (s0 * s1[0]))


@pytest.mark.parametrize("vnni", KERNELS)
def test_integer_matmul_extremes(vnni):
    """x all 255 against w all -128 (the largest products VPDPBUSD sums), K = 4099: sums of -1.3e8."""
    for rows in (3, 40):   # (40: the tiles' rows, where the host has them)
        x = np.full((rows, 4099), 255, np.uint8)
        w = np.full((4099, 17), -128, np.int8)
        kernel = IntegerMatmul(w, np.zeros(1, np.int64), vnni_kernel=vnni[0], tiles=vnni[1])
        np.testing.assert_array_equal(kernel(x, np.uint8(0)), reference(x, 0, w, 0))
        out = np.empty((rows, 17), np.int32)
        assert kernel(x, np.uint8(0), out) is out and out[rows - 1, 0] == 255 * -128 * 4099


def test_dynamic_quantize_matmul_integer_is_fused():
    """A quantize_dynamic layer: the sum runs as one integer_matmul step, bit-equal to onnxruntime."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from ingot.importers.onnx import from_onnx
    from ingot.ir import Op
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 13, 70)).astype(np.float32)
    w, wz = ints(rng, (70, 45), np.int8), ints(rng, (45,), np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(wz, "wz")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (theirs,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    exe = from_onnx(model)
    kinds = [n.attrs["kind"] for n in exe.program.nodes() if n.op == Op.FUSED]
    assert sorted(kinds) == ["dynamic_quantize", "integer_matmul"]
    np.testing.assert_array_equal(exe.run({"x": x})[0], theirs)
    del onnx


@pytest.mark.parametrize("w_type", [np.int8, np.uint8])
@pytest.mark.parametrize("rows,k,n,per_column,bias", [(8, 16, 16, False, False), (9, 37, 19, True, True),
                                                       (22, 384, 50, True, False), (3, 2, 2, False, True)])
def test_float_x_by_8_bit_weight(w_type, rows, k, n, per_column, bias):
    """The quantized_matmul lowering for float x and an 8-bit weight with a zero point and scale per column
    (or one), bias too, against the reference; below FLOAT_MIN_ROWS the lowering declines."""
    from ingot import dtypes as dt
    from ingot.backends.cpu.int8_matmul import FLOAT_MIN_ROWS, float_weight_step
    from ingot.ir import Node, Op, TensorType
    from ingot.ops.quant import quantized_matmul_reference
    rng = np.random.default_rng(rows + k + n)
    width = n if per_column else 1
    x = rng.standard_normal((1, rows, k)).astype(np.float32)
    q = ints(rng, (k, n), w_type)
    params = [(rng.random((1, width)) * 0.02 + 0.001).astype(np.float32),
              ints(rng, (1, width), w_type).astype(np.float32)]
    if bias:
        params.append(rng.standard_normal((1, n)).astype(np.float32))
    attrs = {"qdtype": dt.int8 if w_type == np.int8 else dt.uint8, "dtype": dt.float32, "mode": "affine",
             "has_zero_point": True, "has_bias": bias, "transpose": False}
    src = [Node(Op.PLACEHOLDER, TensorType(x.shape, dt.float32), name="x")] + \
        [Node(Op.CONSTANT, TensorType(a.shape, dt.from_numpy(a.dtype)), attrs={"key": str(i)})
         for i, a in enumerate([q] + params)]
    node = Node(Op.QUANTIZED_MATMUL, TensorType((1, rows, n), dt.float32), tuple(src), attrs)
    step = float_weight_step(node, None)
    if rows < FLOAT_MIN_ROWS:
        assert step is None
        return
    want = quantized_matmul_reference([x, q] + params, attrs)
    got = step(x, q, *params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert float_weight_step(node, None, activations="int8") is None


@pytest.mark.parametrize("case", ["normal", "zeros", "positive", "negative", "tiny", "one_value"])
def test_dynamic_quantize_linear_fused(case):
    """DynamicQuantizeLinear as one fused step: y, scale and zero point bit-equal to onnxruntime on
    ranges that hold 0 or not, all zeros (scale 1) and a constant tensor."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    from ingot.importers.onnx import from_onnx
    from ingot.ir import Op
    rng = np.random.default_rng(11)
    x = {"normal": rng.standard_normal((2, 7, 33)) * 3, "zeros": np.zeros((2, 7, 33)),
         "positive": rng.random((2, 7, 33)) + 0.5, "negative": -rng.random((2, 7, 33)) - 2,
         "tiny": rng.standard_normal((2, 7, 33)) * 1e-30, "one_value": np.full((2, 7, 33), 0.37)}[case].astype(np.float32)
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info(n, t, None) for n, t in
                               (("y", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("z", TensorProto.UINT8))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    exe = from_onnx(model)
    assert [n.attrs["kind"] for n in exe.program.nodes() if n.op == Op.FUSED] == ["dynamic_quantize"]
    for ours, want in zip(exe.run({"x": x}), theirs):
        np.testing.assert_array_equal(np.asarray(ours), want)
        assert np.asarray(ours).dtype == want.dtype


def test_float_x_by_8_bit_weight_on_two_threads():
    """Past PARALLEL_MIN multiply-adds the column groups split over the pool: the same result."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 520)).astype(np.float32)
    q, scale = ints(rng, (520, 300), np.int8), (rng.random(300) * 0.01).astype(np.float32)
    one = int8_matmul.FloatInt8Matmul(q, scale, None, None, threads=1)(x)
    two = int8_matmul.FloatInt8Matmul(q, scale, None, None, threads=2)(x)
    assert 40 * 520 * 300 >= int8_matmul.PARALLEL_MIN
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("w_scale_shape", [(), (1,)])
def test_scaled_matmul_integer_epilogue_is_fused(w_scale_shape):
    """quantize_dynamic's layer, DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(x_scale * w_scale):
    the cast and both products run inside the integer_matmul step (float32 out), bit-equal to
    onnxruntime's plain graph; a second reader of the cast keeps the epilogue out."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from ingot.importers.onnx import from_onnx
    from ingot.ir import Op
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 11, 70)).astype(np.float32)
    w, wz = ints(rng, (70, 45), np.int8), ints(rng, (45,), np.int8)
    ws = np.full(w_scale_shape, 0.0123, np.float32)

    def model(second_reader: bool):
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
                 helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
                 helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["xs", "ws"], ["s"]),
                 helper.make_node("Mul", ["accf", "s"], ["y"])]
        outs = ["y"] + (["accf"] if second_reader else [])
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                                  [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
                                  [numpy_helper.from_array(a, k) for k, a in (("w", w), ("wz", wz), ("ws", ws))])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for second_reader in (False, True):
        m = model(second_reader)
        theirs = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
        exe = from_onnx(m)
        fused = [n for n in exe.program.nodes() if n.op == Op.FUSED and n.attrs["kind"] == "integer_matmul"]
        assert len(fused) == 1 and fused[0].dtype.name == ("int32" if second_reader else "float32")
        if not second_reader:
            assert not [n for n in exe.program.nodes() if n.op in (Op.CAST, Op.MUL)]
        for got, want in zip(exe.run({"x": x}), theirs):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [1, 15, 16, 17, 1000])
def test_dynamic_quantize_kernel(size):
    """The kernel's range (16 lanes, then the tail) and rounding against NumPy's, on sizes around the
    lanes; NaN or an infinity anywhere gives NaN (the caller then runs the body)."""
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * 3 + 1).astype(np.float32)
    x[-1] = -7.5   # the minimum in the tail where there is one
    y = np.empty(size, np.uint8)
    scale, zero = int8_matmul.dynamic_quantize(x, y)
    lo, hi = min(np.float32(x.min()), np.float32(0)), max(np.float32(x.max()), np.float32(0))
    want_scale = np.float32((hi - lo) / np.float32(255))
    want_zero = np.float32(np.clip(np.rint(-lo / want_scale), 0, 255))
    assert scale == want_scale and zero == want_zero
    np.testing.assert_array_equal(y, np.clip(np.rint(x / want_scale) + want_zero, 0, 255).astype(np.uint8))
    for bad in (np.nan, np.inf, -np.inf):
        z = x.copy()
        z[size // 2] = bad
        assert np.isnan(int8_matmul.dynamic_quantize(z, y)[0])
