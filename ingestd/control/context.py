"""What slow commands share: the handler ``Context``, the ack wait, frame rates.

``Context.wait`` is how a command waits for workers: it re-reads their stats
blocks (shared memory, no messages) until each one has acknowledged, has
gone (a dead worker cannot acknowledge and is dropped from the wait), or the
deadline passes (``timeout``).
"""
from __future__ import annotations

import struct
import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ingestd.control.commands import Request
from ingestd.control.protocol import ErrorCode, Preencoded, RequestError

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


class RecordReader:
    """Reads workers' stats records with one ``struct`` unpack each (numpy's per-call overhead
    made up most of a status request). Relies on the record layout being plain words
    (``ingestd.collect.stats.RECORD``)."""

    SCALARS = ("state", "pid", "incarnation", "frames", "episodes", "restarts", "weights_version", "heartbeat",
               "returns_count", "pause_reason")

    def __init__(self, records: np.ndarray):
        dtype = records.dtype
        self._bytes = records.view(np.uint8)
        self._size = dtype.itemsize
        layout = sorted((dtype.fields[name][1], name, dtype.fields[name][0]) for name in self.SCALARS)
        codes = {("i", 8): "q", ("u", 8): "Q", ("f", 8): "d"}  # standard sizes ("=" mode)
        fmt, pos = "=", 0
        for offset, _, field_dtype in layout:
            fmt += f"{offset - pos}x{codes[field_dtype.kind, field_dtype.itemsize]}"
            pos = offset + field_dtype.itemsize
        self._scalars = struct.Struct(fmt)
        self._names = tuple(name for _, name, _ in layout)
        self._returns_at, self._ring = dtype.fields["returns"][1], dtype.fields["returns"][0].shape[0]
        self._error_at, self._error_len = dtype.fields["error"][1], dtype.fields["error"][0].itemsize
        self._double = struct.Struct("=d")

    def read(self, index: int) -> tuple[dict[str, Any], float | None, str]:
        """``(scalars, last return or None, error)`` of worker ``index``."""
        base = index * self._size
        values = dict(zip(self._names, self._scalars.unpack_from(self._bytes, base)))
        count = values["returns_count"]
        last = None
        if count:
            slot = (count - 1) % self._ring
            last = self._double.unpack_from(self._bytes, base + self._returns_at + 8 * slot)[0]
        start = base + self._error_at
        error = bytes(self._bytes[start:start + self._error_len]).rstrip(b"\0").decode("utf-8", "replace")
        return values, last, error



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
    profile_lock: threading.Lock = field(default_factory=threading.Lock)  # one profile request at a time
    _config_cache: tuple[int, dict, Preencoded] | None = None
    _record_reader: RecordReader | None = None

    def record_reader(self) -> RecordReader:
        """A fast reader of the workers' stats records, made on first use."""
        if self._record_reader is None:
            self._record_reader = RecordReader(self.daemon.layout.stats.records)
        return self._record_reader

    def deadline(self, request: Request) -> float:
        wait = request.wait_s or self.daemon.config.control.ack_timeout_s
        return time.monotonic() + wait

    def config_dict(self) -> dict:
        """The effective config as nested dicts (recomputed when a reload replaces it)."""
        return self._config()[1]

    def config_json(self) -> Preencoded:
        """The same, encoded once for the replies that carry it."""
        return self._config()[2]

    def _config(self) -> tuple[int, dict, Preencoded]:
        config = self.daemon.config
        cache = self._config_cache
        if cache is None or cache[0] != id(config):
            plain = config.to_dict()
            cache = self._config_cache = (id(config), plain, Preencoded(plain))
        return cache

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
