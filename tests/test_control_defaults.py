"""A daemon started without ``--config`` (the embedded default config and ``--set`` overrides)
and with ``metrics.port = 0``: what ``reload``, ``ping`` and ``status`` tell about it."""
from __future__ import annotations

import json
import re
import urllib.request

import pytest

from control_daemon import PLUGIN_ENV, SETTINGS, shared_paused, wait_collecting
from daemon_proc import DaemonProc
from ingestd import ControlClient
from ingestd.control import cli


class WithoutConfigFile(DaemonProc):
    """``ingestd run`` with ``--set`` overrides only: no config file to re-read."""

    def run_args(self) -> list[str]:
        args = super().run_args()
        at = args.index("--config")
        return args[:at] + args[at + 2:]


@pytest.fixture(scope="module")
def daemon():
    overrides = {**SETTINGS, "workers.count": 1, "replay.capacity": 100_000, "metrics.enabled": True,
                 "metrics.port": 0}
    with shared_paused(), WithoutConfigFile(overrides=overrides, env=PLUGIN_ENV) as d:
        wait_collecting(d)
        yield d


@pytest.fixture
def client(daemon):
    with ControlClient(daemon.control_address, timeout=5.0) as c:
        yield c


def run(daemon, capsys, *argv: str, as_json: bool = False) -> tuple[int, str, str]:
    code = cli.main(["--connect", daemon.control_address, *(["--json"] if as_json else []), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_reload_says_there_is_no_config_file(daemon, client, capsys):
    result = client.reload()
    assert (result.applied, result.not_applied, result.config_file) == ([], [], None)
    code, out, err = run(daemon, capsys, "reload")
    assert code == 0, err
    assert "no config file to re-read" in out and "embedded default config" in out, out
    code, out, err = run(daemon, capsys, "reload", as_json=True)
    assert json.loads(out)["result"] == {"applied": [], "not_applied": [], "config_file": None,
                                         "authorized_keys": None, "authorized_keys_error": None}  # no CURVE


def test_ping_and_status_tell_the_bound_metrics_port(daemon, client, capsys):
    """With metrics.port = 0 the kernel picks the port: the log said which, and now the
    control replies do too."""
    logged = re.search(r"serving metrics on (http://\S+/metrics)", daemon.log())
    assert logged is not None, daemon.log()
    url = logged[1]
    assert not url.endswith(":0/metrics")
    assert client.ping()["metrics_url"] == client.status().metrics_url == url
    with urllib.request.urlopen(url, timeout=10) as page:
        assert "ingestd_replay_capacity_rows" in page.read().decode()
    code, out, err = run(daemon, capsys, "status")
    assert code == 0, err
    assert f"metrics: {url}" in out, out
    code, out, err = run(daemon, capsys, "status", as_json=True)
    assert json.loads(out)["result"]["metrics_url"] == url


SMALL_RING = ("[workers]\ncount = 2\nnum_envs = 8\nchunk_steps = 8\nenv = 'Checksum'\npolicy = 'Random'\n"
              "[replay]\ncapacity = 256\n")  # exactly 2 * 2 workers * 8 envs * 8 steps


def test_scale_limiter_and_reload_are_checked_like_the_config_file():
    """A scale past what the replay holds was accepted (writers could lap each other mid-write);
    scale and limiter changes left `config` stale; a reload checked the file's live keys against
    the file's own restart-only values instead of the running ones."""
    from ingestd import CommandFailed

    d = DaemonProc(config_text=SMALL_RING, env=PLUGIN_ENV)
    for key in ("workers.num_envs", "workers.chunk_steps", "replay.capacity"):
        d.overrides.pop(key)  # from the file, so that a reload reads them too
    with d:
        d.wait_ready()
        with ControlClient(d.control_address, timeout=10) as c:
            with pytest.raises(CommandFailed, match="replay.capacity.*at least 384") as err:
                c.scale(3)
            assert err.value.code == "bad_request"
            assert len(c.status().workers) == 2 and c.config()["workers"]["count"] == 2
            c.scale(1)
            assert c.config()["workers"]["count"] == 1 and len(c.status().workers) == 1
            c.limiter(samples_per_insert=0.5)
            assert c.config()["limiter"]["samples_per_insert"] == 0.5
            result = c.reload()  # the file wins over changes made over the socket
            assert {"workers.count", "limiter.samples_per_insert"} <= set(result.applied), result
            assert c.config()["workers"]["count"] == 2 and c.limiter().samples_per_insert == 1.0
            d.config_path.write_text(SMALL_RING.replace("count = 2", "count = 4").replace("num_envs = 8",
                                                                                        "num_envs = 2"))
            with pytest.raises(CommandFailed, match="replay.capacity.*workers.num_envs") as err:
                c.reload()  # 4 workers fit only with the file's 2 envs, which need a restart
            assert err.value.code == "reload_failed"
            assert c.config()["workers"]["count"] == 2 and len(c.status().workers) == 2


def test_the_default_socket_in_a_dir_of_another_user_is_refused(tmp_path):
    """/tmp/ingestd-<uid> made first by another user could hold a fake daemon that takes the
    trainer's weights and answers for the real one."""
    from ingestd import DaemonUnavailable

    runtime = tmp_path / "ingestd"
    with ControlClient(environ={"XDG_RUNTIME_DIR": str(tmp_path)}, timeout=0.3) as client:
        with pytest.raises(DaemonUnavailable, match="was not sent"):  # no dir yet: nothing is connected
            client.ping()
    runtime.mkdir()
    runtime.chmod(0o777)
    with ControlClient(environ={"XDG_RUNTIME_DIR": str(tmp_path)}, timeout=1.0) as client:
        with pytest.raises(DaemonUnavailable, match="refusing the default control socket"):
            client.ping()
    runtime.chmod(0o700)  # our own again: now it is merely absent
    with ControlClient(environ={"XDG_RUNTIME_DIR": str(tmp_path)}, timeout=0.3, retries=0) as client:
        with pytest.raises(DaemonUnavailable, match="no reply|no socket"):
            client.ping()
