"""CI's share of the fuzzing: CASES derandomized cases per loader (hypothesis, fixed seed, no
shrinking), each run by a persistent forked worker with an address-space limit and a timeout (worker.Runner:
harness.run_case's limits and outcome classes, without a ~50 ms fork per case). A case
may load or be refused with one IngotError; a crash, hang or memory blow-up fails the test with the
case. The long mode is `python -m tests.fuzz --minutes N`."""
from __future__ import annotations

import os
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .loaders import LOADERS  # noqa: E402
from .mutate import HypothesisDraw  # noqa: E402
from .worker import Runner  # noqa: E402

CASES = {"gguf": 200, "onnx": 200, "package": 200, "audio": 100, "template": 200, "viewer": 200}

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="the harness forks (Linux)")


@pytest.mark.parametrize("name", list(LOADERS))
def test_fuzz_loader(name):
    loader = LOADERS[name]
    loader.prepare()
    outcomes = []

    runner = Runner(loader.run)

    @settings(max_examples=CASES[name], derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one_case(data):
        case = loader.case(HypothesisDraw(data))
        outcome = runner.run(case)
        outcomes.append(outcome.kind)
        assert not outcome.bug, f"{name} case {case!r:.2000}\n{outcome.kind} after {outcome.seconds:.2f} s:\n{outcome.detail}"

    try:
        one_case()
    finally:
        runner.close()
    assert len(outcomes) == CASES[name]
    if name != "viewer":                       # (the viewer answers HTTP statuses, it raises nothing)
        assert outcomes.count("refused") > 0   # the mutations do reach the checks ...
    assert outcomes.count("ok") > 0            # ... and some inputs survive them
