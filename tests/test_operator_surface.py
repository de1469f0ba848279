"""The operator's surface outside the control plane: ``ingestd run`` start-up failures that
no restart fixes exit 78 (EX_CONFIG, which the systemd unit does not retry) with the key at
fault and what to do, never a traceback; and docs/systemd.md says what the daemon does.

Every case is a real ``ingestd run`` in a subprocess. Each imports torch (seconds of CPU),
so the module starts them all at once (``startup``), as tests/test_daemon.py does.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from daemon_proc import failed_starts

import ingestd.control.commands  # noqa: F401 - imported by MetricsExporter.start(): before the fds run out
from ingestd.errors import ConfigError
from ingestd.metrics.exporter import MetricsExporter
from ingestd.service.config import load_config
from ingestd.service.instance import lock_runtime_dir

ROOT = Path(__file__).resolve().parent.parent
SETPRIV = shutil.which("setpriv")
AS_ROOT = os.geteuid() == 0
NO_DAC = ("dac_override", "dac_read_search")  # root would write a 0555 directory anyway


def unprivileged_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        return 1024


def no_room() -> None:
    """In the child: files past 1 MiB fail with EFBIG (as on a full tmpfs), instead of SIGXFSZ."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def damaged_replay(tmp: Path) -> None:
    (tmp / "replay").mkdir()
    (tmp / "replay" / "meta.json").write_text('{"format": "ingestd-replay", ')  # cut short
    (tmp / "replay" / "data.bin").write_bytes(b"rows someone may still want" * 100)


# case -> (settings, capabilities to drop when root, setup(tmp), how the key is named, why / what to do)
CASES = {
    "metrics address not on this host": (['metrics.address="192.0.2.1"'], (), None, "config key 'metrics.address'",
                                         "must name an address of this host"),
    "metrics port below 1024": (["metrics.port=81"], ("net_bind_service",), None, "config key 'metrics.port'",
                                "choose a metrics.port of 1024 or more"),
    "runtime dir not writable": (['service.runtime_dir="{tmp}/ro"'], NO_DAC, None, "config key 'service.runtime_dir'",
                                 "needs write access"),
    "replay dir not writable": (['replay.path="{tmp}/ro/replay"'], NO_DAC, None, "config key 'replay.path'",
                                "needs write access"),
    "replay path holds other files": (['replay.path="{tmp}/other"'], (), None, "config key 'replay.path'", "not empty"),
    "replay damaged": (['replay.path="{tmp}/replay"'], (), damaged_replay, "config key 'replay.path'",
                       "nothing there was changed"),
    "replay does not fit": (["replay.capacity=1000000"], (), None, "lower replay.capacity", "no room for a replay"),
    # a plain file where the replay's directory goes: a mistake, which read as a planted-files warning (ops review)
    "replay path is a file": (['replay.path="{tmp}/afile"'], (), lambda tmp: (tmp / "afile").write_text(""),
                              "config key 'replay.path'", "is a file, not a directory"),
    # ENOENT from mkdir under /proc: a traceback and exit 1, restarted by systemd for ever (ops review)
    "data dir where no directory can be made": (['service.data_dir="/proc/self/ingestd"'], (), None,
                                                "config key 'service.data_dir'", "makes no directories"),
}


@functools.cache
def can_drop(caps: tuple[str, ...]) -> bool:
    """Whether setpriv may drop ``caps`` here (it needs CAP_SETPCAP, which a container may lack)."""
    drop = ",".join(f"-{cap}" for cap in caps)
    return subprocess.run([SETPRIV, "--bounding-set", drop, "--inh-caps", drop, "true"],
                          capture_output=True, timeout=30).returncode == 0


def skip_reason(case: str) -> str | None:
    settings, caps, _, _, _ = CASES[case]
    if caps and AS_ROOT and SETPRIV is None:
        return "needs setpriv (util-linux) to drop root's capabilities"
    if caps and AS_ROOT and not can_drop(caps):
        return f"setpriv cannot drop {', '.join(caps)} here (no CAP_SETPCAP?)"
    if case == "metrics port below 1024" and unprivileged_port_start() <= 81:
        return "net.ipv4.ip_unprivileged_port_start lets anyone bind port 81 here"
    return None


def prefix(case: str) -> list[str]:
    """Run as root without the capabilities the case is about (none otherwise)."""
    caps = CASES[case][1]
    if not (caps and AS_ROOT):
        return []
    drop = ",".join(f"-{cap}" for cap in caps)
    return [SETPRIV, "--bounding-set", drop, "--inh-caps", drop]


@pytest.fixture(scope="module")
def startup(tmp_path_factory):
    """``{case: (exit status, stderr, its directory)}`` for every case that can run here."""
    cases, made = {}, []
    for case, (settings, _, setup, _, _) in CASES.items():
        if skip_reason(case):
            continue
        tmp = tmp_path_factory.mktemp("op")
        made.append(tmp)
        (tmp / "ro").mkdir(mode=0o555)
        (tmp / "ro").chmod(0o555)
        (tmp / "other").mkdir()
        (tmp / "other" / "notes.txt").write_text("not a replay")
        if setup is not None:
            setup(tmp)
        args = [f'service.data_dir="{tmp}/data"', f'service.runtime_dir="{tmp}/run"', "metrics.port=0",
                "workers.count=1", "workers.num_envs=4", "workers.chunk_steps=4", "replay.capacity=4096",
                *(s.replace("{tmp}", str(tmp)) for s in settings)]
        cases[case] = (prefix(case), args, no_room if case == "replay does not fit" else None, tmp)
    try:
        yield from failed_starts(cases)
    finally:
        for tmp in made:
            (tmp / "ro").chmod(0o755)


@pytest.mark.parametrize("case", CASES)
def test_startup_failure_exits_78_naming_the_key_without_a_traceback(case, startup):
    if reason := skip_reason(case):
        pytest.skip(reason)
    _, _, _, named, why = CASES[case]
    status, stderr, tmp = startup[case]
    assert status == 78, stderr
    assert named in stderr and why in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert not (tmp / "run" / "control.sock").exists(), "the control socket outlived the failed start"


def test_a_damaged_replay_is_left_as_it_was(startup):
    status, stderr, tmp = startup["replay damaged"]
    assert status == 78, stderr
    replay = tmp / "replay"
    assert sorted(p.name for p in replay.iterdir()) == ["data.bin", "meta.json"]
    assert (replay / "data.bin").read_bytes() == b"rows someone may still want" * 100
    assert (replay / "meta.json").read_text() == '{"format": "ingestd-replay", '


def test_systemd_docs_say_a_replay_too_big_for_run_fails_at_start(startup):
    """docs/systemd.md told operators that an oversized replay in /run starts and later dies
    with SIGBUS; the daemon allocates the files at creation and refuses to start (exit 78)."""
    status, stderr, _ = startup["replay does not fit"]
    assert status == 78 and "no room for a replay of 1000000 rows" in stderr, stderr
    doc = " ".join((ROOT / "docs" / "systemd.md").read_text().split())
    section = doc[doc.index("**Size `/run` for the replay.**"):doc.index("**Never put the replay under")]
    assert "SIGBUS" not in section and "sparse" not in section, section
    assert "no room for a replay of" in section and re.search(r"exits with status 78", section), section


@pytest.mark.parametrize("argv", [["run", "--bogus"], [], ["config", "check"], ["replay", "snapshot", "x"]])
def test_usage_errors_exit_64_like_ingestctl(argv):
    """EX_USAGE, which the unit does not retry (a typo in ExecStart= stays a typo), not argparse's 2."""
    done = subprocess.run([sys.executable, "-m", "ingestd.service.cli", *argv], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 64 and "usage: ingestd" in done.stderr and "error:" in done.stderr, done


# -- what a restart may fix is not a config error --------------------------------------------------
def _next_free_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


@contextlib.contextmanager
def no_free_fd():
    """Every new file descriptor fails with EMFILE (a transient shortage: a restart fixes it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_next_free_fd(), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_runtime_dir_lock_out_of_fds_is_not_a_config_error(tmp_path):
    """EMFILE (or ENOMEM, EINTR...) opening the lock is no reason to exit 78: systemd would
    never retry it. Only a directory the daemon may not write is the config's fault."""
    (tmp_path / "run").mkdir()
    with no_free_fd(), pytest.raises(OSError) as err:
        lock_runtime_dir(tmp_path / "run")
    assert not isinstance(err.value, ConfigError) and err.value.errno == errno.EMFILE, err.value


def test_a_metrics_bind_out_of_fds_is_not_blamed_on_the_address():
    """Only failures the configured address or port cause name a key; EMFILE is not one."""
    config = load_config(None, ["metrics.port=0"])
    daemon = SimpleNamespace(layout=SimpleNamespace(stats=None, storage=None, weights=None), telemetry=None,
                             started_at=0.0, supervisor=SimpleNamespace(count=0))
    exporter = MetricsExporter(config)
    try:
        with no_free_fd(), pytest.raises(OSError) as err:
            exporter.start(daemon)
        assert not isinstance(err.value, ConfigError) and err.value.errno == errno.EMFILE, err.value
    finally:
        exporter.stop()


@pytest.mark.parametrize("setting,key", [
    ('service.runtime_dir="{tmp}/a-file/run"', "service.runtime_dir"),
    ('service.data_dir="{tmp}/a-file/data"', "service.data_dir"),
    ('replay.path="{tmp}/a-file/replay"', "replay.path"),
    ('service.runtime_dir="{tmp}/' + "r" * 110 + '"', "control.address"),
])
def test_unusable_paths_are_refused_before_torch_is_imported(setting, key, tmp_path):
    """An unusable directory or socket path is found before torch's seconds of import: a
    ``torch`` that cannot be imported stands in for it here, and the start must still fail
    with exit 78 naming the key (it failed with the stand-in's ImportError)."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('torch was imported before the path checks')\n")
    (tmp_path / "a-file").write_text("")
    args = [f'service.data_dir="{tmp_path}/data"', f'service.runtime_dir="{tmp_path}/run"', "metrics.enabled=false",
            setting.replace("{tmp}", str(tmp_path))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "ingestd.service.cli", "run",
                           *[a for s in args for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 78 and key in proc.stderr, proc.stderr
    assert "torch was imported" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_sigterm_during_a_hung_start_up_probe_stops_the_daemon(tmp_path):
    """SAC review: a SIGTERM while the env's constructor hung was logged and ignored until
    systemd's SIGKILL (TimeoutStopSec later), then a restart hung again. The probe now gives way:
    exit 0 at once, and nothing created."""
    import threading
    import time

    args = [f'service.data_dir="{tmp_path}/data"', f'service.runtime_dir="{tmp_path}/run"', "metrics.enabled=false",
            'workers.env="faulty_envs:hanging_build"', "workers.start_timeout_s=0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "ingestd.service.cli", "run", *[a for s in args for a in ("--set", s)]],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    try:
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # no read blocks the test
        reader.start()
        deadline = time.monotonic() + 60
        while not any("start-up probe" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, f"no probe started: {lines}"
            time.sleep(0.05)
        time.sleep(0.5)  # inside the env's constructor now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, lines
        reader.join(10)
        assert any("stopping during start-up" in line for line in lines), lines
        assert not (tmp_path / "data" / "replay").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_replay_is_private_to_the_group_whatever_the_umask(tmp_path):
    """Operator review: the replay's directory and data files took the process's umask (with
    002, data.bin was group-writable: any trainer could overwrite rows); only the files trainers
    write may be group-writable."""
    from replay_payload import spec

    from ingestd.replay import ReplayStorage

    old = os.umask(0o002)
    try:
        with ReplayStorage.create(tmp_path / "r", spec("cartpole"), 1024):
            pass
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "r", *(tmp_path / "r").iterdir()]}
    assert modes["r"] == 0o750 and modes["data.bin"] == modes["header.bin"] == modes["meta.json"] == 0o640, modes
    assert modes["priority.bin"] == 0o660, modes  # trainers update priorities


def test_a_second_daemon_reaching_the_replay_through_a_symbolic_link_is_refused(tmp_path):
    """Operator review: the replay's lock was keyed on the path as written, so a second daemon
    on a symlink to the same replay wrote into it and numbered weights over the first's."""
    from ingestd.errors import DaemonAlreadyRunning
    from ingestd.service.instance import lock_replay

    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    fd = lock_replay(tmp_path / "real" / "replay")
    try:
        with pytest.raises(DaemonAlreadyRunning):
            lock_replay(tmp_path / "alias" / "replay")
    finally:
        os.close(fd)


STATS_NO_ROOM = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
from ingestd.collect.stats import StatsBlock
from ingestd.errors import StorageFull
try:
    StatsBlock(sys.argv[1], create=True)
except StorageFull as exc:
    print(exc)
    sys.exit(3)
"""


def test_no_room_for_the_stats_block_is_a_clear_error_naming_the_runtime_dir(tmp_path):
    """Operator review: a traceback and exit 1 (retried by systemd), where the weight store in
    the same runtime dir said what to do."""
    out = subprocess.run([sys.executable, "-c", STATS_NO_ROOM, str(tmp_path / "workers.stats")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "service.runtime_dir" in out.stdout, (out.stdout, out.stderr)


def test_a_user_outside_the_group_is_told_at_once_and_why(tmp_path, monkeypatch):
    """Operator review: ``ControlClient`` waited its whole timeout (5 s for status, 15 s for a
    pause) before saying that the socket was not writable; ``ReplayReader`` raised a bare
    PermissionError on header.bin. (Root passes every access check, so the denial is simulated.)"""
    import socket as socket_module

    from ingestd import ControlClient, DaemonUnavailable
    from ingestd.control import client as client_module
    from ingestd.replay import reader as reader_module

    path = tmp_path / "control.sock"
    with socket_module.socket(socket_module.AF_UNIX) as listener:
        listener.bind(str(path))
        monkeypatch.setattr(client_module.os, "access", lambda p, mode: str(p) != str(path))
        with ControlClient(f"ipc://{path}", timeout=30) as client, pytest.raises(DaemonUnavailable) as err:
            client.status()
    assert "was not sent" in str(err.value) and "join the daemon's group" in str(err.value), err.value

    def denied(p):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(reader_module, "file_identity", denied)
    with pytest.raises(PermissionError) as err:
        reader_module.ReplayReader(tmp_path / "replay")
    assert "trainers need read access" in str(err.value) and "group" in str(err.value), err.value
