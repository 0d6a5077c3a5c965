"""The long mode's engine (worker.py) blames each way a case can go wrong on exactly that case, and
goes on with the next one in a fresh worker."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from ingot.errors import IngotError

from . import worker
from .loaders import Loader

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="the engine forks (Linux)")

# what case `index` does: a case is drawn by index, so the plan is indexed the same way
PLAN = ["ok", "refused", "crash", "ok", "exit", "ok", "segv", "ok", "spin", "ok", "sleep", "ok", "oom", "ok", "peak",
        "ok", "multiline", "ok"]


def _target(what: str) -> None:
    if what == "refused":
        raise IngotError("x.gguf: field n is -1, which is not a count")
    if what == "multiline":
        raise IngotError("two\nlines")
    if what == "crash":
        raise ZeroDivisionError("head_count 0")
    if what == "exit":
        os._exit(7)
    if what == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "spin":
        while True:
            pass
    if what == "sleep":
        time.sleep(60)
    if what == "oom":
        bytearray(8 << 30)
    if what == "peak":   # over a threshold set from this worker's own RSS (a fork's RSS is below its parent's)
        worker.PEAK_RSS = (worker._status_kib("VmRSS:") << 10) + (100 << 20)
        block = bytearray(200 << 20)
        block[::4096] = b"\1" * len(block[::4096])   # touched: resident


def test_each_outcome_is_blamed_on_its_case(monkeypatch):
    plan = {"fake": Loader("fake", None, _target, lambda: None)}
    monkeypatch.setattr(worker, "draw_case", lambda loader, seed, index: PLAN[index])
    # budgets with room for a loaded machine: at 0.5 s CPU / 1.5 s wall a 200 MB touch ("peak") read "hang"
    pool = worker.Pool(plan, ["fake"], seed=0, jobs=1, timeout=1.0, wall_timeout=3.0, recycle=4)
    results = {}
    for r in pool.events(lambda: len(results) >= len(PLAN)):
        results[r.index] = r
    kinds = [results[i].kind for i in range(len(PLAN))]
    assert kinds == ["ok", "refused", "crash", "ok", "crash", "ok", "crash", "ok", "hang", "ok", "hang", "ok", "memory",
                     "ok", "memory", "ok", "crash", "ok"]
    assert "ZeroDivisionError" in results[2].detail
    assert "status 7" in results[4].detail and "SIGSEGV" in results[6].detail
    assert "Segmentation fault" in results[6].detail   # (faulthandler's report, Python stack included)
    assert "still running" in results[8].detail                                 # spun (over its CPU or wall budget)
    assert results[10].seconds >= 3.0 and results[10].cpu_seconds < 0.5         # slept: over its wall budget
    assert "MemoryError" in results[12].detail and "peak RSS" in results[14].detail
    assert all(results[i].peak_rss > 0 for i in range(len(PLAN)) if PLAN[i] in ("ok", "refused"))
    assert not pool.slots   # every worker ended


def test_the_ci_runner_blames_each_case_and_goes_on():
    """worker.Runner (CI: cases made by hypothesis in the parent, sent to a persistent worker) gives the same
    outcomes, each case's own, whatever the cases before it did; it also carries bytes, dicts and tuples."""
    runner = worker.Runner(_target, timeout=3.0, recycle=4)
    try:
        kinds = [runner.run(what).kind for what in PLAN]
        assert kinds == ["ok", "refused", "crash", "ok", "crash", "ok", "crash", "ok", "hang", "ok", "hang", "ok", "memory",
                         "ok", "memory", "ok", "crash", "ok"]
        echo = worker.Runner(lambda case: None if case == ({"a.bin": b"\0\xff", "@l": b"../x"}, None, 3) else 1 / 0)
        assert echo.run(({"a.bin": b"\0\xff", "@l": b"../x"}, None, 3)).kind == "ok"
        echo.close()
    finally:
        runner.close()
    assert runner.pid is None
