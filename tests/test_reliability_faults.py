"""Reliability, env faults: envs that raise, change shape or return NaN rewards, on some
workers of one daemon. Each fault gives a clear error in the log and in status and a restart
with backoff; a worker that can never write is marked failed; the healthy worker is not
disturbed; no bad row is ever stored.

Decision (README, "Bad env data never enters the storage"): a chunk holding a non-finite
reward is refused whole (no row of it is stored); the worker records the error and exits,
and the supervisor restarts it with backoff, like any other crash.
"""
from __future__ import annotations

import re

from control_daemon import shared_paused, wait_for
from daemon_proc import DaemonProc
from ingestd import ControlClient, DaemonUnavailable
from reliability_util import FAULTS, PLUGIN_ENV, check_integrity, read_storage, record

BUDGET, BACKOFF_S, BACKOFF_MAX_S = 3, 0.2, 0.4
SETTINGS = {"workers.count": 6, "workers.env": "reliability_util:faulty_by_worker", "workers.policy": "Random",
            "workers.num_envs": 8, "workers.chunk_steps": 8, "replay.capacity": 200_000, "metrics.enabled": False,
            "workers.restart_budget": BUDGET, "workers.restart_backoff_s": BACKOFF_S,
            "workers.restart_backoff_max_s": BACKOFF_MAX_S,
            # the first chunk is progress (workers 4 and 5 fail a few chunks in; with the default 10 s they
            # would grow their backoff and count against the budget: tests/test_supervisor.py covers that)
            "workers.restart_reset_s": 0.0}
# what the log and status must say for each faulty worker
MESSAGES = {1: "simulated env failure in step",
            2: r"leaf \('next', 'observation'\): got shape \(8,\)",
            3: r"non-finite reward in \d+ rows .*the chunk was not stored",
            4: r"non-finite reward in \d+ rows .*the chunk was not stored",
            5: r"changed \('next', 'observation'\) within a chunk"}
CRASH_LOOPING, PROGRESSING = (1, 2, 3), (4, 5)


def restarted_after(log: str, worker: int) -> list[float]:
    """The backoff delays of the worker's restarts, from the daemon's event log lines."""
    return [float(s) for s in re.findall(rf'event worker\.restarted \{{"worker": {worker}, .*"after_s": ([\d.]+)\}}',
                                         log)]


def test_env_faults_are_contained():
    assert set(FAULTS) == {*CRASH_LOOPING, *PROGRESSING}
    with shared_paused(), DaemonProc(overrides=SETTINGS, env=PLUGIN_ENV) as d:
        with ControlClient(d.control_address, timeout=2.0) as client:
            status = wait_for(lambda: _status_when(client, d, lambda s: [w.state for w in s.workers][1:4]
                                                   == ["failed"] * 3), 60, "workers 1-3 to be marked failed", 0.05)
            healthy = status.workers[0]
            assert healthy.state == "running" and healthy.restarts == 0
            for worker in CRASH_LOOPING:
                w = status.workers[worker]
                assert re.search(MESSAGES[worker], w.error), (worker, w.error)
                assert w.restarts == BUDGET - 1 and w.frames == 0
            assert status.workers[1].error.startswith("workers.env raised RuntimeError: "), status.workers[1].error
            seen_errors = {}

            def progressing_errors(s) -> bool:  # a looping worker shows its error between death and restart
                for worker in PROGRESSING:
                    if s.workers[worker].error:
                        seen_errors.setdefault(worker, s.workers[worker].error)
                return set(seen_errors) == set(PROGRESSING) and all(s.workers[w].restarts >= 2 for w in PROGRESSING)

            status = wait_for(lambda: _status_when(client, d, progressing_errors), 60,
                              "workers 4-5 to show their errors and be restarted twice", 0.01)
            for worker in PROGRESSING:
                assert re.search(MESSAGES[worker], seen_errors[worker]), (worker, seen_errors[worker])
                assert status.workers[worker].state != "failed" and status.workers[worker].frames > 0
                assert re.search(MESSAGES[worker], status.workers[worker].error)  # kept across the restart
            frames = status.workers[0].frames
            final = wait_for(lambda: _status_when(client, d, lambda s: s.workers[0].frames > frames), 10,
                             "the healthy worker to go on collecting", 0.05)
        assert final.workers[0].pid == healthy.pid and final.workers[0].restarts == 0
        assert d.stop() == 0
        log = d.log()
        for worker, message in MESSAGES.items():
            assert re.search(message, log), f"worker {worker}'s error is not in the log"
        for worker in CRASH_LOOPING:
            assert restarted_after(log, worker) == [BACKOFF_S * 2 ** k for k in range(BUDGET - 1)], worker
            assert re.search(rf"worker {worker} failed {BUDGET} times in a row without writing a chunk in between; "
                             "marked failed", log)
        for worker in PROGRESSING:  # progress resets the failure count: the first backoff every time
            delays = restarted_after(log, worker)
            assert len(delays) >= 2 and set(delays) == {BACKOFF_S}, (worker, delays)
        stored = read_storage(d.replay_path)
        counts = check_integrity(stored)  # verify_rows: no NaN reward, no foreign or torn row
        writers = set(stored.rows.get(("ingestd", "worker")).unique().tolist())
    assert writers == {0, *PROGRESSING}, writers
    record("6 env faults", failed_workers=len(CRASH_LOOPING), restarts_per_failed=BUDGET - 1,
           progressing_restarts=min(status.workers[w].restarts for w in PROGRESSING),
           healthy_restarts=final.workers[0].restarts, rows_verified=counts["rows"], bad_rows_stored=counts["torn"])


def _status_when(client, d, predicate):
    assert d.proc.poll() is None, d.log()
    try:
        status = client.status()
    except DaemonUnavailable:  # not listening yet
        return None
    return status if predicate(status) else None
