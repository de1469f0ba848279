"""The Python client: ``ControlClient`` (requests) and ``EventStream`` (the PUB events).

``ControlClient`` speaks DEALER with the "lazy pirate" pattern: each request
waits at most ``timeout`` seconds (plus the worker-acknowledgement wait the
command asks the daemon for); on silence the socket is thrown away (LINGER 0)
and, for idempotent commands only, the request is sent again on a fresh
socket. Replies are matched by request id, so a late reply to an abandoned
request is dropped. Nothing is ever pickled: weights travel in
``ingestd.weights``'s manifest + lz4 format.

``timeout`` bounds the whole call: a command that waits for workers (pause,
resume, restart, scale, push_weights) may take ``timeout`` plus the wait it
asks the daemon for (``timeout_s``, default ``ack_timeout``); a snapshot may
take ``timeout`` plus its own wait (default ``SNAPSHOT_WAIT_S``).

An ipc:// socket file that does not exist means no daemon listens there
yet. By default a client keeps trying within its timeout, so a trainer
started next to the daemon gets its answer once the daemon is up; with
``wait_for_socket=False`` (what ``ingestctl`` uses) it raises
``DaemonUnavailable`` at once, sending nothing.

A client is not meant to be shared between threads; calls are serialised by
a lock if it is.
"""
from __future__ import annotations

import itertools
import json
import math
import operator
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import zmq

from ingestd.control import curve
from ingestd.control.addresses import (  # noqa: F401  (check_address and the rest: imported from here too)
    check_address, default_address, events_address, followable_events_address, metrics_url,
)
from ingestd.control.addresses import may_exist as _may_exist
from ingestd.control.commands import (
    MAX_WAIT_S, SNAPSHOT_WAIT_S, Acked, GetConfig, GetStatus, Pause, Ping, Profile, Profiled, Pushed, PushWeights,
    Reload, Reloaded, Request, Restart, Resume, Scale, Snapshot, Snapshotted, Status,
)
from ingestd.control.protocol import (
    PROTOCOL_VERSION, Reply, decode_reply, encode_header, socket_file,
)
from ingestd.control.sockets import refused
from ingestd.errors import BadReply, BadWeights, ClosedError, DaemonUnavailable

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_ACK_TIMEOUT_S = 10.0  # sent with commands that wait for workers
MAX_REPLY_BYTES = 16 << 20


def _whole(value: Any, what: str) -> int:
    """``value`` as an int (any integer type); a float, a string or a bool is refused, not truncated."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})") from None


def _check_own_dir(directory: str) -> None:
    """The default socket's dir (``/tmp/ingestd-<uid>`` when there is no runtime dir) must be
    ours: a dir another user made first could hold a fake daemon that receives our weights and
    answers for the real one."""
    try:
        st = os.stat(directory)
    except OSError:
        return  # not there (yet): nothing to connect to, and nobody else's
    if st.st_uid != os.geteuid() or st.st_mode & 0o002:
        raise DaemonUnavailable(f"refusing the default control socket in {directory}: it is owned by uid "
                                f"{st.st_uid} (mode {st.st_mode & 0o7777:04o}), not by you (uid {os.geteuid()}), "
                                "so another user may run a fake daemon there; remove it, or pass the daemon's "
                                "address (--connect / INGESTD_CONTROL)")


def _client_socket(context: zmq.Context, kind: int, address: str, curve_keys: "CurveKeys | None",
                   subscribe: list[bytes] = ()) -> zmq.Socket:
    """A connected client socket (no linger, replies capped, CURVE if given); closed again if any
    step fails (a CURVE key file that went away raises ``KeyFileError``)."""
    sock = context.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:port too (IPv4 addresses work as before)
        if curve_keys is not None and address.startswith("tcp://"):  # CURVE is for tcp only (ipc: the file mode)
            curve_keys.apply(sock)
        for topic in subscribe:
            sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


@dataclass(frozen=True)
class CurveKeys:
    """CURVE settings of a client: the daemon's public key and this client's key pair, read
    once from its secret key file (a warning about the file's mode comes once, not per socket)."""

    server_public: bytes
    client_secret_file: str
    client_public: bytes = field(default=b"", repr=False)
    client_secret: bytes = field(default=b"", repr=False)

    @classmethod
    def load(cls, server_key: str | bytes | os.PathLike, client_secret_file: str | os.PathLike) -> CurveKeys:
        public = curve.load_public(server_key)
        client_public, client_secret = curve.load_secret(client_secret_file)
        return cls(public, os.fspath(client_secret_file), client_public, client_secret)

    def apply(self, sock: zmq.Socket) -> None:
        pair = (self.client_public, self.client_secret)
        if not all(pair):  # made directly, not by load(): read the file now
            pair = curve.load_secret(self.client_secret_file)
        curve.make_client(sock, self.server_public, *pair)


_clients: "weakref.WeakSet[ControlClient]" = weakref.WeakSet()  # made afresh in a forked child


def _after_fork_in_child() -> None:
    for client in list(_clients):
        client._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ControlClient:
    """Talks to a running daemon. ``ControlClient()`` finds the local default socket.

    ``wait_for_socket``: whether a request to an ipc:// socket file that does not exist (yet)
    waits up to ``timeout`` for a starting daemon to create it (the default), or fails at once.

    A client inherited through ``fork`` (a DataLoader worker) works in the child: its first
    request there connects afresh, from the child's own ZeroMQ context (the parent's socket and
    context cannot be used after a fork; a request on them hung past any timeout). After
    :meth:`close` every request raises ``ClosedError``.
    """

    def __init__(self, address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, *, retries: int = 2,
                 ack_timeout: float = DEFAULT_ACK_TIMEOUT_S, curve_keys: CurveKeys | None = None,
                 environ: Mapping[str, str] | None = None, context: zmq.Context | None = None,
                 wait_for_socket: bool = True):
        if not (0 < timeout < math.inf and 0 < ack_timeout <= MAX_WAIT_S) or retries < 0:
            raise ValueError(f"timeout must be a finite number of seconds > 0, ack_timeout one in (0, {MAX_WAIT_S:g}] "
                             f"(the daemon waits no longer), and retries >= 0; got timeout={timeout}, "
                             f"ack_timeout={ack_timeout}, retries={retries}")
        self.address = check_address(address or default_address(environ))  # $INGESTD_CONTROL too
        env = os.environ if environ is None else environ
        # the default ipc socket (not one named by the caller) is trusted only in a dir of our own
        self._own_dir = address is None and not env.get("INGESTD_CONTROL", "").strip()
        self.timeout, self.retries, self.ack_timeout = timeout, retries, ack_timeout
        self.curve_keys, self.wait_for_socket = curve_keys, wait_for_socket
        self._socket_file = socket_file(self.address)
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None  # of _socket, made with it (a Poller per call costs)
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}-{id(self) & 0xFFFFFF:x}-"
        self._lock = threading.Lock()
        self._max_message_bytes: int | str | None = None  # the daemon's, once asked (_check_size)
        self._closed = False
        _clients.add(self)

    def _forked(self) -> None:
        """In a forked child: drop the parent's socket (its connection stays the parent's) and lock
        (a parent thread may have held it), and connect from this process's context when asked."""
        self._lock = threading.Lock()
        self._socket = self._poller = None
        self._context = zmq.Context.instance()  # pyzmq makes a new one in a child
        self._prefix = f"{os.getpid():x}-{id(self) & 0xFFFFFF:x}-"

    # -- commands ------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        pong = self.call(Ping())
        if isinstance(pong, dict) and self._max_message_bytes is None:  # a push need not ask again
            self._max_message_bytes = pong.get("max_message_bytes")
        return pong

    def status(self) -> Status:
        return Status.from_json(self.call(GetStatus()))

    def config(self) -> dict[str, Any]:
        """The daemon's effective config, as nested dicts shaped like the TOML file."""
        return self.call(GetConfig())

    def pause(self, timeout_s: float | None = None) -> Acked:
        """Pause every worker; returns once each live worker has finished its chunk and paused."""
        return Acked.from_json(self.call(Pause(timeout_s=self._wait(timeout_s))))

    def resume(self, timeout_s: float | None = None) -> Acked:
        return Acked.from_json(self.call(Resume(timeout_s=self._wait(timeout_s))))

    def restart(self, workers: int | list[int] | None = None, wait: bool = True, timeout_s: float | None = None
                ) -> Acked:
        """Restart all workers, those listed, or the one given; with ``wait`` returns once they
        run again."""
        if workers is not None and not isinstance(workers, Iterable):
            workers = [workers]  # one index (refused below unless it is an integer); any iterable of them else
        chosen = None if workers is None else tuple(_whole(w, "a worker index") for w in workers)
        return Acked.from_json(self.call(Restart(workers=chosen, wait=wait, timeout_s=self._wait(timeout_s))))

    def scale(self, n: int, wait: bool = True, timeout_s: float | None = None) -> Acked:
        return Acked.from_json(self.call(Scale(count=_whole(n, "the worker count"), wait=wait,
                                               timeout_s=self._wait(timeout_s))))

    def push_weights(self, module_or_state_dict: Any, wait: bool = True, timeout_s: float | None = None) -> int:
        """Send new policy weights; returns their version. With ``wait`` the reply comes once
        every live, collecting worker has applied them (paused ones apply them once resumed:
        ``push_weights_detailed(...).deferred``).

        ``BadWeights`` for anything the daemon would refuse: raised here for what the client
        can see (not a state dict, non-tensor values, a meta tensor, weights larger than the
        daemon's ``control.max_message_bytes``), else ``WeightsRejected`` (a ``BadWeights``
        and a ``CommandFailed`` with code ``bad_weights``) when the daemon refused them
        (names, shapes or dtypes that do not fit its policy, non-finite values, a value the
        policy's ``check_weights`` refuses)."""
        return self.push_weights_detailed(module_or_state_dict, wait, timeout_s).version

    def push_weights_detailed(self, module_or_state_dict: Any, wait: bool = True,
                              timeout_s: float | None = None) -> Pushed:
        from ingestd.weights.wire import encode

        wait_s = self._wait(timeout_s)
        frames = tuple(encode(module_or_state_dict))
        self._check_size(frames)
        return Pushed.from_json(self.call(PushWeights(wait=wait, timeout_s=wait_s, frames=frames)))

    def _check_size(self, frames: tuple) -> None:
        """``BadWeights`` for a push larger than the daemon takes: libzmq would drop the
        connection without a reply, which looks like a daemon that is down. Asked once (a
        ``ping``, at this client's first push)."""
        from ingestd.weights.wire import PUSH_OVERHEAD

        size = sum(len(f) for f in frames) + PUSH_OVERHEAD  # + the JSON header
        if self._max_message_bytes is None:
            self.ping()
        limit = self._max_message_bytes
        if isinstance(limit, int) and size > limit:
            raise BadWeights(f"the encoded weights are {size} bytes, over the daemon's control.max_message_bytes "
                             f"of {limit}: the daemon would drop the connection; raise control.max_message_bytes "
                             "in its config (and restart it), or check the state dict holds only the policy's "
                             "tensors")

    def profile(self, worker: int, seconds: float | None = None) -> Profiled:
        """Record a torch profiler trace of worker ``worker``'s loop for ``seconds`` (1 by default,
        at most 30) while it keeps collecting; returns once the worker wrote the Chrome trace
        (``.path``, on the daemon's host)."""
        request = Profile(worker=int(worker)) if seconds is None else Profile(worker=int(worker),
                                                                              seconds=float(seconds))
        return Profiled.from_json(self.call(request))

    def limiter(self, timeout_s: float | None = None, **changes: Any):
        """The rate limiter's state; keyword arguments (``enabled``, ``min_size``,
        ``samples_per_insert``, ``min_diff``, ``max_diff``) change it live first. A change
        that finds the limiter's file locked by a trainer (stopped inside a sample) is retried
        for ``timeout_s`` (``ack_timeout``), then fails with ``busy``."""
        from ingestd.control.commands import LimiterState, SetLimiter

        wait = self._wait(timeout_s) if changes else None  # a read answers at once
        return LimiterState.from_json(self.call(SetLimiter(timeout_s=wait, **changes)))

    def reload(self) -> Reloaded:
        """Re-read the daemon's config file and apply what can change live."""
        return Reloaded.from_json(self.call(Reload(), extra_wait=self.ack_timeout))

    def snapshot(self, name: str | None = None, timeout: float | None = None) -> Snapshotted:
        """Copy the replay's committed rows, while the workers keep collecting, into
        ``<data_dir>/snapshots/<name>`` on the daemon's host (default name: the UTC time).
        Waits up to ``timeout`` seconds for it (default ``SNAPSHOT_WAIT_S``) on top of the client's
        own; never re-sent (the daemon finishes a snapshot whose reply came too late).
        ``CommandFailed``: ``bad_request`` (name), ``snapshot_exists``, ``busy`` (another snapshot
        is being written), ``snapshot_failed`` (disk full, no storage...)."""
        wait = SNAPSHOT_WAIT_S if timeout is None else float(timeout)
        if not wait > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        return Snapshotted.from_json(self.call(Snapshot(name=name), extra_wait=wait))

    # -- transport -----------------------------------------------------------------------
    def _wait(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return float(self.ack_timeout)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_WAIT_S:
            raise ValueError(f"timeout_s must be a number of seconds in (0, {MAX_WAIT_S:g}] (the daemon waits no "
                             f"longer), got {timeout_s!r}")
        return float(timeout_s)

    def call(self, request: Request, extra_wait: float = 0.0) -> Any:
        """Send ``request``; the result, ``CommandFailed``, ``DaemonUnavailable`` or ``BadReply``."""
        return self.request(request, extra_wait).unwrap()

    def request(self, request: Request, extra_wait: float = 0.0) -> Reply:
        """One request, lazy-pirate style: everything happens within ``timeout`` plus the time the
        command may wait for workers; idempotent commands are re-sent on a fresh socket within it."""
        args, payload = request.encode()
        waits = (request.wait_s or 0.0) + extra_wait
        budget = self.timeout + waits
        attempts = 1 + (self.retries if request.idempotent else 0)
        if not self.wait_for_socket and self._socket_file is not None and not _may_exist(self._socket_file):
            raise DaemonUnavailable(f"{request.cmd!r} was not sent to {self.address}: {self._no_socket()}")
        if self._socket_file is not None and _may_exist(self._socket_file) and not os.access(self._socket_file, os.W_OK):
            # said at once: connecting needs write access, and a refused connect only looked like silence
            raise DaemonUnavailable(f"{request.cmd!r} was not sent to {self.address}: you have no write access to "
                                    f"{self._socket_file}; join the daemon's group (docs/systemd.md)")
        deadline = time.monotonic() + budget
        sent = 0
        with self._lock:
            if self._closed:
                raise ClosedError(f"this ControlClient of {self.address} was closed; make a new one")
            if self._own_dir and self._socket is None and self._socket_file is not None:
                # connect only once the dir exists and is ours: libzmq reconnects by itself to whatever
                # socket appears later, so a dir made meanwhile by another user would get the request
                directory = os.path.dirname(self._socket_file)
                while not os.path.isdir(directory) and time.monotonic() < deadline:
                    time.sleep(0.02)
                if not os.path.isdir(directory):
                    raise DaemonUnavailable(f"{request.cmd!r} was not sent to {self.address}: {self._no_socket()}")
                _check_own_dir(directory)
            if not self.wait_for_socket and self._socket is None and self._socket_file is not None \
                    and refused(self._socket_file):  # (once a connection: not a probe per request)
                # (walkthrough review: ingestctl waited out its 5 s timeout on the file a killed daemon left)
                raise DaemonUnavailable(f"{request.cmd!r} was not sent to {self.address}: the socket file "
                                        f"{self._socket_file} exists but nothing listens on it (a daemon killed "
                                        "without cleanup, or stopped): check `systemctl status ingestd` or the "
                                        "daemon's pid")
            request_id = self._prefix + str(next(self._ids))
            frames = [encode_header(request_id, request.cmd, args), *payload]
            while sent < attempts and (remaining := deadline - time.monotonic()) > 0.001:
                sent += 1
                reply = self._attempt(frames, request_id, min(remaining, self.timeout / attempts + waits))
                if reply is not None:
                    return reply
        raise DaemonUnavailable(self._silence(request.cmd, budget, sent))

    def _attempt(self, frames: list, request_id: str, budget: float) -> Reply | None:
        """Send, then wait for the reply with the socket's own ``Poller`` (``Socket.poll`` builds
        one per call). Not ``RCVTIMEO``: pyzmq restarts an interrupted receive with the whole
        timeout, so a signal arriving more often than that (a timer) would keep it waiting."""
        sock, poller = self._connected(), self._poller
        if len(frames) == 1:
            sock.send(frames[0])
        else:
            sock.send_multipart(frames, copy=False)
        deadline = time.monotonic() + budget
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._discard()  # lazy pirate: a fresh socket for the next attempt
                return None
            if not poller.poll(max(1, int(remaining * 1000))):
                continue  # the deadline passed, or a signal cut the wait short
            reply = decode_reply(_recv_frames(sock))
            if reply.id == request_id:
                return reply
            # a late reply to an abandoned request: drop it and keep waiting

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            sock = _client_socket(self._context, zmq.DEALER, self.address, self.curve_keys)
            self._socket, self._poller = sock, zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
        return self._socket

    def _discard(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = self._poller = None

    def _no_socket(self) -> str:
        where = ("; a daemon elsewhere: set INGESTD_CONTROL or pass --connect / ControlClient(address=...)"
                 if self._own_dir else "")
        directory = os.path.dirname(self._socket_file)
        if os.path.exists(directory) and not os.path.isdir(directory):  # (was "no write access": exhaustion review)
            return f"{directory} is not a directory, so there is no socket at {self._socket_file}; remove or move " \
                   f"that file, then restart the daemon{where}"
        return f"there is no socket at {self._socket_file}: is the daemon running with this runtime dir?{where}"

    def _silence(self, cmd: str, budget: float, attempts: int) -> str:
        hint = ""
        path = self._socket_file
        if path is not None:
            if not _may_exist(path):
                hint = f"; {self._no_socket()}"
            elif not os.access(path, os.W_OK):
                hint = f"; you have no write access to {path} (join the daemon's group)"
            elif os.path.basename(path) == "events.sock":  # a PUB socket: it never answers (walkthrough review)
                hint = (f"; {path} is the daemon's events socket, which publishes and never answers: connect "
                        f"to its control socket ({os.path.join(os.path.dirname(path), 'control.sock')} by default)")
            else:  # a file left behind (kill -9 unlinks nothing) looks like a daemon that just did not answer
                hint = (f"; the socket file {path} exists but no daemon answered on it (killed, hung, or stopped "
                        "without cleanup): check `systemctl status ingestd` or the daemon's pid")
        elif self.address.startswith("tcp://") and self.curve_keys is None:
            hint = ("; tcp:// needs CURVE keys: ControlClient(..., curve_keys=CurveKeys.load(SERVER_KEY, "
                    "CLIENT_KEY_SECRET)), or ingestctl --server-key/--client-key")
        elif self.address.startswith("tcp://"):  # a refused CURVE handshake looks like silence
            hint = ("; or the daemon refused this client's key (not in its control.curve_authorized_keys, or "
                    "revoked), or --server-key is not the daemon's public key")
        return (f"no reply to {cmd!r} from {self.address} within {budget:g} s "
                f"({attempts} attempt{'s' if attempts > 1 else ''}){hint}")

    def close(self) -> None:
        with self._lock:
            self._discard()
            self._closed = True

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ControlClient({self.address!r}, timeout={self.timeout})"


_RCVMORE, _NOBLOCK = int(zmq.RCVMORE), int(zmq.NOBLOCK)


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One waiting message: a reply is one frame, so the usual case is one receive and one
    ``RCVMORE`` check (plain-int options: pyzmq's enums cost microseconds)."""
    frames = [sock.recv(_NOBLOCK)]
    while sock.getsockopt(_RCVMORE):
        frames.append(sock.recv(_NOBLOCK))
    return frames


@dataclass(frozen=True)
class Event:
    topic: str
    data: dict[str, Any]


class EventStream:
    """Follows the daemon's PUB events (best-effort: a late joiner misses earlier ones)."""

    def __init__(self, address: str, topics: tuple[str, ...] = ("",), *, curve_keys: CurveKeys | None = None,
                 context: zmq.Context | None = None):
        self.address = check_address(address)
        self._socket = _client_socket(context or zmq.Context.instance(), zmq.SUB, self.address, curve_keys,
                                      [topic.encode() for topic in topics or ("",)])

    @classmethod
    def of(cls, client: ControlClient, topics: tuple[str, ...] = ("",)) -> EventStream:
        """The event stream of the daemon ``client`` talks to (asks it for the address)."""
        return cls(cls.address_of(client), topics, curve_keys=client.curve_keys)

    @staticmethod
    def address_of(client: ControlClient) -> str:
        """Where the daemon ``client`` talks to publishes its events, as this host reaches them
        (``addresses.followable_events_address``: refused if only on another host's ipc socket)."""
        return followable_events_address(client.ping(), client.address)

    def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after ``timeout`` seconds (None: wait for ever)."""
        if not self._socket.poll(None if timeout is None else max(0, int(timeout * 1000)), zmq.POLLIN):
            return None
        frames = self._socket.recv_multipart()
        if len(frames) != 2:
            raise BadReply(f"an event is 2 frames (topic, JSON), got {len(frames)}")
        try:
            data = json.loads(frames[1])
        except ValueError as exc:
            raise BadReply(f"event body is not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("v") != PROTOCOL_VERSION:
            raise BadReply(f"not a v{PROTOCOL_VERSION} ingestd event: {frames[1][:200]!r}")
        return Event(frames[0].decode(errors="replace"), data)

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.next()
            if event is not None:
                yield event

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
