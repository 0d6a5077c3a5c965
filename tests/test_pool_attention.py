"""pool_attention (ops/pool.py) and the pool rows decoder (`llama.build(rows=R, pool=S)`) on the CPU:
the op against per-row SDPA on awkward shapes (odd head_dim, GQA, bf16 pools, window, softcap,
rows outside the pool), the inplace pass keeping the pools' memory, and every row of the decoder
equal to a batch-1 decoder whose state is that row's pool entry, whatever the other rows hold."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ingot import Graph, IngotError
from ingot import dtypes as dt
from ingot.ir import Op, TensorType
from ingot.models import llama
from ingot.ops.nn import sdpa
from ingot.runtime import State

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import tiny_config  # noqa: E402


def per_row(q, k, v, k_pool, v_pool, slots, positions, scale=None, window=0, softcap=0.0):
    """Independent reference: each valid row's write, then its own SDPA over its entry's prefix."""
    kp, vp = k_pool.astype(np.float32), v_pool.astype(np.float32)
    ok = [0 <= s < kp.shape[0] and 0 <= p < kp.shape[2] for s, p in zip(slots, positions)]
    for r in np.flatnonzero(ok):
        kp[slots[r], :, positions[r]] = k[r].astype(k_pool.dtype).astype(np.float32)
        vp[slots[r], :, positions[r]] = v[r].astype(v_pool.dtype).astype(np.float32)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    for r in np.flatnonzero(ok):
        s, n = slots[r], positions[r] + 1
        out[r] = sdpa(q[r][None, :, None], kp[None, s, :, :n], vp[None, s, :, :n], scale=scale, causal=True,
                      window=window, softcap=softcap)[0, :, 0]
    return out, kp, vp


CASES = [  # rows, Hq, Hk, D, Dv, entries, context, pool dtype, window, softcap, slots, positions
    (3, 4, 2, 13, 13, 4, 37, "float32", 0, 0.0, [2, 0, 3], [0, 36, 17]),          # odd D, lengths 1 and 37
    (4, 6, 1, 16, 8, 5, 20, "bfloat16", 0, 0.0, [4, 4, 1, 0], [3, 5, 19, 0]),      # MQA, Dv != D, a slot twice
    (2, 2, 2, 24, 24, 3, 33, "float16", 5, 30.0, [1, 2], [32, 6]),                 # window, softcap
    (3, 4, 2, 8, 8, 2, 9, "float32", 0, 0.0, [0, 7, -1], [4, 1, 2]),               # slots outside the pool
    (2, 4, 4, 8, 8, 2, 9, "float32", 0, 0.0, [0, 1], [9, -3]),                     # positions outside
]


def _case_arrays(case, seed=0):
    rows, hq, hk, d, dv, entries, context, kind, window, softcap, slots, positions = case
    rng = np.random.default_rng(seed)
    storage = dt.by_name(kind).storage
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    k = rng.standard_normal((rows, hk, d)).astype(np.float32)
    v = rng.standard_normal((rows, hk, dv)).astype(np.float32)
    k_pool = rng.standard_normal((entries, hk, context, d)).astype(storage)
    v_pool = rng.standard_normal((entries, hk, context, dv)).astype(storage)
    return q, k, v, k_pool, v_pool, np.array(slots, np.int32), np.array(positions, np.int32)


def _graph(case, arrays):
    window, softcap = case[8], case[9]
    g = Graph()
    q, k, v = (g.placeholder(a.shape, dt.float32, name=n) for n, a in zip("qkv", arrays[:3]))
    kind = dt.by_name(case[7])
    k_pool = g.variable(arrays[3], name="k_pool")
    v_pool = g.variable(arrays[4], name="v_pool")
    slots = g.placeholder((case[0],), dt.int32, name="slots")
    positions = g.placeholder((case[0],), dt.int32, name="positions")
    out, kn, vn = g.pool_attention(q, k, v, k_pool, v_pool, slots, positions, window=window, softcap=softcap)
    g.assign(k_pool, kn)
    g.assign(v_pool, vn)
    assert k_pool.dtype == kind
    return g, out


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_pool_attention_equals_per_row_attention_in_place(case):
    arrays = _case_arrays(case)
    g, out = _graph(case, arrays)
    exe = g.compile(targets=[out])
    assert [n.attrs.get("inplace") for n in exe.program.nodes() if n.op == Op.POOL_ATTENTION] == [True]
    state = exe.new_state()
    k_pool, v_pool = state["k_pool"], state["v_pool"]
    got = exe.run({"q": arrays[0], "k": arrays[1], "v": arrays[2], "slots": arrays[5], "positions": arrays[6]},
                  state=state)[0]
    want, kp, vp = per_row(*arrays, window=case[8], softcap=case[9])
    assert got.shape == want.shape and got.dtype == np.float32
    tolerance = 1e-5 if case[7] == "float32" else 1e-3   # the reference widens the same rounded pool values
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    assert state["k_pool"] is k_pool and state["v_pool"] is v_pool          # written in place, same memory
    np.testing.assert_array_equal(k_pool.astype(np.float32), kp)
    np.testing.assert_array_equal(v_pool.astype(np.float32), vp)


def test_pool_attention_type_rule_refuses_bad_shapes():
    g = Graph()
    q = g.placeholder((2, 4, 8), dt.float32)
    k = g.placeholder((2, 3, 8), dt.float32)                     # 4 query heads over 3 KV heads
    pool = g.variable(np.zeros((2, 3, 5, 8), np.float32), name="pool")
    ids = g.placeholder((2,), dt.int32)
    with pytest.raises(IngotError, match="pool_attention"):
        g.pool_attention(q, k, k, pool, pool, ids, ids)
    with pytest.raises(IngotError, match="pool_attention"):
        g.pool_attention(q, q, q, pool, pool, g.placeholder((2,), dt.float32), ids)


def _prefill(model, prompt, state):
    n = len(prompt)
    return model.compile(n).run({"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(n - 1)},
                                state=state)[0][0]


def entry_state(cfg, pool: State, s: int) -> State:
    """A batch-1 decoder's state whose caches are entry s of the pool (views, no copy)."""
    return State({f"blk.{i}.{kind}_cache": pool.values[f"blk.{i}.{kind}_pool"][s:s + 1]
                  for i in range(cfg.n_layers) for kind in ("k", "v")})


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_pool_rows_decoder_rows_equal_batch_one_whatever_the_batch(kv_dtype):
    cfg = tiny_config(qk_norm=True, kv_dtype=kv_dtype)
    weights = llama.random_weights(cfg, seed=3)
    single = llama.build(cfg, weights)
    rows, entries = 4, 6
    model = llama.build(cfg, weights, rows=rows, pool=entries)
    exe = model.graph.compile(feeds={model.tokens: TensorType((rows,), dt.int32)}, targets=[model.logits])
    assert exe.feed_order == ["tokens", "positions", "slots"]
    pool = exe.new_state()
    decoder = single.compile(1)
    rng = np.random.default_rng(1)
    slots = [4, 1, 3]                                  # rows 0..2; row 3 pads into entry 5 (scratch)
    refs, last, positions = [], [], []
    for s, n in zip(slots, (5, 2, 9)):
        prompt = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        logits = _prefill(single, prompt, entry_state(cfg, pool, s))   # prefill straight into the entry
        ref = decoder.new_state()
        np.testing.assert_array_equal(_prefill(single, prompt, ref), logits)
        refs.append(ref)
        last.append(int(np.argmax(logits)))
        positions.append(n)
    for step in range(3):
        feeds = {"tokens": np.array(last + [7], np.int32), "positions": np.array(positions + [0], np.int32),
                 "slots": np.array(slots + [5], np.int32)}
        got = exe.run(feeds, state=pool)[0]
        # the same rows with other company: row 1 alone among noise rows, in another order
        other = {"tokens": np.array([3, last[1], 9, 11], np.int32), "positions": np.array([2, positions[1], 0, 1], np.int32),
                 "slots": np.array([0, slots[1], 5, 2], np.int32)}
        k_saved = {name: a.copy() for name, a in pool.values.items()}
        alone = exe.run(other, state=pool)[0]
        np.testing.assert_array_equal(alone[1], got[1])    # a row's logits do not depend on the others
        for name, a in pool.values.items():                # undo the noise rows' writes (entries 0 and 2, 5)
            a[...] = k_saved[name]
        for r in range(3):
            want = decoder.run({"tokens": np.array([last[r]], np.int32), "pos": np.int32(positions[r]),
                                "last": np.int32(0)}, state=refs[r])[0][0]
            np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}, row {r}")
            np.testing.assert_allclose(   # the row's K went into its own entry (to the rounding of rows GEMMs)
                entry_state(cfg, pool, slots[r])["blk.1.k_cache"][:, :, :positions[r] + 1].astype(np.float32),
                refs[r]["blk.1.k_cache"][:, :, :positions[r] + 1].astype(np.float32), rtol=1e-2, atol=1e-2)
        last = [int(np.argmax(row)) for row in got[:3]]
        positions = [p + 1 for p in positions]


def test_pool_needs_rows():
    cfg = tiny_config()
    with pytest.raises(IngotError, match="pool"):
        llama.build(cfg, llama.random_weights(cfg), pool=3)


# --------------------------------------------------------------------------------------------
# The serving engine over a KV pool (what `ingot serve --device cuda` runs), here on the CPU.

PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16], [8], [20, 21, 22]]


def served(engine, prompts, max_tokens: int = 6, logprobs: bool = True, adapters=None) -> list:
    """Greedy token ids of each prompt (its text without logprobs), all submitted at once to a started
    engine; adapters: each prompt's adapter name (None: the base model)."""
    import threading

    from ingot.serve.engine import Request, SamplingParams

    results, finished = {}, threading.Event()
    for i, prompt in enumerate(prompts):
        ids: list = []

        def on_event(event, i=i, ids=ids):
            ids.extend(entry["id"] for entry in event.logprobs) if logprobs else ids.append(event.text)
            if event.kind != "text":
                results[i] = (ids if logprobs else "".join(ids)) if event.kind == "done" else event.message
                if len(results) == len(prompts):
                    finished.set()
        engine.submit(Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs),
                              adapter=adapters[i] if adapters else None, on_event=on_event))
    assert finished.wait(900)
    return [results[i] for i in range(len(prompts))]


def check_pool_engine(path, device: str, kv_dtype: str | None, max_batch: int = 4):
    """Concurrent greedy answers (more prompts than slots: some wait, then reuse freed entries) equal
    each prompt served alone and `LLM.generate` on the same device."""
    from ingot.serve.engine import Engine

    engine = Engine(path, device=device, max_batch=max_batch, context=64, pool=True, kv_dtype=kv_dtype)
    assert engine.pooled and engine.scratch.index == max_batch
    engine.warm(rows=(2,))            # runs the bucket on the scratch entry only: every slot still zeros
    for array in engine.pool.values.values():
        assert not array[:max_batch].any() and array[max_batch:].any()
    engine.start()
    try:
        together = served(engine, PROMPTS)
        alone = [served(engine, [p])[0] for p in PROMPTS]
        texts = served(engine, PROMPTS, logprobs=False)   # on a GPU: each row's arg-max taken on the device
    finally:
        engine.stop()
    assert together == alone
    assert texts == [engine.tokenizer.decode(ids) for ids in together]
    for prompt, ids in zip(PROMPTS, alone):
        ids = ids[:-1] if ids and ids[-1] in engine.tokenizer.eos_ids else ids   # (its logprob is served)
        list(engine.llm.generate(prompt, max_tokens=6))
        assert ids == engine.llm.stats.tokens
    return engine


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory):
    from quant_helpers import save_tiny

    path = tmp_path_factory.mktemp("pool") / "tiny.llm"
    save_tiny(path)
    return str(path)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])   # int8: the pool's codes and row scales, as slots
def test_pool_engine_on_the_cpu_equals_alone_and_generate(tiny_package, kv_dtype):
    engine = check_pool_engine(tiny_package, "cpu", kv_dtype)
    if kv_dtype == "int8":
        assert engine.pool.values["blk.0.k_pool"].dtype == np.int8 and "blk.0.v_scale_pool" in engine.pool.values


def test_pool_engine_steps_ahead_on_the_cpu(tiny_package, monkeypatch):
    """A GPU's steps ahead (the next decode step launched from this one's arg-max before the host reads
    its tokens), driven on the CPU with NumPy's arg-max standing in for the device's: the greedy texts
    equal the answers served alone (sequences stopping at max_tokens with a step already in flight)."""
    from ingot.serve import engine as serve_engine

    def greedy(self, seqs, logits, positions):
        if not all(s.sampler.greedy and not s.adjusts and not s.request.params.logprobs for s in seqs):
            return None
        rows = np.asarray(logits)[:len(seqs)]
        tokens = np.argmax(rows, axis=-1).astype(np.int32)
        return serve_engine._Flight(list(seqs), tokens, np.stack([tokens, np.isnan(rows).any(axis=-1)]), None)
    monkeypatch.setattr(serve_engine.Engine, "_device_tokens", greedy)
    engine = check_pool_engine(tiny_package, "cpu", None)
    assert engine.metrics.steps_ahead > 0 and engine._flight is None


def test_pool_engine_samples_on_the_device_path(tiny_package, monkeypatch):
    """Sampled requests through a GPU step's token choice (serve/sampling.py, run here on CPU tensors):
    a seeded request's text repeats whatever else is in the batch and steps are launched ahead."""
    torch = pytest.importorskip("torch")
    from ingot.serve import engine as serve_engine
    from ingot.serve.engine import Engine, Request, SamplingParams

    def on_cpu_tensors(self, seqs, logits, positions):
        if not all(serve_engine._on_device(s) for s in seqs):
            return None
        return self._flight_of(seqs, torch.from_numpy(np.asarray(logits)), positions)
    monkeypatch.setattr(serve_engine.Engine, "_device_tokens", on_cpu_tensors)
    engine = Engine(tiny_package, device="cpu", max_batch=4, context=64, pool=True)
    engine.start()

    def run(batch):   # [(prompt, seed)]: the texts
        import threading
        done, texts = threading.Event(), {}
        for i, (prompt, seed) in enumerate(batch):
            parts: list = []

            def on_event(event, i=i, parts=parts):
                parts.append(event.text)
                if event.kind != "text":
                    texts[i] = "".join(parts) if event.kind == "done" else event.message
                    if len(texts) == len(batch):
                        done.set()
            engine.submit(Request(list(prompt), SamplingParams(max_tokens=8, temperature=1.3, top_p=0.9, seed=seed),
                                  on_event=on_event))
        assert done.wait(300)
        return [texts[i] for i in range(len(batch))]
    try:
        alone = run([(PROMPTS[0], 11)])[0]
        together = run([(PROMPTS[1], 5), (PROMPTS[0], 11), (PROMPTS[2], 7)])
        other_seed = run([(PROMPTS[0], 12)])[0]
    finally:
        engine.stop()
    assert together[1] == alone
    assert other_seed != alone or len(alone) == 0
    assert engine.metrics.steps_ahead > 0


def check_mixed_steps(path: str, device: str, monkeypatch) -> None:
    """Prompts that arrive while another sequence decodes are prefilled as rows of its decode steps
    (mixed steps): at most MIXED_ROWS rows a step (a bucket of that many), positions below
    MIXED_MAX_POSITION (the rest of a longer prompt through its own prefill chunks). The scheduler is
    stepped by hand, so the order of arrivals is fixed; every answer equals its prompt served alone."""
    from ingot.serve import engine as serve_engine
    from ingot.serve.engine import Engine, Request, SamplingParams

    monkeypatch.setattr(serve_engine, "MIXED_MAX_POSITION", 3)   # the 4- and 7-token prompts end in chunks
    monkeypatch.setattr(serve_engine, "MIXED_ROWS", 6)           # 4 decoding rows leave room for 2 prompt rows
    engine = Engine(path, device=device, max_batch=4, context=64, pool=True)
    assert engine.buckets() == [1, 2, 4, 6]
    results = {}

    def submit(i, prompt, max_tokens):
        ids: list = []

        def on_event(event):
            ids.extend(entry["id"] for entry in event.logprobs)
            if event.kind != "text":
                results[i] = ids if event.kind == "done" else event.message
        engine.submit(Request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True),
                              on_event=on_event))

    first = [2, 3]
    submit(0, first, 20)                      # prefilled alone, then decoding
    engine._iteration()
    for i, prompt in enumerate(PROMPTS, 1):   # arrive while it decodes (two wait for a slot)
        submit(i, prompt, 6)
    for _ in range(500):
        if len(results) == len(PROMPTS) + 1:
            break
        engine._iteration()
    assert engine.metrics.prompt_rows > 0
    engine.start()
    try:
        alone = [served(engine, [p])[0] for p in [first, *PROMPTS]]
    finally:
        engine.stop()
    assert results[0][:6] == alone[0]
    assert [results[i] for i in range(1, len(PROMPTS) + 1)] == alone[1:]


def test_pool_engine_prompts_ride_in_decode_steps(tiny_package, monkeypatch):
    check_mixed_steps(tiny_package, "cpu", monkeypatch)


def test_kv_pool_too_big_for_the_device_is_refused_before_allocating():
    from ingot.serve.engine import check_kv_fits, kv_bytes

    cfg = llama.LlamaConfig(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                            context_length=4096, kv_dtype="bfloat16")
    assert kv_bytes(cfg, 64) == 64 * 4096 * 32 * 2 * 8 * 128 * 2          # 64 sequences of 4k: 32 GiB in bf16
    check_kv_fits(cfg, 65, "cuda", 5 << 30, free=139 << 30)               # fits an H200
    with pytest.raises(IngotError, match=r"KV cache of 64 slots x context 4096 x 32 layers in bfloat16 needs 32\.5 GiB"):
        check_kv_fits(cfg, 65, "cuda", 5 << 30, free=30 << 30)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "phi3", "qwen3moe", "gemma2", "gemma3",
                                    "mistral3"])
def test_pool_rows_decoder_of_every_family_equals_batch_one(family, tmp_path, monkeypatch):
    """Each family's pool rows decoder (what `ingot serve --device cuda` runs) against its batch-1
    decoder, on the CPU: Gemma's softcaps and sliding windows (prompts past the window of 8), SmolLM3's
    NoPE layer, Phi-3's LongRoPE, Qwen3-MoE's experts, Mistral 3's attention temperature."""
    import dataclasses

    import family_models
    from family_models import write_family_gguf

    from ingot import models
    from ingot.llm.package import open_model, storage_form

    monkeypatch.setitem(family_models.FAMILIES, family, dataclasses.replace(family_models.FAMILIES[family], quant="Q8_0"))
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(family, path)
    stored = open_model(path)
    cfg = stored.config
    tensors = storage_form(cfg, {name: stored.tensors[name] for name in stored.tensors})
    single = models.build(cfg, tensors, str(path))
    rows, entries = 3, 4
    model = models.build(cfg, tensors, str(path), rows=rows, pool=entries)
    exe = model.graph.compile(feeds={model.tokens: TensorType((rows,), dt.int32)}, targets=[model.logits])
    pool = exe.new_state()
    decoder = single.compile(1)
    rng = np.random.default_rng(4)
    slots, refs, last, positions = [2, 0, 3], [], [], []
    for s, n in zip(slots, (11, 2, 19)):
        prompt = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        logits = _prefill(single, prompt, entry_state(cfg, pool, s))
        ref = decoder.new_state()
        _prefill(single, prompt, ref)
        refs.append(ref)
        last.append(int(np.argmax(logits)))
        positions.append(n)
    for step in range(3):
        got = exe.run({"tokens": np.array(last, np.int32), "positions": np.array(positions, np.int32),
                       "slots": np.array(slots, np.int32)}, state=pool)[0]
        for r in range(rows):
            want = decoder.run({"tokens": np.array([last[r]], np.int32), "pos": np.int32(positions[r]),
                                "last": np.int32(0)}, state=refs[r])[0][0]
            np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}, row {r}")
        last = [int(np.argmax(row)) for row in got]
        positions = [p + 1 for p in positions]
