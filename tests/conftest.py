"""Shared fixtures (keep small and generic)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shm_dir():
    """A fresh directory under /dev/shm (tmpfs), removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="ingestd-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir():
    """A fresh directory on a real disk (not tmpfs), removed after the test."""
    base = Path(tempfile.gettempdir())
    if base.resolve().is_relative_to("/dev/shm"):
        base = Path("/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="ingestd-test-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- session hygiene -----------------------------------------------------------------------------
# Nothing a test session starts may outlive it: processes, /dev/shm entries, listening sockets
# (tests/reliability_util.py: Hygiene says how each is attributed to this session). The check
# runs as the session's *first* registered cleanup, so it runs last: after the session fixtures
# and after the cleanups tests register (the shared control daemon is closed in one).
def pytest_sessionstart(session):
    from reliability_util import Hygiene

    hygiene = Hygiene()
    hygiene.start()
    session.config.add_cleanup(lambda: _check_hygiene(session, hygiene))
    from forkserver import SERVER
    from ingestd.service.tunables import with_copy_tunable

    # every process the tests start has the tunable `ingestd run` would exec itself to get (an exec'd
    # daemon then does not exec again), the fork server included, so that its forked daemons (which
    # never exec: they run main(argv)) copy as a real daemon does; test_tunables starts some without
    os.environ["GLIBC_TUNABLES"] = with_copy_tunable(os.environ.get("GLIBC_TUNABLES", ""))
    SERVER.base_env = dict(os.environ)  # with the session's marker: its forked daemons are attributed
    session.config.add_cleanup(SERVER.close)  # before the check (cleanups run last-in, first-out)


def _check_hygiene(session, hygiene) -> None:
    from reliability_util import report

    problems = hygiene.finish()
    if problems:
        report(problems)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    import sys

    util = sys.modules.get("reliability_util")
    if util is not None and util.FIGURES:
        terminalreporter.section("reliability figures")
        for line in util.summary_lines():
            terminalreporter.write_line(line)
