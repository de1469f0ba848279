"""The replay-side commands: the rate limiter (``SetLimiter``) and snapshots (``Snapshot``).

Both run on the server's thread pool (``ingestd.control.handlers.HANDLERS``). A limiter
change goes through the main thread, which owns the effective config; a snapshot copies
the ring while the workers keep writing, one at a time.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from ingestd.collect.stats import PauseReason, State
from ingestd.control.commands import LimiterState, SetLimiter, Snapshot, Snapshotted
from ingestd.control.context import Context
from ingestd.control.protocol import ErrorCode, RequestError
from ingestd.errors import CorruptStorage, LockBusy, SnapshotExists
from ingestd.replay.snapshot import check_name, save, sweep

log = logging.getLogger("ingestd.control")

_MAIN_LOCK_TRY_S = 0.05  # the main thread tries a trainer-writable lock this long, then lets go
_RELEASE_WAIT_S = 0.5  # a limiter change that releases held workers: the reply waits this long to show it


def limiter(ctx: Context, request: SetLimiter) -> dict:
    """Report the rate limiter; with arguments, change it first (ingestd.replay.limiter)."""
    lim = ctx.daemon.layout.limiter
    if lim is None:
        raise RequestError(ErrorCode.UNAVAILABLE, "the rate limiter is not set up yet")
    changes = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)
               if f.name != "timeout_s" and getattr(request, f.name) is not None}
    deadline = ctx.deadline(request)  # once: the change's retries and the wait below share it
    if changes:
        def change() -> None:  # in the main thread, which owns the effective config (a reload races it)
            daemon = ctx.daemon
            config = daemon.checked_with({f"limiter.{key}": value for key, value in changes.items()})
            lim.configure(dataclasses.replace(lim.params, **changes), timeout=_MAIN_LOCK_TRY_S)
            daemon.adopt(config)  # `ingestctl config` shows it; a reload sets the file's values again
        while True:  # a trainer stopped while sampling may hold limiter.bin: retry here, not in the main loop
            try:
                ctx.on_main(change, deadline)
                break
            except ValueError as exc:
                raise RequestError(ErrorCode.BAD_REQUEST, f"{exc}; the limiter was not changed") from None
            except LockBusy as exc:
                if time.monotonic() >= deadline:
                    raise RequestError(ErrorCode.BUSY, f"{exc}; the limiter was not changed") from None
                time.sleep(_MAIN_LOCK_TRY_S)
        ctx.publish("limiter.changed", **changes)
    stats = ctx.daemon.layout.stats

    def held() -> list[int]:
        return [i for i in ctx.slots() if int(stats[i]["pause_reason"]) == PauseReason.LIMITER
                and int(stats[i]["state"]) == State.RUNNING]

    blocked = held()
    released_by = min(time.monotonic() + _RELEASE_WAIT_S, deadline)  # never past the caller's wait
    while changes and blocked and lim.insert_blocked() is None and time.monotonic() < released_by:
        time.sleep(0.002)  # the change released them: they clear their mark within a poll (2 ms)
        blocked = held()
    lag = lim.sampled_lag()
    return LimiterState(**lim.state(), workers_blocked=blocked,
                        workers_blocked_s=round(sum(float(stats[i]["limiter_blocked_s"]) for i in ctx.slots()), 6),
                        sampled_policy_lag=list(lag[:3]) if lag else None).to_json()


SNAPSHOTS_DIR_MODE = 0o750


def snapshot(ctx: Context, request: Snapshot) -> dict:
    """Copy the replay's committed rows into ``<data_dir>/snapshots/<name>`` while the workers keep
    writing (ingestd.replay.snapshot: atomic, so a snapshot directory is always complete). One at a
    time; there is no deadline: the copy cannot be stopped half-way, and the client waits for it."""
    if request.name is not None:
        try:
            check_name(request.name)
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
    if not ctx.snapshot_lock.acquire(blocking=False):
        raise RequestError(ErrorCode.BUSY, "another snapshot is being written; try again once it has finished")
    try:
        paths = ctx.daemon.paths
        folder = Path(paths.data_dir) / "snapshots"
        try:
            folder.mkdir(mode=SNAPSHOTS_DIR_MODE, parents=True, exist_ok=True)
            sweep(folder)
            dest = folder / (request.name or _free_name(folder, time.time()))
            info = save(paths.replay, dest)
        except SnapshotExists:  # only save raises it: dest is set
            raise RequestError(ErrorCode.SNAPSHOT_EXISTS, f"a snapshot named {dest.name!r} exists ({dest}); it was "
                                                          "left as it was: choose another name") from None
        except (OSError, CorruptStorage) as exc:  # disk full, no storage, no access...
            log.error("snapshot in %s failed: %s", folder, exc)
            raise RequestError(ErrorCode.SNAPSHOT_FAILED, f"no snapshot was written in {folder}: {exc}") from None
    finally:
        ctx.snapshot_lock.release()
    result = Snapshotted(**info.to_json()).to_json()  # the same fields (seconds rounded by save)
    log.info("snapshot %s: %d rows (%d left out while being written), %.1f MB in %.2f s",
             info.path, info.rows, info.skipped, info.bytes / 1e6, info.seconds)
    ctx.publish("replay.snapshot", **result)
    return result


def _free_name(folder: Path, now: float) -> str:
    """The UTC time ``now`` as ``%Y%m%dT%H%M%SZ``, with ``-2``, ``-3``... if that name is taken."""
    base = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    name, n = base, 1
    while (folder / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name
