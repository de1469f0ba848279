"""Policy lag: max_policy_lag never returns rows older than the current weights version
minus k, whatever the sampler; the lag of sampled rows is reported."""
from __future__ import annotations

import pytest
import torch
from sampling_rows import checksum_rollouts, example_rows, rows

from ingestd.errors import EmptyReplay
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
        with pytest.raises(EmptyReplay, match="policy_version >= 18"):
            r.sample(8)


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


def test_lag_needs_a_version_source(shm_dir):
    with versions_store(shm_dir / "r") as store, pytest.raises(ValueError, match="weights_path"):
        ReplayReader(store.path, max_policy_lag=1)
