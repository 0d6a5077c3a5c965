"""The long mode: `python -m tests.fuzz --minutes N [--loader X] [--seed S] [--out DIR]`.

Cases are drawn with random.Random (no hypothesis overhead), round robin over the loaders, each run in
a forked child (tests/fuzz/harness.py). Prints a line per loader every minute and at the end (cases,
refused, ok, and the bugs: crash / hang / memory, with the slowest case and its time); every bug's
case is written to DIR (default ./fuzz-findings) so it can be replayed and turned into a regression."""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path


def save_case(folder: Path, loader: str, index: int, case, outcome) -> Path:
    """A bug's case as files: bytes as .bin, a string as .txt, a dict of files as a folder, plus the outcome."""
    where = folder / f"{loader}-{index}"
    where.mkdir(parents=True, exist_ok=True)
    payload = case[0] if isinstance(case, tuple) else case
    if isinstance(payload, bytes):
        (where / "case.bin").write_bytes(payload)
    elif isinstance(payload, str):
        (where / "case.txt").write_text(payload, encoding="utf-8", errors="surrogateescape")
    elif isinstance(payload, dict):
        for name, data in payload.items():
            (where / "files" / name.lstrip("@")).parent.mkdir(parents=True, exist_ok=True)
            (where / "files" / name.lstrip("@")).write_bytes(data)
    (where / "outcome.txt").write_text(f"{outcome.kind} after {outcome.seconds:.2f} s\ncase: {case!r}"[:100000] +
                                       f"\n\n{outcome.detail}\n")
    return where


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--loader", action="append", help="gguf, onnx, package, audio, template, viewer (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="fuzz-findings")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="wall seconds before a case is killed as a hang (each outcome also records its CPU time)")
    args = parser.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    from .harness import run_case
    from .loaders import LOADERS
    from .mutate import RandomDraw

    names = args.loader or list(LOADERS)
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        parser.error(f"unknown loader {unknown[0]!r} (have {', '.join(LOADERS)})")
    for n in names:
        LOADERS[n].prepare()
    draw = RandomDraw(random.Random(args.seed))
    counts = {n: Counter() for n in names}
    slowest = {n: 0.0 for n in names}
    busiest = {n: 0.0 for n in names}
    start = time.monotonic()
    end = start + 60 * args.minutes
    report_at = start + 60
    index = 0

    def report(final: bool = False) -> None:
        minutes = (time.monotonic() - start) / 60
        for n in names:
            c = counts[n]
            print(f"{'final' if final else f'{minutes:5.1f} min'} {n:8s} cases {sum(c.values()):8d}  refused {c['refused']:8d}  "
                  f"ok {c['ok']:7d}  crash {c['crash']}  hang {c['hang']}  memory {c['memory']}  "
                  f"slowest {slowest[n]:.2f} s wall, {busiest[n]:.2f} s CPU", flush=True)

    while time.monotonic() < end:
        name = names[index % len(names)]
        index += 1
        loader = LOADERS[name]
        try:
            case = loader.case(draw)
        except Exception:  # a mutator that cannot make this case: draw another
            counts[name]["unmade"] += 1
            continue
        outcome = run_case(loader.run, case, timeout=args.timeout)
        counts[name][outcome.kind] += 1
        slowest[name] = max(slowest[name], outcome.seconds)
        busiest[name] = max(busiest[name], outcome.cpu_seconds)
        if outcome.bug:
            where = save_case(Path(args.out), name, index, case, outcome)
            print(f"BUG {name} {outcome.kind}: {outcome.detail.strip().splitlines()[-1][:200] if outcome.detail.strip() else ''} "
                  f"-> {where}", flush=True)
        if time.monotonic() > report_at:
            report()
            report_at += 60
    report(final=True)
    return 1 if any(counts[n][k] for n in names for k in ("crash", "hang", "memory")) else 0


if __name__ == "__main__":
    sys.exit(main())
