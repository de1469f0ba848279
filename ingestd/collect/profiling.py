"""Worker profiling on command: ``ingestctl profile WORKER --seconds S``.

The request travels through the worker's stats record, like every other
order: the daemon writes ``profile_path`` and ``profile_seconds``, then bumps
``profile_seq``. The worker polls between chunks; on a new ``profile_seq`` it
starts a ``torch.profiler`` (CPU activities) and keeps collecting; once the
seconds have passed it writes a Chrome trace to the path and sets
``profile_done = profile_seq`` (``-profile_seq`` and an ``error: ...`` text in
``profile_path`` if it could not). Each chunk is a ``ingestd.worker.chunk``
range in the trace.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("ingestd.worker")

PATH_BYTES = 256
CHUNK_RANGE = "ingestd.worker.chunk"
DEFAULT_SECONDS = 1.0  # a second of a 256-env CartPole worker: ~120 chunks, a ~120 MB trace
MAX_SECONDS = 30.0  # traces go to the runtime dir, RAM under systemd: ~3.6 GB at this length


def write_allowance(seconds: float) -> float:
    """How long stopping the profiler and writing the trace of ``seconds`` may take, both
    holding the GIL: torch's ``profiler.stop()`` 2.5 s for each profiled second of a 256-env
    CartPole worker here (8.2 s for 3 s), then the export 0.7-0.9 s a second."""
    return 30.0 + 10.0 * seconds


class ProfileRequests:
    """The worker's side: polled once per loop iteration."""

    def __init__(self, rec, worker: int, beat: Callable[[], None]):
        """``beat``: the worker's heartbeat, called once a trace is written (the write itself runs
        under a lease: ``finish``)."""
        self.rec, self.worker, self._beat = rec, worker, beat
        self._profiler = None
        self._until = self._seconds = 0.0
        self._seq = 0
        self._path = ""
        self._started = 0.0
        # a request pending now is this worker's own: one left by a dead predecessor was answered
        # as failed when the supervisor started this process (fail_pending)

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def poll(self) -> None:
        rec = self.rec
        if self._profiler is None:
            seq = int(rec["profile_seq"])
            if seq != abs(int(rec["profile_done"])):  # -seq: answered with a failure, not a new request
                self._start(seq, bytes(rec["profile_path"]).decode("utf-8", "replace"),
                            float(rec["profile_seconds"]))
        elif time.monotonic() >= self._until:
            self.finish()

    def chunk(self):
        """A context marking one chunk in the trace (nothing while no profile runs)."""
        if self._profiler is None:
            return contextlib.nullcontext()
        import torch

        return torch.profiler.record_function(CHUNK_RANGE)

    def _start(self, seq: int, path: str, seconds: float) -> None:
        import torch

        self._seq, self._path, self._seconds = seq, path, seconds
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.start()
        except Exception as exc:  # a profile must never take the worker down
            self._fail(f"could not start the profiler: {exc}")
            return
        self._profiler = profiler
        self._started = time.monotonic()
        self._until = self._started + seconds
        log.info("worker %d: profiling for %.1f s into %s", self.worker, seconds, path)

    def finish(self) -> None:
        """Stop a running profile and write its trace (also called when the worker stops)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        try:  # stopping and writing take longer than the heartbeat timeout: not a hang (it was killed as one)
            # torch's stop() and export hold the GIL for seconds, so no thread can beat (a keepalive
            # thread did not get to run): the heartbeat word is set ahead instead, a lease the
            # supervisor honours as a recent beat
            recorded = max(self._seconds, time.monotonic() - self._started)  # a long chunk records past S
            self.rec["heartbeat"] = time.monotonic() + write_allowance(recorded)
            profiler.stop()
            tmp = f"{self._path}.tmp{os.getpid()}"
            profiler.export_chrome_trace(tmp)
            os.replace(tmp, self._path)
        except Exception as exc:
            self._fail(f"could not write the trace: {exc}")
            return
        finally:
            self._beat()  # the lease ends with the write
        log.info("worker %d: profile written to %s", self.worker, self._path)
        self.rec["profile_done"] = self._seq

    def _fail(self, message: str) -> None:
        log.warning("worker %d: profile %d failed: %s", self.worker, self._seq, message)
        answer_failed(self.rec, self._seq, message)


def answer_failed(rec, seq: int, message: str) -> None:
    """Answer request ``seq`` as failed: ``error: message`` in the path word, ``-seq`` done."""
    rec["profile_path"] = f"error: {message}".encode("utf-8", "replace")[:PATH_BYTES]
    rec["profile_done"] = -seq


def fail_pending(rec) -> None:
    """The supervisor's side, as it starts a worker process: a request still pending was its dead
    predecessor's, which will never write the trace. Answered as failed here, before the new
    process exists: the new worker marked it done (the daemon answered with the path of a trace
    never written), and a new worker cannot tell an old request from one sent while it starts."""
    seq = int(rec["profile_seq"])
    if seq != abs(int(rec["profile_done"])):
        answer_failed(rec, seq, "the worker's process ended before it wrote the trace (restarted since); ask again")


def request(rec, path: str | os.PathLike, seconds: float) -> int:
    """The daemon's side: order a profile from the worker owning ``rec``; returns its sequence number."""
    encoded = os.fsencode(path)
    if len(encoded) >= PATH_BYTES:
        raise ValueError(f"profile path {path} is longer than {PATH_BYTES - 1} bytes")
    seq = max(int(rec["profile_seq"]), int(rec["profile_done"]), abs(int(rec["profile_done"]))) + 1
    rec["profile_path"] = encoded
    rec["profile_seconds"] = float(seconds)
    rec["profile_seq"] = seq  # last: the worker reads path and seconds once it sees this
    return seq


KEEP_TRACES = 8  # traces kept in <runtime_dir>/profiles (RAM under systemd: /run), the new one included


def prune(folder: Path, keep: int = KEEP_TRACES) -> list[Path]:
    """Make room for one more trace in ``folder``: remove all but the newest ``keep - 1`` traces,
    and partial ones (``*.tmp<pid>``) whose writer is gone. Returns what was removed."""
    from ingestd.collect.stats import pid_alive

    try:
        entries = [(entry, entry.stat(follow_symlinks=False)) for entry in os.scandir(folder)
                   if entry.is_file(follow_symlinks=False)]
    except OSError:  # no folder yet, or one this process cannot list: nothing to remove
        return []
    traces = [e for e, _ in sorted(((e, st) for e, st in entries
                                    if e.name.startswith("worker") and e.name.endswith(".json")),
                                   key=lambda item: item[1].st_mtime)]
    stale = [e for e, _ in entries if ".json.tmp" in e.name and not pid_alive(_writer(e.name))]
    removed = []
    for entry in traces[:max(0, len(traces) - (keep - 1))] + stale:
        with contextlib.suppress(OSError):  # removed meanwhile, or not ours to remove
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def _writer(name: str) -> int:
    """The pid in a partial trace's name (``<trace>.json.tmp<pid>``), 0 if there is none."""
    pid = name.rsplit(".tmp", 1)[1]
    return int(pid) if pid.isdigit() else 0


def outcome(rec, seq: int) -> tuple[bool, str] | None:
    """``(ok, path or error)`` once the worker answered request ``seq``, else ``None``."""
    done = int(rec["profile_done"])
    if done == seq:
        return True, bytes(rec["profile_path"]).decode("utf-8", "replace")
    if done == -seq:
        return False, bytes(rec["profile_path"]).decode("utf-8", "replace")
    return None
