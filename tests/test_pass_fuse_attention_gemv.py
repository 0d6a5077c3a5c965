"""fuse_attention_gemv: a decode attention and the o projection reading it as one FUSED op."""
from ingot.ir import Op
from ingot.passes.fuse_attention_gemv import fuse_attention_gemv
from ingot.passes.fuse_rope_cache import fuse_rope_cache
from fusion_helpers import assert_same_on_cpu, kinds, tiny_llama


def test_rope_attention_and_o_projection_are_one_op():
    exe, feeds = tiny_llama(1)
    p, _ = fuse_rope_cache(exe.program)
    after, changed = fuse_attention_gemv(p)
    assert changed and kinds(after) == {"attention_gemv": 2}
    assert_same_on_cpu(exe, after, feeds)


def test_a_plain_sdpa_is_taken_too():
    exe, feeds = tiny_llama(1)
    after, changed = fuse_attention_gemv(exe.program)
    assert changed and kinds(after) == {"attention_gemv": 2}
    assert not any(n.op == Op.SDPA for n in after.nodes())
    assert_same_on_cpu(exe, after, feeds)


def test_prefill_is_left_alone():
    exe, feeds = tiny_llama(3)        # more than one query row: no decode attention
    p, _ = fuse_rope_cache(exe.program)
    after, changed = fuse_attention_gemv(p)
    assert not changed
