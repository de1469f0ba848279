"""Policy lag: max_policy_lag never returns rows older than the current weights version
minus k, whatever the sampler; the lag of sampled rows is reported."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_rows import checksum_rollouts, example_rows, rows

from ingestd.errors import EmptyReplay, StorageNotFound
from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.weights.store import WeightStore
from ingestd.weights.wire import manifest_of

PV = ("ingestd", "policy_version")


def versions_store(path, capacity=1000):
    store = ReplayStorage.create(path, rows(1), capacity)
    for v in range(10):  # 90 rows of each version 0..9: most rows are old
        store.write(rows(90, version=v))
    return store


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_max_policy_lag_filters_old_rows(shm_dir, sampler):
    current = [9]
    with versions_store(shm_dir / "r") as store, ReplayReader(store.path, seed=0, sampler=sampler, max_policy_lag=2,
                                                              weights_version=lambda: current[0]) as r:
        for _ in range(20):
            assert int(r.sample(256).get(PV).min()) >= 7
        out = r.empty_batch(256)  # the same filter when sampling into a reused batch
        for _ in range(5):
            assert r.sample(256, out=out) is out and int(out.get(PV).min()) >= 7
        lo, mean, hi = r.last_policy_lag
        assert 0 <= lo <= mean <= hi <= 2
        current[0] = 11  # only version 9 is recent enough
        assert (r.sample(512).get(PV) == 9).all()
        current[0] = 20
        with pytest.raises(EmptyReplay, match="policy_version >= 18") as err:
            r.sample(8)
        assert "paused, failed or stopped ones write none (`ingestctl status`)" in str(err.value)


def test_without_a_filter_old_rows_come_back_and_the_reported_lag_is_theirs(shm_dir):
    with versions_store(shm_dir / "r") as store, ReplayReader(store.path, seed=0, weights_version=lambda: 9) as r:
        for _ in range(3):
            lag = 9 - r.sample(300).get(PV)
            assert int(lag.max()) > 2  # no filter: old rows come back, and the lag says so
            assert r.last_policy_lag == (int(lag.min()), pytest.approx(float(lag.double().mean())), int(lag.max()))


def test_sequences_obey_the_lag(shm_dir):
    rollouts = checksum_rollouts(2, 4, 5)
    with ReplayStorage.create(shm_dir / "r", example_rows(), 4000) as store:
        for i in range(150):  # versions 0..9, 15 chunks each
            chunk = rollouts[i % 2].chunk(0)[0]
            chunk.get(PV).fill_(i // 15)
            store.write(chunk)
        current = [9]
        with ReplayReader(store.path, seed=0, max_policy_lag=1, weights_version=lambda: current[0]) as r:
            for cross in (False, True):
                td = r.sample_sequences(32, 4, cross_episodes=cross)
                assert int(td.get(PV).min()) >= 8 and r.last_policy_lag[2] <= 1
            current[0] = 20
            with pytest.raises(EmptyReplay, match="policy_version >= 19"):
                r.sample_sequences(4, 2)


def test_weights_path_gives_the_version(shm_dir):
    state = {"w": torch.zeros(3)}
    with WeightStore.create(shm_dir / "weights", manifest_of(state)) as ws, versions_store(shm_dir / "r") as store:
        ws.publish(state, version=8)
        with ReplayReader(store.path, max_policy_lag=0, weights_path=shm_dir / "weights") as r:
            assert (r.sample(64).get(PV) >= 8).all()
            ws.publish(state, version=9)
            assert (r.sample(64).get(PV) == 9).all()


def test_the_runtime_dir_given_as_weights_path_says_which_file(shm_dir):
    """It said "has only 140 bytes; it is not a weight store"."""
    state = {"w": torch.zeros(3)}
    with WeightStore.create(shm_dir / "weights", manifest_of(state)) as ws, versions_store(shm_dir / "r") as store:
        ws.publish(state, version=1)
        with pytest.raises(StorageNotFound, match=r"is a directory.*did you mean '.*/weights'"):
            ReplayReader(store.path, max_policy_lag=0, weights_path=shm_dir)


def test_lag_needs_a_version_source(shm_dir):
    with versions_store(shm_dir / "r") as store, pytest.raises(ValueError, match="weights_path"):
        ReplayReader(store.path, max_policy_lag=1)


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_a_lag_filter_that_rejects_most_rows_redraws_in_a_few_rounds(shm_dir, sampler):
    """With 28 % of the rows recent enough, a batch took ~16 rounds of copy-and-reject (each
    round re-drew only the rejected rows, and 72 % of those were rejected again: a trainer's
    sampling fell from 806 to 226 calls/s in the SAC review). Re-draws now oversample and leave
    out rows whose stamp is too old before copying."""
    with ReplayStorage.create(shm_dir / "r", rows(1), 10_000) as store:
        store.write(rows(7200, version=0))
        store.write(rows(2800, version=3))
        with ReplayReader(store.path, seed=0, sampler=sampler, max_policy_lag=0, weights_version=lambda: 3) as r:
            copies = []
            real = r._copy
            r._copy = lambda *a, **k: copies.append(1) or real(*a, **k)
            counts = []
            for _ in range(20):
                copies.clear()
                assert (r.sample(256).get(PV) == 3).all()
                counts.append(len(copies))
            assert max(counts) <= 3, counts  # the first copy, one re-draw, rarely a second


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_rare_recent_rows_are_found_by_either_sampler(shm_dir, sampler):
    """Right after a push only a few rows are recent enough: after the rejection rounds both
    samplers list the eligible slots and draw among them (the prioritized one by priority)."""
    with ReplayStorage.create(shm_dir / "r", rows(1), 2000) as store:
        store.write(rows(1995, version=0))
        store.write(rows(5, version=5))  # 0.25 % of the rows
        with ReplayReader(store.path, seed=0, sampler=sampler, max_policy_lag=0, weights_version=lambda: 5) as r:
            for _ in range(3):
                assert (r.sample(256).get(PV) == 5).all()


def test_weights_path_follows_a_store_a_new_daemon_made(shm_dir, monkeypatch):
    """A new daemon that cannot reopen the old weight store (another policy shape) makes a new
    file at the same path; a trainer's reader must read versions from it, not from the old
    mapping frozen at its last version."""
    from ingestd.weights.follow import FollowedStore

    monkeypatch.setattr(FollowedStore, "CHECK_S", 0.0)
    small, large = {"w": torch.zeros(3)}, {"w": torch.zeros(5)}
    path = shm_dir / "weights"
    with versions_store(shm_dir / "r") as store:
        with WeightStore.create(path, manifest_of(small)) as old:
            old.publish(small, version=5)
            with ReplayReader(store.path, max_policy_lag=0, weights_path=path) as r:
                assert int(r.sample(64).get(PV).min()) >= 5
                with WeightStore.create(path, manifest_of(large)) as new:  # replaces the file
                    new.publish(large, version=9)
                    assert (r.sample(64).get(PV) == 9).all()
                    assert r.last_policy_lag == (0, 0.0, 0)
                path.unlink()  # the daemon stopped and its runtime dir went: the last store still counts
                assert (r.sample(64).get(PV) == 9).all()


@pytest.mark.parametrize("lag", [None, 3])
def test_a_timeout_must_be_seconds(shm_dir, lag):
    """A NaN deadline would never pass (a NaN timeout on an empty storage waited for ever);
    a negative or a string timeout is a caller's mistake, not 0."""
    with versions_store(shm_dir / "r") as store, ReplayReader(store.path, max_policy_lag=lag,
                                                              weights_version=lambda: 9) as r:
        for bad in (float("nan"), -1.0):
            with pytest.raises(ValueError, match="timeout must be >= 0"):
                r.sample(4, timeout=bad)
        with pytest.raises(TypeError, match="timeout must be a number"):
            r.sample(4, timeout="1")
        assert r.sample(4, timeout=0).batch_size == (4,)
        assert r.sample(4, timeout=float("inf")).batch_size == (4,)


def test_sampling_arguments_are_checked(shm_dir):
    from ingestd.errors import ClosedError

    with versions_store(shm_dir / "r") as store:
        with pytest.raises(TypeError, match="max_policy_lag must be a whole number"):
            ReplayReader(store.path, max_policy_lag=1.5, weights_version=lambda: 9)
        with pytest.raises(ValueError, match="finite"):
            ReplayReader(store.path, sampler="prioritized", beta=float("inf"))
        r = ReplayReader(store.path)
        r.close()
        with pytest.raises(ClosedError):
            r.empty_batch(4)


def test_the_eligible_slots_follow_new_rows_without_a_rescan(shm_dir, monkeypatch):
    """After the one scan for a lag bound, rows written since join the candidates (they are the
    recent ones); a new bound scans again. (The scan is the fallback after _REJECT_ROUNDS rounds
    of rejection: taken at the first here.)"""
    from ingestd.replay import sampling as sampling_module

    monkeypatch.setattr(sampling_module, "_REJECT_ROUNDS", 1)
    with ReplayStorage.create(shm_dir / "r", rows(1), 4000) as store:
        store.write(rows(3000, version=0))
        store.write(rows(5, version=5, start=100))
        current = [5]
        with ReplayReader(store.path, seed=0, max_policy_lag=0, weights_version=lambda: current[0]) as r:
            assert set(r.sample(256).get(("ingestd", "worker")).tolist()) <= set(range(100, 105))
            sampling = r._sampling
            scans = []
            real = np.flatnonzero
            monkeypatch.setattr(np, "flatnonzero", lambda a: scans.append(a.size) or real(a))
            store.write(rows(5, version=5, start=200))  # new recent rows, after the scan
            seen = set()
            for _ in range(20):
                seen |= set(r.sample(256).get(("ingestd", "worker")).tolist())
            assert seen == set(range(100, 105)) | set(range(200, 205))
            assert not any(size >= 3000 for size in scans), scans  # no full rescan for them
            current[0] = 6
            store.write(rows(5, version=6, start=300))
            assert set(r.sample(256).get(("ingestd", "worker")).tolist()) <= set(range(300, 305))
            assert sampling._eligible_cache[0] == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed="prioritized"), "seed must be a whole number"),  # the sampler given positionally
    (dict(seed=True), "seed must be a whole number"),
    (dict(sampler="prioritized", alpha="0.5"), "alpha must be a number"),
    (dict(sampler="prioritized", beta=[0.4]), "beta must be a number"),
    (dict(max_policy_lag=2, weights_version=5), "weights_version must be a callable"),
])
def test_reader_arguments_of_the_wrong_type_are_refused_at_once(shm_dir, kwargs, message):
    """Sampling review: each was taken, then failed inside numpy or at the first sample with an
    error that did not name the argument (or, for seed=True, sampled uniformly in silence)."""
    from sampling_rows import rows

    from ingestd.replay import ReplayReader, ReplayStorage

    with ReplayStorage.create(shm_dir / "r", rows(1), 64) as store, pytest.raises(TypeError, match=message):
        ReplayReader(store.path, **kwargs)
