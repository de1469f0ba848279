"""Paired worker efficiency: ingestd's per-worker rate and the in-process limit, measured
alternately inside one daemon run with the same number of busy cores. Prints JSON.

    flock /tmp/ingestd-bench.lock python benchmarks/bench_efficiency.py [--cases cartpole,gym_cartpole]
        [--workers 1,2] [--rounds 5] [--window 3]

Why: on a shared VM the machine's speed drifts by tens of percent within minutes, so a
limit measured minutes before or after a daemon run (as ``bench_ingest.py`` does) can be
far from the machine's speed during it; two bench_ingest runs of the same code at load ~1
gave CartPole 2-worker efficiencies of 0.72 and 0.65, and gymnasium 1.08 and 0.61.

After ``--warmup`` seconds of collection (and, for a case with ``warm_laps``, until the ring
was written that many times per worker: first-touch page faults, ``warm_until``), each
round, inside one running daemon (``tests/daemon_proc.py``; everything it made is
removed at the end):

1. the daemon collects for one window, from one move of the storage's ``write_count`` to
   another (``next_commit``), and the rate is the rows between them over that time;
2. ``pause`` (acknowledged by every worker: they hold still), then ``workers`` limit
   processes run concurrently for one window: each is the bare env + policy loop of
   ``bench_env_loop.inprocess_rate`` (no storage, no stamps, no IPC), started once before
   the first round and kept waiting on a pipe, with one torch thread like the workers;
3. ``resume``, and a short settle before the next round.

Round k's efficiency is the daemon's per-worker rate over the mean limit-process rate of
round k. The report gives every round and the median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_ingest import IngestCase, load, make_cases, wait_first_frame  # noqa: E402
from daemon_proc import DaemonProc  # noqa: E402

SETTLE_S = 0.5  # after resume, before the daemon's window: workers back at speed


def limit_child(case_json: str) -> None:
    """A limit process: build the loop, say ``ready``, then answer ``go SECONDS`` with a rate."""
    import torch

    from bench_env_loop import Case, inprocess_rate
    from ingestd.collect.worker import keep_heap

    keep_heap()  # the workers' allocator settings: without them the Pixels limit read 2-3x low
    torch.set_num_threads(1)
    env, policy = Case(**json.loads(case_json)).build(seed=0)
    inprocess_rate(env, policy, seconds=0.3)  # warm
    print("ready", flush=True)
    for line in sys.stdin:
        print(inprocess_rate(env, policy, seconds=float(line.split()[1])), flush=True)


class Limits:
    """``n`` waiting limit processes of one case (stopped by PID on exit)."""

    def __init__(self, case: IngestCase, n: int):
        spec = case.loop_case()
        text = json.dumps({"env": spec.env, "num_envs": spec.num_envs, "policy": spec.policy,
                           "env_kwargs": spec.env_kwargs, "policy_kwargs": spec.policy_kwargs})
        self.procs = []
        try:
            for _ in range(n):
                self.procs.append(subprocess.Popen([sys.executable, __file__, "--limit-child", text],
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for p in self.procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"limit process {p.pid} did not start (exit code {p.poll()})")
        except BaseException:  # __exit__ is not called when the constructor fails: stop them here
            for p in self.procs:
                p.kill()
                p.wait()
            raise

    def run(self, seconds: float) -> list[float]:
        for p in self.procs:  # all start within microseconds of each other
            p.stdin.write(f"go {seconds}\n")
            p.stdin.flush()
        return [float(p.stdout.readline()) for p in self.procs]

    def __enter__(self) -> "Limits":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.stdin.close()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def next_commit(reader, timeout: float = 30.0) -> tuple[float, int]:
    """``(time, write_count)`` when ``write_count`` next moves (a worker took its chunk's
    slots: at a chunk's end, or with image rows at its start). A window from one move to another
    counts one worker's chunks whole; with several, it is off by a fraction of a chunk, where
    a window of fixed length was off by up to a chunk per worker (~8 % of a 3 s window of
    64 x 64 Pixels rows)."""
    count, deadline = reader.write_count, time.perf_counter() + timeout
    while reader.write_count == count:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"no commit within {timeout} s (write_count {count})")
        time.sleep(0.0002)
    return time.perf_counter(), reader.write_count


def warm_until(reader, laps: float, timeout: float = 120.0) -> None:
    """Wait until the ring was written ``laps`` times over. Each process maps the ring's pages
    on its first touch of them (0.7 s per GB of page faults in a bare copy loop here), and a
    fresh 1.8 GB Pixels ring wrote at 8k frames/s for its first 5 s, not 80-100k: the first
    round read an efficiency of 0.07 (two runs). ``workers`` laps give each worker most pages."""
    deadline = time.perf_counter() + timeout
    while reader.write_count < laps * reader.capacity and time.perf_counter() < deadline:
        time.sleep(0.05)


def paired(case: IngestCase, workers: int, rounds: int, window: float, warmup: float) -> dict[str, Any]:
    from ingestd.control import ControlClient

    out: dict[str, Any] = {"workers": workers, "load_average_before": load(), "rounds": []}
    d = DaemonProc(overrides=case.overrides(workers), launch="exec")  # as a user runs it, not forked
    with d, Limits(case, workers) as limits:
        _, reader = wait_first_frame(d, time.perf_counter(), timeout=120)
        client = ControlClient(d.control_address, timeout=30)
        try:
            time.sleep(warmup)
            warm_until(reader, case.warm_laps * workers)
            for _ in range(rounds):
                t0, c0 = next_commit(reader)
                time.sleep(window)
                t1, c1 = next_commit(reader)
                rate = (c1 - c0) / (t1 - t0)
                client.pause()
                limit = limits.run(window)
                client.resume()
                per_worker = rate / workers
                out["rounds"].append({"per_worker_frames_per_s": round(per_worker),
                                      "limit_frames_per_s": [round(x) for x in limit],
                                      "efficiency": round(per_worker / statistics.mean(limit), 3),
                                      "load_average": load()})
                time.sleep(SETTLE_S)
        finally:
            client.close()
            reader.close()
        d.stop(timeout=30)
    out["efficiency_median"] = statistics.median(r["efficiency"] for r in out["rounds"])
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="cartpole,gym_cartpole,pixels")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=float, default=3.0, help="seconds per daemon and per limit window")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of collection before the first round")
    parser.add_argument("--chunk-steps", type=int, default=64, help="workers.chunk_steps of the cases (the daemon's default)")
    parser.add_argument("--gym-envs", type=int, default=64)
    parser.add_argument("--pixels-envs", type=int, default=64)
    parser.add_argument("--limit-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.limit_child:
        limit_child(args.limit_child)
        return {}
    cases = make_cases(args)
    report: dict[str, Any] = {"benchmark": "efficiency_paired", "cpu_count": os.cpu_count(),
                              "load_average_start": load(), "target": 0.9,
                              "settings": {"rounds": args.rounds, "window_s": args.window, "warmup_s": args.warmup,
                                           "chunk_steps": args.chunk_steps}, "cases": {}}
    for name in [c for c in args.cases.split(",") if c]:
        case = cases[name]
        report["cases"][name] = {"case": case.describe(),
                                 "runs": [paired(case, int(w), args.rounds, args.window, args.warmup)
                                          for w in args.workers.split(",") if w]}
    report["summary"] = {f"{name} {run['workers']}w": run["efficiency_median"]
                         for name, c in report["cases"].items() for run in c["runs"]}
    report["load_average_end"] = load()
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    from ingestd.service.tunables import exec_with_copy_tunable

    exec_with_copy_tunable()  # the copy mode `ingestd run` gives its workers, here and in the limits
    main()
