"""Daemons for the tests, forked from one process that has already imported them.

A daemon spends ~4.5 s of its start-up importing torch and tensordict on a 2-core machine,
and the suite starts about a hundred. The fork server imports ``ingestd.service.daemon``
(torch and tensordict with it) once per session; each ``launch`` forks it and runs
``ingestd.service.cli.main`` in the child with the caller's argv, environment, directory,
umask and stdout/stderr, which saves those seconds per daemon. What follows ``main()`` is
the code ``ingestd run`` runs, and the child leaves through ``sys.exit`` as an exec'd
interpreter does (atexit handlers, multiprocessing's join of its children, logging's
flush). What a fork does not redo is the interpreter's start: ``PYTHONPATH`` is applied to
``sys.path`` by hand, and variables read while torch loads (``OMP_NUM_THREADS``, say) do
not apply, so tests setting such variables, and those of the start-up itself, exec
(``DaemonProc(launch="exec")``); ``INGESTD_TEST_LAUNCH=exec`` makes every daemon exec.

The server is single-threaded (a fork copies only the forking thread): a select loop that
accepts launches, reaps children with ``waitpid`` and sends each exit status to the client
that launched it. A client that goes away takes its daemon with it (SIGKILL by PID), and so
does the server (each child's PDEATHSIG); the server stops when told to, or when its stdin
(a pipe from pytest) closes, and kills the children it still has, by PID. Run as a script,
this file is the server: ``python forkserver.py SOCKET``.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HEADER = struct.Struct("!I")
_FDS = 2  # the child's stdout and stderr (its stdin is /dev/null)
_REQUEST_TIMEOUT_S = 5.0  # a client that connects and then says nothing does not hold the server
_PR_SET_PDEATHSIG = 1


# -- client ---------------------------------------------------------------------------------------
class ForkedProc:
    """The ``subprocess.Popen`` surface the tests use (pid, poll, wait, communicate,
    send_signal, terminate, kill, returncode) for a process the fork server started: its
    exit status arrives as a line on ``conn``."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], buffered: bytes = b""):
        self._conn, self.pid, self.args, self.returncode = conn, pid, args, None
        self._buffer = buffered  # what arrived with the pid line (the exit line of a quick child)
        self.stderr_fd: int | None = None  # the read end of its stderr, if a pipe: communicate() reads it

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str | None]:
        """As ``Popen.communicate`` with only stderr piped: its text once it closes, after the exit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stderr_fd is None:
            self.wait(timeout)
            return None, None
        chunks = []
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([self.stderr_fd], [], [], left)[0]:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                chunk = os.read(self.stderr_fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self.stderr_fd)
            self.stderr_fd = None
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return None, b"".join(chunks).decode(errors="replace")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> None:
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
            data = self._conn.recv(4096)
            if not data:  # the server died (its PDEATHSIG has killed the child): the status is lost
                _kill(self.pid)
                self.returncode = -signal.SIGKILL
                self._conn.close()
                return
            self._buffer += data
        self.returncode = int(json.loads(self._buffer.split(b"\n", 1)[0])["exit"])
        self._conn.close()


class ForkServer:
    """The session's fork server: started on the first ``launch``, stopped by ``close``.

    ``base_env`` is the environment it starts with (the session's, when conftest makes it):
    what a forked daemon cannot change is compared with it (``daemon_proc.forkable``)."""

    def __init__(self):
        self.base_env = dict(os.environ)
        self._proc: subprocess.Popen | None = None
        self._root: Path | None = None

    def launch(self, argv: list[str], env: dict, cwd: str, stdout: int, stderr: int) -> ForkedProc:
        """Run ``ingestd.service.cli.main(argv)`` in a fork of the server."""
        path = self._started()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(60.0)  # a server that cannot answer fails the test, rather than hang the suite
            conn.connect(path)
            umask = _umask()  # the child's, as exec would inherit it
            body = json.dumps({"argv": argv, "env": env, "cwd": cwd, "umask": umask}).encode()
            socket.send_fds(conn, [_HEADER.pack(len(body)) + body], [stdout, stderr])
            reply = b""
            while b"\n" not in reply:
                data = conn.recv(4096)
                if not data:
                    raise RuntimeError(f"the fork server did not start the daemon; its log:\n{self.log()}")
                reply += data
        except BaseException:
            conn.close()
            raise
        conn.settimeout(None)
        line, rest = reply.split(b"\n", 1)
        return ForkedProc(conn, int(json.loads(line)["pid"]), argv, rest)

    def log(self) -> str:
        path = self._root / "server.log" if self._root is not None else None
        return path.read_text(errors="replace") if path is not None and path.exists() else ""

    def _started(self) -> str:
        if self._proc is not None and self._proc.poll() is None:
            return str(self._root / "fork.sock")
        self.close()
        self._root = Path(tempfile.mkdtemp(prefix="ingestd-fs-", dir="/dev/shm"))
        path = str(self._root / "fork.sock")
        with open(self._root / "server.log", "wb") as log:
            self._proc = subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, env=self.base_env)
        # "ready" once it has imported and listens (a server hung in its imports fails the test)
        started = select.select([self._proc.stdout], [], [], 120.0)[0]
        line = self._proc.stdout.readline() if started else b"(nothing in 120 s)"
        if line.strip() != b"ready":
            said = self.log()
            self.close()
            raise RuntimeError(f"the fork server did not start (said {line!r}); its log:\n{said}")
        return path

    def close(self) -> None:
        proc, root, self._proc, self._root = self._proc, self._root, None, None
        try:
            if proc is not None and proc.poll() is None:
                proc.terminate()  # it kills its children by PID, then exits
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        finally:
            if proc is not None:
                proc.stdin.close()
                proc.stdout.close()
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)


SERVER = ForkServer()


# -- server ---------------------------------------------------------------------------------------
class _ChildExit(Exception):
    """Raised in a forked child to leave the server's stack; ``__main__`` exits with ``code``."""

    def __init__(self, code):
        self.code = code


def serve(path: str) -> None:
    # sys.path as `python -m` in the same directory has it: the tree under test, not the
    # editable install's (nor tests/, which the plugins reach only through PYTHONPATH)
    sys.path[0] = os.getcwd()
    import ingestd.service.cli  # noqa: F401  (what every daemon imports: done once, here)
    import ingestd.service.daemon  # noqa: F401

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the daemons; pytest stops the server
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}  # pid -> the connection of the client that launched it
    while not stopping:
        try:
            ready, _, _ = select.select([listener, sys.stdin, *children.values()], [], [], 0.05)
        except InterruptedError:
            continue
        for sock in ready:
            if sock is listener:
                _accept(listener, children)
            elif sock is sys.stdin:
                stopping.append(True)  # pytest is gone (its end of the pipe closed)
            elif not _peek(sock):  # its client went away: so does its daemon
                _kill(next(pid for pid, conn in children.items() if conn is sock))
        _reap(children)
    for pid in list(children):
        _kill(pid)
    while children:
        _reap(children, block=True)
    shutil.rmtree(Path(path).parent, ignore_errors=True)  # (a pytest killed outright does not remove it)


def _accept(listener: socket.socket, children: dict) -> None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(_REQUEST_TIMEOUT_S)
        head, fds, _, _ = socket.recv_fds(conn, 1 << 16, _FDS)
        (size,), body = _HEADER.unpack(head[:_HEADER.size]), head[_HEADER.size:]
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise ConnectionError("the client went away mid-request")
            body += more
        request = json.loads(body)
        if len(fds) != _FDS:
            raise ValueError(f"{len(fds)} descriptors, not {_FDS}")
        conn.settimeout(None)
    except (OSError, ValueError, struct.error) as exc:
        print(f"forkserver: bad launch request: {exc}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        print(f"forkserver: fork failed: {exc}", file=sys.stderr, flush=True)
        pid = None
    if pid == 0:
        _child(request, fds, [listener, conn, *children.values()], server)
    for fd in fds:
        os.close(fd)
    if pid is None:
        conn.close()  # the client's launch says the server did not start the daemon
        return
    children[pid] = conn
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:  # the client left mid-launch: its daemon goes too (reaped with the others)
        _kill(pid)


def _child(request: dict, fds: list[int], sockets: list[socket.socket], server: int) -> None:
    """The daemon: leaves only by raising (``_ChildExit`` with main's status, or what main raised)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the server
    if os.getppid() != server:  # the server died before that took effect
        os._exit(1)
    for sock in sockets:
        sock.close()
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), *zip(fds, (1, 2))):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    # sys.path as `python -m` would make it: the directory it ran in, then PYTHONPATH
    sys.path[0] = os.getcwd()
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.argv = ["ingestd", *request["argv"]]
    from ingestd.service.cli import exit_now, main

    try:
        code = main(request["argv"])
    except SystemExit as exc:  # argparse, and sys.exit anywhere below main
        raise _ChildExit(exc.code) from None
    if request["argv"][:1] == ["run"]:
        exit_now(code)  # as `ingestd run` ends (cli.entry)
    raise _ChildExit(code)


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` can only swap it)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)


def _peek(conn: socket.socket) -> bool:
    """Whether the client is still there (it never sends after its request)."""
    try:
        return conn.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(children: dict, block: bool = False) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()
        if block:
            return


if __name__ == "__main__":
    try:
        serve(sys.argv[1])
    except _ChildExit as exit_:  # a forked daemon's main returned: exit as its interpreter would
        sys.exit(exit_.code)
