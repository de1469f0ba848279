"""A forked worker lets go of the daemon's locks and sockets (ingestd.collect.inherited)."""
from __future__ import annotations

import fcntl
import os
import signal
import socket

from ingestd.collect.inherited import daemon_only, release_inherited


def _forked(then) -> int:
    """Fork a child that runs ``then()`` (os-level calls only: no torch in a forked child) and then
    waits for SIGKILL; returns its pid."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            then()
            os.write(ready_w, b"x")
            signal.pause()
        finally:
            os._exit(1)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    return pid


def test_a_child_drops_the_marked_locks_and_every_socket_but_keeps_other_files(tmp_path):
    lock = os.open(tmp_path / "daemon.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    daemon_only(lock)
    unmarked = os.open(tmp_path / "other.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(unmarked, fcntl.LOCK_EX | fcntl.LOCK_NB)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    results_r, results_w = os.pipe()

    def child():
        released = release_inherited()
        os.write(results_w, " ".join(map(str, released)).encode() + b"\n")
    pid = _forked(child)
    try:
        released = {int(fd) for fd in os.read(results_r, 4096).split()}
        assert lock in released and listener.fileno() in released
        assert unmarked not in released and results_w not in released and not released & {0, 1, 2}
        os.close(lock)  # the parent lets go too: with the child's copy gone, nothing holds the lock
        listener.close()
        again = os.open(tmp_path / "daemon.lock", os.O_RDWR)
        fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the child still held it
        os.close(again)
        with socket.socket() as rebound:
            rebound.bind(("127.0.0.1", port))  # EADDRINUSE if the child still listened
            rebound.listen()
        other = os.open(tmp_path / "other.lock", os.O_RDWR)
        os.close(unmarked)
        try:  # an unmarked file is the child's to keep: its copy still holds that lock
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the child let go of a file that was not marked daemon_only")
        except BlockingIOError:
            pass
        finally:
            os.close(other)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(results_r)
        os.close(results_w)
        listener.close()


def test_a_marked_descriptor_number_reused_for_another_file_is_left_alone(tmp_path):
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT)
    daemon_only(fd)
    os.close(fd)
    reused = os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT)
    results_r, results_w = os.pipe()
    try:
        assert reused == fd  # the lowest free number
        pid = _forked(lambda: os.write(results_w, b"%d\n" % (reused in release_inherited())))
        try:
            assert os.read(results_r, 16) == b"0\n"
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        os.close(reused)
        os.close(results_r)
        os.close(results_w)
