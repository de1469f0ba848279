"""A stats record read while its writer is mid-update: the returns ring's seqlock, and restart
counters that never step back (metrics review: both could mislead a scrape)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ingestd.collect.rollout import Finished
from ingestd.collect.stats import RING, State, StatsBlock
from ingestd.collect.worker import Worker
from ingestd.control.context import RecordReader
from ingestd.metrics import IngestdCollector
from ingestd.service import supervisor
from ingestd.service.telemetry import Telemetry


class Box:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def block(tmp_path):
    stats = StatsBlock(tmp_path / "stats", create=True)
    yield stats
    stats.close()


def _collector(block) -> IngestdCollector:
    return IngestdCollector(block, Box(write_count=0, capacity=100), None, Telemetry(), started_at=1e9)


def _scrape(collector) -> dict:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _writer(block, index: int) -> Worker:
    """A worker whose only part is its stats record (``Worker._account`` writes the returns)."""
    worker = Worker.__new__(Worker)
    worker.rec = block[index]
    return worker


def test_a_ring_being_written_is_not_fed_until_its_write_ends(block):
    block[0]["state"] = State.RUNNING
    worker, collector = _writer(block, 0), _collector(block)
    worker._account(10, Finished(returns=[1.0, 2.0], lengths=[1, 2]), 0.1)
    assert int(block[0]["returns_seq"]) == 2  # odd during the write, even after it
    block[0]["returns_seq"] += 1  # a write under way (a worker stopped inside _account, say)
    found = _scrape(collector)
    assert found[("ingestd_episode_return_bucket", (("le", "+Inf"),))] == 0
    assert block.recent_returns(0) == [(1.0, 1), (2.0, 2)]  # the copy it had (RETRIES tries)
    block[0]["returns_seq"] += 1
    found = _scrape(collector)
    assert found[("ingestd_episode_return_bucket", (("le", "+Inf"),))] == 2


def test_a_worker_killed_inside_its_ring_write_leaves_no_ring_torn_for_ever(block):
    block[0]["returns_seq"] = 7
    block.reset(0)
    assert int(block[0]["returns_seq"]) % 2 == 0


def _write_episodes(path, seconds: float) -> None:
    """A worker's returns, written by the real ``Worker._account`` for ``seconds``: episode k's
    return is k, so a whole ring holds k at slot k % RING for each of its last RING episodes."""
    block = StatsBlock(path)
    worker, count, until = _writer(block, 0), 0, time.monotonic() + seconds
    while time.monotonic() < until:
        n = 1 + count % 5
        worker._account(n, Finished(returns=[float(k) for k in range(count, count + n)], lengths=[1] * n), 0.0)
        count += n
        time.sleep(20e-6)  # (a worker writes once a chunk: a reader retrying at once finds the ring whole)


def test_readers_never_take_a_ring_half_written_by_a_concurrent_worker(block):
    """The writer is another process, as a worker is (in one process the GIL never switches between
    the ring's stores and the count's, which have no Python call between them)."""
    block[0]["state"] = State.RUNNING
    reader, torn, checked, empty = RecordReader(block.records), [], 0, 0
    writer = multiprocessing.get_context("fork").Process(target=_write_episodes, args=(block.path, 60.0))
    writer.start()
    try:
        while int(block[0]["returns_count"]) < 10 * RING:
            time.sleep(0.001)
        for _ in range(20000):
            copies, whole = block.snapshot(np.array([0]))
            views = [(int(copies[0]["returns_count"]), copies[0]["returns"].tolist())] if whole[0] else []
            values, recent, _ = reader.read(0)
            for count, ring in views:
                recent_copy = [ring[k % RING] for k in range(count - RING, count)]
                torn.extend([("snapshot", count)] if recent_copy != list(map(float, range(count - RING, count)))
                            else [])
            if not recent:  # a copy it could not take whole: none (the writer descheduled inside its write)
                empty += 1
            elif recent != list(map(float, range(values["returns_count"] - RING, values["returns_count"]))):
                torn.append(("status", values["returns_count"]))
            checked += 1
        assert writer.is_alive()  # it wrote throughout
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
    assert checked == 20000 and empty < checked // 2 and not torn, (len(torn), torn[:3], empty)


def test_restart_counters_never_step_back_between_a_restarts_stores(block, monkeypatch):
    """``failure`` was ``restarts - requested_restarts``, two words bumped in two stores: a scrape
    between them saw it fall by one (a counter reset to Prometheus: a spike in its rate)."""
    block[0]["state"] = State.RUNNING
    collector, seen = _collector(block), []

    def restarts() -> tuple[float, float]:
        found = _scrape(collector)
        return tuple(found[("ingestd_worker_restarts_total", (("reason", r), ("worker", "0")))]
                     for r in ("failure", "requested"))

    class Scraped:
        """The record, scraped after every store the supervisor makes into it."""

        def __getitem__(self, name):
            return block[0][name]

        def __setitem__(self, name, value):
            block[0][name] = value
            seen.append(restarts())

    for requested in (True, False, True, False, False):
        supervisor._count_restart(Scraped(), requested=requested)
    assert all(a <= b for earlier, later in zip(seen, seen[1:]) for a, b in zip(earlier, later)), seen
    assert seen[-1] == (3, 2) and int(block[0]["restarts"]) == 5
