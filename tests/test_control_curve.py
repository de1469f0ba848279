"""A tcp:// control socket requires CURVE: authorised keys work, unknown keys get nothing."""
from __future__ import annotations

import shutil
import time

import pytest

from control_daemon import PLUGIN_ENV, SETTINGS, shared_paused, wait_for
from daemon_proc import DaemonProc, free_port
from ingestd import CommandFailed, ControlClient, DaemonUnavailable
from ingestd.control import cli
from ingestd.control.client import CurveKeys, EventStream
from ingestd.control.curve import keygen


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    authorized = root / "authorized"
    authorized.mkdir()
    made = {name: keygen(root, name) for name in ("server", "trainer", "intruder")}
    shutil.copy(made["trainer"][0], authorized / "trainer.key")
    return root, authorized, made


@pytest.fixture(scope="module")
def daemon(keys):
    root, authorized, made = keys
    control, events = free_port(), free_port()
    overrides = {**SETTINGS, "control.address": f"tcp://127.0.0.1:{control}",
                 "control.events_address": f"tcp://127.0.0.1:{events}",
                 "control.curve_secret_key": str(made["server"][1]), "control.curve_authorized_keys": str(authorized)}
    with shared_paused(), DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        with ControlClient(d.control_address, timeout=1.0, curve_keys=_keys(made, "trainer")) as c:
            wait_for(lambda: _alive(d, c), 60, "the daemon to answer over CURVE", interval=0.1)
        yield d


def _keys(made, name: str) -> CurveKeys:
    return CurveKeys.load(made["server"][0], made[name][1])


def _paused_event(client: ControlClient, stream: EventStream):
    """The first event ``stream`` hears while ``client`` pauses and resumes (a subscription
    becomes live a little after it connects); fails after 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        client.pause()
        client.resume()
        got = stream.next(0.3)
        if got is not None:
            return got
    raise AssertionError("no event within 10 s")


def _alive(d: DaemonProc, client: ControlClient) -> bool:
    assert d.proc.poll() is None, d.log()
    try:
        return client.status().replay.write_count > 0
    except DaemonUnavailable:
        return False


def test_authorised_client_controls_the_daemon(daemon, keys):
    with ControlClient(daemon.control_address, timeout=3.0, curve_keys=_keys(keys[2], "trainer")) as c:
        assert c.ping()["pong"]
        assert c.pause().workers == [0, 1]
        assert c.status().desired == "pause"
        assert c.resume().workers == [0, 1]


def test_unknown_key_gets_nothing_and_cannot_pause(daemon, keys):
    with ControlClient(daemon.control_address, timeout=0.5, retries=0,
                       curve_keys=_keys(keys[2], "intruder")) as intruder:
        with pytest.raises(DaemonUnavailable):
            intruder.ping()
        with pytest.raises(DaemonUnavailable):
            intruder.pause(timeout_s=0.5)
    with ControlClient(daemon.control_address, timeout=0.5, retries=0) as plain:  # no CURVE at all
        with pytest.raises(DaemonUnavailable, match=r"curve_keys=CurveKeys\.load\(.*or ingestctl --server-key"):
            plain.ping()  # (the hint named only ingestctl's flags, to a Python caller: review)
    with ControlClient(daemon.control_address, timeout=3.0, curve_keys=_keys(keys[2], "trainer")) as c:
        status = c.status()
        assert status.desired == "run" and all(w.state == "running" for w in status.workers)
        mark = status.replay.write_count
        wait_for(lambda: c.status().replay.write_count > mark, 5, "collection to go on")


def test_events_need_an_authorised_key_too(daemon, keys):
    made = keys[2]
    with ControlClient(daemon.control_address, timeout=3.0, curve_keys=_keys(made, "trainer")) as c:
        address = c.ping()["events_address"]
        assert address.startswith("tcp://")
        with EventStream(address, ("paused",), curve_keys=_keys(made, "trainer")) as good, \
                EventStream(address, ("paused",), curve_keys=_keys(made, "intruder")) as bad:
            assert _paused_event(c, good).topic == "paused"
            assert bad.next(0.3) is None


def test_ingestctl_with_keys_and_reloaded_authorisation(daemon, keys, capsys):
    root, authorized, made = keys
    # 5 s for calls that must succeed (a TCP + CURVE handshake and the ZAP check, on a maybe slow
    # machine); 0.5 s for those that must get nothing (they would wait out any timeout)
    connect = ["--connect", daemon.control_address, "--server-key", str(made["server"][0])]
    ok, refused = [*connect, "--timeout", "5"], [*connect, "--timeout", "0.5"]
    assert cli.main([*ok, "--client-key", str(made["trainer"][1]), "ping"]) == 0
    assert cli.main([*refused, "--client-key", str(made["intruder"][1]), "ping"]) == cli.EX_UNAVAILABLE
    shutil.copy(made["intruder"][0], authorized / "intruder.key")
    try:
        assert cli.main([*ok, "--client-key", str(made["trainer"][1]), "reload"]) == 0
        assert cli.main([*ok, "--client-key", str(made["intruder"][1]), "ping"]) == 0
    finally:
        (authorized / "intruder.key").unlink()
        assert cli.main([*ok, "--client-key", str(made["trainer"][1]), "reload"]) == 0
    assert cli.main([*refused, "--client-key", str(made["intruder"][1]), "ping"]) == cli.EX_UNAVAILABLE
    capsys.readouterr()


def test_a_revoked_key_loses_the_connection_it_already_has(daemon, keys):
    """Revoking a key (remove it, reload) only refused new connections: one already open kept
    full control."""
    root, authorized, made = keys
    shutil.copy(made["intruder"][0], authorized / "intruder.key")
    try:
        with ControlClient(daemon.control_address, timeout=5.0, curve_keys=_keys(made, "trainer")) as admin, \
                ControlClient(daemon.control_address, timeout=2.0, retries=0,
                              curve_keys=_keys(made, "intruder")) as held:
            admin.reload()
            assert held.ping()["pong"]  # connected while authorised
            (authorized / "intruder.key").unlink()
            admin.reload()
            with pytest.raises(DaemonUnavailable):
                held.pause(timeout_s=1.0)
            assert admin.status().desired == "run"
    finally:
        (authorized / "intruder.key").unlink(missing_ok=True)
        with ControlClient(daemon.control_address, timeout=5.0, curve_keys=_keys(made, "trainer")) as admin:
            admin.reload()
    assert "dropped a request from revoked key" in daemon.log()


def test_key_files_delivered_as_links_are_read(tmp_path):
    """Secret mounts and config management deliver keys as links; they must keep working."""
    from ingestd.control.curve import load_public, load_secret

    keygen(tmp_path, "real")
    (tmp_path / "linked.key_secret").symlink_to(tmp_path / "real.key_secret")
    (tmp_path / "linked.key").symlink_to(tmp_path / "real.key")
    assert load_secret(tmp_path / "linked.key_secret") == load_secret(tmp_path / "real.key_secret")
    assert load_public(tmp_path / "linked.key") == load_public(tmp_path / "real.key")


def test_local_tools_need_no_keys_beside_a_tcp_socket(daemon):
    """A tcp:// control (and event) socket is also bound at its local ipc default, without CURVE
    (file modes guard it): systemd's ExecReload and a local ingestctl work with no keys."""
    local = f"ipc://{daemon.runtime_dir}/control.sock"
    with ControlClient(local, timeout=5.0) as c:
        pong = c.ping()
        assert pong["events_address"].startswith("tcp://")
        assert pong["events_local"] == f"ipc://{daemon.runtime_dir}/events.sock"
        with EventStream.of(c, ("paused",)) as stream:  # follows the local event socket, keyless
            assert _paused_event(c, stream).topic == "paused"
        assert c.reload().applied == []
    assert cli.main(["--connect", local, "--timeout", "5", "status"]) == 0


def test_a_reload_of_a_broken_file_still_revokes_keys(daemon, keys, capsys):
    """The keys were re-read only when the config file reloaded fine: a revocation did not
    happen while the file had a typo, and the reply did not say so."""
    root, authorized, made = keys
    shutil.copy(made["intruder"][0], authorized / "intruder.key")
    text = daemon.config_path.read_text()
    try:
        with ControlClient(daemon.control_address, timeout=5.0, curve_keys=_keys(made, "trainer")) as admin:
            assert admin.reload().authorized_keys == 2
            with ControlClient(daemon.control_address, timeout=5.0, curve_keys=_keys(made, "intruder")) as held:
                assert held.ping()["pong"]
            (authorized / "intruder.key").unlink()
            daemon.config_path.write_text(text + "\n[workers\n")  # a TOML syntax error
            with pytest.raises(CommandFailed, match="re-read all the same: 1"):
                admin.reload()
        with ControlClient(daemon.control_address, timeout=0.5, retries=0,
                           curve_keys=_keys(made, "intruder")) as intruder:
            with pytest.raises(DaemonUnavailable, match="refused this client's key"):
                intruder.ping()
    finally:
        daemon.config_path.write_text(text)
        (authorized / "intruder.key").unlink(missing_ok=True)
        with ControlClient(daemon.control_address, timeout=5.0, curve_keys=_keys(made, "trainer")) as admin:
            admin.reload()
    capsys.readouterr()


def test_an_unreadable_keys_directory_keeps_the_keys_at_reload(daemon, keys):
    """An unreadable or vanished directory read as "no keys": the reload said ok and locked
    every remote operator out."""
    root, authorized, made = keys
    moved = root / "authorized.moved"
    with ControlClient(daemon.control_address, timeout=5.0, curve_keys=_keys(made, "trainer")) as admin:
        authorized.rename(moved)
        try:
            result = admin.reload()
            assert result.authorized_keys == 1 and "cannot read" in result.authorized_keys_error
            assert admin.ping()["pong"]
        finally:
            moved.rename(authorized)
        assert admin.reload().authorized_keys_error is None


def test_events_of_a_tcp_daemon_whose_events_socket_is_left_ipc(keys):
    """control.address tcp://, control.events_address unset (its ipc default): a client with
    CURVE keys followed that ipc socket with them and heard nothing, without a word (review). On
    the daemon's host it now follows it without keys (CURVE is for tcp only); where the socket is
    not (another host), it is told why and what to set. The start-up log says which socket is CURVE."""
    _, authorized, made = keys
    overrides = {**SETTINGS, "control.address": f"tcp://127.0.0.1:{free_port()}",
                 "control.curve_secret_key": str(made["server"][1]), "control.curve_authorized_keys": str(authorized)}
    with shared_paused(), DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        with ControlClient(d.control_address, timeout=3.0, curve_keys=_keys(made, "trainer")) as c:
            wait_for(lambda: _alive(d, c), 60, "the daemon to answer over CURVE", interval=0.1)
            with EventStream.of(c, ("paused",)) as stream:
                assert stream.address == f"ipc://{d.runtime_dir}/events.sock"
                assert _paused_event(c, stream).topic == "paused"

            class Elsewhere:  # the same daemon as a client on another host sees it
                address, curve_keys = c.address, c.curve_keys

                def __init__(self, **pong):
                    self.pong = pong

                def ping(self):
                    return {**c.ping(), **self.pong}

            # another host whose own daemon has a socket at that very path (the default /run/ingestd/events.sock
            # of a host running ingestd itself): it would follow that daemon's events (review); and an older
            # daemon, which does not say its host, with no socket at that path here
            for other in (Elsewhere(host="another-host/0"),
                          Elsewhere(host="", events_address="ipc:///nonexistent-ingestd/run/events.sock")):
                with pytest.raises(DaemonUnavailable, match=r"control\.events_address = \"tcp://HOST:PORT\""):
                    EventStream.of(other)
            code = cli.main(["--connect", c.address, "--server-key", str(made["server"][0]), "--client-key",
                             str(made["trainer"][1]), "events", "--duration", "0.1"])
            assert code == 0  # ingestctl events resolves the address the same way: here, the local socket
        line = next(line for line in d.log().splitlines() if "ingestd.control: control: " in line)
        assert f"{d.control_address} (CURVE), events: ipc://{d.runtime_dir}/events.sock;" in line, line
        assert "None" not in line, line
        assert d.stop() == 0
