"""The tests' fork server (tests/forkserver.py) runs ``ingestd`` as an exec would."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from daemon_proc import DaemonProc, pid_alive, wait_for
from forkserver import SERVER


def forked(args: list[str], env: dict | None = None) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``ingestd ARGS`` forked from the server."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = SERVER.launch(args, {**os.environ, **(env or {})}, os.getcwd(), out_w, err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    with os.fdopen(out_r) as out:
        proc.stderr_fd = err_r
        _, err = proc.communicate(timeout=60)
        return proc.returncode, out.read(), err


def executed(args: list[str]) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "ingestd.service.cli", *args], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout, done.stderr


def test_output_and_exit_statuses_are_those_of_an_exec():
    for args in (["config", "default"], ["run", "--bogus"], ["config", "check", "/nonexistent.toml"]):
        assert forked(args) == executed(args), args


def test_a_killed_daemon_reports_the_signal_as_popen_does():
    with DaemonProc(overrides={"workers.count": 1}) as d:
        assert d.forked()
        d.wait_ready()
        d.remember_children()
        os.kill(d.proc.pid, signal.SIGKILL)
        assert d.proc.wait(30) == -signal.SIGKILL
        assert not pid_alive(d.proc.pid)


def test_a_client_that_goes_away_takes_its_daemon_with_it():
    with DaemonProc(overrides={"workers.count": 1}) as d:
        d.wait_ready()
        d.remember_children()
        d.proc._conn.close()  # as when the test process dies
        wait_for(lambda: not pid_alive(d.proc.pid), 30, f"daemon {d.proc.pid} to be killed")
        d.proc.returncode = -signal.SIGKILL  # (what its closed connection can no longer say)
