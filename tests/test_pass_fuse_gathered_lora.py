"""fuse_gathered_lora: a row-indexed LoRA (each row's factors gathered by its adapter index, two
batched matmuls; serve/adapters.RowAdapters) becomes one FUSED "gathered_lora" op per site, with the
same numbers; a gather read elsewhere or two different index feeds are left alone."""
import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.options import CompileOptions
from ingot.passes.fuse_gathered_lora import fuse_gathered_lora
from fusion_helpers import assert_same_on_cpu, kinds


def lora_graph(rows=3, extra_reader=False, two_indices=False):
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder((rows, 37), name="x")
    which = g.placeholder((rows,), dt.int32, name="which")
    other = g.placeholder((rows,), dt.int32, name="other") if two_indices else which
    a_rows = g.gather(g.constant(rng.standard_normal((3, 37, 5)).astype(np.float32)), which, axis=0)
    b_rows = g.gather(g.constant(rng.standard_normal((3, 5, 11)).astype(np.float32)), other, axis=0)
    up = g.reshape(g.matmul(g.matmul(g.reshape(x, (rows, 1, 37)), a_rows), b_rows), (rows, 11))
    targets = [up, g.exp(a_rows)] if extra_reader else [up]
    return g.compile(targets=targets, options=CompileOptions(fusions=frozenset()))


def feeds(rows=3, two_indices=False):
    rng = np.random.default_rng(1)
    out = {"x": rng.standard_normal((rows, 37)).astype(np.float32), "which": np.array([2, 0, 1][:rows], np.int32)}
    if two_indices:
        out["other"] = np.array([0, 1, 2][:rows], np.int32)
    return out


def test_gathered_shrink_and_expand_become_one_op():
    exe = lora_graph()
    after, changed = fuse_gathered_lora(exe.program)
    assert changed and kinds(after) == {"gathered_lora": 1}
    assert not any(n.op.name in ("GATHER", "MATMUL") for n in after.nodes())
    assert_same_on_cpu(exe, after, feeds())


@pytest.mark.parametrize("why", ["gather read elsewhere", "two index feeds"])
def test_left_alone(why):
    exe = lora_graph(extra_reader=why == "gather read elsewhere", two_indices=why == "two index feeds")
    after, changed = fuse_gathered_lora(exe.program)
    assert not changed and not kinds(after)


def test_every_site_of_a_rows_decoder_with_adapters():
    """The rows decoder ingot serve builds with adapters inline: each adapted site is one fused op."""
    from quant_helpers import tiny_config, tiny_tensors

    from ingot.adapters import AdapterSet
    from ingot.ir import TensorType
    from ingot.models import llama
    from ingot.serve.adapters import RowAdapters

    cfg = tiny_config()
    rng = np.random.default_rng(2)
    lora = AdapterSet({f"blk.{i}.{w}.weight": [(rng.standard_normal((4, 64 if w != "ffn_down" else 96)).astype(np.float32),
                                                rng.standard_normal((64, 4)).astype(np.float32))]
                       for i in range(cfg.n_layers) for w in ("attn_q", "ffn_down")})
    model = llama.build(cfg, tiny_tensors(cfg), rows=4, pool=5, adapter_sites=RowAdapters(cfg, [AdapterSet(), lora]).for_rows(4))
    exe = model.graph.compile(feeds={model.tokens: TensorType((4,), dt.int32)}, targets=[model.logits],
                              options=CompileOptions(fusions=frozenset()))
    after, changed = fuse_gathered_lora(exe.program)
    assert changed and kinds(after) == {"gathered_lora": 2 * cfg.n_layers}   # q/k/v and down, each layer
