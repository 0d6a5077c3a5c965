"""Shared checks for the device fusion passes: a fused program must compute what the unfused one does
on the CPU backend (which runs a FUSED op by its NumPy reference, the body op by op), outputs and
variables alike, and the pass must report what it changed."""
from __future__ import annotations

import collections

import numpy as np

from ingot.ir import Op, Program
from ingot.models import llama
from ingot.options import CompileOptions
from ingot.passes.memory_plan import plan_memory
from ingot.passes.regions import find_regions
from ingot.runtime import Executable
from ingot.verify import verify


def tiny_llama(length: int = 1, **overrides):
    """(the executable of a 2-layer random-weight Llama for `length` tokens on the CPU, without the CPU's
    own device fusions (the passes under test start from the plain program), its feeds)."""
    shape = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=50, context_length=32)
    shape.update(overrides)
    cfg = llama.LlamaConfig(**shape)
    exe = llama.build(cfg, llama.random_weights(cfg, seed=1)).compile(length, options=CompileOptions(fusions=frozenset()))
    feeds = {"tokens": (np.arange(length, dtype=np.int32) * 7 + 3) % cfg.vocab_size, "pos": np.int32(5),
             "last": np.int32(length - 1)}
    return exe, feeds


def kinds(program: Program) -> collections.Counter:
    return collections.Counter(n.attrs["kind"] for n in program.nodes() if n.op == Op.FUSED)


def cpu_executable(program: Program, like: Executable) -> Executable:
    """The program (after a fusion pass) ready for the CPU backend, with like's inputs."""
    program, _ = find_regions(program)
    regions = program.regions
    program, _ = plan_memory(program)
    program.regions = regions
    return Executable(program, device="cpu", inputs=list(like.feed_types.items()))


def assert_same_on_cpu(before: Executable, after: Program, feeds: dict, seed: int = 0) -> None:
    """Both programs from the same (random) variables: equal outputs and equal variables after one run."""
    verify(after)
    fused = cpu_executable(after, before)
    rng = np.random.default_rng(seed)
    s1, s2 = before.new_state(), fused.new_state()
    for name in s1:
        value = rng.standard_normal(s1[name].shape).astype(s1[name].dtype)
        s1[name], s2[name] = value, value
    out1, out2 = before.run(feeds, state=s1), fused.run(feeds, state=s2)
    for a, b in zip(out1, out2):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    for name in s1:
        np.testing.assert_allclose(s2[name], s1[name], rtol=1e-5, atol=1e-5, err_msg=name)


def quantized_weight(g, k: int, n: int, seed: int = 0, block: int = 32):
    """A uint4 [k, n] weight in blocks of `block` along k (scale and zero point), dequantized: x @ it
    becomes a quantized_matmul of constant affine weights."""
    from ingot import dtypes as dt

    rng = np.random.default_rng(seed)
    q = g.constant(dt.pack_int4(rng.integers(0, 16, size=(k, n))), dtype=dt.uint4)
    scale = g.constant((rng.random((k // block, n)) * 0.1 + 0.01).astype(np.float32))
    zero = g.constant(np.full((k // block, n), 8.0, np.float32))
    return g.dequantize(q, scale=scale, zero_point=zero, axis=0, block_size=block)
