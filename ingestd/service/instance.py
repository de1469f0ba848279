"""The daemon's directories and instance locks, checked and taken before the seconds of
torch's import: a config naming an unusable directory, or a second daemon on the same runtime
dir or replay, is refused at once (``ingestd run`` claims them first; ``Daemon.run`` when it
was built in-process)."""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ingestd.collect.inherited import daemon_only
from ingestd.errors import ConfigError, DaemonAlreadyRunning

NO_ACCESS = (errno.EACCES, errno.EPERM, errno.EROFS)  # a path this user cannot write
# a path no restart makes usable: no access, or under a file, too long, a symlink loop
UNUSABLE_PATH = (*NO_ACCESS, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP)


def make_dir(directory, key: str) -> None:
    """Create ``directory`` and its parents; one that cannot be created is a config error naming
    ``key`` (no restart fixes a path under a file, a read-only or a forbidden place)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True, mode=0o750)
    except FileExistsError:  # said "cannot create the directory ...: File exists" (user review)
        what = (f"is a symlink to {os.readlink(directory)}, which is no directory" if Path(directory).is_symlink()
                else "is a file, not a directory")
        raise ConfigError(key, f"{directory} {what}; move it away or choose another {key}") from None
    except OSError as exc:
        # mkdir(parents=True) that finds no parent to make it in (under /proc) is no passing state either: it
        # was re-raised, a traceback and exit 1, which systemd restarts for ever (ops review)
        if exc.errno == errno.ENOENT:
            raise ConfigError(key, f"cannot create the directory {directory}: {exc.strerror}; the file system "
                                   f"there makes no directories (e.g. /proc); choose another {key}") from None
        raise_unusable_path(key, exc, f"cannot create the directory {directory}")


def check_owned(directory, key: str) -> None:
    """A directory the daemon keeps its sockets, locks and files in must be its own: one another
    user made (``/tmp/ingestd-<uid>`` squatted before the daemon first ran) could hold links to
    files the daemon would overwrite, or a fake control socket. Refused, naming ``key``, if it
    is a link another user made, is owned by another uid than the daemon's or root's, or is
    writable by everyone."""
    euid = os.geteuid()
    try:
        link = os.lstat(directory)
        st = os.stat(directory)
    except OSError as exc:
        raise_unusable_path(key, exc, f"cannot look at {directory}")
    why = None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (euid, 0):
        why = f"is a symbolic link made by uid {link.st_uid}"
    elif not stat.S_ISDIR(st.st_mode):  # a mistake, not an intrusion (it read "another user could plant files")
        raise ConfigError(key, f"{directory} is a file, not a directory; {key} names a directory (the daemon "
                               f"makes it if it does not exist): move the file away or choose another {key}")
    elif st.st_uid not in (euid, 0):  # root's own dirs (tmpfiles.d, a mount point) are trusted
        why = f"is owned by uid {st.st_uid}, not by the daemon's uid {euid} (nor root)"
    elif st.st_mode & stat.S_IWOTH:
        why = f"is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if why is not None:
        raise ConfigError(key, f"{directory} {why}: another user could plant files or a fake control socket "
                               f"there; remove it (or fix its owner and mode), or choose another {key}")


def raise_unusable_path(key: str, exc: OSError, doing: str) -> NoReturn:
    """A config error naming ``key`` for a path no restart makes usable (``doing``: what failed);
    anything else (EMFILE, ENOMEM, ENOSPC, EINTR...) is re-raised as it is: a restart may succeed."""
    if exc.errno not in UNUSABLE_PATH:
        raise exc
    hint = (f"the daemon (uid {os.getuid()}) needs write access there: fix the owner or mode, or choose "
            f"another {key}" if exc.errno in NO_ACCESS else f"choose another {key}")
    raise ConfigError(key, f"{doing}: {exc.strerror or exc}; {hint}") from None

@dataclass(frozen=True)
class Claim:
    """The flocks one daemon holds for its lifetime (closed with the process)."""

    runtime: int  # <runtime_dir>/ingestd.lock
    replay: int  # <replay>.lock


def claim_instance(paths) -> Claim:
    """Make and check the runtime and data dirs and take the daemon's instance locks, in the
    order whose first failure names the right key."""
    runtime = lock_runtime_dir(paths.runtime_dir, paths.control)
    make_dir(paths.data_dir, "service.data_dir")  # first: a data dir that cannot be made is named as such
    check_owned(paths.data_dir, "service.data_dir")
    return Claim(runtime, lock_replay(paths.replay))


def lock_runtime_dir(runtime_dir, control: str = "") -> int:
    """Hold an exclusive flock on ``<runtime_dir>/ingestd.lock`` for the daemon's lifetime, so a
    second daemon on the same runtime dir refuses to start instead of clobbering the first.

    A lock file deleted under a running daemon (``systemd-tmpfiles`` ageing ``/tmp``, an operator
    tidying up) would let a second one lock a new file and then overwrite the first one's weight
    store and stats block: a daemon answering on the control socket (``control``, an ipc address)
    is refused too, before anything is touched."""
    from ingestd.control.protocol import socket_file
    from ingestd.control.sockets import answering

    make_dir(runtime_dir, "service.runtime_dir")
    check_owned(runtime_dir, "service.runtime_dir")  # before anything in it is opened
    lock = Path(runtime_dir) / "ingestd.lock"
    fd = _hold(lock, "service.runtime_dir", f"another ingestd daemon is running with runtime dir {runtime_dir}; "
                                           "stop it first, or give this one its own service.runtime_dir")
    path = socket_file(control)
    if path is not None and answering(path):
        os.close(fd)
        raise DaemonAlreadyRunning(f"a daemon answers on {path}, although nothing held {lock} (the lock file was "
                                   "deleted while it ran?); stop that daemon first (`ingestctl --connect "
                                   f"ipc://{path} ping` gives its pid)")
    return fd


def lock_replay(replay) -> int:
    """Hold an exclusive flock on ``<replay>.lock`` (beside the replay directory) for the daemon's
    lifetime: two daemons writing one replay (other runtime dirs, the same ``replay.path``) would
    recover slots the other is writing, number weights over each other and stamp the same worker
    indices. Taken before the replay is opened."""
    make_dir(Path(replay).parent, "replay.path")
    # keyed on the resolved path: a second daemon reaching the replay through a symbolic link
    # wrote into it too, numbering weights over the first's (a bind mount is not caught)
    replay = os.path.realpath(replay)
    return _hold(Path(f"{replay}.lock"), "replay.path",
                 f"another ingestd daemon writes the replay {replay}; stop it, or give this one its own "
                 "replay.path (trainers can read a replay any daemon writes)")


def _hold(lock: Path, key: str, busy: str) -> int:
    import fcntl

    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    except OSError as exc:
        raise_unusable_path(key, exc, f"cannot open {lock}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonAlreadyRunning(busy) from None
    return daemon_only(fd)  # a worker's forked children must not keep the lock alive (collect.inherited)
