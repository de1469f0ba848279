"""What slow commands share: the handler ``Context``, the ack wait, frame rates.

``Context.wait`` is how a command waits for workers: it re-reads their stats
blocks (shared memory, no messages) until each one has acknowledged, has
gone (a dead worker cannot acknowledge and is dropped from the wait), or the
deadline passes (``timeout``).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from ingestd.control.commands import Request
from ingestd.control.protocol import ErrorCode, RequestError

POLL_S = 0.0005  # how often a waiting command re-reads the stats blocks
LIVENESS_EVERY = 20  # polls between /proc liveness checks of the workers waited for
RATE_WINDOW_S = 5.0


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a dead, unreaped worker is not live)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class FrameRates:
    """frames/s per worker over a sliding window; sampled by the control thread only."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._samples: dict[int, deque[tuple[float, int]]] = {}

    def sample(self, now: float, frames: dict[int, int]) -> None:
        for index in list(self._samples):
            if index not in frames:
                del self._samples[index]
        for index, count in frames.items():
            ring = self._samples.setdefault(index, deque())
            if ring and count < ring[-1][1]:
                ring.clear()
            ring.append((now, count))
            while len(ring) > 2 and now - ring[1][0] >= self.window_s:
                ring.popleft()

    def rate(self, index: int) -> float:
        ring = self._samples.get(index)
        if not ring or len(ring) < 2 or ring[-1][0] <= ring[0][0]:
            return 0.0
        (t0, f0), (t1, f1) = ring[0], ring[-1]
        return (f1 - f0) / (t1 - t0)


@dataclass
class Context:
    """What handlers get: the daemon, and the server's thread-safe helpers."""

    daemon: Any  # ingestd.service.daemon.Daemon
    events_address: str
    publish: Callable[..., None]  # publish(kind, **fields): thread-safe, best-effort
    rates: FrameRates = field(default_factory=FrameRates)
    stopping: threading.Event = field(default_factory=threading.Event)
    change_lock: threading.Lock = field(default_factory=threading.Lock)  # pause/resume/restart/scale/reload
    push_lock: threading.Lock = field(default_factory=threading.Lock)  # one publisher of the weight store
    _config_cache: tuple[int, dict] | None = None

    def deadline(self, request: Request) -> float:
        wait = request.wait_s or self.daemon.config.control.ack_timeout_s
        return time.monotonic() + wait

    def config_dict(self) -> dict:
        config = self.daemon.config
        if self._config_cache is None or self._config_cache[0] != id(config):
            self._config_cache = (id(config), config.to_dict())
        return self._config_cache[1]

    def on_main(self, fn: Callable[[], Any], deadline: float) -> Any:
        """Run ``fn`` in the daemon's main thread and return its result."""
        future = self.daemon.submit(fn)
        while True:
            self._check_stopping()
            try:
                return future.result(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                if time.monotonic() >= deadline:
                    future.cancel()
                    raise RequestError(ErrorCode.TIMEOUT, "the daemon's main loop did not take the command "
                                                          "before the deadline (is it overloaded?)") from None

    def _check_stopping(self) -> None:
        if self.stopping.is_set():
            raise RequestError(ErrorCode.UNAVAILABLE, "the daemon is shutting down")

    def slots(self) -> list[int]:
        """Worker indices the supervisor manages (a snapshot; the main thread owns the dict)."""
        for _ in range(10):
            try:
                return sorted(self.daemon.supervisor.slots)
            except RuntimeError:  # changed size during iteration
                continue
        return []

    def wait(self, pending: dict[int, int], verdict: Callable[[int, int, Any], bool | None], deadline: float,
             what: str, drop_dead: bool = True) -> tuple[list[int], list[int]]:
        """Poll until ``verdict(index, pid, record)`` is True (done) or False (dropped) for every
        pending worker (``{index: pid}``); ``(done, dropped)`` or ``timeout``. With ``drop_dead``
        a worker whose process ``pid`` has died is dropped (it cannot acknowledge any more)."""
        stats, done, dropped, polls = self.daemon.layout.stats, [], [], 0
        while pending:
            for index, pid in list(pending.items()):
                outcome = verdict(index, pid, stats[index])
                if outcome is None and drop_dead and polls % LIVENESS_EVERY == 0 and pid and not pid_alive(pid) \
                        and int(stats[index]["pid"]) == pid:
                    outcome = False  # the process waited for is gone
                if outcome is not None:
                    (done if outcome else dropped).append(index)
                    del pending[index]
            if not pending:
                break
            self._check_stopping()
            if time.monotonic() >= deadline:
                raise RequestError(ErrorCode.TIMEOUT, f"worker(s) {sorted(pending)} did not {what} before the "
                                                      "deadline; the request stays in effect")
            polls += 1
            time.sleep(POLL_S)
        return sorted(done), sorted(dropped)
