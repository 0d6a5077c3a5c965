"""Run one fuzz case in a forked child with an address-space limit and a timeout, and say how it ended.

    outcome = run_case(target, case)      # target(case) runs in the child
    outcome.kind                          # "ok" | "refused" (one IngotError) | "crash" | "hang" | "memory"

One fresh child per case: the way to replay a saved finding alone (CI and the long mode run many
cases per child, with these limits and classes: worker.py). The parent has imported everything
already, so a case that crashes, allocates what the input claims or loops forever costs
only its child. The child's address space is limited with resource.setrlimit(RLIMIT_AS): an
allocation past it raises MemoryError (classified "memory"), as it would on a machine without the
memory. A child still running after the timeout is killed ("hang"). A refusal must be exactly one
IngotError whose message is one line; any other exception is a "crash" with its traceback.
"""
from __future__ import annotations

import os
import resource
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

MEMORY_LIMIT = 2 << 30      # bytes of address space a case may use beyond what the parent maps
TIMEOUT = 10.0              # seconds a case may run


@dataclass
class Outcome:
    kind: str               # ok, refused, crash, hang, memory
    detail: str = ""        # the IngotError's message, or the traceback
    seconds: float = 0.0    # wall time
    cpu_seconds: float = 0.0  # the child's own CPU time (what a loaded machine does not inflate)

    @property
    def bug(self) -> bool:
        return self.kind in ("crash", "hang", "memory")


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child(target: Callable[[Any], Any], case: Any, write_fd: int, limit: int) -> None:
    """In the forked child: limit memory, run, report on the pipe, exit without cleanup."""
    from ingot.errors import IngotError

    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        budget = _address_space() + limit
        resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
        try:
            target(case)
            report = "ok\n"
        except IngotError as e:
            message = str(e)
            report = "refused\n" + message if "\n" not in message.strip() else "crash\nmulti-line IngotError: " + message
        except MemoryError:
            report = "memory\n" + traceback.format_exc(limit=-8)
        except RecursionError:
            report = "crash\n" + traceback.format_exc(limit=-8)
        except BaseException:  # noqa: BLE001 (anything else is a bug, PanicException included)
            report = "crash\n" + traceback.format_exc(limit=-12)
        data = report.encode("utf-8", "replace")[:65536]
        while data:
            data = data[os.write(write_fd, data):]
    except BaseException:  # noqa: BLE001 (even reporting failed, e.g. out of memory)
        code = 3
    finally:
        os._exit(code)


def run_case(target: Callable[[Any], Any], case: Any, timeout: float = TIMEOUT, limit: int = MEMORY_LIMIT) -> Outcome:
    """target(case) in a forked child; its Outcome."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        _child(target, case, write_fd, limit)
    os.close(write_fd)
    chunks = []
    deadline = start + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                _, _, usage = os.wait4(pid, 0)
                cpu = usage.ru_utime + usage.ru_stime
                return Outcome("hang", f"still running after {timeout} s ({cpu:.1f} s of CPU)", time.monotonic() - start, cpu)
            ready, _, _ = select.select([read_fd], [], [], left)
            if ready:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        _, status, usage = os.wait4(pid, 0)
    finally:
        os.close(read_fd)
    seconds = time.monotonic() - start
    cpu = usage.ru_utime + usage.ru_stime
    text = b"".join(chunks).decode("utf-8", "replace")
    kind, _, detail = text.partition("\n")
    if kind in ("ok", "refused", "crash", "memory"):
        return Outcome(kind, detail, seconds, cpu)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        # the kernel's answer to an allocation past the limit can be a SIGSEGV/SIGABRT in C code
        return Outcome("crash", f"killed by signal {signal.Signals(signum).name}", seconds, cpu)
    return Outcome("crash", f"exited with status {os.WEXITSTATUS(status)} without a report", seconds, cpu)
