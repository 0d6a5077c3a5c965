"""ONNX's backend node test cases, all of them, through the public `ingot.from_onnx`.

Each case is a model, its inputs and the expected outputs, made by `onnx.backend.test.case.node`;
every case runs (about 12 s on one core) as `python -m ingot.importers.onnx_report` runs it, with the
case's own tolerances. Every case whose ops are all claimed (onnx_report.CLAIMED) must pass, and the
pass rate over all cases must not fall below the figure last measured.
"""
import pytest

pytest.importorskip("onnx")

from ingot.importers import onnx_report as report  # noqa: E402

PASS_FLOOR = 1749  # of 1,884 cases (onnx 1.23); raise it as the importer grows


@pytest.fixture(scope="module")
def results():
    return report.run()


def test_claimed_ops_have_cases(results):
    claimed = [r for r in results if report.claimed(r)]
    ops = set().union(*(r.ops for r in claimed))
    assert ops == set(report.CLAIMED), sorted(set(report.CLAIMED) - ops)
    assert len(claimed) > 900


def test_every_claimed_case_passes(results):
    bad = [f"{r.name}: {r.status}: {r.message[:200]}" for r in results if report.claimed(r) and r.status != "pass"]
    assert not bad, "\n".join(bad)


def test_pass_rate_over_all_cases(results):
    passed = sum(r.status == "pass" for r in results)
    assert len(results) >= 1884
    assert passed >= PASS_FLOOR, f"{passed}/{len(results)} node test cases pass, fewer than the {PASS_FLOOR} measured before"
