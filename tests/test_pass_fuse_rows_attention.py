"""fuse_rows_attention (passes/fuse_rows_attention.py) and its CPU kernel (backends/cpu/rows_attention.py):
a rows decoder's per-row decode attentions of a layer become one step, the fused program bit for bit
the per-row one (the kernel itself: tests/test_cpu_decode_attention.py)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ingot import dtypes as dt
from ingot.ir import Op, TensorType
from ingot.models import llama
from ingot.options import CompileOptions, CpuOptions
from ingot.passes.device import FUSIONS
from ingot.runtime import State

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import tiny_config  # noqa: E402

PER_ROW = frozenset(FUSIONS["cpu"]) - {"rows_attention"}   # every CPU fusion but this one


def _kinds(exe) -> list[str]:
    return [n.attrs["kind"] for n in exe.program.nodes() if n.op == Op.FUSED]


def _compile(model, rows: int, **options):
    return model.graph.compile(feeds={model.tokens: TensorType((rows,), dt.int32)}, targets=[model.logits],
                               options=CompileOptions(**options) if options else None)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_one_fused_step_per_layer(rows):
    cfg = tiny_config(n_layers=3)
    model = llama.build(cfg, llama.random_weights(cfg, seed=1), rows=rows)
    exe, plain = _compile(model, rows), _compile(model, rows, fusions=PER_ROW)
    changed = dict(exe.history)["fuse_rows_attention"]
    if rows == 1:   # one row: nothing to take together
        assert not changed and _kinds(exe) == _kinds(plain) == ["rope_qkv_attention"] * 3
        return
    assert changed and _kinds(exe) == ["rows_qkv_attention"] * 3
    assert _kinds(plain) == ["rope_qkv_attention"] * (3 * rows)
    inner = [n.attrs["kind"] for f in exe.program.nodes() if f.op == Op.FUSED
             for n in f.attrs["body"].nodes if n.op == Op.FUSED]
    assert inner == ["rope_qkv_attention"] * (3 * rows)      # the body is the per-row program
    assert not any(n.op == Op.CONCAT for n in exe.program.nodes())


def _states(cfg, rows: int, lengths, seed: int) -> list[State]:
    """Each row's own caches [1, nkv, context, hd], filled with noise (what earlier tokens left)."""
    rng = np.random.default_rng(seed)
    shape = (1, cfg.n_kv_heads, cfg.context_length, cfg.head_dim)
    return State({f"blk.{i}.{kind}_cache.{r}": rng.standard_normal(shape).astype(np.float32)
                  for r in range(rows) for i in range(cfg.n_layers) for kind in ("k", "v")})


@pytest.mark.parametrize("threads, rows", [(1, 4), (2, 4), (2, 11)])
def test_fused_program_equals_per_row_program(threads, rows):
    """Logits and every cache bit for bit, rows at positions 0 (a first token), odd and unequal ones
    and the last position of the cache; on two threads the rows are split over the team; 11 rows go
    to the kernel in two calls (ROWS_PER_CALL)."""
    cfg = tiny_config(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=12, rope_dims=8, context_length=40)
    model = llama.build(cfg, llama.random_weights(cfg, seed=4), rows=rows)
    exe = _compile(model, rows, cpu=CpuOptions(threads=threads))
    plain = _compile(model, rows, fusions=PER_ROW, cpu=CpuOptions(threads=threads))
    assert "rows_qkv_attention" in _kinds(exe)
    a, b = _states(cfg, rows, None, 5), _states(cfg, rows, None, 5)
    for first in ([0, 7, 3, 39], [1, 8, 4, 20]):
        positions = (first * 3)[:rows]
        tokens = [(3 + 41 * r) % cfg.vocab_size for r in range(rows)]
        feeds = {"tokens": np.array(tokens, np.int32), "positions": np.array(positions, np.int32)}
        np.testing.assert_array_equal(exe.run(feeds, state=a)[0], plain.run(feeds, state=b)[0])
    for name in a.values:
        np.testing.assert_array_equal(a.values[name], b.values[name], err_msg=name)



def test_caches_that_do_not_fit_the_kernel_go_to_the_reference():
    """The step remembers the caches it last found fit (a server passes the same ones every step);
    other arrays are checked again: a non-contiguous cache, passed after fitting ones, runs the
    fused op's body through the references (which write it as the view it is), and every result
    still equals the per-row program's within float32 rounding."""
    rows = 2
    cfg = tiny_config(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=12, rope_dims=8, context_length=40)
    model = llama.build(cfg, llama.random_weights(cfg, seed=4), rows=rows)
    exe, plain = _compile(model, rows), _compile(model, rows, fusions=PER_ROW)
    feeds = {"tokens": np.array([5, 9], np.int32), "positions": np.array([3, 11], np.int32)}
    a, b = _states(cfg, rows, None, 5), _states(cfg, rows, None, 5)
    np.testing.assert_array_equal(exe.run(feeds, state=a)[0], plain.run(feeds, state=b)[0])
    c, d = _states(cfg, rows, None, 6), _states(cfg, rows, None, 6)
    name = "blk.1.k_cache.1"
    wide = np.zeros(c.values[name].shape[:3] + (2 * cfg.head_dim,), np.float32)
    strided = wide[..., ::2]                 # the same values, every other float of a wider array
    strided[...] = c.values[name]
    c.values[name] = strided
    np.testing.assert_allclose(exe.run(feeds, state=c)[0], plain.run(feeds, state=d)[0], rtol=1e-5, atol=1e-5)
    for key in c.values:   # (the references round differently from the kernels: not bit for bit)
        np.testing.assert_allclose(c.values[key], d.values[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert not wide[..., 1::2].any()         # nothing written between the view's floats
