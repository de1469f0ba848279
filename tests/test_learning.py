"""Learning end to end: a real daemon (built-in CartPole, MLP policy, 2 workers) and the
DQN example trainer as a separate process, on this machine's cores.

What is asserted comes from the daemon, never from the trainer's own view:
the episode returns are read from the workers' stats block (what ``status``
and the Prometheus exporter read) and from the metrics endpoint; the
trainer's report is used only for the policy-lag property of the rows it
trained on.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from daemon_proc import DaemonProc
from ingestd import ReplayReader, SampleTimeout
from ingestd.collect.envs.cartpole import SPEC, CartPole
from ingestd.collect.interfaces import EnvContext
from ingestd.collect.policies import MLP, mlp_qnet
from ingestd.collect.rollout import Rollout
from ingestd.collect.stats import RING, StatsBlock
from ingestd.control.client import ControlClient
from ingestd.replay.storage import ReplayStorage

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = EXAMPLES / "dqn_cartpole.py"
sys.path.insert(0, str(EXAMPLES))
import dqn_cartpole  # noqa: E402  (the example, imported as a module)

BUDGET_S = 500.0  # hard bound on the whole test, daemon start and teardown included (a slow CI
# machine: 20-100 s here; the trainer stops once it reaches TRAINER_TARGET, TRAINER_SECONDS is only its cap)
TRAINER_SECONDS = 400
WINDOW = 20  # "the last 20 finished episodes"
RANDOM_LEVEL = 50.0  # a uniform-random CartPole policy averages about 22
LEARNED = 150.0  # what the daemon's workers must reach with the trainer's weights
TRAINER_TARGET = 180.0  # the trainer stops once the daemon's recent mean holds this (3 looks, 1.5 s)
MAX_LAG = 4
PUSH_EVERY = 100
WORKERS = 2

DAEMON = {
    "workers.count": WORKERS, "workers.num_envs": 16, "workers.chunk_steps": 8, "replay.capacity": 200_000,
    "service.seed": 7, "workers.policy_kwargs": {"epsilon": 1.0, "hidden": [128, 128]},  # starts fully random
}


def episodes_after(stats: StatsBlock, since: list[int], per_worker: int, deadline: float) -> list[float]:
    """The newest ``per_worker`` returns of each worker, once it has finished that many
    episodes after its ``since`` count."""
    while any(int(stats[i]["returns_count"]) < since[i] + per_worker for i in range(WORKERS)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers did not finish {per_worker} more episodes each: "
                               f"{returns_counts(stats)} since {since}")
        time.sleep(0.02)
    return [r for i in range(WORKERS) for r, _ in stats.recent_returns(i, per_worker)]


def returns_counts(stats: StatsBlock) -> list[int]:
    return [int(stats[i]["returns_count"]) for i in range(WORKERS)]


def scrape_return_means(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.labels["worker"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "ingestd_worker_episode_return_mean"}


@pytest.mark.slow
def test_dqn_example_raises_the_daemons_returns_and_trains_only_on_fresh_rows():
    started = time.monotonic()
    deadline = started + BUDGET_S
    with DaemonProc(overrides=DAEMON) as daemon:
        result_path, trainer_log = daemon.root / "result.json", daemon.root / "trainer.log"
        # started together: the trainer's imports overlap the daemon's start (it waits for both sockets)
        with open(trainer_log, "wb") as log:
            trainer = subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--replay", str(daemon.replay_path), "--connect",
                 daemon.control_address, "--wait", "60", "--seconds", str(TRAINER_SECONDS), "--target-return", str(TRAINER_TARGET),
                 "--max-lag", str(MAX_LAG), "--push-every", str(PUSH_EVERY), "--result-json", str(result_path)],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            daemon.wait_ready(timeout=60)
            stats = StatsBlock(daemon.runtime_dir / "workers.stats")
            ctl = ControlClient(daemon.control_address, timeout=10)
            try:
                # the random level: episodes played under the daemon's initial weights (version 1, epsilon 1)
                before = episodes_after(stats, [0] * WORKERS, WINDOW // WORKERS, deadline)
                assert ctl.status().weights_version == 1, "the trainer pushed before the random level was read"
                start_mean = sum(before) / len(before)
                assert start_mean < RANDOM_LEVEL, before

                code = trainer.wait(timeout=max(1.0, deadline - time.monotonic() - 15))
                assert code == 0, trainer_log.read_text(errors="replace")
                result = json.loads(result_path.read_text())

                # the daemon's returns with the trainer's last weights: fresh episodes only
                status = ctl.status()
                assert status.weights_version == result["final_version"] > 1
                assert all(w.weights_version == result["final_version"] for w in status.workers), status.workers
                after = episodes_after(stats, returns_counts(stats), WINDOW // WORKERS, deadline)
                final_mean = sum(after) / len(after)
                scraped = episodes_after(stats, returns_counts(stats), RING, deadline)  # the exporter's window
                metric_means = scrape_return_means(daemon.metrics_port)
            finally:
                ctl.close()
                stats.close()
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait(10)
            trainer_output = trainer_log.read_text(errors="replace")
            print(trainer_output)
    elapsed = time.monotonic() - started
    report = (f"daemon returns (last {WINDOW}): {start_mean:.1f} -> {final_mean:.1f}; trainer: "
              f"{result['updates']} updates in {result['seconds']:.1f} s, versions {result['first_version']}.."
              f"{result['final_version']}, largest row lag {result['max_row_lag']}; test {elapsed:.0f} s")
    print(report)
    assert final_mean >= LEARNED, report
    assert min(metric_means.values()) >= LEARNED * 0.8 and len(metric_means) == WORKERS, (metric_means, scraped)
    assert elapsed < BUDGET_S

    # every row the trainer trained on was collected under weights at most MAX_LAG versions old
    updates = result["updates"]
    assert updates >= PUSH_EVERY and result["pushes"] == updates // PUSH_EVERY
    against, oldest = result["update_version"], result["update_min_row_version"]
    assert len(against) == len(oldest) == updates
    assert all(o >= v - MAX_LAG for v, o in zip(against, oldest))
    assert result["max_row_lag"] <= MAX_LAG
    # ... and the bound was binding: the replay (about 9 s of collection) spans more versions than
    # MAX_LAG by the time the returns rise, so the trainer had stale rows to refuse
    assert result["rows_dropped_stale"] > 0
    assert against == sorted(against) and against[-1] <= result["final_version"]
    counted = {int(v): n for v, n in result["rows_per_version"].items()}
    assert sum(counted.values()) == result["rows_trained"] == updates * 256
    assert min(counted) >= 1 and max(counted) <= result["final_version"]


# -- the example's pieces, without a daemon ------------------------------------------------------
@pytest.fixture
def cartpole_replay(shm_dir):
    """A replay of CartPole rows from the MLP policy, chunk i stamped policy_version i + 1."""
    rollout = Rollout(CartPole(EnvContext(8, seed=3, worker=0, episode_base=0)), MLP(SPEC, epsilon=1.0, seed=3),
                      worker=0, episode_base=0, chunk_steps=16)
    storage = None
    for version in range(1, 9):
        rows, _ = rollout.chunk(version)
        storage = storage or ReplayStorage.create(shm_dir / "replay", rows, capacity=8 * 8 * 16)
        storage.write(rows)
    storage.close()
    reader = ReplayReader(shm_dir / "replay", seed=0)
    yield reader
    reader.close()


def test_fresh_sampler_returns_only_rows_within_the_lag_and_counts_the_rest(cartpole_replay):
    sampler = dqn_cartpole.FreshSampler(cartpole_replay, timeout=5.0)
    for min_version in (1, 5, 8):
        batch = sampler.sample(300, min_version)
        versions = batch["ingestd", "policy_version"]
        assert batch.batch_size == (300,) and int(versions.min()) >= min_version
    assert sampler.dropped > 0  # 4 of 8 versions, then 7 of 8, were stale
    with pytest.raises(TimeoutError):
        dqn_cartpole.FreshSampler(cartpole_replay, timeout=0.2).sample(10, min_version=9)


def test_a_malformed_connect_is_one_line_not_a_traceback(tmp_path, capsys):
    assert dqn_cartpole.main(["--replay", str(tmp_path), "--connect", "foo"]) == 1
    assert "BadArgument: 'foo' is not a daemon address" in capsys.readouterr().err


def test_the_wait_for_learning_starts_ends_with_the_time_budget(cartpole_replay):
    """Paused workers never bring the replay to --learning-starts: the trainer says so after
    --seconds instead of waiting for ever."""
    cfg = dqn_cartpole.TrainConfig(replay="unused", learning_starts=10**9, seconds=0.3)
    status = SimpleNamespace(weights_version=0, config={})
    trainer = dqn_cartpole.Trainer(cfg, cartpole_replay, None, status, dqn_cartpole.DQNLearner, lambda line: None)
    with pytest.raises(SampleTimeout, match="fewer than --learning-starts 1000000000, after 0.3 s"):
        trainer.run()


def test_the_example_bootstraps_n_step_rows_with_the_replays_gamma(cartpole_replay):
    """Its own --gamma (0.99) gave wrong targets for rows the daemon discounted with another
    workers.gamma; it now takes the replay's (ReplayReader.nstep) and says so."""
    from ingestd.replay import nstep_record

    status = SimpleNamespace(weights_version=0, config={})
    said = []
    make = lambda: dqn_cartpole.Trainer(dqn_cartpole.TrainConfig(replay="unused"), cartpole_replay, None,  # noqa: E731
                                        status, dqn_cartpole.DQNLearner, said.append)
    assert make().cfg.gamma == 0.99 and not any("bootstrapping" in line for line in said)  # 1-step rows
    nstep_record.write(cartpole_replay.path, 3, 0.5)
    assert make().cfg.gamma == 0.5 and make().learner.cfg.gamma == 0.5
    assert any("3-step returns discounted by gamma=0.5" in line for line in said), said


def test_torchrl_dqnloss_takes_ingestd_samples_unchanged_and_agrees_with_the_example(cartpole_replay):
    """The TorchRL variant: DQNLoss on the reader's TensorDict as is, same loss as the plain one."""
    pytest.importorskip("torchrl")
    import torchrl_dqnloss

    batch = cartpole_replay.sample(256)
    cfg = dqn_cartpole.TrainConfig(replay="unused")
    torch.manual_seed(0)
    plain = dqn_cartpole.DQNLearner(mlp_qnet(4, 2, (32, 32)), cfg)
    torch.manual_seed(0)
    qnet = mlp_qnet(4, 2, (32, 32))
    torchrl = torchrl_dqnloss.TorchRLLearner(qnet, cfg)
    before = {k: v.clone() for k, v in qnet.state_dict().items()}
    assert float(torchrl.step(batch.clone())) == pytest.approx(float(plain.step(batch.clone())), rel=1e-5)
    after = qnet.state_dict()
    assert list(after) == list(before) and not torch.equal(after["net.0.weight"], before["net.0.weight"])
