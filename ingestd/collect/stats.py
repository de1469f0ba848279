"""Per-worker stats blocks in shared memory.

One fixed-size record per worker slot in a file on tmpfs. A worker writes
its own record (state, counters, heartbeat, returns); the daemon writes
``desired`` and ``restarts``; the control plane and the metrics read it at
will. No per-frame messaging: every field is a plain aligned 64-bit word.
"""
from __future__ import annotations

import enum
import mmap
import os
import time
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

MAX_WORKERS = 256
T = TypeVar("T")
RING = 32  # finished episodes remembered per worker
ERROR_BYTES = 240


class State(enum.IntEnum):
    EMPTY = 0
    STARTING = 1
    RUNNING = 2
    PAUSED = 3
    STOPPING = 4
    STOPPED = 5
    FAILED = 6

    @property
    def label(self) -> str:
        return self.name.lower()


# Workers with no process to beat: their heartbeat word is stale, so their age is not reported.
NOT_LIVE = frozenset({State.EMPTY, State.STOPPED, State.FAILED})


def heartbeat_age(rec: np.void, now: float) -> float | None:
    """Seconds since the worker's last heartbeat (``now``: ``time.monotonic()``), or None for a
    worker that is not live (no pid yet, stopped or failed): the one rule for ``status``'s
    ``heartbeat_age_s`` and the ``ingestd_worker_heartbeat_age_seconds`` metric."""
    if int(rec["pid"]) <= 0 or int(rec["state"]) in NOT_LIVE:  # an IntEnum set: plain ints match
        return None
    return max(0.0, now - float(rec["heartbeat"]))


class PauseReason(enum.IntEnum):
    """Why a worker is paused (the ``pause_reason`` word; NONE while it collects)."""

    NONE = 0
    REQUESTED = 1  # a pause command
    BUDGET = 2  # workers.total_frames reached
    LIMITER = 3  # held back by the rate limiter (state stays running; ingestd.replay.limiter)
    PRIORITY_LOCK = 4  # waiting for priority.lock, held by a trainer (stopped inside update_priorities?)

    @property
    def label(self) -> str:
        return self.name.lower()


PAUSES = (PauseReason.REQUESTED, PauseReason.BUDGET)  # a paused worker's reasons
WAITS = (PauseReason.LIMITER, PauseReason.PRIORITY_LOCK)  # a running worker's, while it collects nothing


def shown_reason(state: int, reason: int) -> int:
    """Why a worker is not collecting, as status and the metrics show it: a paused one's
    reason, a running one's wait (``WAITS``), else ``PauseReason.NONE``."""
    if state == State.PAUSED or (state == State.RUNNING and reason in WAITS):
        return reason
    return PauseReason.NONE


class Desired(enum.IntEnum):
    RUN = 0
    PAUSE = 1
    STOP = 2


RECORD = np.dtype([
    ("desired", np.int64), ("state", np.int64), ("pid", np.int64), ("incarnation", np.int64),
    ("restarts", np.int64), ("frames", np.int64), ("episodes", np.int64), ("chunks", np.int64),
    ("heartbeat", np.float64), ("started_at", np.float64), ("weights_version", np.int64),
    ("seed", np.int64), ("pause_reason", np.int64), ("limiter_waits", np.int64),
    ("limiter_blocked_s", np.float64), ("chunk_seconds", np.float64),
    ("returns_count", np.int64), ("returns", np.float64, (RING,)), ("lengths", np.int64, (RING,)),
    ("error", f"S{ERROR_BYTES}"),
    ("requested_restarts", np.int64),  # of ``restarts``: the ones a restart command asked for
    ("error_at", np.float64),  # when ``error`` was set (time.time(); 0 without one)
    # collector features (ingestd.collect.features, ingestd.collect.profiling)
    ("threads", np.int64), ("threads_wanted", np.int64),  # applied; asked for by the daemon (0: as started)
    ("profile_seq", np.int64), ("profile_done", np.int64),
    ("profile_seconds", np.float64), ("profile_path", "S256"),
    ("failure_restarts", np.int64),  # of ``restarts``: the others (a crash, a hang, a failed start)
    # odd while the worker writes its returns ring and returns_count (a seqlock: a reader copying the
    # record then has a torn ring, and reads it again; see consistent)
    ("returns_seq", np.int64),
], align=True)
# a torn copy of a record is taken again at once SPINS times (the ring's write takes a few us), then
# after RETRY_SLEEP_S each time (a worker descheduled inside it), RETRIES times in all (~2 ms)
RETRIES, SPINS, RETRY_SLEEP_S = 24, 4, 100e-6


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a dead, unreaped worker is not live)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class StatsBlock:
    """Maps the stats file; ``records[i]`` is worker ``i``'s record (a numpy void view)."""

    def __init__(self, path: str | os.PathLike, create: bool = False):
        self.path = Path(path)
        size = RECORD.itemsize * MAX_WORKERS
        if create:
            from ingestd.errors import StorageFull
            from ingestd.replay.files import NO_ROOM, reserve  # here, not at the top: readers of stats need neither

            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:  # a new file, not the old one truncated: a stray worker of an earlier daemon that still
                os.unlink(self.path)  # maps that one would write its pid and heartbeat into ours
            except FileNotFoundError:
                pass
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
            try:
                reserve(fd, size)  # a full runtime dir: ENOSPC here, not SIGBUS in a worker
            except BaseException as exc:
                os.close(fd)
                if isinstance(exc, OSError) and exc.errno in NO_ROOM:  # was a traceback and exit 1 (retried)
                    raise StorageFull(f"no room for the workers' stats block {self.path} ({size // 1024} KiB, "
                                      f"{exc.strerror}): free space where service.runtime_dir is, or choose a "
                                      "runtime dir with room") from exc
                raise
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.records = np.frombuffer(self._mm, dtype=RECORD)

    def __getitem__(self, index: int) -> np.void:
        return self.records[index]

    def snapshot(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(copies of records[indices], whether each copy's returns ring is whole)``: a copy
        taken while its worker wrote the ring is taken again (``seqlocked``)."""
        records = self.records
        seq = records["returns_seq"]
        before = seq[indices]  # (fancy indexing copies) read before the records, as a seqlock's reader must
        copies = records[indices]
        whole = consistent(before, seq[indices])
        for j in np.flatnonzero(~whole).tolist():
            i = int(indices[j])
            copies[j], whole[j] = seqlocked(lambda: int(seq[i]), lambda: records[i].copy())
        return copies, whole

    def reset(self, index: int) -> None:
        """Clear a slot for a fresh worker. Keeps restarts, desired, episode counts and the last
        error, so an operator still sees why a worker was restarted once it runs again. The state
        goes straight to ``starting``: an occupied slot never reads ``EMPTY`` (a scrape between a
        zeroed state and the supervisor's ``starting`` dropped every series of the worker)."""
        rec = self.records[index]
        rec["state"] = State.STARTING
        if rec["returns_seq"] % 2:  # a worker killed while writing its ring: a reader would retry for ever
            rec["returns_seq"] += 1
        for name in ("pid", "incarnation", "chunks", "weights_version", "seed", "pause_reason", "chunk_seconds"):
            rec[name] = 0
        rec["heartbeat"] = rec["started_at"] = time.monotonic()

    def set_error(self, index: int, message: str) -> None:
        rec = self.records[index]
        rec["error"] = message.encode("utf-8", "replace")[:ERROR_BYTES]
        rec["error_at"] = time.time() if message else 0.0

    def error(self, index: int) -> str:
        return bytes(self.records[index]["error"]).decode("utf-8", "replace")

    def state(self, index: int) -> State:
        return State(int(self.records[index]["state"]))

    def recent_returns(self, index: int, n: int = RING) -> list[tuple[float, int]]:
        """The last ``n`` finished episodes (return, length), oldest first."""
        rec = self.snapshot(np.array([index]))[0][0]
        count = int(rec["returns_count"])
        take = min(n, count, RING)
        pos = [(count - take + k) % RING for k in range(take)]
        return [(float(rec["returns"][p]), int(rec["lengths"][p])) for p in pos]

    def close(self) -> None:
        self.records = None
        try:
            self._mm.close()
        except BufferError:
            pass


def consistent(before, after):
    """Whether records copied between reading their ring sequence ``before`` and ``after`` hold
    a whole ring: no write was under way (even) and none began in between (the same)."""
    return (before % 2 == 0) & (before == after)


def seqlocked(seq: Callable[[], int], copy: Callable[[], T]) -> tuple[T, bool]:
    """``(copy(), whether it holds a whole returns ring)``, taken again while it does not
    (``RETRIES`` times at most): ``seq`` reads the record's live ``returns_seq``."""
    for attempt in range(RETRIES):
        before = seq()
        value = copy()
        if consistent(before, seq()):
            return value, True
        if attempt >= SPINS:
            time.sleep(RETRY_SLEEP_S)
    return value, False
