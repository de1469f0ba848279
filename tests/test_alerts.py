"""The Prometheus alerting rules in dashboards/alerts.yml: promtool's checks and
unit tests (dashboards/alerts_test.yml), their metrics against docs/metrics.md,
and one alert fired for real by a real Prometheus scraping a real daemon whose
worker crash-loops."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from daemon_proc import DaemonProc
from prometheus_proc import MISSING, PrometheusProc, promtool
from test_dashboard import metric_names
from test_metrics import documented

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
RULES = DASHBOARDS / "alerts.yml"
RULE_TESTS = DASHBOARDS / "alerts_test.yml"
PLUGIN_ENV = {"PYTHONPATH": str(Path(__file__).resolve().parent)}

needs_prometheus = pytest.mark.skipif(bool(MISSING), reason=MISSING)


def alert_names(text: str) -> list[str]:
    return re.findall(r"^\s+- alert: (\w+)$", text, re.M)


@needs_prometheus
def test_rules_pass_promtool_check():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_names(RULES.read_text()))} rules found" in out.stdout


@needs_prometheus
def test_rule_unit_tests_pass():
    out = promtool("test", "rules", str(RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_unit_test_and_docs():
    names = alert_names(RULES.read_text())
    assert len(names) == len(set(names)) >= 8
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert set(names) <= tested, f"alerts without a promtool unit test: {set(names) - tested}"
    docs = (DASHBOARDS.parent / "docs" / "metrics.md").read_text()
    assert all(f"`{name}`" in docs for name in names), "docs/metrics.md lists every alert"


def test_alerts_use_only_documented_metrics():
    used = metric_names(RULES.read_text())
    assert {"ingestd_worker_state", "ingestd_replay_writes_total", "ingestd_policy_lag_versions"} <= used
    assert used <= set(documented()), f"undocumented metrics in alerts.yml: {used - set(documented())}"


@needs_prometheus
def test_a_crash_looping_worker_fires_ingestd_worker_failed():
    overrides = {"workers.env": "faulty_envs:raising", "workers.env_kwargs": {"only_worker": 1},
                 "workers.policy": "Random", "workers.count": 2, "workers.restart_budget": 2,
                 "workers.restart_backoff_s": 0.05}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as daemon, \
            PrometheusProc([f"127.0.0.1:{daemon.metrics_port}"], rule_files=(RULES,)) as prom:
        deadline, firing = time.monotonic() + 45, []
        while time.monotonic() < deadline and not firing:
            firing = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
            time.sleep(0.5)
        assert [(a["labels"]["alertname"], a["labels"]["worker"]) for a in firing] == \
            [("IngestdWorkerFailed", "1")], (firing, daemon.log()[-2000:])
        alert = firing[0]
        assert alert["labels"]["severity"] == "critical" and alert["labels"]["job"] == "ingestd"
        assert "ingestctl restart 1" in alert["annotations"]["description"]
        assert daemon.stop() == 0
