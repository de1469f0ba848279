"""Sequence sampling on Checksum rows written by interleaved workers: every returned step is
verified exactly, and each sequence is one trajectory of consecutive steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from sampling_rows import checksum_rollouts, example_rows

from ingestd.collect.envs import verify_rows
from ingestd.collect.nstep import STEPS_KEY, NStep, schema_rows
from ingestd.errors import EmptyReplay, SampleTimeout
from ingestd.replay import ReplayReader, ReplayStorage

S = ("ingestd",)


def fill(path, capacity, chunks, workers=2, num_envs=4, chunk_steps=5, order=None):
    rollouts = checksum_rollouts(workers, num_envs, chunk_steps)
    store = ReplayStorage.create(path, example_rows(), capacity)
    rng = np.random.default_rng(0)
    for _ in range(chunks):  # workers write in a random order, as free-running workers do
        w = int(rng.integers(workers)) if order is None else order
        store.write(rollouts[w].chunk(0)[0])
    return store


def check_sequences(td, cross: bool, num_envs: int = 4):
    """``num_envs``: a sub-env's next episode id is that much further."""
    b, length = td.batch_size
    flat = td.reshape(-1)
    assert verify_rows(flat).all()
    g = lambda f: td.get(("ingestd", f))  # noqa: E731
    worker, env, episode, step, wi = g("worker"), g("env"), g("episode"), g("step"), g("write_index")
    assert (worker == worker[:, :1]).all() and (env == env[:, :1]).all()
    assert (wi[:, 1:] > wi[:, :-1]).all()
    done = td.get(("next", "done")).reshape(b, length)
    cont = (episode[:, 1:] == episode[:, :-1]) & (step[:, 1:] == step[:, :-1] + 1)
    if cross:
        cont |= done[:, :-1] & (episode[:, 1:] == episode[:, :-1] + num_envs) & (step[:, 1:] == 0)
    else:
        assert not done[:, :-1].any()
    assert cont.all()
    # the observation chain: a step's next observation is the following step's observation
    same_ep = episode[:, 1:] == episode[:, :-1]
    obs, nxt = td.get("observation"), td.get(("next", "observation"))
    assert (nxt[:, :-1][same_ep] == obs[:, 1:][same_ep]).all()


@pytest.mark.parametrize("cross", [False, True])
def test_sequences_are_exact_trajectories_across_chunks(shm_dir, cross):
    with fill(shm_dir / "r", capacity=4000, chunks=150) as store, ReplayReader(store.path, seed=1) as r:
        td = r.sample_sequences(64, 12, cross_episodes=cross)
        assert td.batch_size == (64, 12)
        check_sequences(td, cross)
        # chunks are 5 steps: sequences of 12 cross chunk boundaries, between other workers' chunks
        wi = td.get(("ingestd", "write_index"))
        assert ((wi[:, 1:] - wi[:, :-1]) > 4).any()
        if cross:
            assert td.get(("next", "done"))[:, :-1].any()


def test_wrapped_ring_and_overwritten_rows(shm_dir):
    # capacity small enough that the ring has wrapped many times
    with fill(shm_dir / "r", capacity=400, chunks=200) as store, ReplayReader(store.path, seed=2) as r:
        for _ in range(5):
            td = r.sample_sequences(32, 8)
            check_sequences(td, False)
            assert (td.get(("ingestd", "write_index")) >= store.write_count - store.capacity).all()


def test_a_single_worker_and_one_env(shm_dir):
    with fill(shm_dir / "r", capacity=1000, chunks=60, workers=1, num_envs=1, chunk_steps=7) as store, \
            ReplayReader(store.path, seed=3) as r:
        check_sequences(r.sample_sequences(16, 3), False, num_envs=1)
        check_sequences(r.sample_sequences(16, 20, cross_episodes=True), True, num_envs=1)


def test_never_a_slot_overwritten_mid_sequence(shm_dir):
    with fill(shm_dir / "r", capacity=400, chunks=100) as store, ReplayReader(store.path, seed=4) as r:
        real_copy = r._copy
        rollouts = checksum_rollouts(2, 4, 5, seed=9)

        def racing_copy(idx):  # a writer laps the ring between the search and the copy
            store.write(rollouts[0].chunk(0)[0])
            return real_copy(idx)
        r._copy = racing_copy
        td = r.sample_sequences(16, 6)
        check_sequences(td, False)


def test_too_long_or_empty(shm_dir):
    with fill(shm_dir / "r", capacity=1000, chunks=20) as store, ReplayReader(store.path, seed=5) as r:
        with pytest.raises(EmptyReplay):
            r.sample_sequences(4, 41)  # Checksum episodes last at most 40 steps
        with pytest.raises(SampleTimeout):
            r.sample_sequences(4, 41, timeout=0.05)
        with pytest.raises(ValueError):
            r.sample_sequences(0, 3)
        with pytest.raises(TypeError, match="cross_episodes must be True or False"):
            r.sample_sequences(4, 3, 5.0)  # a wait, as sample(4, 5.0) is: it turned crossing on
    empty = ReplayStorage.create(shm_dir / "e", example_rows(), 100)
    with empty, ReplayReader(empty.path) as r, pytest.raises(EmptyReplay):
        r.sample_sequences(2, 2)


def test_impossible_lengths_say_why(shm_dir):
    with fill(shm_dir / "r", capacity=1000, chunks=20) as store, \
            ReplayReader(store.path, seed=5, max_policy_lag=3, weights_version=lambda: 0) as r:
        r.sample(8)  # a uniform sample before: its lag filter must not explain the sequences' failure
        with pytest.raises(EmptyReplay, match="41 consecutive steps of one episode.*cross_episodes=True"):
            r.sample_sequences(4, 41)  # Checksum episodes last at most 40 steps
        with pytest.raises(ValueError, match="capacity 1000"):  # longer than the ring: refused at once
            r.sample_sequences(4, 1001, timeout=30)
        with pytest.raises(TypeError, match="integer"):
            r.sample_sequences(4, 2.0)


def test_rows_written_between_calls_and_a_ring_lapped_between_calls(shm_dir):
    # the run table is brought up to date incrementally, and rebuilt after falling a ring behind
    rollouts = checksum_rollouts(3, 4, 5, seed=11)
    with fill(shm_dir / "r", capacity=600, chunks=40) as store, ReplayReader(store.path, seed=6) as r:
        for chunks in (3, 7, 200):
            check_sequences(r.sample_sequences(32, 9), False)
            for i in range(chunks):
                store.write(rollouts[i % 3].chunk(0)[0])
        check_sequences(r.sample_sequences(32, 9, cross_episodes=True), True)


def test_layouts_the_run_table_does_not_describe(shm_dir):
    # env-major chunks and single rows: the table's guesses miss, the forward scan still finds
    # every continuation
    rollouts = checksum_rollouts(2, 4, 5, seed=12)
    with ReplayStorage.create(shm_dir / "r", example_rows(), 3000) as store, \
            ReplayReader(store.path, seed=7) as r:
        for i in range(120):
            rows = rollouts[i % 2].chunk(0)[0]
            env_major = torch.arange(rows.shape[0]).reshape(5, 4).T.reshape(-1)
            if i % 3 == 0:
                for j in range(rows.shape[0]):
                    store.write(rows[j:j + 1])
            else:
                store.write(rows[env_major])
        td = r.sample_sequences(64, 8)
        check_sequences(td, False)
        wi = td.get(("ingestd", "write_index"))
        assert ((wi[:, 1:] - wi[:, :-1]) == 1).any()  # env-major: the next step is the next row


def test_a_worker_that_stopped(shm_dir):
    # worker 0's trajectories end with its last chunk; worker 1 goes on writing after it
    rollouts = checksum_rollouts(2, 4, 5, seed=13)
    with ReplayStorage.create(shm_dir / "r", example_rows(), 5000) as store, \
            ReplayReader(store.path, seed=8) as r:
        for i in range(160):
            store.write(rollouts[0 if i < 60 and i % 2 else 1].chunk(0)[0])
        for _ in range(3):
            td = r.sample_sequences(64, 10)
            check_sequences(td, False)
        assert set(td.get(("ingestd", "worker"))[:, 0].tolist()) == {0, 1}


def test_rows_lapped_while_the_table_is_read(shm_dir):
    # a writer overwrites the oldest rows between the reader's write_count and its table update
    with fill(shm_dir / "r", capacity=400, chunks=100) as store, ReplayReader(store.path, seed=9) as r:
        r.sample_sequences(4, 2)
        runs = r._sampling._sequences._runs
        real_refresh, rollouts = runs.refresh, checksum_rollouts(2, 4, 5, seed=14)

        def lapping_refresh(wc):
            store.write(rollouts[0].chunk(0)[0])
            store.write(rollouts[1].chunk(0)[0])
            real_refresh(wc)
        runs.refresh = lapping_refresh
        for _ in range(10):  # more than a ring written meanwhile
            check_sequences(r.sample_sequences(16, 6), False)


def test_sequences_of_n_step_rows_reach_episode_ends_and_cross_them(shm_dir):
    """With ``workers.n_step = n`` a row's ("next", "done") says its episode ended within the
    row's window, so the last n-1 steps of every episode are done: a sequence must still run
    to the episode's last step, and across it with ``cross_episodes=True``."""
    n, num_envs = 3, 4
    rollouts, rng = checksum_rollouts(2, num_envs, 5, seed=15), np.random.default_rng(15)
    windows = [NStep(n, 0.9, num_envs) for _ in rollouts]
    with ReplayStorage.create(shm_dir / "r", schema_rows(example_rows(num_envs), n, 0.9), 4000) as store, \
            ReplayReader(store.path, seed=10) as r:
        for _ in range(150):
            w = int(rng.integers(2))
            store.write(windows[w](rollouts[w].chunk(0)[0]))
        for cross, length in ((False, 12), (True, 41)):  # 41: longer than any Checksum episode
            td = r.sample_sequences(32, length, cross_episodes=cross)
            g = lambda f: td.get(("ingestd", f))  # noqa: E731
            worker, env, episode, step = g("worker"), g("env"), g("episode"), g("step")
            assert (worker == worker[:, :1]).all() and (env == env[:, :1]).all()
            assert (g("write_index")[:, 1:] > g("write_index")[:, :-1]).all()
            assert (td.get("observation") == torch.stack((worker, env, episode, step), -1)).all()  # rows intact
            same = (episode[:, 1:] == episode[:, :-1]) & (step[:, 1:] == step[:, :-1] + 1)
            crossed = (episode[:, 1:] == episode[:, :-1] + num_envs) & (step[:, 1:] == 0)
            done = td.get(("next", "done")).reshape(32, length)[:, :-1]
            assert (same | (crossed & done)).all() and (crossed.any() if cross else not crossed.any())
            assert done.any()  # the steps near an episode's end are in sequences
            assert (td.get(STEPS_KEY)[..., 0] <= n).all()


def test_a_storage_without_done_flags_says_so(shm_dir):
    """A storage made through the public API with other keys than the workers' has no episode
    boundaries: a clear error, not a bare KeyError."""
    stamps = {f: torch.zeros(4, dtype=torch.int64) for f in ("worker", "env", "episode", "step", "policy_version")}
    rows = TensorDict({"observation": torch.zeros(4, 3), "next": {"observation": torch.zeros(4, 3)},
                       "ingestd": stamps}, batch_size=[4])
    with ReplayStorage.create(shm_dir / "r", rows, 100) as store, ReplayReader(store.path) as r:
        store.write(rows)
        with pytest.raises(ValueError, match=r"has no \[\('next', 'done'\)\].*sample single rows"):
            r.sample_sequences(2, 2)
