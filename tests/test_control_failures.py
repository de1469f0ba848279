"""Commands that wait for workers do not wait for dead or failed ones; a clean stop."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import control_plugins
from control_daemon import PLUGIN_ENV, SETTINGS, shared_paused, wait_for
from daemon_proc import DaemonProc
from ingestd import ControlClient, DaemonUnavailable


@pytest.fixture(scope="module")
def daemon_and_client():
    overrides = {**SETTINGS, "workers.env": "faulty_envs:raising",
                 # worker 1 raises on its first step, half a second after it starts running: long
                 # enough for a restart's wait to see it running (test_a_failed_worker_can_be_restarted)
                 "workers.env_kwargs": {"only_worker": 1, "after_steps": 0, "delay_s": 0.5},
                 "workers.restart_budget": 2, "workers.restart_backoff_s": 0.05, "workers.restart_backoff_max_s": 0.1}
    with shared_paused(), DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        with ControlClient(d.control_address, timeout=2.0) as c:
            wait_for(lambda: d.proc.poll() is None and _states(c) == ["running", "failed"], 60,
                     "worker 1 to crash-loop into 'failed' while worker 0 runs", interval=0.1)
            yield d, c


@pytest.fixture
def client(daemon_and_client):
    return daemon_and_client[1]


def _states(c: ControlClient) -> list[str]:
    try:
        return [w.state for w in c.status().workers]
    except DaemonUnavailable:  # not listening yet; any other error is a failure, not a reason to wait
        return []


def test_failed_worker_drops_out_of_every_wait(client):
    status = client.status()
    assert "simulated env failure" in status.workers[1].error
    # when: seconds since it was reported (none for the healthy worker); where trainers follow weights
    assert 0 <= status.workers[1].error_age_s < 120 and status.workers[0].error_age_s is None, status.workers
    assert status.weights_path and Path(status.weights_path).is_file(), status.weights_path
    assert client.pause(timeout_s=5).workers == [0]
    assert client.resume(timeout_s=5).workers == [0]
    pushed = client.push_weights_detailed(control_plugins.weights(1.0), timeout_s=5)
    assert pushed.applied == [0]
    assert client.status().workers[0].weights_version == pushed.version


def test_a_failed_worker_can_be_restarted(client):
    before = client.status().workers[1]
    assert client.restart([1], timeout_s=10).workers == [1]  # a new process got as far as running
    wait_for(lambda: _states(client) == ["running", "failed"], 10, "worker 1 to fail again")
    after = client.status().workers[1]
    assert after.incarnation != before.incarnation and after.restarts > before.restarts
    assert after.pid == before.pid == 0  # failed: no process (its old pid may be reused)
    assert client.pause(timeout_s=5).workers == [0]
    assert client.resume(timeout_s=5).workers == [0]


def test_sigterm_stops_cleanly_and_removes_the_sockets(daemon_and_client):
    import signal

    d, c = daemon_and_client
    assert d.stop(signal.SIGTERM, timeout=20) == 0
    assert not [p for p in d.runtime_dir.iterdir() if p.suffix == ".sock"]


def test_a_command_in_flight_when_the_server_stops_still_gets_its_reply(tmp_path):
    """A slow command still running when the control server stops (the daemon is draining its
    workers, so its main loop takes no calls) is answered ``unavailable``: its reply used to be
    queued after the control thread had gone (and replies sent just before were dropped with the
    sockets), so the client waited out its whole timeout for nothing."""
    import time

    import zmq

    from ingestd.control.protocol import decode_reply, encode_header
    from ingestd.control.server import ControlServer
    from ingestd.service.config import load_config
    from ingestd.service.daemon import Daemon

    config = load_config(overrides=[f'service.runtime_dir="{tmp_path / "run"}"',
                                    f'service.data_dir="{tmp_path / "data"}"', "metrics.enabled=false"])
    daemon = Daemon(config, None, (), {})  # not running: nothing takes the calls it is submitted
    server = ControlServer(config)
    server.start(daemon)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(daemon.paths.control)
        sock.send(encode_header(1, "reload", {}))
        deadline = time.monotonic() + 10
        while server._slow_in_flight == 0 and time.monotonic() < deadline:  # until the reload waits for the main loop
            time.sleep(0.01)
        assert server._slow_in_flight == 1, "the reload never reached the server"
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < STOP_WITHIN_S
        assert sock.poll(2000), "no reply to a command in flight at stop"
        reply = decode_reply(sock.recv_multipart())
        assert (reply.id, reply.code) == (1, "unavailable"), reply
    finally:
        sock.close(0)
        server.stop()  # again if it was stopped above (a no-op): its sockets never outlive a failure


STOP_WITHIN_S = 3.0


def test_a_push_whose_worker_dies_before_applying_it_says_so():
    """SAC review: when every worker died during the wait, push_weights(wait=True) returned
    ``applied=[], deferred=[]`` as a success, which reads as "no worker needed it"."""
    import os
    import signal
    import threading
    import time

    overrides = {"workers.count": 1, "workers.env": "reliability_util:slow_checksum",
                 "workers.env_kwargs": {"step_s": 0.1}, "workers.chunk_steps": 30,  # ~3 s chunks
                 "workers.policy": "control_plugins:readable", "workers.num_envs": 4,
                 "workers.heartbeat_timeout_s": 10.0, "replay.capacity": 10_000, "metrics.enabled": False}
    with shared_paused(), DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready()  # the socket is bound by then: a loaded CI host took over the client's 5 s to start
        with ControlClient(d.control_address, timeout=5.0) as c:
            def frames_now():  # None until the supervisor lists its worker (status may come first)
                workers = c.status().workers
                return workers[0].frames if workers else None
            frames = wait_for(lambda: frames_now() or None, 60, "a first chunk", interval=0.05)
            wait_for(lambda: frames_now() > frames, 30, "a chunk boundary", interval=0.05)
            pid = c.status().workers[0].pid  # ~3 s until it applies a new version
            replies: list = []
            pusher = threading.Thread(target=lambda: replies.append(
                c.push_weights_detailed(control_plugins.weights(1.0), wait=True, timeout_s=20)))
            pusher.start()
            time.sleep(0.5)
            assert pid > 0
            os.kill(pid, signal.SIGKILL)
            pusher.join(30)
            assert replies, "the push did not come back"
            assert replies[0].applied == [] and replies[0].dropped == [0], replies[0]


def test_a_stuck_control_thread_keeps_its_sockets_at_stop(tmp_path, monkeypatch, caplog):
    """A control thread that does not stop in time still owns its sockets: destroying the
    context under it (zmq sockets are not thread-safe) could abort the daemon at exit. stop()
    leaves them to the process exit, says so, and still removes the socket files."""
    import threading
    import time

    import ingestd.control.server as server_module
    from ingestd.control.server import ControlServer
    from ingestd.service.config import load_config
    from ingestd.service.daemon import Daemon

    config = load_config(overrides=[f'service.runtime_dir="{tmp_path / "run"}"',
                                    f'service.data_dir="{tmp_path / "data"}"', "metrics.enabled=false"])
    daemon = Daemon(config, None, (), {})
    server = ControlServer(config)
    release, inside = threading.Event(), threading.Event()

    def stuck(now):
        inside.set()
        release.wait(30)

    monkeypatch.setattr(server, "_housekeeping", stuck)
    monkeypatch.setattr(server_module, "STOP_JOIN_S", 0.3)
    server.start(daemon)
    thread = server._thread
    try:
        assert inside.wait(10)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="ingestd"):
            server.stop()
        assert time.monotonic() - t0 < 5 and thread.is_alive()
        assert "left to the process exit" in caplog.text
        assert server._context is not None  # not destroyed under the thread
        assert not Path(daemon.paths.control.removeprefix("ipc://")).exists()
        wake = server._wake_r
        server.stop()  # a second stop (review: it destroyed the context under the thread)
        assert server._context is not None and thread.is_alive() and server._wake_r == wake
    finally:
        release.set()
        thread.join(10)
    assert not thread.is_alive()
    server.stop()  # once the thread has ended, a stop closes what it left: context and wake pipe
    assert server._context is None and server._wake_r == -1
    with pytest.raises(OSError):
        os.fstat(wake)
