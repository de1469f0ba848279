"""Metrics: the collector on a real stats block, the HTTP exporter, and a real
daemon scraped directly and by a real Prometheus evaluating every dashboard expr."""
from __future__ import annotations

import math

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from daemon_proc import DaemonProc, children
from ingestd.collect.stats import MAX_WORKERS, RING, PauseReason, State, StatsBlock
from ingestd.errors import ConfigError
from ingestd.metrics import IngestdCollector, MetricsExporter
from ingestd.service.config import load_config
from ingestd.service.telemetry import Telemetry
from prometheus_proc import MISSING, PrometheusProc, promtool
from test_dashboard import load_dashboard, metric_names, panel_exprs, substitute

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
LIVE_STATES = {"starting", "running", "paused", "stopping", "stopped", "failed"}


# -- helpers ----------------------------------------------------------------------------------
def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(found: dict, name: str, **labels) -> float:
    return found[(name, frozenset(labels.items()))]


def by_worker(found: dict, name: str, **labels) -> dict[str, float]:
    """``{worker: value}`` of the samples of ``name`` that have ``labels`` too."""
    return {dict(k[1])["worker"]: v for k, v in found.items()
            if k[0] == name and labels.items() <= dict(k[1]).items()}


def documented() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the reference tables in docs/metrics.md."""
    rows = re.findall(r"^\| `([a-z_]+)` \| (counter|gauge|histogram|summary) \|([^|]*)\|", DOCS.read_text(), re.M)
    return {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def exposed(text: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) from an exposition's TYPE lines and samples."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    labels: dict[str, set[str]] = {name: set() for name in types}
    for sample, labelset in samples(text):
        family = sample if sample in types else re.sub(r"_(bucket|sum|count|created)$", "", sample)
        labels[family] |= {k for k, _ in labelset} - {"le"}
    return {name: (kind, labels[name]) for name, kind in types.items()}


def test_labels_table_lists_every_label_of_the_reference():
    """The "Labels are few and bounded" table names every label a metric carries (ingestd_build_info's
    version labels are explained in its own row)."""
    text = DOCS.read_text()
    table = set(re.findall(r"^\| `(\w+)` \| ", text.split("## Reference")[0], re.M))
    used = set().union(*(labels for name, (_, labels) in documented().items() if name != "ingestd_build_info"))
    assert used - table == set(), f"labels missing from the labels table: {sorted(used - table)}"


# -- the collector on a real stats block ------------------------------------------------------
class Box(SimpleNamespace):
    """Stand-in for the replay storage / weight store: only the fields the collector reads."""


@pytest.fixture
def block(tmp_path):
    stats = StatsBlock(tmp_path / "stats", create=True)
    yield stats
    stats.close()


def scrape(block, weights_version=3, storage=None, telemetry=None, clock=time.monotonic, collector=None):
    collector = collector or IngestdCollector(
        block, storage or Box(write_count=150, capacity=100), Box(version=weights_version) if weights_version else None,
        telemetry or Telemetry(), started_at=1e9, clock=clock, commands=["ping", "push_weights"])
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return samples(text), text, collector


@pytest.mark.parametrize("state", [s for s in State if s != State.EMPTY], ids=lambda s: s.label)
def test_state_is_one_hot(block, state):
    block[4]["state"] = state
    found, _, _ = scrape(block)
    hot = {dict(k[1])["state"]: v for k, v in found.items() if k[0] == "ingestd_worker_state"}
    assert set(hot) == LIVE_STATES and hot[state.label] == 1 and sum(hot.values()) == 1
    assert set(by_worker(found, "ingestd_frames_total")) == {"4"}  # empty slots are not workers


@pytest.mark.parametrize("current,applied,lag", [(0, 0, 0), (3, 3, 0), (7, 2, 5), (2, 5, 0)])
def test_policy_lag(block, current, applied, lag):
    block[0]["state"], block[0]["weights_version"] = State.RUNNING, applied
    found, _, _ = scrape(block, weights_version=current)
    assert value(found, "ingestd_weights_version") == current
    assert value(found, "ingestd_worker_weights_version", worker="0") == applied
    assert value(found, "ingestd_policy_lag_versions", worker="0") == lag


@pytest.mark.parametrize("state", [State.STARTING, State.FAILED, State.STOPPED, State.RUNNING])
def test_a_worker_that_applied_no_weights_has_no_version_and_no_lag(block, state):
    """Observability review: each restart read version 0 and a lag of the whole store's version,
    a spike far past the panel's threshold; a failed worker's lag grew with every push."""
    block[0]["state"], block[0]["weights_version"] = state, 0
    found, _, _ = scrape(block, weights_version=13)
    assert math.isnan(value(found, "ingestd_worker_weights_version", worker="0"))
    assert math.isnan(value(found, "ingestd_policy_lag_versions", worker="0"))


@pytest.mark.parametrize("state,reason,hot", [
    (State.RUNNING, PauseReason.LIMITER, "limiter"), (State.RUNNING, PauseReason.PRIORITY_LOCK, "priority_lock"),
    (State.RUNNING, PauseReason.NONE, None), (State.PAUSED, PauseReason.REQUESTED, None)])
def test_a_running_worker_that_waits_says_why(block, state, reason, hot):
    """Trainer review: workers stopped by a trainer holding priority.lock read plain "running"."""
    block[2]["state"], block[2]["pause_reason"] = state, reason
    found, _, _ = scrape(block)
    waiting = {dict(k[1])["reason"]: v for k, v in found.items() if k[0] == "ingestd_worker_waiting"}
    assert set(waiting) == {"limiter", "priority_lock"}
    assert {r for r, v in waiting.items() if v == 1} == ({hot} if hot else set())


def test_restarts_are_counted_by_reason(block):
    """Observability review: IngestdWorkerRestarting fired on three operator restarts."""
    block[0]["state"], block[0]["restarts"], block[0]["requested_restarts"] = State.RUNNING, 5, 3
    block[0]["failure_restarts"] = 2
    found, _, _ = scrape(block)
    assert value(found, "ingestd_worker_restarts_total", worker="0", reason="failure") == 2
    assert value(found, "ingestd_worker_restarts_total", worker="0", reason="requested") == 3


def _finish(block, index, returns):
    rec = block[index]
    count = int(rec["returns_count"])
    for r in returns:
        rec["returns"][count % RING] = r
        count += 1
    rec["returns_count"] = count


def test_episode_return_histogram_reads_the_ring_since_the_last_scrape(block):
    block[0]["state"] = block[1]["state"] = State.RUNNING
    _finish(block, 0, [1.0, 22.0, -3.0])
    found, text, collector = scrape(block)
    assert value(found, "ingestd_episode_return_bucket", le="+Inf") == 3
    assert not {"ingestd_episode_return_sum", "ingestd_episode_return_count"} & {n for n, _ in found}  # OpenMetrics
    assert value(found, "ingestd_worker_episode_return_mean", worker="0") == pytest.approx(20 / 3)
    assert ("ingestd_worker_episode_return_mean", frozenset({("worker", "1")})) not in found  # none finished yet
    assert value(found, "ingestd_episode_return_bucket", le="0.0") == 1
    assert value(found, "ingestd_episode_return_bucket", le="50.0") == 3
    found, _, _ = scrape(block, collector=collector)  # nothing new: nothing counted twice
    assert value(found, "ingestd_episode_return_bucket", le="+Inf") == 3
    _finish(block, 0, [500.0] * (RING + 8))  # more than the ring holds between two scrapes
    _finish(block, 1, [float("nan"), 2.0])
    found, _, _ = scrape(block, collector=collector)
    assert value(found, "ingestd_episode_returns_dropped_total") == 8
    assert value(found, "ingestd_episode_return_bucket", le="200.0") == 4
    assert value(found, "ingestd_episode_return_bucket", le="+Inf") == 3 + RING + 1  # NaN skipped
    assert value(found, "ingestd_worker_episode_return_mean", worker="0") == 500  # the ring's last 32
    assert value(found, "ingestd_worker_episode_return_mean", worker="1") == 2  # NaN left out


def _quantile(found: dict, q: float) -> float:
    """``histogram_quantile(q, ingestd_episode_return_bucket)`` as Prometheus computes it: linear
    inside the bucket the rank falls in."""
    buckets = sorted((float(dict(labels)["le"]), n) for (name, labels), n in found.items()
                     if name == "ingestd_episode_return_bucket")
    rank = q * buckets[-1][1]
    below, count_below = buckets[0][0], 0.0
    for le, count in buckets:
        if count >= rank:
            return below + (le - below) * (rank - count_below) / (count - count_below)
        below, count_below = le, count


@pytest.mark.parametrize("returns", [range(8, 12), range(180, 221), range(-1600, -99)], ids=["8-11", "180-220", "neg"])
def test_default_return_buckets_give_quantiles_near_the_true_ones(block, returns):
    """The metrics review's case: CartPole returns of 8-11 read p10 5.7, p50 8.3 and p90 16 from
    1-2-5 buckets per decade; 10 per decade keep every quantile within a bucket's 25 %."""
    block[0]["state"] = State.RUNNING
    values = [float(v) for v in returns for _ in range(3)]
    collector = None
    for start in range(0, len(values), RING):  # a scrape per ring's worth: none dropped
        _finish(block, 0, values[start:start + RING])
        found, _, collector = scrape(block, collector=collector)
    assert value(found, "ingestd_episode_returns_dropped_total") == 0
    for q in (0.1, 0.5, 0.9):
        true = float(np.quantile(values, q))
        assert _quantile(found, q) == pytest.approx(true, rel=0.25), (q, true)


def test_configured_return_buckets_are_the_ones_exported(block):
    """Bounds of 0 and up, and a negative return all the same: still no _sum (it would decrease,
    and no longer be a counter: OpenMetrics parsers refuse it, rate() sees a reset)."""
    config = load_config(None, ["metrics.port=0", "metrics.episode_return_buckets=[0, 100, 1e3]"])
    block[0]["state"] = State.RUNNING
    _finish(block, 0, [-200.0, 50.0])
    exporter = MetricsExporter(config)
    exporter.start(fake_daemon(block, config))
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.address[1]}/metrics", timeout=5).read().decode()
    finally:
        exporter.stop()
    found = samples(text)
    bounds = [dict(labels)["le"] for (name, labels) in found if name == "ingestd_episode_return_bucket"]
    assert bounds == ["0.0", "100.0", "1000.0", "+Inf"]
    assert value(found, "ingestd_episode_return_bucket", le="0.0") == 1
    assert not {"ingestd_episode_return_sum", "ingestd_episode_return_count"} & {n for n, _ in found}


def test_overlapping_scrapes_count_each_episode_once(block):
    """Two scrapes overlap (an HA pair of Prometheus servers, a curl): the one with the older snapshot
    of the ring feeds the histogram last. It must not count those episodes again, nor as dropped."""
    block[0]["state"] = State.RUNNING
    _finish(block, 0, [1.0] * 100)
    _, _, collector = scrape(block)  # RING observed, 100 - RING dropped
    snapshot, overlapped = collector._snapshot, []

    def snapshot_then_overlap():
        taken = snapshot()
        if not overlapped:
            overlapped.append(True)
            _finish(block, 0, [2.0] * 10)
            scrape(block, collector=collector)  # the second scrape snapshots and feeds count 110 first
        return taken

    collector._snapshot = snapshot_then_overlap
    scrape(block, collector=collector)  # the first scrape feeds its older snapshot (count 100) last
    collector._snapshot = snapshot
    found, _, _ = scrape(block, collector=collector)
    assert value(found, "ingestd_episode_returns_dropped_total") == 100 - RING
    assert value(found, "ingestd_episode_return_bucket", le="+Inf") == RING + 10
    assert value(found, "ingestd_episode_return_bucket", le="1.0") == RING


def test_worker_up_needs_a_live_child_in_a_live_state(block):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        block[0]["state"], block[0]["pid"] = State.RUNNING, child.pid
        block[1]["state"], block[1]["pid"] = State.RUNNING, os.getppid()  # alive but not our child
        block[2]["state"], block[2]["pid"] = State.FAILED, child.pid
        block[3]["state"], block[3]["pid"] = State.STARTING, 0
        found, _, _ = scrape(block)
        assert by_worker(found, "ingestd_worker_up") == {"0": 1, "1": 0, "2": 0, "3": 0}
        child.kill()
        child.wait()
        found, _, _ = scrape(block)
        assert value(found, "ingestd_worker_up", worker="0") == 0
    finally:
        child.kill()
        child.wait()


def test_heartbeat_age_uses_the_injected_clock(block):
    block[0]["state"], block[0]["pid"], block[0]["heartbeat"] = State.RUNNING, 1234, 100.0
    found, _, _ = scrape(block, clock=lambda: 102.5)
    assert value(found, "ingestd_worker_heartbeat_age_seconds", worker="0") == 2.5


def test_heartbeat_age_is_nan_for_a_worker_that_is_not_live(block):
    """A stopped or failed worker (or one without a process yet) beats no more: its age grew for
    ever while ``status`` showed ``heartbeat_age_s: null`` (the same rule: stats.heartbeat_age)."""
    import math

    for index, (state, pid) in enumerate([(State.RUNNING, 1234), (State.PAUSED, 1234), (State.STOPPED, 1234),
                                          (State.FAILED, 1234), (State.STARTING, 0)]):
        block[index]["state"], block[index]["pid"], block[index]["heartbeat"] = state, pid, 100.0
    found, _, _ = scrape(block, clock=lambda: 1e6)
    ages = by_worker(found, "ingestd_worker_heartbeat_age_seconds")
    assert {w: math.isnan(age) for w, age in ages.items()} == {"0": False, "1": False, "2": True, "3": True,
                                                              "4": True}, ages


def test_full_block_scrape_is_cheap_and_lints(block):
    block.records["state"][:] = State.RUNNING
    block.records["frames"][:] = 10
    telemetry = Telemetry()
    telemetry.observe_request("ping", "ok")
    telemetry.observe_request("pause", "timeout")
    telemetry.observe_push(0.03)
    t0 = time.process_time()  # CPU time: what others run on a shared machine does not count
    found, text, _ = scrape(block, telemetry=telemetry)
    elapsed = time.process_time() - t0
    assert len(by_worker(found, "ingestd_frames_total")) == MAX_WORKERS
    assert value(found, "ingestd_control_requests_total", cmd="push_weights", outcome="ok") == 0  # pre-initialised
    assert value(found, "ingestd_control_requests_total", cmd="pause", outcome="timeout") == 1
    # every error outcome too, before it happens: a series that first appears at 1 shows in no rate()
    assert value(found, "ingestd_control_requests_total", cmd="push_weights", outcome="bad_weights") == 0
    assert value(found, "ingestd_control_requests_total", cmd="invalid", outcome="unknown_command") == 0
    assert ("ingestd_control_requests_total", frozenset({"cmd": "invalid", "outcome": "ok"}.items())) not in found
    assert value(found, "ingestd_weight_push_seconds_bucket", le="0.05") == 1
    assert value(found, "ingestd_weight_push_seconds_bucket", le="0.025") == 0
    assert value(found, "ingestd_replay_rows") == 100 and value(found, "ingestd_replay_writes_total") == 150
    assert elapsed < 2.0, f"a full scrape of {MAX_WORKERS} workers took {elapsed:.3f} s of CPU (~0.1 s expected)"
    if not MISSING:
        result = promtool("check", "metrics", stdin=text)
        assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_source_blanks_only_its_section(block):
    class Closed:
        capacity = 10

        @property
        def write_count(self):
            raise RuntimeError("closed")

    block[0]["state"] = State.RUNNING
    found, _, _ = scrape(block, storage=Closed())
    assert value(found, "ingestd_scrape_errors_total", section="replay") == 1
    assert not any(name.startswith("ingestd_replay_") for name, _ in found)
    assert value(found, "ingestd_frames_total", worker="0") == 0 and value(found, "ingestd_up") == 1


# -- the HTTP exporter --------------------------------------------------------------------------
def fake_daemon(block, config):
    layout = SimpleNamespace(stats=block, storage=Box(write_count=5, capacity=10), weights=None)
    return SimpleNamespace(layout=layout, telemetry=Telemetry(), started_at=time.time(), config=config,
                           supervisor=SimpleNamespace(count=config.workers.count))


def test_default_address_is_loopback_on_a_fixed_port():
    metrics = load_config(None).metrics
    assert metrics.enabled and metrics.address == "127.0.0.1" and metrics.port == 9464


def test_exporter_serves_its_own_registry_and_stops(block):
    config = load_config(None, ["metrics.port=0"])
    exporter = MetricsExporter(config)
    exporter.start(fake_daemon(block, config))
    try:
        host, port = exporter.address
        assert host == "127.0.0.1" and port > 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "ingestd_replay_writes_total 5.0" in text and "process_cpu_seconds_total" in text
        assert "python_gc_objects_collected_total" not in text  # not the global registry
    finally:
        exporter.stop()
    # refused, not merely unanswered: a port still listening after stop() would time out instead
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    assert isinstance(refused.value.reason, ConnectionRefusedError), refused.value


def test_exporter_port_in_use_is_a_config_error(block):
    config = load_config(None, ["metrics.port=0"])
    first = MetricsExporter(config)
    first.start(fake_daemon(block, config))
    try:
        taken = load_config(None, [f"metrics.port={first.address[1]}"])
        with pytest.raises(ConfigError) as err:
            MetricsExporter(taken).start(fake_daemon(block, taken))
        assert err.value.key == "metrics.port" and "in use" in str(err.value)
    finally:
        first.stop()


# -- a real daemon, scraped directly and by a real Prometheus ----------------------------------
@pytest.fixture(scope="module")
def live():
    daemon = DaemonProc(overrides={"workers.count": 2})
    prom = PrometheusProc([f"127.0.0.1:{daemon.metrics_port}"]) if not MISSING else None
    try:
        daemon.start()
        if prom is not None:
            prom.start()  # its first scrape lands ~6 s later: overlap that with the daemon's start
        daemon.wait_ready(rows=1)
        yield SimpleNamespace(daemon=daemon, prom=prom, url=f"http://127.0.0.1:{daemon.metrics_port}/metrics")
    finally:
        if prom is not None:
            prom.close()
        daemon.close()


def fetch(live) -> str:
    return urllib.request.urlopen(live.url, timeout=5).read().decode()


def poll(fn, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last}")


def test_live_scrape_has_sane_values(live):
    first = samples(fetch(live))
    found = poll(lambda: (lambda f: (all(f[k] > first[k] for k in f if k[0] == "ingestd_frames_total"), f))(
        samples(fetch(live))), 20, "frames to increase on every worker")
    assert by_worker(found, "ingestd_worker_up") == {"0": 1, "1": 1}
    for worker in ("0", "1"):
        hot = {dict(k[1])["state"]: v for k, v in found.items()
               if k[0] == "ingestd_worker_state" and dict(k[1])["worker"] == worker}
        assert set(hot) == LIVE_STATES and sum(hot.values()) == 1 and hot["running"] == 1
        assert 0 <= value(found, "ingestd_worker_heartbeat_age_seconds", worker=worker) < 5
        assert value(found, "ingestd_worker_weights_version", worker=worker) >= 1
        assert value(found, "ingestd_policy_lag_versions", worker=worker) == 0
    assert value(found, "ingestd_weights_version") >= 1
    assert value(found, "ingestd_workers_desired") == 2
    assert value(found, "ingestd_replay_capacity_rows") == 100_000
    assert 0 < value(found, "ingestd_replay_rows") <= value(found, "ingestd_replay_writes_total")
    assert value(found, "ingestd_up") == 1
    assert abs(value(found, "ingestd_start_time_seconds") - time.time()) < 600
    assert sum(v for k, v in found.items() if k[0] == "ingestd_episodes_total") > 0
    assert value(found, "ingestd_episode_return_bucket", le="+Inf") > 0  # CartPole episodes finish quickly
    info = next(dict(k[1]) for k in found if k[0] == "ingestd_build_info")
    assert info["python"] == ".".join(map(str, sys.version_info[:3])) and info["version"] and info["torch"]


def test_live_exposition_passes_promtool_and_openmetrics(live):
    request = urllib.request.Request(live.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    openmetrics = urllib.request.urlopen(request, timeout=5).read().decode()
    assert openmetrics.endswith("# EOF\n")
    assert len(list(openmetrics_families(openmetrics))) >= 25  # the strict parser checks histogram rules
    if MISSING:
        pytest.skip(MISSING)
    result = promtool("check", "metrics", stdin=fetch(live))
    assert result.returncode == 0, result.stdout + result.stderr


def test_docs_list_exactly_the_exposed_metrics(live):
    docs, live_metrics = documented(), exposed(fetch(live))
    assert len(docs) >= 25
    assert set(docs) == set(live_metrics), (f"undocumented: {sorted(set(live_metrics) - set(docs))}; "
                                            f"documented but not exposed: {sorted(set(docs) - set(live_metrics))}")
    for name, (kind, labels) in docs.items():
        assert live_metrics[name] == (kind, labels), name


def test_bound_to_loopback_only(live):
    port = f"{live.daemon.metrics_port:04X}"
    listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[1].endswith(":" + port) and line.split()[3] == "0A"]
    assert listening == [f"0100007F:{port}"]
    assert f"serving metrics on http://127.0.0.1:{live.daemon.metrics_port}/metrics" in live.daemon.log()


def test_dashboard_uses_only_exposed_metrics(live):
    names = {name for name, _ in samples(fetch(live))}
    for panel, ref, expr in panel_exprs(load_dashboard()):
        missing = metric_names(expr) - names
        assert not missing, f"panel {panel['title']!r} ({ref}) uses {sorted(missing)}, which the exporter lacks"


# Labels a query may use besides the exporter's: Prometheus adds `instance` and `job` to every series.
TARGET_LABELS = {"instance", "job"}
SELECTOR = re.compile(r"\b((?:ingestd|process)_[a-z0-9_]+)\{([^}]*)\}")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def test_dashboard_uses_only_exposed_labels(live):
    """Label names in selectors and in by/on clauses exist on the metrics the expr reads (a typo like
    `wroker=~".*"` or `by (stats)` still returns data, so the Prometheus test cannot catch it)."""
    labels: dict[str, set[str]] = {}
    for name, labelset in samples(fetch(live)):
        labels.setdefault(name, set()).update(k for k, _ in labelset)
    for panel, ref, expr in panel_exprs(load_dashboard()):
        where = f"panel {panel['title']!r} ({ref})"
        for metric, matchers in SELECTOR.findall(expr):
            named = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
            unknown = named - labels[metric] - TARGET_LABELS
            assert not unknown, f"{where}: {metric} has no label {sorted(unknown)}"
        known = set().union(*(labels[m] for m in metric_names(expr))) | TARGET_LABELS
        for group in GROUPING.findall(expr):
            named = {g.strip() for g in group.split(",") if g.strip()}
            assert named <= known, f"{where}: groups by {sorted(named - known)}, which no metric of it has"


def test_dashboard_exprs_return_series_from_real_prometheus(live):
    if MISSING:
        pytest.skip(MISSING)
    exprs = [(f"{p['title']} ({ref})", substitute(expr)) for p, ref, expr in panel_exprs(load_dashboard())]

    def empty():  # (a filter "> 0" keeps only series with something to show: checked without it)
        bad = [title for title, expr in exprs if not live.prom.query(expr.removesuffix(" > 0"))]
        return not bad, bad

    poll(empty, 45, "every dashboard expr to return a series", interval=1.0)


def test_control_requests_and_weight_pushes_are_counted(live):
    import torch

    from ingestd.control.client import ControlClient
    from ingestd.errors import CommandFailed
    from ingestd.weights.store import WeightStore

    store = WeightStore.attach(live.daemon.runtime_dir / "weights")
    try:
        version, state = store.read()
    finally:
        store.close()
    before = samples(fetch(live))
    with ControlClient(live.daemon.control_address, timeout=20) as client:
        client.ping()
        pushed = client.push_weights({k: v + 0.01 for k, v in state.items()}, wait=True)
        with pytest.raises(CommandFailed) as failed:
            client.push_weights({k: torch.zeros(v.numel() + 1) for k, v in state.items()})
    found = samples(fetch(live))
    assert pushed == version + 1 == value(found, "ingestd_weights_version")
    assert by_worker(found, "ingestd_worker_weights_version") == {"0": pushed, "1": pushed}  # wait=True
    assert by_worker(found, "ingestd_policy_lag_versions") == {"0": 0, "1": 0}

    def grew(name, **labels):
        return value(found, name, **labels) - before.get((name, frozenset(labels.items())), 0)

    assert grew("ingestd_control_requests_total", cmd="ping", outcome="ok") == 1
    assert grew("ingestd_control_requests_total", cmd="push_weights", outcome="ok") == 1
    assert grew("ingestd_control_requests_total", cmd="push_weights", outcome=failed.value.code) == 1
    refused = ("ingestd_control_requests_total", frozenset({"cmd": "push_weights", "outcome": failed.value.code}.items()))
    seen_before = before.get(refused)
    assert grew("ingestd_weight_push_seconds_count") >= 1
    count = value(found, "ingestd_weight_push_seconds_count")
    assert value(found, "ingestd_weight_push_seconds_bucket", le="+Inf") == count
    if live.prom is not None:  # and the dashboard's "Control errors/s" shows that one error
        shown = substitute(next(expr for panel, _, expr in panel_exprs(load_dashboard())
                                if panel["title"] == "Control errors/s" and "cmd, outcome" in expr))

        def refusal_shown():
            got = [r["metric"] for r in live.prom.query(shown)]
            return any(m.get("cmd") == "push_weights" and m.get("outcome") == failed.value.code for m in got), got

        poll(refusal_shown, 30, "the panel to show the refused push", interval=1.0)
    assert seen_before == 0, "the error's series was not there at 0 before it: rate() misses its first error"


def test_killed_worker_counts_a_restart(live):
    daemon = live.daemon
    before = samples(fetch(live))
    restarts = by_worker(before, "ingestd_worker_restarts_total", reason="failure")
    from ingestd.control.client import ControlClient

    with ControlClient(daemon.control_address, timeout=30) as client:
        workers = client.status().workers
    victim = next(w.pid for w in workers if w.state == "running")
    assert victim in children(daemon.proc.pid), f"worker pid {victim} is not a child of the daemon"
    daemon.remember_children()
    os.kill(victim, signal.SIGKILL)

    def restarted():
        now = samples(fetch(live))
        after = by_worker(now, "ingestd_worker_restarts_total", reason="failure")
        grew = {w: after[w] - restarts[w] for w in restarts if after[w] != restarts[w]}
        up = by_worker(now, "ingestd_worker_up")
        return len(grew) == 1 and list(grew.values()) == [1] and set(up.values()) == {1}, (grew, up)

    poll(restarted, 30, "one worker's restarts_total to grow by 1 and every worker to be up again")


def test_scale_moves_workers_desired_and_drops_the_removed_worker(live):
    """``ingestd_workers_desired`` follows a ``scale`` command (docs/metrics.md), and a worker scaled
    away leaves no series behind."""
    from ingestd.control.client import ControlClient

    with ControlClient(live.daemon.control_address, timeout=30) as client:
        try:
            client.scale(1, wait=True)

            def scaled_down():
                found = samples(fetch(live))
                return (value(found, "ingestd_workers_desired") == 1
                        and set(by_worker(found, "ingestd_worker_up")) == {"0"}), found

            poll(scaled_down, 20, "workers_desired to be 1 and worker 1 to be gone")
        finally:
            client.scale(2, wait=True)
    found = poll(lambda: (lambda f: (by_worker(f, "ingestd_worker_up") == {"0": 1, "1": 1}, f))(
        samples(fetch(live))), 30, "both workers to be up again")
    assert value(found, "ingestd_workers_desired") == 2


def test_held_connections_cannot_exhaust_the_daemons_descriptors(monkeypatch):
    """prometheus_client's server gave each connection a thread with no cap or timeout: a local
    user holding ~1,000 half-sent requests used up the descriptors and the daemon crashed."""
    import socket
    import threading

    from prometheus_client import Counter

    from ingestd.metrics import exporter

    monkeypatch.setattr(exporter, "CONNECTION_TIMEOUT_S", 0.5)
    registry = CollectorRegistry()
    Counter("probe_total", "a probe", registry=registry).inc()
    server, thread = exporter.serve("127.0.0.1", 0, registry)
    port = server.server_address[1]
    held = []
    try:
        threads = threading.active_count()
        for _ in range(exporter.MAX_CONNECTIONS + 40):
            conn = socket.create_connection(("127.0.0.1", port), timeout=5)
            conn.sendall(b"GET /metr")  # never finished
            held.append(conn)
        time.sleep(0.2)
        assert threading.active_count() <= threads + exporter.MAX_CONNECTIONS
        for conn in held:  # each is closed by the server: at once over the cap, else after the timeout
            assert conn.recv(1) == b""
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "probe_total 1.0" in page
    finally:
        for conn in held:
            conn.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_connection_trickling_bytes_is_cut_at_its_deadline(monkeypatch):
    """A socket timeout restarts with every byte: one byte every few seconds held a slot for ever."""
    import socket

    from ingestd.metrics import exporter

    monkeypatch.setattr(exporter, "CONNECTION_TIMEOUT_S", 0.5)
    server, thread = exporter.serve("127.0.0.1", 0, CollectorRegistry())
    try:
        with socket.create_connection(server.server_address[:2], timeout=5) as conn:
            started = time.monotonic()
            conn.sendall(b"GET /metrics HTTP/1.1\r\n")
            cut = False
            while time.monotonic() - started < 5 and not cut:
                time.sleep(0.1)
                try:
                    conn.sendall(b"X-Trickle: 1\r\n")  # well within the socket timeout each time
                    conn.setblocking(False)
                    cut = conn.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:  # reset: cut too
                    cut = True
                finally:
                    conn.setblocking(True)
            assert cut and time.monotonic() - started < 2.5
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
