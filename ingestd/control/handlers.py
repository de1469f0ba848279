"""What each command does: the ``{request type: handler}`` table.

Fast handlers (ping, status, config) read shared memory and run inline on
the control thread. Slow ones run on the server's small thread pool: they
change the supervisor through ``daemon.submit`` (the main thread owns it and
forks the workers) and then watch the per-worker stats blocks until every
live worker has acknowledged, or the deadline passes (``timeout``). Workers
that die meanwhile drop out of the wait; they are not waited for.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from ingestd.collect.stats import Desired, State
from ingestd.control.commands import (
    Acked, GetConfig, GetStatus, Pause, Ping, Pushed, PushWeights, Reload, Reloaded, ReplayStatus, Request,
    Restart, Resume, Scale, Status, WorkerStatus,
)
from ingestd.control.protocol import PROTOCOL_VERSION, ErrorCode, RequestError
from ingestd.errors import BadWeights, ConfigError

log = logging.getLogger("ingestd.control")

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
    on_reload: Callable[[], None] = lambda: None  # e.g. re-read the authorised CURVE keys
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


# -- fast handlers (control thread) ---------------------------------------------------
def ping(ctx: Context, request: Ping) -> dict:
    from ingestd import __version__

    return {"pong": True, "pid": os.getpid(), "version": __version__, "protocol": PROTOCOL_VERSION,
            "events_address": ctx.events_address, "time": time.time()}


def _worker_status(ctx: Context, index: int, now: float) -> WorkerStatus:
    stats = ctx.daemon.layout.stats
    rec = stats[index]
    pid = int(rec["pid"])
    count = int(rec["returns_count"])
    last = stats.recent_returns(index, 1)[0][0] if count else None
    alive = pid > 0 and State(int(rec["state"])) not in (State.STOPPED, State.FAILED, State.EMPTY)
    return WorkerStatus(
        index=index, state=State(int(rec["state"])).label, pid=pid, incarnation=int(rec["incarnation"]),
        frames=int(rec["frames"]), frames_per_s=round(ctx.rates.rate(index), 1), episodes=int(rec["episodes"]),
        last_return=last, restarts=int(rec["restarts"]), weights_version=int(rec["weights_version"]),
        heartbeat_age_s=round(now - float(rec["heartbeat"]), 4) if alive else None, error=stats.error(index))


def status(ctx: Context, request: GetStatus) -> dict:
    daemon = ctx.daemon
    storage, weights, sup = daemon.layout.storage, daemon.layout.weights, daemon.supervisor
    now = time.monotonic()
    write_count = storage.write_count
    return Status(
        pid=os.getpid(), uptime_s=round(time.time() - daemon.started_at, 3), desired=Desired(sup.desired).name.lower(),
        count=sup.count, weights_version=weights.version if weights is not None else 0,
        replay=ReplayStatus(str(storage.path), min(write_count, storage.capacity), storage.capacity, write_count),
        workers=[_worker_status(ctx, i, now) for i in ctx.slots()], config=ctx.config_dict()).to_json()


def get_config(ctx: Context, request: GetConfig) -> dict:
    return ctx.config_dict()


# -- slow handlers (thread pool) ---------------------------------------------------------
_DESIRED_STATE = {Desired.PAUSE: (State.PAUSED, "paused", "pause"), Desired.RUN: (State.RUNNING, "resumed", "resume")}


def _set_desired(ctx: Context, desired: Desired, deadline: float) -> dict[int, int]:
    """Tell the workers; return ``{index: pid}`` of the live ones that must acknowledge.

    The stats words of workers that are collecting or paused are written here
    directly, so the workers see the change at once; the main thread then
    makes it authoritative (supervisor state, new workers) and re-asserts
    ``stop`` for workers on their way out, in case this write raced with it.
    """
    daemon = ctx.daemon
    stats = daemon.layout.stats
    for index in ctx.slots():
        rec = stats[index]
        if int(rec["desired"]) in (Desired.RUN, Desired.PAUSE):
            rec["desired"] = desired

    def authoritative() -> dict[int, int]:
        daemon.set_desired(desired)
        for index, slot in daemon.supervisor.slots.items():
            if slot.retiring or slot.restarting:
                stats[index]["desired"] = Desired.STOP
        return {i: int(stats[i]["pid"]) for i in daemon.supervisor.live()
                if not (daemon.supervisor.slots[i].restarting or stats.state(i) == State.FAILED)}

    return ctx.on_main(authoritative, deadline)


def _change_desired(ctx: Context, request: Request, desired: Desired) -> dict:
    started = time.monotonic()
    deadline = ctx.deadline(request)
    target, event, verb = _DESIRED_STATE[desired]
    if not ctx.change_lock.acquire(timeout=max(0.0, deadline - started)):
        raise RequestError(ErrorCode.TIMEOUT, "another pause/resume/restart/scale/reload kept the daemon busy")
    try:
        pending = _set_desired(ctx, desired, deadline)

        def verdict(index: int, pid: int, rec) -> bool | None:
            if int(rec["pid"]) != pid or int(rec["state"]) in (State.FAILED, State.STOPPED, State.STOPPING):
                return False
            return True if int(rec["state"]) == target else None

        acked, _ = ctx.wait(pending, verdict, deadline, f"acknowledge {verb}")
    finally:
        ctx.change_lock.release()
    seconds = time.monotonic() - started
    ctx.publish(event, workers=acked, seconds=round(seconds, 6))
    return Acked(acked, round(seconds, 6)).to_json()


def pause(ctx: Context, request: Pause) -> dict:
    return _change_desired(ctx, request, Desired.PAUSE)


def resume(ctx: Context, request: Resume) -> dict:
    return _change_desired(ctx, request, Desired.RUN)


def _started_again(index: int, old_pid: int, rec) -> bool | None:
    """Verdict for a worker that must come (back) up as a new process."""
    state = int(rec["state"])
    if state == State.FAILED:
        return False
    pid = int(rec["pid"])
    return True if pid not in (0, old_pid) and state in (State.RUNNING, State.PAUSED) else None


def _gone(index: int, pid: int, rec) -> bool | None:
    """Verdict for a retired worker: done once the supervisor has reaped it and freed its slot."""
    return True if int(rec["state"]) == State.EMPTY else None


def _locked_change(ctx: Context, request: Request, change: Callable[[], Any], what: str) -> tuple[Any, float]:
    started = time.monotonic()
    deadline = ctx.deadline(request)
    if not ctx.change_lock.acquire(timeout=max(0.0, deadline - started)):
        raise RequestError(ErrorCode.TIMEOUT, f"another command kept the daemon busy; {what} was not started")
    try:
        return change(deadline), started
    finally:
        ctx.change_lock.release()


def restart(ctx: Context, request: Restart) -> dict:
    daemon = ctx.daemon
    stats = daemon.layout.stats

    def change(deadline: float) -> list[int]:
        def go() -> dict[int, int]:
            chosen = daemon.supervisor.restart(list(request.workers) if request.workers else None)
            return {i: int(stats[i]["pid"]) for i in chosen}

        try:
            old = ctx.on_main(go, deadline)
        except KeyError as exc:
            raise RequestError(ErrorCode.NO_SUCH_WORKER, str(exc.args[0]) if exc.args else str(exc)) from None
        if not request.wait:
            return sorted(old)
        return ctx.wait(old, _started_again, deadline, "come back up", drop_dead=False)[0]

    workers, started = _locked_change(ctx, request, change, "the restart")
    return Acked(workers, round(time.monotonic() - started, 6)).to_json()


def scale(ctx: Context, request: Scale) -> dict:
    daemon = ctx.daemon
    stats = daemon.layout.stats

    def change(deadline: float) -> list[int]:
        def go() -> tuple[dict[int, int], dict[int, int]]:
            sup = daemon.supervisor
            before = {i: int(stats[i]["pid"]) for i in sup.live()}
            sup.scale(request.count)
            fresh = {i: int(stats[i]["pid"]) for i, s in sup.slots.items() if not s.retiring and i not in before}
            leaving = {i: 0 for i, s in sup.slots.items() if s.retiring}
            return fresh, leaving

        try:
            fresh, leaving = ctx.on_main(go, deadline)
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
        if request.wait:
            ctx.wait(fresh, _started_again, deadline, "start", drop_dead=False)
            ctx.wait(leaving, _gone, deadline, "stop", drop_dead=False)
        return list(range(request.count))

    workers, started = _locked_change(ctx, request, change, "the scale")
    return Acked(workers, round(time.monotonic() - started, 6)).to_json()


def push_weights(ctx: Context, request: PushWeights) -> dict:
    from ingestd.weights.wire import decode

    started = time.monotonic()
    deadline = ctx.deadline(request)
    layout = ctx.daemon.layout
    if layout.weights is None or layout.manifest is None:
        raise RequestError(ErrorCode.NO_WEIGHTS, "the configured policy has no weights to replace")
    try:
        state = decode(request.frames, expected=layout.manifest, max_raw_bytes=layout.manifest.total_bytes)
        with ctx.push_lock:
            version = layout.weights.publish(state)
    except BadWeights as exc:
        raise RequestError(ErrorCode.BAD_WEIGHTS, f"{exc}; nothing was changed") from None
    del state
    ctx.publish("weights.published", version=version)
    applied: list[int] = []
    deferred: list[int] = []
    if request.wait:
        stats = layout.stats
        pending = {i: int(stats[i]["pid"]) for i in ctx.slots()
                   if int(stats[i]["state"]) in (State.STARTING, State.RUNNING) and pid_alive(int(stats[i]["pid"]))}

        def verdict(index: int, pid: int, rec) -> bool | None:
            if int(rec["pid"]) != pid or int(rec["state"]) in (State.FAILED, State.STOPPED, State.STOPPING):
                return False
            if int(rec["weights_version"]) >= version:
                return True
            if int(rec["state"]) == State.PAUSED:
                deferred.append(index)
                return False
            return None

        applied, _ = ctx.wait(pending, verdict, deadline, f"apply weights version {version}")
    seconds = time.monotonic() - started
    ctx.daemon.telemetry.observe_push(seconds)
    return Pushed(version, applied, sorted(deferred), round(seconds, 6)).to_json()


def reload(ctx: Context, request: Reload) -> dict:
    def change(deadline: float) -> dict:
        try:
            return ctx.on_main(ctx.daemon.reload, deadline)
        except ConfigError as exc:
            raise RequestError(ErrorCode.RELOAD_FAILED, f"{exc}; the running config was kept") from None

    result, _ = _locked_change(ctx, request, change, "the reload")
    ctx.on_reload()
    return Reloaded(list(result["applied"]), list(result["not_applied"])).to_json()


@dataclass(frozen=True)
class Handler:
    run: Callable[[Context, Any], Any]
    fast: bool  # answered on the control thread (reads shared memory only)


HANDLERS: dict[type[Request], Handler] = {
    Ping: Handler(ping, fast=True),
    GetStatus: Handler(status, fast=True),
    GetConfig: Handler(get_config, fast=True),
    Pause: Handler(pause, fast=False),
    Resume: Handler(resume, fast=False),
    Restart: Handler(restart, fast=False),
    Scale: Handler(scale, fast=False),
    PushWeights: Handler(push_weights, fast=False),
    Reload: Handler(reload, fast=False),
}
