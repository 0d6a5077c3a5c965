"""The compile pipeline: pass order, verification after each pass, debug dumps, caching, errors."""
import numpy as np
import pytest

import ingot
from ingot import compiler
from ingot.ir import Op, Program


def attention_and_quantized_graph():
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder((1, None, 16), name="x")
    w = g.dequantize(g.constant(rng.integers(-8, 8, (16, 16)).astype(np.int8)), scale=0.05)
    h = g.matmul(x, w)
    q = k = v = g.transpose(g.reshape(h, (1, -1, 2, 8)), (0, 2, 1, 3))  # [1, 2 heads, T, 8]
    probs = g.softmax(g.matmul(q, g.swapaxes(k, -1, -2)) * (1 / np.sqrt(8)), axis=-1)
    y = g.matmul(probs, v) * 2.0 + 1.0
    return g, x, y


def test_pipeline_runs_every_pass_in_order():
    g, x, y = attention_and_quantized_graph()
    exe = g.compile(feeds={x: ingot.TensorType((1, 4, 16))}, targets=[y])
    names = [name for name, _ in exe.history]
    assert names == ["specialize", "fold", "dce", "cse", "fold_conv_affine", "fuse_attention", "fuse_norms", "fuse_one_hot", "fuse_dequantize",
                     "simplify_views", "inplace", "attention_length", "fuse_two_level", "fuse_spatial", "fuse_conv_epilogue",
                     "fuse_squeeze_excite", "fuse_expand_depthwise", "block_channels", "fuse_rope_cache", "fuse_integer_matmul", "fuse_dynamic_quantize", "fuse_rows_attention", "regions", "memory_plan"]
    changed = dict(exe.history)
    assert changed["specialize"] and changed["fuse_attention"] and changed["fuse_dequantize"]
    assert not changed["inplace"] and not changed["attention_length"]
    ops = [n.op for n in exe.program.nodes()]
    assert ops.count(Op.SDPA) == 1 and ops.count(Op.QUANTIZED_MATMUL) == 1
    assert Op.SOFTMAX not in ops and Op.DEQUANTIZE not in ops and Op.MATMUL not in ops


def test_numbers_match_numpy():
    g, x, y = attention_and_quantized_graph()
    exe = g.compile(feeds={x: ingot.TensorType((1, 3, 16))}, targets=[y])
    (wq,) = [v for v in exe.program.constants.values() if v.dtype == np.int8]
    xv = np.random.default_rng(1).standard_normal((1, 3, 16)).astype(np.float32)
    h = (xv @ (wq.astype(np.float32) * 0.05)).reshape(1, 3, 2, 8).transpose(0, 2, 1, 3)
    s = h @ h.swapaxes(-1, -2) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    expected = (p / p.sum(-1, keepdims=True)) @ h * 2 + 1
    np.testing.assert_allclose(exe.run({"x": xv})[0], expected, rtol=1e-4, atol=1e-5)


def test_debug_dumps_the_graph_after_each_pass(capfd):
    g, x, y = attention_and_quantized_graph()
    g.compile(feeds={x: ingot.TensorType((1, 2, 16))}, targets=[y], debug=True)
    err = capfd.readouterr().err
    for name in compiler.pass_names("cpu"):
        assert f"--- after {name} (changed=" in err
    assert "sdpa(" in err and "softmax(" in err  # before and after the fusion
    assert err.index("--- after fuse_attention") < err.rindex("sdpa(")


def test_debug_can_name_passes(capfd):
    g, x, y = attention_and_quantized_graph()
    g.compile(feeds={x: ingot.TensorType((1, 5, 16))}, targets=[y], debug="fuse_attention,memory_plan")
    err = capfd.readouterr().err
    assert "--- after fuse_attention" in err and "--- after memory_plan" in err
    assert "--- after fold" not in err and "buffer 0" in err
    with pytest.raises(ingot.IngotError, match="unknown passes \\['fusion'\\]"):
        g.compile(feeds={x: ingot.TensorType((1, 6, 16))}, targets=[y], debug="fusion")


def test_compile_is_silent_without_debug(capfd):
    g, x, y = attention_and_quantized_graph()
    g.compile(feeds={x: ingot.TensorType((1, 7, 16))}, targets=[y])
    assert capfd.readouterr().err == ""


def test_a_pass_that_breaks_the_graph_is_caught(monkeypatch):
    def broken(program: Program):
        out = program.outputs[0]
        bad = out.replace(type=ingot.TensorType((99,), out.dtype))
        return program.with_roots([bad], program.assigns), True

    monkeypatch.setattr(compiler, "PIPELINE", compiler.PIPELINE[:2] + [("broken", broken)] + compiler.PIPELINE[2:])
    g = ingot.Graph()
    x = g.placeholder((3,), name="x")
    with pytest.raises(ingot.IngotError, match="invalid after pass 'broken'"):
        g.compile(targets=[g.exp(x)])


def test_only_passes_that_changed_the_program_are_verified_again(monkeypatch):
    """verify runs on the program as given and after each pass that reports a change (a pass is a pure
    function: one that changed nothing returns the program it was given, already verified)."""
    calls = []
    monkeypatch.setattr(compiler, "verify", lambda program, checked=None: calls.append(program))
    g, x, y = attention_and_quantized_graph()
    history = g.compile(feeds={x: ingot.TensorType((1, 5, 16))}, targets=[y]).history
    assert len(calls) == 1 + sum(changed for _, changed in history) < 1 + len(history)


def test_executables_are_cached_per_feed_shape():
    g, x, y = attention_and_quantized_graph()
    four = g.compile(feeds={x: ingot.TensorType((1, 4, 16))}, targets=[y])
    assert g.compile(feeds={x: ingot.TensorType((1, 4, 16))}, targets=[y]) is four
    assert g.compile(feeds={"x": (1, 4, 16)}, targets=[y]) is four
    eight = g.compile(feeds={x: ingot.TensorType((1, 8, 16))}, targets=[y])
    assert eight is not four
    assert four.feed_types["x"].shape == (1, 4, 16) and eight.output_types[0].shape == (1, 2, 8, 8)
    assert all(n.type.static for n in eight.program.nodes())
    with pytest.raises(ingot.IngotError, match="shape"):
        four.run({"x": np.zeros((1, 8, 16), np.float32)})
    with pytest.raises(ingot.IngotError, match="dtype"):
        four.run({"x": np.zeros((1, 4, 16), np.int32)})


@pytest.mark.parametrize("case, message", [
    ("nothing", "nothing to compute"),
    ("dynamic", "dynamic shape"),
    ("bad feed", "does not fit"),
    ("stranger feed", "not a placeholder|no placeholder"),
    ("assign twice", "assigned twice"),
    ("unused feed", "not placeholders the targets depend on"),
])
def test_compile_errors(case, message):
    g = ingot.Graph()
    x = g.placeholder((None, 4), name="x")
    y = g.exp(x)
    with pytest.raises(ingot.IngotError, match=message):
        if case == "nothing":
            g.compile()
        elif case == "dynamic":
            g.compile(targets=[y])
        elif case == "bad feed":
            g.compile(feeds={x: ingot.TensorType((2, 5))}, targets=[y])
        elif case == "stranger feed":
            g.compile(feeds={"z": (2, 4)}, targets=[y])
        elif case == "assign twice":
            v = g.variable(np.zeros(4, np.float32), name="v")
            g.assign(v, v + 1.0)
            g.assign(v, v * 2.0)
            g.compile()
        elif case == "unused feed":
            z = g.placeholder((2,), name="z")
            g.compile(feeds={z: ingot.TensorType((2,))}, targets=[g.exp(g.constant(np.ones(2, np.float32)))])


def test_dump_names_every_node():
    g = ingot.Graph()
    x = g.placeholder((2,), name="x")
    program = Program([(g.exp(x) + 1.0).node], [], dict(g.constants))
    text = compiler.dump(program)
    assert "placeholder()" in text and "exp(" in text and "add(" in text and text.endswith(f"outputs: %{program.outputs[0].id}")


def test_compiles_pause_the_garbage_collector_and_restore_it():
    """A compile runs with Python's cyclic collector paused and leaves it as it found it: running
    (also when the compile raises), or stopped by the caller."""
    import gc
    seen = []
    monkey_pipeline = compiler.run_pipeline

    def pipeline(*args, **kwargs):
        seen.append(gc.isenabled())
        return monkey_pipeline(*args, **kwargs)
    g, x, y = attention_and_quantized_graph()
    assert gc.isenabled()
    compiler.run_pipeline = pipeline
    try:
        g.compile(feeds={x: ingot.TensorType((1, 6, 16))}, targets=[y])
        assert seen == [False] and gc.isenabled()
        with pytest.raises(ingot.IngotError):
            g.compile(feeds={x: ingot.TensorType((2, 6, 16))}, targets=[y])   # batch 2 against the reshape's 1
        assert seen == [False, False] and gc.isenabled()   # raised inside the pipeline
        gc.disable()
        g.compile(feeds={x: ingot.TensorType((1, 7, 16))}, targets=[y])
        assert not gc.isenabled()
    finally:
        gc.enable()
        compiler.run_pipeline = monkey_pipeline
