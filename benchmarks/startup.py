"""Start-up: what a user waits for before Ingot does anything.

Three figures, each the median wall time of --repeats fresh processes (after one untimed run, so
the page cache is warm, as it is for a user's second command):

  import    python -c "import ingot"
  help      python -m ingot.cli --help
  refusal   python -m ingot.cli generate --model NOT_A_MODEL.gguf hi   (exits 2, one sentence)

The goals (issue 32): import under 0.5 s, --help and a refused file under 1 s. An anchor for the
floor: `python -c "import numpy"`, which every one of them pays.

    python -m benchmarks startup [--repeats 5] [--json]

Run it from the repository root (it puts the root first on PYTHONPATH, so the checkout's ingot is
the one timed). `python -X importtime -c "import ingot"` shows where an import's time goes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOALS = {"import": 0.5, "help": 1.0, "refusal": 1.0}


def wall(argv: list[str], expect: int, env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    if r.returncode != expect:
        raise SystemExit(f"{' '.join(argv)} exited {r.returncode}, not {expect}: {r.stderr.decode()[-500:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        bogus = os.path.join(tmp, "not-a-model.gguf")
        with open(bogus, "w") as fh:
            fh.write("hello, I am a text file\n")
        cases = {
            "numpy": ([sys.executable, "-c", "import numpy"], 0),
            "import": ([sys.executable, "-c", "import ingot"], 0),
            "help": ([sys.executable, "-m", "ingot.cli", "--help"], 0),
            "refusal": ([sys.executable, "-m", "ingot.cli", "generate", "--model", bogus, "hi"], 2),
        }
        figures = {}
        for name, (argv, expect) in cases.items():
            wall(argv, expect, env)  # untimed: warms the page cache
            figures[name] = statistics.median(wall(argv, expect, env) for _ in range(args.repeats))
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in figures.items()}))
        return
    print(f"# start-up, median of {args.repeats} fresh processes; {platform.node()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, load {os.getloadavg()[0]:.2f}")
    for name, seconds in figures.items():
        goal = GOALS.get(name)
        verdict = "" if goal is None else f"  (goal < {goal} s: {'met' if seconds < goal else 'MISSED'})"
        print(f"{name:8s} {seconds:6.3f} s{verdict}")


if __name__ == "__main__":
    main()
