"""What a freshly forked worker lets go of: the daemon's descriptors it must not keep alive.

Workers are forked from the daemon, so they start with copies of every descriptor
the daemon has open: its lock files, its control, events and metrics sockets. So
does anything an env forks in turn (a ``multiprocessing`` pool, gymnasium's async
vector env). Such a grandchild outlives a daemon that was SIGKILLed, and with those
copies it would keep the daemon's flocks held and its listening sockets bound: a new
daemon on the same runtime dir or replay would be refused as "already running", or
could not bind its metrics port, until the grandchild exits.

So a worker, first thing, points each of them at ``/dev/null`` (``dup2``, not
``close``: the descriptor number stays taken, so a stale object of the daemon's
that closes it later cannot close a file the worker opened since):

- every file the daemon marked with :func:`daemon_only` (its lifetime flocks), if the
  descriptor still refers to that file;
- every inherited socket other than stdin, stdout and stderr (journald's stream
  socket). A worker talks to nobody over a socket; it uses shared memory only.
"""
from __future__ import annotations

import os
import stat

_DAEMON_ONLY: dict[int, tuple[int, int]] = {}  # fd -> (device, inode) of the file it had when marked


def daemon_only(fd: int) -> int:
    """Mark ``fd`` (a file the daemon holds, e.g. a lifetime flock) as one its workers drop."""
    st = os.fstat(fd)
    _DAEMON_ONLY[fd] = (st.st_dev, st.st_ino)
    return fd


def release_inherited() -> list[int]:
    """In a freshly forked worker: point the daemon's marked files and every inherited socket
    (but stdio) at ``/dev/null``. Returns the descriptors released."""
    try:
        fds = sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: only the marked files
        fds = sorted(_DAEMON_ONLY)
    released = []
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in fds:
            if fd <= 2 or fd == null:
                continue
            try:
                st = os.fstat(fd)
            except OSError:  # the listing's own descriptor, closed since
                continue
            if stat.S_ISSOCK(st.st_mode) or _DAEMON_ONLY.get(fd) == (st.st_dev, st.st_ino):
                os.dup2(null, fd, inheritable=False)
                released.append(fd)
    finally:
        os.close(null)
    return released
