"""Lock files trainers write (``priority.lock``, ``limiter.bin``) held by a stopped trainer:
workers keep beating while they wait, the daemon's main thread does not wait on them, rows a
dying writer committed never keep an overwritten row's priority, and trainers that drop
readers without closing them leak no descriptors (Ape-X review)."""
from __future__ import annotations

import fcntl
import gc
import multiprocessing as mp
import os
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
from sampling_rows import rows

from ingestd.errors import LockBusy, SampleTimeout
from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.replay.limiter import FILE as LIMITER_FILE, Limiter, LimiterParams
from ingestd.replay.priority import LOCK as PRIORITY_LOCK


class Held:
    """``path``'s flock taken through a description of our own, as another process would."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def test_a_writer_beats_while_a_trainer_holds_the_priority_lock(shm_dir):
    """A worker blocked in flock(priority.lock) sent no heartbeat: killed as hung, again and
    again, then marked failed for good."""
    with ReplayStorage.create(shm_dir / "r", rows(1), 1024) as store:
        beats = []
        store.lock_wait = lambda: beats.append(time.monotonic())
        held = Held(store.path / PRIORITY_LOCK)
        done = threading.Event()
        writer = threading.Thread(target=lambda: (store.write(rows(8)), done.set()))
        try:
            writer.start()
            time.sleep(0.3)
            assert not done.is_set() and len(beats) > 10
        finally:
            held.release()
        writer.join(10)
        assert done.is_set() and store.write_count == 8


def _commit_then_die(path: str) -> None:
    store = ReplayStorage.open(path)
    with store.reserved(16) as slots:
        store._commit(slots, rows(16, start=slots.first))
        os._exit(0)  # killed between the commit and entering the rows' priorities


def test_rows_a_dying_writer_committed_never_keep_the_old_rows_priority(shm_dir):
    """Their leaves kept the overwritten rows' priority, and recovery (leaves == 0) never
    matched once the ring had wrapped."""
    with ReplayStorage.create(shm_dir / "r", rows(1), 64) as store:
        store.write(rows(64))
        tree = store._priorities
        tree.update(np.arange(64), np.full(64, 1e-3))
        tree.update(np.array([63]), np.array([5.0]))  # the max new rows enter at
        child = mp.get_context("fork").Process(target=_commit_then_die, args=(str(store.path),))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert store.write_count == 80 and (store.seq[:16] % 2 == 0).all()
        assert (tree.levels[0][:16] == 0).all()  # not drawn (nor the old rows' 1e-3)
        assert store.enter_unentered(timeout=0.0) == 16  # what the daemon does when a worker died
        assert (tree.levels[0][:16] == 5.0).all() and tree.total == pytest.approx(16 * 5.0 + 47 * 1e-3 + 5.0)


def test_the_daemon_thread_never_waits_long_on_a_trainers_lock(shm_dir):
    """A limiter change (command or reload) blocked the daemon's main loop on limiter.bin while
    a stopped trainer held it: no supervision meanwhile."""
    with ReplayStorage.create(shm_dir / "r", rows(1), 64) as store:
        store.write(rows(64))
        store._priorities.clear(np.array([3]))  # one committed row not entered (a writer died)
        lim = Limiter.attach(store.path)
        held = [Held(store.path / LIMITER_FILE), Held(store.path / PRIORITY_LOCK)]
        started = time.monotonic()
        try:
            with pytest.raises(LockBusy, match="limiter.bin is locked by another process"):
                lim.configure(LimiterParams(True, 0, 1.0, -100.0, 100.0), timeout=0.1)
            with pytest.raises(LockBusy, match="priority.lock is locked by another process"):
                store.enter_unentered(timeout=0.0)
        finally:
            for h in held:
                h.release()
        assert time.monotonic() - started < 5
        assert store.enter_unentered(timeout=0.0) == 1
        assert not lim.configure(LimiterParams(False, 0, 1.0, -100.0, 100.0), timeout=0.1).enabled
        lim.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_readers_dropped_without_close_leak_no_descriptors(shm_dir):
    """Each prioritized, rate-limited reader garbage-collected without close() kept
    priority.lock and limiter.bin open: 6 -> 206 descriptors over 200 readers."""
    with ReplayStorage.create(shm_dir / "r", rows(1), 1024) as store:
        store.write(rows(64))
        ReplayReader(store.path, sampler="prioritized").sample(8)  # warm imports and caches
        gc.collect()
        before = _fds()
        for _ in range(50):
            ReplayReader(store.path, sampler="prioritized").sample(8)
        gc.collect()
        assert _fds() <= before + 2
        # and at once, without the cycle collector: a reader and its sampler referred to each
        # other, so each dropped one kept 4 descriptors and its mappings until a collection ran
        # (exhaustion review: 302 open after 5,000 readers, EMFILE at 254 kept ones)
        gc.disable()
        try:
            for _ in range(50):
                ReplayReader(store.path, sampler="prioritized").sample(8)
            assert _fds() <= before + 2
        finally:
            gc.enable()


def test_trainers_checking_together_overshoot_the_window_by_one_batch_not_one_each(shm_dir):
    with ReplayStorage.create(shm_dir / "r", rows(1), 1024) as store:
        store.write(rows(100))
        a, b = Limiter.attach(store.path), Limiter.attach(store.path)
        try:
            a.configure(LimiterParams(True, 0, 1.0, 0.0, 1000.0))  # error starts at 0: room for nothing
            store.write(rows(10))  # error 10
            assert a.take_samples(64, len(store)) == (None, 64)  # error -54
            why, taken = b.take_samples(64, len(store))  # checked after a's count, under the lock
            assert taken == 0 and "trainer is ahead" in why
            a.give_back(64)  # a's sample found nothing
            assert b.error() == 10
        finally:
            a.close()
            b.close()


def test_workers_outlast_a_trainer_stopped_inside_update_priorities(tmp_path):
    """The daemon end to end: priority.lock held for three heartbeat timeouts costs no restart,
    and collection goes on once it is released."""
    from daemon_proc import DaemonProc, wait_for

    from ingestd.control.client import ControlClient

    with DaemonProc(overrides={"workers.count": 1, "workers.heartbeat_timeout_s": 1.0}) as d:
        d.wait_ready()
        with ControlClient(d.control_address, timeout=10) as client:
            held = Held(d.replay_path / PRIORITY_LOCK)
            try:
                time.sleep(3.0)
                worker = client.status().workers[0]  # says why it collects nothing (it read plain "running")
                assert (worker.state, worker.pause_reason) == ("running", "priority_lock"), worker
                frames = worker.frames
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read()
                assert b'ingestd_worker_waiting{reason="priority_lock",worker="0"} 1.0' in metrics
            finally:
                held.release()
            wait_for(lambda: client.status().workers[0].frames > frames, 10, "collection after the release")
            worker = client.status().workers[0]
            assert worker.restarts == 0 and worker.state == "running" and worker.pause_reason == "", worker


def test_recovery_at_start_never_waits_for_a_trainers_priority_lock(shm_dir):
    """Operator review: a daemon started while a trainer was stopped inside update_priorities
    blocked in flock(priority.lock) before any log line, until the trainer went on (under
    systemd: killed at TimeoutStartSec, restarted, failed). Recovery now clears the dead slots'
    leaves without the lock and leaves the tree's re-sum to the daemon's main loop."""
    path = shm_dir / "r"
    with ReplayStorage.create(path, rows(1), 1000) as store:
        store.write(rows(100))
        store.seq[10:20] += 1  # as writers killed mid-write leave them
    held = Held(path / PRIORITY_LOCK)
    result: list = []
    try:
        opener = threading.Thread(target=lambda: result.append(ReplayStorage.open(path, recover=True)), daemon=True)
        opener.start()
        opener.join(10)
        assert result, "opening with recovery waited on the trainer's priority.lock"
        store = result[0]
        assert (store.seq[10:20] == 0).all() and (store._priorities.levels[0][10:20] == 0).all()
    finally:
        held.release()
    store.enter_unentered(timeout=1.0)  # what the daemon's main loop does once the lock is free
    with ReplayReader(path, sampler="prioritized") as reader:
        drawn = reader.sample(512).get(("ingestd", "write_index")).numpy()
        assert not np.isin(drawn, np.arange(10, 20)).any()
    store.close()


@pytest.mark.parametrize("lock", ["priority.lock", "limiter.bin"])
def test_an_interrupt_as_the_lock_is_taken_leaves_it_free(shm_dir, monkeypatch, lock):
    """Trainer review: a Ctrl-C landing as flock() returned (before the try that unlocks) left
    priority.lock or limiter.bin held by an idle trainer: workers stopped writing and other
    trainers hung until it called again or exited."""
    from ingestd.replay import files

    real = fcntl.flock

    def interrupted(fd, op):
        real(fd, op)
        if op & fcntl.LOCK_EX:
            raise KeyboardInterrupt  # as Python delivers a SIGINT after the call returned

    store = ReplayStorage.create(shm_dir / "r", rows(1), 64)
    store.write(rows(8))
    with store, ReplayReader(store.path, sampler="prioritized") as r:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        call = ((lambda: r.update_priorities([0], [2.0])) if lock == "priority.lock"
                else (lambda: lim.configure(LimiterParams(True, 0, 1.0, -100.0, 100.0))))
        monkeypatch.setattr(files.fcntl, "flock", interrupted)
        with pytest.raises(KeyboardInterrupt):
            call()
        monkeypatch.undo()
        fd = os.open(store.path / lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's view: free
        finally:
            os.close(fd)
        lim.close()


def test_a_limiter_change_while_a_trainer_holds_limiter_bin_answers_busy():
    """A trainer stopped inside a sample holds ``limiter.bin``: ``ingestctl limiter --spi 2`` got no
    reply (the main thread's ``LockBusy``, a ``TimeoutError``, was taken for the futures' wait
    running out and re-raised in a loop until the daemon stopped), and the client gave up after
    its 5 s while the daemon retried for its 10 (control review). It gets ``busy`` within its
    own wait, the daemon keeps answering, and the change goes through once the trainer lets go."""
    from daemon_proc import DaemonProc

    from ingestd.control.client import ControlClient
    from ingestd.errors import CommandFailed

    with DaemonProc(overrides={"workers.count": 1}) as d:
        d.wait_ready()
        held = Held(d.replay_path / LIMITER_FILE)
        try:
            with ControlClient(d.control_address, timeout=3, ack_timeout=1.0) as client:
                started = time.monotonic()
                with pytest.raises(CommandFailed, match="limiter.bin") as err:
                    client.limiter(samples_per_insert=3.0)
                assert err.value.code == "busy" and time.monotonic() - started < 8
                assert client.status().workers  # the daemon still answers
        finally:
            held.release()
        with ControlClient(d.control_address, timeout=10) as client:
            assert client.limiter(samples_per_insert=3.0).samples_per_insert == 3.0


def test_a_reload_while_a_trainer_holds_limiter_bin_is_busy_not_a_refused_file_and_sighup_retries():
    """A reload with a limiter change while a trainer held ``limiter.bin`` was reported as a config
    error naming a key 'limiter', set ``ingestd_config_last_reload_successful`` to 0 (the alert then
    said the next start would fail on a good file), and a SIGHUP's reload was dropped (ops review).
    The command answers ``busy``, the metric stays 1, and a SIGHUP's reload is tried again."""
    import signal

    from daemon_proc import DaemonProc, wait_for
    from test_limiter import _metric

    from ingestd.control.client import ControlClient
    from ingestd.errors import CommandFailed

    with DaemonProc(overrides={"workers.count": 1}) as d:
        d.wait_ready()
        with ControlClient(d.control_address, timeout=10) as client:
            held = Held(d.replay_path / LIMITER_FILE)
            try:
                d.config_path.write_text("[limiter]\nenabled = true\nmin_size = 10\n[workers]\nrestart_budget = 7\n")
                with pytest.raises(CommandFailed, match="limiter.bin") as err:
                    client.reload()
                assert err.value.code == "busy" and "it is fine" in err.value.message
                assert client.config()["workers"]["restart_budget"] == 5  # nothing applied
                assert _metric(d.metrics_port, "ingestd_config_last_reload_successful") == 1
                d.proc.send_signal(signal.SIGHUP)
                wait_for(lambda: "trying again in" in d.log(), 10, "the SIGHUP's reload to be retried")
            finally:
                held.release()
            wait_for(lambda: client.config()["workers"]["restart_budget"] == 7, 15, "the retried reload")
            assert client.config()["limiter"]["enabled"] is True
            assert _metric(d.metrics_port, "ingestd_config_last_reload_successful") == 1


def test_a_trainer_stopped_holding_the_limiter_or_priority_lock_never_blocks_another_past_its_timeout(shm_dir):
    """With the limiter on, every sample took limiter.bin's flock with no time limit, so another
    trainer stopped inside a call (Ctrl-Z, a debugger) made ``sample(n, timeout=0.5)`` and
    ``sample(n)`` block for ever; ``update_priorities`` had no timeout at all (sampling review)."""
    with ReplayStorage.create(shm_dir / "r", rows(1), 64) as store:
        store.write(rows(64))
        lim = Limiter.attach(store.path)
        lim.configure(LimiterParams(True, 0, 1.0, -1e6, 1e6))
        lim.close()
        with ReplayReader(store.path, sampler="prioritized") as r:
            batch = r.sample(4)
            held = [Held(store.path / LIMITER_FILE), Held(store.path / PRIORITY_LOCK)]
            try:
                started = time.monotonic()
                with pytest.raises(SampleTimeout, match="limiter.bin is locked"):
                    r.sample(4, timeout=0.5)
                with pytest.raises(LockBusy, match="limiter.bin is locked"):
                    r.sample(4)  # no timeout: at once, but for a lock held past READER_LOCK_WAIT_S
                with pytest.raises(LockBusy, match="priority.lock is locked"):
                    r.update_priorities(batch, torch.ones(4), timeout=0.2)
                assert time.monotonic() - started < 5
            finally:
                for h in held:
                    h.release()
            assert r.sample(4, timeout=1.0).batch_size[0] == 4
            assert r.update_priorities(batch, torch.ones(4), timeout=1.0) == 4
