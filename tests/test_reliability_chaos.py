"""Reliability, worker chaos: a random worker SIGKILLed every 2 s while the Checksum env
collects, then one worker SIGSTOPped (a hang). The daemon stays up, every worker is back
quickly, ``restarts`` counts exactly the kills, and every stored row verifies.

``INGESTD_CHAOS_SECONDS`` (test-only) sets the length of the kill phase (default 14 s;
docs/reliability.md quotes a 60 s run).
"""
from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter

import numpy as np
import pytest

from control_daemon import shared_paused, wait_collecting
from daemon_proc import DaemonProc
from ingestd import ControlClient
from ingestd.collect.envs.checksum import verify_rows
from ingestd.collect.stats import State, StatsBlock
from ingestd.replay import ReplayReader, ReplayStorage
from reliability_util import RssSeries, alive, check_integrity, knob, percentiles, read_storage, record, wait_for
from test_metrics import by_worker, samples

CHAOS_S = knob("INGESTD_CHAOS_SECONDS", 14.0)
KILL_EVERY_S = 2.0
BACK_WITHIN_S = 2.0  # target from SIGKILL to the new process RUNNING, backoff included (recorded, not asserted)
HEARTBEAT_S = 2.0
WORKERS = 4
SETTINGS = {"workers.count": WORKERS, "workers.env": "Checksum", "workers.policy": "Random",
            "workers.num_envs": 8, "workers.chunk_steps": 8, "replay.capacity": 2_000_000,
            "workers.heartbeat_timeout_s": HEARTBEAT_S, "workers.restart_backoff_s": 0.1,
            # kills every few seconds: every incarnation that wrote is progress, so each restart takes the
            # first backoff and the figures measure the restart itself (with the default 10 s the backoff
            # would grow from kill to kill)
            "workers.restart_reset_s": 0.0, "service.stop_timeout_s": 10.0}


def _running(stats: StatsBlock) -> list[int]:
    """Workers running now, with their pid (a worker waiting to restart shows pid 0)."""
    return [i for i in range(WORKERS) if stats.state(i) == State.RUNNING and int(stats[i]["pid"]) > 0]


def back_after(stats: StatsBlock, worker: int, old_pid: int, since: float, timeout: float) -> float:
    """Seconds from ``since`` until ``worker`` runs again as a new process (polled every ms)."""
    deadline = since + timeout
    while time.monotonic() < deadline:
        pid = int(stats[worker]["pid"])
        if pid not in (0, old_pid) and stats.state(worker) == State.RUNNING:
            return time.monotonic() - since
        time.sleep(0.001)
    raise AssertionError(f"worker {worker} (pid {old_pid}) was not running again {timeout} s later: "
                         f"state {stats.state(worker).label}, error {stats.error(worker)!r}")


def metrics_restarts(daemon: DaemonProc) -> dict[int, int]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {int(w): int(v) for w, v in by_worker(samples(text), "ingestd_worker_restarts_total", reason="failure").items()}


@pytest.mark.slow
def test_worker_chaos_kills_and_a_hang():
    rng = random.Random(7)
    kills, latencies = Counter(), []
    rss = RssSeries()
    with shared_paused(), DaemonProc(overrides=SETTINGS) as d:
        wait_collecting(d, rows=1000)
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            end = time.monotonic() + CHAOS_S
            while time.monotonic() < end:
                d.remember_children()
                worker = rng.choice(wait_for(lambda: _running(stats), 10, "a running worker to kill"))
                old = int(stats[worker]["pid"])
                assert old > 0  # os.kill(0, ...) would signal this test's own process group
                t0 = time.monotonic()
                os.kill(old, signal.SIGKILL)
                kills[worker] += 1
                latencies.append(back_after(stats, worker, old, t0, BACK_WITHIN_S + 8))
                assert d.proc.poll() is None, f"the daemon died during the chaos:\n{d.log()}"
                rss.sample([d.proc.pid])
                time.sleep(max(0.0, t0 + KILL_EVERY_S - time.monotonic()))

            d.remember_children()
            hung = rng.choice(wait_for(lambda: _running(stats), 10, "a running worker to hang"))
            old = int(stats[hung]["pid"])
            assert old > 0
            t0 = time.monotonic()
            os.kill(old, signal.SIGSTOP)
            hang_latency = back_after(stats, hung, old, t0, HEARTBEAT_S + 8)
            assert not alive(old), "the hung worker was not killed"
            d.remember_children()

            frames = [int(stats[i]["frames"]) for i in range(WORKERS)]
            wait_for(lambda: all(int(stats[i]["frames"]) > frames[i] for i in range(WORKERS)), 10,
                     "every worker to collect again")
            expected = {i: kills[i] + (i == hung) for i in range(WORKERS)}
            with ControlClient(d.control_address, timeout=5.0) as client:
                status = client.status()
            assert {w.index: w.restarts for w in status.workers} == expected
            assert all(w.state == "running" for w in status.workers)
            assert metrics_restarts(d) == expected
            assert d.log().count("event worker.hung") == 1, "one hang must be reported (and killed) once"
        finally:
            stats.close()
        children = d.remember_children()
        assert d.stop(signal.SIGTERM, timeout=30) == 0
        assert not [pid for pid in children if alive(pid)], "a worker outlived the daemon"

        stored = read_storage(d.replay_path)
        counts = check_integrity(stored)
        odd = stored.odd
        with ReplayReader(d.replay_path) as reader:  # samples never hold a slot left mid-write
            drawn = reader.sample(1 << 16)
        assert bool(verify_rows(drawn).all())
        assert not np.isin(drawn.get(("ingestd", "write_index")).numpy() % stored.capacity, odd).any()
        with ReplayStorage.open(d.replay_path, recover=True) as storage:
            assert int((storage.seq & 1).sum()) == 0
            assert storage.write_count == stored.write_count

    p50, p99 = percentiles(latencies, 50, 99)
    drift = rss.drift(warmup_s=min(5.0, CHAOS_S / 4), edge=2)  # 14 s: ~5 samples after the warm-up
    record("1 worker chaos", seconds=CHAOS_S, kills=sum(kills.values()), restarts=sum(expected.values()),
           restart_p50_s=round(p50, 3), restart_p99_s=round(p99, 3), restart_max_s=round(max(latencies), 3),
           hang_detected_and_back_s=round(hang_latency, 3), rows_verified=counts["rows"], torn=counts["torn"],
           duplicated_steps=counts["duplicates"], stream_breaks=counts["breaks"],
           incarnations=counts["incarnations"], slots_left_mid_write=int(odd.size),
           daemon_rss_drift_pct=round(100 * drift.get(d.proc.pid, float("nan")), 2))
    # the targets (back within BACK_WITHIN_S, a hang back within HEARTBEAT_S + BACK_WITHIN_S) are
    # figures, recorded above: on a slow, shared CI machine they are not behaviour. What is asserted
    # is that every worker came back at all, within back_after's 10 s.
