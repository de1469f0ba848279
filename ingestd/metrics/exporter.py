"""The metrics HTTP exporter: a daemon service serving ``/metrics``.

prometheus_client lives in the daemon process only; workers never import it.
The exporter has its own ``CollectorRegistry`` (never the global one) holding
the ingestd collector and the standard process collector.
"""
from __future__ import annotations

import errno
import logging
import socket

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from ingestd.errors import ConfigError
from ingestd.metrics.collector import IngestdCollector

log = logging.getLogger("ingestd.metrics")


def collector_for(daemon) -> IngestdCollector:
    """The collector wired to a started daemon's shared objects."""
    from ingestd.control.commands import COMMANDS

    layout = daemon.layout
    # the supervisor's count follows scale commands too; config.workers.count only follows reloads
    return IngestdCollector(layout.stats, layout.storage, layout.weights, daemon.telemetry, daemon.started_at,
                            desired_workers=lambda: daemon.supervisor.count, commands=sorted(COMMANDS))


class MetricsExporter:
    """``start(daemon)`` binds ``[metrics] address:port`` and serves; ``stop()`` shuts the server down."""

    def __init__(self, config, registry: CollectorRegistry | None = None):
        self.settings = config.metrics
        self.registry = registry if registry is not None else CollectorRegistry()
        self._server = None
        self._thread = None

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound (host, port), once started."""
        return None if self._server is None else tuple(self._server.server_address[:2])

    def start(self, daemon) -> None:
        self.registry.register(collector_for(daemon))
        ProcessCollector(registry=self.registry)
        host, port = self.settings.address, self.settings.port
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            fault = _bind_failure(exc.errno, port)
            if fault is None:  # not the config's fault (EMFILE, ENOMEM, a DNS lookup that failed for now)
                raise
            key, hint = fault
            raise ConfigError(key, f"cannot serve metrics on {_url(host, port)}: {exc.strerror or exc}; "
                                   f"{hint}") from exc
        bound_host, bound_port = self.address
        log.info("serving metrics on %s/metrics", _url(bound_host, bound_port))
        if bound_host in ("0.0.0.0", "::"):
            log.warning("metrics bound to all interfaces (%s); anyone who can reach this host can read them",
                        bound_host)

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(5.0)


# an address that is not this host's, of no family it has, or a host name that does not exist
_ADDRESS_FAULTS = frozenset(code for code in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL,
                                              socket.EAI_NONAME, getattr(socket, "EAI_ADDRFAMILY", None),
                                              getattr(socket, "EAI_NODATA", None)) if code is not None)


def _bind_failure(code: int | None, port: int) -> tuple[str, str] | None:
    """(the key at fault, what to do) for a failed bind of the metrics server; None when the
    config is not at fault (a restart may succeed)."""
    if code == errno.EADDRINUSE:
        return "metrics.port", "another process holds the port: choose another metrics.port or stop that process"
    if code == errno.EACCES and port < 1024:
        return "metrics.port", ("ports below 1024 need CAP_NET_BIND_SERVICE, which the daemon does not have "
                                "(the systemd unit grants none): choose a metrics.port of 1024 or more")
    if code == errno.EACCES:
        return "metrics.port", "a security policy (SELinux, AppArmor, a seccomp or BPF filter) refuses this port"
    if code in _ADDRESS_FAULTS:
        return "metrics.address", ("metrics.address must name an address of this host (127.0.0.1 for "
                                   "loopback, 0.0.0.0 or :: for all interfaces)")
    return None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
