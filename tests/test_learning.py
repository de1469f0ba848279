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

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_proc import DaemonProc
from ingestd.collect.stats import RING, StatsBlock
from ingestd.control.client import ControlClient

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dqn_cartpole.py"
BUDGET_S = 170.0  # hard bound on the whole test, daemon start and teardown included
WINDOW = 20  # "the last 20 finished episodes"
RANDOM_LEVEL = 50.0  # a uniform-random CartPole policy averages about 22
LEARNED = 150.0  # what the daemon's workers must reach with the trainer's weights
TRAINER_TARGET = 180.0  # the trainer stops once the daemon's recent mean holds this (3 looks, 1.5 s)
MAX_LAG = 8
PUSH_EVERY = 100
WORKERS = 2

DAEMON = {
    "workers.count": WORKERS, "workers.num_envs": 16, "workers.chunk_steps": 8, "replay.capacity": 100_000,
    "service.seed": 7, "workers.policy_kwargs": {"epsilon": 1.0, "hidden": [128, 128]},  # starts fully random
}


def episodes_after(stats: StatsBlock, since: list[int], per_worker: int) -> list[float]:
    """The newest ``per_worker`` returns of each worker, once it has finished that many
    episodes after its ``since`` count."""
    while any(int(stats[i]["returns_count"]) < since[i] + per_worker for i in range(WORKERS)):
        time.sleep(0.02)
    return [r for i in range(WORKERS) for r, _ in stats.recent_returns(i, per_worker)]


def returns_counts(stats: StatsBlock) -> list[int]:
    return [int(stats[i]["returns_count"]) for i in range(WORKERS)]


def scrape_return_means(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.labels["worker"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "ingestd_worker_episode_return_mean"}


def test_dqn_example_raises_the_daemons_returns_and_trains_only_on_fresh_rows():
    started = time.monotonic()
    deadline = started + BUDGET_S
    with DaemonProc(overrides=DAEMON) as daemon:
        result_path, trainer_log = daemon.root / "result.json", daemon.root / "trainer.log"
        # started together: the trainer's imports overlap the daemon's start (it waits for both sockets)
        with open(trainer_log, "wb") as log:
            trainer = subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--replay", str(daemon.replay_path), "--connect",
                 daemon.control_address, "--wait", "60", "--seconds", "110", "--target-return", str(TRAINER_TARGET),
                 "--max-lag", str(MAX_LAG), "--push-every", str(PUSH_EVERY), "--result-json", str(result_path)],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            daemon.wait_ready(timeout=60)
            stats = StatsBlock(daemon.runtime_dir / "workers.stats")
            ctl = ControlClient(daemon.control_address, timeout=10)
            try:
                # the random level: episodes played under the daemon's initial weights (version 1, epsilon 1)
                before = episodes_after(stats, [0] * WORKERS, WINDOW // WORKERS)
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
                after = episodes_after(stats, returns_counts(stats), WINDOW // WORKERS)
                final_mean = sum(after) / len(after)
                scraped = episodes_after(stats, returns_counts(stats), RING)  # the exporter's window, fresh
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
    assert against == sorted(against) and against[-1] <= result["final_version"]
    counted = {int(v): n for v, n in result["rows_per_version"].items()}
    assert sum(counted.values()) == result["rows_trained"] == updates * 256
    assert min(counted) >= 1 and max(counted) <= result["final_version"]
