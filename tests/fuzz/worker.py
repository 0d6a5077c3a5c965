"""The long mode's engine: persistent workers that run many cases each, so that a case costs what its
loader costs rather than a fork of a large process (~50 ms here, more than most cases).

    pool = Pool(names, seed=5, jobs=1)
    for event in pool.events(stop):    # Result(loader, index, kind, detail, seconds, cpu_seconds, peak_rss)
        ...

A worker is forked from the parent once the parent has imported everything and built every loader's
seeds; it limits its own address space (RLIMIT_AS, as harness.py does for one case), then loops: case
number `index` of loader `names[(index // jobs) % len(names)]` is drawn from random.Random(f"{seed}:{index}")
(so the parent can draw it again to save it), announced on a pipe before it runs, run, and answered
with its outcome, its wall and CPU time and the peak RSS it reached (VmHWM, reset before each case by
writing 5 to /proc/self/clear_refs). Outcomes are harness.py's: ok, refused (one IngotError, one line),
crash (any other exception, or the worker died: a signal, os._exit, an error escaping the loop),
memory (MemoryError, or a peak RSS over PEAK_RSS), hang (the case used more than `timeout` seconds
of CPU, or more than `wall_timeout` seconds of wall time: under a loaded, niced machine wall time is
not the case's own). Because the parent was told which case started, a worker that dies or goes
silent is blamed on exactly that case; it is killed if need be and a fresh worker forked, which goes
on with the next case. A worker also retires after a bug, after `recycle` cases or when its RSS has
grown by RSS_GROWTH, so that no state leaks from one case into many others.
"""
from __future__ import annotations

import base64
import faulthandler
import json
import os
import random
import resource
import select
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from .harness import MEMORY_LIMIT, Outcome, _address_space
from .mutate import RandomDraw

PEAK_RSS = 2 << 30      # a case whose process peaks above this many bytes of RSS is a "memory" bug
RSS_GROWTH = 1 << 30    # a worker whose RSS grew this much since its fork retires
_CLOCK_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Result(Outcome):
    loader: str = ""
    index: int = 0
    peak_rss: int = 0       # bytes (0 when the worker died before it could say)


def draw_case(loader, seed: int, index: int):
    """Case `index` of a run with `seed`: the same in the worker that runs it and the parent that saves it."""
    return loader.case(RandomDraw(random.Random(f"{seed}:{index}")))


def loader_of(names: list[str], jobs: int, index: int) -> str:
    return names[(index // jobs) % len(names)]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _cpu_of(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _fault_file(pid: int):
    from .loaders import SCRATCH
    SCRATCH.mkdir(parents=True, exist_ok=True)
    return SCRATCH / f"fault-{pid}.txt"


def _run_one(target, case) -> tuple[str, str]:
    from ingot.errors import IngotError
    try:
        target(case)
        return "ok", ""
    except IngotError as e:
        message = str(e)
        if "\n" in message.strip():
            return "crash", "multi-line IngotError: " + message
        return "refused", message
    except MemoryError:
        return "memory", traceback.format_exc(limit=-8)
    except BaseException:  # noqa: BLE001 (anything else is a bug, PanicException and RecursionError included)
        return "crash", traceback.format_exc(limit=-12)


def _worker(loaders: dict, names: list[str], seed: int, jobs: int, first: int, recycle: int,
            write_fd: int, limit: int) -> None:
    """In the forked worker: limit memory, run cases first, first + jobs, ..., report each on the pipe."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        faulthandler.enable(open(_fault_file(os.getpid()), "w"))   # a fatal signal's Python traceback, for the parent
        budget = _address_space() + limit
        resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
        start_rss = _status_kib("VmRSS:") << 10

        def send(message: dict) -> None:
            data = (json.dumps(message) + "\n").encode("utf-8", "replace")
            while data:
                data = data[os.write(write_fd, data):]

        index = first
        for _ in range(recycle):
            name = loader_of(names, jobs, index)
            send({"start": index, "cpu": time.process_time()})
            _reset_peak()
            wall, cpu = time.monotonic(), time.process_time()
            try:
                case = draw_case(loaders[name], seed, index)
            except Exception:  # a mutator that cannot make this case: counted, not run
                send({"index": index, "kind": "unmade"})
                index += jobs
                continue
            kind, detail = _run_one(loaders[name].run, case)
            peak = _status_kib("VmHWM:") << 10
            if kind in ("ok", "refused") and peak > PEAK_RSS:
                kind, detail = "memory", f"peak RSS {peak / 2**30:.2f} GiB (over {PEAK_RSS / 2**30:.0f} GiB)"
            send({"index": index, "kind": kind, "detail": detail[-65536:] if kind not in ("ok", "refused") else detail[:300],
                  "seconds": time.monotonic() - wall, "cpu": time.process_time() - cpu, "peak": peak})
            index += jobs
            if kind not in ("ok", "refused") or (_status_kib("VmRSS:") << 10) - start_rss > RSS_GROWTH:
                break
    except BaseException:  # noqa: BLE001 (even reporting failed, e.g. out of memory: the parent blames the case)
        code = 3
    finally:
        os._exit(code)


class _Slot:
    """One worker: its pid, pipe, what it has said so far and the case it is running."""

    def __init__(self, pid: int, fd: int, next_index: int):
        self.pid, self.fd = pid, fd
        self.buffer = b""
        self.next_index = next_index     # the case it will run next (or is running)
        self.running: int | None = None  # the case announced and not answered yet
        self.wall = 0.0                  # when it was announced (parent's clock)
        self.cpu = 0.0                   # the worker's CPU time then
        self.fault = ""                  # what faulthandler wrote when it died


class Pool:
    """`jobs` persistent workers over `names` (LOADERS prepared in this process already)."""

    def __init__(self, loaders: dict, names: list[str], seed: int = 0, jobs: int = 1, timeout: float = 10.0,
                 wall_timeout: float | None = None, limit: int = MEMORY_LIMIT, recycle: int = 2000):
        self.loaders, self.names, self.seed, self.jobs = loaders, names, seed, jobs
        self.timeout, self.limit, self.recycle = timeout, limit, recycle
        self.wall_timeout = wall_timeout if wall_timeout is not None else 6 * timeout
        self.slots: list[_Slot] = []
        self.forks = 0

    def _fork(self, first: int) -> _Slot:
        sys.stdout.flush()
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_fd)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
            finally:
                _worker(self.loaders, self.names, self.seed, self.jobs, first, self.recycle, write_fd, self.limit)
        os.close(write_fd)
        self.forks += 1
        return _Slot(pid, read_fd, first)

    def _reap(self, slot: _Slot, kill: bool) -> tuple[int, float]:
        """Wait for (or kill) the worker, close its pipe, remove its scratch folder: (wait status, its CPU seconds)."""
        from .loaders import SCRATCH
        if kill:
            try:
                os.kill(slot.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status, usage = os.wait4(slot.pid, 0)
        os.close(slot.fd)
        shutil.rmtree(SCRATCH / str(slot.pid), ignore_errors=True)
        try:
            slot.fault = _fault_file(slot.pid).read_text(errors="replace").split("\nExtension modules:")[0][-6000:]
            _fault_file(slot.pid).unlink()
        except OSError:
            slot.fault = ""
        return status, usage.ru_utime + usage.ru_stime

    def _result(self, index: int, kind: str, detail: str = "", seconds: float = 0.0, cpu: float = 0.0,
                peak: int = 0) -> Result:
        return Result(kind, detail, seconds, cpu, loader=loader_of(self.names, self.jobs, index), index=index, peak_rss=peak)

    def events(self, stop):
        """Yield a Result per case until stop() is true (checked between cases), then end every worker."""
        self.slots = [self._fork(j) for j in range(self.jobs)]
        try:
            while self.slots:
                ready, _, _ = select.select([s.fd for s in self.slots], [], [], 1.0)
                now = time.monotonic()
                for slot in list(self.slots):
                    if slot.fd in ready:
                        chunk = os.read(slot.fd, 1 << 16)
                        if chunk:
                            slot.buffer += chunk
                            *lines, slot.buffer = slot.buffer.split(b"\n")
                            for line in lines:
                                message = json.loads(line)
                                if "start" in message:
                                    slot.running, slot.wall, slot.cpu = message["start"], now, message["cpu"]
                                    continue
                                slot.running = None
                                slot.next_index = message["index"] + self.jobs
                                yield self._result(message["index"], message["kind"], message.get("detail", ""),
                                                   message.get("seconds", 0.0), message.get("cpu", 0.0),
                                                   message.get("peak", 0))
                            continue
                        # the worker is gone: retired (nothing running) or died in a case
                        status, _ = self._reap(slot, kill=False)
                        if slot.running is not None:
                            if os.WIFSIGNALED(status):
                                how = f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
                            else:
                                how = f"exited with status {os.WEXITSTATUS(status)} without a report"
                            yield self._result(slot.running, "crash", f"{slot.fault}\nthe worker {how}", now - slot.wall)
                            slot.next_index = slot.running + self.jobs
                        self._replace(slot, stop)
                    elif slot.running is not None and now - slot.wall > min(self.timeout, self.wall_timeout):
                        cpu = _cpu_of(slot.pid) - slot.cpu
                        if cpu > self.timeout or now - slot.wall > self.wall_timeout:
                            self._reap(slot, kill=True)
                            yield self._result(slot.running, "hang", f"still running after {now - slot.wall:.1f} s "
                                               f"({cpu:.1f} s of CPU)", now - slot.wall, cpu)
                            slot.next_index = slot.running + self.jobs
                            self._replace(slot, stop)
                if stop():
                    break
        finally:
            for slot in self.slots:
                self._reap(slot, kill=True)
            self.slots = []

    def _replace(self, slot: _Slot, stop) -> None:
        self.slots.remove(slot)
        if not stop():
            self.slots.append(self._fork(slot.next_index))


# -- CI: cases made by hypothesis in the parent, run by one persistent worker --------------------------

def _encode(value):
    """A case (bytes, str, int, None, and dicts and tuples of them) as JSON-able data."""
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict):
        return {"d": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, (tuple, list)):
        return {"t": [_encode(v) for v in value]}
    if value is None or isinstance(value, (str, int, float)):
        return {"v": value}
    raise TypeError(f"a case holds a {type(value).__name__}")


def _decode(data):
    (kind, value), = data.items()
    if kind == "b":
        return base64.b64decode(value)
    if kind == "d":
        return {k: _decode(v) for k, v in value.items()}
    if kind == "t":
        return tuple(_decode(v) for v in value)
    return value


def _read_exactly(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return b""
        out += chunk
    return out


def _serve(target, read_fd: int, write_fd: int, limit: int, recycle: int) -> None:
    """In the forked worker: run each case the parent sends (8-byte length, JSON) and answer as _worker does."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        faulthandler.enable(open(_fault_file(os.getpid()), "w"))
        budget = _address_space() + limit
        resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
        for _ in range(recycle):
            header = _read_exactly(read_fd, 8)
            if not header:
                break
            case = _decode(json.loads(_read_exactly(read_fd, int.from_bytes(header, "little"))))
            _reset_peak()
            wall, cpu = time.monotonic(), time.process_time()
            kind, detail = _run_one(target, case)
            peak = _status_kib("VmHWM:") << 10
            if kind in ("ok", "refused") and peak > PEAK_RSS:
                kind, detail = "memory", f"peak RSS {peak / 2**30:.2f} GiB (over {PEAK_RSS / 2**30:.0f} GiB)"
            data = (json.dumps({"kind": kind, "detail": detail[-65536:], "seconds": time.monotonic() - wall,
                                "cpu": time.process_time() - cpu, "peak": peak}) + "\n").encode("utf-8", "replace")
            while data:
                data = data[os.write(write_fd, data):]
            if kind not in ("ok", "refused"):
                break
    except BaseException:  # noqa: BLE001
        code = 3
    finally:
        os._exit(code)


class Runner:
    """harness.run_case without a fork per case: `Runner(target).run(case)` sends the case to a persistent
    worker (forked on first use, again after a bug or `recycle` cases) and returns its Outcome. The same
    limits and classes as run_case: an address-space limit, a wall-clock timeout (hang), a death (crash),
    MemoryError or a peak RSS over PEAK_RSS (memory); a worker that fails is replaced."""

    def __init__(self, target, timeout: float = 10.0, limit: int = MEMORY_LIMIT, recycle: int = 500):
        self.target, self.timeout, self.limit, self.recycle = target, timeout, limit, recycle
        self.pid: int | None = None
        self.done = 0

    def _fork(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        case_read, self.case_fd = os.pipe()
        self.result_fd, result_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(self.case_fd)
                os.close(self.result_fd)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
            finally:
                _serve(self.target, case_read, result_write, self.limit, self.recycle)
        os.close(case_read)
        os.close(result_write)
        self.pid, self.done, self.buffer = pid, 0, b""

    def close(self, kill: bool = True) -> tuple[int, str]:
        """End the worker: (its wait status, what faulthandler wrote)."""
        if self.pid is None:
            return 0, ""
        from .loaders import SCRATCH
        os.close(self.case_fd)
        if kill:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.result_fd)
        shutil.rmtree(SCRATCH / str(self.pid), ignore_errors=True)
        try:
            fault = _fault_file(self.pid).read_text(errors="replace").split("\nExtension modules:")[0][-6000:]
            _fault_file(self.pid).unlink()
        except OSError:
            fault = ""
        self.pid = None
        return status, fault

    def run(self, case) -> Outcome:
        if self.pid is None:
            self._fork()
        data = json.dumps(_encode(case)).encode()
        start = time.monotonic()
        try:
            view = memoryview(len(data).to_bytes(8, "little") + data)
            while view:
                view = view[os.write(self.case_fd, view):]
        except BrokenPipeError:   # (it died before reading: judged below by its exit)
            pass
        while b"\n" not in self.buffer:
            left = start + self.timeout - time.monotonic()
            ready, _, _ = select.select([self.result_fd], [], [], max(left, 0))
            if not ready:
                cpu = _cpu_of(self.pid)
                self.close()
                return Outcome("hang", f"still running after {self.timeout} s ({cpu:.1f} s of CPU in its worker)",
                               time.monotonic() - start, cpu)
            chunk = os.read(self.result_fd, 1 << 16)
            if not chunk:
                status, fault = self.close(kill=False)
                if os.WIFSIGNALED(status):
                    how = f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
                else:
                    how = f"exited with status {os.WEXITSTATUS(status)} without a report"
                return Outcome("crash", f"{fault}\nthe worker {how}", time.monotonic() - start)
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        message = json.loads(line)
        self.done += 1
        outcome = Outcome(message["kind"], message["detail"], message["seconds"], message["cpu"])
        if outcome.bug or self.done >= self.recycle:   # the worker leaves after a bug, or after `recycle` cases
            self.close(kill=False)
        return outcome
