"""The user docs stay in sync with the code they describe."""
from __future__ import annotations

from pathlib import Path

from ingestd.service.cli import config_reference_markdown
from ingestd.service.config import reference

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_doc_is_generated_from_the_dataclasses():
    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc == config_reference_markdown(), "docs/config.md is stale: run `ingestd config reference > docs/config.md`"
    for key, default, _ in reference():
        assert f"`{key}`" in doc


def test_readme_gives_the_two_setup_commands_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ingestd run" in readme
    test_command = "python3 -m pytest -q"
    assert test_command in readme
    assert ci.rstrip().splitlines()[-1] == test_command, ".ci/run must end with the README's test command"


def test_docs_do_not_deny_the_readers_policy_lag_filter():
    """``ReplayReader(max_policy_lag=...)`` exists (docs/sampling.md): the TorchRL guide and the
    example must not tell trainers it does not."""
    import inspect
    import re

    from ingestd import ReplayReader

    assert "max_policy_lag" in inspect.signature(ReplayReader.__init__).parameters
    for path in (ROOT / "docs" / "from-torchrl.md", ROOT / "examples" / "dqn_cartpole.py"):
        text = " ".join(path.read_text().split())
        assert not re.search(r"ReplayReader`*\s+has\s+no\s+(such|lag)\s+option", text), path.name
        assert "max_policy_lag" in text, f"{path.name} should point at ReplayReader(max_policy_lag=...)"


def test_readme_lists_every_ingestctl_command():
    import argparse

    from ingestd.control.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    readme = (ROOT / "README.md").read_text()
    usage = next(p for p in readme.split("\n- ") if p.startswith("`ingestctl [--connect"))
    missing = [c for c in sub.choices if f"`{c}" not in usage]
    assert not missing, f"the README's ingestctl line leaves out {missing}"


def test_collector_features_says_where_status_shows_a_budget_pause():
    """docs/collector-features.md: where a user sees that workers paused for the frame budget."""
    from ingestd.control.cli import format_status
    from ingestd.control.commands import Status

    worker = {"index": 0, "state": "paused", "pid": 1, "incarnation": 1, "frames": 5120, "frames_per_s": 0.0,
              "episodes": 3, "last_return": 9.0, "restarts": 0, "weights_version": 1, "heartbeat_age_s": 0.1,
              "error": "", "pause_reason": "budget", "recent_returns": [9.0]}
    status = Status.from_json({"pid": 1, "uptime_s": 1.0, "desired": "run", "count": 1, "weights_version": 1,
                               "replay": {"path": "/r", "rows": 5120, "capacity": 10000, "write_count": 5120},
                               "workers": [worker], "config": {}})
    doc = " ".join((ROOT / "docs" / "collector-features.md").read_text().split())
    assert "paused (budget)" in format_status(status)
    assert "`ingestctl status` shows the state `paused (budget)`" in doc
    worker["pause_reason"] = "requested"  # a pause command: the plain state
    assert " paused " in format_status(Status.from_json({**status.to_json(), "workers": [worker]}))


def test_example_does_not_say_status_lacks_the_recent_returns():
    """``WorkerStatus.recent_returns`` exists: the example must not claim status has only the last return."""
    import dataclasses
    import re

    from ingestd.control.commands import WorkerStatus

    assert "recent_returns" in {f.name for f in dataclasses.fields(WorkerStatus)}
    text = " ".join((ROOT / "examples" / "dqn_cartpole.py").read_text().split())
    assert not re.search(r"carries only each worker's \*?last\*? return", text)
    assert not re.search(r"Until the status reply carries", text)


def _toml_blocks() -> list[tuple[str, str]]:
    """``(where, text)`` of every whole config file the docs show (a ```toml block opening with a
    section; indented fragments of a list item are left out)."""
    import re

    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, match in enumerate(re.finditer(r"```toml\n(.*?)```", doc.read_text(), re.S)):
            if match.group(1).startswith("["):
                found.append((f"{doc.name} block {i}", match.group(1)))
    return found


def test_every_config_file_the_docs_show_passes_config_check(tmp_path, capsys, monkeypatch):
    """Config review: docs/envs.md's Gym example (Pendulum with the default MLP policy) failed
    `ingestd config check` with 78; a user copying it got an error first."""
    from ingestd.service.cli import main

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    blocks = _toml_blocks()
    assert len(blocks) >= 2, blocks
    for where, text in blocks:
        path = tmp_path / "example.toml"
        path.write_text(text)
        assert main(["config", "check", str(path)]) == 0, (where, capsys.readouterr().err)
