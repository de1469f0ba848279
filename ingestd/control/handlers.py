"""What each command does: the ``{request type: handler}`` table.

Fast handlers (ping, status, config) read shared memory and run inline on
the control thread. Slow ones run on the server's small thread pool: they
change the supervisor through ``daemon.submit`` (the main thread owns it and
forks the workers) and then watch the per-worker stats blocks until every
live worker has acknowledged, or the deadline passes (``timeout``). Workers
that die meanwhile drop out of the wait; they are not waited for. The replay-side
commands (limiter, snapshot) are in ``ingestd.control.replay_handlers``.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ingestd import __version__
from ingestd.collect.stats import NOT_LIVE, Desired, PauseReason, State, heartbeat_age, shown_reason
from ingestd.control.commands import (
    Acked, GetConfig, GetStatus, Pause, Ping, Pong, Profile, Profiled, Pushed, PushWeights, Reload, Reloaded,
    ReplayStatus, Request, Restart, Resume, Scale, SetLimiter, Snapshot, Status, WorkerStatus,
)
from ingestd.control.addresses import host_identity
from ingestd.control.context import Context, pid_alive
from ingestd.control.replay_handlers import limiter, snapshot
from ingestd.control.protocol import PROTOCOL_VERSION, ErrorCode, Preencoded, RequestError
from ingestd.errors import BadWeights, ConfigError, LockBusy

log = logging.getLogger("ingestd.control")


# -- fast handlers (control thread) ---------------------------------------------------
def ping(ctx: Context, request: Ping) -> dict:
    return Pong(True, os.getpid(), __version__, PROTOCOL_VERSION, ctx.events_address, time.time(),
                ctx.metrics_url(), ctx.daemon.config.control.max_message_bytes,  # control: not reloadable
                ctx.events_local, host_identity()).to_json()


def _workers_status(ctx: Context, indices: list[int], now: float) -> list[WorkerStatus]:
    """Every worker's status, read straight from the shared stats records."""
    reader = ctx.record_reader()
    wall = time.time()
    out = []
    for index in indices:
        rec, recent, error = reader.read(index)
        state, pid = State(rec["state"]), rec["pid"]
        out.append(WorkerStatus(
            index=index, state=state.label, pid=pid, incarnation=rec["incarnation"], frames=rec["frames"],
            # the rate over the last seconds, for a worker collecting now: a paused, starting or failed one
            # showed what it did before (user review: two paused workers at 15k frames/s)
            frames_per_s=round(ctx.rates.rate(index), 1) if state == State.RUNNING else 0.0, episodes=rec["episodes"],
            last_return=recent[-1] if recent else None, restarts=rec["restarts"],
            weights_version=rec["weights_version"],
            heartbeat_age_s=None if (age := heartbeat_age(rec, now)) is None else round(age, 4),
            error=error, pause_reason=_pause_reason(state, PauseReason(rec["pause_reason"])),
            recent_returns=recent,
            error_age_s=round(max(wall - rec["error_at"], 0.0), 1) if error and rec["error_at"] else None))
    return out


def _pause_reason(state: State, reason: PauseReason) -> str:
    """Why a worker is not collecting: a paused one's reason, or for a running one ``limiter``
    (the rate limiter holds it back) or ``priority_lock`` (a trainer holds the lock its commit
    needs) (docs/protocol.md, "status")."""
    shown = shown_reason(state, reason)
    return PauseReason(shown).label if shown else ""


def status(ctx: Context, request: GetStatus) -> Preencoded:
    """Built at most once per ``ctx.status_cache.max_age_s`` (docs/protocol.md, "status")."""
    return ctx.status_cache.get(lambda: _status(ctx))


def _status(ctx: Context) -> dict:
    daemon = ctx.daemon
    storage, weights, sup = daemon.layout.storage, daemon.layout.weights, daemon.supervisor
    now = time.monotonic()
    workers = _workers_status(ctx, ctx.slots(), now)
    # read after the workers: a status showing every worker paused counts every row they wrote
    # before pausing (read first, a worker could write and pause between the two reads)
    write_count = storage.write_count
    return Status(
        pid=os.getpid(), uptime_s=round(time.time() - daemon.started_at, 3), desired=Desired(sup.desired).name.lower(),
        count=sup.count, weights_version=weights.version if weights is not None else 0, metrics_url=ctx.metrics_url(),
        weights_path=str(weights.path) if weights is not None else None,
        replay=ReplayStatus(str(storage.path), min(write_count, storage.capacity), storage.capacity, write_count),
        workers=workers, config=ctx.config_json()).to_json()


def get_config(ctx: Context, request: GetConfig) -> Preencoded:
    return ctx.config_json()


# -- slow handlers (thread pool) ---------------------------------------------------------
_DESIRED_STATE = {Desired.PAUSE: (State.PAUSED, "paused", "pause"), Desired.RUN: (State.RUNNING, "resumed", "resume")}


def _set_desired(ctx: Context, desired: Desired, deadline: float) -> dict[int, int]:
    """Tell the workers; return ``{index: pid}`` of the live ones that must acknowledge.

    The stats words of workers that are collecting or paused are written here
    directly, so the workers see the change at once; the main thread then
    makes it authoritative (supervisor state, new workers); the supervisor's
    tick re-asserts ``stop`` for workers on their way out, in case this write
    raced with it.
    """
    daemon = ctx.daemon
    stats = daemon.layout.stats
    told = []  # (index, what it was told before)
    for index in ctx.slots():
        rec = stats[index]
        before = int(rec["desired"])
        if before in (Desired.RUN, Desired.PAUSE):
            rec["desired"] = desired
            told.append((index, before))

    def authoritative() -> dict[int, int]:
        daemon.set_desired(desired)
        return {i: int(stats[i]["pid"]) for i in daemon.supervisor.live()
                if not (daemon.supervisor.slots[i].restarting or stats.state(i) == State.FAILED)}

    try:
        return ctx.on_main(authoritative, deadline)
    except RequestError as exc:
        if exc.code == ErrorCode.TIMEOUT:  # "it was not run": take back what the workers were told
            for index, before in told:  # (a word the main thread has changed since is its own)
                if int(stats[index]["desired"]) == desired:
                    stats[index]["desired"] = before
        raise


def _locked_change(ctx: Context, request: Request, change: Callable[[float], Any], what: str) -> tuple[Any, float]:
    """Run ``change(deadline)`` holding the lock that serialises pause/resume/restart/scale/reload."""
    started = time.monotonic()
    deadline = ctx.deadline(request)
    if not ctx.change_lock.acquire(timeout=max(0.0, deadline - started)):
        raise RequestError(ErrorCode.TIMEOUT, f"another command kept the daemon busy; {what} was not started")
    try:
        return change(deadline), started
    finally:
        ctx.change_lock.release()


def _change_desired(ctx: Context, request: Request, desired: Desired) -> dict:
    target, event, verb = _DESIRED_STATE[desired]

    def verdict(index: int, pid: int, rec) -> bool | None:
        if int(rec["pid"]) != pid or int(rec["state"]) in (State.FAILED, State.STOPPED, State.STOPPING):
            return False
        if desired == Desired.RUN and int(rec["pause_reason"]) == PauseReason.BUDGET:
            return True  # resumed, but workers.total_frames keeps it paused
        return True if int(rec["state"]) == target else None

    def change(deadline: float) -> list[int]:
        pending = _set_desired(ctx, desired, deadline)
        return ctx.wait(pending, verdict, deadline, f"acknowledge {verb}")[0]

    acked, started = _locked_change(ctx, request, change, f"the {verb}")
    seconds = time.monotonic() - started
    ctx.publish(event, workers=acked, seconds=round(seconds, 6))
    return Acked(acked, round(seconds, 6)).to_json()


def pause(ctx: Context, request: Pause) -> dict:
    return _change_desired(ctx, request, Desired.PAUSE)


def resume(ctx: Context, request: Resume) -> dict:
    return _change_desired(ctx, request, Desired.RUN)


def _started_again(index: int, old_incarnation: int, rec) -> bool | None:
    """Verdict for a worker that must come (back) up as a new process (a new incarnation: every
    start numbers one; pids do not tell, a failed worker shows pid 0). ``failed`` counts only for
    a new process: a failed worker being restarted still shows its old failure at first."""
    state, incarnation = int(rec["state"]), int(rec["incarnation"])
    if incarnation in (0, old_incarnation):
        return None
    if state in (State.RUNNING, State.PAUSED):
        return True
    return False if state == State.FAILED else None


def _all_up(ctx: Context, done: list[int], failed: list[int]) -> list[int]:
    """``done``, or ``worker_failed`` naming the workers whose new process failed and why (a
    restart that reported success while a worker never came back misled operators' scripts)."""
    if not failed:
        return done
    stats = ctx.daemon.layout.stats
    why = "; ".join(f"worker {i}: {stats.error(i) or 'no error recorded'}" for i in failed)
    raise RequestError(ErrorCode.WORKER_FAILED, f"workers {failed} did not come up (failed): {why}; workers "
                                                f"{done} did")


def _gone(index: int, pid: int, rec) -> bool | None:
    """Verdict for a retired worker: done once the supervisor has reaped it and freed its slot."""
    return True if int(rec["state"]) == State.EMPTY else None


def restart(ctx: Context, request: Restart) -> dict:
    daemon = ctx.daemon
    stats = daemon.layout.stats

    def change(deadline: float) -> list[int]:
        def go() -> dict[int, int]:
            chosen = daemon.supervisor.restart(list(request.workers) if request.workers else None)
            return {i: int(stats[i]["incarnation"]) for i in chosen}

        try:
            old = ctx.on_main(go, deadline)
        except KeyError as exc:
            raise RequestError(ErrorCode.NO_SUCH_WORKER, str(exc.args[0]) if exc.args else str(exc)) from None
        if not request.wait:
            return sorted(old)
        return _all_up(ctx, *ctx.wait(old, _started_again, deadline, "come back up", drop_dead=False))

    workers, started = _locked_change(ctx, request, change, "the restart")
    return Acked(workers, round(time.monotonic() - started, 6)).to_json()


def scale(ctx: Context, request: Scale) -> dict:
    daemon = ctx.daemon
    stats = daemon.layout.stats

    def change(deadline: float) -> list[int]:
        def go() -> tuple[dict[int, int], dict[int, int]]:
            sup = daemon.supervisor
            before = {i: int(stats[i]["pid"]) for i in sup.live()}
            daemon.scale(request.count)  # checked like the config (replay capacity), and then the effective config
            fresh = {i: int(stats[i]["incarnation"]) for i, s in sup.slots.items()
                     if not s.retiring and i not in before and stats.state(i) != State.FAILED}
            leaving = {i: 0 for i, s in sup.slots.items() if s.retiring}
            return fresh, leaving

        try:
            fresh, leaving = ctx.on_main(go, deadline)
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
        if request.wait:
            _all_up(ctx, *ctx.wait(fresh, _started_again, deadline, "start", drop_dead=False))
            ctx.wait(leaving, _gone, deadline, "stop", drop_dead=False)
        return list(range(request.count))

    workers, started = _locked_change(ctx, request, change, "the scale")
    return Acked(workers, round(time.monotonic() - started, 6)).to_json()


def _check_policy_weights(policy, state: dict) -> None:
    """The policy's own test of pushed weights (``Policy.check_weights``), if it has one."""
    check = getattr(policy, "check_weights", None)
    if check is None:
        return
    try:
        check(state)
    except ValueError as exc:
        raise BadWeights(f"the policy refused them: {exc}") from None


def push_weights(ctx: Context, request: PushWeights) -> dict:
    from ingestd.weights.wire import decode

    started = time.monotonic()
    deadline = ctx.deadline(request)
    layout = ctx.daemon.layout
    if layout.weights is None or layout.manifest is None:
        raise RequestError(ErrorCode.NO_WEIGHTS, "the configured policy has no weights to replace")
    try:
        state = decode(request.frames, expected=layout.manifest, max_raw_bytes=layout.manifest.total_bytes)
        _check_policy_weights(layout.policy, state)
        decoded = time.monotonic()
        with ctx.push_lock:
            version = layout.weights.publish(state)
    except BadWeights as exc:
        log.warning("rejected a weight push: %s", exc)
        raise RequestError(ErrorCode.BAD_WEIGHTS, f"{exc}; nothing was changed") from None
    del state
    published = time.monotonic()
    ctx.publish("weights.published", version=version)
    applied: list[int] = []
    dropped: list[int] = []
    collecting, deferred = _push_audience(ctx, version)
    if request.wait:
        def verdict(index: int, pid: int, rec) -> bool | None:
            if int(rec["pid"]) != pid or int(rec["state"]) in (State.FAILED, State.STOPPED, State.STOPPING):
                return False
            if int(rec["weights_version"]) >= version:
                return True
            if int(rec["state"]) == State.PAUSED:
                deferred.append(index)
                return False
            return None

        try:
            applied, dropped = ctx.wait(collecting, verdict, deadline, f"apply weights version {version}")
        except RequestError as exc:  # published all the same: the trainer may map versions to checkpoints
            ctx.daemon.telemetry.observe_push(time.monotonic() - started)  # the slowest pushes count too
            raise RequestError(exc.code, exc.message, {"version": version}) from None
        # a paused worker resumed meanwhile (a concurrent resume) and applied it: it is not deferred
        caught_up = {i for i in deferred if int(layout.stats[i]["weights_version"]) >= version}
        applied, deferred = sorted({*applied, *caught_up}), [i for i in deferred if i not in caught_up]
        dropped = [i for i in dropped if i not in applied and i not in deferred]
    seconds = time.monotonic() - started
    ctx.daemon.telemetry.observe_push(seconds)
    log.info("weights v%d: %.1f MB decoded in %.1f ms, published in %.1f ms, applied by %s after %.1f ms in total",
             version, layout.manifest.total_bytes / 1e6, (decoded - started) * 1e3, (published - decoded) * 1e3,
             applied if request.wait else "(not waited for)", seconds * 1e3)
    return Pushed(version, applied, sorted(deferred), round(seconds, 6), dropped).to_json()


def _push_audience(ctx: Context, version: int) -> tuple[dict[int, int], list[int]]:
    """The live workers a push of ``version`` reaches: ``{index: pid}`` of those that apply it
    before their next chunk (or have already), and the paused ones, which apply it only once
    resumed (``deferred``)."""
    stats = ctx.daemon.layout.stats
    collecting, paused = {}, []
    for index in ctx.slots():
        rec = stats[index]
        state, pid = int(rec["state"]), int(rec["pid"])
        if not pid_alive(pid):
            continue
        if state in (State.STARTING, State.RUNNING) or int(rec["weights_version"]) >= version:
            collecting[index] = pid
        elif state == State.PAUSED:
            paused.append(index)
    return collecting, paused


def reload(ctx: Context, request: Reload) -> dict:
    def change(deadline: float) -> dict:
        try:
            return ctx.on_main(ctx.daemon.reload, deadline)
        except (ConfigError, LockBusy) as exc:
            extra = getattr(exc, "reload_extra", {})
            keys = (f" (the authorised CURVE keys were re-read all the same: {extra['authorized_keys']})"
                    if "authorized_keys" in extra else "")
            code = ErrorCode.BUSY if isinstance(exc, LockBusy) else ErrorCode.RELOAD_FAILED  # busy: retry
            raise RequestError(code, f"{exc}; the running config was kept{keys}") from None

    result, _ = _locked_change(ctx, request, change, "the reload")
    path = ctx.daemon.config_path
    return Reloaded(list(result["applied"]), list(result["not_applied"]),
                    None if path is None else os.path.abspath(path), result.get("authorized_keys"),
                    result.get("authorized_keys_error")).to_json()


def profile(ctx: Context, request: Profile) -> dict:
    """Order a trace from one worker (ingestd.collect.profiling) and wait for its file."""
    from ingestd.collect import profiling

    daemon = ctx.daemon
    if not daemon.config.workers.enable_profile:
        raise RequestError(ErrorCode.PROFILE_FAILED, "profiling is turned off (workers.enable_profile = false)")
    stats, index = daemon.layout.stats, request.worker
    rec = stats[index]
    if index not in ctx.slots() or State(int(rec["state"])) in NOT_LIVE or not pid_alive(int(rec["pid"])):
        raise RequestError(ErrorCode.NO_SUCH_WORKER, f"worker {index} is not running; workers are {ctx.slots()}")
    deadline = ctx.deadline(request)
    path = Path(daemon.paths.runtime_dir) / "profiles" / f"worker{index}-{time.strftime('%Y%m%dT%H%M%S')}-" \
        f"{time.monotonic_ns() % 10**6:06d}.json"
    if not ctx.profile_lock.acquire(blocking=False):  # waiting would hold a slow-command thread for minutes
        raise RequestError(ErrorCode.BUSY, "another profile is being recorded; try again once it is written")
    try:
        for old in profiling.prune(path.parent):  # /run is RAM: traces of up to 600 s are tens of MB each
            log.info("removed the old profile trace %s (the newest %d are kept)", old, profiling.KEEP_TRACES)
        pid = int(rec["pid"])
        seq = profiling.request(rec, path, request.seconds)
        # answered, else dropped once the slot holds another pid (or none): a dead worker's request is
        # answered by nobody when the slot is marked failed instead of restarted (it waited to the deadline)
        done, _ = ctx.wait({index: pid}, lambda i, p, r: True if profiling.outcome(r, seq) else
                           (False if int(r["pid"]) != p else None), deadline, "write the profile")
    finally:
        ctx.profile_lock.release()
    answer = profiling.outcome(rec, seq) if done else None
    if answer is None:
        raise RequestError(ErrorCode.NO_SUCH_WORKER, f"worker {index} stopped before it wrote the profile")
    ok, text = answer
    if not ok:
        raise RequestError(ErrorCode.PROFILE_FAILED, f"worker {index}: {text}")
    ctx.publish("worker.profiled", worker=index, path=text)
    return Profiled(index, text, request.seconds).to_json()


@dataclass(frozen=True)
class Handler:
    run: Callable[[Context, Any], Any]
    fast: bool  # answered on the control thread (reads shared memory only)
    read_only: bool = False  # changes nothing: its reply leaves the status cache alone


HANDLERS: dict[type[Request], Handler] = {
    Ping: Handler(ping, fast=True, read_only=True),
    GetStatus: Handler(status, fast=True, read_only=True),
    GetConfig: Handler(get_config, fast=True, read_only=True),
    Pause: Handler(pause, fast=False),
    Resume: Handler(resume, fast=False),
    Restart: Handler(restart, fast=False),
    Scale: Handler(scale, fast=False),
    PushWeights: Handler(push_weights, fast=False),
    Reload: Handler(reload, fast=False),
    Profile: Handler(profile, fast=False),
    SetLimiter: Handler(limiter, fast=False),  # a change goes through the main thread (the effective config)
    Snapshot: Handler(snapshot, fast=False, read_only=True),
}
