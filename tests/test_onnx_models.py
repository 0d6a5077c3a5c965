"""Whole models through the ONNX importer, against onnxruntime: a BERT-like encoder (one SDPA per
layer after compile), a CNN classifier, an STFT front end (fixtures exported from PyTorch by
scripts/make_onnx_fixtures.py), quantized matmuls (DequantizeLinear -> MatMul, MatMulNBits), and
the encoder re-exported from PyTorch when torch is installed."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import ingot  # noqa: E402
from ingot.importers.onnx import NeedsConstant, SpecializingOnnxExecutable, from_onnx, import_onnx, op_counts  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "onnx"
ROOT = Path(__file__).resolve().parent.parent


def onnxruntime_outputs(model, feeds, optimize=True):
    data = model if isinstance(model, (str, Path)) else model.SerializeToString()
    options = ort.SessionOptions()
    if not optimize:  # onnxruntime's optimiser would quantize the activations of a DequantizeLinear -> MatMul
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(data) if isinstance(data, Path) else data, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def encoder_feeds(batch=1, length=16, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), np.int64)
    mask[:, length - 3:] = 0
    return {"input_ids": rng.integers(0, 512, (batch, length)).astype(np.int64), "attention_mask": mask}


def assert_matches(exe, model, feeds, atol=1e-4, optimize=True):
    ours = exe.run(feeds)
    theirs = onnxruntime_outputs(model, feeds, optimize)
    assert list(ours.keys()) == list(theirs)  # by ONNX output name, in the graph's order
    for name in theirs:
        assert ours[name].shape == theirs[name].shape and ours[name].dtype == theirs[name].dtype, name
        np.testing.assert_allclose(ours[name], theirs[name], atol=atol, rtol=0, err_msg=name)


def test_encoder_one_sdpa_per_layer_and_matches_onnxruntime():
    path = FIXTURES / "encoder.onnx"
    exe = from_onnx(path)
    counts = op_counts(exe)
    assert counts["sdpa"] == 2 and counts["softmax"] == 0  # two layers, attention fused by the compiler's pass
    assert counts["matmul"] == 13                          # q, k, v, out, up, down per layer + the pooler
    assert_matches(exe, path, encoder_feeds())
    assert_matches(exe, path, encoder_feeds(seed=1))


def test_cnn_matches_onnxruntime():
    path = FIXTURES / "cnn.onnx"
    exe = from_onnx(path)
    assert {"conv", "maxpool"}.isdisjoint(op_counts(exe))
    image = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    assert_matches(exe, path, {"image": image})


def test_stft_matches_onnxruntime():
    path = FIXTURES / "stft.onnx"
    exe = from_onnx(path)
    assert op_counts(exe)["rfft"] == 1 and op_counts(exe)["array_view"] == 1  # frames are a strided view
    audio = np.random.default_rng(0).standard_normal((1, 4000)).astype(np.float32)
    assert_matches(exe, path, {"audio": audio})


@pytest.mark.parametrize("batch", ["batch", -1])   # PaddlePaddle writes dim_value -1 for a symbolic dimension
def test_symbolic_dimensions_compile_per_shape(batch):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ingot.IngotError, match="symbolic dimension '(batch|\\?)'.*input_shapes"):
        import_onnx(model)                         # a static import (ingot convert) still needs the shape
    exe = from_onnx(model, input_shapes={"x": (3, 4)})
    assert exe.run({"x": -np.ones((3, 4), np.float32)})["y"].tolist() == [[0.0] * 4] * 3
    with pytest.raises(ingot.IngotError, match="shape"):
        exe.run({"x": np.ones((2, 4), np.float32)})
    exe = from_onnx(model)                         # compiled per shape, at run
    assert isinstance(exe, SpecializingOnnxExecutable)
    for rows in (3, 5, 3):
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) - 6
        np.testing.assert_array_equal(exe.run({"x": x})["y"], np.maximum(x, 0))
    assert len(exe.compiled) == 2


def _dynamic_int8_matmul_model():
    """x [rows, 64] @ DequantizeLinear(int8 W [64, 48], scale per column) + bias, rows symbolic."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.integers(-127, 128, (64, 48)).astype(np.int8), "w")
    scale = numpy_helper.from_array((rng.random(48) * 0.02 + 0.01).astype(np.float32), "scale")
    bias = numpy_helper.from_array(rng.standard_normal(48).astype(np.float32), "bias")
    nodes = [helper.make_node("DequantizeLinear", ["w", "scale"], ["wf"], axis=1),
             helper.make_node("MatMul", ["x", "wf"], ["xw"]), helper.make_node("Add", ["xw", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 48])], [w, scale, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_executables_of_each_shape_share_their_constants():
    """A model compiled per input shape holds its weights once: each shape's executable has the same
    arrays as the first (byte-equal constants found), and the CPU's packed int8 weight is made once
    (each executable keeps its own row buffers); the model's initializers are read out of the protobuf
    once, read-only."""
    from ingot.backends.cpu import int8_matmul
    model = _dynamic_int8_matmul_model()
    exe = from_onnx(model)
    rng = np.random.default_rng(6)
    for rows in (9, 17, 30):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        want = onnxruntime_outputs(model, {"x": x}, optimize=False)["y"]
        np.testing.assert_allclose(exe.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)
    first, *others = exe.compiled.values()
    big = {k: v for k, v in first.program.constants.items() if getattr(v, "nbytes", 0) >= 48 * 4}
    assert big and all(any(v is w for w in other.program.constants.values()) for other in others for v in big.values())
    kernels = [c.cell_contents["kernel"] for e in exe.compiled.values() for fn, _, _ in e.plan.steps
               for c in (getattr(fn, "__closure__", None) or ()) if isinstance(c.cell_contents, dict)
               and isinstance(c.cell_contents.get("kernel"), int8_matmul.FloatInt8Matmul)]
    assert len(kernels) == 3 and kernels[0].w is kernels[1].w is kernels[2].w
    assert kernels[0].buffers is not kernels[1].buffers
    assert all(isinstance(a, np.ndarray) and not a.flags.writeable for a in exe.import_cache.initializers.values())


def test_shared_constants_are_found_by_their_bytes_and_held_weakly():
    """compile_import's pool: a constant with the same dtype, shape and bytes becomes the pooled array
    (small ones found by their bytes, large ones compared); -0.0 is not 0.0 and a NaN matches only its own
    bits; the pool keeps no array alive."""
    import gc

    from ingot.importers.onnx import SMALL_CONSTANT, _share_constants
    big = np.arange(SMALL_CONSTANT, dtype=np.float32)
    small = np.array([1.0, np.nan, -0.0], np.float32)
    shared: dict = {}
    first = {"big": big, "small": small, "scalar": np.float32(2.0)}
    _share_constants(first, shared)
    second = {"big": big.copy(), "small": small.copy(), "zero": np.array([1.0, np.nan, 0.0], np.float32),
              "other": big[::-1].copy()}
    _share_constants(second, shared)
    assert second["big"] is big and second["small"] is small
    assert second["zero"] is not small and second["other"] is not big
    refs = [r for held in shared.values() for r in held]
    del first, second, big, small
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_options_reach_every_compiled_executable():
    """from_onnx(options=) compiles each executable with them: a static model, each specialisation."""
    from ingot.options import CompileOptions, CpuOptions
    options = CompileOptions(cpu=CpuOptions(threads=1))
    assert ingot.from_onnx(FIXTURES / "cnn.onnx", options=options).options is options
    exe = ingot.from_onnx(FIXTURES / "encoder_dynamic.onnx", options=options)
    assert isinstance(exe, SpecializingOnnxExecutable)
    exe.run({"input_ids": np.ones((2, 5), np.int64), "attention_mask": np.ones((2, 5), np.int64)})
    assert [e.options for e in exe.compiled.values()] == [options]
    assert from_onnx(FIXTURES / "cnn.onnx").options == CompileOptions()


def test_shape_giving_inputs_compile_per_value():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
                                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
                                           helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.arange(6, dtype=np.float32)
    exe = from_onnx(model)
    assert isinstance(exe, SpecializingOnnxExecutable)
    for shape, axis in [((2, 3), 0), ((2, 3), 1), ((3, 2), 1), ((2, 3), 0)]:
        out = exe.run({"x": x, "shape": np.array(shape), "axes": np.array([axis])})
        assert type(out) is ingot.Outputs and list(out.keys()) == ["y"]
        np.testing.assert_array_equal(out["y"], x.reshape(shape).sum(axis))
    assert len(exe.compiled) == 3 and exe.value_inputs == ["shape", "axes"]
    fixed = from_onnx(model, constant_inputs={"shape": np.array([3, 2]), "axes": np.array([0])})
    np.testing.assert_array_equal(fixed.run({"x": x, "shape": np.array([3, 2]), "axes": np.array([0])})["y"], [6, 9])
    with pytest.raises(ingot.IngotError, match="fixed to"):
        fixed.run({"x": x, "shape": np.array([2, 3]), "axes": np.array([0])})


def test_large_shape_giving_inputs_are_not_compiled_per_value():
    # a Reshape whose shape comes from a 100-element input's values: not something to compile per value
    nodes = [helper.make_node("Cast", ["big"], ["c"], to=TensorProto.INT64),
             helper.make_node("ReduceMax", ["c"], ["m"], keepdims=1), helper.make_node("Reshape", ["x", "m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
                                           helper.make_tensor_value_info("big", TensorProto.FLOAT, [100])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(NeedsConstant, match="constant_inputs"):
        from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_unsupported_ops_are_listed_in_one_error():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Foo", ["a"], ["b"], name="foo1"),
             helper.make_node("Foo", ["b"], ["c"], name="foo2"), helper.make_node("Bar", ["c"], ["y"], name="bar1")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]))
    with pytest.raises(ingot.IngotError) as e:
        from_onnx(model)
    message = str(e.value)
    assert "2 op types are not supported: Foo (2 nodes, e.g. 'foo1'), Bar (1 node, e.g. 'bar1')" in message
    assert "Relu" not in message and "\n" not in message


def test_dequantize_linear_matmul_becomes_quantized_matmul():
    rng = np.random.default_rng(0)
    k, n = 64, 32
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = (rng.random(n) * 0.01 + 0.001).astype(np.float32)
    inits = [numpy_helper.from_array(q, "w_q"), numpy_helper.from_array(scale, "w_scale"),
             numpy_helper.from_array(np.zeros(n, np.int8), "w_zero")]
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    exe = from_onnx(model)
    assert op_counts(exe)["quantized_matmul"] == 1 and op_counts(exe)["dequantize"] == 0
    x = rng.standard_normal((3, k)).astype(np.float32)
    assert_matches(exe, model, {"x": x}, optimize=False)
    np.testing.assert_allclose(exe.run({"x": x})["y"], x @ (q.astype(np.float32) * scale), atol=1e-5)


def test_matmul_nbits_becomes_quantized_matmul():
    rng = np.random.default_rng(0)
    k, n, block = 64, 48, 32
    values = rng.integers(0, 16, (n, k)).astype(np.uint8)              # W^T [N, K], 4-bit
    packed = (values[:, 0::2] | (values[:, 1::2] << 4)).reshape(n, k // block, block // 2)
    scales = (rng.random(n * k // block) * 0.1 + 0.01).astype(np.float32)
    zeros = rng.integers(0, 16, (n, k // block)).astype(np.uint8)
    zeros_packed = (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).reshape(-1)
    inits = [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "scales"),
             numpy_helper.from_array(zeros_packed, "zeros")]
    node = helper.make_node("MatMulNBits", ["x", "b", "scales", "zeros"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=block)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    exe = from_onnx(model)
    assert op_counts(exe)["quantized_matmul"] == 1
    x = rng.standard_normal((2, k)).astype(np.float32)
    assert_matches(exe, model, {"x": x}, atol=1e-4)


def test_quantize_option_stores_matmul_weights_quantized():
    path = FIXTURES / "encoder.onnx"
    exe = from_onnx(path, quantize="int8")
    counts = op_counts(exe)
    assert counts["quantized_matmul"] == 13 and counts["matmul"] == 0 and counts["sdpa"] == 2
    feeds = encoder_feeds()
    ours, theirs = exe.run(feeds), onnxruntime_outputs(path, feeds)
    np.testing.assert_allclose(ours["last_hidden_state"], theirs["last_hidden_state"], atol=0.05)


@pytest.mark.slow
def test_encoder_exported_from_pytorch(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    spec = importlib.util.spec_from_file_location("make_onnx_fixtures", ROOT / "scripts" / "make_onnx_fixtures.py")
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    path = fixtures.export_encoder(tmp_path / "bert.onnx", batch=2, length=24, hidden=96, heads=4, ffn=192, layers=3)
    exe = from_onnx(path)
    assert op_counts(exe)["sdpa"] == 3 and op_counts(exe)["softmax"] == 0
    assert_matches(exe, path, encoder_feeds(batch=2, length=24))


@pytest.mark.parametrize("mask_kind", ["float", "float_dead_rows", "bool", "bool_dead_rows"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_masked_sdpa_cpu_lowering_matches_reference(mask_kind, heads, causal):
    """The CPU lowering of masked attention (imported encoders' padding masks) against the NumPy reference
    (a float mask through nn_kernels.masked_softmax, rows of -inf only included)."""
    from ingot.ir import Program
    from ingot.passes import evaluate

    rng = np.random.default_rng(0)
    hq, hk = heads
    g = ingot.Graph()
    q = g.placeholder((2, hq, 5, 8), name="q")
    k = g.placeholder((2, hk, 7, 8), name="k")
    v = g.placeholder((2, hk, 7, 6), name="v")
    if mask_kind == "float":
        mask_value = np.where(rng.random((2, 1, 1, 7)) < 0.3, -10000.0, 0.0).astype(np.float32)
    elif mask_kind == "float_dead_rows":
        mask_value = np.where(rng.random((2, 1, 5, 7)) < 0.3, -np.inf, 0.0).astype(np.float32)
        mask_value[1, 0, 2] = -np.inf
    else:
        mask_value = rng.random((2, 1, 5, 7)) < 0.7
        if mask_kind == "bool_dead_rows":
            mask_value[0, 0, 1] = False
    mask = g.placeholder(mask_value.shape, ingot.float32 if mask_value.dtype == np.float32 else ingot.bool_, name="mask")
    y = g.scaled_dot_product_attention(q, k, v, mask=mask, scale=0.3, causal=causal)
    feeds = {"q": rng.standard_normal((2, hq, 5, 8)).astype(np.float32), "k": rng.standard_normal((2, hk, 7, 8)).astype(np.float32),
             "v": rng.standard_normal((2, hk, 7, 6)).astype(np.float32), "mask": mask_value}
    (expected,) = evaluate(Program([y.node], [], dict(g.constants)), feeds)
    (out,) = g.compile(targets=[y]).run(feeds)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", ["raw", "lengths", "none"])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_microsoft_attention_matches_onnxruntime(mask, unidirectional):
    rng = np.random.default_rng(0)
    b, s, hidden, heads = 2, 6, 32, 4
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, 3 * hidden)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal(3 * hidden) * 0.1).astype(np.float32), "bias")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, hidden])]
    feeds = {"x": rng.standard_normal((b, s, hidden)).astype(np.float32)}
    names = ["x", "w", "bias"]
    if mask == "raw":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, [b, s]))
        feeds["mask"] = np.array([[1] * s, [1] * (s - 2) + [0] * 2], np.int32)
        names.append("mask")
    elif mask == "lengths":
        inits.append(numpy_helper.from_array(np.array([s, s - 3], np.int32), "mask"))
        names.append("mask")
    node = helper.make_node("Attention", names, ["y"], domain="com.microsoft", num_heads=heads, unidirectional=unidirectional)
    graph = helper.make_graph([node], "attn", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    exe = from_onnx(model)
    assert op_counts(exe)["sdpa"] == 1
    assert_matches(exe, model, feeds, atol=1e-5)


@pytest.mark.parametrize("attrs", [dict(strides=[2, 2], output_padding=[1, 0], group=2),
                                   dict(strides=[3, 1], pads=[1, 0, 2, 1], dilations=[2, 1]),
                                   dict(strides=[2, 2], auto_pad="SAME_UPPER")])
def test_conv_transpose_with_constant_weights_matches_onnxruntime(attrs):
    """The importer flips constant kernels in NumPy (node tests feed weights as inputs: the graph path)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)   # [C, M/G, kh, kw]
    b = rng.standard_normal(3 * attrs.get("group", 1)).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    graph = helper.make_graph([node], "ct", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    exe = from_onnx(model)
    x = rng.standard_normal((1, 4, 5, 6)).astype(np.float32)
    assert_matches(exe, model, {"x": x}, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 5), (3, 24)])
def test_dynamic_encoder_shape_arithmetic_folds_at_import(shape):
    """An encoder exported with symbolic batch and length computes its shapes (Shape, Range, Expand,
    Concat): with input_shapes given, all of that is constant at import and only the model's math is left."""
    path = FIXTURES / "encoder_dynamic.onnx"
    model = onnx.load(path)
    assert {"Shape", "Range", "Expand"} <= {n.op_type for n in model.graph.node}
    exe = from_onnx(path, input_shapes={"input_ids": shape, "attention_mask": shape})
    counts = op_counts(exe)
    assert counts["sdpa"] == 1 and set(counts) <= {"placeholder", "constant", "gather", "add", "layer_norm", "matmul", "reshape",
                                                   "transpose", "cast", "sub", "mul", "sdpa", "gelu", "tanh"}, counts
    rng = np.random.default_rng(0)
    mask = np.ones(shape, np.int64)
    mask[0, -2:] = 0
    assert_matches(exe, path, {"input_ids": rng.integers(0, 64, shape).astype(np.int64), "attention_mask": mask})


@pytest.mark.parametrize("equation, shapes", [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("ij,jk,kl->il", [(3, 4), (4, 5), (5, 2)]),
    ("...ij,...jk", [(2, 1, 3, 4), (5, 4, 6)]),
    ("bii->bi", [(2, 4, 4)]),
    ("ijk->kj", [(2, 3, 4)]),
    ("i,j->ij", [(3,), (4,)]),
])
def test_einsum_matches_numpy(equation, shapes):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    names = [f"x{i}" for i in range(len(shapes))]
    expected = np.einsum(equation, *arrays)
    node = helper.make_node("Einsum", names, ["y"], equation=equation)
    graph = helper.make_graph([node], "e", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, expected.shape)])
    exe = from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    out = exe.run(dict(zip(names, arrays)))["y"]
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("past", [0, 3])
@pytest.mark.parametrize("rotary", [False, True])
def test_group_query_attention_matches_onnxruntime(past, rotary):
    """com.microsoft GroupQueryAttention: a prompt (no past) and a step after a dense past, with and without rotary."""
    rng = np.random.default_rng(0)
    b, s, hq, hk, d = 2, 4 if past == 0 else 1, 4, 2, 16  # onnxruntime rotates heads of 16k only
    total = past + s
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, [b, s, hq * d]), helper.make_tensor_value_info("k", f, [b, s, hk * d]),
              helper.make_tensor_value_info("v", f, [b, s, hk * d])]
    feeds = {"q": rng.standard_normal((b, s, hq * d)).astype(np.float32), "k": rng.standard_normal((b, s, hk * d)).astype(np.float32),
             "v": rng.standard_normal((b, s, hk * d)).astype(np.float32)}
    names = ["q", "k", "v", "", ""]
    if past:
        inputs += [helper.make_tensor_value_info(n, f, [b, hk, past, d]) for n in ("past_k", "past_v")]
        feeds.update(past_k=rng.standard_normal((b, hk, past, d)).astype(np.float32),
                     past_v=rng.standard_normal((b, hk, past, d)).astype(np.float32))
        names[3:5] = ["past_k", "past_v"]
    inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]), helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    feeds.update(seqlens_k=np.full(b, total - 1, np.int32), total=np.array(total, np.int32))
    names += ["seqlens_k", "total"]
    inits, attrs = [], {}
    if rotary:
        angles = np.arange(16)[:, None] / (10000 ** (np.arange(0, d, 2) / d))[None, :]
        inits = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"), numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
        names += ["cos", "sin"]
        attrs = {"do_rotary": 1}
    node = helper.make_node("GroupQueryAttention", names, ["y", "present_k", "present_v"], domain="com.microsoft",
                            num_heads=hq, kv_num_heads=hk, **attrs)
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "present_k", "present_v")]
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    exe = from_onnx(model)
    assert op_counts(exe)["sdpa"] == 1
    assert_matches(exe, model, feeds, atol=1e-5)


def test_import_computes_what_fold_would_and_shares_small_constants():
    """The import graph makes a constant of a known op result that the fold pass would fold, and one node
    of each small unnamed constant; a shared constant declared as another ONNX type gets its own node,
    and the others keep theirs undeclared. Fold and CSE then find nothing on a CNN's import."""
    from ingot.importers.onnx_ops import Context, ImportGraph
    from ingot.ir import Op, Program
    from ingot.passes.cse import eliminate_common_subexpressions
    from ingot.passes.fold import fold_constants
    g = ImportGraph()
    a, b = g.constant(np.array([3, 4], np.int32)), g.constant(np.array([3, 4], np.int32))
    assert a.node is b.node and g.constant(np.array([3, 4], np.int32), name="named").node is not a.node
    total = a + g.constant(np.array([1, 1], np.int32))
    assert total.node.op == Op.CONSTANT and g.value(total).tolist() == [4, 5]
    ctx = Context(g, "test")
    own = ctx.declare(b, np.uint16)
    assert own.node is not a.node and ctx.onnx_dtype(own) == np.uint16 and ctx.onnx_dtype(a) == np.int32
    imported = import_onnx(str(FIXTURES / "cnn.onnx"))
    program = Program([t.node for t in imported.outputs.values()], [], dict(imported.graph.constants), {})
    assert not fold_constants(program)[1] and not eliminate_common_subexpressions(program)[1]
