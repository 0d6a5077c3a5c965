"""The server's Prometheus metrics (prometheus_client, one registry per engine), for GET /metrics."""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

WINDOW_SECONDS = 10.0   # tokens/s is measured over this much recent time


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self._queue = Gauge("ingot_queue_depth", "Requests waiting for a slot", registry=r)
        self._running = Gauge("ingot_running_sequences", "Sequences holding a slot (prefill or decode)", registry=r)
        self._rate = Gauge("ingot_tokens_per_second", f"Generated tokens per second over the last {WINDOW_SECONDS:g} s",
                           registry=r)
        self._rate.set_function(self.tokens_per_second)
        self._generated = Counter("ingot_generated_tokens", "Tokens generated", registry=r)
        self._prompt = Counter("ingot_prompt_tokens", "Prompt tokens received", registry=r)
        self._reused = Counter("ingot_prefix_reused_tokens", "Prompt tokens whose K/V came from a cached prefix",
                               registry=r)
        self._mixed = Counter("ingot_prompt_tokens_in_decode_steps",
                              "Prompt tokens prefilled as rows of a decode step (a KV pool's mixed steps)", registry=r)
        self._ahead = Counter("ingot_decode_steps_ahead", "Decode steps launched from the step before's tokens on "
                              "the device, before the host read them (a KV pool's greedy steps)", registry=r)
        self._requests = Counter("ingot_requests", "Requests admitted to a slot", registry=r)
        self._cancelled = Counter("ingot_cancelled_requests", "Requests stopped because the client went away",
                                  registry=r)
        self._ttft = Histogram("ingot_time_to_first_token_seconds", "Arrival to first generated token", registry=r,
                               buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self._itl = Histogram("ingot_inter_token_seconds", "Time between a sequence's generated tokens", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self._step = Histogram("ingot_decode_step_seconds", "One decode step of the running batch", registry=r,
                               buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2))
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()

    def queue(self, n: int) -> None:
        self._queue.set(n)

    def running(self, n: int) -> None:
        self._running.set(n)

    def admitted(self, prompt: int, reused: int) -> None:
        self._requests.inc()
        self._prompt.inc(prompt)
        self._reused.inc(reused)

    def reused(self, tokens: int) -> None:
        """Prompt tokens found cached after admission (copied from a sequence admitted with it)."""
        self._reused.inc(tokens)

    def cancelled(self) -> None:
        self._cancelled.inc()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def step(self, rows: int, seconds: float, prompt_rows: int = 0, ahead: bool = False) -> None:
        self._step.observe(seconds)
        self._mixed.inc(prompt_rows)
        if ahead:
            self._ahead.inc()

    @property
    def steps_ahead(self) -> int:
        """Decode steps launched ahead so far (the counter's value)."""
        return int(self.registry.get_sample_value("ingot_decode_steps_ahead_total") or 0)

    @property
    def prompt_rows(self) -> int:
        """Prompt tokens prefilled in decode steps so far (the counter's value)."""
        return int(self.registry.get_sample_value("ingot_prompt_tokens_in_decode_steps_total") or 0)

    def tokens(self, n: int) -> None:
        self._generated.inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - WINDOW_SECONDS:
                self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - WINDOW_SECONDS:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / WINDOW_SECONDS

    def text(self) -> bytes:
        return generate_latest(self.registry)
