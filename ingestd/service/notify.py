"""sd_notify without a library: one AF_UNIX datagram per message to $NOTIFY_SOCKET."""
from __future__ import annotations

import os
import socket
import time
from typing import Mapping, MutableMapping

NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def unset_environment(environ: MutableMapping[str, str]) -> None:
    """Drop the sd_notify variables (as sd_notify's ``unset_environment``), so that processes
    started afterwards (the workers) never talk to systemd in the daemon's name."""
    for name in NOTIFY_VARIABLES:
        environ.pop(name, None)


class Notifier:
    """Talks to systemd (or to a test's fake socket). A no-op when not under systemd."""

    def __init__(self, environ: Mapping[str, str]):
        address = environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self._address else None
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        wanted = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        self.watchdog_interval: float | None = int(usec) / 2e6 if wanted else None
        self._last_ping = 0.0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: str | int) -> None:
        if self._sock is None:
            return
        message = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(message, self._address)
        except OSError:
            pass  # systemd went away; nothing useful to do

    def ready(self, status: str) -> None:
        self.send(ready=1, status=status, mainpid=os.getpid())

    def status(self, status: str) -> None:
        self.send(status=status)

    def reloading(self) -> None:
        self.send(reloading=1, monotonic_usec=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str = "stopping") -> None:
        self.send(stopping=1, status=status)

    def watchdog(self, now: float) -> None:
        """Ping at half of WATCHDOG_USEC (call often; it rate-limits itself)."""
        if self.watchdog_interval is not None and now - self._last_ping >= self.watchdog_interval:
            self._last_ping = now
            self.send(watchdog=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
