"""Per-request LoRA adapters in one decode batch (`ingot serve --lora`), on the CPU: the base model
and two adapters of different ranks served together, in both KV layouts (per-row caches, the CPU's;
the pool, CUDA's), each request's greedy tokens equal to it served alone and to `ingot generate
--lora` (LLM with that adapter); rows without adapter get exactly the base model's logits."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_pool_attention import served  # noqa: E402

# (adapter, prompt): more requests than slots, the base model and both adapters on one prompt
JOBS = [(None, [1, 5, 7, 9]), ("qv", [1, 5, 7, 9]), ("down", [1, 5, 7, 9]), ("qv", [3, 4]),
        (None, [10, 11, 12, 13, 14, 15, 16]), ("down", [8]), ("qv", [20, 21, 22])]


def write_adapters(root) -> dict[str, str]:
    """Two PEFT folders for the tiny model: q/v rank 8 on every layer, down_proj rank 1 on both layers."""
    from quant_helpers import tiny_config
    from test_lora import write_peft

    cfg = tiny_config()
    write_peft(root / "qv", cfg, ["q_proj", "v_proj"], rank=8, alpha=16, seed=3)
    write_peft(root / "down", cfg, ["down_proj"], rank=1, alpha=8, seed=4, layers=[0, 1])
    return {"qv": str(root / "qv"), "down": str(root / "down")}


def check_adapter_engine(path: str, adapters: dict[str, str], device: str, pool: bool, kv_dtype=None):
    """Served together (base and adapters in one batch) equals served alone and `LLM.generate` with
    that adapter on the same device; the adapters change the answers. Returns the engine."""
    from ingot.llm import load
    from ingot.serve.engine import Engine

    engine = Engine(path, device=device, max_batch=4, context=64, pool=pool, kv_dtype=kv_dtype,
                    loras={name: (folder, 1.0) for name, folder in adapters.items()})
    names, prompts = [a for a, _ in JOBS], [p for _, p in JOBS]
    engine.start()
    try:
        together = served(engine, prompts, adapters=names)
        alone = [served(engine, [p], adapters=[a])[0] for a, p in JOBS]
    finally:
        engine.stop()
    assert together == alone
    assert len({tuple(ids) for ids in together[:3]}) == 3      # the adapters change the answer
    for name in (None, *adapters):
        llm = load(path, device=device, context=64, kv_dtype=kv_dtype, lora=[adapters[name]] if name else ())
        for (a, prompt), ids in zip(JOBS, alone):
            if a == name:
                ids = ids[:-1] if ids and ids[-1] in engine.tokenizer.eos_ids else ids
                list(llm.generate(prompt, max_tokens=6))
                assert ids == llm.stats.tokens, (name, prompt)
    return engine


@pytest.fixture(scope="module")
def tiny_with_adapters(tmp_path_factory):
    from quant_helpers import save_tiny

    root = tmp_path_factory.mktemp("serve_lora")
    save_tiny(root / "tiny.llm")
    return str(root / "tiny.llm"), write_adapters(root)


@pytest.mark.parametrize("pool", [False, True])
def test_adapters_per_request_in_one_batch_equal_generate_lora(tiny_with_adapters, pool):
    check_adapter_engine(*tiny_with_adapters, "cpu", pool)


def test_rows_without_adapter_get_exactly_the_base_logits(tiny_with_adapters):
    """The rows decoder with every adapter inline: rows on entry 0 (the base, zero factors) give the
    logits of the rows decoder without adapters bit for bit, whatever adapters the other rows use."""
    from quant_helpers import tiny_config, tiny_tensors

    from ingot import dtypes as dt
    from ingot.adapters import AdapterSet, load_peft
    from ingot.ir import TensorType
    from ingot.models import llama
    from ingot.serve.adapters import RowAdapters

    cfg = tiny_config()
    tensors = tiny_tensors(cfg)
    _, folders = tiny_with_adapters
    sets = [AdapterSet()] + [load_peft(folders[n], cfg) for n in ("qv", "down")]
    rows, entries = 4, 5
    sites = RowAdapters(cfg, sets).for_rows(rows)
    assert sites.factors(["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"])[0].shape == (3, 64, 16)   # q and v: 8 + 8
    plain, adapted = (llama.build(cfg, tensors, rows=rows, pool=entries, adapter_sites=s) for s in ((), sites))
    exes = [m.graph.compile(feeds={m.tokens: TensorType((rows,), dt.int32)}, targets=[m.logits]) for m in (plain, adapted)]
    feeds = {"tokens": np.array([5, 9, 5, 2], np.int32), "positions": np.zeros(rows, np.int32),
             "slots": np.array([0, 1, 2, 3], np.int32)}
    want = exes[0].run(feeds, state=exes[0].new_state())[0]
    for which in ([0, 1, 0, 2], [0, 2, 0, 1], [0, 0, 0, 0]):
        got = exes[1].run(dict(feeds, adapter_rows=np.array(which, np.int32)), state=exes[1].new_state())[0]
        for r in range(rows):
            if which[r] == 0:
                np.testing.assert_array_equal(got[r], want[r])
            else:
                assert not np.array_equal(got[r], want[r])
