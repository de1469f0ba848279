"""The rate limiter (Reverb's sample-to-insert ratio), shared through ``limiter.bin``.

::

    <replay>/limiter.bin    32 int64/float64 words (see the W_* constants); changes under
                            an flock on the file itself

The limiter keeps ``error = (inserts - base_inserts) * samples_per_insert
- (samples - base_samples) + offset`` inside ``[min_diff, max_diff]``, where
``inserts`` is the storage's ``write_count`` and ``samples`` counts the rows
every rate-limited reader has sampled while the limiter was enabled.

- A **worker** checks before each chunk: while ``inserts >= min_size`` and
  ``error > max_diff`` it waits (its state stays ``running``; ``pause_reason``
  = :data:`PAUSE_LIMITER`, ``limiter_waits`` / ``limiter_blocked_s`` count it,
  and the heartbeat stays fresh). A pause or stop request ends the wait.
- A **reader** checks before each sample: while the storage holds fewer than
  ``min_size`` rows (a ring smaller than ``min_size``: until ``min_size`` rows
  were written), or ``error < min_diff``, ``sample(timeout=...)`` waits and
  raises ``SampleTimeout`` at the deadline; without a timeout it raises
  :class:`RateLimited` at once.

Both sides check the *current* error, so a chunk (or a batch) may overshoot
the window by its own size; in exchange neither side can wait on the other
while both are inside the window, whatever the chunk and batch sizes: as long
as ``max_diff >= min_diff`` one side can always move. The window must be at
least ``2 * max(1, samples_per_insert)`` wide (:func:`check_window`).

Changing the parameters (config, ``ingestctl limiter``) re-anchors the error:
the new limiter starts from the old error clamped into the new window (``0``
when it was disabled), so history from before is not charged to either side.
Readers add to ``samples`` under the flock; parameter words are written under
it and read without it (a reader may see a change one call late).
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from ingestd.errors import LockBusy, SampleTimeout, StorageNotFound
from ingestd.replay import files
from ingestd.replay.limiter_params import LimiterParams, check_window, params_of  # noqa: F401 (re-exported)

FILE = "limiter.bin"
WORDS = 32
MAGIC = 0x4C494D49_0001  # "LIMI" + 1
(W_MAGIC, W_ENABLED, W_MIN_SIZE, W_SPI, W_MIN_DIFF, W_MAX_DIFF, W_SAMPLES, W_BASE_INSERTS, W_BASE_SAMPLES,
 W_OFFSET, W_READER_BLOCKED_S, W_READER_WAITS, W_CHANGES, W_LAG_MIN, W_LAG_MEAN, W_LAG_MAX, W_LAG_AT,
 W_READER_REFUSALS) = range(18)
_FLOATS = frozenset((W_SPI, W_MIN_DIFF, W_MAX_DIFF, W_OFFSET, W_READER_BLOCKED_S, W_LAG_MEAN, W_LAG_AT))
PAUSE_LIMITER = 3  # stats record ``pause_reason`` while the limiter holds a worker back (PauseReason.LIMITER)
_WORKER_POLL_S = 0.002
# a reader waits this long at most for limiter.bin, which another trainer stopped inside a call holds
READER_LOCK_WAIT_S = 1.0
log = logging.getLogger("ingestd.replay")


class RateLimited(SampleTimeout):
    """A non-blocking sample was refused by the rate limiter (the trainer is too far ahead)."""


def ensure_file(path: str | os.PathLike) -> None:
    """Create ``<path>/limiter.bin`` (disabled) unless it exists (the storage does so when
    opened for writing, so readers never create files)."""
    path = Path(path)
    if (path / FILE).exists():
        return
    tmp = path / f"{FILE}.{os.getpid()}-{threading.get_native_id()}.tmp"  # this thread's own
    words = np.zeros(WORDS, dtype=np.int64)
    words[W_MAGIC] = MAGIC
    f = words.view(np.float64)
    d = LimiterParams()
    words[W_MIN_SIZE] = d.min_size
    f[W_SPI], f[W_MIN_DIFF], f[W_MAX_DIFF] = d.samples_per_insert, d.min_diff, d.max_diff
    try:
        files.write_new(tmp, words.tobytes())
        tmp.chmod(files.TRAINER_WRITABLE)
        os.link(tmp, path / FILE)  # atomic, and never replaces a file another process made
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


class Limiter:
    """One process's handle on ``limiter.bin``; ``inserts()`` gives the storage's write_count."""

    def __init__(self, path: Path, inserts: Callable[[], int] | None = None):
        self.path = Path(path)
        self._inserts = inserts or _header_write_count(self.path)  # first: it may fail
        self._fd = files.open_lock_file(self.path / FILE, owner=self)
        try:
            self._mm = mmap.mmap(self._fd, 8 * WORDS, flags=mmap.MAP_SHARED)
        except BaseException:
            files.close_lock_file(self._fd)
            raise
        self._i = np.frombuffer(self._mm, dtype=np.int64)
        self._f = np.frombuffer(self._mm, dtype=np.float64)
        if self._i[W_MAGIC] != MAGIC:
            self.close()
            raise ValueError(f"{self.path / FILE} is not a limiter file")

    @classmethod
    def attach(cls, path: str | os.PathLike, inserts: Callable[[], int] | None = None) -> "Limiter":
        """Open ``<path>/limiter.bin``, creating it (disabled) when missing."""
        inserts = inserts or _header_write_count(Path(path))  # not a storage: fail before creating the file
        ensure_file(path)
        return cls(path, inserts)

    # -- parameters ----------------------------------------------------------------------
    @property
    def params(self) -> LimiterParams:
        i, f = self._i, self._f
        return LimiterParams(bool(i[W_ENABLED]), int(i[W_MIN_SIZE]), float(f[W_SPI]), float(f[W_MIN_DIFF]),
                             float(f[W_MAX_DIFF]))

    def configure(self, params: LimiterParams, timeout: float | None = None) -> LimiterParams:
        """Apply new parameters (checked), re-anchoring the error; returns them. ``timeout``:
        raise ``LockBusy`` rather than wait longer for ``limiter.bin``'s lock, which a trainer
        stopped while sampling may hold (the daemon's main thread must not wait on it)."""
        check_window(params)
        with self._locked(timeout):
            old_enabled, error = bool(self._i[W_ENABLED]), self.error()
            start = min(max(error if old_enabled else 0.0, params.min_diff), params.max_diff)
            i, f = self._i, self._f
            i[W_ENABLED] = 0  # nobody acts on a half-written change
            i[W_MIN_SIZE] = params.min_size
            f[W_SPI], f[W_MIN_DIFF], f[W_MAX_DIFF] = params.samples_per_insert, params.min_diff, params.max_diff
            i[W_BASE_INSERTS], i[W_BASE_SAMPLES] = self._inserts(), i[W_SAMPLES]
            f[W_OFFSET] = start
            i[W_CHANGES] += 1
            i[W_ENABLED] = int(params.enabled)
        return params

    # -- state ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self._i[W_ENABLED])

    def error(self) -> float:
        i, f = self._i, self._f
        return float((self._inserts() - i[W_BASE_INSERTS]) * f[W_SPI] - (i[W_SAMPLES] - i[W_BASE_SAMPLES])
                     + f[W_OFFSET])

    @property
    def samples(self) -> int:
        return int(self._i[W_SAMPLES])

    @property
    def reader_blocked_s(self) -> float:
        return float(self._f[W_READER_BLOCKED_S])

    @property
    def reader_waits(self) -> int:
        return int(self._i[W_READER_WAITS])

    @property
    def reader_refusals(self) -> int:
        """Non-blocking samples refused (``RateLimited``): a trainer sampling without a timeout."""
        return int(self._i[W_READER_REFUSALS])

    def insert_blocked(self) -> str | None:
        """Why a worker must wait before its next chunk, or None."""
        if not self._i[W_ENABLED] or self._inserts() < self._i[W_MIN_SIZE]:
            return None
        error = self.error()
        if error > self._f[W_MAX_DIFF]:
            return f"workers are ahead: error {error:g} > max_diff {self._f[W_MAX_DIFF]:g}"
        return None

    def sample_blocked(self, rows: int) -> str | None:
        """Why a reader must wait before sampling, or None. ``rows``: the rows the storage holds;
        a ring smaller than ``min_size`` has enough once ``min_size`` rows were written (else
        readers and workers, who count inserts, could wait on each other for ever)."""
        if not self._i[W_ENABLED]:
            return None
        if rows < self._i[W_MIN_SIZE] and self._inserts() < self._i[W_MIN_SIZE]:
            return f"the replay holds {rows} rows, fewer than the limiter's min_size {int(self._i[W_MIN_SIZE])}"
        error = self.error()
        if error < self._f[W_MIN_DIFF]:
            return f"the trainer is ahead: error {error:g} < min_diff {self._f[W_MIN_DIFF]:g}"
        return None

    def take_samples(self, n: int, rows: int, timeout: float | None = None) -> tuple[str | None, int]:
        """Before a sample of ``n`` rows: ``(why the reader must wait, 0)``, or ``(None, rows
        counted)``. The check and the count are one step under the lock, so trainers that check
        together cannot all pass: together they overshoot ``min_diff`` by one batch, not one
        each. A sample that then fails gives its rows back (:meth:`give_back`). ``timeout``:
        ``LockBusy`` if another trainer holds ``limiter.bin`` that long (stopped inside a call)."""
        if not self._i[W_ENABLED]:
            return None, 0
        with self._locked(timeout):
            why = self.sample_blocked(rows)
            if why is not None:
                return why, 0
            self._i[W_SAMPLES] += n
        return None, n

    def give_back(self, n: int) -> None:
        """Un-count ``n`` rows taken by :meth:`take_samples` for a sample that found none (not
        if ``limiter.bin`` stays locked: then they stay counted, and said so)."""
        if n:
            try:
                with self._locked(READER_LOCK_WAIT_S):
                    self._i[W_SAMPLES] -= n
            except LockBusy as exc:
                log.warning("%s: %d rows of a failed sample stay counted as sampled", exc, n)

    def add_reader_blocked(self, seconds: float) -> None:
        """Counted for the metrics; dropped if ``limiter.bin`` stays locked (never a reader's wait)."""
        with contextlib.suppress(LockBusy), self._locked(READER_LOCK_WAIT_S):
            self._f[W_READER_BLOCKED_S] += seconds
            self._i[W_READER_WAITS] += 1

    def add_reader_refused(self) -> None:
        with contextlib.suppress(LockBusy), self._locked(READER_LOCK_WAIT_S):
            self._i[W_READER_REFUSALS] += 1

    def record_sampled_lag(self, lo: int, mean: float, hi: int) -> None:
        """The policy lag of the latest sample any reader took (for the metrics; no lock)."""
        self._i[W_LAG_MIN], self._f[W_LAG_MEAN], self._i[W_LAG_MAX] = lo, mean, hi
        self._f[W_LAG_AT] = time.time()

    def sampled_lag(self) -> tuple[int, float, int, float] | None:
        """``(min, mean, max, unix time)`` of the latest recorded sample, or None."""
        at = float(self._f[W_LAG_AT])
        if at == 0:
            return None
        return int(self._i[W_LAG_MIN]), float(self._f[W_LAG_MEAN]), int(self._i[W_LAG_MAX]), at

    def state(self) -> dict:
        """The parameters and counters; ``error`` is None while disabled (none is kept then)."""
        out = asdict(self.params)
        out.update(inserts=int(self._inserts()), samples=self.samples, error=self.error() if out["enabled"] else None,
                   reader_blocked_s=self.reader_blocked_s, reader_waits=self.reader_waits,
                   reader_refusals=self.reader_refusals)
        return out

    def _locked(self, timeout: float | None = None):
        return files.flocked(self._fd, timeout=timeout, name=str(self.path / FILE))

    def close(self) -> None:
        if self._mm is None:
            return
        self._i = self._f = None
        files.unmap(self._mm)
        self._mm = None
        files.close_lock_file(self._fd)


def _header_write_count(path: Path) -> Callable[[], int]:
    """``write_count`` read straight from ``header.bin`` (for handles without a storage)."""
    try:
        fd = os.open(path / "header.bin", os.O_RDONLY)
    except FileNotFoundError:
        raise StorageNotFound(f"no replay storage at {str(path)!r} (header.bin is missing): give the "
                              "storage's path, or inserts=") from None
    try:
        mm = mmap.mmap(fd, 8 * files.HEADER_WORDS, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    words = np.frombuffer(mm, dtype=np.int64)
    return lambda: int(words[files.H_WRITE_COUNT])


# -- the worker side -------------------------------------------------------------------------
def hold_worker(limiter: Limiter, rec, beat: Callable[[], None], keep_waiting: Callable[[], bool]) -> bool:
    """Wait while the limiter holds this worker back (before a chunk). Returns whether it
    waited. ``rec`` is the worker's stats record: ``pause_reason`` says why it waits,
    ``limiter_waits`` / ``limiter_blocked_s`` count it (updated as it goes, so a worker held
    for ever shows it in status and metrics); the heartbeat stays fresh."""
    if limiter.insert_blocked() is None:
        return False
    rec["pause_reason"] = PAUSE_LIMITER
    rec["limiter_waits"] += 1
    last = time.monotonic()
    try:
        while keep_waiting() and limiter.insert_blocked() is not None:
            beat()
            time.sleep(_WORKER_POLL_S)
            now = time.monotonic()
            rec["limiter_blocked_s"] += now - last
            last = now
    finally:
        rec["limiter_blocked_s"] += time.monotonic() - last
        rec["pause_reason"] = 0
    return True

