"""Sampling benchmark: uniform, prioritized and sequence sampling throughput, and
update_priorities throughput, while 2 writer processes write CartPole chunks. Prints JSON.

    flock /tmp/ingestd-bench.lock python benchmarks/bench_sampling.py [--capacity 1000000] [--seconds 2]

The storage (under /dev/shm, removed at the end) is first filled with real CartPole
rollouts (64 sub-envs x 16 steps per chunk, 4 simulated workers), so sequences follow
real trajectories. The 2 writers run at the daemon's worker niceness (+5), as its workers
do (``--writers-nice 0`` for writers as busy as the sampler). Every rate is given per
wall-clock second (``..._per_s``) and per CPU-second of the sampling process (``..._per_cpu_s``: less sensitive to other load on
the machine), with the load average before and after; "targets" says whether the
issue's targets are met. TorchRL is compared when importable (optional).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import torch

from ingestd.collect.envs import CartPole
from ingestd.collect.interfaces import EnvContext, episode_base_of
from ingestd.collect.policies import Random
from ingestd.collect.rollout import Rollout
from ingestd.collect.worker import WORKER_NICE
from ingestd.replay import ReplayReader, ReplayStorage

NUM_ENVS, CHUNK = 64, 16
TARGETS = {"prioritized_sample_256_per_s": 5000,  # issue #8: prioritized sample(256) calls/s, 2 writers
           "prioritized_sample_256_into_per_s": 5000}  # the same, into a reused batch (sample(out=))


def rollout(worker: int) -> Rollout:
    env = CartPole(EnvContext(num_envs=NUM_ENVS, seed=worker, worker=worker, episode_base=episode_base_of(worker),
                              device="cpu"))
    return Rollout(env, Random(env.spec, seed=worker), worker, episode_base_of(worker), CHUNK)


def writer(path: str, worker: int, stop, nice: int) -> None:
    torch.set_num_threads(1)
    os.nice(nice)  # by default as the daemon's workers run: collectors yield to the trainer
    r = rollout(worker)
    with ReplayStorage.open(path) as store:
        while not stop.value:
            store.write(r.chunk(0)[0])


def rate(fn, seconds: float) -> tuple[float, float]:
    """Calls per wall-clock second and per CPU-second of this process."""
    fn()
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0), n / max(time.process_time() - c0, 1e-9)


def measure(path: str, seconds: float) -> dict:
    out: dict = {}

    def record(name: str, fn, digits: int = 1) -> None:
        wall, cpu = rate(fn, seconds)
        out[f"{name}_per_s"], out[f"{name}_per_cpu_s"] = round(wall, digits), round(cpu, digits)

    with ReplayReader(path, seed=0) as uni, ReplayReader(path, seed=1, sampler="prioritized") as pri:
        for b in (256, 4096):
            record(f"uniform_sample_{b}", lambda: uni.sample(b))
            record(f"prioritized_sample_{b}", lambda: pri.sample(b))
            record(f"sequences_{b}x16", lambda: uni.sample_sequences(b, 16), 2)
        into_uni, into_pri = uni.empty_batch(256), pri.empty_batch(256)  # sample(out=): a reused batch
        record("uniform_sample_256_into", lambda: uni.sample(256, out=into_uni))
        record("prioritized_sample_256_into", lambda: pri.sample(256, out=into_pri))
        s = pri.sample(256)
        prio = np.random.default_rng(0).uniform(0.1, 2.0, 256)
        record("update_priorities_256", lambda: pri.update_priorities(s, prio))
    return out


def targets(results: dict) -> dict:
    return {f"{key} >= {goal}": ("met" if results[key] >= goal else "missed") + f" ({results[key]})"
            for key, goal in TARGETS.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--writers-nice", type=int, default=WORKER_NICE,
                    help="niceness of the 2 writers (default: the daemon's workers', +5)")
    args = ap.parse_args()
    if args.writers_nice < 0:
        ap.error(f"--writers-nice must be >= 0 (a niceness increment), got {args.writers_nice}")
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="ingestd-bench-", dir="/dev/shm")
    path = os.path.join(root, "replay")
    procs = []
    try:
        rolls = [rollout(w) for w in range(4)]
        t0 = time.perf_counter()
        first = rolls[0].chunk(0)[0]
        store = ReplayStorage.create(path, first, args.capacity)
        store.write(first)
        while store.write_count < args.capacity:
            for r in rolls:
                store.write(r.chunk(0)[0])
        fill_s = time.perf_counter() - t0
        ctx = mp.get_context("fork")
        stop = ctx.Value("b", 0, lock=False)
        procs = [ctx.Process(target=writer, args=(path, 10 + w, stop, args.writers_nice), daemon=True) for w in range(2)]
        for p in procs:
            p.start()
        results: dict = {"capacity": args.capacity, "fill_seconds": round(fill_s, 1), "writers": 2,
                         "writers_nice": args.writers_nice,
                         "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                         "loadavg_before": os.getloadavg()}
        w0 = store.write_count
        t0 = time.perf_counter()
        results.update(measure(path, args.seconds))
        results["writer_rows_per_s_during"] = round((store.write_count - w0) / (time.perf_counter() - t0))
        results["loadavg_after"] = os.getloadavg()
        results["targets"] = targets(results)
        try:
            import torchrl
        except ImportError:
            results["torchrl"] = "not installed (pip install torchrl to compare)"
        else:
            from torchrl_compare import measure as torchrl_measure

            results["torchrl"] = torchrl.__version__
            results.update(torchrl_measure(path, args.capacity, args.seconds, rate))
        stop.value = 1
        for p in procs:
            p.join(10)
        store.close()
        print(json.dumps(results, indent=2))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
