"""ONNX's backend node test cases for every op the importer claims (ingot.importers.onnx_report.CLAIMED).

Each case is a model, its inputs and the expected outputs, made by `onnx.backend.test.case.node`;
a case runs here when every op it uses is claimed, and must pass with ONNX's own tolerances
(rtol 1e-3, atol 1e-7). `python -m ingot.importers.onnx_report` prints the table over all cases.
"""
import pytest

pytest.importorskip("onnx")

from ingot.importers import onnx_report as report  # noqa: E402

CASES = [case for _, case in report.collect() if report.model_ops(case.model) <= report.CLAIMED]


def test_claimed_ops_have_cases():
    ops = set().union(*(report.model_ops(c.model) for c in CASES))
    assert ops == set(report.CLAIMED), sorted(set(report.CLAIMED) - ops)
    assert len(CASES) > 900


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_node_case(case):
    status, message = report.run_case(case)
    assert status == "pass", message
