"""The daemon's ipc socket files: bound private (mode 0660 or stricter) and never over a
live daemon's. Free of zmq and torch imports: ``ingestd run`` looks for a live daemon with
:func:`answering` before its start-up."""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from ingestd.control.protocol import socket_file

log = logging.getLogger("ingestd.control")


def bind_private(sock, address: str) -> None:
    """Bind; an ipc:// socket file gets mode 0660 or stricter (umask around bind, then chmod).

    libzmq silently replaces an existing ipc socket file, which would steal a running
    daemon's socket: a live one is refused (``AddressInUse``), a stale one is replaced."""
    path = socket_file(address)
    if path is None:
        if address.startswith("ipc://@") and not sock.curve_server:
            log.warning("%s is an abstract socket: it has no file mode, so every local user can connect to it "
                        "and control the daemon; use an ipc:// path (or CURVE) on a shared host", address)
        sock.bind(address)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    if answering(path):
        raise AddressInUse(f"{address} is in use: another daemon is listening on it")
    old = os.umask(0o117)
    try:
        sock.bind(address)
    finally:
        os.umask(old)
    os.chmod(path, os.stat(path).st_mode & 0o660)


def bind_without_curve(sock, address: str) -> None:
    """Bind an ipc address again as it was bound first: without CURVE. A listener copies the
    socket's options when it binds, and a socket that also listens on tcp:// is a CURVE server by
    now: its new ipc listener demanded keys, so local tools without them (ingestctl, systemd's
    ExecReload) got no answer from the file that was bound again for them (control review)."""
    server = sock.curve_server
    sock.curve_server = False
    try:
        bind_private(sock, address)
    finally:
        sock.curve_server = server


class AddressInUse(OSError):
    """A control or event address is already taken by a live process."""


def refused(path) -> bool:
    """Whether connecting to the unix socket file ``path`` is refused (ECONNREFUSED): nothing
    listens on it, a file left by a killed daemon (or a file that is no socket). Any other
    outcome (a connection, no such file, a full backlog's timeout) is not a refusal."""
    return isinstance(_connect_error(path), ConnectionRefusedError)


def answering(path) -> bool:
    """Whether something accepts connections on the unix socket ``path`` (a live daemon; a file
    left by a killed one refuses them, and a missing one is no listener)."""
    return _connect_error(path) is None  # ECONNREFUSED: a stale file from a daemon that died; ENOENT: none


def _connect_error(path) -> OSError | None:
    """What connecting to the unix socket ``path`` raised (within 1 s), or None if it connected."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as exc:
            return exc
    return None
