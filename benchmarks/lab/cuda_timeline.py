"""Where a replayed decode step's time goes between and inside its GEMVs (ingot/backends/cuda/timeline.py).

Builds the Llama graph with random weights of a real shape (int4 g32, as cuda_llm.py), captures the
decode step with CudaOptions(timeline="all") (every word GEMV and quantize launch stamps the global timer in
each program: start, released past its wait, loop done, end), replays it, and prints per kernel kind
the medians over the step's launches, in us:

    gap      the kernel's first release after the kernel ahead's last end (the time nothing stamped runs:
             the wait itself, an unstamped kernel between them such as the attention)
    early    how long before that release its first program was resident (programmatic dependent launch)
    busy     first release to last end;  stream: the weight bytes over busy, TB/s
    tail     median end to last end;  loop  median (loop done - release) of its programs
    spread   the programs' release times, first to last
    ends     the programs' ends, first to last;  since: its last end after the kernel ahead's last end

then the first layer launch by launch, and the step: stamped span against the replay's time.
--ends stamps only the ends (timeline="end"): the word GEMVs keep their registers (held to
them, timeline.py), and so their waves; only tail, ends and since are shown. --detail NAME,...: those
kernels' programs a multiprocessor and their ends in deciles, then the word GEMV's compiled variants
with their registers (and the memo `_words_gemv` sizes its splits from).

    python benchmarks/lab/cuda_timeline.py [--model llama8b] [--layers 32] [--ends] [--npz out.npz]
        [--detail "gemv 4096x28672,gemv 14336x4096"]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))          # benchmarks/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))    # the repository
from cuda_llm import SHAPES, fast_random_weights, gguf_like_random_weights, graph_replay_us, model_shape  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402
from ingot.options import CompileOptions, CudaOptions  # noqa: E402
from ingot.backends.cuda import timeline  # noqa: E402
from ingot.models import llama  # noqa: E402


def summarize(launches: list[dict], nbytes: dict) -> tuple[list[dict], float]:
    """Per launch: its name and the figures in the module docstring (us), against the launch ahead; a
    launch's programs that left no stamps (a decode attention's splits without keys) are left out."""
    rows, prev_end = [], None
    launches = [dict(x, stamps=x["stamps"][x["stamps"][:, 3] > 0]) for x in launches]   # programs that stamped
    launches = [x for x in launches if len(x["stamps"])]
    full = all((x["stamps"][:, 1] > 0).all() for x in launches)   # every point stamped, or the ends only
    t0 = min(int(x["stamps"][:, 0 if full else 3].min()) for x in launches)
    for x in launches:
        s = x["stamps"].astype(np.int64)
        start, rel, loop, end = (s[:, i] - t0 for i in range(4))
        row = dict(name=x["name"], programs=len(s), sms=len(np.unique(s[:, 4])),
                   tail=(end.max() - np.median(end)) / 1e3, ends=(end.max() - end.min()) / 1e3,
                   since=None if prev_end is None else (end.max() - prev_end) / 1e3, end=end.max() / 1e3,
                   early=None, busy=None, loop=None, spread=None, gap=None, stream=None, at=end.min() / 1e3)
        if full:
            row.update(early=(rel.min() - start.min()) / 1e3, busy=(end.max() - rel.min()) / 1e3,
                       loop=float(np.median(loop - rel)) / 1e3, spread=(rel.max() - rel.min()) / 1e3,
                       gap=None if prev_end is None else (rel.min() - prev_end) / 1e3, at=rel.min() / 1e3)
            b = nbytes.get(x["name"])
            row["stream"] = b / (row["busy"] * 1e-6) / 1e12 if b and row["busy"] > 0 else None
        rows.append(row)
        prev_end = end.max()
    span = (max(int(x["stamps"][:, 3].max()) for x in launches) - t0) / 1e3
    return rows, span


def detail(launches: list[dict], name: str) -> None:
    """The first launch called `name`: how many of its programs each multiprocessor ran, and when they
    ended (us after its first end, in deciles): two waves show as a gap between groups of ends."""
    x = next((x for x in launches if x["name"] == name), None)
    if x is None:
        print(f"\nno launch named {name!r}")
        return
    s = x["stamps"][x["stamps"][:, 3] > 0].astype(np.int64)
    per_sm = np.bincount(np.unique(s[:, 4], return_counts=True)[1])
    end = (s[:, 3] - s[:, 3].min()) / 1e3
    print(f"\n{name}: {len(s)} programs on {len(np.unique(s[:, 4]))} multiprocessors; multiprocessors running "
          + ", ".join(f"{n} programs: {c}" for n, c in enumerate(per_sm) if c))
    print("  ends (us after the first), deciles: " + " ".join(f"{v:.1f}" for v in np.quantile(end, np.linspace(0, 1, 11))))


def word_gemv_registers() -> None:
    """The word GEMV's compiled variants, with their registers a thread, and `_words_gemv`'s memo."""
    print()
    for cache in getattr(qmm._qgemv_words_kernel, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for kernel in getattr(kernels, "values", lambda: [])():
            names = qmm._qgemv_words_kernel.arg_names
            consts = {names[k[0]] if isinstance(k, tuple) else k: v
                      for k, v in (getattr(getattr(kernel, "src", None), "constants", None) or {}).items()}
            print(f"word GEMV variant: {kernel.n_regs} registers, {kernel.n_spills} spills, warps "
                  f"{kernel.metadata.num_warps}; " + " ".join(f"{k}={v}" for k, v in sorted(consts.items())
                                                             if k in ("BLOCK_N", "TB", "EARLY_W", "XQ", "REDUCE",
                                                                      "XQ_RMS", "RESIDUAL", "ZERO", "ROWS")))
    print("register memo: " + "; ".join(f"n {k[0]}: {v}" for k, v in qmm._WORDS_REGS.items()))


def fmt(v, w=7, d=2):
    return f"{v:{w}.{d}f}" if isinstance(v, (float, int, np.floating)) and v is not None else " " * (w - 1) + "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--npz", default=None, help="save every launch's raw stamps here")
    ap.add_argument("--ends", action="store_true", help="stamp only each program's end (timeline=\"end\")")
    ap.add_argument("--detail", default=None, help="kernel names (comma-separated): their programs a multiprocessor and end times")
    ap.add_argument("--context", type=int, default=2048, help="the compiled context (cache rows)")
    ap.add_argument("--kv-dtype", default="float32", help="the cache's dtype (float32, bfloat16, int8)")
    ap.add_argument("--positions", default=None,
                    help="comma-separated decode positions: the step replayed and stamped at each in turn "
                         "(issue 38: 512,8192 with --context 8736 --kv-dtype bfloat16); the tables per position")
    args = ap.parse_args()
    cfg = llama.LlamaConfig(**model_shape(args.model, args.layers), context_length=args.context,
                            kv_dtype=args.kv_dtype)
    weights = gguf_like_random_weights(cfg) if args.model == "smollm2" else fast_random_weights(cfg)
    model = llama.build(cfg, weights)
    options = CompileOptions(cuda=CudaOptions(timeline="end" if args.ends else "all"))
    dec, pre = model.compile(1, "cuda", options), model.compile(args.prompt, "cuda", options)
    state = dec.new_state()
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, args.prompt).astype(np.int32)
    pre.run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(args.prompt - 1)}, state=state)
    timeline.reset()
    for i in range(4):   # compiles, then captures the step
        dec.run({"tokens": np.array([1], np.int32), "pos": np.int32(args.prompt + i), "last": np.int32(0)}, state=state)
    graphs = list(dec.plan._graphs.values())
    assert graphs, "the decode step was not captured (INGOT_CUDA_GRAPHS=0?)"
    g = graphs[0]["graph"]
    positions = [int(p) for p in args.positions.split(",")] if args.positions else [args.prompt + 3]
    for position in positions:
        # the captured step's feeds are staged in place: a run at this position, then the same graph replayed
        dec.run({"tokens": np.array([1], np.int32), "pos": np.int32(position), "last": np.int32(0)}, state=state)
        replay_us = graph_replay_us(g, warmup=20)
        g.replay()
        torch.cuda.synchronize()
        launches = timeline.read()
        if not launches:
            sys.exit("no stamped launch: was the step captured?")
        if len(positions) > 1:
            print(f"\n=== decode at position {position} (context {cfg.context_length}, KV {args.kv_dtype})")
        report(args, cfg, launches, replay_us)


def report(args, cfg, launches: list[dict], replay_us: float) -> None:
    nbytes = {}
    for v in getattr(__import__("ingot.backends.cuda", fromlist=["_DEVICE_CONSTANTS"]), "_DEVICE_CONSTANTS").values():
        if isinstance(v, qmm.QuantizedWeight) and v.words:
            nbytes[f"gemv {v.k}x{v.n}"] = v.nbytes
    if args.npz:
        np.savez_compressed(args.npz, names=np.array([x["name"] for x in launches]),
                            **{f"l{i}": x["stamps"] for i, x in enumerate(launches)})
    ticks = np.diff(np.unique(np.concatenate([x["stamps"][:, :4].ravel() for x in launches])))
    rows, span = summarize(launches, nbytes)
    print(f"{args.model} ({cfg.n_layers} layers): {len(rows)} stamped launches; stamped span {span:.1f} us, "
          f"replay {replay_us:.1f} us/step; timer step {int(ticks[ticks > 0].min())} ns")
    cols = ("gap", "early", "busy", "tail", "loop", "spread", "ends", "since", "stream")
    print(f"{'kernel':28s} {'n':>4s} {'progs':>6s} " + " ".join(f"{c:>7s}" for c in cols))
    by = defaultdict(list)
    for r in rows[1:]:
        by[r["name"]].append(r)
    for name, rs in by.items():
        med = {c: (float(np.median([r[c] for r in rs if r[c] is not None])) if any(r[c] is not None for r in rs) else None)
               for c in cols}
        print(f"{name:28s} {len(rs):4d} {rs[0]['programs']:6d} " + " ".join(fmt(med[c]) for c in cols))
    per_layer = max(1, (len(rows) - 2) // max(cfg.n_layers, 1))
    print(f"\nthe first {per_layer + 1} launches (at: us from the step's first stamp)")
    print(f"{'kernel':28s} {'at':>7s} " + " ".join(f"{c:>7s}" for c in cols))
    for r in rows[: per_layer + 1]:
        print(f"{r['name']:28s} {fmt(r['at'])} " + " ".join(fmt(r[c]) for c in cols))
    weights = f"weights {sum(nbytes.get(r['name'], 0) for r in rows) / 1e6:.1f} MB stamped"
    if args.detail:
        for name in args.detail.split(","):
            detail(launches, name)
        word_gemv_registers()
    if rows[0]["busy"] is None:   # ends only
        print(f"\n{weights}")
        return
    gaps = sum(r["gap"] for r in rows if r["gap"] is not None and r["gap"] > 0)
    busy = sum(r["busy"] for r in rows)
    print(f"\nsum of busy {busy:.1f} us (overlapping launches count twice), of positive gaps {gaps:.1f} us; {weights}")


if __name__ == "__main__":
    main()
