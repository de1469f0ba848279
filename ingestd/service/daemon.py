"""The daemon: builds the layout, runs the supervisor in the main thread,
talks to systemd, and serves commands submitted by other threads."""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from typing import Callable, Mapping

import torch

from ingestd.collect.inherited import daemon_only
from ingestd.collect.stats import WAITS, Desired, PauseReason, State
from ingestd.errors import ConfigError, LockBusy
from ingestd.service.config import toml_value, with_overrides
from ingestd.service.instance import Claim, claim_instance
from ingestd.service.layout import Layout, build_layout
from ingestd.service.notify import Notifier, unset_environment
from ingestd.service.signals import EARLY_SIGHUP
from ingestd.service.supervisor import RestartPolicy, Supervisor
from ingestd.service.telemetry import Telemetry

log = logging.getLogger("ingestd.daemon")

TICK_S = 0.02
STATUS_EVERY_S = 5.0


def _may_write(rec) -> bool:
    """Whether a worker (its stats record) is starting or collecting: not failed, not paused,
    not held back by the rate limiter."""
    state = int(rec["state"])
    if state in (State.FAILED, State.PAUSED):
        return False
    return not (state == State.RUNNING and int(rec["pause_reason"]) == PauseReason.LIMITER)


RELOAD_LOCK_TRY_S = 0.5  # a reload waits this long at most for limiter.bin, which trainers lock
RELOAD_RETRY_S, RELOAD_RETRIES = 2.0, 15  # a SIGHUP's reload that found it locked: tried again so

class Daemon:
    """One running ingestd. ``run()`` blocks until a stop is requested."""

    def __init__(self, config, config_path: str | None, overrides: tuple[str, ...],
                 environ: Mapping[str, str], clock: Callable[[], float] = time.monotonic):
        from ingestd.service.config import resolve_paths

        self.config, self.config_path, self.overrides = config, config_path, tuple(overrides)
        self.environ, self.clock = environ, clock
        self.paths = resolve_paths(config, environ)
        self.notifier = Notifier(environ)
        self.started_at = time.time()
        self.telemetry = Telemetry()
        self.telemetry.observe_reload(True, self.started_at)  # the config read at start counts as applied
        # run first by every reload (command or SIGHUP), whatever becomes of the config file;
        # each returns fields for the reply and the config.reloaded event (the CURVE keys' count)
        self.reload_hooks: list[Callable[[], dict]] = []
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set by submit() so commands do not wait out a tick
        self._stop_requested = False
        self._reload_requested = False
        self._reload_retry_at: float | None = None  # (retry_reload) when a SIGHUP's reload is tried again
        self._reload_retries = 0
        # how a SIGHUP's reload runs once the control server is up: behind its lock, as the reload
        # command (run here, between supervisor ticks, it undid a scale or restart a command was
        # waiting on, which then timed out saying its request stayed in effect)
        self.reload_runner: Callable[[], None] | None = None
        # set when a worker died (see _repair_priorities), and at start: the recovery may have found
        # priority.lock held by a trainer and left the tree's repair to the main loop
        self._priorities_to_repair = True
        self._ready = False  # READY=1 sent (the workers wrote, or none ever will)
        self._listeners: list[Callable[..., None]] = []
        self.layout: Layout | None = None
        self.supervisor: Supervisor | None = None
        self.services: list = []  # started after the layout; each has start(daemon) and stop()
        self.claim: Claim | None = None  # the instance locks (ingestd.service.instance)

    # -- cross-thread entry points ------------------------------------------------------
    def submit(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` in the main thread at the next tick (for commands that fork or scale)."""
        future: Future = Future()
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def request_stop(self) -> None:
        self._stop_requested = True

    def subscribe(self, listener: Callable[..., None]) -> None:
        """``listener(kind, **fields)`` gets every supervisor/daemon event."""
        self._listeners.append(listener)

    def emit(self, kind: str, **fields) -> None:
        log.info("event %s %s", kind, json.dumps(fields, default=str))  # JSON: what a log search can parse
        if kind == "worker.died":  # it may have died between its commit and entering the rows' priorities
            self._priorities_to_repair = True
        for listener in self._listeners:
            try:
                listener(kind, **fields)
            except Exception:  # a broken listener must not take the daemon down
                log.exception("event listener failed for %s", kind)

    # -- lifecycle ------------------------------------------------------------------------
    def run(self) -> int:
        torch.set_num_threads(1)  # the daemon forks workers: keep OpenMP's pool unstarted here
        unset_environment(os.environ)  # the Notifier has read them; workers must not inherit them
        self._install_signals()
        if self.claim is None:  # (``ingestd run`` claimed them before importing torch)
            self.claim = claim_instance(self.paths)
        self.layout = build_layout(self.config, self.paths, stopping=lambda: self._stop_requested)
        self._first_write_count = self.layout.storage.write_count  # a reopened replay's rows are not this run's
        self._pins = [pin_dir(d) for d in (self.paths.runtime_dir, self.paths.data_dir, self.paths.replay)]
        w = self.config.workers
        self.supervisor = Supervisor(self.layout.worker_spec, self.layout.stats, restart_policy(w),
                                     on_event=self.emit, clock=self.clock,
                                     incarnation=self.layout.storage.next_incarnation)
        try:
            for service in self.services:
                service.start(self)
            self.supervisor.scale(w.count)
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _loop(self) -> None:
        start_count = self.layout.storage.write_count
        next_status = 0.0
        while not self._stop_requested:
            now = self.clock()
            self.supervisor.tick()
            self._run_calls()
            if self._priorities_to_repair:
                self._repair_priorities()
            if self._reload_retry_at is not None and now >= self._reload_retry_at:
                self._reload_retry_at, self._reload_requested = None, True
            if self._reload_requested:
                self._reload_requested = False
                if self.reload_runner is not None:
                    self.reload_runner()
                else:
                    try:
                        self.reload()
                    except ConfigError:
                        pass  # logged by reload(); the running config stays, as after a failed reload command
                    except LockBusy:
                        self.retry_reload()
            if not self._ready and self._first_data(start_count):
                self._ready = True
                self.notifier.ready(self.status_line())
                log.info("ready: %s", self.status_line())
            if self._ready and now >= next_status:
                self.notifier.status(self.status_line())
                next_status = now + STATUS_EVERY_S
            self.notifier.watchdog(now)
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _first_data(self, start_count: int) -> bool:
        """Whether to tell systemd READY: the workers wrote, or none of them is going to write
        now (each failed, paused, e.g. by a ``workers.total_frames`` budget a reused replay had
        already reached, or held back by the rate limiter): systemd then sees the daemon up
        and its status, instead of a start that times out and restarts it in a loop."""
        if self.layout.storage.write_count > start_count:
            return True
        records = self.layout.stats.records
        return not any(_may_write(records[i]) for i in self.supervisor.slots)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def _shutdown(self) -> None:
        self.notifier.stopping()
        log.info("stopping: draining workers (deadline %.1f s)", self.config.service.stop_timeout_s)
        if self.supervisor is not None:
            clean = self.supervisor.stop_all(self.config.service.stop_timeout_s)
            if not clean:
                log.warning("some workers had to be terminated")
        self._run_calls()  # answer anything still queued (they see a stopped daemon)
        for service in reversed(self.services):
            try:
                service.stop()
            except Exception:
                log.exception("error while stopping %s", type(service).__name__)
        if self.layout is not None:
            self.layout.close()
        self.notifier.close()
        log.info("stopped")

    def _install_signals(self) -> None:
        def stop(signum, frame):
            log.info("received %s", signal.Signals(signum).name)
            self._stop_requested = True

        def reload(signum, frame):
            log.info("received SIGHUP: reloading the config")
            self._reload_requested, self._reload_retries = True, 0

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGHUP, reload)
        if EARLY_SIGHUP.is_set():  # a SIGHUP during start-up (the torch import): the file may have changed
            log.info("a SIGHUP arrived while starting: reloading the config")
            self._reload_requested = True

    def _repair_priorities(self) -> None:
        """Rows a dead worker committed but did not enter in the priority tree enter it now
        (they are not drawn by prioritized readers until then). ``priority.lock`` is
        trainer-writable: a trainer stopped inside ``update_priorities`` holds it, so this tries
        without blocking the main loop, and again at the next tick."""
        try:
            entered = self.layout.storage.enter_unentered(timeout=0.0)
        except LockBusy:
            return
        self._priorities_to_repair = False
        if entered:
            log.info("%d row(s) a dead worker had committed entered the priority tree", entered)

    def retry_reload(self) -> None:
        """A SIGHUP's reload found ``limiter.bin`` locked by a trainer (LockBusy): nothing was
        applied and no one is there to try again, so it is tried again in ``RELOAD_RETRY_S``,
        ``RELOAD_RETRIES`` times at most (any thread: two stores the main loop reads)."""
        if self._reload_retries >= RELOAD_RETRIES:
            log.error("reload on SIGHUP: limiter.bin stayed locked for %d tries; nothing of the file was applied: "
                      "reload again (systemctl reload ingestd) once the trainer lets go", RELOAD_RETRIES + 1)
            return
        self._reload_retries += 1
        log.warning("reload on SIGHUP: trying again in %g s (%d of %d)", RELOAD_RETRY_S, self._reload_retries,
                    RELOAD_RETRIES)
        self._reload_retry_at = self.clock() + RELOAD_RETRY_S

    # -- operations (main thread) -----------------------------------------------------------
    def reload(self) -> dict:
        """Re-read the config file; apply what can change live, report the rest. The reload
        hooks run first, whatever becomes of the file."""
        if self._ready:  # before the first READY=1, a reload is part of starting up: nothing to tell
            self.notifier.reloading()
        extra: dict = {}
        for hook in self.reload_hooks:
            extra.update(hook())
        try:
            result = self._reload(extra)
        except LockBusy as exc:  # the file is fine: the metrics do not say it is refused (an alert fired)
            exc.reload_extra = extra
            raise
        except Exception as exc:
            exc.reload_extra = extra  # the reply says what the hooks did all the same (keys re-read)
            self.telemetry.observe_reload(False, time.time())  # the metrics say the file on disk is refused
            raise
        self.telemetry.observe_reload(True, time.time(), tuple(result["not_applied"]))
        return result

    def _reload(self, extra: dict) -> dict:
        from ingestd.service.config import load_config, reloadable_diff

        try:
            new = load_config(self.config_path, self.overrides)
        except Exception as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            self._reloaded()
            raise
        applied, needs_restart = reloadable_diff(self.config, new)
        try:  # what would run: the file's live keys with the running values of the others
            checked = with_overrides(_with_live(self.config, new, applied), ())
        except ConfigError as exc:
            log.error("reload refused, keeping the running config: %s (with the running values of the keys that "
                      "need a restart: %s)", exc, ", ".join(needs_restart) or "none")
            self._reloaded()
            raise ConfigError(exc.key, f"{exc.message}; with the running values of the keys that need a restart "
                                       f"({', '.join(needs_restart) or 'none changed'}), so nothing was applied: "
                                       "restart the daemon to apply the file") from None
        if any(key.startswith("limiter.") for key in applied) and self.layout.limiter is not None:
            from ingestd.replay.limiter import params_of

            try:  # first: nothing else is applied if it cannot be (never wait long in the main loop)
                self.layout.limiter.configure(params_of(new.limiter), timeout=RELOAD_LOCK_TRY_S)
            except LockBusy as exc:
                log.error("reload not applied, keeping the running config: %s", exc)
                self._reloaded()
                raise LockBusy(f"{exc}; nothing of the file was applied (it is fine): reload again once the "
                               "trainer lets go") from None
        if "service.log_level" in applied:
            logging.getLogger("ingestd").setLevel(new.service.log_level.upper())
        self.adopt(checked)  # first: workers started by the scale are made from it (their thread share)
        if "workers.count" in applied:
            self.supervisor.scale(new.workers.count)
        self.supervisor.policy = restart_policy(self.config.workers)
        if needs_restart:
            log.warning("reload: these changes need a restart and were not applied: %s", ", ".join(needs_restart))
        log.info("reload: applied %s", ", ".join(applied) or "nothing (no live change)")
        self._reloaded()
        self.emit("config.reloaded", applied=applied, not_applied=needs_restart, **extra)
        return {"applied": applied, "not_applied": needs_restart, **extra}

    def checked_with(self, changes: Mapping[str, object]):
        """The running config with live ``changes`` (``{"workers.count": 4}``), checked as a config
        file would be (``ConfigError`` names the rule): for changes made over the socket."""
        return with_overrides(self.config, [f"{key}={toml_value(value)}" for key, value in changes.items()])

    def adopt(self, config) -> None:
        """Make ``config`` the effective one (``ingestctl config``, the metrics, the next reload's diff)."""
        self.config = config
        self.layout.config = config

    def scale(self, count: int) -> None:
        """Run ``count`` workers (main thread): refused like a config file asking for it, e.g. when
        the replay is too small for that many writers."""
        config = self.checked_with({"workers.count": count})
        was = self.supervisor.count
        self.adopt(config)  # first: workers started by the scale are made from it (their thread share)
        self.supervisor.scale(count)
        self.emit("workers.scaled", count=count, was=was)

    def _reloaded(self) -> None:
        """READY=1 ends the RELOADING=1 state (sent only once the daemon was ready)."""
        if self._ready:
            self.notifier.ready(self.status_line())

    def set_desired(self, desired: Desired) -> None:
        self.supervisor.set_desired(desired)

    def status_line(self) -> str:
        """``STATUS=``: workers collecting out of those wanted, and why the others are not (a
        running worker held back by the limiter or waiting for a trainer's priority.lock is not
        collecting: it read "2/2 workers running" while nothing was written, ops review). The rows
        this run wrote come from the storage's count, as the replay's do (the workers' frame
        counters move a moment after each commit, so READY read "0 frames" next to a chunk's rows)."""
        stats, sup = self.layout.stats, self.supervisor
        wanted = [i for i in sup.slots if i < sup.count]  # not those a scale down retires
        states = [stats.state(i) for i in wanted]
        waiting = [int(stats[i]["pause_reason"]) for i, state in zip(wanted, states) if state == State.RUNNING]
        waiting = [reason for reason in waiting if reason in WAITS]
        others = [(states.count(State.PAUSED), "paused"),
                  (waiting.count(PauseReason.LIMITER), "held back by the limiter"),
                  (waiting.count(PauseReason.PRIORITY_LOCK), "waiting for a trainer's priority.lock"),
                  (states.count(State.FAILED), "failed")]
        storage = self.layout.storage
        written = storage.write_count
        return (f"{states.count(State.RUNNING) - len(waiting)}/{sup.count} workers running"
                f"{''.join(f', {n} {why}' for n, why in others if n)}, "
                f"{written - self._first_write_count} rows written since start, "
                f"replay {len(storage)}/{storage.capacity} rows, write_count {written}")


def pin_dir(path) -> int | None:
    """Hold a shared flock on the directory ``path`` for the daemon's lifetime: systemd-tmpfiles
    does not age anything below a directory someone holds a BSD lock on (tmpfiles.d(5)). Without
    it, the default runtime dir ``/tmp/ingestd-<uid>`` of a daemon started outside a login
    session loses its weight store, stats block and socket files to a ``/tmp`` cleanup (10 days
    on Fedora and Arch) while the daemon runs. None if the directory cannot be opened."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("cannot open %s to keep systemd-tmpfiles from ageing it: %s", path, exc)
        return None
    for _ in range(20):  # tmpfiles holds LOCK_EX only while it scans; anyone else may hold it longer
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return daemon_only(fd)
        except BlockingIOError:
            time.sleep(0.1)
        except OSError as exc:  # ENOLCK...
            log.warning("cannot lock %s to keep systemd-tmpfiles from ageing it: %s", path, exc)
            break
    else:
        log.warning("%s is locked by another process; systemd-tmpfiles may age the files in it", path)
    os.close(fd)
    return None


def restart_policy(workers) -> RestartPolicy:
    return RestartPolicy(workers.heartbeat_timeout_s, workers.restart_backoff_s, workers.restart_backoff_max_s,
                         workers.restart_budget, workers.failed_retry_s, workers.restart_reset_s)


def _with_live(old, new, applied: list[str]):
    """``old`` with only the live-applied keys taken from ``new``."""
    import dataclasses

    result = old
    for dotted in applied:
        section, key = dotted.split(".", 1)
        part = dataclasses.replace(getattr(result, section), **{key: getattr(getattr(new, section), key)})
        result = dataclasses.replace(result, **{section: part})
    return result
