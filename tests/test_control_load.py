"""A lean status-load client, and its test.

The control-load figures (scenario 8 in test_reliability_control.py, ``bench_control.py``) are
taken with the clients on the same 2 vCPUs as the workers, so whatever CPU a client spends per
request is taken from collection and counted as "ingest slowdown". ``ControlClient.status``
decodes every reply into dataclasses (~150-200 us of CPU per request); this client sends one
pre-built header on a raw DEALER socket and checks only the reply's prefix (id and ``"ok":true``),
about 40 us. It imports only the standard library, zmq, numpy and pytest, so it starts fast.

Run as a load process: ``python tests/test_control_load.py ADDRESS RATE START WINDOW ROUNDS OUT [lean|client]``
(what ``status_load`` says; ``START`` is a ``time.monotonic()`` value).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time

import numpy as np
import pytest
import zmq

REQUEST = b'{"v":1,"id":%d,"cmd":"status","args":{}}'
REPLY_PREFIX = b'{"v":1,"id":%d,"ok":true,'
TIMEOUT_MS = 5000


class StatusProbe:
    """One DEALER socket sending ``status`` requests and checking the replies cheaply."""

    def __init__(self, address: str, context: zmq.Context | None = None):
        self._context = context or zmq.Context()
        self._own_context = context is None
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._next = 0

    def status(self) -> bytes:
        """One request; the raw reply. ``AssertionError`` if none comes or it is not a success."""
        self._next += 1
        self._socket.send(REQUEST % self._next)
        assert self._socket.poll(TIMEOUT_MS), f"no reply to status request {self._next}"
        reply = self._socket.recv()
        assert reply.startswith(REPLY_PREFIX % self._next), reply[:300]
        return reply

    def close(self) -> None:
        self._socket.close(0)
        if self._own_context:
            self._context.term()


class ClientProbe:
    """The same interface over ``ControlClient`` (decodes every reply; heavier on the client CPU)."""

    def __init__(self, address: str):
        from ingestd.control.client import ControlClient

        self._client = ControlClient(address, timeout=TIMEOUT_MS / 1000, retries=0)

    def status(self):
        return self._client.status()

    def close(self) -> None:
        self._client.close()


PROBES = {"lean": StatusProbe, "client": ClientProbe}


def status_load(address: str, rate: float, start: float, window: float, rounds: int, out: str,
                client: str = "lean") -> None:
    """Open loop: ``rate`` status requests/s during the loaded windows
    ``[start + (2k+1) * window, start + (2k+2) * window)``, k < ``rounds``; saves to ``out`` (npz)
    each request's latency (send to reply, seconds), its lateness against the schedule, the
    CPU seconds this client spent in the loaded windows, and ``in_window``: how many requests
    were sent before their window closed. (The number of requests is fixed by the schedule; a
    client that falls behind sends them late, after its window, where they load nothing.)"""
    latency, late, cpu, in_window = [], [], 0.0, 0
    probe = PROBES[client](address)
    try:
        for k in range(rounds):
            t0, t1 = start + (2 * k + 1) * window, start + (2 * k + 2) * window
            cpu0 = time.process_time()
            # the count, fixed up front: `t0 + n / rate < t1` let floating-point rounding add one
            for n in range(round((t1 - t0) * rate)):
                due = t0 + n / rate
                now = time.monotonic()
                if due > now:
                    time.sleep(due - now)
                sent = time.monotonic()
                probe.status()
                latency.append(time.monotonic() - sent)
                late.append(sent - due)
                in_window += sent < t1
            cpu += time.process_time() - cpu0
    finally:
        probe.close()
    np.savez(out, latency=np.array(latency), late=np.array(late), cpu_s=np.array(cpu), in_window=np.array(in_window))


@contextlib.contextmanager
def fake_daemon(ok: bool, reply_after_s: float = 0.0):
    """A ROUTER on a random TCP port answering every status request like the daemon: success,
    or (``ok=False``) an error; each reply ``reply_after_s`` seconds after its request."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    body = b'"result":{}}' if ok else b'"error":{"code":"busy","message":""}}'

    def serve():
        while not stop.is_set():
            if router.poll(50):
                route, head = router.recv_multipart()
                time.sleep(reply_after_s)
                request_id = int(head.split(b'"id":', 1)[1].split(b",", 1)[0])
                router.send_multipart([route, b'{"v":1,"id":%d,"ok":%s,%s' % (request_id, b"true" if ok else b"false",
                                                                          body)])

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        server.join()
        router.close(0)
        context.term()


def test_status_load_keeps_its_schedule(tmp_path):
    out = tmp_path / "load.npz"
    with fake_daemon(ok=True) as address:
        status_load(address, 200.0, time.monotonic(), 0.25, 2, str(out))
    got = np.load(out)
    assert 90 <= got["latency"].size <= 101  # 2 loaded windows of 0.25 s at 200 requests/s
    assert got["late"].min() >= 0 and float(got["cpu_s"]) > 0
    assert 0 < int(got["in_window"]) <= got["latency"].size


def test_a_client_behind_its_schedule_is_seen_to_be(tmp_path):
    """A daemon answering in 20 ms cannot take 200 requests/s from one client: all 20 requests of
    a 0.1 s window still go out (the schedule fixes their number), but at most 6 inside it."""
    out = tmp_path / "load.npz"
    with fake_daemon(ok=True, reply_after_s=0.02) as address:
        status_load(address, 200.0, time.monotonic(), 0.1, 1, str(out))
    got = np.load(out)
    assert got["latency"].size == 20 and int(got["in_window"]) <= 6, dict(got)
    assert got["late"].max() >= 0.2  # the last one went out a whole window late


def test_status_probe_refuses_an_error_reply():
    with fake_daemon(ok=False) as address:
        probe = StatusProbe(address)
        try:
            with pytest.raises(AssertionError, match="ok.:false"):
                probe.status()
        finally:
            probe.close()


if __name__ == "__main__":
    address, rate, start, window, rounds, out, *kind = sys.argv[1:]
    status_load(address, float(rate), float(start), float(window), int(rounds), out, *kind)
