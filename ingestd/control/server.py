"""The ZeroMQ control server: one thread owns the ROUTER and PUB sockets.

- The control thread receives every request, answers the fast ones (ping,
  status, config) inline from shared memory, and hands slow ones to a small
  thread pool. Finished slow commands and daemon events come back through a
  queue plus a wake-up pipe that the thread polls next to the ROUTER, so only
  the control thread ever touches a socket (zmq sockets are not thread-safe)
  and a pause waiting for acks never delays a ping.
- A ``status`` result is reused for up to ``STATUS_MAX_AGE_S`` and dropped
  whenever the thread sends the reply of a command that may change
  something, or an event (``context.ReplyCache``; docs/protocol.md).
- Every request is checked against the limits (``MAXMSGSIZE`` per frame on
  the socket; frame count and total size here) before it is parsed.
- ipc:// sockets are created 0660 or stricter; tcp:// requires CURVE.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from ingestd.collect.stats import State
from ingestd.control import curve
from ingestd.control.commands import COMMANDS
from ingestd.control.context import Context, ReplyCache
from ingestd.control.handlers import HANDLERS, Handler
from ingestd.control.protocol import (
    PROTOCOL_VERSION, ErrorCode, Limits, RequestError, dumps, encode_error, encode_result, parse_header, peek_id,
    socket_file,
)
from ingestd.control.sockets import bind_private, bind_without_curve
from ingestd.errors import ConfigError, LockBusy
from ingestd.service.limits import FdWatch
from ingestd.service.telemetry import INVALID_CMD

log = logging.getLogger("ingestd.control")

MAX_SLOW_IN_FLIGHT = 16  # beyond this, slow commands get ``busy``
# a thread for every slow command let in: one never queues behind others (four profile requests
# held all four threads of a smaller pool, and a push waited a minute for one)
POOL_THREADS = MAX_SLOW_IN_FLIGHT
MAX_PUSHES_IN_FLIGHT = 2  # each holds a payload of up to max_message_bytes
HOUSEKEEPING_S = 0.25  # frame-rate samples and weights.applied events
RECV_BATCH = 64  # requests handled per poll wake-up before looking at the outbox again
STATUS_MAX_AGE_S = 0.005  # a status result is reused this long at most (docs/protocol.md, "status")
STOP_JOIN_S = 5.0
STOP_LINGER_MS = 500  # at stop, how long the last replies may take to leave
SIGNAL_RELOAD_DEADLINE_S = 60.0  # a SIGHUP's reload waits this long for the main loop to take it
SOCKET_FILE_CHECK_S = 2.0  # how often the ipc socket files are looked at (deleted ones are bound again)


class ControlServer:
    """The daemon's control service: ``start(daemon)`` binds and starts the thread; ``stop()``."""

    def __init__(self, config, *, pool_threads: int = POOL_THREADS, status_max_age_s: float = STATUS_MAX_AGE_S):
        self.config = config
        self.pool_threads = pool_threads
        self.status_max_age_s = status_max_age_s
        self._thread: threading.Thread | None = None
        self._stuck: threading.Thread | None = None  # a control thread that outlived stop()
        self._context: zmq.Context | None = None
        self._auth: curve.Authenticator | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r = self._wake_w = -1
        self._slow_in_flight = 0
        self._pushes_in_flight = 0
        self._event_seq = 0
        self._applied: dict[int, int] = {}
        self._files: list[str] = []
        self._ipc: list[list] = []  # [socket, address, path, (device, inode) of its file when bound, failed]
        self._next_file_check = 0.0
        self._fds = FdWatch()

    # -- lifecycle (main thread) -------------------------------------------------------
    def start(self, daemon) -> None:
        c, paths = self.config.control, daemon.paths
        self.limits = Limits(max_frames=c.max_frames, max_total_bytes=c.max_message_bytes)
        self._context = zmq.Context()
        # a tcp:// socket is also bound at its local ipc default (no CURVE: the file's mode is the
        # access control, as always), so local tools (systemd's ExecReload, an operator's
        # ingestctl) need no keys
        local_control = _local(paths.control, paths.runtime_dir / "control.sock")
        local_events = _local(paths.events, paths.runtime_dir / "events.sock")
        try:
            keys = self._setup_curve(paths, daemon.telemetry)
            self._router = self._socket(zmq.ROUTER, [a for a in (local_control, paths.control) if a], keys, {
                zmq.MAXMSGSIZE: c.max_message_bytes, zmq.RCVHWM: 256, zmq.SNDHWM: 1024})
            self._pub = self._socket(zmq.PUB, [a for a in (local_events, paths.events) if a], keys,
                                     {zmq.SNDHWM: 10_000, zmq.MAXMSGSIZE: 1024})
        except BaseException:
            self._close_all()
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # the handlers' events (paused, scaled, limiter.changed...) go out through the daemon, as its own
        # do: logged, then published here (an operator reading the journal sees who stopped collection)
        self.ctx = Context(daemon, paths.events, publish=daemon.emit, status_cache=ReplyCache(self.status_max_age_s),
                           events_local=local_events)
        self._pool = ThreadPoolExecutor(self.pool_threads, thread_name_prefix="ingestd-control-slow")
        daemon.subscribe(self.publish)  # daemon events go out as they are
        daemon.reload_hooks.append(self._reload_keys)
        daemon.reload_runner = self._reload_on_signal
        self._thread = threading.Thread(target=self._run, name="ingestd-control", daemon=True)
        self._thread.start()
        def shown(address: str) -> str:
            return f"{address} (CURVE)" if keys and address.startswith("tcp://") else address

        local = ", ".join(a for a in (local_control, local_events) if a)
        log.info("control: %s, events: %s%s", shown(paths.control), shown(paths.events),
                 f"; without keys on this host: {local}" if local else "")

    def _setup_curve(self, paths, telemetry) -> tuple[bytes, bytes] | None:
        """The server key pair and the authenticator, when a socket is tcp:// (CURVE is for tcp
        only: an ipc socket's access control is its file mode)."""
        needs = any(a.startswith("tcp://") for a in (paths.control, paths.events))
        if paths.curve_secret_key is None or paths.curve_authorized_keys is None:
            if needs:
                raise ConfigError("control.address", "a tcp:// bind requires control.curve_secret_key and "
                                                     "control.curve_authorized_keys")
            return None
        if not needs:
            log.warning("control: CURVE keys are set but no address is tcp://; they are not used (an ipc "
                        "socket's access control is its file mode)")
            return None
        try:
            keys = curve.load_secret(paths.curve_secret_key)
        except curve.KeyFileError as exc:
            raise ConfigError("control.curve_secret_key", str(exc)) from None
        try:
            self._auth = curve.Authenticator(self._context, paths.curve_authorized_keys,
                                             on_refuse=lambda reason: telemetry.observe_auth_refusal(reason))
        except curve.KeyFileError as exc:
            raise ConfigError("control.curve_authorized_keys", str(exc)) from None
        return keys

    def _socket(self, kind: int, addresses: list[str], keys: tuple[bytes, bytes] | None,
                options: dict) -> zmq.Socket:
        """A socket bound at ``addresses``, its options set *before* each bind (a listener copies
        them when it binds): the ipc ones first, without CURVE, then the tcp ones with it."""
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:port too (IPv4 addresses work as before)
        for option, value in options.items():
            sock.setsockopt(option, value)
        try:
            for address in sorted(addresses, key=lambda a: a.startswith("tcp://")):
                if address.startswith("tcp://") and keys is not None:
                    curve.make_server(sock, *keys)
                self._bind(sock, kind, address)
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _bind(self, sock: zmq.Socket, kind: int, address: str) -> None:
        try:
            bind_private(sock, address)
        except (zmq.ZMQError, OSError) as exc:
            key = "control.address" if kind == zmq.ROUTER else "control.events_address"
            raise ConfigError(key, f"cannot bind {address}: {exc}") from None
        if (path := socket_file(address)) is not None:
            self._files.append(path)
            self._ipc.append([sock, address, path, _identity(path), False])

    def _reload_on_signal(self) -> None:
        """A SIGHUP (main thread): reload as the ``reload`` command does, in a pool thread holding
        the lock that serialises pause/resume/restart/scale/reload, so it waits for a scale or
        restart in flight instead of undoing what that command is waiting for."""
        ctx = self.ctx

        def run() -> None:
            with ctx.change_lock:
                try:
                    ctx.on_main(ctx.daemon.reload, time.monotonic() + SIGNAL_RELOAD_DEADLINE_S)
                except ConfigError:
                    pass  # logged by reload(); the running config stays, as after a failed reload command
                except LockBusy:  # a trainer holds limiter.bin: nothing applied, and no one to retry but us
                    ctx.daemon.retry_reload()
                except RequestError as exc:  # shutting down, or the main loop did not take it
                    log.warning("reload on SIGHUP not run: %s", exc.message)
                except Exception:  # noqa: BLE001 - a pool thread: log, never lose it silently
                    log.exception("reload on SIGHUP failed")
        self._pool.submit(run)

    def _reload_keys(self) -> dict:
        """Re-read the authorised CURVE keys: the first step of every reload (command or SIGHUP),
        before the config file is read, so a revocation takes effect even when the file is broken."""
        if self._auth is None:
            return {}
        try:
            return {"authorized_keys": self._auth.reload()}
        except curve.KeyFileError as exc:
            log.error("CURVE: %s; keeping the %d key(s) read before", exc, self._auth.count)
            return {"authorized_keys": self._auth.count, "authorized_keys_error": str(exc)}

    def stop(self) -> None:
        if self._thread is None:
            stuck, self._stuck = self._stuck, None
            if stuck is not None and stuck.is_alive():  # a stop before found it stuck: still is,
                self._stuck = stuck  # and its context, sockets and pipe stay with it (see below)
                return
            self._close_wake()
            self._close_all()
            return
        self.ctx.stopping.set()
        self._wake()
        thread = self._thread
        thread.join(STOP_JOIN_S)
        stuck = thread.is_alive()
        if stuck:
            log.warning("control thread did not stop within %.0f s; its sockets are left to the process exit",
                        STOP_JOIN_S)
        self._pool.shutdown(wait=True, cancel_futures=True)  # waiters see ``stopping`` and return at once
        try:
            if not stuck:  # the sockets are this thread's now
                self._flush_outbox()  # replies of commands that finished meanwhile (a snapshot, ``unavailable``)
                self._router.close(linger=STOP_LINGER_MS)  # let them leave (the context is destroyed with linger 0)
        finally:
            self._thread = None
            if stuck:  # closing its sockets or its wake pipe under a thread still in poll() aborts libzmq
                self._remove_files()  # (zmq sockets are not thread-safe); the daemon thread dies with us,
                self._stuck = thread  # or a later stop() closes them once it has ended
            else:
                self._close_wake()
                self._close_all()

    def _close_wake(self) -> None:
        wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
        for fd in (wake_r, wake_w):
            if fd >= 0:
                os.close(fd)

    def _close_all(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
        self._remove_files()

    def _remove_files(self) -> None:
        for path in self._files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._files.clear()

    # -- thread-safe entry points --------------------------------------------------------
    def publish(self, kind: str, **fields: Any) -> None:
        """Queue an event for the PUB socket (any thread; the daemon's listener signature)."""
        self._outbox.put(("event", kind, fields))
        self._wake()

    def _wake(self) -> None:
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):  # pipe full: a wake-up is pending anyway
            pass

    # -- the control thread ----------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_housekeeping = 0.0
        while not self.ctx.stopping.is_set():
            try:
                ready = dict(poller.poll(int(HOUSEKEEPING_S * 1000)))
                if self._router in ready:
                    self._drain_router()
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    self._flush_outbox()
                now = time.monotonic()
                if now >= next_housekeeping:
                    next_housekeeping = now + HOUSEKEEPING_S
                    self._housekeeping(now)
            except Exception:  # keep serving: a bug in one step must not silence the control plane
                log.exception("control thread: unexpected error; carrying on")
                time.sleep(0.01)
        self._flush_outbox()

    def _drain_router(self) -> None:
        """Handle the waiting requests (at most ``RECV_BATCH``). Asking ``EVENTS`` whether another
        one waits costs less than the ``Again`` that a receive on an empty socket raises."""
        router, auth = self._router, self._auth
        for _ in range(RECV_BATCH):
            try:
                frames, user = _recv_request(router, auth is not None)
            except zmq.Again:
                return
            try:
                if auth is not None and not auth.allows(user):  # its key was revoked since it connected
                    auth.refused_request(user)
                else:
                    self._handle(frames)
            except Exception:  # never let one request take the thread down
                log.exception("control: unexpected error while handling a request")
            if not router.getsockopt(_EVENTS) & _POLLIN:
                return

    def _handle(self, frames: list) -> None:
        route, body = _split_route(frames)
        request_id, cmd = None, INVALID_CMD
        try:
            self.limits.check_sizes([len(f) for f in body])
            head = body[0]
            try:
                header = parse_header(head)
            except RequestError:
                request_id = peek_id(head)  # answer with the id if it can be found
                raise
            request_id = header.id
            request_cls = COMMANDS.get(header.cmd)
            if request_cls is None:
                raise RequestError(ErrorCode.UNKNOWN_COMMAND,
                                   f"no command {header.cmd[:64]!r}; commands are {sorted(COMMANDS)}")
            cmd = header.cmd
            request = request_cls.decode(header.args, [f.buffer for f in body[1:]])
            handler = HANDLERS[request_cls]
            if handler.fast:
                result = handler.run(self.ctx, request)
                if not handler.read_only:
                    self.ctx.status_cache.invalidate()
                self._reply(route, cmd, encode_result(request_id, result), "ok")
            else:
                self._start_slow(route, cmd, request_id, handler, request)
        except RequestError as exc:
            self._reply(route, cmd, encode_error(request_id, exc.code, exc.message, exc.details), exc.code.value)
        except Exception as exc:
            log.exception("control: %s failed", cmd)
            self._reply(route, cmd, encode_error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"),
                        ErrorCode.INTERNAL.value)

    def _start_slow(self, route, cmd: str, request_id, handler: Handler, request) -> None:
        is_push = cmd == "push_weights"
        if self._slow_in_flight >= MAX_SLOW_IN_FLIGHT or (is_push and self._pushes_in_flight >= MAX_PUSHES_IN_FLIGHT):
            raise RequestError(ErrorCode.BUSY, f"too many {cmd if is_push else 'slow'} commands in flight; retry "
                                               "after the current ones finish")
        self._slow_in_flight += 1
        self._pushes_in_flight += is_push
        self._pool.submit(self._run_slow, route, cmd, request_id, handler, request, is_push)

    def _run_slow(self, route, cmd: str, request_id, handler: Handler, request, is_push: bool) -> None:
        """Pool thread: run the handler, queue the reply for the control thread."""
        try:
            reply, outcome = encode_result(request_id, handler.run(self.ctx, request)), "ok"
        except RequestError as exc:
            reply, outcome = encode_error(request_id, exc.code, exc.message, exc.details), exc.code.value
        except Exception as exc:
            log.exception("control: %s failed", cmd)
            reply = encode_error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            outcome = ErrorCode.INTERNAL.value
        self._outbox.put(("reply", route, cmd, reply, outcome, is_push, handler.read_only))
        self._wake()

    def _reply(self, route: list, cmd: str, reply: bytes, outcome: str) -> None:
        self.ctx.daemon.telemetry.observe_request(cmd, outcome)
        router = self._router
        try:
            for part in route:
                router.send(part, _SEND_MORE)
            router.send(reply, _NOBLOCK)
        except zmq.ZMQError:  # peer gone or its queue full: replies are not retried; the client retries
            pass

    def _flush_outbox(self) -> None:
        while not self._outbox.empty():  # the control thread is its only reader
            item = self._outbox.get_nowait()
            if item[0] == "reply":
                _, route, cmd, reply, outcome, is_push, read_only = item
                self._slow_in_flight -= 1
                self._pushes_in_flight -= is_push
                if not read_only:
                    self.ctx.status_cache.invalidate()  # the change is acknowledged: a status after it shows it
                self._reply(route, cmd, reply, outcome)
            else:
                self._send_event(item[1], item[2])

    def _send_event(self, kind: str, fields: dict) -> None:
        self.ctx.status_cache.invalidate()  # a status asked after the event shows its cause
        self._event_seq += 1
        try:
            body = dumps({"v": PROTOCOL_VERSION, "event": kind, "seq": self._event_seq, "time": time.time(),
                          **{k: v for k, v in fields.items() if k not in ("v", "event", "seq", "time")}})
        except (TypeError, ValueError):
            body = dumps({"v": PROTOCOL_VERSION, "event": kind, "seq": self._event_seq, "time": time.time(),
                          "fields": repr(fields)[:1000]})
        try:
            self._pub.send_multipart([kind.encode(), body], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # best-effort: state stays queryable over the ROUTER

    def _housekeeping(self, now: float) -> None:
        if now >= self._next_file_check:
            self._next_file_check = now + SOCKET_FILE_CHECK_S
            self._rebind_lost_files()
            self._fds.check()  # near the open-file limit: said before libzmq aborts at it
        daemon = self.ctx.daemon
        if daemon.layout is None or daemon.supervisor is None:
            return
        stats = daemon.layout.stats
        frames = {}
        for index in self.ctx.slots():
            rec = stats[index]
            frames[index] = int(rec["frames"])
            version = int(rec["weights_version"])
            if version and self._applied.get(index) not in (None, version) and int(rec["state"]) != State.EMPTY:
                self._send_event("weights.applied", {"worker": index, "version": version})
            self._applied[index] = version
        self.ctx.rates.sample(now, frames)


    def _rebind_lost_files(self) -> None:
        """Bind again an ipc socket whose file was deleted or replaced (``systemd-tmpfiles`` ageing
        /tmp, an operator tidying the runtime dir): nobody could connect to the daemon any more."""
        for entry in self._ipc:
            sock, address, path, identity, failed = entry
            if _identity(path) == identity:
                continue
            if not failed:
                log.warning("control: the socket file %s was deleted or replaced; binding it again", path)
            try:  # no unbind: that would drop the clients connected through the old file
                bind_without_curve(sock, address)
                entry[3], entry[4] = _identity(path), False
            except (zmq.ZMQError, OSError) as exc:  # tried again at the next check; said once
                if not failed:
                    log.error("control: cannot bind %s again (%s); retrying every %.0f s", address, exc,
                              SOCKET_FILE_CHECK_S)
                entry[4] = True


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# Plain ints: pyzmq's flag enums cost a microsecond per operation, and each request made several.
_NOBLOCK, _SEND_MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)


def _local(address: str, path) -> str | None:
    """The local ipc endpoint bound beside a tcp:// ``address`` (None for an ipc one)."""
    return f"ipc://{path}" if address.startswith("tcp://") else None


def _recv_request(router: zmq.Socket, who: bool = False) -> tuple[list, str | None]:
    """One request's frames (``zmq.Again`` if none waits) and, with ``who``, the CURVE user id
    (the client's public key, Z85) the ZAP handler gave its connection. The routing envelope and
    the header come as bytes, the payloads after the header (weights) as zero-copy
    ``zmq.Frame``s. A request without payloads is all bytes, which costs less than a ``Frame``
    per part."""
    user = None
    if who:
        first = router.recv(_NOBLOCK, copy=False)
        try:
            user = first.get("User-Id")
        except zmq.ZMQError:  # none: it came through the local ipc listener, which has no CURVE
            user = None
        frames = [first.bytes]
    else:
        frames = [router.recv(_NOBLOCK)]
    copy = True
    while router.getsockopt(_RCVMORE):
        frame = router.recv(_NOBLOCK, copy=copy)
        frames.append(frame)
        copy = copy and not frame  # the first non-empty frame after the routing id is the header
    return frames, user


def _split_route(frames: list) -> tuple[list, list]:
    """``(routing envelope, body)``: a REQ peer adds an empty delimiter, a DEALER does not."""
    if len(frames) >= 2 and len(frames[1]) == 0:
        return [frames[0], b""], frames[2:]
    return [frames[0]], frames[1:]
