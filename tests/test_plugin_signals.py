"""Plug-in code cannot take over how the daemon and its workers handle signals (chaos review:
an env factory that ignored SIGTERM, as some simulator libraries set up their own handling,
left a daemon that only SIGKILL could stop: ``systemctl stop`` hung to its timeout)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from daemon_proc import DaemonProc, wait_for

TESTS = str(Path(__file__).parent)
PLUGIN_ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _mask(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _has(mask: int, signum: int) -> bool:
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.parametrize("env, kwargs", [
    ("faulty_envs:grabbing_signals", {}),
    ("faulty_envs:grabbing_signals", {"in_reset": True}),
    ("faulty_envs:grabbing_signals", {"native": True}),
    ("grabbing_import:make", {}),
], ids=["factory", "first reset", "through libc", "module import"])
def test_an_env_that_grabs_sigterm_sigint_and_sighup_does_not_keep_them(env, kwargs):
    """Diff review: a grab as the module is imported (before the build) and one through libc's
    ``signal()`` (invisible to ``signal.getsignal``) were kept."""
    overrides = {"workers.env": env, "workers.env_kwargs": kwargs,
                 "workers.policy": "Random", "workers.count": 1, "service.stop_timeout_s": 5}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready(rows=100)
        wait_for(lambda: d.remember_children(), 10, "the worker to be seen")
        (worker,) = d.remember_children()
        daemon = d.proc.pid
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the daemon's own handlers, back
            assert _has(_mask(daemon, "SigCgt"), signum), signal.Signals(signum).name
        ignored = _mask(worker, "SigIgn")  # a worker: SIGINT and SIGHUP ignored, SIGTERM's default
        assert _has(ignored, signal.SIGINT) and _has(ignored, signal.SIGHUP) and not _has(ignored, signal.SIGTERM)
        assert not _has(_mask(worker, "SigCgt"), signal.SIGINT)
        log = d.log()
        assert "the env or policy (workers.env, workers.policy) changed how this process handles SIGTERM, " \
               "SIGINT, SIGHUP" in log, log
        if env != "grabbing_import:make":  # (a worker imports nothing: the daemon's modules are its own)
            assert "worker 0's env" in log
        assert d.stop(signal.SIGTERM, timeout=15) == 0
