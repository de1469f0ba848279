"""The Grafana dashboard, checked offline: JSON model structure, variables,
grid, panel coverage, provisioning files, and every PromQL expr parsed by
promtool. (tests/test_metrics.py evaluates the same exprs against a real
Prometheus scraping a real daemon.)"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from prometheus_proc import MISSING, promtool

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
DASHBOARD = DASHBOARDS / "ingestd.json"
DS_UID = "${datasource}"
GRID_COLUMNS = 24

# What Grafana substitutes, as the tests substitute it (regex-valued variables get "match all").
VARIABLES = {"__rate_interval": "15s", "__interval": "15s", "__range": "1m", "instance": ".*", "worker": ".*"}
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
METRIC = re.compile(r"\b(?:ingestd|process)_[a-z0-9_]+\b")


# -- helpers (also used by test_metrics.py) ----------------------------------------------
def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def all_panels(dash: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def panel_exprs(dash: dict) -> list[tuple[dict, str, str]]:
    """(panel, refId, expr) of every query target."""
    return [(p, t["refId"], t["expr"]) for p in all_panels(dash) for t in p.get("targets", []) if "expr" in t]


def substitute(expr: str, values: dict[str, str] = VARIABLES) -> str:
    """``expr`` with Grafana variables replaced; an unknown variable raises KeyError."""
    def repl(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name not in values:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return values[name]
    return _VAR.sub(repl, expr)


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def recording_rules(exprs: list[tuple[str, str]]) -> str:
    """A promtool rules file (JSON is YAML) with one recording rule per (name, expr)."""
    return json.dumps({"groups": [{"name": "dashboard", "rules": [
        {"record": name, "expr": expr} for name, expr in exprs]}]}, indent=1)


# -- structure ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dash() -> dict:
    return load_dashboard()


def test_identity_and_classic_model(dash):
    assert isinstance(dash["uid"], str) and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])
    assert isinstance(dash["title"], str) and dash["title"].strip()
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 30
    assert isinstance(dash["panels"], list) and dash["panels"]
    text = DASHBOARD.read_text()
    assert "__inputs" not in dash and "${DS_" not in text, "use the ${datasource} variable, not __inputs"


def test_variables(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "worker"} <= set(variables)
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("instance", "worker"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == DS_UID
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert query.startswith("label_values(") and f", {name})" in query
        assert var["multi"] and var["includeAll"] and var["allValue"] == ".*"


def test_panel_ids_unique(dash):
    ids = [p["id"] for p in all_panels(dash)]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"


def test_every_panel_and_target_uses_the_datasource_variable(dash):
    queried = [p for p in all_panels(dash) if p["type"] != "row"]
    assert len(queried) >= 15
    for panel in queried:
        assert panel.get("datasource", {}).get("uid") == DS_UID, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("datasource", {}).get("uid") == DS_UID, (panel["title"], target["refId"])
            assert target["expr"].strip()
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_grid_positions_valid_and_not_overlapping(dash):
    cells: dict[tuple[int, int], str] = {}
    for panel in dash["panels"]:  # top level: rows are not collapsed, so every panel is laid out here
        g = panel["gridPos"]
        assert set(g) >= {"x", "y", "w", "h"} and all(isinstance(g[k], int) for k in "xywh"), panel["title"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, panel["title"]
        assert g["x"] + g["w"] <= GRID_COLUMNS, f"{panel['title']!r} is wider than the grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


# (a title fragment, metrics its queries must use): the panels the issue asks for.
REQUIRED_PANELS = [
    ("Frames/s (total)", {"ingestd_frames_total"}),
    ("Frames/s per worker", {"ingestd_frames_total"}),
    ("Worker states", {"ingestd_worker_state", "ingestd_worker_paused"}),  # and why paused (metrics review)
    ("Worker up", {"ingestd_worker_up"}),
    ("Restarts", {"ingestd_worker_restarts_total"}),
    ("Heartbeat age", {"ingestd_worker_heartbeat_age_seconds"}),
    ("Replay fill (%)", {"ingestd_replay_rows", "ingestd_replay_capacity_rows"}),
    ("Replay writes/s", {"ingestd_replay_writes_total"}),
    ("Weights version", {"ingestd_weights_version", "ingestd_worker_weights_version"}),
    ("Policy lag", {"ingestd_policy_lag_versions"}),
    ("Episode return", {"ingestd_episode_return_bucket", "ingestd_worker_episode_return_mean"}),
    ("Control requests", {"ingestd_control_requests_total"}),
    ("Control errors", {"ingestd_control_requests_total"}),
    ("Weight-push latency", {"ingestd_weight_push_seconds_bucket"}),
    ("Rate limiter: error", {"ingestd_limiter_error"}),
    ("Rate limiter: trainer blocked", {"ingestd_limiter_reader_blocked_seconds_total"}),
    ("Rate limiter: workers held back", {"ingestd_limiter_workers_blocked", "ingestd_worker_waiting"}),
    ("Rate limiter: time blocked", {"ingestd_limiter_blocked_seconds_total"}),
    ("Policy lag of stored and sampled rows", {"ingestd_replay_policy_lag_versions",
                                               "ingestd_sampled_policy_lag_versions"}),
    ("Config reload", {"ingestd_config_last_reload_successful", "ingestd_config_restart_pending_keys"}),
]


@pytest.mark.parametrize("title,metrics", REQUIRED_PANELS, ids=[t for t, _ in REQUIRED_PANELS])
def test_required_panel_present(dash, title, metrics):
    matches = [p for p in all_panels(dash) if title in p["title"]]
    assert matches, f"no panel titled like {title!r}"
    used = set().union(*(metric_names(t["expr"]) for p in matches for t in p["targets"]))
    assert metrics <= used, f"{title!r} does not query {sorted(metrics - used)}"


def test_per_worker_panels_filter_by_the_worker_variable(dash):
    for panel, ref, expr in panel_exprs(dash):
        if "by (worker)" in expr:
            assert 'worker=~"$worker"' in expr, (panel["title"], ref)
        if "ingestd_" in expr:
            assert 'instance=~"$instance"' in expr, (panel["title"], ref)


def test_no_panel_merges_the_daemons_of_a_multi_instance_selection(dash):
    """$instance allows several daemons at once (two experiments on one host): a sum, max or
    quantile without ``instance`` mixed their workers, returns and latencies into one series,
    and a legend without it gave several series the same name."""
    for panel in all_panels(dash):
        for target in panel.get("targets", []):
            expr, legend = target.get("expr", ""), target.get("legendFormat", "")
            if "ingestd_" not in expr:
                continue
            where = (panel["title"], target["refId"])
            for agg, group in re.findall(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(", expr):
                assert "instance" in re.split(r"\s*,\s*", group), (*where, f"{agg} by ({group})")
            for on in re.findall(r"\bon\s*\(([^)]*)\)", expr):
                assert "instance" in re.split(r"\s*,\s*", on), (*where, f"on ({on})")
            assert not legend or "{{instance}}" in legend, (*where, legend)


def series_unit(panel: dict, ref: str) -> str | None:
    """The unit Grafana shows a target's series in: a byFrameRefID override, else the panel's."""
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        if override.get("matcher") == {"id": "byFrameRefID", "options": ref}:
            unit = next((p["value"] for p in override.get("properties", []) if p["id"] == "unit"), unit)
    return unit


# Units that would misstate a per-second count of things (rows/s, frames/s): a fraction, a percent,
# or a duration.
NOT_A_RATE = {"percent", "percentunit", "s", "ms", "µs", "ns", "dtdurations", "dtdhms"}


def test_per_second_series_are_not_shown_as_percent_or_time(dash):
    """A series whose legend says "/s" must not inherit a panel unit like percentunit (a trainer's
    25,600 rows/s would read as 2,560,000 %)."""
    checked = 0
    for panel, ref, _ in panel_exprs(dash):
        target = next(t for t in panel["targets"] if t["refId"] == ref)
        if "/s" in target.get("legendFormat", ""):
            assert series_unit(panel, ref) not in NOT_A_RATE, (panel["title"], ref, series_unit(panel, ref))
            checked += 1
    assert checked, "no series has a legend with /s: this test checked nothing"


def test_rate_limiter_panels_sit_in_the_sampling_row(dash):
    row, rows = None, {}
    for panel in dash["panels"]:  # a panel belongs to the row panel before it
        if panel["type"] == "row":
            row = panel["title"]
        elif panel["title"].startswith("Rate limiter"):
            rows[panel["title"]] = row
    assert len(rows) == 4 and set(rows.values()) == {"Sampling and rate limiter"}, rows


def test_an_on_off_series_has_its_own_axis(dash):
    """The limiter's 0/1 "enabled" line would be flat at the bottom of an error axis in the millions."""
    checked = 0
    for panel, ref, expr in panel_exprs(dash):
        if "ingestd_limiter_enabled" in expr and len(panel["targets"]) > 1:
            override = next(o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == ref)
            assert {"id": "custom.axisPlacement", "value": "right"} in override["properties"], panel["title"]
            checked += 1
    assert checked, "no panel shows ingestd_limiter_enabled beside another series: this test checked nothing"


def test_why_paused_is_not_stacked_on_the_states_that_count_those_workers_already(dash):
    """The bars stack one count per state; the paused-by-reason series stacked on them drew every
    paused worker twice (diff review)."""
    panel = next(p for p in all_panels(dash) if p["title"] == "Worker states")
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    why = next(t for t in panel["targets"] if "ingestd_worker_paused" in t["expr"])
    override = next(o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == why["refId"])
    stacking = next(p["value"] for p in override["properties"] if p["id"] == "custom.stacking")
    assert stacking["mode"] == "none", stacking


def test_exprs_use_only_known_variables(dash):
    for panel, ref, expr in panel_exprs(dash):
        substitute(expr)  # raises on an unknown variable


# -- PromQL parses (promtool) ----------------------------------------------------------------
@pytest.mark.skipif(bool(MISSING), reason=MISSING)
def test_every_expr_parses_with_promtool(dash, tmp_path):
    rules = [(f"dashboard:panel{p['id']}_{ref.lower()}", substitute(expr)) for p, ref, expr in panel_exprs(dash)]
    path = tmp_path / "rules.yml"
    path.write_text(recording_rules(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


@pytest.mark.skipif(bool(MISSING), reason=MISSING)
def test_promtool_check_rejects_a_broken_expr(tmp_path):
    """The check above can fail: a typo in a panel expr is caught."""
    path = tmp_path / "rules.yml"
    path.write_text(recording_rules([("dashboard:bad", "sum by (worker (rate(ingestd_frames_total[1m]))")]))
    assert promtool("check", "rules", str(path)).returncode != 0


# -- provisioning ------------------------------------------------------------------------------
def _yaml_lines(path: Path) -> list[str]:
    return [line.rstrip() for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dashboard_provider_provisioning():
    path = DASHBOARDS / "provisioning" / "dashboards" / "ingestd.yaml"
    lines = _yaml_lines(path)
    assert lines[0] == "apiVersion: 1" and "providers:" in lines
    text = "\n".join(lines)
    assert re.search(r"^\s+type: file$", text, re.M)
    path_line = re.search(r"^\s+path: (\S+)$", text, re.M)
    assert path_line and path_line.group(1).startswith("/")
    readme = (DASHBOARDS / "README.md").read_text()
    assert path_line.group(1) in readme, "the README must say where to copy ingestd.json"
    assert "provisioning" in readme


def test_datasource_provisioning():
    lines = _yaml_lines(DASHBOARDS / "provisioning" / "datasources" / "prometheus.yaml")
    text = "\n".join(lines)
    assert lines[0] == "apiVersion: 1" and "datasources:" in lines
    assert re.search(r"^\s+type: prometheus$", text, re.M)
    assert re.search(r"^\s+url: https?://\S+$", text, re.M)


def _threshold_colors(thresholds: dict) -> list[tuple]:
    return [(step["color"], step["value"]) for step in thresholds["steps"]]


def test_coloured_stats_set_their_own_thresholds(dash):
    """A stat panel that colours its value with no thresholds of its own gets Grafana's default:
    red from 80. "Replay fill" was red whenever the ring held 80 % or more (a full ring is the
    steady state) and "Workers up" red from 80 workers, whatever was missing."""
    stats = [p for p in all_panels(dash) if p["type"] == "stat" and p["options"].get("colorMode") != "none"]
    assert stats, "no coloured stat panel: this test checked nothing"
    for panel in stats:
        assert "thresholds" in panel["fieldConfig"]["defaults"], panel["title"]
    fill = next(p for p in stats if p["title"] == "Replay fill")
    assert all(color != "red" for color, _ in _threshold_colors(fill["fieldConfig"]["defaults"]["thresholds"]))
    workers = next(p for p in stats if p["title"] == "Workers up")
    missing = next(t for t in workers["targets"] if "missing" in t["legendFormat"])
    assert "ingestd_workers_desired" in missing["expr"] and "ingestd_worker_up" in missing["expr"]
    override = next(o for o in workers["fieldConfig"]["overrides"] if o["matcher"]["options"] == missing["refId"])
    red = [p["value"] for p in override["properties"] if p["id"] == "thresholds"]
    assert red and ("red", 1) in _threshold_colors(red[0]), override
