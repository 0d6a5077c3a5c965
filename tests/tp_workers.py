"""Rank bodies for tests/test_tensor_parallel.py (module-level, so torch.multiprocessing can start
them in new processes). Each asserts; a failed assert fails the launch in the test."""
import os

import numpy as np

import ingot
from ingot.ir import Op
from ingot.ops.collective import reference_ranks

SHAPE = (7, 13)


def rank_input(rank: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    return (rng.standard_normal(SHAPE) * 100).astype(dtype)


def collectives(rank: int, ranks: int, device: str) -> None:
    """all_reduce and all_gather (axes 0 and 1) through a compiled graph equal reference_ranks."""
    for dtype in (np.float32, np.int32):
        g = ingot.Graph()
        x = g.placeholder(SHAPE, ingot.dtypes.from_numpy(np.dtype(dtype)), name="x")
        ops = [(Op.ALL_REDUCE, {"world": ranks, "reduce": "sum"}), (Op.ALL_GATHER, {"world": ranks, "axis": 1}),
               (Op.ALL_GATHER, {"world": ranks, "axis": 0})]
        exe = g.compile(targets=[g.op(op, [x], attrs) for op, attrs in ops], device=device)
        outs = [exe.backend.to_host(o) for o in exe.run({"x": rank_input(rank, dtype)})]
        everyone = [rank_input(r, dtype) for r in range(ranks)]
        for (op, attrs), out in zip(ops, outs):
            expected = reference_ranks(op, everyone, attrs)[rank]
            assert out.dtype == expected.dtype and out.shape == expected.shape, (op, out.shape)
            np.testing.assert_allclose(out, expected, rtol=1e-6, err_msg=f"{op.name} rank {rank}")


def random_model(rank: int, ranks: int, cfg, expected_tokens: list[int], expected_logits: np.ndarray) -> None:
    """Rank `rank`'s shard of a random-weight Llama decodes the tokens one process decodes."""
    from ingot.models import llama
    from ingot.models.tensor_parallel import build_sharded

    tokens, logits = greedy(build_sharded(cfg, llama.random_weights(cfg, seed=5), ranks, rank), len(expected_tokens))
    assert tokens == expected_tokens, (rank, tokens, expected_tokens)
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-4)


def greedy(model, steps: int, prompt=(3, 250, 17, 128, 5)):
    """Greedy tokens after a prompt (one prefill, then decode steps) and the logits of the last step."""
    prefill, decode = model.compile(len(prompt)), model.compile(1)
    state = decode.new_state()
    logits = prefill.run({"tokens": np.array(prompt, np.int32), "pos": np.int32(0), "last": np.int32(len(prompt) - 1)},
                         state=state)[0]
    tokens, pos = [], len(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[0])))
        logits = decode.run({"tokens": np.array(tokens[-1:], np.int32), "pos": np.int32(pos), "last": np.int32(0)},
                            state=state)[0]
        pos += 1
    return tokens, np.asarray(logits)


def default_model(rank: int, ranks: int, prompts: list[str], expected: list[list[int]], max_tokens: int) -> None:
    """ingot.llm.load(tensor_parallel=ranks) generates the greedy tokens one process generates."""
    from ingot.llm import load

    llm = load(tensor_parallel=ranks, context=256)
    for prompt, want in zip(prompts, expected):
        got = [t.id for t in llm.generate(prompt, max_tokens=max_tokens)]
        assert llm.stats.tokens == want, (rank, prompt, llm.stats.tokens, want, got)


__all__ = ["collectives", "default_model", "greedy", "random_model", "os"]
