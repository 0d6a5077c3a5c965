"""fuse_rope_cache: rope + KV-cache writes (+ the decode attention) as one FUSED op."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op
from ingot.passes.fuse_rope_cache import fuse_rope_cache
from fusion_helpers import assert_same_on_cpu, kinds, tiny_llama

PLAIN = ingot.CompileOptions(fusions=frozenset())   # the CPU's own fusions (this one among them) off


@pytest.mark.parametrize("length", [1, 3])
def test_decoder_layers_rotate_write_and_attend_in_one_op(length):
    exe, feeds = tiny_llama(length)
    after, changed = fuse_rope_cache(exe.program)
    assert changed and kinds(after) == {"rope_qkv_attention": 2}
    assert not any(n.op in (Op.ROPE, Op.SDPA, Op.SLICE_UPDATE) for n in after.nodes())
    assert_same_on_cpu(exe, after, feeds)
    _, again = fuse_rope_cache(after)
    assert not again


def test_without_the_attention_the_writes_still_fuse():
    exe, feeds = tiny_llama(1)
    after, changed = fuse_rope_cache(exe.program, attention=False)
    assert changed and kinds(after) == {"rope_qkv_write": 2}
    assert sum(n.op == Op.SDPA for n in after.nodes()) == 2
    assert_same_on_cpu(exe, after, feeds)


def test_the_length_plus_one_is_computed_inside():
    exe, feeds = tiny_llama(1)
    adds = lambda p: [n for n in p.nodes() if n.op == Op.ADD and n.type.rank == 0]  # noqa: E731
    assert adds(exe.program)
    after, _ = fuse_rope_cache(exe.program)
    assert not adds(after)      # pos + 1 lives in each fused body, the program computes no sum


def rope_k_into_cache(read_old: bool):
    g = ingot.Graph()
    cache = g.variable(np.zeros((1, 2, 16, 8), np.float32), name="k_cache")
    k = g.placeholder((1, 2, 1, 8), name="k")
    pos = g.placeholder((), ingot.int32, name="pos")
    g.assign(cache, g.slice_update(cache, g.rope(k, pos), [0, 0, pos, 0]))
    target = g.sum(cache) if read_old else g.exp(k)
    return g, g.compile(targets=[target], options=PLAIN)


def test_a_lone_rope_of_k_is_written_in_place():
    g, exe = rope_k_into_cache(read_old=False)
    after, changed = fuse_rope_cache(exe.program)
    assert changed and kinds(after) == {"rope_kv_write": 1}
    feeds = {"k": np.random.default_rng(2).standard_normal((1, 2, 1, 8)).astype(np.float32), "pos": np.int32(4)}
    assert_same_on_cpu(exe, after, feeds)


def test_a_cache_read_before_its_write_is_left_alone():
    g, exe = rope_k_into_cache(read_old=True)      # the write is not in place: nothing to fuse
    after, changed = fuse_rope_cache(exe.program)
    assert not changed and not kinds(after)


def test_a_windowed_or_capped_attention_keeps_its_own_step():
    g = ingot.Graph()
    kc = g.variable(np.zeros((1, 2, 16, 8), np.float32), name="k_cache")
    vc = g.variable(np.zeros((1, 2, 16, 8), np.float32), name="v_cache")
    q, k, v = (g.placeholder((1, 2, 1, 8), name=n) for n in "qkv")
    pos = g.placeholder((), ingot.int32, name="pos")
    ku = g.slice_update(kc, g.rope(k, pos), [0, 0, pos, 0])
    vu = g.slice_update(vc, v, [0, 0, pos, 0])
    g.assign(kc, ku)
    g.assign(vc, vu)
    out = g.scaled_dot_product_attention(g.rope(q, pos), ku, vu, causal=True, softcap=30.0)
    exe = g.compile(targets=[out], options=PLAIN)
    after, changed = fuse_rope_cache(exe.program)
    assert kinds(after) == {"rope_qkv_write": 1} and sum(n.op == Op.SDPA for n in after.nodes()) == 1
