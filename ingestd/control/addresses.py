"""Where a client finds the daemon: its control address (given, ``$INGESTD_CONTROL`` or the
default socket), checked before any connect, and the event and metrics addresses that ``ping``
and ``status`` advertise, as a client reaches them (a wildcard bind at the control host)."""
from __future__ import annotations

import functools
import os
import re
import socket
from typing import Mapping


def default_address(environ: Mapping[str, str] | None = None) -> str:
    """$INGESTD_CONTROL, else the daemon's default ipc socket in the runtime dir."""
    from ingestd.service.config import default_control_address

    return default_control_address(os.environ if environ is None else environ)


_ADDRESS_FORMS = "ipc:///absolute/path, ipc://@name or tcp://host:port"
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")  # a bind on every interface: not an address to connect to
_TCP = re.compile(r"tcp://(?P<host>.+):(?P<port>\d+)")
_HTTP = re.compile(r"http://(?P<host>\[[^\]]*\]|[^:/]+):(?P<port>\d+)(?P<path>/.*)")


def check_address(address: str) -> str:
    """``address``, stripped, if a client can connect to it (``_ADDRESS_FORMS``); ``ValueError``
    otherwise, at once: ZeroMQ would only say "Invalid argument", at the first request."""
    from ingestd.errors import ConfigError
    from ingestd.service.config_schema import Address

    try:
        checked = Address("").check("address", address)
    except ConfigError:
        checked = ""
    match = _TCP.fullmatch(checked)
    if not checked or (checked.startswith("tcp://") and (match is None or match["host"] in _WILDCARD_HOSTS)):
        raise ValueError(f"{address!r} is not a daemon address; expected {_ADDRESS_FORMS}")
    return checked


def events_address(advertised: str, control_address: str, local: str | None = None) -> str:
    """Where to follow the events that ``ping`` says are at ``advertised``: a client on the local
    ipc control socket follows the ``local`` ipc event socket bound beside a tcp:// one (no keys
    needed there); a wildcard tcp bind (``0.0.0.0``, ``[::]``) is reached at the host of
    ``control_address`` (loopback if that is an ipc socket)."""
    if local and control_address.startswith("ipc://"):
        return local
    match = _TCP.fullmatch(advertised)
    if match is None or match["host"] not in _WILDCARD_HOSTS:
        return advertised
    return f"tcp://{_control_host(control_address)}:{match['port']}"


def followable_events_address(pong: Mapping, control_address: str) -> str:
    """The events address of a ``ping`` reply (``pong``) as this host reaches it;
    ``DaemonUnavailable`` if only by an ipc socket of another host (a daemon reached over tcp
    with control.events_address unset): that path here is no socket of it, or another daemon's
    (the default /run/ingestd/events.sock of this host's own)."""
    from ingestd.control.protocol import socket_file
    from ingestd.errors import DaemonUnavailable

    address = events_address(pong["events_address"], control_address, pong.get("events_local"))
    path = socket_file(address)
    if path is None:
        return address
    host = pong.get("host") or ""
    elsewhere = host != host_identity() if host else not may_exist(path)  # (an older daemon: no host)
    if elsewhere:
        raise DaemonUnavailable(
            f"the daemon at {control_address} publishes its events only at {address}, a socket on its own host, "
            "not this one (control.events_address is unset, so the events socket is ipc); set "
            "control.events_address = \"tcp://HOST:PORT\" in the daemon's config to follow them over tcp "
            "(CURVE keys as for control.address), or run this on the daemon's host")
    return address


@functools.cache
def host_identity() -> str:
    """This host as its ipc sockets know it: the host name and the kernel's boot id (two
    machines, or two containers with host names of their own, differ). Read once a process:
    ``ping`` reports it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def may_exist(path: str) -> bool:
    """False only if ``path`` is known not to exist (a directory this user cannot enter says
    nothing: the daemon may well be there, and the reply's silence explains the access)."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # (a runtime dir that became a file: no socket can be there)
        return False
    except OSError:  # EACCES on a directory: unknown
        pass
    return True


def metrics_url(advertised: str | None, control_address: str) -> str | None:
    """Where to scrape the page that ``ping`` and ``status`` say is at ``advertised``: a
    wildcard bind (``0.0.0.0``, ``[::]``) is reached at the host of ``control_address``, as
    for :func:`events_address`. None and ``""`` (metrics off, not reported) pass through."""
    match = _HTTP.fullmatch(advertised or "")
    if match is None or match["host"] not in _WILDCARD_HOSTS:
        return advertised
    return f"http://{_control_host(control_address)}:{match['port']}{match['path']}"


def _control_host(control_address: str) -> str:
    """The host a client reaches the daemon at: that of a tcp:// control address, else loopback."""
    control = _TCP.fullmatch(control_address)
    return control["host"] if control is not None else "127.0.0.1"
