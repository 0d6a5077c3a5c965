"""fuse_attention: hand-written attention becomes one scaled_dot_product_attention node."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ingot
from ingot.ir import Op, Program
from ingot.passes import evaluate
from ingot.passes.fuse_sdpa import fuse_attention
from ingot.runtime import Executable

HYPOTHESIS = settings(derandomize=True, deadline=None, max_examples=20)


def ops_of(program: Program) -> list[Op]:
    return [n.op for n in program.nodes()]


def reference_attention(q, k, v, scale, mask=None, bool_mask=None, softcap=0.0):
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if mask is not None:
        s = s + mask
    if bool_mask is not None:
        s = np.where(bool_mask, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)


def build(lead, hq, tq, tk, d, dv, scale_mode, mask_mode, cap_mode=None):
    """Hand-written attention; returns (graph, output, feeds, expected)."""
    rng = np.random.default_rng(sum(lead) + 7 * hq + 11 * tq + 13 * tk + 17 * d + 19 * dv)
    g = ingot.Graph()
    qs, ks, vs = lead + (hq, tq, d), lead + (hq, tk, d), lead + (hq, tk, dv)
    q, k, v = g.placeholder(qs, name="q"), g.placeholder(ks, name="k"), g.placeholder(vs, name="v")
    feeds = {"q": rng.standard_normal(qs, np.float32), "k": rng.standard_normal(ks, np.float32),
             "v": rng.standard_normal(vs, np.float32)}
    scores = g.matmul(q, g.swapaxes(k, -1, -2))
    scale = 1.0
    if scale_mode == "mul":
        scale = 1 / math.sqrt(d)
        scores = scores * scale
    elif scale_mode == "mul_left":
        scale = 0.37
        scores = 0.37 * scores
    elif scale_mode == "div":
        scale = 1 / math.sqrt(d)
        scores = scores / math.sqrt(d)
    softcap = 0.0
    if cap_mode == "div":
        softcap = 1.5
        scores = g.tanh(scores / 1.5) * 1.5
    elif cap_mode == "mul_left":
        softcap = 2.0
        scores = 2.0 * g.tanh(scores * 0.5)
    mask = bool_mask = None
    if mask_mode in ("add", "add_left"):
        mask = np.triu(np.full((tq, tk), -1e4, np.float32), 1 + tk - tq)
        m = g.placeholder((tq, tk), name="mask")
        feeds["mask"] = mask
        scores = scores + m if mask_mode == "add" else m + scores
    elif mask_mode == "where":
        bool_mask = np.tril(np.ones((1, tq, tk), bool), tk - tq)
        bool_mask[..., 0] = True  # every row sees at least one key
        m = g.placeholder((1, tq, tk), ingot.bool_, name="mask")
        feeds["mask"] = bool_mask
        scores = g.where(m, scores, -np.inf)
    out = g.matmul(g.softmax(scores, axis=-1), v)
    expected = reference_attention(feeds["q"], feeds["k"], feeds["v"], scale, mask, bool_mask, softcap)
    return g, out, feeds, expected


def program_of(g, out) -> Program:
    return Program([out.node], [], dict(g.constants), dict(g.variables))


@HYPOTHESIS
@given(lead=st.sampled_from([(), (1,), (2,)]), hq=st.integers(1, 3), tq=st.integers(1, 5), tk=st.integers(1, 6),
       d=st.integers(1, 8), dv=st.integers(1, 8), scale_mode=st.sampled_from(["none", "mul", "mul_left", "div"]),
       mask_mode=st.sampled_from([None, "add", "add_left", "where"]), cap_mode=st.sampled_from([None, "div", "mul_left"]))
def test_fuses_every_form_and_keeps_the_numbers(lead, hq, tq, tk, d, dv, scale_mode, mask_mode, cap_mode):
    g, out, feeds, expected = build(lead, hq, tq, tk, d, dv, scale_mode, mask_mode, cap_mode)
    before = program_of(g, out)
    after, changed = fuse_attention(before)
    assert changed
    ops = ops_of(after)
    assert Op.SOFTMAX not in ops and Op.MATMUL not in ops and Op.TRANSPOSE not in ops
    assert ops.count(Op.SDPA) == 1
    sdpa = after.outputs[0]
    assert sdpa.attrs["has_mask"] == (mask_mode is not None)
    assert sdpa.attrs.get("softcap", 0.0) == {None: 0.0, "div": 1.5, "mul_left": 2.0}[cap_mode]
    assert Op.TANH not in ops
    assert sdpa.type == out.type
    (unfused,) = evaluate(before, feeds)
    (fused,) = Executable(after).run(feeds)
    assert fused.shape == expected.shape and fused.dtype == np.float32
    np.testing.assert_allclose(unfused, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fused, expected, rtol=1e-4, atol=1e-5)


def test_scale_value_is_recorded():
    g, out, _, _ = build((1,), 2, 3, 4, 16, 16, "div", None)
    after, _ = fuse_attention(program_of(g, out))
    assert after.outputs[0].attrs["scale"] == pytest.approx(0.25)


def test_compiled_hand_written_attention_is_one_sdpa_node():
    g, out, feeds, expected = build((1,), 3, 4, 4, 8, 8, "mul", "add")
    exe = g.compile(targets=[out])
    ops = ops_of(exe.program)
    assert ops.count(Op.SDPA) == 1 and Op.SOFTMAX not in ops and Op.MATMUL not in ops
    assert ("fuse_attention", True) in exe.history
    np.testing.assert_allclose(exe.run(feeds)[0], expected, rtol=1e-4, atol=1e-5)


def _unfusable(kind):
    g = ingot.Graph()
    q, k, v = (g.placeholder((1, 2, 3, 4), name=n) for n in "qkv")
    s = g.matmul(q, g.swapaxes(k, -1, -2))
    if kind == "softmax_axis":
        return g, g.matmul(g.softmax(s * 0.5, axis=-2), v)
    if kind == "not_a_swap":
        s = g.matmul(q, g.transpose(k, (1, 0, 3, 2)))  # swaps the heads too: not attention
        return g, g.matmul(g.softmax(s, axis=-1), v)
    if kind == "runtime_scale":
        c = g.placeholder((), name="c")
        return g, g.matmul(g.softmax(s * c, axis=-1), v)
    if kind == "scale_divides":
        return g, g.matmul(g.softmax(g.div(2.0, s), axis=-1), v)
    if kind == "cap_mismatch":  # tanh(s / 2) * 3 is not a softcap
        return g, g.matmul(g.softmax(g.tanh(s / 2.0) * 3.0, axis=-1), v)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["softmax_axis", "not_a_swap", "runtime_scale", "scale_divides", "cap_mismatch"])
def test_leaves_what_is_not_attention(kind):
    g, out = _unfusable(kind)
    after, changed = fuse_attention(program_of(g, out))
    assert not changed
    assert Op.SDPA not in ops_of(after) and Op.SOFTMAX in ops_of(after)


def test_second_run_changes_nothing():
    g, out, _, _ = build((1,), 1, 2, 2, 4, 4, "mul", None)
    once, _ = fuse_attention(program_of(g, out))
    twice, changed = fuse_attention(once)
    assert not changed and twice.outputs[0] is once.outputs[0]


@pytest.mark.parametrize("guard", [False, True])
def test_hf_export_form_split_scale_merged_transpose_nan_guard(guard):
    """HF's exported attention (MiniLM): q * c and k^T * c (c^2 = 1/sqrt(D)), k^T made as reshape to
    [B*H, T, D], transpose, reshape back, and the probabilities NaN-guarded: one SDPA, same numbers
    (a row masked whole gives zeros either way)."""
    rng = np.random.default_rng(9)
    b, h, t, d = 2, 3, 5, 6
    g = ingot.Graph()
    q, k, v = (g.placeholder((b, h, t, d), name=n) for n in "qkv")
    m = g.placeholder((b, 1, t, t), name="mask")
    c = float(1 / math.sqrt(math.sqrt(d)))
    kt = g.reshape(g.transpose(g.reshape(k, (b * h, t, d)), (0, 2, 1)), (b, h, d, t))
    p = g.softmax(g.matmul(q * c, kt * c) + m, axis=-1)
    if guard:
        p = g.where(g.not_equal(p, p), g.constant(np.float32(0)), p)
    out = g.matmul(p, v)
    mask = np.where(rng.random((b, 1, t, t)) < 0.3, -np.inf, 0).astype(np.float32)
    mask[1, 0, 2] = -np.inf        # a row that sees no key
    feeds = {n: rng.standard_normal((b, h, t, d)).astype(np.float32) for n in "qkv"} | {"mask": mask}
    before = program_of(g, out)
    after, changed = fuse_attention(before)
    assert changed and ops_of(after).count(Op.SDPA) == 1 and Op.SOFTMAX not in ops_of(after)
    assert after.outputs[0].attrs["scale"] == pytest.approx(c * c)
    (fused,) = Executable(after).run(feeds)
    with np.errstate(invalid="ignore"):   # the row that sees no key: NaN in the written-out form
        want = reference_attention(feeds["q"], feeds["k"], feeds["v"], c * c, mask)
        unfused = evaluate(before, feeds)[0]
    want[1, :, 2] = 0
    np.testing.assert_allclose(fused, want, rtol=1e-4, atol=1e-5)
    if guard:
        np.testing.assert_allclose(unfused, want, rtol=1e-4, atol=1e-5)
