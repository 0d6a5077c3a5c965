"""pytest plugin for lent-GPU runs: each failure's node id and traceback written to $OUT/failures.log the
moment it is reported (with xdist, on the controller), so a run stopped at its time limit still says
what failed and why. `PYTHONPATH=benchmarks/lab:. python3 -m pytest -p failure_log ...`"""
import os
import time

_PATH = os.path.join(os.environ.get("OUT", "/tmp"), "failures.log")
_START = time.time()


def pytest_runtest_logreport(report):
    if report.failed:
        with open(_PATH, "a") as f:
            f.write(f"==== {time.time() - _START:6.1f} s {report.when} FAILED {report.nodeid}\n"
                    f"{report.longreprtext[-6000:]}\n")
    elif report.when == "call" and report.passed:
        with open(_PATH.replace("failures", "passed"), "a") as f:
            f.write(f"{report.nodeid} {report.duration:.1f}\n")
