"""The daemon's open-file limit: raised at start, watched while it runs.

Every control connection, worker pipe, mapped file and lock is a descriptor. At the
limit libzmq aborts the whole process on the ipc listener's failed ``accept`` (an
assertion in libzmq 4.3, not an error we can catch): 1,100 idle ``ingestctl``
connections killed a daemon started under the usual soft limit of 1024 (exhaustion
review). So ``ingestd run`` raises its soft limit to the hard one (systemd's unit sets
both with ``LimitNOFILE=``), and the control thread warns once the daemon uses most of it.
"""
from __future__ import annotations

import errno
import logging
import os
import resource

log = logging.getLogger("ingestd.daemon")

CEILING = 1 << 20  # the kernel's default nr_open: the most a soft limit can be when the hard one is unlimited
WARN_FRACTION = 0.8  # descriptors in use past this share of the soft limit are warned about


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most :data:`CEILING`); returns the
    soft limit in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a kernel with a lower nr_open: keep what we have
            log.debug("could not raise the open-file limit to %d: %s", target, exc)
    return soft


def fds_in_use() -> int | None:
    """Descriptors this process has open (None where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # (the listing's own)
    except OSError:
        return None


class FdWatch:
    """Warns once each time descriptor use crosses :data:`WARN_FRACTION` of the soft limit."""

    def __init__(self) -> None:
        self.warned = False

    def check(self) -> None:
        used, (soft, _) = fds_in_use(), resource.getrlimit(resource.RLIMIT_NOFILE)
        if used is None or soft == resource.RLIM_INFINITY:
            return
        high = used >= WARN_FRACTION * soft
        if high and not self.warned:
            log.warning("%d of the %d file descriptors this daemon may open are in use (control connections? "
                        "`ls -l /proc/%d/fd`); at the limit libzmq aborts the daemon: raise LimitNOFILE in the "
                        "unit (or `ulimit -n`), or close idle clients", used, soft, os.getpid())
        self.warned = high


def out_of_fds(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is EMFILE (an
    env's own "could not start the simulator" wraps the OSError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__suppress_context__ else (exc.__cause__ or exc.__context__)  # (from None: cut)
    return False


def attach_out_of_fds(path, exc: BaseException) -> OSError | None:
    """What a ``ReplayReader`` that could not attach to ``path`` raises instead of ``exc`` when it
    ran out of descriptors (a bare errno 24 from the limiter's file said nothing of the cause);
    None otherwise (a KeyboardInterrupt is never turned into this)."""
    if not (isinstance(exc, Exception) and out_of_fds(exc)):
        return None
    return OSError(errno.EMFILE, f"{os.strerror(errno.EMFILE)}: cannot attach a reader to {path}"
                   + fd_hint("this process") + "; every open reader holds a few: close() the readers you no "
                   "longer use (or open them in a with block)", getattr(exc, "filename", None))


def fd_hint(what: str) -> str:
    """What to say when ``what`` ran out of descriptors (EMFILE), with the limit in effect."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f" ({what} is out of file descriptors: its limit is {soft}; raise LimitNOFILE in the unit or "
            "`ulimit -n`)")
