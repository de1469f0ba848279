"""The control plane end to end: a real daemon in a subprocess, real sockets, ControlClient."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import threading
import time
from pathlib import Path

import lz4.frame
import pytest
import torch
import zmq

import control_plugins
from control_daemon import client, daemon, snapshots  # noqa: F401  (pytest fixtures)
from control_daemon import MAX_FRAMES, MAX_MESSAGE_BYTES, rows_between, stream_breaks, wait_for
from ingestd import BadReply, BadWeights, ClosedError, CommandFailed, ControlClient, DaemonUnavailable
from ingestd.collect.envs.checksum import verify_rows
from ingestd.control.client import EventStream
from ingestd.control.commands import Snapshot
from ingestd.control.replay_handlers import _free_name
from ingestd.control.protocol import decode_reply, encode_header
from ingestd.weights.wire import encode


# the shared control daemon and a client on it: fixtures `daemon` and `client` (control_daemon)


def write_count(client) -> int:
    return client.status().replay.write_count


# -- every command -----------------------------------------------------------------------
def test_ping_status_config(daemon, client):
    pong = client.ping()
    assert pong["pong"] is True and pong["protocol"] == 1
    assert pong["events_address"].startswith("ipc://")
    status = client.status()
    assert status.pid == daemon.proc.pid and status.uptime_s > 0
    assert [w.index for w in status.workers] == [0, 1]
    for w in status.workers:
        assert w.state == "running" and w.pid > 0 and w.frames > 0 and w.weights_version >= 1
        assert w.heartbeat_age_s is not None and w.heartbeat_age_s < 2.0
    assert status.replay.capacity == 400_000 and 0 < status.replay.rows <= status.replay.write_count
    assert status.weights_version >= 1
    assert status.config["workers"]["env"] == "Checksum"
    assert client.config() == status.config
    wait_for(lambda: all(w.frames_per_s > 0 for w in client.status().workers), 3, "frames/s to be measured")
    assert all(w.episodes > 0 and w.last_return is not None for w in client.status().workers)


def test_metrics_url_is_null_when_metrics_are_off(client):
    """The shared daemon runs with metrics.enabled = false (a daemon with metrics:
    test_control_defaults.py)."""
    assert client.ping()["metrics_url"] is None and client.status().metrics_url is None


def test_ipc_socket_is_private(daemon):
    for address in (daemon.control_address, daemon.control_address.replace("control.sock", "events.sock")):
        mode = stat.S_IMODE(os.stat(address[len("ipc://"):]).st_mode)
        assert mode & 0o007 == 0 and mode & 0o660 == mode, oct(mode)


def test_deleted_socket_files_are_bound_again(daemon, client):
    """A runtime dir tidied under a running daemon (systemd-tmpfiles ageing /tmp) left it
    reachable by nobody until restarted."""
    from ingestd import ControlClient, DaemonUnavailable

    events_path = daemon.control_address.replace("control.sock", "events.sock")[len("ipc://"):]
    for path in (daemon.control_address[len("ipc://"):], events_path):
        os.unlink(path)
    wait_for(lambda: os.path.exists(events_path), 10, "the events socket file to be made again")

    def answers() -> bool:
        with ControlClient(daemon.control_address, timeout=0.5, retries=0) as fresh:
            try:
                return fresh.ping()["pid"] == daemon.proc.pid
            except DaemonUnavailable:
                return False
    wait_for(answers, 10, "a new client to reach the daemon")
    test_ipc_socket_is_private(daemon)
    with EventStream.of(client) as events:
        until_subscribed(client, events)
    assert "binding it again" in daemon.log()


def test_pause_stops_writes_and_resume_loses_no_frame(daemon, client):
    before = write_count(client)
    time.sleep(0.1)
    acked = client.pause()
    assert acked.workers == [0, 1]
    frozen = write_count(client)
    assert [w.state for w in client.status().workers] == ["paused", "paused"]
    time.sleep(0.4)
    assert write_count(client) == frozen, "a worker wrote while paused"
    assert client.status().desired == "pause"
    assert client.resume().workers == [0, 1]
    wait_for(lambda: write_count(client) > frozen + 2000, 10, "collection to resume")
    rows = rows_between(daemon.replay_path, before, write_count(client))
    assert bool(verify_rows(rows).all()), "a stored row does not match what the Checksum env produced"
    assert_contiguous(rows)


def assert_contiguous(rows) -> None:
    """Per (worker, env), consecutive rows continue the same episode or start the next: no lost step."""
    breaks, checked = stream_breaks(rows)
    assert breaks == 0, f"{breaks} steps are missing or repeated"
    assert checked > 1000


def test_weights_change_behaviour_exactly_at_the_stamped_version(daemon, client):
    v0 = client.push_weights(control_plugins.weights(0.0))  # a known baseline: action 0
    start = write_count(client)
    pushed = client.push_weights_detailed(control_plugins.weights(1.0))  # action 1 from version v on
    v = pushed.version
    assert v == v0 + 1 and pushed.applied == [0, 1] and pushed.deferred == []
    assert all(w.weights_version >= v for w in client.status().workers)
    wait_for(lambda: write_count(client) > start + 3000, 10, "rows under the new weights")
    v2 = client.push_weights(control_plugins.weights(2.0))  # action 0 again, from version v2 on
    assert v2 == v + 1
    wait_for(lambda: write_count(client) > start + 6000, 10, "rows under version v2")
    rows = rows_between(daemon.replay_path, start, write_count(client))
    version, action = rows.get(("ingestd", "policy_version")), rows.get("action").reshape(-1)
    old = (version >= v0) & (version < v)
    assert int(old.sum()) > 0 and bool((action[old] == 0).all()), "a row stamped before v shows the new weights"
    assert int((version == v).sum()) > 500 and bool((action[version == v] == 1).all())
    assert int((version == v2).sum()) > 500 and bool((action[version == v2] == 0).all())
    assert not bool((version > v2).any())

    restarted = client.restart([0])
    assert restarted.workers == [0]
    worker0 = client.status().workers[0]
    assert worker0.weights_version == v2 and worker0.restarts >= 1
    mark = write_count(client)
    wait_for(lambda: write_count(client) > mark + 2000, 10, "rows from the restarted worker")
    rows = rows_between(daemon.replay_path, mark, write_count(client))
    mine = rows.get(("ingestd", "worker")) == 0
    assert int(mine.sum()) > 0
    assert bool((rows.get(("ingestd", "policy_version"))[mine] == v2).all())
    assert bool((rows.get("action").reshape(-1)[mine] == 0).all())


def test_a_push_while_paused_is_deferred_and_applied_on_resume(client):
    """Paused workers cannot apply a push before they resume: the reply lists them in
    ``deferred`` (not in ``applied``, and not left out), and they apply it on resume."""
    client.pause()
    before = client.status().weights_version
    pushed = client.push_weights_detailed(control_plugins.weights(0.0))
    assert (pushed.version, pushed.applied, pushed.deferred) == (before + 1, [], [0, 1]), pushed
    assert [(w.state, w.weights_version, w.frames_per_s) for w in client.status().workers] == [
        ("paused", before, 0.0)] * 2  # not the rate from before the pause
    client.resume()
    wait_for(lambda: [w.weights_version for w in client.status().workers] == [pushed.version] * 2, 10,
             "the resumed workers to apply the deferred version")


@pytest.mark.parametrize("state", [{"bias": torch.zeros(2)}, {"bias": torch.tensor([float("nan")])},
                                   {"bias": torch.tensor([5000.0])}],
                         ids=["wrong shape", "NaN", "policy check_weights"])
def test_a_push_the_daemon_refuses_is_bad_weights(client, state):
    """``except ingestd.BadWeights`` catches a push the daemon refused as well as one refused
    while encoding; it is still a ``CommandFailed`` with the stable code."""
    import ingestd

    version = client.status().weights_version
    with pytest.raises(ingestd.BadWeights) as err:
        client.push_weights(state)
    assert isinstance(err.value, ingestd.WeightsRejected) and isinstance(err.value, CommandFailed)
    assert isinstance(err.value, ValueError) and err.value.code == "bad_weights"
    assert "nothing was changed" in err.value.message
    assert client.status().weights_version == version


def _raw_push(daemon, frames: list, timeout: float = 3.0):
    """Send push_weights with hand-made payload frames; the decoded reply (or None on silence)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.control_address)
    try:
        sock.send_multipart([encode_header("raw", "push_weights", {"wait": True, "timeout_s": 5}), *frames])
        if not sock.poll(int(timeout * 1000)):
            return None
        return decode_reply(sock.recv_multipart())
    finally:
        sock.close(0)


def _good() -> list[bytes]:
    return encode(control_plugins.weights(1.0))


def _with_manifest(edit) -> list[bytes]:
    head, payload = _good()
    manifest = json.loads(head)
    edit(manifest)
    return [json.dumps(manifest).encode(), payload]


BAD_PUSHES = {
    "wrong name": lambda: encode({"weight": torch.zeros(1)}),
    "extra name": lambda: encode({"bias": torch.zeros(1), "other": torch.zeros(1)}),
    "wrong shape": lambda: encode({"bias": torch.zeros(2)}),
    "wrong dtype": lambda: encode({"bias": torch.zeros(1, dtype=torch.float64)}),
    "NaN": lambda: encode({"bias": torch.tensor([float("nan")])}),
    "Inf": lambda: encode({"bias": torch.tensor([float("-inf")])}),
    "truncated payload": lambda: [_good()[0], _good()[1][:-6]],
    "flipped payload byte": lambda: [_good()[0], _good()[1][:-5] + bytes([_good()[1][-5] ^ 0xFF]) + _good()[1][-4:]],
    "not lz4": lambda: [_good()[0], b"\x00" * 64],
    "manifest not JSON": lambda: [b"{nope", _good()[1]],
    "manifest nested too deep": lambda: [b"[" * 30_000, _good()[1]],  # a RecursionError is not `internal`
    "manifest lies about size": lambda: _with_manifest(lambda m: m.update(raw_bytes=8)),
    "lz4 bomb": lambda: [_good()[0], lz4.frame.compress(b"\0" * (1 << 20), content_checksum=True)],
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_push_is_rejected_and_changes_nothing(daemon, client, case):
    version = client.status().weights_version
    reply = _raw_push(daemon, BAD_PUSHES[case]())
    assert reply is not None and not reply.ok and reply.code == "bad_weights", reply
    assert client.status().weights_version == version
    assert all(w.weights_version == version for w in client.status().workers)
    before = write_count(client)
    wait_for(lambda: write_count(client) > before, 5, "collection to continue")


@pytest.mark.parametrize("frames, code", [
    (lambda: _good()[:1], "bad_request"),  # missing the payload frame
    (lambda: [*_good(), b"x"], "bad_request"),  # one frame too many for push_weights
    (lambda: [b"x" * 1000] * MAX_FRAMES, "too_large"),  # more frames than control.max_frames
    (lambda: [b"x" * (MAX_MESSAGE_BYTES - 100), b"y" * (MAX_MESSAGE_BYTES - 100)], "too_large"),  # total size
])
def test_malformed_push_framing_is_refused(daemon, client, frames, code):
    version = client.status().weights_version
    reply = _raw_push(daemon, frames())
    assert reply is not None and reply.code == code, reply
    assert client.status().weights_version == version


def test_oversize_frame_gets_no_reply_and_changes_nothing(daemon, client):
    version = client.status().weights_version
    assert _raw_push(daemon, [_good()[0], b"z" * (MAX_MESSAGE_BYTES + 1)], timeout=1.0) is None
    assert client.status().weights_version == version
    # the client asks the daemon's limit and refuses such a push itself: an oversize push is a
    # bad push, not a daemon that seems to be down
    assert client.ping()["max_message_bytes"] == MAX_MESSAGE_BYTES
    with ControlClient(daemon.control_address, timeout=5) as c:
        with pytest.raises(BadWeights, match="over the daemon's control.max_message_bytes of 65536"):
            c.push_weights({"bias": torch.zeros(1), "pad": torch.rand(MAX_MESSAGE_BYTES)}, timeout_s=0.5)
    assert client.ping()["pong"] and client.status().weights_version == version
    before = write_count(client)
    wait_for(lambda: write_count(client) > before, 5, "collection to continue")


# -- errors and robustness ---------------------------------------------------------------------
@pytest.mark.parametrize("cmd, args, code", [
    ("launch_missiles", {}, "unknown_command"),
    ("scale", {}, "bad_request"),
    ("scale", {"count": -1}, "bad_request"),
    ("scale", {"count": "2"}, "bad_request"),
    ("scale", {"count": 2, "colour": "red"}, "bad_request"),
    ("pause", {"timeout_s": 0}, "bad_request"),
    ("restart", {"workers": [7]}, "no_such_worker"),
    ("restart", {"workers": "all"}, "bad_request"),
])
def test_bad_commands_get_stable_error_codes(client, cmd, args, code):
    from ingestd.control.commands import Request

    class Raw(Request):
        pass

    Raw.cmd, Raw.encode = cmd, lambda self: (args, [])  # type: ignore[assignment]
    with pytest.raises(CommandFailed) as err:
        client.call(Raw())
    assert err.value.code == code


def test_req_socket_and_garbage_headers(daemon):
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(daemon.control_address)
    try:
        for frame, code in ((b"\xff\xfe", "bad_request"), (b"[1, 2]", "bad_request"),
                            (b'{"v": 2, "id": 1, "cmd": "ping"}', "unsupported_version"),
                            (b'{"v": 1, "id": 7, "cmd": "ping", "args": [], "x": 1}', "bad_request"),
                            (encode_header(5, "ping", {}), None)):
            req.send(frame)
            assert req.poll(3000), "no reply on a REQ socket"
            reply = decode_reply(req.recv_multipart())
            assert reply.code == code, reply
            if code is None:
                assert reply.id == 5 and reply.result["pong"]
    finally:
        req.close(0)


def test_slow_commands_do_not_block_ping(daemon, client):
    done, spans = threading.Event(), []

    def restart_all():
        with ControlClient(daemon.control_address, timeout=10) as c:
            t0 = time.perf_counter()
            c.restart()  # waits until both workers run again as new processes
            spans.append((t0, time.perf_counter()))
        done.set()

    thread = threading.Thread(target=restart_all)
    thread.start()
    asked = []
    while not done.is_set():
        t0 = time.perf_counter()
        client.ping()
        client.status()
        asked.append((t0, time.perf_counter()))
    thread.join()
    (start, end), = spans
    # answered while the restart was in flight: had the restart blocked the daemon's command loop,
    # a ping asked after it began would only be answered after it ended (no timing ratio here:
    # on a slow machine one ping can stall for other reasons)
    during = [t1 - t0 for t0, t1 in asked if t0 >= start and t1 <= end]
    assert len(during) >= 5, (f"only {len(during)} ping+status answered during a {(end - start) * 1e3:.0f} ms "
                              f"restart ({len(asked)} in all)")


def test_a_client_inherited_through_fork_works_in_the_child_and_the_parent(daemon):
    """A DataLoader worker given the trainer's client: its request hung in the parent's socket
    past any timeout; now the child connects afresh and the parent's client keeps working."""
    with ControlClient(daemon.control_address, timeout=5.0) as mine:
        pid = mine.status().pid
        child = os.fork()
        if child == 0:  # the child: exit 0 only if the inherited client answers
            code = 1
            signal.alarm(30)  # a hang (as before) kills the child: the test fails instead of hanging
            try:
                code = 0 if mine.status().pid == pid and mine.ping()["pid"] == pid else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert mine.status().pid == pid  # the parent's connection is untouched
    with pytest.raises(ClosedError, match="was closed; make a new one"):  # closed means closed
        mine.status()


def test_scale_up_and_down(daemon, client):
    assert client.scale(3).workers == [0, 1, 2]
    status = client.status()
    assert [w.state for w in status.workers] == ["running"] * 3 and status.count == 3
    assert client.scale(1).workers == [0]
    assert [w.index for w in client.status().workers] == [0]
    # the operator's journal says what was changed (the handlers' events are logged, as the daemon's are)
    client.pause()
    client.resume()
    wait_for(lambda: all(f"event {kind} " in daemon.log() for kind in ("workers.scaled", "paused", "resumed")), 5,
             "the scale, pause and resume in the daemon's log")
    assert 'event workers.scaled {"count": 1, "was": 3}' in daemon.log()


def test_status_right_after_a_change_shows_it(daemon, client):
    """A status result is reused for a few ms (docs/protocol.md), never across a change the
    asker has seen acknowledged: another client keeps the cache warm while this one changes things."""
    stop = threading.Event()

    def hammer():
        with ControlClient(daemon.control_address, timeout=5.0) as other:
            while not stop.is_set():
                other.status()

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for _ in range(5):
            client.pause()
            status = client.status()
            assert status.desired == "pause" and {w.state for w in status.workers} == {"paused"}
            client.resume()
            status = client.status()
            assert status.desired == "run" and {w.state for w in status.workers} == {"running"}
        client.scale(1)
        assert [w.index for w in client.status().workers] == [0]
        client.scale(2)
        assert [w.state for w in client.status().workers] == ["running"] * 2
        version = client.push_weights(control_plugins.weights(0.0))
        assert client.status().weights_version == version
    finally:
        stop.set()
        thread.join()


def test_reload_rereads_the_config_file(daemon, client):
    daemon.config_path.write_text("[workers]\nrestart_budget = 7\n")
    try:
        result = client.reload()
        assert "workers.restart_budget" in result.applied
        assert client.config()["workers"]["restart_budget"] == 7
        daemon.config_path.write_text("[workers]\nrestart_budget = 'many'\n")
        with pytest.raises(CommandFailed) as err:
            client.reload()
        assert err.value.code == "reload_failed" and "restart_budget" in err.value.message
        assert client.config()["workers"]["restart_budget"] == 7
    finally:
        daemon.config_path.write_text("")
        client.reload()


def until_subscribed(client, events: EventStream, timeout: float = 10.0) -> None:
    """Pause and resume until ``events`` (subscribed to ``paused`` among others) delivers a
    ``paused`` event: then its subscription has reached the publisher (slow joiner; a fixed
    sleep may be too short on a slow machine). The workers are left running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client.pause()
        client.resume()
        end = time.monotonic() + 0.3
        while (left := end - time.monotonic()) > 0:
            event = events.next(left)
            if event is not None and event.topic == "paused":
                return
    raise AssertionError(f"no paused event in {timeout} s: the event subscription never became live")


def test_events_are_published(daemon, client):
    with EventStream.of(client) as events:
        until_subscribed(client, events)
        client.pause()
        client.resume()
        version = client.push_weights(control_plugins.weights(0.0))
        client.restart([1])
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + 5
        wanted = {"paused", "resumed", "weights.published", "weights.applied", "worker.restarted", "worker.started"}
        while not wanted <= set(seen) and time.monotonic() < deadline:
            event = events.next(0.5)
            if event is not None:
                seen.setdefault(event.topic, event.data)
    assert wanted <= set(seen), f"missing events {wanted - set(seen)}"
    assert seen["weights.published"]["version"] == version
    assert seen["paused"]["workers"] == [0, 1]
    assert seen["worker.restarted"]["worker"] == 1


# -- snapshot ----------------------------------------------------------------------------------------
TIME_NAME = re.compile(r"\d{8}T\d{6}Z(-\d+)?")


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()}


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def test_snapshot_while_workers_collect(daemon, client, snapshots):
    with EventStream.of(client, ("replay.", "paused")) as events:
        until_subscribed(client, events)
        before = write_count(client)
        shot = client.snapshot()
        event, deadline = None, time.monotonic() + 5
        while (event is None or not event.topic.startswith("replay.")) and time.monotonic() < deadline:
            event = events.next(max(0.0, deadline - time.monotonic()))  # skips paused events of the above
    path = Path(shot.path)
    assert path.parent == snapshots and TIME_NAME.fullmatch(path.name) and path.is_dir()
    assert stat.S_IMODE(os.stat(snapshots).st_mode) & 0o027 == 0, "snapshots dir must be 0750 or stricter"
    assert shot.capacity == 400_000 and shot.write_count >= before
    assert 0 < shot.rows <= min(shot.write_count, shot.capacity) and shot.skipped >= 0
    assert shot.bytes == sum(size for size, _ in _files(path).values()) > 0 and shot.seconds > 0
    assert event is not None and event.topic == "replay.snapshot", event
    assert {k: event.data[k] for k in shot.to_json()} == shot.to_json()
    assert [w.state for w in client.status().workers] == ["running", "running"]
    wait_for(lambda: write_count(client) > shot.write_count + 1000, 5, "collection to go on")


def test_snapshot_default_names_take_a_suffix_when_taken(tmp_path):
    now = 1767225600.0  # 2026-01-01T00:00:00Z
    assert _free_name(tmp_path, now) == "20260101T000000Z"
    (tmp_path / "20260101T000000Z").mkdir()
    (tmp_path / "20260101T000000Z-2").mkdir()
    assert _free_name(tmp_path, now) == "20260101T000000Z-3"


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "with space", "\u00e9t\u00e9", "", "n" * 101, 7,
                                  ["a"]])
def test_snapshot_bad_name_is_refused(daemon, client, snapshots, name):
    before = _entries(snapshots)
    with pytest.raises(CommandFailed) as err:
        client.call(Snapshot(name=name))
    assert err.value.code == "bad_request" and "name" in err.value.message
    assert _entries(snapshots) == before and not (daemon.data_dir / "escape").exists()


def test_snapshot_name_taken_leaves_the_first_intact(client, snapshots):
    first = client.snapshot("keep-me.1")
    assert first.path == str(snapshots / "keep-me.1")
    files = _files(Path(first.path))
    with pytest.raises(CommandFailed) as err:
        client.snapshot("keep-me.1")
    assert err.value.code == "snapshot_exists" and "keep-me.1" in err.value.message
    assert _files(Path(first.path)) == files
    assert "keep-me.1" in _entries(snapshots) and not any(n.startswith(".") for n in _entries(snapshots))


def test_one_snapshot_at_a_time(daemon, client, snapshots):
    """Two snapshots sent back to back: the second finds the first being written (each takes
    100+ ms here) and gets ``busy``. Tried a few times, in case the first one was quicker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.control_address)
    outcomes = []
    try:
        for attempt in range(5):
            for i in (1, 2):
                sock.send(encode_header(f"snap-{attempt}-{i}", "snapshot", {}))
            replies = []
            for _ in (1, 2):
                assert sock.poll(30_000), "no reply to a snapshot"
                replies.append(decode_reply(sock.recv_multipart()))
            outcomes.append(sorted("ok" if r.ok else r.code for r in replies))
            busy = [r for r in replies if r.code == "busy"]
            if busy:
                assert "another snapshot" in busy[0].message
                break
    finally:
        sock.close(0)
    assert all(o in (["busy", "ok"], ["ok", "ok"]) for o in outcomes), outcomes
    assert outcomes[-1] == ["busy", "ok"], f"the second snapshot never found the first one running: {outcomes}"
    assert client.ping()["pong"] and len(_entries(snapshots)) >= 1


def test_unavailable_daemon_raises_quickly_typed():
    with ControlClient("ipc:///dev/shm/ingestd-no-such-daemon.sock", timeout=0.2, retries=1) as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="no socket"):
            c.ping()
        assert time.monotonic() - t0 < 1.5


def test_bad_reply_is_typed():
    ctx = zmq.Context.instance()
    impostor = ctx.socket(zmq.ROUTER)
    impostor.setsockopt(zmq.LINGER, 0)
    port = impostor.bind_to_random_port("tcp://127.0.0.1")

    def answer():
        if impostor.poll(3000):
            identity, *_ = impostor.recv_multipart()
            impostor.send_multipart([identity, b"HTTP/1.1 400 Bad Request"])

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with ControlClient(f"tcp://127.0.0.1:{port}", timeout=3) as c, pytest.raises(BadReply):
            c.ping()
    finally:
        thread.join()
        impostor.close(0)


# -- fuzz ----------------------------------------------------------------------------------------
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)
_harmless_cmd = st.sampled_from(["ping", "status", "config", "push_weights", "", "PING", "pause\x00"]) | st.text()
_header = st.fixed_dictionaries(
    {}, optional={"v": st.sampled_from([1, 1, 2, "1", None, True]), "id": _json, "cmd": _harmless_cmd, "args": _json})
_frame0 = st.one_of(st.binary(max_size=300), _header.map(lambda h: json.dumps(h).encode()),
                    _json.map(lambda j: json.dumps(j).encode()))
_garbage = st.tuples(_frame0, st.lists(st.binary(max_size=2000), max_size=MAX_FRAMES + 1)).map(
    lambda t: [t[0], *t[1]])


def test_fuzzed_garbage_never_hurts_the_daemon(daemon, client):
    pids = [w.pid for w in client.status().workers]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.control_address)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames=_garbage)
    def every_message_gets_a_well_formed_reply(frames):
        sock.send_multipart(frames)
        assert sock.poll(3000), f"no reply to {frames!r}"
        reply = sock.recv_multipart()
        if len(reply) == 2 and reply[0] == b"":  # it looked like a REQ envelope: answered as one
            reply = reply[1:]
        answer = decode_reply(reply)  # raises BadReply if the daemon answered nonsense
        assert answer.code != "internal", answer.message

    try:
        every_message_gets_a_well_formed_reply()
    finally:
        sock.close(0)
    assert daemon.proc.poll() is None
    assert client.ping()["pong"]
    status = client.status()
    assert [w.pid for w in status.workers] == pids and all(w.state == "running" for w in status.workers)
    mark = status.replay.write_count
    wait_for(lambda: write_count(client) > mark, 5, "collection to continue")
