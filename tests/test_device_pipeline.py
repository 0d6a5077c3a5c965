"""The CUDA device pipeline (compiler.DEVICE_PIPELINES) decides fusions on the IR alone: a Llama-family
graph written by hand, with none of models/llama.py's own choices (separate q/k/v and gate/up
matmuls, its own names), gets the same fused ops per decode step as models/llama.py's graph. Runs
without torch: only the passes are involved."""
import collections

import numpy as np
import pytest

import ingot
from ingot import compiler
from ingot.errors import IngotError
from ingot.ir import GroupOp, Op, Program, TensorType
from ingot.models import llama
from fusion_helpers import assert_same_on_cpu, quantized_weight

CFG = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, context_length=32)


def by_hand(seed=0):
    """A SmolLM-like decoder in plain Graph calls: (graph, logits)."""
    c = CFG
    hd = c["dim"] // c["n_heads"]
    g = ingot.Graph()
    tokens = g.placeholder((None,), ingot.int32, name="tokens")
    pos = g.placeholder((), ingot.int32, name="pos")
    rng = np.random.default_rng(seed)
    embed = g.constant(rng.standard_normal((c["vocab_size"], c["dim"])).astype(np.float32))
    x = g.gather(embed, tokens, axis=0)                                   # [T, dim]
    ones = lambda n: g.constant((1 + 0.1 * rng.standard_normal(n)).astype(np.float32))  # noqa: E731
    w = iter(range(1000))
    for layer in range(c["n_layers"]):
        h = g.rms_norm(x, ones(c["dim"]), 1e-5)
        q = g.matmul(h, quantized_weight(g, c["dim"], c["n_heads"] * hd, seed=next(w)))
        k = g.matmul(h, quantized_weight(g, c["dim"], c["n_kv_heads"] * hd, seed=next(w)))
        v = g.matmul(h, quantized_weight(g, c["dim"], c["n_kv_heads"] * hd, seed=next(w)))
        heads = lambda t, n: g.transpose(g.reshape(t, (1, -1, n, hd)), (0, 2, 1, 3))  # noqa: E731
        q, k, v = heads(q, c["n_heads"]), heads(k, c["n_kv_heads"]), heads(v, c["n_kv_heads"])
        q, k = g.rope(q, pos, base=10000.0), g.rope(k, pos, base=10000.0)
        kc = g.variable(np.zeros((1, c["n_kv_heads"], c["context_length"], hd), np.float32), name=f"k{layer}")
        vc = g.variable(np.zeros((1, c["n_kv_heads"], c["context_length"], hd), np.float32), name=f"v{layer}")
        k_all, v_all = g.slice_update(kc, k, [0, 0, pos, 0]), g.slice_update(vc, v, [0, 0, pos, 0])
        g.assign(kc, k_all)
        g.assign(vc, v_all)
        end = pos + g.dim(tokens, 0)
        o = g.scaled_dot_product_attention(q, g.slice(k_all, [0, 0, 0, 0], [None, None, end, None]),
                                           g.slice(v_all, [0, 0, 0, 0], [None, None, end, None]), causal=True)
        o = g.reshape(g.transpose(o, (0, 2, 1, 3)), (-1, c["n_heads"] * hd))
        x = x + g.matmul(o, quantized_weight(g, c["n_heads"] * hd, c["dim"], seed=next(w)))
        h = g.rms_norm(x, ones(c["dim"]), 1e-5)
        gate = g.matmul(h, quantized_weight(g, c["dim"], c["ffn_dim"], seed=next(w)))
        up = g.matmul(h, quantized_weight(g, c["dim"], c["ffn_dim"], seed=next(w)))
        x = x + g.matmul(g.silu(gate) * up, quantized_weight(g, c["ffn_dim"], c["dim"], seed=next(w)))
    x = g.rms_norm(x, ones(c["dim"]), 1e-5)
    logits = g.matmul(x, quantized_weight(g, c["dim"], 64, seed=next(w)))
    return g, logits


def device_program(g, target, device):
    program = Program([target.node], list(g.assigns), dict(g.constants), dict(g.variables))
    out, history = compiler.run_pipeline(program, feed_types={"tokens": TensorType((1,), ingot.int32)}, device=device)
    return out, history


def launches(program):
    """What runs per step: fused ops by kind and the other non-view, non-source ops by name."""
    skip = GroupOp.Source | GroupOp.View | {Op.ASSIGN, Op.GET_ITEM, Op.DIM}
    return collections.Counter(n.attrs["kind"] if n.op == Op.FUSED else n.op.name.lower()
                               for n in program.nodes() if n.op not in skip)


def test_a_hand_built_llama_gets_the_fusions_of_models_llama():
    g, logits = by_hand()
    mine, history = device_program(g, logits, "cuda")
    cfg = llama.LlamaConfig(**CFG)
    model = llama.build(cfg, llama.random_weights(cfg, seed=1))
    theirs, _ = device_program(model.graph, model.logits, "cuda")
    ours, reference = launches(mine), launches(theirs)
    for counts in (ours, reference):     # the embedding differs by design (float here, quantized there)
        counts.pop("gather", None), counts.pop("quantized_gather", None)
    assert ours == reference
    assert reference["norm_gemv_glu"] == reference["attention_gemv"] == CFG["n_layers"]
    assert [name for name, _ in history] == list(compiler.pass_names("cuda"))


def test_the_cuda_pipeline_runs_on_the_cpu_backend():
    g, logits = by_hand()
    exe = g.compile(feeds={"tokens": TensorType((1,), ingot.int32)}, targets=[logits])
    fused, _ = device_program(g, logits, "cuda")
    assert_same_on_cpu(exe, fused, {"tokens": np.array([7], np.int32), "pos": np.int32(3)})


def test_options_choose_fusions():
    class Options:
        fusions = frozenset({"siblings"})
    g, logits = by_hand()
    program = Program([logits.node], list(g.assigns), dict(g.constants), dict(g.variables))
    out, history = compiler.run_pipeline(program, feed_types={"tokens": TensorType((1,), ingot.int32)},
                                         device="cuda", options=Options())
    assert [n for n, _ in history if n.startswith("fuse_")] == ["fuse_attention", "fuse_norms", "fuse_one_hot", "fuse_dequantize", "fuse_siblings"]
    Options.fusions = frozenset({"everything"})
    with pytest.raises(IngotError, match="not cuda fusions"):
        compiler.run_pipeline(program, device="cuda", options=Options())

