"""Collector features from TorchRL (issue 9): warm-up, seeding, episode limits, budget, n-step,
devices, threads, profiling. See docs/collector-features.md.

Unit tests check the rules on in-process rollouts; each feature also runs in the real daemon
(short runs: a frame budget makes the workers stop by themselves)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon_proc import DaemonProc, wait_for
from ingestd.collect.envs import CartPole, Gym
from ingestd.collect.envs.checksum import Checksum, episode_hash, episode_shape, mix64, reward_of
from ingestd.collect.features import (
    WARMUP_VERSION, Schedule, StepLimit, check_device, component_seeds, seeded_policy_kwargs,
)
from ingestd.collect.interfaces import EnvContext
from ingestd.collect.nstep import STEPS_KEY, NStep
from ingestd.collect.policies import MLP, Random
from ingestd.collect.rollout import Rollout
from ingestd.collect.stats import State, StatsBlock
from ingestd.control.client import ControlClient
from ingestd.errors import ConfigError
from ingestd.replay import ReplayReader
from ingestd.service.config import load_config
from ingestd.service.layout import worker_threads

CHUNK = 8 * 8  # DaemonProc's num_envs * chunk_steps


def stored_rows(path):
    """Every committed row, in write order."""
    with ReplayReader(path) as reader:
        seq = np.array(reader.seq)
        rows = reader.gather(np.flatnonzero((seq > 0) & (seq % 2 == 0)))
    return rows[torch.argsort(rows["ingestd", "write_index"])]


def wait_status(client: ControlClient, predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.status()
        if predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}: {status}")


def _workers(status) -> list[tuple]:
    return [(w.index, w.state, w.pause_reason, w.pid, w.incarnation, w.frames, w.restarts) for w in status.workers]


def budget_spent(status) -> bool:
    return bool(status.workers) and all(w.state == "paused" and w.pause_reason == "budget" for w in status.workers)


def checksum_stamps(rows):
    w, i, e, s = (rows["ingestd", f].reshape(-1) for f in ("worker", "env", "episode", "step"))
    length, terminates = episode_shape(episode_hash(w, i, e))
    return w, i, e, s, length, terminates


# -- n-step: against a reference computed by hand on the Checksum env -----------------------------
def nstep_reference(w, i, e, s, n: int, gamma: float) -> dict:
    """What the n-step row of Checksum step ``s`` of episode ``e`` must hold (pure Python)."""
    h = episode_hash(torch.tensor(w), torch.tensor(i), torch.tensor(e))
    length, terminates = (int(x) for x in episode_shape(h))
    m = min(n, length - s)
    ret = sum(gamma ** k * float(reward_of(mix64(h + s + k))) for k in range(m))
    end = s + m == length
    return {"steps": m, "reward": ret, "next_obs": [w, i, e, s + m], "done": end,
            "terminated": end and bool(terminates), "truncated": end and not bool(terminates)}


def _into(rows, transform, chunk_steps: int, num_envs: int) -> dict:
    """Fresh ``[K * B, ...]`` targets for the observation leaves, as reserved slots would be."""
    n = transform.ready_steps(chunk_steps) * num_envs
    return {key: torch.full((n, *rows.get(key).shape[1:]), -1, dtype=rows.get(key).dtype)
            for key in (("observation",), ("next", "observation"))}


@pytest.mark.parametrize("into", [False, True], ids=["gathered", "into slots"])
@pytest.mark.parametrize("n, chunk_steps", [(3, 2), (3, 5), (5, 8), (2, 1), (4, 1)])
def test_nstep_rows_match_a_hand_computed_reference_across_chunk_boundaries(n, chunk_steps, into):
    gamma, num_envs = 0.5, 3
    env = Checksum(EnvContext(num_envs=num_envs, seed=0, worker=1, episode_base=7 << 32))
    rollout = Rollout(env, Random(env.spec, seed=0), 1, 7 << 32, chunk_steps)
    transform, plain, out = NStep(n, gamma, num_envs), [], []
    for _ in range(12):
        rows, _ = rollout.chunk(3)
        plain.append(rows.clone())
        slots = _into(rows, transform, chunk_steps, num_envs) if into else None
        out.append(transform(rows, into=slots))
        if slots and out[-1].batch_size[0]:
            assert all(out[-1].get(key) is dest for key, dest in slots.items())  # written there, not copied
    held = transform.held_steps
    assert held == n - 1
    flushed = transform.flush()
    assert out[0].batch_size[0] == max(0, chunk_steps - (n - 1)) * num_envs  # rows come n-1 steps late
    stored = torch.cat([*out, flushed])
    assert stored.batch_size[0] == 12 * chunk_steps * num_envs  # nothing lost, nothing doubled
    plain = torch.cat(plain)
    for key in ("observation", "action", ("ingestd", "step"), ("ingestd", "episode"), ("ingestd", "env")):
        assert torch.equal(stored[key], plain[key]), key  # root entries are those of step t, in order
    tail = stored.batch_size[0] - flushed.batch_size[0]
    for r in range(stored.batch_size[0]):
        w, i, e, s = (int(stored[("ingestd", f)][r]) for f in ("worker", "env", "episode", "step"))
        ref = nstep_reference(w, i, e, s, n, gamma)
        steps = int(stored[STEPS_KEY][r, 0])
        if r >= tail:  # flushed at stop: the window is as long as the steps collected
            assert 1 <= steps <= ref["steps"]
            ref = nstep_reference(w, i, e, s, steps, gamma) if steps < ref["steps"] else ref
        assert steps == ref["steps"], r
        assert float(stored["next", "reward"][r, 0]) == pytest.approx(ref["reward"], abs=1e-5)
        assert stored["next", "observation"][r].tolist() == ref["next_obs"]
        for flag in ("done", "terminated", "truncated"):
            assert bool(stored["next", flag][r, 0]) == ref[flag], (r, flag)
        assert int(stored["next", "checksum"][r]) == int(mix64(episode_hash(
            torch.tensor(w), torch.tensor(i), torch.tensor(e)) + s + steps))


def test_nstep_windows_stop_at_episode_ends():
    env = Checksum(EnvContext(num_envs=4, seed=0, worker=0, episode_base=0))
    rollout, transform = Rollout(env, Random(env.spec, seed=0), 0, 0, 16), NStep(8, 0.9, 4)
    rows = torch.cat([transform(rollout.chunk(1)[0]) for _ in range(6)])
    same_episode = rows["next", "observation"][:, 2] == rows["observation"][:, 2]
    assert bool(same_episode.all())  # never the observation of a later episode
    short = rows[STEPS_KEY][:, 0] < 8
    assert bool(rows["next", "done"][short].all())  # a window shorter than n ended its episode


@pytest.mark.parametrize("n, gamma, error", [(0, 0.9, "n_step"), (3, 0.0, "gamma"), (3, 1.5, "gamma")])
def test_nstep_rejects_bad_parameters(n, gamma, error):
    with pytest.raises(ValueError, match=error):
        NStep(n, gamma, 2)


# -- unit rules -------------------------------------------------------------------------------------
def test_step_limit_truncates_and_never_marks_terminated():
    env = StepLimit(Checksum(EnvContext(num_envs=16, seed=0, worker=0, episode_base=0)), 4)
    rollout = Rollout(env, Random(env.spec, seed=0), 0, 0, 32)
    rows, _ = rollout.chunk(1)
    w, i, e, s, length, terminates = checksum_stamps(rows)
    natural = s + 1 == length
    assert int(s.max()) == 3
    nxt = rows["next"]
    assert torch.equal(nxt["done"][:, 0], natural | (s == 3))
    assert torch.equal(nxt["terminated"][:, 0], natural & terminates)
    assert torch.equal(nxt["truncated"][:, 0], (natural & ~terminates) | ((s == 3) & ~natural))
    assert torch.equal(rows["observation"], torch.stack((w, i, e, s), 1))  # the env really reset


def test_step_limit_really_resets_a_gym_env():
    """The Gym adapter is a TorchEnv, so StepLimit accepts it: a cut episode must restart from a
    reset state (gymnasium's CartPole resets into U(-0.05, 0.05)), not go on from where it was."""
    env = StepLimit(Gym(EnvContext(num_envs=3, seed=0, worker=0, episode_base=0), id="CartPole-v1"), 4)
    push_right = lambda td: td.set("action", torch.ones(3, dtype=torch.int64))  # noqa: E731
    rows, _ = Rollout(env, push_right, 0, 0, 12).chunk(1)
    env.close()
    step, obs = rows["ingestd", "step"], rows["observation"]
    assert int(step.max()) == 3 and bool(rows["next", "truncated"][step == 3].all())
    assert obs[step == 0].abs().max() <= 0.05  # every episode, the cut ones included, starts reset
    assert obs[step == 3][:, 1].min() > 0.4  # pushed right for 3 steps: well away from a reset state


def test_schedule_counts_the_replays_write_count():
    schedule = Schedule(init_random_frames=100, total_frames=1000)
    assert [schedule.warming_up(n) for n in (0, 99, 100)] == [True, True, False]
    assert [schedule.spent(n) for n in (0, 999, 1000, 5000)] == [False, False, True, True]
    assert not Schedule().spent(10**12) and not Schedule().warming_up(0)


def test_component_seeds_are_distinct_and_stable():
    from ingestd.collect.worker import derive_seed

    seeds = [component_seeds(derive_seed(7, w, inc)) for w in range(4) for inc in range(1, 4)]
    values = [v for s in seeds for v in (s.torch, s.env, s.policy)]
    assert len(set(values)) == len(values)
    assert component_seeds(derive_seed(7, 1, 2)) == component_seeds(derive_seed(7, 1, 2))
    assert all(0 <= s.numpy < 2**32 for s in seeds)


def test_policy_factories_taking_a_seed_get_the_workers_seed():
    assert seeded_policy_kwargs(MLP, {"epsilon": 0.1}, 5) == {"epsilon": 0.1, "seed": 5}
    assert seeded_policy_kwargs(Random, {"seed": 9}, 5) == {"seed": 9}  # the config wins
    assert seeded_policy_kwargs(lambda spec, hidden=1: None, {}, 5) == {}


@pytest.mark.parametrize("configured, workers, cores, expected", [
    (0, 1, 2, 2), (0, 2, 2, 1), (0, 3, 2, 1), (0, 2, 8, 4), (3, 2, 2, 3)])
def test_worker_threads_zero_shares_out_the_cores(configured, workers, cores, expected):
    assert worker_threads(configured, workers, cores) == expected


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: every share is one thread")
def test_scaling_shares_the_cores_out_again_to_new_and_running_workers():
    """User review: with workers.threads = 0, a scale worked the share out from the count before
    it (the config was adopted after the new workers were made), and running workers kept
    theirs: scaled from 1 to 2 on 2 cores, both ran 2 threads, and spun in OpenMP's barrier."""
    cores = len(os.sched_getaffinity(0))
    with DaemonProc(overrides={"workers.count": 1, "workers.threads": 0, "workers.num_envs": 16}) as d:
        d.wait_ready()
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            assert int(stats[0]["threads"]) == cores
            with ControlClient(d.control_address) as client:
                client.scale(2)
                wait_for(lambda: [int(stats[i]["threads"]) for i in (0, 1)] == [cores // 2] * 2, 30,
                         f"both workers at {cores // 2} threads")
                client.restart([1])  # a restart keeps the new share
                wait_for(lambda: int(stats[1]["restarts"]) >= 1 and int(stats[1]["state"]) == State.RUNNING, 30,
                         "worker 1 restarted")
                assert int(stats[1]["threads"]) == cores // 2
                client.scale(1)
                wait_for(lambda: int(stats[0]["threads"]) == cores, 30, f"worker 0 back at {cores} threads")
        finally:
            stats.close()
        assert d.stop() == 0


def test_importing_ingestd_leaves_a_trainers_thread_count_alone():
    code = ("import torch; torch.set_num_threads(3); import ingestd, ingestd.collect.worker, ingestd.collect.features, "
            "ingestd.collect.nstep, ingestd.service.daemon, ingestd.service.layout, ingestd.control.client; "
            "from ingestd import ReplayReader, ControlClient; print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "3"


@pytest.mark.parametrize("text", ["workers.gamma=0", "workers.gamma=1.01", "workers.n_step=0",
                                  "workers.total_frames=-1", "workers.init_random_frames=\"10\""])
def test_config_rejects_bad_feature_values(text):
    with pytest.raises(ConfigError, match=text.split("=")[0]):
        load_config(None, [text])


def test_cpu_device_passes_and_a_missing_cuda_is_a_config_error():
    assert check_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert check_device("cuda").type == "cuda"
        return
    with pytest.raises(ConfigError, match="workers.device.*no usable CUDA"):
        check_device("cuda:0")


# -- the real daemon ------------------------------------------------------------------------------------
def test_daemon_warmup_episode_limit_and_budget():
    """Warm-up rows (policy_version -1) come first, episodes stop at max_episode_steps, and the
    workers pause at the budget with the reason in status and metrics while the daemon serves on."""
    warmup, budget, limit = 256, 1024, 5
    overrides = {"workers.env": "Checksum", "workers.policy": "MLP", "workers.count": 2,
                 "workers.init_random_frames": warmup, "workers.total_frames": budget,
                 "workers.max_episode_steps": limit}
    with DaemonProc(overrides=overrides) as d:
        d.wait_ready()
        with ControlClient(d.control_address, timeout=10) as client:
            first = wait_status(client, budget_spent, 30, "the budget pause")
            written = client.status().replay.write_count
            time.sleep(0.3)
            status = client.status()  # still serving, and collecting nothing more
            # (seen once in CI: 1088 rows where 1024 were written when both workers showed paused:
            # status read write_count before the workers' records, so a worker could write its last
            # chunk and pause in between; it now reads write_count last)
            assert status.replay.write_count == written, (
                f"rows written after every worker showed the budget pause: {written} -> "
                f"{status.replay.write_count}; then {_workers(first)}, now {_workers(status)}; log:\n{d.log()[-3000:]}")
            assert budget <= written <= budget + 2 * CHUNK  # a worker finishes the chunk it started
            assert client.resume().workers == [0, 1]  # acknowledged, but the budget keeps them paused
            assert budget_spent(client.status())
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
        for w in (0, 1):
            assert f'ingestd_worker_paused{{reason="budget",worker="{w}"}} 1.0' in metrics
        with ReplayReader(d.replay_path) as reader:
            assert reader.sample(16)["observation"].shape == (16, 4)
        assert d.stop() == 0
        rows = stored_rows(d.replay_path)
    index, version = rows["ingestd", "write_index"], rows["ingestd", "policy_version"]
    assert bool((version[index < warmup] == WARMUP_VERSION).all())
    assert bool((index[version == WARMUP_VERSION] < warmup + 2 * CHUNK).all())
    assert bool((version[index >= warmup + 2 * CHUNK] >= 1).all()) and int((version >= 1).sum()) > 0
    w, i, e, s, length, terminates = checksum_stamps(rows)
    natural, cut = s + 1 == length, (s == limit - 1) & (s + 1 != length)
    assert int(s.max()) == limit - 1
    assert torch.equal(rows["next", "done"][:, 0], natural | cut)
    assert torch.equal(rows["next", "terminated"][:, 0], natural & terminates)
    assert torch.equal(rows["next", "truncated"][:, 0], (natural & ~terminates) | cut)
    assert torch.equal(rows["observation"], torch.stack((w, i, e, s), 1))


def test_daemon_warms_up_a_continuous_env_within_its_action_bounds():
    """A SAC setup's warm-up (TorchRL: init_random_frames with RandomPolicy(action_spec)) was a
    config error for continuous actions. Pendulum's Box bounds reach the spec; warm-up rows act
    uniformly within [-2, 2], later rows with the configured policy (zeros here)."""
    warmup = 4 * CHUNK
    overrides = {"workers.env": "Gym", "workers.env_kwargs": {"id": "Pendulum-v1"}, "workers.count": 1,
                 "workers.policy": "faulty_envs:odd_policy", "workers.policy_kwargs": {"mode": "fits"},
                 "workers.init_random_frames": warmup, "workers.total_frames": warmup + 4 * CHUNK}
    tests = str(Path(__file__).parent)
    with DaemonProc(overrides=overrides, env={"PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}) as d:
        d.wait_ready(rows=warmup + 4 * CHUNK)
        assert d.stop() == 0
        rows = stored_rows(d.replay_path)
    action, version = rows["action"], rows["ingestd", "policy_version"]
    assert action.shape[1:] == (1,) and action.dtype == torch.float32
    random = action[version == WARMUP_VERSION]
    assert random.shape[0] >= warmup and bool((random.abs() <= 2.0).all())
    assert float(random.min()) < -1.0 and float(random.max()) > 1.0  # spread over the range, not clipped
    assert bool((action[version >= 0] == 0).all()) and int((version >= 0).sum()) > 0  # (no weights: version 0)


def test_daemon_stores_a_goal_envs_dict_observations_through_wrappers():
    """A goal-conditioned gymnasium env (Dict observation space) with a wrapper from the TOML
    config: every entry is stored in the root and under next, and checks out row by row."""
    config = """
[workers]
env = "Gym"
policy = "Random"
count = 1
env_kwargs = { id = "gym_goal_env:Goal-v0", length = 4, info_keys = { is_success = "bool" }, wrappers = [
    { path = "gymnasium.wrappers:ClipReward", kwargs = { max_reward = 2.0 } } ] }
"""
    tests = str(Path(__file__).parent)
    with DaemonProc(config_text=config, env={"PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}) as d:
        d.wait_ready(rows=4 * CHUNK)
        assert d.stop() == 0
        rows = stored_rows(d.replay_path)
    nxt = rows["next"]
    step, episode = nxt["observation"][:, 0], nxt["observation"][:, 1]
    assert rows.batch_size[0] >= 4 * CHUNK and bool((step >= 1).all() and (step <= 4).all())
    assert bool((nxt["achieved_goal"][:, 0] == step).all() and (nxt["desired_goal"][:, 0] == episode).all())
    assert bool((rows["achieved_goal"][:, 0] == step - 1).all() and (rows["desired_goal"] == nxt["desired_goal"]).all())
    assert bool((nxt["phase"] == step.long() % 3).all()) and rows["phase"].dtype == torch.int64
    assert bool((nxt["reward"].view(-1) == step.clamp(max=2.0)).all())  # ClipReward(max 2) on reward = step
    assert bool((nxt["terminated"].view(-1) == (step == 4)).all())
    assert bool((nxt["is_success"].view(-1) == (step == 4)).all())  # env_kwargs.info_keys


def _seeded_run(seed: int, restart: bool = False):
    overrides = {"workers.env": "CartPole", "workers.policy": "MLP", "workers.count": 1, "service.seed": seed,
                 "workers.policy_kwargs": {"epsilon": 0.5}, "workers.total_frames": 8 * CHUNK}
    with DaemonProc(overrides=overrides) as d:
        d.wait_ready()
        with ControlClient(d.control_address, timeout=10) as client:
            wait_status(client, budget_spent, 30, "the budget pause")
            stats = StatsBlock(d.runtime_dir / "workers.stats")
            seeds = [int(stats[0]["seed"])]
            if restart:
                client.restart([0])
                seeds.append(int(stats[0]["seed"]))
            stats.close()
        assert d.stop() == 0
        rows, log = stored_rows(d.replay_path), d.log()
    return rows, seeds, log


def test_one_worker_with_a_fixed_seed_stores_identical_data_twice():
    first, seeds, log = _seeded_run(123, restart=True)
    second, _, _ = _seeded_run(123)
    assert first.batch_size[0] == 8 * CHUNK
    keys = sorted(first.keys(include_nested=True, leaves_only=True), key=str)
    assert keys == sorted(second.keys(include_nested=True, leaves_only=True), key=str)
    for key in keys:  # every field, the write order included: one worker writes deterministically
        assert torch.equal(first[key], second[key]), key
    assert seeds[0] != seeds[1]  # a restarted worker gets a new seed, and says so
    assert f"seed {seeds[0]}" in log and f"seed {seeds[1]}" in log


def rows_of(env: str) -> int:
    """Tile rows of each observation: 1 for Checksum, 64 for the image-sized one."""
    return 64 if env.startswith("image_checksum") else 1


@pytest.mark.parametrize("env", ["Checksum", "image_checksum:make"])  # rows written, or images into slots
def test_daemon_stores_nstep_rows_matching_the_reference(env):
    n, gamma, num_envs = 3, 0.5, 8
    overrides = {"workers.env": env, "workers.policy": "Random", "workers.count": 1,
                 "workers.n_step": n, "workers.gamma": gamma, "workers.total_frames": 6 * CHUNK}
    with DaemonProc(overrides=overrides, env={"PYTHONPATH": str(Path(__file__).parent)}) as d:
        d.wait_ready()
        with ControlClient(d.control_address, timeout=10) as client:
            collected = wait_status(client, budget_spent, 30, "the budget pause").workers[0].frames
        assert d.stop() == 0
        rows = stored_rows(d.replay_path)
        with ReplayReader(d.replay_path) as reader:  # what a trainer bootstraps with
            assert reader.nstep == {"n_step": n, "gamma": gamma}
        if env == "Checksum":  # another discount into the same replay: refused (it mixed them silently)
            again = subprocess.run(d.args() + ["--set", "workers.gamma=0.9"], capture_output=True, text=True,
                                   timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
            assert again.returncode == 78 and "config key 'workers.gamma'" in again.stderr, again.stderr
            assert "holds n-step rows of n_step=3, gamma=0.5" in again.stderr, again.stderr
    assert rows.batch_size[0] == collected  # the first chunk n-1 steps short, the rest flushed at stop
    flushed = rows.batch_size[0] - (n - 1) * num_envs
    for r in range(rows.batch_size[0]):
        w, i, e, s = (int(rows[("ingestd", f)][r]) for f in ("worker", "env", "episode", "step"))
        steps = int(rows[STEPS_KEY][r, 0])
        ref = nstep_reference(w, i, e, s, n, gamma)
        if r >= flushed and steps < ref["steps"]:
            ref = nstep_reference(w, i, e, s, steps, gamma)
        assert steps == ref["steps"], r
        assert float(rows["next", "reward"][r, 0]) == pytest.approx(ref["reward"], abs=1e-5)
        assert rows["next", "observation"][r].reshape(-1, 4).tolist() == [ref["next_obs"]] * rows_of(env)
        assert rows["observation"][r].reshape(-1, 4).tolist() == [[w, i, e, s]] * rows_of(env)
        assert [bool(rows["next", f][r, 0]) for f in ("done", "terminated", "truncated")] == \
            [ref["done"], ref["terminated"], ref["truncated"]]


def test_a_replay_of_nstep_rows_keeps_its_settings(tmp_path, caplog):
    """nstep.json: recorded by the first daemon, refused when another n_step or gamma would mix
    returns of another discount into the rows (naming the key), recorded for an older replay of
    n-step rows that has none, and a damaged one is a config error naming replay.path."""
    from types import SimpleNamespace

    from ingestd.errors import ConfigError
    from ingestd.replay.storage import ReplayStorage
    from ingestd.service.layout import _check_nstep

    settings = lambda n, g: SimpleNamespace(n_step=n, gamma=g)  # noqa: E731
    with ReplayStorage.create(tmp_path / "r", {STEPS_KEY: ((1,), torch.int64), "x": ((2,), torch.float32)}, 64) as st:
        assert st.nstep is None
        _check_nstep(st, settings(3, 0.9))
        assert st.nstep == {"n_step": 3, "gamma": 0.9}
        _check_nstep(st, settings(3, 0.9))  # the same: fine
        for n, g, key in ((5, 0.9, "workers.n_step"), (3, 0.5, "workers.gamma"), (1, 1.0, "workers.n_step")):
            with pytest.raises(ConfigError, match="holds n-step rows of n_step=3, gamma=0.9") as err:
                _check_nstep(st, settings(n, g))
            assert err.value.key == key
        assert st.nstep == {"n_step": 3, "gamma": 0.9}  # nothing changed
        (st.path / "nstep.json").unlink()  # a replay from before ingestd recorded them
        _check_nstep(st, settings(2, 0.99))
        assert st.nstep == {"n_step": 2, "gamma": 0.99}
        (st.path / "nstep.json").write_text("{oops")
        with pytest.raises(ConfigError, match="nstep.json cannot be read as JSON") as err:
            _check_nstep(st, settings(2, 0.99))
        assert err.value.key == "replay.path"
    with ReplayStorage.create(tmp_path / "one", {"x": ((2,), torch.float32)}, 64) as st:
        _check_nstep(st, settings(1, 0.5))  # 1-step rows: no discount in them, nothing recorded
        assert st.nstep is None and not (st.path / "nstep.json").exists()


def test_stopping_the_profiler_and_writing_the_trace_run_under_a_heartbeat_lease(tmp_path):
    """torch's profiler.stop() and its export hold the GIL for seconds (~2.5 s and ~0.8 s a
    profiled second): no thread can beat, and a worker profiled for more than about a second
    was killed as hung, its trace lost (review; a keepalive thread never got to run). The
    worker sets its heartbeat ahead for both, and beats for real once the trace is written."""
    from ingestd.collect.profiling import ProfileRequests, write_allowance

    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    try:
        rec = stats[0]
        requests = ProfileRequests(rec, 0, lambda: rec.__setitem__("heartbeat", time.monotonic()))

        class Profiler:
            def stop(self):
                self.lease_at_stop = float(rec["heartbeat"]) - time.monotonic()

            def export_chrome_trace(self, path):
                self.lease_at_export = float(rec["heartbeat"]) - time.monotonic()
                Path(path).write_text("{}")

        profiler = Profiler()
        requests._profiler, requests._path, requests._seq = profiler, str(tmp_path / "t.json"), 1
        requests._seconds, requests._started = 3.0, time.monotonic()
        requests.finish()
        for lease in (profiler.lease_at_stop, profiler.lease_at_export):
            assert write_allowance(3.0) - 1.0 < lease <= write_allowance(3.0)
        assert write_allowance(3.0) >= 3.0 * (2.5 + 0.9) * 2  # twice the time measured here, at least
        assert abs(float(rec["heartbeat"]) - time.monotonic()) < 1.0  # the lease ended with the write
        assert int(rec["profile_done"]) == 1 and (tmp_path / "t.json").exists()
    finally:
        stats.close()


def test_a_profile_whose_worker_died_is_answered_as_failed_and_a_starting_worker_takes_its_own(tmp_path):
    """The replacement of a worker killed while it recorded marked the request done, and the
    daemon answered with the path of a trace never written (review: ingestctl exited 0). The
    supervisor now answers a dead worker's pending request as failed as it starts the next
    process; a request sent while that process starts (pid set, env still building) is the new
    worker's own, and it records it (answering it as a dead one's was the first fix's bug)."""
    from ingestd.collect import profiling

    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    try:
        rec = stats[0]
        seq = profiling.request(rec, tmp_path / "lost.json", 1.0)  # the worker recording it dies
        profiling.fail_pending(rec)  # Supervisor._start, before the new process exists
        ok, text = profiling.outcome(rec, seq)
        assert not ok and "ended before it wrote the trace" in text
        profiling.fail_pending(rec)  # answered: nothing pending any more
        assert profiling.outcome(rec, seq) == (ok, text)
        mine = profiling.request(rec, tmp_path / "mine.json", 0.1)  # sent while the new worker starts
        requests = profiling.ProfileRequests(rec, 0, lambda: None)
        requests.poll()
        assert requests.active and profiling.outcome(rec, mine) is None
        requests.finish()
        assert profiling.outcome(rec, mine) == (True, str(tmp_path / "mine.json"))
        assert (tmp_path / "mine.json").stat().st_size > 0
    finally:
        stats.close()


def test_a_profile_longer_than_the_heartbeat_timeout_comes_back_and_the_worker_lives():
    """The review's case, sized down: a 2 s profile with a 1 s heartbeat timeout (the stop alone
    takes longer than that here); before the lease the worker was killed as hung."""
    with DaemonProc(overrides={"workers.count": 1, "workers.heartbeat_timeout_s": 1.0}) as d:
        d.wait_ready()
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            pid, restarts = int(stats[0]["pid"]), int(stats[0]["restarts"])
            with ControlClient(d.control_address, timeout=10) as client:
                path = client.profile(0, 2.0).path
            assert Path(path).stat().st_size > 0
            assert int(stats[0]["pid"]) == pid and int(stats[0]["restarts"]) == restarts
            assert "missed its heartbeat" not in d.log()
        finally:
            stats.close()
        assert d.stop() == 0


def test_profile_command_writes_a_chrome_trace_while_the_worker_collects():
    overrides = {"workers.count": 1, "workers.threads": 2}
    with DaemonProc(overrides=overrides) as d:
        d.wait_ready()
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            assert int(stats[0]["threads"]) == 2  # workers.threads, set in the worker
            pid, before = int(stats[0]["pid"]), int(stats[0]["frames"])
            env = {**os.environ, "INGESTD_CONTROL": d.control_address}
            first = subprocess.Popen([sys.executable, "-m", "ingestd.control.cli", "--json", "profile", "0",
                                      "--seconds", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)
            try:
                wait_for(lambda: int(stats[0]["profile_seq"]) != int(stats[0]["profile_done"]), 30,
                         "the first profile to start")
                with ControlClient(d.control_address, timeout=5) as client:  # a second one is busy at once
                    from ingestd.errors import CommandFailed

                    started = time.monotonic()
                    with pytest.raises(CommandFailed) as info:
                        client.profile(0, 0.1)
                    assert info.value.code == "busy" and time.monotonic() - started < 2.0
                out, err = first.communicate(timeout=60)
            finally:
                if first.poll() is None:
                    first.kill()
                    first.wait()
            assert first.returncode == 0, err
            path = json.loads(out)["result"]["path"]
            assert int(stats[0]["frames"]) > before  # it kept collecting
        finally:
            stats.close()
        with open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        chunks = [e for e in events if e.get("name") == "ingestd.worker.chunk"]
        assert chunks and all(int(e["pid"]) == pid for e in chunks)
        with ControlClient(d.control_address, timeout=5) as client:
            from ingestd.errors import CommandFailed

            with pytest.raises(CommandFailed) as info:
                client.profile(7, 0.1)
            assert info.value.code == "no_such_worker"
        assert d.stop() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA; the CUDA run is tested instead")
def test_daemon_refuses_cuda_without_a_gpu():
    with DaemonProc(overrides={"workers.device": "cuda", "workers.count": 1}) as d:
        assert d.proc.wait(60) == 78
        assert "workers.device" in d.log() and "CUDA" in d.log()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host (CPU path tested)")
def test_daemon_collects_with_the_policy_on_cuda():
    with DaemonProc(overrides={"workers.device": "cuda", "workers.count": 1}) as d:
        d.wait_ready(rows=4 * CHUNK)
        assert d.stop() == 0
        assert stored_rows(d.replay_path).batch_size[0] >= 4 * CHUNK


@pytest.mark.slow
def test_daemon_collects_with_a_compiled_policy_and_pushed_weights_reach_it():
    """workers.compile_policy on the real daemon: the worker compiles (cold, this can take a minute
    on 2 cores, with the heartbeat kept alive), collects, and a weights push changes what the
    compiled policy does from the stamped version on, so the compiled graph reads the live weights."""
    overrides = {"workers.env": "CartPole", "workers.policy": "MLP", "workers.count": 1,
                 "workers.compile_policy": True, "workers.threads": 1}
    env = CartPole(EnvContext(num_envs=1, seed=0, worker=0, episode_base=0, device="cpu"))
    zeros = {k: torch.zeros_like(v) for k, v in MLP(env.spec).state_dict().items()}
    last_bias = [k for k in zeros if k.endswith("bias")][-1]

    def always(action: int) -> dict:  # every Q-value 0 except this action's: argmax is it everywhere
        state = {k: v.clone() for k, v in zeros.items()}
        state[last_bias][action] = 1.0
        return state

    with DaemonProc(overrides=overrides) as d:
        d.wait_ready(timeout=600, rows=4 * CHUNK)
        with ControlClient(d.control_address, timeout=60) as client:
            assert client.status().workers[0].restarts == 0  # never taken for hung while compiling
            versions = []
            for action in (0, 1):
                versions.append(client.push_weights(always(action)))
                start = client.status().replay.write_count
                wait_status(client, lambda s: s.replay.write_count > start + 8 * CHUNK, 60, "rows under the push")
        assert d.stop() == 0
        log, rows = d.log(), stored_rows(d.replay_path)
    assert "compiled the policy in" in log
    stamped, action = rows["ingestd", "policy_version"], rows["action"].reshape(-1)
    for expected, version in enumerate(versions):
        mine = stamped == version
        assert int(mine.sum()) >= 4 * CHUNK and bool((action[mine] == expected).all()), version


def test_compiling_keeps_the_heartbeat_while_torch_compile_imports_its_backend():
    """torch.compile itself imports inductor before any call (5-10 s on a cold CI machine): a
    worker that beat only during the first call was killed as hung 5 times, then failed."""
    from ingestd.collect.features import compiled

    beats = []

    def slow_compile(module, dynamic):
        time.sleep(0.35)
        return module
    policy = compiled(torch.nn.Linear(2, 2), beat=lambda: beats.append(1), compile_fn=slow_compile, every_s=0.05)
    assert len(beats) >= 3
    assert isinstance(policy.fn, torch.nn.Linear)


def test_compiled_policy_keeps_the_heartbeat_during_its_first_call():
    from ingestd.collect.features import KeepaliveFirstCall

    beats = []
    slow = KeepaliveFirstCall(lambda td: time.sleep(0.35) or td, beat=lambda: beats.append(1), every_s=0.05)
    assert slow("td") == "td"
    assert len(beats) >= 3  # the supervisor would otherwise see a silent worker while torch compiles
    beats.clear()
    slow("td")
    assert not beats


def test_a_compile_that_hangs_stops_beating_after_start_timeout_s():
    """The compile and the compiled policy's first call were kept alive with no limit: a compile
    that hung (an inductor worker pool deadlocked) kept the heartbeat fresh for ever, and the
    supervisor never restarted the worker (lifecycle review). Past ``workers.start_timeout_s``
    the beats stop, as for a hung env build."""
    from ingestd.collect.features import compiled

    for hang_in in ("compile", "first call"):
        beats = []

        def slow_compile(module, dynamic):
            time.sleep(0.6 if hang_in == "compile" else 0.0)
            return lambda td: time.sleep(0.6) or td if hang_in == "first call" else td
        policy = compiled(torch.nn.Linear(2, 2), beat=lambda: beats.append(time.monotonic()),
                          compile_fn=slow_compile, every_s=0.02, limit_s=0.2)
        assert policy("td") == "td"
        assert beats and beats[-1] - beats[0] < 0.4, (hang_in, beats[-1] - beats[0])  # none past the limit


def test_a_failed_profile_is_answered_once_not_run_again_into_the_error_text(tmp_path):
    """A profile that could not start answers with ``-seq`` and puts ``error: ...`` in the path
    word; the next poll took that for a new request and profiled into a file named after the
    error (a 50 MB trace under the worker's cwd)."""
    from ingestd.collect import profiling
    from ingestd.collect.stats import State, StatsBlock

    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    try:
        rec = stats[0]
        requests = profiling.ProfileRequests(rec, 0, lambda: None)
        blocked = tmp_path / "file"
        blocked.write_text("")  # a file where the trace's directory should be: mkdir fails
        seq = profiling.request(rec, blocked / "sub" / "trace.json", 0.1)
        requests.poll()
        assert not requests.active and profiling.outcome(rec, seq)[0] is False
        for _ in range(3):
            requests.poll()
            assert not requests.active, "the failure was taken for a new request"
        assert not list(tmp_path.glob("error*")) and not list(Path.cwd().glob("error: *"))
    finally:
        stats.close()


def test_old_profile_traces_are_removed_before_a_new_one(tmp_path):
    """Traces piled up in <runtime_dir>/profiles, which is RAM under systemd (75 MB for two
    1 s traces in the soak review). The newest KEEP_TRACES - 1 stay, plus the one ordered next;
    partial traces stay only while their writer lives."""
    import os
    import subprocess

    from ingestd.collect import profiling

    traces = []
    for i in range(profiling.KEEP_TRACES + 3):
        path = tmp_path / f"worker0-2026120{i % 10}T000000-{i:06d}.json"
        path.write_text("{}")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
        traces.append(path)
    gone = subprocess.Popen(["true"])  # a pid that is gone once waited for
    gone.wait()
    dead, live = tmp_path / f"{traces[-1].name}.tmp{gone.pid}", tmp_path / f"{traces[-1].name}.tmp{os.getpid()}"
    dead.write_text(""), live.write_text("")
    other = tmp_path / "notes.txt"
    other.write_text("")
    removed = profiling.prune(tmp_path)
    kept = sorted(p for p in tmp_path.iterdir())
    assert sorted(removed) == sorted(traces[:4] + [dead])
    assert kept == sorted(traces[4:] + [live, other])
    assert profiling.prune(tmp_path / "missing") == []
