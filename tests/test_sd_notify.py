"""sd_notify as systemd would see it: a real daemon talking to a fake $NOTIFY_SOCKET.

The unit (systemd/ingestd.service) is Type=notify with WatchdogSec= and
NotifyAccess=main, so the daemon must send READY=1 (with STATUS= and its
MAINPID), keep STATUS= current, ping WATCHDOG=1 every WATCHDOG_USEC/2 (only
when WATCHDOG_PID is unset or its own pid), bracket a reload with
RELOADING=1 + MONOTONIC_USEC= ... READY=1, send STOPPING=1 on the way out,
and start its workers without the sd_notify variables.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import time
from pathlib import Path

import pytest

from daemon_proc import DaemonProc, wait_for
from ingestd.service.notify import NOTIFY_VARIABLES, Notifier

TESTS = str(Path(__file__).parent)
PLUGIN_ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
WATCHDOG_USEC = 2_000_000  # pings expected every 1 s; a gap of 2 s would get the daemon killed
# where no ping may come at all: short, so that a wrong ping would show within the test's 1 s
SHORT_WATCHDOG_USEC = 400_000


def fields(message: str) -> dict[str, str]:
    """``"READY=1\\nSTATUS=x"`` -> ``{"READY": "1", "STATUS": "x"}``."""
    return dict(line.split("=", 1) for line in message.splitlines() if "=" in line)


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def collect(d: DaemonProc, seconds: float) -> list[tuple[float, str]]:
    """Every message arriving within ``seconds``, stamped with its arrival time (also kept in d.messages)."""
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        d.notify_sock.settimeout(min(0.05, left))
        try:
            message = d.notify_sock.recv(4096).decode()
        except socket.timeout:
            continue
        got.append((time.monotonic(), message))
        d.messages.append(message)
    d.notify_sock.settimeout(0.1)
    return got


def wait_messages(d: DaemonProc, start: int, done, timeout: float, what: str) -> list[str]:
    """Until ``done(messages since index start)``; returns those messages."""
    deadline = time.monotonic() + timeout
    while not done(d.messages[start:]):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {timeout} s: {d.messages[start:]}\n{d.log()}")
        collect(d, 0.1)
    return d.messages[start:]


class WatchedDaemon(DaemonProc):
    """Exported WATCHDOG_PID is the daemon's own pid, as systemd sets it (``exec`` keeps the pid)."""

    def args(self) -> list[str]:
        return ["/bin/sh", "-c", 'WATCHDOG_PID=$$; export WATCHDOG_PID; exec "$@"', "sh", *super().args()]

    def forked(self) -> bool:
        return False  # the shell's exec is the point


def environ_probe(ctx, out_dir: str):
    """An env factory (``test_sd_notify:environ_probe``) recording the sd_notify variables its process sees."""
    from ingestd.collect.registry import make_env

    seen = {name: os.environ.get(name) for name in NOTIFY_VARIABLES}
    Path(out_dir, f"{os.getpid()}.json").write_text(json.dumps({"worker": ctx.worker, "environ": seen}))
    return make_env("CartPole", ctx, {})


# -- the Notifier on its own -------------------------------------------------------------
@pytest.mark.parametrize("environ, interval", [
    ({"WATCHDOG_USEC": "400000"}, 0.2),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "{pid}"}, 0.2),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "1"}, None),  # another process is watched
    ({}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "abc"}, None),
])
def test_watchdog_interval_is_half_of_watchdog_usec_for_our_pid(environ, interval):
    environ = {k: v.format(pid=os.getpid()) for k, v in environ.items()}
    notifier = Notifier({"NOTIFY_SOCKET": "/nonexistent/notify", **environ})
    try:
        assert notifier.watchdog_interval == interval
    finally:
        notifier.close()


def test_abstract_notify_socket_and_message_format():
    name = f"ingestd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        server.settimeout(2)
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        try:
            assert notifier.enabled
            before = monotonic_usec()
            notifier.reloading()
            after = monotonic_usec()
            got = fields(server.recv(4096).decode())
            assert got["RELOADING"] == "1" and before <= int(got["MONOTONIC_USEC"]) <= after
            notifier.ready("all good")
            assert fields(server.recv(4096).decode()) == {"READY": "1", "STATUS": "all good",
                                                           "MAINPID": str(os.getpid())}
        finally:
            notifier.close()
    assert not Notifier({}).enabled  # not under systemd: a silent no-op


def test_status_line_counts_the_wanted_workers_and_says_how_many_failed():
    """After a scale down the retiring worker is not counted (it read "2/1 workers running"), and
    failed workers are named, so a READY with nothing written says why (user review)."""
    from types import SimpleNamespace

    from ingestd.collect.stats import PauseReason, State
    from ingestd.service.daemon import Daemon

    class Storage:
        write_count, capacity = 5000, 10000

        def __len__(self):
            return 5000

    class Stats:
        def __init__(self, states, reasons):
            self.states, self.reasons = states, reasons or [PauseReason.NONE] * len(states)

        def state(self, i):
            return self.states[i]

        def __getitem__(self, i):
            return {"pause_reason": int(self.reasons[i])}

    def line(states, count, reasons=None):
        fake = SimpleNamespace(layout=SimpleNamespace(stats=Stats(states, reasons), storage=Storage()),
                               supervisor=SimpleNamespace(slots=dict.fromkeys(range(len(states))), count=count),
                               _first_write_count=1000)
        return Daemon.status_line(fake)

    assert line([State.RUNNING, State.RUNNING], 1) == ("1/1 workers running, 4000 rows written since start, "
                                                       "replay 5000/10000 rows, write_count 5000")
    assert line([State.FAILED, State.RUNNING, State.FAILED], 3).startswith("1/3 workers running, 2 failed, 4000 rows")
    # running but collecting nothing: it read "2/2 workers running" while nothing was written (ops review)
    held = line([State.RUNNING, State.RUNNING, State.RUNNING, State.PAUSED], 4,
                [PauseReason.LIMITER, PauseReason.PRIORITY_LOCK, PauseReason.NONE, PauseReason.REQUESTED])
    assert held.startswith("1/4 workers running, 1 paused, 1 held back by the limiter, 1 waiting for a trainer's "
                           "priority.lock, 4000 rows"), held


# -- a real daemon ------------------------------------------------------------------------
def test_ready_status_watchdog_reload_stopping_sequence():
    with WatchedDaemon(notify=True, env={"WATCHDOG_USEC": str(WATCHDOG_USEC)}) as d:
        ready = fields(d.wait_notify("READY=1", timeout=60))
        assert ready["MAINPID"] == str(d.proc.pid)
        said = re.fullmatch(r"\d/2 workers running, (\d+) rows written since start, replay (\d+)/\d+ rows, "
                            r"write_count (\d+)", ready["STATUS"])
        assert said, ready["STATUS"]  # READY follows the first rows: this run's count says so (it said 0 frames)
        assert 0 < int(said[1]) <= int(said[2]) <= int(said[3]), ready["STATUS"]

        # 5 s: 4-5 pings at half of WATCHDOG_USEC, 2-3 at the full one (which the median rules out;
        # a gap of 2 s, the kill condition, is a second late: a slow machine does not get there)
        stamped = collect(d, 5.0)
        pings = [t for t, m in stamped if m == "WATCHDOG=1"]
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert len(pings) >= 3, f"too few WATCHDOG=1 in 5 s: {[m for _, m in stamped]}"
        half = WATCHDOG_USEC / 2e6
        assert 0.8 * half <= statistics.median(gaps) <= 1.3 * half, f"ping gaps {gaps}"
        assert max(gaps) < 2 * half, f"a ping gap reached WATCHDOG_USEC: systemd would kill us ({gaps})"
        assert any(fields(m).keys() == {"STATUS"} for m in d.messages), "no STATUS= update after READY"

        seen = len(d.messages)
        before = monotonic_usec()
        d.proc.send_signal(signal.SIGHUP)
        wait_messages(d, seen, lambda new: any("READY=1" in m for m in new), 10, "READY=1 after SIGHUP")
        after = monotonic_usec()
        reload_msgs = [fields(m) for m in d.messages[seen:] if "RELOADING=1" in m or "READY=1" in m]
        assert [("RELOADING" in f, "READY" in f) for f in reload_msgs] == [(True, False), (False, True)]
        assert before <= int(reload_msgs[0]["MONOTONIC_USEC"]) <= after
        assert reload_msgs[1]["MAINPID"] == str(d.proc.pid)

        assert d.stop(signal.SIGTERM, timeout=20) == 0
        d.recv_notify(0.2)
        stopping = [i for i, m in enumerate(d.messages) if "STOPPING=1" in m]
        assert len(stopping) == 1, d.messages[-5:]
        assert not any("READY=1" in m for m in d.messages[stopping[0]:]), "READY=1 after STOPPING=1"


def test_watchdog_pid_of_another_process_and_workers_without_notify_environment():
    d = DaemonProc(notify=True, env={"WATCHDOG_USEC": str(SHORT_WATCHDOG_USEC), "WATCHDOG_PID": "1", **PLUGIN_ENV})
    probe = d.root / "probe"
    probe.mkdir()
    d.overrides.update({"workers.env": "test_sd_notify:environ_probe", "workers.env_kwargs": {"out_dir": str(probe)}})
    with d:
        d.wait_notify("READY=1", timeout=60)  # so the daemon itself did have NOTIFY_SOCKET
        collect(d, 1.0)
        assert not [m for m in d.messages if "WATCHDOG=1" in m], "pinged although WATCHDOG_PID names another pid"
        daemon_pid = d.proc.pid

        def probed() -> list[dict]:
            """What each worker recorded so far (READY=1 does not wait for the slower of them)."""
            found = []
            for path in probe.glob("*.json"):
                try:
                    if path.stem != str(daemon_pid):
                        found.append(json.loads(path.read_text()))
                except (OSError, ValueError):  # being written
                    continue
            return found

        wait_for(lambda: {s["worker"] for s in probed()} >= {0, 1}, 30, "both workers to record their environment")
        seen = probed()
        assert {s["worker"] for s in seen} == {0, 1}, seen
        for s in seen:
            assert s["environ"] == dict.fromkeys(NOTIFY_VARIABLES), f"a worker inherited {s['environ']}"
        assert d.stop() == 0


def test_a_reload_before_the_first_data_sends_no_early_ready():
    """READY=1 means the workers write: a SIGHUP while they are still starting changes the config but
    must not end the start-up early with the READY=1 that closes a reload."""
    from ingestd.replay import ReplayReader

    overrides = {"workers.env": "faulty_envs:slow_start", "workers.env_kwargs": {"seconds": 4.0},
                 "workers.policy": "Random", "workers.count": 1}
    with DaemonProc(overrides=overrides, notify=True, env=PLUGIN_ENV) as d:
        wait_for(lambda: (d.runtime_dir / "control.sock").exists(), 60, "the control socket (signals installed)")
        d.proc.send_signal(signal.SIGHUP)
        wait_messages(d, 0, lambda new: any("READY=1" in m for m in new), 60, "READY=1")
        with ReplayReader(d.replay_path) as reader:
            assert reader.write_count > 0, f"READY=1 before any row was stored: {d.messages}"
        assert not any("RELOADING=1" in m for m in d.messages), d.messages
        assert "reload: applied" in d.log()
        assert d.stop() == 0


def test_ready_when_a_reused_replay_already_spent_the_frame_budget():
    """A daemon restarted on a replay that already holds ``workers.total_frames`` rows has
    workers that pause at once (budget) and never write: it must still say READY=1, or
    ``systemctl start`` times out and systemd restarts it in a loop."""
    from ingestd.replay import ReplayReader

    overrides = {"workers.policy": "Random", "workers.count": 1, "workers.total_frames": 64}
    with DaemonProc(overrides=overrides, notify=True) as d:
        d.wait_notify("READY=1", timeout=60)
        wait_for(lambda: _budget_spent(d), 30, "the frame budget to be spent")
        assert d.stop() == 0
        with ReplayReader(d.replay_path) as reader:
            spent = reader.write_count
        assert spent >= 64
        d.messages.clear()
        d.start()  # the same dirs: the replay is reopened with the budget already spent
        d.wait_notify("READY=1", timeout=60)
        with ReplayReader(d.replay_path) as reader:
            assert reader.write_count == spent  # ready without writing: the worker paused on its budget
        assert d.stop() == 0


def _budget_spent(d: DaemonProc) -> bool:
    from ingestd.replay import ReplayReader

    with ReplayReader(d.replay_path) as reader:
        return reader.write_count >= 64
