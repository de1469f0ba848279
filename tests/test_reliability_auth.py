"""Reliability, authentication: on a CURVE tcp bind, clients without an authorised key (none, an
unknown one, or the wrong server key) cannot run any command and receive nothing, neither replies
nor events; and the modes of the key files, the ipc sockets and the daemon's state files."""
from __future__ import annotations

import os
import shutil
import stat
import time
import urllib.request

import pytest
import zmq

import control_plugins
from control_daemon import PLUGIN_ENV, SETTINGS, pause_shared, shared, shared_paused
from daemon_proc import DaemonProc, free_port
from ingestd import ControlClient, DaemonUnavailable
from ingestd.control.client import CurveKeys, EventStream
from ingestd.control.commands import COMMANDS
from ingestd.control.curve import keygen
from ingestd.control.protocol import encode_header
from ingestd.weights.wire import encode
from reliability_util import record, wait_for
from test_metrics import samples


@pytest.fixture(scope="module")
def daemon(pytestconfig):
    """The shared (ipc) control daemon (only its files are looked at: its workers need not run;
    paused after the module, as ``control_daemon.daemon`` leaves it)."""
    yield shared(pytestconfig)
    pause_shared()


@pytest.fixture(scope="module")
def curve_daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    (authorized := root / "authorized").mkdir()
    made = {name: keygen(root, name) for name in ("server", "trainer", "intruder", "impostor")}
    shutil.copy(made["trainer"][0], authorized / "trainer.key")
    loose = root / "loose.key_secret"  # the daemon's secret key, readable by others: it must warn
    shutil.copy(made["server"][1], loose)
    loose.chmod(0o644)
    overrides = {**SETTINGS, "control.address": f"tcp://127.0.0.1:{free_port()}",
                 "control.events_address": f"tcp://127.0.0.1:{free_port()}",
                 "control.curve_secret_key": str(loose), "control.curve_authorized_keys": str(authorized),
                 "metrics.enabled": True}
    with shared_paused(), DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        keys = CurveKeys.load(made["server"][0], made["trainer"][1])
        with ControlClient(d.control_address, timeout=1.0, curve_keys=keys) as c:
            wait_for(lambda: _answers(d, c), 60, "the daemon to answer over CURVE", 0.1)
        yield d, made, keys


def _answers(d, c) -> bool:
    assert d.proc.poll() is None, d.log()
    try:
        return all(w.frames > 0 for w in c.status().workers)
    except DaemonUnavailable:
        return False


def _requests_counted(d: DaemonProc) -> dict[str, float]:
    """Requests that reached the handlers, per command."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as reply:
        found = samples(reply.read().decode())
    counted: dict[str, float] = {}
    for (name, labels), value in found.items():
        if name == "ingestd_control_requests_total":
            cmd = dict(labels)["cmd"]
            counted[cmd] = counted.get(cmd, 0.0) + value
    return counted


def _every_command() -> list[list[bytes]]:
    """One message per command, each of them harmful if it ran (scale to 0, restart, a push...)."""
    args = {"pause": {}, "resume": {}, "restart": {}, "scale": {"count": 0}, "push_weights": {"wait": False}}
    out = []
    for cmd in sorted(COMMANDS):
        payload = encode(control_plugins.weights(1.0)) if cmd == "push_weights" else []
        out.append([encode_header(f"intruder-{cmd}", cmd, args.get(cmd, {})), *payload])
    return out + [[b"garbage"]]


def test_unauthorised_clients_get_nothing(curve_daemon):
    d, made, keys = curve_daemon
    ctx = zmq.Context.instance()
    with ControlClient(d.control_address, timeout=3.0, curve_keys=keys) as c:
        before = c.status()
        events_address = c.ping()["events_address"]
    counted = _requests_counted(d)
    socks, subs = [], []
    unsent = 0

    def curve(sock, server_public: bytes, secret_file) -> zmq.Socket:
        CurveKeys(server_public, str(secret_file)).apply(sock)
        return sock

    server_public = CurveKeys.load(made["server"][0], made["trainer"][1]).server_public
    impostor_public = CurveKeys.load(made["impostor"][0], made["trainer"][1]).server_public
    setups = {"no key": lambda s: s, "unknown client key": lambda s: curve(s, server_public, made["intruder"][1]),
              "wrong server key": lambda s: curve(s, impostor_public, made["trainer"][1])}
    try:
        for name, setup in setups.items():
            for frames in _every_command():
                sock = setup(ctx.socket(zmq.DEALER))
                sock.setsockopt(zmq.LINGER, 0)
                # a DEALER send blocks while the socket has no pipe, which a refused CURVE handshake can
                # leave it without for a while (the test once hung here for ever): a message that could
                # not be queued in 2 s was not sent, and cannot be answered either
                sock.setsockopt(zmq.SNDTIMEO, 2000)
                sock.connect(d.control_address)
                try:
                    sock.send_multipart(frames)
                except zmq.Again:
                    unsent += 1
                socks.append((name, frames[0], sock))
            sub = setup(ctx.socket(zmq.SUB))
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(events_address)
            subs.append((name, sub))
        time.sleep(0.5)
        with ControlClient(d.control_address, timeout=5.0, retries=0, curve_keys=keys) as c:
            with EventStream(events_address, curve_keys=keys) as good:  # events flow, to the authorised only
                got, pairs = None, 0
                deadline = time.monotonic() + 10
                while got is None and time.monotonic() < deadline:
                    c.pause()
                    c.resume()
                    pairs += 1
                    got = good.next(0.3)
                assert got is not None
        time.sleep(1.0)
        answered = [(name, head) for name, head, sock in socks if sock.poll(0)]
        heard = [name for name, sub in subs if sub.poll(0)]
    finally:
        for _, _, sock in socks:
            sock.close(0)
        for _, sub in subs:
            sub.close(0)
    assert not answered, f"unauthorised requests were answered: {answered}"
    assert not heard, f"unauthorised subscribers received events: {heard}"
    with ControlClient(d.control_address, timeout=3.0, retries=0, curve_keys=keys) as c:
        after = c.status()
    assert after.desired == "run" and after.count == before.count and after.weights_version == before.weights_version
    assert [(w.pid, w.restarts, w.state) for w in after.workers] == \
        [(w.pid, w.restarts, "running") for w in before.workers], "a worker was disturbed"
    now = _requests_counted(d)
    grew = {cmd: now[cmd] - counted.get(cmd, 0.0) for cmd in now if now[cmd] != counted.get(cmd, 0.0)}
    # only the authorised client's requests (no retries: retries=0) reached the handlers
    assert grew == {"pause": pairs, "resume": pairs, "status": 1}, f"requests that reached the handlers: {grew}"
    counted = sum(grew.values())
    assert unsent < len(socks), "no unauthorised request could even be sent: the test tested nothing"
    record("7 authentication", attempts=len(socks), unsent=unsent, setups=len(setups), commands=len(_every_command()),
           answered=len(answered), subscribers_heard=len(heard), requests_counted=int(counted))


def test_key_socket_and_state_file_modes(curve_daemon, daemon):
    d, made, _ = curve_daemon
    for public, secret in made.values():
        assert stat.S_IMODE(public.stat().st_mode) == 0o644 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "every user may read it: chmod o-rwx it" in d.log(), "a loose secret key must be warned about"
    checked = {}
    for name in ("control.sock", "events.sock"):  # ipc sockets: 0660 or stricter
        mode = stat.S_IMODE(os.stat(daemon.runtime_dir / name).st_mode)
        assert mode & 0o660 == mode, (name, oct(mode))
        checked[name] = oct(mode)
    for name, most in (("weights", 0o640), ("workers.stats", 0o640)):  # group: trainers may read
        mode = stat.S_IMODE(os.stat(daemon.runtime_dir / name).st_mode)
        assert mode & most == mode, (name, oct(mode))
        checked[name] = oct(mode)
    mode = stat.S_IMODE(os.stat(daemon.runtime_dir).st_mode)
    assert mode & 0o007 == 0, oct(mode)
    checked["runtime dir"] = oct(mode)
    record("7 file modes", **checked)


def test_an_ipc_socket_file_bound_again_takes_local_tools_without_keys(curve_daemon):
    """A daemon on a CURVE tcp bind also listens at its local ipc sockets without keys. Their
    files deleted (systemd-tmpfiles, a tidy operator), it binds them again, on a socket that is a
    CURVE server by then: the new listener demanded keys, so ``ingestctl`` and ExecReload got
    no answer from the file bound again for them (control review)."""
    d, _, keys = curve_daemon
    control, events = d.runtime_dir / "control.sock", d.runtime_dir / "events.sock"
    with ControlClient(f"ipc://{control}", timeout=5.0) as c:
        assert c.ping()["pong"]
    before = {p: p.stat().st_ino for p in (control, events)}
    for path in before:
        path.unlink()
    wait_for(lambda: all(p.exists() and p.stat().st_ino != ino for p, ino in before.items()), 20,
             "the daemon to bind its socket files again", 0.1)
    with ControlClient(f"ipc://{control}", timeout=5.0) as c:  # no keys: a local tool
        assert c.ping()["pong"]
        with EventStream(f"ipc://{events}") as events_in:  # the local events socket too
            time.sleep(0.3)  # (subscribed before the event goes out)
            c.pause()
            assert events_in.next(timeout=5.0) is not None
        c.resume()
    with ControlClient(d.control_address, timeout=5.0, curve_keys=keys) as c:  # tcp still takes CURVE
        assert c.ping()["pong"]
