"""fuse_norm_gemv: [add ->] rms_norm -> GEMV [-> silu * up -> down GEMV] as one FUSED op."""
import pytest

from ingot.ir import Op
from ingot.passes.fuse_glu import fuse_glu
from ingot.passes.fuse_norm_gemv import fuse_norm_gemv
from ingot.passes.fuse_rope_cache import fuse_rope_cache
from ingot.passes.fuse_siblings import fuse_siblings
from fusion_helpers import assert_same_on_cpu, kinds, tiny_llama


@pytest.mark.parametrize("length", [1, 4])
def test_every_norm_of_a_decoder_feeds_its_gemv(length):
    exe, feeds = tiny_llama(length)
    p, _ = fuse_glu(exe.program)
    after, changed = fuse_norm_gemv(p)
    assert changed
    # per layer: attention norm -> qkv; ffn norm (+ residual add) -> gate_up -> glu -> down; and the output norm
    assert kinds(after) == {"norm_gemv": 2 + 1, "norm_gemv_glu": 2}
    assert not any(n.op == Op.RMS_NORM for n in after.nodes())
    assert_same_on_cpu(exe, after, feeds)


def test_a_big_down_weight_keeps_its_own_step():
    exe, feeds = tiny_llama(1)
    p, _ = fuse_glu(exe.program)
    after, _ = fuse_norm_gemv(p, self_xq_bytes=1)     # no down weight is small enough to round its own x
    assert kinds(after) == {"norm_gemv": 5, "glu_gemv": 2}
    assert_same_on_cpu(exe, after, feeds)


def test_more_rows_than_the_gemv_takes_are_left_alone():
    exe, feeds = tiny_llama(4)
    after, changed = fuse_norm_gemv(exe.program, words_max_rows=2)
    assert kinds(after) == {"norm_gemv": 1}    # only the output norm of row `last`
    assert_same_on_cpu(exe, after, feeds)


def test_a_siblings_group_is_taken_whole():
    exe, feeds = tiny_llama(1)
    p, _ = fuse_rope_cache(exe.program)
    p, _ = fuse_siblings(p)
    after, changed = fuse_norm_gemv(p)
    assert changed and kinds(after)["norm_gemv"] >= 3
    assert_same_on_cpu(exe, after, feeds)
