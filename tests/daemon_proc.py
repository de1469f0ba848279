"""A real ``ingestd run`` in a subprocess, for end-to-end tests.

Every directory lives under /dev/shm (short paths for ipc:// sockets) and
is removed on close; every process the daemon started is found through
/proc and killed by PID if it outlives the daemon.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forkserver import SERVER

# variables read as the interpreter starts or as torch and its libraries load (forkserver): a
# daemon whose environment differs from the fork server's in one of these execs. Others (what
# ingestd, sd_notify or pytest read at run time, and what libraries put into os.environ as they
# import: TORCHINDUCTOR_CACHE_DIR, PYGAME_HIDE_SUPPORT_PROMPT) do not matter; PYTHONPATH is applied
_LOAD_TIME_ENV = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "TORCH", "PYTORCH_",
                  "CUDA_", "NCCL_", "GLIBC_")
_RUN_TIME_ENV = frozenset(("PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR"))

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """PIDs of the live children of ``pid`` (via /proc/PID/task/*/children; a thread that exits
    while this reads is skipped, not an error)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process is gone (or exits while this lists its threads)
        return []
    found = []
    for task in tasks:
        try:
            found.extend(int(k) for k in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except OSError:
            continue
    return found


def environ_of(pid: int) -> list[str]:
    """``KEY=VALUE`` items of the environment process ``pid`` started with (``/proc/PID/environ``)."""
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid``."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found.extend(kids)
        todo.extend(kids)
    return found


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def failed_starts(cases: dict, env: dict | None = None, at_once: int = 4, timeout: float = 600.0):
    """Run every ``ingestd run`` of ``cases`` (``{case: (argv prefix, settings, preexec_fn, tmp)}``,
    settings as for ``--set``), ``at_once`` at a time (an exec'd one imports torch: seconds of
    CPU and ~300 MB; all of them at once would crowd a small machine; a case without a prefix or
    a preexec_fn is forked from the fork server), and return ``{case: (exit status, stderr,
    tmp)}``. A generator for a fixture: whatever still runs when it ends is killed by PID."""
    env = {**os.environ, **(env or {})}
    procs, results = {}, {}
    items = list(cases.items())
    try:
        for first in range(0, len(items), at_once):
            batch = items[first:first + at_once]
            for case, (prefix, settings, preexec, tmp) in batch:
                args = ["run", *(a for setting in settings for a in ("--set", setting))]
                if not prefix and preexec is None and forkable(env):
                    procs[case] = forked_with_stderr(args, env)
                    continue
                procs[case] = subprocess.Popen([*prefix, sys.executable, "-m", "ingestd.service.cli", *args],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                               env=env, preexec_fn=preexec)
            for case, (_, _, _, tmp) in batch:
                # communicate, not wait: a child blocked on a full stderr pipe would never exit
                stderr = procs[case].communicate(timeout=timeout)[1]
                results[case] = (procs[case].returncode, stderr, tmp)
        yield results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def forkable(env: dict) -> bool:
    """Whether a daemon with the environment ``env`` can be forked from the fork server: none of
    the variables in which it differs from the server's is read only as a process loads."""
    if os.environ.get("INGESTD_TEST_LAUNCH", "fork") == "exec":
        return False
    differs = {k for k, v in env.items() if SERVER.base_env.get(k) != v}
    differs |= set(SERVER.base_env) - set(env)
    return not any(k.startswith(_LOAD_TIME_ENV) for k in differs - _RUN_TIME_ENV)


def forked_with_stderr(args: list[str], env: dict, stdout: int | None = None):
    """A forked ``ingestd`` whose stderr ``communicate()`` returns; its stdout goes to the
    descriptor ``stdout`` (closed here once the child has it), else to /dev/null."""
    read, write = os.pipe()
    out = os.open(os.devnull, os.O_WRONLY) if stdout is None else stdout
    try:
        proc = SERVER.launch(args, env, os.getcwd(), out, write)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
        os.close(out)
    proc.stderr_fd = read
    return proc


class Started:
    """``with X(...) as x``: ``start()`` on entry, ``close()`` on exit, and also when ``start()``
    fails (``__exit__`` is not called then: the process's directory would stay in /dev/shm)."""

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


class DaemonProc(Started):
    """``with DaemonProc(overrides={...}) as d: d.wait_ready()``.

    ``launch="fork"`` (the default) forks the daemon from the session's fork server, which has
    imported torch already (tests/forkserver.py); ``"exec"`` runs ``python -m ingestd.service.cli
    run`` as a user does, for the tests of the start-up itself. ``INGESTD_TEST_LAUNCH=exec`` in
    the environment makes every daemon exec."""

    def __init__(self, overrides: dict | None = None, config_text: str = "", notify: bool = False,
                 env: dict | None = None, launch: str = "fork"):
        self.root = Path(tempfile.mkdtemp(prefix="ingestd-t-", dir="/dev/shm"))
        self.data_dir, self.runtime_dir = self.root / "data", self.root / "run"
        self.metrics_port = free_port()
        settings = {"service.data_dir": str(self.data_dir), "service.runtime_dir": str(self.runtime_dir),
                    "metrics.port": self.metrics_port, "workers.num_envs": 8, "workers.chunk_steps": 8,
                    "replay.capacity": 100_000}
        settings.update(overrides or {})
        self.overrides = settings
        self.config_path = self.root / "ingestd.toml"
        self.config_path.write_text(config_text)
        self.log_path = self.root / "daemon.log"
        self.notify_sock = None
        self.extra_env = dict(env or {})
        if notify:
            self.notify_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.notify_sock.bind(str(self.root / "notify.sock"))
            self.notify_sock.settimeout(0.1)
        self.messages: list[str] = []
        self.launch = launch
        self.proc: subprocess.Popen | None = None
        self.known_children: set[int] = set()

    # -- paths ------------------------------------------------------------------------
    @property
    def replay_path(self) -> Path:
        return Path(self.overrides.get("replay.path") or self.data_dir / "replay")

    @property
    def control_address(self) -> str:
        return self.overrides.get("control.address") or f"ipc://{self.runtime_dir}/control.sock"

    def run_args(self) -> list[str]:
        """``ingestd``'s arguments: ``run --config FILE --set KEY=VALUE ...``."""
        args = ["run", "--config", str(self.config_path)]
        for key, value in self.overrides.items():
            args += ["--set", f"{key}={_toml(value)}"]
        return args

    def args(self) -> list[str]:
        """The command an exec'd daemon runs."""
        return [sys.executable, "-m", "ingestd.service.cli", *self.run_args()]

    # -- lifecycle --------------------------------------------------------------------
    def env(self) -> dict:
        """The daemon's environment: this process's, without its sd_notify variables, plus ours."""
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        if self.notify_sock is not None:
            env["NOTIFY_SOCKET"] = str(self.root / "notify.sock")
        env.update(self.extra_env)
        return env

    def start(self) -> "DaemonProc":
        env = self.env()
        self._log = open(self.log_path, "wb")
        if self.forked():
            self.proc = SERVER.launch(self.run_args(), env, os.getcwd(), self._log.fileno(), self._log.fileno())
        else:
            self.proc = subprocess.Popen(self.args(), stdout=self._log, stderr=subprocess.STDOUT, env=env)
        return self

    def forked(self) -> bool:
        """Whether ``start`` forks the daemon from the fork server (else it execs it)."""
        return self.launch == "fork" and forkable(self.env())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def recv_notify(self, timeout: float) -> list[str]:
        """Collect sd_notify messages for up to ``timeout`` seconds (all so far are in .messages)."""
        deadline = time.monotonic() + timeout
        got = []
        while time.monotonic() < deadline:
            try:
                got.append(self.notify_sock.recv(4096).decode())
            except socket.timeout:
                continue
        self.messages.extend(got)
        return got

    def wait_notify(self, needle: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self.recv_notify(0.1):
                if needle in msg:
                    return msg
            self._check_alive()
        raise TimeoutError(f"no sd_notify message containing {needle!r} in {timeout} s; log:\n{self.log()}")

    def wait_ready(self, timeout: float = 60.0, rows: int = 1) -> None:
        """Until the replay holds ``rows`` committed rows."""
        from ingestd.replay import ReplayReader

        deadline = time.monotonic() + timeout
        reader = None
        while time.monotonic() < deadline:
            self._check_alive()
            self.remember_children()
            if reader is None and (self.replay_path / "meta.json").exists():
                try:
                    reader = ReplayReader(self.replay_path)
                except Exception:
                    reader = None
            if reader is not None and reader.write_count >= rows:
                reader.close()
                return
            time.sleep(0.05)
        raise TimeoutError(f"daemon wrote fewer than {rows} rows in {timeout} s; log:\n{self.log()}")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {self.proc.returncode}; log:\n{self.log()}")

    def remember_children(self) -> set[int]:
        if self.proc is not None and self.proc.poll() is None:
            self.known_children.update(descendants(self.proc.pid))
        return self.known_children

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        self.remember_children()
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        try:
            if self.proc is not None:
                self.remember_children()
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait(10)
        finally:  # the directory and the known children go even if the daemon could not be waited for
            for pid in self.known_children:
                if pid_alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if getattr(self, "_log", None) is not None:
                self._log.close()
            if self.notify_sock is not None:
                self.notify_sock.close()
            shutil.rmtree(self.root, ignore_errors=True)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
