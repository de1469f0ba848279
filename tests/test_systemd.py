"""The systemd integration in systemd/: the unit, the example config, the sysusers snippet.

- the unit passes ``systemd-analyze verify`` with nothing on stderr (unknown keys and
  bad values only warn there) and ``systemd-analyze security`` rates it 2.0 or better;
- its settings agree with each other, with the example config and with what
  libzmq and torch need;
- its ExecReload= command line, run as systemd would run it, returns only once
  the daemon has reloaded (RELOADING=1 ... READY=1 sent, workers.count applied);
- under its UMask= the replay is readable by the group and by no one else.

systemd is not PID 1 here: the tools run offline, the unit is never started.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_proc import DaemonProc, descendants, environ_of
from ingestd.control.client import DEFAULT_ACK_TIMEOUT_S, ControlClient
from ingestd.service import config as cfg

REPO = Path(__file__).resolve().parent.parent
SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "ingestd.service"
EXAMPLE = SYSTEMD / "ingestd.toml"
SYSUSERS = SYSTEMD / "ingestd.sysusers"
INSTALLED = {"/usr/local/bin/ingestd": "ingestd", "/usr/local/bin/ingestctl": "ingestctl"}

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed (.ci/run installs Debian's systemd)")


# -- reading the unit ---------------------------------------------------------------------
def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values in order]}}`` (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    lines = iter(path.read_text().splitlines())
    for line in lines:
        line = line.strip()
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines, "").strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


UNIT_CONF = read_unit(UNIT)
SERVICE = UNIT_CONF["Service"]


def one(key: str, section: str = "Service") -> str:
    values = UNIT_CONF[section].get(key)
    assert values and len(values) == 1, f"{section}.{key}: expected one value, got {values}"
    return values[0]


def seconds(span: str) -> float:
    """A systemd time span ("30", "30s", "2min 5s", "500ms") in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span)
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), f"bad time span {span!r}"
    return sum(float(n) * units[u] for n, u in parts)


def example_config() -> cfg.Config:
    return cfg.load_config(EXAMPLE)


def systemd_environ() -> dict[str, str]:
    """What systemd puts in the environment of ExecStart=/ExecReload= for this unit."""
    return {"RUNTIME_DIRECTORY": f"/run/{one('RuntimeDirectory')}",
            "STATE_DIRECTORY": f"/var/lib/{one('StateDirectory')}",
            "CONFIGURATION_DIRECTORY": f"/etc/{one('ConfigurationDirectory')}",
            "HOME": f"/var/lib/{one('StateDirectory')}"}


def unit_environment() -> dict[str, str]:
    """The variables the unit's ``Environment=`` lines set (``KEY=VALUE``, each maybe quoted)."""
    out = {}
    for line in SERVICE.get("Environment", []):
        for item in shlex.split(line):
            key, _, value = item.partition("=")
            out[key] = value
    return out


def local_command(line: str) -> list[str]:
    """An Exec*= command line with the installed paths mapped to this checkout's entry points."""
    argv = shlex.split(line)
    assert argv[0] in INSTALLED, f"{argv[0]}: expected one of {sorted(INSTALLED)}"
    script = Path(sys.executable).parent / INSTALLED[argv[0]]
    if script.exists():
        return [str(script), *argv[1:]]
    module = {"ingestd": "ingestd.service.cli", "ingestctl": "ingestd.control.cli"}[INSTALLED[argv[0]]]
    return [sys.executable, "-m", module, *argv[1:]]


def test_copy(tmp_path: Path, extra: str = "") -> Path:
    """The unit with ExecStart=/ExecReload= pointing at executables that exist here."""
    text = UNIT.read_text()
    for installed, name in INSTALLED.items():
        text = text.replace(installed + " ", (shutil.which(name) or sys.executable) + " ")
    copy = tmp_path / "ingestd.service"
    copy.write_text(text + extra)
    return copy


test_copy.__test__ = False  # a helper, not a test


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"})


# -- systemd-analyze ------------------------------------------------------------------------
@needs_analyze
def test_unit_verifies_without_a_single_warning(tmp_path):
    result = analyze("verify", str(test_copy(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"systemd-analyze verify warned:\n{result.stderr}"


@needs_analyze
def test_verify_does_catch_what_the_test_relies_on(tmp_path):
    """The check above can fail: a bad key only warns (stderr), a missing binary fails."""
    warned = analyze("verify", str(test_copy(tmp_path, "NotAKey=1\n")))
    assert warned.returncode == 0 and "NotAKey" in warned.stderr
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "ingestd.service").write_text(UNIT.read_text())  # /usr/local/bin/ingestd is not installed here
    if not Path("/usr/local/bin/ingestd").exists():
        assert analyze("verify", str(missing / "ingestd.service")).returncode != 0


@needs_analyze
def test_security_exposure_is_2_or_better(tmp_path):
    result = analyze("security", "--offline=yes", "--threshold=20", "--no-pager", str(test_copy(tmp_path)))
    match = re.search(r"Overall exposure level for ingestd\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= 2.0, result.stdout
    assert result.returncode == 0, result.stdout + result.stderr


# -- what the unit says ------------------------------------------------------------------------
@pytest.mark.parametrize("key, value", [
    ("Type", "notify"), ("NotifyAccess", "main"), ("KillMode", "mixed"), ("Restart", "on-failure"),
    ("User", "ingestd"), ("Group", "ingestd"), ("UMask", "0027"),
    ("RuntimeDirectory", "ingestd"), ("StateDirectory", "ingestd"), ("ConfigurationDirectory", "ingestd"),
    ("RuntimeDirectoryMode", "0750"), ("RuntimeDirectoryPreserve", "restart"),
    ("RestartPreventExitStatus", "64 78"), ("ExecStart", "/usr/local/bin/ingestd run --config /etc/ingestd/ingestd.toml"),
    ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
])
def test_service_setting(key, value):
    assert one(key) == value


def test_start_limit_is_set():
    assert int(one("StartLimitBurst", "Unit")) >= 1
    assert seconds(one("StartLimitIntervalSec", "Unit")) > 0


def test_hardening_leaves_what_zmq_and_torch_need():
    families = " ".join(SERVICE["RestrictAddressFamilies"]).split()
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= set(families), "libzmq needs AF_NETLINK"
    assert not any(f.startswith("~") for f in families)
    for rule in SERVICE["SystemCallFilter"]:
        if rule.startswith("~"):
            assert "@resources" not in rule.split(), "libzmq calls sched_setscheduler (@resources)"
    assert "@system-service" in SERVICE["SystemCallFilter"]
    assert SERVICE.get("MemoryDenyWriteExecute", ["no"])[-1] in ("no", "false"), "torch's oneDNN JITs code"
    assert SERVICE.get("PrivateNetwork", ["no"])[-1] in ("no", "false"), "metrics listen on TCP"


def test_timeouts_fit_the_daemon():
    config = example_config()
    assert seconds(one("TimeoutStopSec")) >= config.service.stop_timeout_s + 5, \
        "KillMode=mixed SIGKILLs the workers after TimeoutStopSec: leave the daemon time to drain them"
    watchdog = seconds(one("WatchdogSec"))
    assert 5 <= watchdog <= 120
    argv = shlex.split(one("ExecReload"))
    timeout = float(argv[argv.index("--timeout") + 1])
    attempts = 1 + 2  # ControlClient's default retries for an idempotent command
    assert attempts * (timeout + DEFAULT_ACK_TIMEOUT_S) < seconds(one("TimeoutStartSec")), \
        "systemd would kill ExecReload (bounded by TimeoutStartSec) before ingestctl gives up"


def test_example_config_is_valid_and_matches_the_unit():
    check = subprocess.run(local_command(f"/usr/local/bin/ingestd config check {EXAMPLE}"),
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert shlex.split(one("ExecStart"))[-1] == f"/etc/{one('ConfigurationDirectory')}/ingestd.toml"
    env = systemd_environ()
    config = example_config()
    paths = cfg.resolve_paths(config, env, uid=999)
    runtime = Path(env["RUNTIME_DIRECTORY"])
    assert paths.runtime_dir == runtime and paths.data_dir == Path(env["STATE_DIRECTORY"])
    assert paths.replay.parent == runtime, "the replay lives in the RuntimeDirectory (see docs/systemd.md)"
    assert paths.control == f"ipc://{runtime}/control.sock"
    assert cfg.default_control_address(env) == paths.control, "ExecReload's ingestctl would miss the daemon"
    for private in ("/tmp", "/var/tmp", "/dev/shm"):  # PrivateTmp=/PrivateDevices= hide them from trainers
        assert not str(paths.replay).startswith(private)


def test_sysusers_snippet_creates_the_service_user(tmp_path):
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed (.ci/run installs Debian's systemd)")
    etc = tmp_path / "etc"
    etc.mkdir()
    for name in ("passwd", "group", "shadow", "gshadow"):
        (etc / name).touch()
    result = subprocess.run([sysusers, f"--root={tmp_path}", str(SYSUSERS)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    users = {line.split(":")[0]: line.split(":") for line in (etc / "passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (etc / "group").read_text().splitlines()}
    user = users[one("User")]
    assert one("Group") in groups and user[3] == groups[one("Group")][2], "the user's primary group"
    assert user[5] == f"/var/lib/{one('StateDirectory')}", "home = the StateDirectory (ProtectHome= hides /home)"
    assert user[6].endswith("nologin")


def test_docs_cover_every_shipped_file():
    doc = (REPO / "docs" / "systemd.md").read_text()
    for path in SYSTEMD.iterdir():
        assert f"systemd/{path.name}" in doc, f"docs/systemd.md does not say how to install {path.name}"


# -- a daemon started as the unit would start it ---------------------------------------------------
@pytest.fixture(scope="module")
def service():
    """A daemon under the unit's UMask= and Environment=, its replay in the runtime dir as in the
    example config, with a fake NOTIFY_SOCKET, one worker from its config file, and a control socket."""
    d = DaemonProc(notify=True, config_text="[workers]\ncount = 1\n", launch="exec", env=unit_environment())
    d.overrides["replay.path"] = str(d.runtime_dir / "replay")
    old = os.umask(int(one("UMask"), 8))
    try:
        d.start()  # the daemon inherits the umask, as from UMask=
    finally:
        os.umask(old)
    try:
        d.wait_notify("READY=1", timeout=60)
        yield d
        assert d.stop() == 0, d.log()
    finally:
        d.close()


# -- ExecReload=, run as systemd would run it ------------------------------------------------------
def drain(d: DaemonProc) -> list[str]:
    """sd_notify messages already queued (sent before now), without waiting for more."""
    got = []
    d.notify_sock.setblocking(False)
    try:
        while True:
            got.append(d.notify_sock.recv(4096).decode())
    except (BlockingIOError, socket.timeout):
        pass
    finally:
        d.notify_sock.settimeout(0.1)
    d.messages.extend(got)
    return got


def exec_reload(d: DaemonProc) -> subprocess.Popen:
    """The unit's ExecReload= command line, in the environment systemd gives it, aimed at ``d``."""
    env = {k: v for k, v in os.environ.items() if k not in ("INGESTD_CONTROL", "NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env.update(RUNTIME_DIRECTORY=str(d.runtime_dir), STATE_DIRECTORY=str(d.data_dir), MAINPID=str(d.proc.pid))
    return subprocess.Popen(local_command(one("ExecReload")), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def reload_notifications(messages: list[str]) -> list[str]:
    return [m.split("\n", 1)[0] for m in messages if m.startswith(("RELOADING=1", "READY=1"))]


def test_exec_reload_returns_once_the_reload_is_done(service):
    d = service
    with ControlClient(d.control_address, timeout=10) as client:
        assert client.status().count == 1
        d.config_path.write_text("[workers]\ncount = 3\n")

        # A command that only pokes the daemon (kill -HUP) would return while it is frozen.
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            drain(d)
            command = exec_reload(d)
            time.sleep(1.0)
            assert command.poll() is None, "ExecReload returned before the daemon could reload"
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        out, err = command.communicate(timeout=60)
        sent = drain(d)  # queued before the command returned
        assert command.returncode == 0, err
        assert reload_notifications(sent) == ["RELOADING=1", "READY=1"], sent
        assert "workers.count" in out
        status = client.status()
        assert status.count == 3 and [w.index for w in status.workers] == [0, 1, 2]

        # A reload that fails must fail the command (systemctl reload reports it) and
        # still end the RELOADING state with READY=1; the running config stays.
        d.config_path.write_text('[workers]\ncount = "three"\n')
        command = exec_reload(d)
        out, err = command.communicate(timeout=60)
        sent = drain(d)
        assert command.returncode != 0 and "workers.count" in err, (out, err)
        assert reload_notifications(sent) == ["RELOADING=1", "READY=1"], sent
        assert client.status().count == 3


# -- UMask= and the group ------------------------------------------------------------------------
def attach_as(uid: int, gid: int, groups: list[int], replay: Path) -> int:
    """In a forked child with those ids: 0 if ReplayReader attaches and samples, 13 on EACCES."""
    from ingestd.replay import ReplayReader

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            with ReplayReader(replay) as reader:
                code = 0 if reader.write_count > 0 and reader.sample(4).batch_size[0] == 4 else 2
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_large_copies_use_non_temporal_stores():
    """docs/systemd.md ("Copy speed"): glibc's memcpy streams copies above 64 KiB past the caches."""
    from ingestd.service.tunables import with_copy_tunable

    # the value `ingestd run` gives itself: a unit with another would be kept as "the user's own"
    assert unit_environment().get("GLIBC_TUNABLES") == with_copy_tunable("")


def test_umask_makes_the_replay_readable_by_the_group_only(service):
    from ingestd.replay import ReplayReader

    d = service
    d.wait_ready(rows=1)
    for pid in (d.proc.pid, *descendants(d.proc.pid)):  # the unit's Environment= reached the daemon and its workers
        assert f"GLIBC_TUNABLES={unit_environment()['GLIBC_TUNABLES']}" in environ_of(pid), pid
    d.root.chmod(0o750)  # stands in for /run, which everyone may traverse
    replay = d.replay_path
    for path in [d.runtime_dir, *d.runtime_dir.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode & 0o007 == 0, f"{path} is open to others: {oct(mode)}"
        if path.parent == replay or path == replay:
            assert mode & 0o050 if path.is_dir() else mode & 0o040, f"{path} not group-readable: {oct(mode)}"
    for sock in ("control.sock", "events.sock"):
        assert (d.runtime_dir / sock).stat().st_mode & 0o777 == 0o660, "group members must connect"
    if os.geteuid() == 0:
        with ReplayReader(replay) as reader:  # import everything the child will use
            reader.sample(4)
        gid = replay.stat().st_gid
        nobody = 65534
        assert attach_as(nobody, nobody, [gid], replay) == 0, "a member of the group cannot attach"
        assert attach_as(nobody, nobody, [], replay) == 13, "someone outside the group can read the replay"
