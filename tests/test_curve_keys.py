"""CURVE key handling without a daemon: the authorised-keys directory, key-file modes, the
throttled refusal log, start-up errors naming the right key, IPv6 and wildcard addresses."""
from __future__ import annotations

import logging
import shutil
import socket
from types import SimpleNamespace

import pytest
import zmq

from daemon_proc import free_port
from ingestd.control import curve
from ingestd.control.client import CurveKeys
from ingestd.control.curve import Authenticator, KeyFileError, keygen
from ingestd.control.server import ControlServer
from ingestd.errors import ConfigError
from ingestd.service.config import Config, with_overrides


@pytest.fixture
def made(tmp_path):
    (tmp_path / "authorized").mkdir()
    return {name: keygen(tmp_path, name) for name in ("a", "b", "c")}


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def _authenticator(context, directory, refusals=None) -> Authenticator:
    return Authenticator(context, directory, on_refuse=(refusals.append if refusals is not None else print))


def test_bare_keys_are_read_and_keyless_files_are_named(made, tmp_path, context, caplog):
    """A file holding only the 40-character key (what the client side accepts) was ignored, as
    were empty files, without a word; a secret key in the directory went unremarked."""
    authorized = tmp_path / "authorized"
    public_a = curve.load_public(made["a"][0])
    (authorized / "a.key").write_bytes(b"# alice\n" + public_a + b"\n")
    (authorized / "empty.key").write_bytes(b"")
    shutil.copy(made["b"][1], authorized / "b.key")  # the secret file, wrongly
    caplog.set_level(logging.INFO, "ingestd.control")
    auth = _authenticator(context, authorized)
    try:
        assert auth.count == 2 and auth.callback("*", public_a)
        assert auth.callback("*", curve.load_public(made["b"][0]))
        text = caplog.text
        assert "empty.key holds no public-key line" in text
        assert "b.key holds a secret key" in text
    finally:
        auth.stop()


def test_refusals_are_counted_but_logged_at_most_every_10_s(made, tmp_path, context, caplog):
    """Every refused handshake logged a warning: a peer offering random keys wrote ~300 lines/s,
    past journald's rate limit, which then dropped the daemon's own messages."""
    refusals: list[str] = []
    auth = _authenticator(context, tmp_path / "authorized", refusals)
    caplog.set_level(logging.WARNING, "ingestd.control")
    try:
        for _ in range(500):
            assert not auth.callback("*", zmq.curve_keypair()[0])
        assert refusals == ["unknown_key"] * 500
        assert caplog.text.count("refused a client with unknown public key") == 1
    finally:
        auth.stop()


def test_a_revoked_key_is_logged_again_after_each_revocation(made, tmp_path, context, caplog):
    authorized = tmp_path / "authorized"
    key = curve.load_public(made["a"][0]).decode()
    refusals: list[str] = []
    auth = _authenticator(context, authorized, refusals)
    auth.LOG_EVERY_S = 0.0  # the throttle is tested above; this is about once per key and revocation
    auth._quiet = {k: curve._Throttle(0.0) for k in auth._quiet}
    caplog.set_level(logging.WARNING, "ingestd.control")
    try:
        for _ in range(2):
            assert not auth.allows(key)
            auth.refused_request(key)
            auth.refused_request(key)
            auth.reload()  # re-added and revoked again in between, say
        assert caplog.text.count("dropped a request from revoked key") == 2
        assert refusals == ["revoked"] * 4
        assert auth.allows(None)  # the local ipc listener: no CURVE, file modes
    finally:
        auth.stop()


def test_an_unreadable_directory_is_an_error_not_zero_keys(made, tmp_path, context):
    authorized = tmp_path / "authorized"
    shutil.copy(made["a"][0], authorized / "a.key")
    with pytest.raises(KeyFileError, match="cannot read the authorised-keys directory"):
        _authenticator(context, tmp_path / "missing")
    auth = _authenticator(context, authorized)
    try:
        authorized.rename(tmp_path / "gone")
        with pytest.raises(KeyFileError, match="cannot read"):
            auth.reload()
        assert auth.count == 1 and auth.callback("*", curve.load_public(made["a"][0]))
    finally:
        auth.stop()


def test_start_up_errors_name_the_key_at_fault(made, tmp_path):
    """A bad curve_authorized_keys was reported as control.curve_secret_key."""
    server = ControlServer(Config())
    server._context = zmq.Context()
    paths = SimpleNamespace(control=f"tcp://127.0.0.1:{free_port()}", events="ipc:///x/events.sock",
                            curve_secret_key=made["a"][1], curve_authorized_keys=tmp_path / "missing")
    try:
        with pytest.raises(ConfigError) as raised:
            server._setup_curve(paths, SimpleNamespace(observe_auth_refusal=print))
        assert raised.value.key == "control.curve_authorized_keys"
        bad = SimpleNamespace(**{**vars(paths), "curve_secret_key": made["a"][0],
                                 "curve_authorized_keys": tmp_path / "authorized"})
        with pytest.raises(ConfigError) as raised:
            server._setup_curve(bad, SimpleNamespace(observe_auth_refusal=print))
        assert raised.value.key == "control.curve_secret_key"
    finally:
        server._context.term()


def test_group_readable_secret_keys_are_fine_others_are_warned(made, caplog):
    """docs/systemd.md keeps keys root:ingestd 0640, and the daemon warned "chmod 600 it" (which
    would lock the service user out); the client warned again for every socket."""
    secret = made["a"][1]
    caplog.set_level(logging.WARNING, "ingestd.control")
    secret.chmod(0o640)
    keys = CurveKeys.load(made["b"][0], secret)
    assert "may read it" not in caplog.text
    secret.chmod(0o644)
    keys = CurveKeys.load(made["b"][0], secret)
    assert caplog.text.count("every user may read it") == 1
    ctx = zmq.Context.instance()
    for _ in range(3):
        sock = ctx.socket(zmq.DEALER)
        keys.apply(sock)
        sock.close(0)
    assert caplog.text.count("every user may read it") == 1
    assert keys.client_secret.decode() not in repr(keys)


@pytest.mark.parametrize("key", ["control.address", "control.events_address"])
def test_a_wildcard_port_is_refused_by_name(key):
    """Port * was accepted, and the daemon advertised tcp://127.0.0.1:* (events could not be followed)."""
    with pytest.raises(ConfigError, match=r"port \* \(any free port\) is not supported"):
        with_overrides(Config(), [f'{key}="tcp://127.0.0.1:*"'])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_addresses_bind_and_connect():
    """tcp://[::1]:port passed the config check, then failed to bind ("No such device"): no
    socket enabled IPv6."""
    from ingestd.control.client import _client_socket

    server = ControlServer(Config())
    server._context = zmq.Context()
    address = f"tcp://[::1]:{free_port()}"
    router = server._socket(zmq.ROUTER, [address], None, {})
    client = _client_socket(server._context, zmq.DEALER, address, None)
    try:
        client.send(b"hello")
        assert router.poll(5000) and router.recv_multipart()[1] == b"hello"
    finally:
        client.close(0)
        router.close(0)
        server._context.term()


def test_config_check_reads_the_key_files(made, tmp_path, capsys):
    """A missing secret key or authorised-keys dir passed `ingestd config check`, and `ingestd
    run` exited 78 only after building the env (operator review)."""
    from ingestd.service import cli

    path = tmp_path / "ingestd.toml"
    path.write_text("")
    base = [f'service.runtime_dir="{tmp_path}/run"', f'service.data_dir="{tmp_path}/data"',
            f'control.address="tcp://127.0.0.1:{free_port()}"']
    cases = {
        "control.address": [],
        "control.curve_secret_key": [f'control.curve_secret_key="{tmp_path}/nope.key_secret"',
                                     f'control.curve_authorized_keys="{tmp_path}/authorized"'],
        "control.curve_authorized_keys": [f'control.curve_secret_key="{made["a"][1]}"',
                                          f'control.curve_authorized_keys="{tmp_path}/nope"'],
    }
    for key, settings in cases.items():
        args = ["config", "check", str(path)]
        for setting in base + settings:
            args += ["--set", setting]
        assert cli.main(args) == 78, key
        assert f"config key '{key}'" in capsys.readouterr().err, key
    good = ["config", "check", str(path)]
    for setting in base + [f'control.curve_secret_key="{made["a"][1]}"',
                           f'control.curve_authorized_keys="{tmp_path}/authorized"']:
        good += ["--set", setting]
    assert cli.main(good) == 0, capsys.readouterr().err
    assert not (tmp_path / "data").exists()
