"""Benchmark the control plane against a real daemon; prints one JSON object.

    python benchmarks/bench_control.py [--workers 2] [--num-envs 64] [--chunk-steps 16]
                                       [--pauses 30] [--params 1000000 25000000] [--quick]

- pause / resume: latency from request to reply (the reply comes once every
  live worker acknowledged), and the moment the last worker's stats block
  said so, seen by a poller in this process; frames lost across all pauses
  (Checksum env: every (worker, env) stream must stay contiguous) and rows
  written while paused.
- push_weights: request to reply with wait=True (every worker applied it),
  for ~1M and ~25M float32 parameters (random, so lz4 cannot shrink them),
  next to a raw lz4 compress + decompress + memcpy of the same bytes measured
  in this process.
- ping / status: closed-loop throughput and p99; then status at a fixed
  1,000 requests/s while the workers collect, and the ingest rate with and
  without that load (alternating windows).

Uses ``tests/daemon_proc.py`` (the test harness) and ``tests/control_plugins.py``
(a policy whose weights size is a parameter). Targets are checked in "targets".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import lz4.frame
import numpy as np
import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from control_plugins import weights  # noqa: E402
from daemon_proc import DaemonProc  # noqa: E402

from ingestd import ControlClient  # noqa: E402
from ingestd.collect.stats import State, StatsBlock  # noqa: E402


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"n": len(s), "p50_ms": ms(pick(0.5)), "p99_ms": ms(pick(0.99)), "max_ms": ms(s[-1]),
            "mean_ms": ms(statistics.fmean(s))}


def start(args, env: str, pad: int = 0, capacity: int = 2_000_000) -> DaemonProc:
    overrides = {"workers.count": args.workers, "workers.num_envs": args.num_envs,
                 "workers.chunk_steps": args.chunk_steps, "workers.env": env,
                 "workers.policy": "control_plugins:readable", "workers.policy_kwargs": {"pad": pad},
                 "replay.capacity": capacity, "metrics.enabled": False,
                 "control.max_message_bytes": 512 << 20, "control.ack_timeout_s": 30.0}
    d = DaemonProc(overrides=overrides, env={"PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    d.start()
    with ControlClient(d.control_address, timeout=1.0, retries=0) as c:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert d.proc.poll() is None, d.log()
            try:
                if all(w.frames > 0 for w in c.status().workers):
                    break
            except Exception:
                pass
            time.sleep(0.1)
    time.sleep(1.0)  # let the collection settle
    return d


def chunk_seconds(stats: StatsBlock, workers: int) -> float:
    samples = []
    for _ in range(20):
        samples += [float(stats[i]["chunk_seconds"]) for i in range(workers)]
        time.sleep(0.01)
    return statistics.median(samples)


def all_in(stats: StatsBlock, workers: int, state: State, stop: threading.Event, out: list) -> None:
    """Poll the stats blocks; record when every worker is in ``state``."""
    while not stop.is_set():
        if all(int(stats[i]["state"]) == state for i in range(workers)):
            out.append(time.perf_counter())
            return
        time.sleep(0.0001)


def bench_pause(args) -> dict:
    d = start(args, "Checksum")
    try:
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        chunk = chunk_seconds(stats, args.workers)
        c = ControlClient(d.control_address, timeout=10)
        first = c.status().replay.write_count
        lat = {"pause": [], "resume": [], "pause_acked": [], "resume_acked": []}
        written_while_paused = 0
        for _ in range(args.pauses):
            for verb, target in (("pause", State.PAUSED), ("resume", State.RUNNING)):
                seen, stop = [], threading.Event()
                watcher = threading.Thread(target=all_in, args=(stats, args.workers, target, stop, seen))
                t0 = time.perf_counter()
                watcher.start()
                getattr(c, verb)()
                t1 = time.perf_counter()
                stop.set()
                watcher.join()
                lat[verb].append(t1 - t0)
                lat[f"{verb}_acked"].append((seen[0] if seen else t1) - t0)
                if verb == "pause":
                    frozen = c.status().replay.write_count
                    time.sleep(0.02)
                    written_while_paused += c.status().replay.write_count - frozen
                else:
                    time.sleep(0.05 + np.random.rand() * chunk)  # resume at a random point in a chunk
        time.sleep(0.2)
        last = c.status().replay.write_count
        c.close()
        stats.close()
        lost, checked = frames_lost(d.replay_path, first, last)
    finally:
        d.close()
    return {"chunk_ms": ms(chunk), "pause": summary(lat["pause"]), "resume": summary(lat["resume"]),
            "pause_all_acked_seen": summary(lat["pause_acked"]),
            "resume_all_acked_seen": summary(lat["resume_acked"]),
            "pauses": args.pauses, "rows_checked": checked, "frames_lost": lost,
            "rows_written_while_paused": written_while_paused}


def frames_lost(replay_path, first: int, last: int) -> tuple[int, int]:
    """Missing (or repeated) steps per (worker, env) stream among rows with write index in [first, last)."""
    from control_daemon import rows_between

    rows = rows_between(replay_path, first, last)
    w, e = rows.get(("ingestd", "worker")), rows.get(("ingestd", "env"))
    episode, step = rows.get(("ingestd", "episode")), rows.get(("ingestd", "step"))
    done = rows.get(("next", "done")).reshape(-1)
    bad = 0
    for worker in w.unique().tolist():
        for env in e.unique().tolist():
            idx = ((w == worker) & (e == env)).nonzero().squeeze(-1)
            a, b = idx[:-1], idx[1:]
            ok = torch.where(done[a], (episode[b] == episode[a] + 1) & (step[b] == 0),
                             (episode[b] == episode[a]) & (step[b] == step[a] + 1))
            bad += int((~ok).sum())
    return bad, len(rows)


def baseline(n: int, repeat: int) -> dict:
    raw = (torch.randn(n + 1) * 0.02).numpy().view(np.uint8)
    target = np.empty_like(raw)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        packed = lz4.frame.compress(raw, block_size=lz4.frame.BLOCKSIZE_MAX4MB, content_checksum=True)
        out = lz4.frame.decompress(packed)
        np.copyto(target, np.frombuffer(out, np.uint8))
        times.append(time.perf_counter() - t0)
    return summary(times)


def bench_push(args, n: int) -> dict:
    repeat = args.pushes if n <= 2_000_000 else max(3, args.pushes // 3)
    d = start(args, "CartPole", pad=n, capacity=400_000)
    try:
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        chunk = chunk_seconds(stats, args.workers)
        stats.close()
        c = ControlClient(d.control_address, timeout=30)
        from ingestd.weights.wire import encode

        encode_s, push_s, server_s = [], [], []
        for i in range(repeat + 1):
            state = weights(float(i), pad=n)
            state["pad"] = torch.randn(n) * 0.02
            t0 = time.perf_counter()
            frames = encode(state)
            encode_s.append(time.perf_counter() - t0)
            from ingestd.control.commands import PushWeights, Pushed

            t1 = time.perf_counter()
            pushed = Pushed.from_json(c.call(PushWeights(wait=True, timeout_s=30.0, frames=tuple(frames))))
            push_s.append(time.perf_counter() - t1)
            server_s.append(pushed.seconds)
            assert pushed.applied == list(range(args.workers)), pushed
            time.sleep(0.1 + np.random.rand() * chunk)
        c.close()
    finally:
        d.close()
    return {"params": n + 1, "bytes": 4 * (n + 1), "chunk_ms": ms(chunk),
            "client_encode": summary(encode_s[1:]), "request_to_all_applied": summary(push_s[1:]),
            "daemon_receipt_to_all_applied": summary(server_s[1:]),
            "baseline_lz4_roundtrip_plus_memcpy": baseline(n, repeat)}


def ingest_rate(c: ControlClient, seconds: float) -> float:
    w0, t0 = c.status().replay.write_count, time.perf_counter()
    time.sleep(seconds)
    return (c.status().replay.write_count - w0) / (time.perf_counter() - t0)


def load(address: str, rate: float, seconds: float, out: list) -> None:
    """Open loop: one status request every 1/rate s; latency measured from the scheduled time."""
    with ControlClient(address, timeout=5) as c:
        start_t = time.perf_counter()
        k = 0
        while True:
            due = start_t + k / rate
            now = time.perf_counter()
            if due - start_t >= seconds:
                return
            if due > now:
                time.sleep(due - now)
            c.status()
            out.append(time.perf_counter() - due)
            k += 1


def bench_queries(args) -> dict:
    d = start(args, "CartPole")
    try:
        c = ControlClient(d.control_address, timeout=5)
        result = {}
        for name, call in (("ping", c.ping), ("status", c.status)):
            lat, t_end = [], time.perf_counter() + args.window
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                call()
                lat.append(time.perf_counter() - t0)
            result[f"{name}_closed_loop"] = {"per_s": round(len(lat) / args.window), **summary(lat)}
        base, loaded, lat = [], [], []
        for _ in range(args.rounds):
            base.append(ingest_rate(c, args.window))
            worker = threading.Thread(target=load, args=(d.control_address, 1000.0, args.window, lat))
            worker.start()
            loaded.append(ingest_rate(c, args.window))
            worker.join()
        c.close()
    finally:
        d.close()
    result["status_at_1000_per_s"] = {"achieved_per_s": round(len(lat) / (args.window * args.rounds)),
                                      **summary(lat)}
    idle, busy = statistics.fmean(base), statistics.fmean(loaded)
    result["ingest_rows_per_s"] = {"idle": round(idle), "under_status_load": round(busy),
                                   "slowdown_pct": round(100 * (1 - busy / idle), 2),
                                   "idle_windows": [round(r) for r in base], "loaded_windows": [round(r) for r in loaded]}
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--chunk-steps", type=int, default=16)
    p.add_argument("--pauses", type=int, default=30)
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--params", type=int, nargs="*", default=[1_000_000, 25_000_000])
    p.add_argument("--window", type=float, default=3.0, help="seconds per measurement window")
    p.add_argument("--rounds", type=int, default=3, help="idle/loaded window pairs for the ingest slowdown")
    p.add_argument("--quick", action="store_true", help="few repetitions (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.pauses, args.pushes, args.window, args.rounds = 5, 3, 1.0, 1
    torch.set_num_threads(1)
    out = {"settings": {k: v for k, v in vars(args).items()}, "cpus": len(os.sched_getaffinity(0)),
           "loadavg_1m_before": round(os.getloadavg()[0], 2)}
    out["pause"] = bench_pause(args)
    out["push_weights"] = [bench_push(args, n - 1) for n in args.params]
    out.update(bench_queries(args))
    out["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # > cpus: other processes shared the machine
    chunk = out["pause"]["chunk_ms"]
    push_1m = next((r for r in out["push_weights"] if r["params"] <= 2_000_000), None)
    out["targets"] = {
        "pause_p99_within_chunk_plus_10ms": out["pause"]["pause"]["p99_ms"] <= chunk + 10,
        "frames_lost_zero": out["pause"]["frames_lost"] == 0 and out["pause"]["rows_written_while_paused"] == 0,
        "push_1m_p99_within_chunk_plus_50ms": None if push_1m is None else
        push_1m["request_to_all_applied"]["p99_ms"] <= push_1m["chunk_ms"] + 50,
        "status_p99_at_1000_per_s_le_5ms": out["status_at_1000_per_s"]["p99_ms"] <= 5,
        "ingest_slowdown_le_5pct": out["ingest_rows_per_s"]["slowdown_pct"] <= 5,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
