"""The long mode: `python -m tests.fuzz [--minutes N | --cases N] [--loader X] [--seed S] [--jobs J] [--out DIR]`.

Cases are drawn with random.Random (no hypothesis overhead), round robin over the loaders, and run by
persistent workers (tests/fuzz/worker.py: forked once, a case at a time, the case announced before it
runs so that a worker that dies or hangs is blamed on it). Case `index` is drawn from
random.Random(f"{seed}:{index}"), so a run is replayed by its seed. Prints a line per loader every
minute and at the end (cases, refused, ok, and the bugs: crash / hang / memory, with the slowest case,
the busiest and the highest peak RSS); every bug's case is written to DIR (default ./fuzz-findings) so
it can be replayed and turned into a regression. Scratch files go to /dev/shm unless TMPDIR says otherwise."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
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
    parser.add_argument("--minutes", type=float, default=None,
                        help="stop after this long (default 1, or no limit with --cases)")
    parser.add_argument("--cases", type=int, default=None, help="stop once every loader has run this many cases")
    parser.add_argument("--loader", action="append", help="gguf, onnx, package, audio, template, viewer (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (each runs every loader in turn)")
    parser.add_argument("--out", default="fuzz-findings")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="CPU seconds a case may use before it is killed as a hang")
    parser.add_argument("--wall-timeout", type=float, default=60.0,
                        help="wall seconds a case may take before it is killed as a hang (blocked, or starved of CPU)")
    args = parser.parse_args(argv)
    minutes = args.minutes if args.minutes is not None else (1.0 if args.cases is None else float("inf"))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    if "TMPDIR" not in os.environ and os.access("/dev/shm", os.W_OK):
        tempfile.tempdir = "/dev/shm"  # every case makes and removes a folder: ~4 ms on an ext4 /tmp, 0.05 ms in RAM
    from .loaders import LOADERS
    from .worker import Pool, draw_case

    names = args.loader or list(LOADERS)
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        parser.error(f"unknown loader {unknown[0]!r} (have {', '.join(LOADERS)})")
    for n in names:
        LOADERS[n].prepare()
    counts = {n: Counter() for n in names}
    slowest = {n: 0.0 for n in names}
    busiest = {n: 0.0 for n in names}
    peak = {n: 0 for n in names}
    where = {n: {} for n in names}   # the case index of the slowest, busiest and largest case
    start = time.monotonic()
    end = start + 60 * minutes
    report_at = start + 60
    pool = Pool(LOADERS, names, seed=args.seed, jobs=args.jobs, timeout=args.timeout, wall_timeout=args.wall_timeout)

    def report(final: bool = False) -> None:
        minutes = (time.monotonic() - start) / 60
        for n in names:
            c = counts[n]
            cases = sum(c.values()) - c["unmade"]
            print(f"{'final' if final else ''} {minutes:6.1f} min {n:8s} cases {cases:8d}  refused {c['refused']:8d}  "
                  f"ok {c['ok']:7d}  crash {c['crash']}  hang {c['hang']}  memory {c['memory']}  "
                  f"slowest {slowest[n]:.2f} s wall (#{where[n].get('wall')}), {busiest[n]:.2f} s CPU (#{where[n].get('cpu')}), "
                  f"peak RSS {peak[n] / 2**20:.0f} MiB (#{where[n].get('rss')})", flush=True)
        total = sum(sum(c.values()) - c["unmade"] for c in counts.values())
        rate = total / max(minutes, 1e-9)
        print(f"{'final' if final else ''} {minutes:6.1f} min total    cases {total:8d}  ({rate:.0f} a minute, "
              f"{pool.forks} worker forks)", flush=True)

    def stop() -> bool:
        if time.monotonic() >= end:
            return True
        return args.cases is not None and all(sum(c.values()) - c["unmade"] >= args.cases for c in counts.values())

    def interrupted(signum, frame):  # (a run in the background ignores SIGINT unless told otherwise)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        for outcome in pool.events(stop):
            name = outcome.loader
            counts[name][outcome.kind] += 1
            for table, value, key in ((slowest, outcome.seconds, "wall"), (busiest, outcome.cpu_seconds, "cpu"),
                                      (peak, outcome.peak_rss, "rss")):
                if value > table[name]:
                    table[name], where[name][key] = value, outcome.index
            if outcome.bug:
                try:
                    case = draw_case(LOADERS[name], args.seed, outcome.index)
                except Exception as e:  # noqa: BLE001
                    case = f"(could not draw case {outcome.index} again: {e!r})"
                saved = save_case(Path(args.out), name, outcome.index, case, outcome)
                print(f"BUG {name} {outcome.kind}: {outcome.detail.strip().splitlines()[-1][:200] if outcome.detail.strip() else ''} "
                      f"-> {saved}", flush=True)
            if time.monotonic() > report_at:
                report()
                report_at += 60
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    report(final=True)
    return 1 if any(counts[n][k] for n in names for k in ("crash", "hang", "memory")) else 0


if __name__ == "__main__":
    sys.exit(main())
