"""Large copies past the caches: glibc's non-temporal threshold, for ``ingestd run``.

A worker's large copies are image batches going into the replay's ring (1.8 MB a step
for Pixels), which it never reads back. glibc's ``memcpy`` writes copies above
``glibc.cpu.x86_non_temporal_threshold`` with non-temporal stores, which do not fill
the caches; its default (about three quarters of the L3 a thread shares) is past those
copies, so they evicted the env's and policy's working set. With the threshold at
64 KiB a Pixels chunk was stored 1.06-1.26x as fast on an AMD EPYC VM and 1.18-1.59x on
an Intel Xeon VM (docs/systemd.md, "Copy speed": on that AMD machine glibc 2.36 streams
the copies past its ``rep movsb`` limit, 1 MiB; on Intel, every copy from 64 KiB).

A tunable is read only as a process starts, so ``ingestd`` (its console script, or
``python -m ingestd.service.cli``) execs itself once for ``run`` with it set (same PID,
same command line; ``entry``) unless the process started with the threshold set,
to this value or any other (the systemd unit sets it in ``Environment=``; a user's own
value is kept). It applies to glibc on x86-64 Linux; elsewhere nothing is done.
"""
from __future__ import annotations

import os
import signal
import sys

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
THRESHOLD = "0x10000"  # 64 KiB: an image batch is streamed, the small leaves' copies are not


def with_copy_tunable(tunables: str) -> str:
    """``GLIBC_TUNABLES`` with the threshold added, unless it names the threshold already."""
    if _names_threshold(tunables):
        return tunables
    return ":".join(filter(None, (tunables, f"{TUNABLE}={THRESHOLD}")))


def applies() -> bool:
    """Whether this process runs glibc 2.29 or later on x86-64 Linux, where the tunable has this
    name (2.26-2.28 spelled it glibc.tune.*, and older releases have no tunables)."""
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        return False
    try:  # (musl has no such name: ValueError)
        name, _, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").partition(" ")
        return name == "glibc" and tuple(int(part) for part in version.split(".")[:2]) >= (2, 29)
    except (ValueError, OSError):
        return False


def started_with_threshold() -> bool | None:
    """Whether this process's environment *at its start* (``/proc/self/environ``, not
    ``os.environ``) set the threshold; None if that cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as f:
            initial = f.read().split(b"\0")
    except OSError:
        return None
    return any(item.startswith(b"GLIBC_TUNABLES=") and _names_threshold(item[15:].decode(errors="replace"))
               for item in initial)


def exec_with_copy_tunable() -> None:
    """Exec this process again, the same command line, with the threshold in its
    environment: once at most (the new image started with it), and only where it applies.

    SIGHUP is blocked across the exec (a blocked signal stays pending through it):
    ``catch_early_sighup`` unblocks it once its handler is in place, so a reload asked for
    meanwhile is kept, not the default action's exit. An exec that fails (no interpreter
    path, a security profile) leaves the process as it was, without the tunable."""
    if not applies() or not sys.executable or started_with_threshold() is not False:
        return
    before = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = with_copy_tunable(before or "")
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if before is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = before


def _names_threshold(tunables: str) -> bool:
    return any(item.partition("=")[0] == TUNABLE for item in tunables.split(":"))
