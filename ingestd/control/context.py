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
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ingestd.collect.stats import pid_alive, seqlocked  # noqa: F401 - handlers import it from here
from ingestd.control.commands import Request
from ingestd.control.protocol import ErrorCode, Preencoded, RequestError

POLL_S = 0.0005  # how often a waiting command re-reads the stats blocks
LIVENESS_EVERY = 20  # polls between /proc liveness checks of the workers waited for
RATE_WINDOW_S = 5.0


_SEQ = struct.Struct("=q")  # a record's returns_seq word

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
    """Reads a worker's stats record with one ``struct`` unpack: its scalars, its ring of recent
    returns and its error (numpy's per-field and per-element overhead made up most of a status
    request). Relies on the record layout being plain words (``ingestd.collect.stats.RECORD``)."""

    SCALARS = ("state", "pid", "incarnation", "frames", "episodes", "restarts", "weights_version", "heartbeat",
               "returns_count", "pause_reason", "error_at")

    def __init__(self, records: np.ndarray):
        dtype = records.dtype
        self._bytes, self._size = records.view(np.uint8), dtype.itemsize
        self._ring = dtype.fields["returns"][0].shape[0]
        fields = sorted((dtype.fields[name][1], name, *_struct_code(dtype.fields[name][0]))
                        for name in (*self.SCALARS, "returns", "error"))
        fmt, pos, names = "=", 0, []
        for offset, name, code, items, size in fields:
            fmt += f"{offset - pos}x{code}"
            pos = offset + size
            names += [name] * items
        self._record = struct.Struct(fmt)
        self._scalars = tuple((name, i) for i, name in enumerate(names) if name in self.SCALARS)
        self._returns_at, self._error_at = names.index("returns"), names.index("error")
        self._seq_at = dtype.fields["returns_seq"][1]

    def read(self, index: int) -> tuple[dict[str, Any], list[float], str]:
        """``(scalars, recent returns oldest first, error)`` of worker ``index``."""
        at = index * self._size
        words, whole = seqlocked(lambda: _SEQ.unpack_from(self._bytes, at + self._seq_at)[0],
                                 lambda: self._record.unpack_from(self._bytes, at))
        values = {name: words[i] for name, i in self._scalars}
        count, ring = values["returns_count"], self._ring
        returns = words[self._returns_at:self._returns_at + ring]
        if not whole:  # its worker stopped inside the ring's write: no returns rather than mixed ones
            recent = []
        elif count < ring:
            recent = list(returns[:count])
        else:
            start = count % ring
            recent = list(returns[start:] + returns[:start])
        error = words[self._error_at].rstrip(b"\0").decode("utf-8", "replace")
        return values, recent, error


def _struct_code(field: np.dtype) -> tuple[str, int, int]:
    """``(struct code, values it unpacks to, bytes)`` of a plain record field."""
    if field.kind == "S":
        return f"{field.itemsize}s", 1, field.itemsize
    if field.subdtype is not None:
        base, shape = field.subdtype
        items = int(np.prod(shape))
        return f"{items}{_struct_code(base)[0]}", items, field.itemsize
    return {("i", 8): "q", ("u", 8): "Q", ("f", 8): "d"}[field.kind, field.itemsize], 1, field.itemsize


class ReplyCache:
    """One result, encoded once and reused for at most ``max_age_s`` (``status`` under load: a
    trainer or a dashboard polling it thousands of times a second gets the same bytes).

    The control thread, its only user, drops it (``invalidate``) whenever it sends anything that
    can follow a change: the reply of a command that is not read-only, or an event. So a client
    that has seen a change acknowledged never gets a result from before it; otherwise a result is
    at most ``max_age_s`` old."""

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_age_s, self._clock = max_age_s, clock
        self._value: Preencoded | None = None
        self._built_at = 0.0

    def get(self, build: Callable[[], Any]) -> Preencoded:
        """The cached result, or ``build()``'s, encoded, if there is none young enough."""
        now = self._clock()
        if self._value is None or now - self._built_at >= self.max_age_s:
            self._value, self._built_at = Preencoded(build()), now
        return self._value

    def invalidate(self) -> None:
        self._value = None


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
    snapshot_lock: threading.Lock = field(default_factory=threading.Lock)  # one snapshot at a time
    status_cache: ReplyCache = field(default_factory=lambda: ReplyCache(0.0))  # the control thread's (0: off)
    events_local: str | None = None  # the local ipc event socket bound beside a tcp:// events_address
    _config_cache: tuple[int, dict, Preencoded] | None = None
    _record_reader: RecordReader | None = None
    _metrics_url: str | None = None

    def record_reader(self) -> RecordReader:
        """A fast reader of the workers' stats records, made on first use."""
        if self._record_reader is None:
            self._record_reader = RecordReader(self.daemon.layout.stats.records)
        return self._record_reader

    def metrics_url(self) -> str | None:
        """The daemon's ``/metrics`` page as its exporter bound it (so also the port the kernel
        chose for ``metrics.port = 0``); None when metrics are off, or not serving yet."""
        if self._metrics_url is None and self.daemon.config.metrics.enabled:  # not reloadable
            from ingestd.metrics.exporter import MetricsExporter  # imported by the daemon already

            for service in self.daemon.services:
                if isinstance(service, MetricsExporter) and service.address is not None:
                    host, port = service.address
                    self._metrics_url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
        return self._metrics_url

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
        """Run ``fn`` in the daemon's main thread and return its result.

        Past the deadline a command the main loop has not taken is withdrawn (``timeout``: it
        was not run, so a retry is safe); one it already took is waited for, since saying it
        was not taken would make a retry run it twice (a second restart)."""
        future = self.daemon.submit(fn)
        while True:
            self._check_stopping()
            left = deadline - time.monotonic()
            # (waited for, then read: fn's own TimeoutError, a LockBusy, is no wait that ran out; taken
            # for one, it was re-raised forever, its traceback growing by a frame a pass)
            if wait_futures([future], timeout=min(0.05, left) if left > 0 else 0.05).done:  # taken late: wait on
                return future.result()
            if time.monotonic() >= deadline and future.cancel():
                raise RequestError(ErrorCode.TIMEOUT, "the daemon's main loop did not take the command "
                                                      "before the deadline (is it overloaded?); it was "
                                                      "not run") from None

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
