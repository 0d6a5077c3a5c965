"""fuse_gathered_lora: a row-indexed LoRA (each row's factors gathered by its adapter index, two
batched matmuls; serve/adapters.RowAdapters) and the add of its delta become one FUSED "gathered_lora"
op per site, with the same numbers; x recomputed inside from an rms_norm's or act(gate) * up's
inputs, so the CUDA pipeline still fuses them into the GEMVs; a gather read elsewhere or two
different index feeds are left alone."""
import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.options import CompileOptions
from ingot.passes.fuse_gathered_lora import fuse_gathered_lora
from fusion_helpers import assert_same_on_cpu, kinds


def lora_graph(rows=3, extra_reader=False, two_indices=False, prologue=None):
    rng = np.random.default_rng(0)
    g = ingot.Graph()
    x = g.placeholder((rows, 37), name="x") if prologue != "silu" else None
    y = g.placeholder((rows, 11), name="y")
    if prologue == "norm":
        x = g.rms_norm(x, g.constant(rng.standard_normal(37).astype(np.float32)), eps=1e-5)
    elif prologue == "silu":
        z = g.placeholder((rows, 80), name="z")
        x = g.silu(g.slice(z, [0, 40], [None, 77])) * g.slice(z, [0, 0], [None, 37])
    which = g.placeholder((rows,), dt.int32, name="which")
    other = g.placeholder((rows,), dt.int32, name="other") if two_indices else which
    a_rows = g.gather(g.constant(rng.standard_normal((3, 37, 5)).astype(np.float32)), which, axis=0)
    b_rows = g.gather(g.constant(rng.standard_normal((3, 5, 11)).astype(np.float32)), other, axis=0)
    up = y + g.reshape(g.matmul(g.matmul(g.reshape(x, (rows, 1, 37)), a_rows), b_rows), (rows, 11))
    targets = [up, g.exp(a_rows)] if extra_reader else [up, g.exp(x)] if prologue else [up]
    return g.compile(targets=targets, options=CompileOptions(fusions=frozenset()))


def feeds(rows=3, two_indices=False, prologue=None):
    rng = np.random.default_rng(1)
    out = {"x": rng.standard_normal((rows, 37)).astype(np.float32), "which": np.array([2, 0, 1][:rows], np.int32),
           "y": rng.standard_normal((rows, 11)).astype(np.float32)}
    if prologue == "silu":   # x is computed from z
        out["z"] = rng.standard_normal((rows, 80)).astype(np.float32)
        del out["x"]
    if two_indices:
        out["other"] = np.array([0, 1, 2][:rows], np.int32)
    return out


@pytest.mark.parametrize("prologue", [None, "norm", "silu"])
def test_gathered_shrink_and_expand_become_one_op(prologue):
    exe = lora_graph(prologue=prologue)
    after, changed = fuse_gathered_lora(exe.program)
    assert changed and kinds(after) == {"gathered_lora": 1}
    assert not any(n.op.name in ("GATHER", "MATMUL", "ADD") for n in after.nodes())
    fused = next(n for n in after.nodes() if n.op.name == "FUSED")
    body = {n.op.name for n in fused.attrs["body"].nodes}
    assert ("RMS_NORM" in body) == (prologue == "norm") and ("SILU" in body) == (prologue == "silu")
    x = next(n for n in after.nodes() if n.op.name == "EXP").src[0] if prologue else None
    if x is not None:   # x itself is read by its other reader only (as a GEMV would read it)
        assert all(u.op.name == "EXP" for u in after.nodes() if x in u.src)
    assert_same_on_cpu(exe, after, feeds(prologue=prologue))


@pytest.mark.parametrize("why", ["gather read elsewhere", "two index feeds"])
def test_left_alone(why):
    exe = lora_graph(extra_reader=why == "gather read elsewhere", two_indices=why == "two index feeds")
    after, changed = fuse_gathered_lora(exe.program)
    assert not changed and not kinds(after)


def test_a_4bit_decoder_keeps_its_gemv_fusions():
    """On a 4-bit rows decoder with a LoRA on every projection, the CUDA pipeline still puts the norms
    and silu * mul into the GEMVs (the whole feed-forward as one step gives way to two: the gate/up
    GEMV's output takes its delta before silu * mul)."""
    from ingot.adapters import AdapterSet, site_input, site_layout
    from ingot.ir import TensorType
    from ingot.models import llama
    from ingot.passes.device import device_steps
    from ingot.serve.adapters import RowAdapters

    cfg = llama.LlamaConfig(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=300, context_length=32)
    weights = llama.random_weights(cfg, seed=0, block_size=32, k_major=True, f16_params=True)
    rng = np.random.default_rng(0)
    factors = {}
    for i in range(cfg.n_layers):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            name = f"blk.{i}.{kind}.weight"
            factors[name] = [(rng.standard_normal((4, site_input(cfg, name))).astype(np.float32),
                              rng.standard_normal((site_layout(cfg, [name])[0], 4)).astype(np.float32))]
    got = []
    for sites in ((), RowAdapters(cfg, [AdapterSet(), AdapterSet(factors)]).for_rows(4)):
        m = llama.build(cfg, weights, rows=4, pool=5, adapter_sites=sites)
        program = m.graph.compile(feeds={m.tokens: TensorType((4,), dt.int32)}, targets=[m.logits],
                                  options=CompileOptions(fusions=frozenset())).program
        for _, step in device_steps("cuda"):
            program, _ = step(program)
        got.append(kinds(program))
    assert got[0] == {"norm_gemv": 3, "norm_gemv_glu": 2}
    assert got[1] == {"gathered_lora": 4 * cfg.n_layers, "norm_gemv": 5, "glu_gemv": 2}


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
