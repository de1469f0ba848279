"""The CPU floor of a ZeroMQ request on this machine, with no ingestd in it; prints JSON.

    flock /tmp/ingestd-bench.lock python benchmarks/bench_zmq_floor.py [--rate 1000] [--seconds 5]

A bare ROUTER echo server and a DEALER client, each in its own process, over an ipc://
socket in a temporary directory: the client sends a small JSON request at a fixed rate
(an open loop, like bench_control's status load) and waits for the echo. Each side
reports the CPU its whole process used per request (user + system, ZeroMQ's I/O thread
included). This is what any ZeroMQ control plane pays per request before it does any
work, so it bounds what ``bench_control.py``'s "ingest slowdown under 1,000 status
requests/s" can reach when the workers already use every core: the share of the
machine is ``(server + client) * rate / cores``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import tempfile
import time


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _server(address: str, n: int, ready, out) -> None:
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as sock:
        sock.bind(address)
        ready.set()
        sock.send_multipart(sock.recv_multipart())  # the client's warm-up request
        start = _cpu()
        for _ in range(n):
            sock.send_multipart(sock.recv_multipart())
        out.put(("server", (_cpu() - start) / n))
        sock.setsockopt(zmq.LINGER, 1000)


def _client(address: str, n: int, rate: float, out) -> None:
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.connect(address)
        sock.send_multipart([b'{"v": 1, "id": 0, "cmd": "ping", "args": {}}'])
        sock.recv_multipart()
        start, t0 = _cpu(), time.monotonic()
        for i in range(n):
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            sock.send_multipart([json.dumps({"v": 1, "id": i, "cmd": "status", "args": {}}).encode()])
            sock.recv_multipart()
        out.put(("client", (_cpu() - start) / n, n / (time.monotonic() - t0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    n = max(1, int(args.rate * args.seconds))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ingestd-zmq-floor-") as tmp:
        address = f"ipc://{tmp}/echo.sock"
        ready, out = ctx.Event(), ctx.Queue()
        server = ctx.Process(target=_server, args=(address, n, ready, out))
        server.start()
        try:
            if not ready.wait(60):
                raise SystemExit("the echo server did not start")
            client = ctx.Process(target=_client, args=(address, n, args.rate, out))
            client.start()
            client.join(args.seconds * 4 + 60)
            results = {}
            for _ in range(2):
                kind, cpu, *rest = out.get(timeout=30)
                results[kind] = (cpu, *rest)
        finally:
            for proc in (server, locals().get("client")):
                if proc is not None and proc.is_alive():
                    proc.kill()
                if proc is not None:
                    proc.join(10)
    server_us, client_us = results["server"][0] * 1e6, results["client"][0] * 1e6
    cores = len(os.sched_getaffinity(0))
    print(json.dumps({
        "benchmark": "zmq_floor", "cores": cores, "loadavg": os.getloadavg(),
        "settings": {"rate_per_s": args.rate, "requests": n, "transport": "ipc", "pattern": "DEALER -> ROUTER echo"},
        "achieved_per_s": round(results["client"][1], 1),
        "cpu_us_per_request": {"server": round(server_us, 1), "client": round(client_us, 1)},
        "machine_share_at_rate": round((server_us + client_us) * 1e-6 * args.rate / cores, 4),
    }, indent=1))


if __name__ == "__main__":
    main()
