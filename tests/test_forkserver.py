"""The tests' fork server (tests/forkserver.py) runs ``ingestd`` as an exec would."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_proc import DaemonProc, forkable, forked_with_stderr, pid_alive, wait_for
from forkserver import _HEADER, SERVER

TESTS = str(Path(__file__).parent)


def forked(args: list[str], env: dict | None = None) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``ingestd ARGS`` forked from the server."""
    out_r, out_w = os.pipe()
    proc = forked_with_stderr(args, {**os.environ, **(env or {})}, stdout=out_w)
    with os.fdopen(out_r) as out:
        _, err = proc.communicate(timeout=60)
        return proc.returncode, out.read(), err


def executed(args: list[str]) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "ingestd.service.cli", *args], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout, done.stderr


def file_probe(ctx, out: str):
    """An env factory (``test_forkserver:file_probe``) saying which ingestd its process runs."""
    import ingestd
    from ingestd.collect.registry import make_env

    Path(out).write_text(json.dumps({"ingestd": ingestd.__file__, "tests_on_path": TESTS in sys.path}))
    return make_env("CartPole", ctx, {})


def test_a_forked_daemon_runs_the_tree_under_test(tmp_path):
    """The server runs as a script: without care it imported ingestd from the editable
    install's tree (another checkout), not the one pytest and an exec'd daemon import."""
    import ingestd

    config, out = tmp_path / "ingestd.toml", tmp_path / "probe.json"
    config.write_text(f'[workers]\nenv = "test_forkserver:file_probe"\nenv_kwargs = {{out = "{out}"}}\n'
                      f'[service]\ndata_dir = "{tmp_path}/data"\nruntime_dir = "{tmp_path}/run"\n')
    status, _, err = forked(["config", "check", str(config)], {"PYTHONPATH": TESTS})
    assert status == 0, err
    assert json.loads(out.read_text()) == {"ingestd": ingestd.__file__, "tests_on_path": True}


def test_clients_that_leave_mid_launch_or_say_nothing_do_not_stop_the_server():
    path = SERVER._started()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(path)  # connects, never sends: the server gives up on it after a few seconds
    leaving = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leaving.connect(path)
    body = json.dumps({"argv": ["config", "default"], "env": dict(os.environ), "cwd": os.getcwd(),
                       "umask": 0o022}).encode()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        socket.send_fds(leaving, [_HEADER.pack(len(body)) + body], [null, null])
    finally:
        os.close(null)
    leaving.close()  # before the pid comes back
    try:
        assert forked(["config", "default"])[0] == 0
    finally:
        silent.close()
    assert SERVER._proc.poll() is None


def test_a_tests_own_environment_is_forkable_and_a_threads_variable_is_not():
    """pytest sets PYTEST_CURRENT_TEST during each test (it made every failed_starts case exec), torch
    sets TORCHINDUCTOR_CACHE_DIR once ingestd's envs are imported, gymnasium PYGAME_HIDE_SUPPORT_PROMPT
    (every later daemon execed): only variables read as a process loads decide."""
    if os.environ.get("INGESTD_TEST_LAUNCH") == "exec":
        pytest.skip("INGESTD_TEST_LAUNCH=exec: nothing is forkable")
    from ingestd.collect import envs  # noqa: F401  (torch sets TORCHINDUCTOR_CACHE_DIR in os.environ as it loads)

    import gymnasium  # noqa: F401  (sets PYGAME_HIDE_SUPPORT_PROMPT: that made every later daemon exec too)

    assert "PYTEST_CURRENT_TEST" in os.environ
    assert forkable(dict(os.environ))
    assert forkable({**os.environ, "INGESTD_CONTROL": "ipc:///x", "NOTIFY_SOCKET": "/x", "PYTHONPATH": "/x"})
    for name in ("OMP_NUM_THREADS", "PYTHONHASHSEED", "LD_PRELOAD", "TORCH_SHOW_CPP_STACKTRACES"):
        assert not forkable({**os.environ, name: "1"}), name  # read as a process loads: an exec's


def test_output_and_exit_statuses_are_those_of_an_exec():
    for args in (["config", "default"], ["run", "--bogus"], ["config", "check", "/nonexistent.toml"]):
        assert forked(args) == executed(args), args


@pytest.fixture
def daemon():
    """A forked one-worker daemon, collecting, its workers known."""
    if os.environ.get("INGESTD_TEST_LAUNCH") == "exec":
        pytest.skip("INGESTD_TEST_LAUNCH=exec: no daemon is forked")
    with DaemonProc(overrides={"workers.count": 1}) as d:
        assert d.forked(), "a plain DaemonProc execs: the suite lost its fork server (see forkable)"
        d.wait_ready()
        d.remember_children()
        yield d


def test_a_killed_daemon_reports_the_signal_as_popen_does(daemon):
    os.kill(daemon.proc.pid, signal.SIGKILL)
    assert daemon.proc.wait(30) == -signal.SIGKILL
    assert not pid_alive(daemon.proc.pid)


def test_a_client_that_goes_away_takes_its_daemon_with_it(daemon):
    daemon.proc._conn.close()  # as when the test process dies
    wait_for(lambda: not pid_alive(daemon.proc.pid), 30, f"daemon {daemon.proc.pid} to be killed")
    daemon.proc.returncode = -signal.SIGKILL  # (what its closed connection can no longer say)
