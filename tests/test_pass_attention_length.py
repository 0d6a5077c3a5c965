"""attention_over_buffer: sdpa over slice(cache, end=L) becomes sdpa over the cache with a length."""
import math

import numpy as np

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.attention_length import attention_over_buffer

CACHE = (1, 3, 2048, 64)


def decode_graph(hand_written: bool):
    g = ingot.Graph()
    k_cache = g.variable(np.zeros(CACHE, np.float32), name="k_cache")
    v_cache = g.variable(np.zeros(CACHE, np.float32), name="v_cache")
    q = g.placeholder((1, 3, 1, 64), name="q")
    k_new = g.placeholder((1, 3, 1, 64), name="k_new")
    v_new = g.placeholder((1, 3, 1, 64), name="v_new")
    pos = g.placeholder((), ingot.int32, name="pos")
    k_all = g.slice_update(k_cache, k_new, start=[0, 0, pos, 0])
    v_all = g.slice_update(v_cache, v_new, start=[0, 0, pos, 0])
    g.assign(k_cache, k_all)
    g.assign(v_cache, v_all)
    k = g.slice(k_all, [0, 0, 0, 0], end=[None, None, pos + 1, None])
    v = g.slice(v_all, [0, 0, 0, 0], end=[None, None, pos + 1, None])
    if hand_written:
        scores = g.matmul(q, g.swapaxes(k, -1, -2)) / math.sqrt(64)
        y = g.matmul(g.softmax(scores, axis=-1), v)
    else:
        y = g.scaled_dot_product_attention(q, k, v)
    return g, y


def reference(q, keys, values):
    s = q @ np.swapaxes(keys, -1, -2) / 8.0
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ values


def test_rewrites_to_a_length_and_keeps_the_numbers():
    g, y = decode_graph(hand_written=False)
    before = Program([y.node], list(g.assigns), dict(g.constants), dict(g.variables))
    assert None in before.outputs[0].src[1].shape  # the slice has a runtime length
    after, changed = attention_over_buffer(before)
    assert changed
    sdpa = after.outputs[0]
    assert sdpa.op == Op.SDPA and sdpa.attrs["has_length"]
    assert sdpa.src[1].op == Op.SLICE_UPDATE and sdpa.src[1].shape == CACHE  # the whole buffer
    assert all(n.type.static for n in after.nodes())
    rng = np.random.default_rng(0)
    variables = {name: rng.standard_normal(CACHE).astype(np.float32) for name in ("k_cache", "v_cache")}
    feeds = {n: rng.standard_normal((1, 3, 1, 64)).astype(np.float32) for n in ("q", "k_new", "v_new")}
    feeds["pos"] = np.int32(9)
    np.testing.assert_allclose(evaluate(after, feeds, variables)[0], evaluate(before, feeds, variables)[0], rtol=1e-5, atol=1e-6)


def test_leaves_slices_with_different_lengths():
    g = ingot.Graph()
    kv = g.placeholder((1, 1, 8, 4), name="kv")
    q = g.placeholder((1, 1, 1, 4), name="q")
    a, b = g.placeholder((), ingot.int32, name="a"), g.placeholder((), ingot.int32, name="b")
    y = g.scaled_dot_product_attention(q, g.slice(kv, [0] * 4, [None, None, a, None]), g.slice(kv, [0] * 4, [None, None, b, None]))
    _, changed = attention_over_buffer(Program([y.node], [], dict(g.constants)))
    assert not changed


def decode(hand_written: bool, steps: int = 100):
    g, y = decode_graph(hand_written)
    exe = g.compile(targets=[y])
    ops = [n.op for n in exe.program.nodes()]
    assert ops.count(Op.SDPA) == 1 and Op.SOFTMAX not in ops and Op.SLICE not in ops
    (sdpa,) = [n for n in exe.program.nodes() if n.op == Op.SDPA]
    assert sdpa.attrs["has_length"]
    assert all(n.type.static for n in exe.program.nodes())
    k_state, v_state = exe.state["k_cache"], exe.state["v_cache"]
    pointers = (k_state.__array_interface__["data"][0], v_state.__array_interface__["data"][0])
    rng = np.random.default_rng(1)
    keys, values = np.zeros(CACHE, np.float32), np.zeros(CACHE, np.float32)
    for p in range(steps):
        feeds = {n: rng.standard_normal((1, 3, 1, 64)).astype(np.float32) for n in ("q", "k_new", "v_new")}
        (out,) = exe.run({**feeds, "pos": np.int32(p)})
        keys[:, :, p], values[:, :, p] = feeds["k_new"][:, :, 0], feeds["v_new"][:, :, 0]
        if p % 33 == 0 or p == steps - 1:
            expected = reference(feeds["q"], keys[:, :, :p + 1], values[:, :, :p + 1])
            np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    assert exe.state["k_cache"] is k_state and exe.state["v_cache"] is v_state
    assert (k_state.__array_interface__["data"][0], v_state.__array_interface__["data"][0]) == pointers
    np.testing.assert_array_equal(k_state, keys)
    np.testing.assert_array_equal(v_state, values)


def test_decode_loop_with_sdpa_over_the_cache():
    decode(hand_written=False)


def test_decode_loop_with_hand_written_attention_over_the_cache():
    decode(hand_written=True)
