"""The metrics HTTP exporter: a daemon service serving ``/metrics``.

prometheus_client lives in the daemon process only; workers never import it.
The exporter has its own ``CollectorRegistry`` (never the global one) holding
the ingestd collector and the standard process collector.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app

from ingestd.errors import ConfigError
from ingestd.metrics.collector import RETURN_BUCKETS, IngestdCollector

log = logging.getLogger("ingestd.metrics")


def collector_for(daemon, return_buckets: tuple[float, ...] = ()) -> IngestdCollector:
    """The collector wired to a started daemon's shared objects (``return_buckets``:
    ``metrics.episode_return_buckets``, empty for the built-in ones)."""
    from ingestd.control.commands import COMMANDS

    layout = daemon.layout
    # the supervisor's count follows scale commands too; config.workers.count only follows reloads
    return IngestdCollector(layout.stats, layout.storage, layout.weights, daemon.telemetry, daemon.started_at,
                            desired_workers=lambda: daemon.supervisor.count, commands=sorted(COMMANDS),
                            return_buckets=return_buckets or RETURN_BUCKETS)


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
        self.registry.register(collector_for(daemon, self.settings.episode_return_buckets))
        ProcessCollector(registry=self.registry)
        host, port = self.settings.address, self.settings.port
        try:
            self._server, self._thread = serve(host, port, self.registry)
        except OSError as exc:
            _raise_bind_failure(exc, host, port)
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


MAX_CONNECTIONS = 16  # scrapes served at once; more are closed at once
CONNECTION_TIMEOUT_S = 10.0  # a connection is closed this long after it was accepted, whatever it sends


class _Server(ThreadingMixIn, WSGIServer):
    """prometheus_client's server gives every connection a thread, without a timeout or a cap:
    a local user holding a thousand half-sent requests used up the daemon's file descriptors,
    and the daemon crashed. This one serves at most ``MAX_CONNECTIONS`` at once (closing the
    others at once) and closes every connection ``CONNECTION_TIMEOUT_S`` after it was accepted
    (a socket timeout alone restarts with every byte: one byte every few seconds held a slot)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 made connects wait for SYN retries)

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._deadlines: dict[socket.socket, float] = {}  # open connections -> when they are cut
        self._deadlines_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            request.settimeout(CONNECTION_TIMEOUT_S)
            with self._deadlines_lock:
                self._deadlines[request] = time.monotonic() + CONNECTION_TIMEOUT_S
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._deadlines_lock:
                self._deadlines.pop(request, None)
            self._slots.release()

    def service_actions(self) -> None:
        """Between polls of ``serve_forever`` (every 0.5 s): cut the connections past their time."""
        now = time.monotonic()
        with self._deadlines_lock:
            late = [conn for conn, deadline in self._deadlines.items() if deadline < now]
        for conn in late:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # the handler's read returns; its thread ends and closes it
            except OSError:  # closed meanwhile
                pass

    def handle_error(self, request, client_address) -> None:
        """A connection that timed out or broke: nothing for the log (socketserver prints a
        traceback to stderr for each, which a scraper or an attacker could flood the journal with)."""
        log.debug("metrics: connection from %s ended with an error", client_address, exc_info=True)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # no line on stderr per scrape
        pass


def serve(host: str, port: int, registry: CollectorRegistry) -> tuple[_Server, threading.Thread]:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_MetricsServer", (_Server,), {"address_family": family})
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="ingestd-metrics", daemon=True)
    thread.start()
    return server, thread


# an address that is not this host's, of no family it has, or a host name that does not exist
_ADDRESS_FAULTS = frozenset(code for code in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL,
                                              socket.EAI_NONAME, getattr(socket, "EAI_ADDRFAMILY", None),
                                              getattr(socket, "EAI_NODATA", None)) if code is not None)


def check_bindable(settings) -> None:
    """Bind the metrics address once and let it go, before the seconds of start-up: an address
    not on this host, a privileged or taken port is a config error now (``ingestd run`` calls it
    before importing torch; the real bind later reports the same errors)."""
    host, port = settings.address, settings.port
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind((host, port))
    except OSError as exc:
        _raise_bind_failure(exc, host, port)


def _raise_bind_failure(exc: OSError, host: str, port: int):
    fault = _bind_failure(exc.errno, port)
    if fault is None:  # not the config's fault (EMFILE, ENOMEM, a DNS lookup that failed for now)
        raise exc
    key, hint = fault
    raise ConfigError(key, f"cannot serve metrics on {_url(host, port)}: {exc.strerror or exc}; {hint}") from exc


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
