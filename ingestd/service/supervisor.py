"""Spawns workers, watches exit codes and heartbeats, restarts with backoff.

Runs in the daemon's main thread (workers are forked from it, and their
``PDEATHSIG`` is tied to it). A worker that dies is restarted after an
exponential backoff; one that keeps failing (``restart_budget`` times in a
row) before it has collected for ``restart_reset_s`` is marked ``failed`` and
left alone while the others keep collecting (see ``Supervisor._count``).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

from ingestd.collect import profiling
from ingestd.collect.stats import MAX_WORKERS, Desired, State, StatsBlock
from ingestd.collect.worker import WorkerSpec, worker_main
from ingestd.service.forking import ForkContext

log = logging.getLogger("ingestd.supervisor")
HANG_DUMP_S = 0.2  # a hung worker gets this long to write its stacks before SIGKILL
EventSink = Callable[..., None]


@dataclass(frozen=True)
class RestartPolicy:
    heartbeat_timeout_s: float = 5.0
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    budget: int = 5
    failed_retry_s: float = 0.0  # a failed worker is started again after this long (0: never)
    # a death starts a fresh count and the first backoff only if the worker had been collecting
    # (written a chunk) for this long; 0: its first chunk is progress enough (see Supervisor._count)
    reset_s: float = 10.0

    def backoff(self, failures: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(max(0, failures - 1), 60))


@dataclass
class Slot:
    spec: WorkerSpec
    process: mp.process.BaseProcess | None = None
    failures: int = 0  # consecutive failures counted against the budget (see Supervisor._count)
    streak: int = 0  # consecutive deaths before collecting for reset_s: the backoff's exponent
    collecting_since: float | None = None  # when this incarnation was first seen to have written a chunk
    start_at: float | None = None  # pending (re)start time
    retiring: bool = False  # asked to stop for good (scale down)
    restarting: bool = False  # asked to stop, then start again (restart command)
    hung: bool = False  # found hung (missed heartbeat), not reaped yet (report and kill it once)
    kill_at: float | None = None  # a hung worker is SIGKILLed then, once it has dumped its stacks
    failed_at: float | None = None  # when it was marked failed (for workers.failed_retry_s)
    error_mark: tuple = ()  # (error_at, error) as this incarnation started: an error equal to it is an earlier one's


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (no error reported; SIGKILL: the OOM killer?)" if name == "SIGKILL" else \
            f"killed by {name} (no error reported)"
    return f"exited with code {code} without reporting an error (os._exit, or a crash before it could)"


class Supervisor:
    def __init__(self, make_spec: Callable[[int], WorkerSpec], stats: StatsBlock, policy: RestartPolicy,
                 on_event: EventSink = lambda kind, **f: None, clock: Callable[[], float] = time.monotonic,
                 incarnation: Callable[[], int] | None = None):
        """``incarnation``: hands out the storage's next incarnation number (its seed and episode
        ids derive from it). Taken here, in start order, so that each worker's seed does not
        depend on which of the freshly forked workers reaches the storage first; without it a
        worker takes its own."""
        self._make_spec, self.stats, self.policy = make_spec, stats, policy
        self._on_event, self._clock, self._incarnation = on_event, clock, incarnation
        self._ctx = ForkContext()
        self.slots: dict[int, Slot] = {}
        self.desired = Desired.RUN
        self._last_hang_kill = float("-inf")

    # -- commands (main thread) -------------------------------------------------
    def scale(self, count: int) -> None:
        if not 0 <= count <= MAX_WORKERS:
            raise ValueError(f"worker count must be within 0..{MAX_WORKERS}, got {count}")
        cores = len(os.sched_getaffinity(0))
        if count > cores > 0 and count > self.count:  # user review: `scale 100` on 2 cores, then "hung" kills
            log.warning("%d workers on %d cores: they take turns, each collects slower, and one kept off the cores "
                        "for longer than workers.heartbeat_timeout_s is restarted as hung; more workers than cores "
                        "only help envs that wait (I/O, a simulator in another process)", count, cores)
        for index in range(count):
            slot = self.slots.get(index)
            spec = self._make_spec(index)  # for the count now (workers.threads = 0 shares the cores out)
            self.stats[index]["threads_wanted"] = spec.threads  # a running worker applies it between chunks
            if slot is None:  # a new worker in this slot: its counters (frames, episodes, restarts)
                # go on from the slot's earlier ones, as Prometheus counters must; an old error is not its own
                self.slots[index] = Slot(spec, start_at=self._clock())
                self.stats.set_error(index, "")
                rec = self.stats[index]
                rec["desired"] = self.desired
                rec["state"], rec["pid"] = State.STARTING, 0  # not the last worker's, until the next tick starts it
                continue
            slot.spec = spec
            if slot.retiring:  # asked to stop but not gone yet: keep it, running
                slot.retiring = False
                if slot.process is not None:
                    slot.restarting = True  # it may have seen the stop already: start it again once it exits
                elif self.stats.state(index) != State.FAILED:
                    slot.start_at = self._clock()  # the scale down cancelled its pending restart
        for index, slot in self.slots.items():
            if index >= count and not slot.retiring:
                slot.retiring = True
                self.stats[index]["desired"] = Desired.STOP
                slot.start_at = None

    def restart(self, indices: list[int] | None = None) -> list[int]:
        chosen = sorted(self.slots) if indices is None else indices
        unknown = [i for i in chosen if i not in self.slots or self.slots[i].retiring]
        if unknown:
            workers = sorted(i for i, slot in self.slots.items() if not slot.retiring)
            raise KeyError(f"no such worker(s) {unknown}; workers are {workers}")
        for index in chosen:
            slot = self.slots[index]
            slot.failures = slot.streak = 0
            if self.stats.state(index) == State.FAILED:
                self._start_over(index, slot, "requested")
            elif slot.process is None:  # waiting for its restart: now
                slot.start_at = self._clock()
                self._on_event("worker.restarted", worker=index, reason="requested", after_s=0.0)
            else:
                slot.restarting = True
                self.stats[index]["desired"] = Desired.STOP
        return chosen

    def set_desired(self, desired: Desired) -> None:
        self.desired = desired
        for index, slot in self.slots.items():
            if not (slot.retiring or slot.restarting):
                self.stats[index]["desired"] = desired

    @property
    def count(self) -> int:  # also read by the control and metrics threads: iterate over a copy
        return sum(1 for s in list(self.slots.values()) if not s.retiring)

    def live(self) -> list[int]:
        """Workers whose process is alive and not on its way out."""
        return [i for i, s in list(self.slots.items()) if self._alive(s) and not s.retiring]

    # -- the watch loop ----------------------------------------------------------
    def tick(self) -> None:
        now = self._clock()
        # stalest heartbeat first: a worker stuck holding a storage lock is older than the ones
        # waiting on that lock, and killing it frees them (see _check_heartbeat)
        for index in sorted(self.slots, key=lambda i: float(self.stats[i]["heartbeat"])):
            slot = self.slots[index]
            if slot.process is not None and not slot.process.is_alive():
                self._reap(index, slot, now)
            elif slot.process is not None:
                if slot.collecting_since is None and int(self.stats[index]["chunks"]) > 0:
                    slot.collecting_since = now
                self._check_heartbeat(index, slot, now)
                if (slot.retiring or slot.restarting) and int(self.stats[index]["desired"]) != Desired.STOP:
                    self.stats[index]["desired"] = Desired.STOP  # a control thread's pause/resume raced the stop
            if (slot.failed_at is not None and self.policy.failed_retry_s > 0 and slot.process is None
                    and now - slot.failed_at >= self.policy.failed_retry_s and not slot.retiring):
                log.warning("worker %d: retrying it %.0f s after it was marked failed (workers.failed_retry_s)",
                            index, self.policy.failed_retry_s)
                self._start_over(index, slot, "retry after failed")
            if slot.start_at is not None and now >= slot.start_at and slot.process is None:
                self._start(index, slot)
            if slot.retiring and slot.process is None:
                del self.slots[index]
                self.stats[index]["state"] = State.EMPTY

    def _start_over(self, index: int, slot: Slot, reason: str) -> None:
        """Start a failed worker again with a fresh restart budget, counted like any restart:
        asked for (``restart``), or ``workers.failed_retry_s`` after it was marked failed (a
        simulator down for longer than the backoff left workers failed until an operator came;
        a crash-looping worker is retried this rarely, not every backoff)."""
        slot.failures, slot.streak, slot.failed_at = 0, 0, None
        rec = self.stats[index]
        _count_restart(rec, requested=reason == "requested")
        rec["state"], rec["pid"] = State.STARTING, 0
        slot.start_at = self._clock()
        self._on_event("worker.restarted", worker=index, reason=reason, after_s=0.0)

    def _mark_failed(self, index: int, slot: Slot, error: str) -> None:
        """Past the restart budget: no more restarts (``workers.failed_retry_s`` aside). No pid:
        the dead one may be another process's by now."""
        self.stats[index]["state"], self.stats[index]["pid"] = State.FAILED, 0
        slot.failed_at = self._clock()
        self._on_event("worker.failed", worker=index, error=error)

    def _start(self, index: int, slot: Slot) -> None:
        slot.start_at, slot.hung, slot.failed_at, slot.kill_at, slot.collecting_since = None, False, None, None, None
        self.stats.reset(index)
        profiling.fail_pending(self.stats[index])  # a profile the dead predecessor never wrote
        slot.error_mark = (float(self.stats[index]["error_at"]), bytes(self.stats[index]["error"]))
        self.stats[index]["desired"] = self.desired
        self.stats[index]["state"] = State.STARTING
        if self._incarnation is not None:
            self.stats[index]["incarnation"] = self._incarnation()
        process = self._ctx.Process(target=worker_main, args=(slot.spec,), name=f"ingestd-worker-{index}",
                                    daemon=False)
        try:
            process.start()
        except OSError as exc:  # EMFILE, EAGAIN, ENOMEM: the host is short of something; try again later
            self._start_failed(index, slot, f"could not start the worker process: {exc}")
            return
        slot.process = process
        self.stats[index]["pid"] = slot.process.pid
        self._on_event("worker.started", worker=index, pid=slot.process.pid,
                       restarts=int(self.stats[index]["restarts"]))

    def _start_failed(self, index: int, slot: Slot, error: str) -> None:
        """A fork that failed counts like a worker that died before writing."""
        slot.failures, slot.streak = slot.failures + 1, slot.streak + 1
        self.stats.set_error(index, error)
        log.error("worker %d: %s; %d consecutive failure(s)", index, error, slot.failures)
        if slot.failures >= self.policy.budget:
            self._mark_failed(index, slot, error)
            return
        slot.start_at = self._clock() + self.policy.backoff(slot.streak)

    def _reap(self, index: int, slot: Slot, now: float) -> None:
        code = slot.process.exitcode
        slot.process.join(0)
        slot.process.close()
        slot.process = None
        rec = self.stats[index]
        if slot.retiring:
            rec["state"] = State.STOPPED
            return
        if slot.restarting:
            slot.restarting = False
            _count_restart(rec, requested=True)
            slot.start_at = now
            self._on_event("worker.restarted", worker=index, reason="requested", after_s=0.0)
            return
        # killed from outside (an operator's SIGKILL or SIGTERM, the OOM killer): not its own failure; a
        # crash of its own (SIGSEGV, SIGABRT, SIGBUS...) or a hang kill is
        external = code in (-signal.SIGKILL, -signal.SIGTERM) and not slot.hung
        counted = self._count(slot, rec, now, own=not external)
        error = self.stats.error(index)
        # gone without a word (os._exit, a segfault, the OOM killer): status says how. The error word
        # keeps an earlier death's text (reset leaves it for status), which is not this one's reason:
        # a SIGSEGV after a SIGKILL was reported as "killed by SIGKILL ... the OOM killer?" (ops review)
        if not error or (float(rec["error_at"]), bytes(rec["error"])) == slot.error_mark:
            error = _exit_reason(code)
            self.stats.set_error(index, error)
        log.warning("worker %d died (%s); %d consecutive failure(s)", index, error, slot.failures)
        self._on_event("worker.died", worker=index, exitcode=code, error=error)
        if counted and slot.failures >= self.policy.budget:
            between = (f"collecting for {self.policy.reset_s:g} s (workers.restart_reset_s)" if self.policy.reset_s
                       else "writing a chunk")
            log.error("worker %d failed %d times in a row without %s in between; marked failed: %s",
                      index, slot.failures, between, error)
            self._mark_failed(index, slot, error)
            return
        _count_restart(rec, requested=False)
        # starting again after the backoff; until then status must not show the dead process as
        # running or paused, with its pid and an ever older heartbeat
        rec["state"], rec["pid"] = State.STARTING, 0
        slot.start_at = now + self.policy.backoff(slot.streak)
        self._on_event("worker.restarted", worker=index, reason=error, after_s=self.policy.backoff(slot.streak))

    def _count(self, slot: Slot, rec, now: float, own: bool) -> bool:
        """Count a death. One after collecting for ``reset_s`` starts afresh: no failure counted,
        the first backoff. One sooner grows the backoff (a worker dying a few chunks in every time was
        restarted for ever at the shortest backoff, rebuilding its env each time: 27 restarts in
        8 s), and counts against the budget if the worker failed on its own (it exited reporting
        an error, crashed on a signal of its own such as SIGSEGV, or hung) or wrote nothing; a
        worker killed from outside after it wrote (SIGKILL or SIGTERM we did not send: an
        operator, the OOM killer) is only restarted later and later, never marked failed for it.
        Returns whether the death counts against the budget."""
        since, slot.collecting_since = slot.collecting_since, None
        wrote = since is not None or rec["chunks"] > 0  # wrote, then died between two ticks: collected 0 s
        settled = wrote and (0.0 if since is None else now - since) >= self.policy.reset_s
        if settled:  # a fresh count, which this death does not start: a budget of 1 is not used up by it
            slot.failures, slot.streak = 0, 1
            return False
        counts = own or not wrote
        slot.failures = slot.failures + 1 if counts else 1
        slot.streak += 1  # (RestartPolicy.backoff caps its exponent)
        return counts

    def _check_heartbeat(self, index: int, slot: Slot, now: float) -> None:
        """Kill a worker silent for longer than the timeout. A hang kill restarts every other
        worker's clock: they may have been blocked (not beating) on the storage lock or slots the
        killed one held, which its death releases; a worker that is really hung too is killed one
        timeout later."""
        if slot.hung:
            if slot.kill_at is not None and now >= slot.kill_at:
                slot.kill_at = None
                _kill(slot.process.pid, signal.SIGKILL)
            return
        beat = float(self.stats[index]["heartbeat"])
        if now - max(beat, self._last_hang_kill) > self.policy.heartbeat_timeout_s:
            age = now - beat
            slot.hung = True
            self._last_hang_kill = now
            log.warning("worker %d (pid %d) missed its heartbeat for %.1f s; killing it (its threads' stacks "
                        "follow, from faulthandler)", index, slot.process.pid, age)
            self.stats.set_error(index, f"hung: no heartbeat for {age:.1f} s")
            self._on_event("worker.hung", worker=index, heartbeat_age_s=round(age, 3))
            _kill(slot.process.pid, signal.SIGUSR1)  # the stacks to stderr (worker_main registers it) ...
            slot.kill_at = now + HANG_DUMP_S  # ... then SIGKILL at a tick after that

    @staticmethod
    def _alive(slot: Slot) -> bool:
        return slot.process is not None and slot.process.is_alive()

    # -- shutdown -------------------------------------------------------------------
    def stop_all(self, timeout: float) -> bool:
        """stop → join → terminate → kill under one deadline; True if all exited cleanly."""
        deadline = self._clock() + timeout
        for index, slot in self.slots.items():
            self.stats[index]["desired"] = Desired.STOP
            slot.start_at = None
        procs = [s.process for s in self.slots.values() if s.process is not None]
        clean = _join_all(procs, deadline - 0.3 * timeout, self._clock)
        for proc in procs:
            if proc.is_alive():
                _kill(proc.pid, signal.SIGTERM)
        _join_all(procs, deadline - 0.1 * timeout, self._clock)
        for proc in procs:
            if proc.is_alive():
                _kill(proc.pid, signal.SIGKILL)
                proc.join(1.0)
        for index, slot in self.slots.items():
            if slot.process is not None:
                slot.process.close()
                slot.process = None
                if self.stats.state(index) != State.FAILED:
                    self.stats[index]["state"] = State.STOPPED
        return clean


def _join_all(procs, deadline: float, clock) -> bool:
    for proc in procs:
        proc.join(max(0.0, deadline - clock()))
    return all(not p.is_alive() for p in procs)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _count_restart(rec, requested: bool) -> None:
    """One restart: its reason's counter (each a metric that must never step back, so each is
    its own word bumped in one store, not a difference of two) and the total."""
    rec["requested_restarts" if requested else "failure_restarts"] += 1
    rec["restarts"] += 1
