"""The CPU plan's generated runner (backends/cpu CpuPlan._runner): the same outputs and variable updates
as the steps called one by one, get_item steps as subscripts, and a plan whose steps are replaced
(ingot view --profile wraps them) runs the replacements."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op


def test_runner_updates_variables_and_is_remade_when_steps_change():
    g = ingot.Graph()
    x = g.placeholder((3, 5), name="x")
    total = g.variable(np.zeros((3, 5), np.float32), name="total")
    g.assign(total, total + x)
    exe = g.compile(targets={"y": g.exp(x) * 2.0, "x_again": x})
    xv = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    first = exe.run({"x": xv})
    np.testing.assert_allclose(first["y"], np.exp(xv) * 2, rtol=1e-6)
    np.testing.assert_array_equal(first["x_again"], xv)
    np.testing.assert_array_equal(exe.state["total"], xv)
    calls = []
    exe.plan.steps = [((lambda fn: lambda *a: (calls.append(1), fn(*a))[1])(fn), *rest) for fn, *rest in exe.plan.steps]
    second = exe.run({"x": xv})
    assert len(calls) == len(exe.plan.steps) > 0
    np.testing.assert_array_equal(second["y"], first["y"])
    np.testing.assert_array_equal(exe.state["total"], 2 * xv)


def test_get_item_steps_are_subscripts_of_a_tuple_valued_step():
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 9])],
                              [helper.make_tensor_value_info(n, t, None) for n, t in
                               (("z", TensorProto.UINT8), ("y", TensorProto.UINT8), ("s", TensorProto.FLOAT))])
    exe = ingot.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert sum(n.op == Op.GET_ITEM for n in exe.program.nodes()) == 3
    x = np.linspace(-1, 3, 36, dtype=np.float32).reshape(4, 9)
    out = exe.run({"x": x})
    scale = np.float32(4 / 255)
    zero = np.uint8(np.rint(1 / scale))
    assert out["s"] == scale and out["z"] == zero
    np.testing.assert_array_equal(out["y"], np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.uint8))
