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
