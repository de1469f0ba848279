"""Signals that arrive before the daemon's own handlers are in place.

``ingestd run`` spends seconds importing torch before ``Daemon.run`` installs
its handlers. SIGHUP's default action would kill it meanwhile (systemd's
reload, or an operator's ``kill -HUP``), so :func:`catch_early_sighup` is the
first thing ``run`` does (after ``ingestd.service.tunables``' exec, which blocks SIGHUP
across it): a SIGHUP then only sets :data:`EARLY_SIGHUP`, and the daemon reloads once
it runs (the config file may have changed after it was read).

:func:`kept_signals` keeps plug-in code (an env or policy module, factory, first
reset) from taking over SIGTERM, SIGINT, SIGHUP, SIGCHLD and SIGPIPE: simulator and client
libraries install their own handlers as they load, and one that ignored SIGTERM
in the daemon's start-up probe left a daemon that ``systemctl stop`` could only
SIGKILL (chaos review).
"""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

EARLY_SIGHUP = threading.Event()
# how ingestd processes stop, are stopped and reload; how the daemon learns its workers died
# (SIGCHLD ignored: the kernel reaps them, and waitpid fails); SIGPIPE as Python sets it (ignored:
# a client gone mid-reply is EPIPE, not the daemon's death)
KEPT = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE)
log = logging.getLogger("ingestd.service")


def catch_early_sighup() -> None:
    signal.signal(signal.SIGHUP, lambda signum, frame: EARLY_SIGHUP.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # blocked across the tunables' exec


@contextmanager
def kept_signals(who: str, signals: tuple = KEPT) -> Iterator[None]:
    """Run the block (plug-in code: ``who`` names it in the log) and put back how this process
    handled each signal of :data:`KEPT` before it, saying which ones the block had changed.

    Every one of them is set again afterwards, changed or not: a native library's own
    ``sigaction()`` is invisible to Python's ``signal.getsignal`` (diff review), so changes are
    also read off the kernel's masks (``/proc/self/status``). A signal whose handler Python did
    not set (a C handler from before the interpreter started: ``getsignal`` gives None) is left
    alone. Outside the main thread (where no handler can be set) the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in signals}
    masks = _masks()
    try:
        yield
    finally:
        after = _masks()
        changed = [signum for signum, handler in before.items() if handler is not None and (
            signal.getsignal(signum) != handler or _mask_bits(after, signum) != _mask_bits(masks, signum))]
        for signum, handler in before.items():
            if handler is not None:
                signal.signal(signum, handler)
        if changed:
            log.warning("%s changed how this process handles %s; ingestd put its own handling back (the daemon "
                        "stops on SIGTERM and SIGINT, reloads on SIGHUP and reaps its workers on SIGCHLD; workers "
                        "ignore SIGINT and SIGHUP; SIGPIPE stays ignored). A library's own handlers for these "
                        "signals do not run under ingestd", who, ", ".join(signal.Signals(s).name for s in changed))


def _masks() -> dict[str, int]:
    """The kernel's ignored and caught signal masks of this process (empty off Linux)."""
    try:
        with open("/proc/self/status") as status:
            return {line[:6]: int(line.split()[1], 16) for line in status if line.startswith(("SigIgn", "SigCgt"))}
    except (OSError, ValueError, IndexError):
        return {}


def _mask_bits(masks: dict[str, int], signum: int) -> tuple[bool, ...]:
    return tuple(bool(mask >> (signum - 1) & 1) for _, mask in sorted(masks.items()))
