"""Signals that arrive before the daemon's own handlers are in place.

``ingestd run`` spends seconds importing torch before ``Daemon.run`` installs
its handlers. SIGHUP's default action would kill it meanwhile (systemd's
reload, or an operator's ``kill -HUP``), so :func:`catch_early_sighup` is the
first thing ``run`` does (after ``ingestd.service.tunables``' exec, which blocks SIGHUP
across it): a SIGHUP then only sets :data:`EARLY_SIGHUP`, and the daemon reloads once
it runs (the config file may have changed after it was read).
"""
from __future__ import annotations

import signal
import threading

EARLY_SIGHUP = threading.Event()


def catch_early_sighup() -> None:
    signal.signal(signal.SIGHUP, lambda signum, frame: EARLY_SIGHUP.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # blocked across the tunables' exec
