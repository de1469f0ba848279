"""The rate limiter: each side blocking and unblocking, live changes, window checks, and an
end-to-end daemon whose trainer stops (the workers wait visibly, and resume)."""
from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os
import threading
import time
import urllib.request

import pytest
from sampling_rows import rows

from ingestd.collect.stats import PauseReason, StatsBlock
from ingestd.errors import SampleTimeout, StorageNotFound
from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.replay.limiter import FILE, Limiter, LimiterParams, RateLimited, check_window, ensure_file, hold_worker
from ingestd.replay import limiter as lim_module
from ingestd.replay.lag_metrics import sampling_metrics
from ingestd.weights.store import WeightStore


def store_with(path, n=100, capacity=10_000):
    store = ReplayStorage.create(path, rows(1), capacity)
    if n:
        store.write(rows(n))
    return store


def test_window_must_be_wide_enough():
    check_window(LimiterParams(True, 0, 1.0, -1.0, 1.0))
    with pytest.raises(ValueError, match="narrower"):
        check_window(LimiterParams(True, 0, 4.0, 0.0, 7.9))
    with pytest.raises(ValueError, match="samples_per_insert"):
        check_window(LimiterParams(True, 0, 0.0, -10.0, 10.0))


def test_reader_blocks_while_the_trainer_is_ahead_and_unblocks_on_inserts(shm_dir):
    with store_with(shm_dir / "r", n=100) as store, ReplayReader(store.path, seed=0) as r:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        lim.configure(LimiterParams(True, min_size=50, samples_per_insert=1.0, min_diff=0.0, max_diff=200.0))
        assert lim.error() == 0
        r.sample(10)  # error 0 >= min_diff: allowed, and now -10
        assert lim.samples == 10 and lim.error() == -10
        with pytest.raises(RateLimited, match="trainer is ahead"):
            r.sample(10)
        assert lim.reader_refusals == 1 and lim.state()["reader_refusals"] == 1  # a polling trainer shows
        t0 = time.monotonic()
        with pytest.raises(SampleTimeout):
            r.sample(10, timeout=0.1)
        # the wait is counted from the first refusal, a few microseconds after the call began
        assert time.monotonic() - t0 >= 0.1 and lim.reader_blocked_s >= 0.09
        writer = threading.Timer(0.2, lambda: store.write(rows(20)))
        writer.start()
        t0 = time.monotonic()
        try:
            assert r.sample(10, timeout=5).batch_size == (10,)
            assert time.monotonic() - t0 >= 0.15
        finally:
            writer.join()  # the write may still be copying when the sample returns
        lim.close()


def test_min_size_holds_readers_but_never_workers(shm_dir):
    with store_with(shm_dir / "r", n=30) as store, ReplayReader(store.path) as r:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        lim.configure(LimiterParams(True, min_size=100, samples_per_insert=1.0, min_diff=-10.0, max_diff=-5.0))
        assert lim.insert_blocked() is None  # below min_size, even with error > max_diff
        with pytest.raises(RateLimited, match="min_size"):
            r.sample(1)
        store.write(rows(80))
        assert lim.insert_blocked() is not None
        lim.close()


def test_min_size_above_the_capacity_does_not_deadlock(shm_dir):
    """A ring smaller than min_size never holds min_size rows: readers wait until min_size rows
    were written (as workers count them), else both sides would wait for ever."""
    with store_with(shm_dir / "r", n=100, capacity=100) as store, ReplayReader(store.path) as r:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        lim.configure(LimiterParams(True, min_size=150, samples_per_insert=1.0, min_diff=-100.0, max_diff=20.0))
        with pytest.raises(RateLimited, match="min_size"):
            r.sample(1)  # 100 rows written: still too few
        store.write(rows(60))  # 160 written, 100 held; error 60 > max_diff: the workers wait
        assert lim.insert_blocked() is not None
        assert lim.sample_blocked(len(r)) is None and r.sample(50).batch_size == (50,)  # released by the trainer
        assert lim.insert_blocked() is None
        lim.close()


def test_worker_waits_visibly_and_a_sample_or_a_live_change_releases_it(shm_dir):
    stats = StatsBlock(shm_dir / "stats", create=True)
    rec = stats[0]
    with store_with(shm_dir / "r", n=100) as store, ReplayReader(store.path) as r:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        lim.configure(LimiterParams(True, min_size=0, samples_per_insert=1.0, min_diff=-100.0, max_diff=10.0))
        store.write(rows(50))  # error 50 > max_diff 10
        beats = []
        result = {}
        hold = threading.Thread(target=lambda: result.setdefault(
            "waited", hold_worker(lim, rec, lambda: beats.append(time.monotonic()), lambda: True)))
        hold.start()
        time.sleep(0.2)
        assert hold.is_alive() and rec["pause_reason"] == PauseReason.LIMITER and rec["limiter_waits"] == 1
        assert rec["limiter_blocked_s"] >= 0.1 and len(beats) > 10  # visible while it lasts
        r.sample(45)  # error 5 <= max_diff: released
        hold.join(5)
        assert not hold.is_alive() and result["waited"] and rec["pause_reason"] == 0
        # a live change takes effect at once
        store.write(rows(100))
        assert lim.insert_blocked() is not None
        hold = threading.Thread(target=hold_worker, args=(lim, rec, lambda: None, lambda: True))
        hold.start()
        time.sleep(0.05)
        lim.configure(LimiterParams(True, 0, 1.0, -100.0, 1000.0))
        hold.join(5)
        assert not hold.is_alive() and rec["limiter_waits"] == 2
        # and a pause/stop request ends the wait
        lim.configure(LimiterParams(True, 0, 1.0, -10.0, -5.0))
        store.write(rows(10))
        stop = threading.Event()
        hold = threading.Thread(target=hold_worker, args=(lim, rec, lambda: None, lambda: not stop.is_set()))
        hold.start()
        stop.set()
        hold.join(5)
        assert not hold.is_alive()
        lim.close()
    stats.close()


def test_changes_re_anchor_the_error(shm_dir):
    with store_with(shm_dir / "r", n=1000) as store:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        lim.configure(LimiterParams(True, 0, 2.0, -50.0, 50.0))
        assert lim.error() == 0  # history from before the limiter is not charged
        store.write(rows(10))
        assert lim.error() == 20
        lim.configure(LimiterParams(True, 0, 2.0, -5.0, 5.0))
        assert lim.error() == 5  # clamped into the new window
        lim.close()


def test_samples_are_counted_only_while_enabled(shm_dir):
    """A disabled limiter takes no flock per sample; enabling it re-anchors the error anyway."""
    with store_with(shm_dir / "r", n=100) as store, ReplayReader(store.path, seed=0, sampler="prioritized") as r:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        r.sample(10)  # prioritized: through the limiter-aware path even while disabled
        assert lim.samples == 0
        lim.configure(LimiterParams(True, 0, 1.0, -50.0, 50.0))
        r.sample(10)
        assert lim.samples == 10 and lim.error() == -10
        lim.configure(LimiterParams(False, 0, 1.0, -50.0, 50.0))
        r.sample(10)
        assert lim.samples == 10
        lim.close()


def test_forked_copies_of_one_handle_exclude_each_other(shm_dir):
    """A flock belongs to the open file, which fork shares: DataLoader workers sampling through
    one inherited reader counted their samples without excluding each other, and lost some."""
    per_child, children = 20_000, 2
    with store_with(shm_dir / "r", n=100) as store:
        lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
        lim.configure(LimiterParams(True, 0, 1.0, -1e15, 1e15))
        pids = []
        for _ in range(children):
            pid = os.fork()
            if pid == 0:  # numpy and fcntl only: no torch op in a forked child
                try:
                    for _ in range(per_child):
                        lim.take_samples(1, rows=100)
                finally:
                    os._exit(0)
            pids.append(pid)
        for _ in range(per_child):
            lim.take_samples(1, rows=100)
        for pid in pids:
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert lim.samples == (children + 1) * per_child
        lim.close()


def test_metrics_follow_a_reopened_storage(shm_dir):
    """The metrics read the storage handle they are given, not one closed since (a daemon
    started again in the same process, on the same path)."""
    stats = StatsBlock(shm_dir / "stats", create=True)
    try:
        for n in (100, 50):
            with ReplayStorage.open_or_create(shm_dir / "r", rows(1), 10_000) as store:
                families = {f.name: f for f in sampling_metrics(store, 0, stats)}
                assert families["ingestd_limiter_enabled"].samples[0].value == 0
                assert math.isnan(families["ingestd_limiter_error"].samples[0].value)  # disabled: no error kept
                lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
                lim.configure(LimiterParams(True, 0, 1.0, -1e6, 1e6))  # anchored at this write_count
                store.write(rows(n))
                families = {f.name: f for f in sampling_metrics(store, 0, stats)}
                assert families["ingestd_limiter_error"].samples[0].value == n  # counted through this handle
                lim.configure(LimiterParams())  # disabled again for the next round
                lim.close()
    finally:
        stats.close()


def _ensure_file_without_room(path):
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE: EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        ensure_file(path)
    except OSError:
        os._exit(3)
    os._exit(0)


def test_no_room_for_the_limiter_file_leaves_nothing_behind(shm_dir):
    child = mp.get_context("fork").Process(target=_ensure_file_without_room, args=(shm_dir,))
    child.start()
    child.join(20)
    assert child.exitcode == 3 and list(shm_dir.iterdir()) == []  # no half-written limiter.bin.<pid>.tmp


def test_a_handle_on_a_path_without_a_storage_fails_without_leaking(shm_dir):
    """Without ``inserts=`` the handle reads the storage's header.bin: where there is none, it
    fails before it opens or creates anything."""
    gc.collect()  # garbage from earlier tests that holds a descriptor closes now, not between the two counts
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(StorageNotFound, match="no replay storage"):
            Limiter.attach(shm_dir)
    assert len(os.listdir("/proc/self/fd")) == fds and not (shm_dir / FILE).exists()


# -- end to end: the trainer stops ----------------------------------------------------------------
def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
              or line.startswith(name + "{")]
    return sum(values)


def test_daemon_workers_wait_for_a_stopped_trainer_visibly_and_resume(tmp_path):
    from daemon_proc import DaemonProc, wait_for

    from ingestd.control.client import ControlClient

    overrides = {"workers.count": 2, "limiter.enabled": True, "limiter.min_size": 0,
                 "limiter.samples_per_insert": 1.0, "limiter.min_diff": -500.0, "limiter.max_diff": 300.0}
    with DaemonProc(overrides=overrides) as d:
        d.wait_ready()
        with ControlClient(d.control_address, timeout=10) as client:
            deadline = time.monotonic() + 20
            while not client.limiter().workers_blocked and time.monotonic() < deadline:
                time.sleep(0.05)
            state = client.limiter()
            assert state.enabled and state.workers_blocked and state.error > 300
            assert state.error <= 300 + 2 * 64  # overshoot: at most one chunk per worker
            time.sleep(0.3)
            assert _metric(d.metrics_port, "ingestd_limiter_workers_blocked") >= 1
            assert _metric(d.metrics_port, "ingestd_limiter_blocked_seconds_total") > 0.2
            frames = sum(w.frames for w in client.status().workers)
            time.sleep(0.3)
            assert sum(w.frames for w in client.status().workers) == frames  # held back, not dead
            workers = client.status().workers
            assert all(w.state == "running" for w in workers)
            assert all(w.pause_reason == "limiter" for w in workers if w.index in state.workers_blocked)
            # a push reaches workers held back (a trainer pushes, then samples: waiting for the
            # sample would time the push out); each writes one chunk of the new version, which a
            # trainer with max_policy_lag=0 needs before it can sample at all (it waited for ever,
            # and so did the workers: Ape-X review), then they are held again
            with WeightStore.attach(d.runtime_dir / "weights") as store:
                _, state_dict = store.read()
            pushed = client.push_weights_detailed(state_dict, wait=True, timeout_s=10)
            assert pushed.applied == [0, 1] and not pushed.deferred, pushed
            assert {w.weights_version for w in client.status().workers} == {pushed.version}
            wait_for(lambda: sum(w.frames for w in client.status().workers) == frames + 2 * 64, 10,
                     "one chunk per worker of the new version")
            with ReplayReader(d.replay_path, max_policy_lag=0, weights_path=d.runtime_dir / "weights") as r:
                batch = r.sample(64, timeout=10)
            assert (batch["ingestd", "policy_version"] == pushed.version).all()
            frames = sum(w.frames for w in client.status().workers)
            time.sleep(0.3)
            assert sum(w.frames for w in client.status().workers) == frames  # held again
            assert client.limiter().workers_blocked
            # a trainer comes back: workers move again
            with ReplayReader(d.replay_path) as r:
                r.sample(int(client.limiter().error) + 100, timeout=5)
            deadline = time.monotonic() + 10
            while sum(w.frames for w in client.status().workers) == frames and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sum(w.frames for w in client.status().workers) > frames
            # a live change through the control socket, and a bad one refused
            from ingestd.errors import CommandFailed

            with pytest.raises(CommandFailed, match="narrower"):
                client.limiter(min_diff=0.0, max_diff=1.0)
            wait_for(lambda: client.limiter().workers_blocked, 10, "the workers to be held again")
            released = client.limiter(enabled=False)  # its reply shows them released, not still held
            assert not released.enabled and released.workers_blocked == [], released
            frames = sum(w.frames for w in client.status().workers)
            wait_for(lambda: sum(w.frames for w in client.status().workers) > frames, 10,
                     "the workers to collect with the limiter off")
            assert not client.limiter().workers_blocked


def test_lag_metrics_leave_out_warm_up_rows_and_a_stale_trainer_report(shm_dir):
    """Observability review: warm-up rows (version -1) counted as current version + 1 of lag,
    and a trainer's last sampled lag stayed in limiter.bin, exported as current for ever (even
    by the next daemon)."""
    stats = StatsBlock(shm_dir / "stats", create=True)
    try:
        with ReplayStorage.open_or_create(shm_dir / "r", rows(1), 10_000) as store:
            store.write(rows(50, version=-1))
            store.write(rows(50, version=1))
            lim = Limiter.attach(store.path, inserts=lambda: store.write_count)
            lim.record_sampled_lag(0, 0.5, 1)
            families = {f.name: f for f in sampling_metrics(store, 1, stats)}
            stored = {s.labels["stat"]: s.value for s in families["ingestd_replay_policy_lag_versions"].samples}
            assert stored == {"min": 0, "mean": 0, "max": 0}
            sampled = {s.labels["stat"]: s.value for s in families["ingestd_sampled_policy_lag_versions"].samples}
            assert sampled == {"min": 0, "mean": 0.5, "max": 1}
            lim._f[lim_module.W_LAG_AT] = time.time() - 120  # reported two minutes ago
            families = {f.name: f for f in sampling_metrics(store, 1, stats)}
            assert all(math.isnan(s.value) for s in families["ingestd_sampled_policy_lag_versions"].samples)
            lim.close()
    finally:
        stats.close()


def test_a_limiter_change_reply_never_waits_past_the_callers_deadline(monkeypatch):
    """Review: after a change, the reply waits for released workers to clear their mark (up to
    _RELEASE_WAIT_S), and that wait ignored the request's deadline. A worker that never clears
    it (stopped, say) now costs the reply at most the deadline."""
    import types

    import numpy as np

    from ingestd.collect.stats import RECORD, State
    from ingestd.control import replay_handlers
    from ingestd.control.commands import SetLimiter

    stats = np.zeros(2, dtype=RECORD)
    stats["state"], stats["pause_reason"] = State.RUNNING, PauseReason.LIMITER  # both held, never cleared
    lim = types.SimpleNamespace(params=LimiterParams(enabled=True), configure=lambda p, timeout=None: p,
                                insert_blocked=lambda: None, sampled_lag=lambda: None,
                                state=lambda: dict(enabled=False, min_size=0, samples_per_insert=1.0, min_diff=0.0,
                                                   max_diff=1.0, inserts=0, samples=0, error=None,
                                                   reader_blocked_s=0.0, reader_waits=0))
    daemon = types.SimpleNamespace(layout=types.SimpleNamespace(limiter=lim, stats=stats),
                                   checked_with=lambda changes: None, adopt=lambda config: None)
    def on_main(fn, deadline):  # the change itself takes longer than the caller's wait
        time.sleep(1.5)
        fn()

    ctx = types.SimpleNamespace(daemon=daemon, slots=lambda: [0, 1], on_main=on_main,
                                publish=lambda kind, **fields: None,
                                deadline=lambda request: time.monotonic() + 1.0)  # as Context.deadline: from now
    monkeypatch.setattr(replay_handlers, "_RELEASE_WAIT_S", 60.0)
    done = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: done.append((replay_handlers.limiter(ctx, SetLimiter(enabled=False)),
                                                          time.monotonic() - started)), daemon=True)
    thread.start()
    thread.join(20)
    assert done and done[0][0]["workers_blocked"] == [0, 1]  # answered, showing them held
    # at once after the change (its deadline long past), not a fresh wait counted from then (2.5 s)
    assert done[0][1] < 2.2, done[0][1]
