"""Daemons for the tests, forked from one process that has already imported them.

A daemon spends ~4.5 s of its start-up importing torch and tensordict on a 2-core machine,
and the suite starts about a hundred. The fork server imports ``ingestd.service.daemon``
(torch and tensordict with it) once per session; each ``launch`` forks it and runs
``ingestd.service.cli.main`` in the child with the caller's argv, environment, directory,
umask and stdout/stderr, which saves those seconds per daemon. What follows ``main()`` is the code
``ingestd run`` runs: the daemon then forks its workers as it always does. What a fork does
not redo is the interpreter's start: ``PYTHONPATH`` is applied to ``sys.path`` by hand, and
variables read while torch loads (``OMP_NUM_THREADS``, say) do not apply, so such tests,
and those of the start-up itself, exec (``DaemonProc(launch="exec")``); ``INGESTD_TEST_LAUNCH
=exec`` makes every daemon exec.

The server is single-threaded (a fork copies only the forking thread): a select loop that
accepts launches, reaps children with ``waitpid`` and sends each exit status to the client
that launched it. A client that goes away takes its daemon with it (SIGKILL by PID); when the
server is told to stop, it kills the children it still has, by PID. Run as a script, this file
is the server: ``python forkserver.py SOCKET``.
"""
from __future__ import annotations

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


# -- client ---------------------------------------------------------------------------------------
class ForkedProc:
    """The ``subprocess.Popen`` surface the tests use (pid, poll, wait, send_signal, terminate,
    kill, returncode) for a process the fork server started: its exit status arrives on
    ``conn``."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]):
        self._conn, self.pid, self.args, self.returncode = conn, pid, args, None
        self._buffer = b""
        self.stderr_fd: int | None = None  # the read end of its stderr, if a pipe: communicate() reads it

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
            if not data:
                raise RuntimeError(f"the fork server went away before daemon {self.pid} exited")
            self._buffer += data
        self.returncode = int(json.loads(self._buffer.split(b"\n", 1)[0])["exit"])
        self._conn.close()


class ForkServer:
    """The session's fork server: started on the first ``launch``, stopped by ``close``."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._root: Path | None = None

    def launch(self, argv: list[str], env: dict, cwd: str, stdout: int, stderr: int) -> ForkedProc:
        """Run ``ingestd.service.cli.main(argv)`` in a fork of the server."""
        path = self._started()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            umask = os.umask(0o077)  # (read it: os.umask only sets) the child's, as exec would inherit it
            os.umask(umask)
            body = json.dumps({"argv": argv, "env": env, "cwd": cwd, "umask": umask}).encode()
            socket.send_fds(conn, [_HEADER.pack(len(body)) + body], [stdout, stderr])
            reply = b""
            while not reply.endswith(b"\n"):
                data = conn.recv(4096)
                if not data:
                    raise RuntimeError("the fork server closed the connection without starting the daemon")
                reply += data
        except BaseException:
            conn.close()
            raise
        return ForkedProc(conn, int(json.loads(reply)["pid"]), argv)

    def _started(self) -> str:
        if self._proc is not None and self._proc.poll() is None:
            return str(self._root / "fork.sock")
        self.close()
        self._root = Path(tempfile.mkdtemp(prefix="ingestd-fs-", dir="/dev/shm"))
        path = str(self._root / "fork.sock")
        self._proc = subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE)
        line = self._proc.stdout.readline()  # "ready" once it has imported and listens
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the fork server did not start (said {line!r})")
        return path

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()  # it kills its children by PID, then exits
                try:
                    self._proc.wait(30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(10)
            self._proc.stdout.close()
            self._proc = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


SERVER = ForkServer()


# -- server ---------------------------------------------------------------------------------------
def serve(path: str) -> None:
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
            ready, _, _ = select.select([listener, *children.values()], [], [], 0.05)
        except InterruptedError:
            continue
        for sock in ready:
            if sock is listener:
                _accept(listener, children)
            elif not _peek(sock):  # its client went away: so does its daemon
                _kill(next(pid for pid, conn in children.items() if conn is sock))
        _reap(children)
    for pid in list(children):
        _kill(pid)
    while children:
        _reap(children, block=True)


def _accept(listener: socket.socket, children: dict) -> None:
    conn, _ = listener.accept()
    try:
        head, fds, _, _ = socket.recv_fds(conn, 1 << 16, _FDS)
        (size,), body = _HEADER.unpack(head[:_HEADER.size]), head[_HEADER.size:]
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise ConnectionError("the client went away mid-request")
            body += more
        request = json.loads(body)
    except (OSError, ValueError, struct.error) as exc:
        print(f"forkserver: bad launch request: {exc}", file=sys.stderr)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request, fds, [listener, conn, *children.values()])
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _child(request: dict, fds: list[int], sockets: list[socket.socket]) -> None:
    """The daemon: never returns."""
    code = 1
    try:
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
        from ingestd.service.cli import main

        code = main(request["argv"])
    except SystemExit as exc:  # argparse, and sys.exit anywhere below main
        code = exc.code if isinstance(exc.code, int) else 1
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if isinstance(code, int) else 1)


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
    serve(sys.argv[1])
