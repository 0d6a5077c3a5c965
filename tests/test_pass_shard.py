"""The sharding pass (ingot/passes/shard.py): a decoder split over W ranks (weights by KV-head groups,
FFN rows and vocabulary; all_reduce after o and down and of the embedding; all_gather of the
logits) computes what the whole decoder computes. Every rank's graph is run with the NumPy
references and the collectives' per-rank reference, in lock step (no process group, no torch)."""
import numpy as np
import pytest

from ingot import dtypes as dt
from ingot.errors import IngotError
from ingot.ir import Op, Program
from ingot.llm.package import storage_form
from ingot.models import llama, qwen3
from ingot.passes import evaluate
from ingot.models.tensor_parallel import build_sharded
from ingot.passes.shard import (check_tensor_parallel, collective_chain, even_parts, evaluate_ranks, insert_collectives,
                                plan, slice_quantized, slice_weight)
from ingot.quant.formats import QuantizedTensor

FEEDS = {"tokens": np.array([3, 250, 17, 128, 5, 0, 255], np.int32), "pos": np.int32(0), "last": np.int32(6)}


def program(model) -> Program:
    g = model.graph
    return Program([model.logits.node], list(g.assigns), dict(g.constants), dict(g.variables))


def config(**changes):
    fields = dict(n_layers=2, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=256, vocab_size=256, head_dim=16,
                  context_length=16)
    fields.update(changes)
    return llama.LlamaConfig(**fields)


def assert_shards_match(cfg, tensors, world, tolerance=2e-5):
    whole = evaluate(program(llama.build(cfg, tensors)), FEEDS)[0]
    ranks = [program(build_sharded(cfg, tensors, world, r)) for r in range(world)]
    outs = evaluate_ranks(ranks, FEEDS)
    for r, (logits,) in enumerate(outs):
        assert logits.shape == whole.shape and logits.dtype == whole.dtype
        np.testing.assert_allclose(logits, whole, rtol=tolerance, atol=tolerance, err_msg=f"rank {r} of {world}")
    return ranks


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_decoder_computes_the_whole_one(world):
    cfg = config()
    ranks = assert_shards_match(cfg, llama.random_weights(cfg), world)
    for r, p in enumerate(ranks):
        chain = collective_chain(p)
        expected = [] if world == 1 else [Op.ALL_REDUCE] * (2 * cfg.n_layers + 1) + [Op.ALL_GATHER]
        assert [n.op for n in chain] == expected
        k_cache = p.variables["blk.0.k_cache"]
        assert k_cache.shape == (1, cfg.n_kv_heads // world, cfg.context_length, cfg.head_dim)


def test_kv_heads_that_do_not_divide_go_two_and_one():
    # SmolLM2's shape of heads: 9 query heads in 3 KV groups, over 2 ranks (6 + 3 query heads)
    cfg = config(n_heads=9, n_kv_heads=3, dim=72, head_dim=32)
    ranks = assert_shards_match(cfg, llama.random_weights(cfg), 2)
    assert [p.variables["blk.1.v_cache"].shape[1] for p in ranks] == [2, 1]
    assert plan(cfg, 2, 1).q_heads == (6, 9)


@pytest.mark.parametrize("changes", [dict(qkv_bias=True), dict(tied_embeddings=True), dict(n_kv_heads=2, n_heads=8)])
def test_biases_tied_heads_and_groups(changes):
    cfg = config(**changes)
    assert_shards_match(cfg, llama.random_weights(cfg), 2)


def test_qwen3_qk_norm_and_int8_weights():
    cfg = qwen3.Config(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, head_dim=32,
                       context_length=16, qk_norm=True)
    feeds = dict(FEEDS, tokens=FEEDS["tokens"] % 128)
    tensors = llama.random_weights(cfg, qdtype=dt.int8)
    whole = evaluate(program(llama.build(cfg, tensors)), feeds)[0]
    outs = evaluate_ranks([program(build_sharded(cfg, tensors, 2, r, builder=llama.build)) for r in range(2)], feeds)
    np.testing.assert_allclose(outs[1][0], whole, rtol=2e-5, atol=2e-5)


def test_package_side_by_side_weights_are_split_part_by_part():
    cfg = config()
    tensors = llama.random_weights(cfg)
    stored = storage_form(cfg, tensors)
    assert "blk.0.attn_q.weight+blk.0.attn_k.weight+blk.0.attn_v.weight" in stored
    whole = evaluate(program(llama.build(cfg, tensors)), FEEDS)[0]
    outs = evaluate_ranks([program(build_sharded(cfg, stored, 2, r)) for r in range(2)], FEEDS)
    np.testing.assert_allclose(outs[0][0], whole, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int4, dt.int8])
@pytest.mark.parametrize("k_major", [False, True])
def test_quantized_slices_are_the_exact_values(qdtype, k_major):
    cfg = config(n_layers=1)
    w = llama.random_weights(cfg, qdtype=qdtype, k_major=k_major)["blk.0.ffn_down.weight"]   # [64 out, 256 in]
    whole = w.dequantize_rows() if not k_major else w.dequantize_rows().T                   # [out, in]
    for side, (start, stop) in (("in", (96, 160)), ("out", (22, 42))):
        part = slice_weight(w, side, start, stop, "blk.0.ffn_down.weight")
        assert isinstance(part, QuantizedTensor) and part.q.flags.c_contiguous
        values = part.dequantize_rows() if not k_major else part.dequantize_rows().T
        expected = whole[:, start:stop] if side == "in" else whole[start:stop]
        np.testing.assert_array_equal(values, expected)


def test_a_cut_inside_a_block_is_refused_by_tensor_name():
    cfg = config(ffn_dim=96)    # 48 columns of ffn_down per rank: not a whole number of 32-blocks
    with pytest.raises(IngotError, match=r"tensor blk\.0\.ffn_down\.weight splits its .* quantization blocks"):
        build_sharded(cfg, llama.random_weights(cfg), 2, 0)
    # k-major [64 in, 128 out], packed along out
    w = llama.random_weights(cfg, qdtype=dt.uint4, k_major=True)["blk.0.attn_q.weight"]
    with pytest.raises(IngotError, match="bytes of two 4-bit values"):
        slice_quantized(w, 1, 0, 31, "blk.0.attn_q.weight")


@pytest.mark.parametrize("world, words", [(0, "whole number"), (True, "whole number"), (8, "KV heads 4"),
                                          (3, "FFN width 256, vocabulary 256")])
def test_splits_that_do_not_fit_are_refused_in_one_sentence(world, words):
    with pytest.raises(IngotError, match=words) as e:
        check_tensor_parallel(config(), world)
    assert str(e.value).count(". ") == 0


def test_even_parts():
    assert even_parts(3, 2) == [(0, 2), (2, 3)]
    assert even_parts(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_the_pass_says_whether_it_changed_the_graph():
    import ingot

    cfg = config()
    p = program(llama.build(cfg, llama.random_weights(cfg)))
    after, changed = insert_collectives(p, 1, 0)
    assert changed and sum(n.op == Op.ALL_REDUCE for n in after.nodes()) == 2 * cfg.n_layers + 1
    g = ingot.Graph()
    y = g.matmul(g.placeholder((2, 4), name="x"), g.constant(np.ones((4, 3), np.float32), name="blk.0.attn_q.weight"))
    after, changed = insert_collectives(Program([y.node], [], dict(g.constants)), 2, 0)
    assert not changed and after.outputs[0] is y.node


def test_a_rank_graph_needs_a_process_group_to_compile():
    cfg = config()
    model = build_sharded(cfg, llama.random_weights(cfg), 2, 0)
    expected = "all_reduce over 2 ranks needs a torch.distributed process group"
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            pytest.skip("a process group exists in this process")
    except ImportError:   # CI: no torch at all, which is said first
        expected = "tensor parallelism needs torch"
    with pytest.raises(IngotError, match=expected):
        model.compile(1)
