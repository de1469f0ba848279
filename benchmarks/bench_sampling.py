"""Sampling benchmark: uniform, prioritized and sequence sampling throughput, and
update_priorities throughput, while 2 writer processes write CartPole chunks. Prints JSON.

    python benchmarks/bench_sampling.py [--capacity 1000000] [--seconds 2]

The storage (under /dev/shm, removed at the end) is first filled with real CartPole
rollouts (64 sub-envs x 16 steps per chunk, 4 simulated workers), so sequences follow
real trajectories. TorchRL is compared when importable (optional).
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
from ingestd.collect.interfaces import EnvContext
from ingestd.collect.policies import Random
from ingestd.collect.rollout import Rollout
from ingestd.replay import ReplayReader, ReplayStorage

NUM_ENVS, CHUNK = 64, 16


def rollout(worker: int) -> Rollout:
    env = CartPole(EnvContext(num_envs=NUM_ENVS, seed=worker, worker=worker, episode_base=worker << 32, device="cpu"))
    return Rollout(env, Random(env.spec, seed=worker), worker, worker << 32, CHUNK)


def writer(path: str, worker: int, stop) -> None:
    torch.set_num_threads(1)
    r = rollout(worker)
    with ReplayStorage.open(path) as store:
        while not stop.value:
            store.write(r.chunk(0)[0])


def rate(fn, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
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
        procs = [ctx.Process(target=writer, args=(path, 10 + w, stop), daemon=True) for w in range(2)]
        for p in procs:
            p.start()
        results: dict = {"capacity": args.capacity, "fill_seconds": round(fill_s, 1), "writers": 2,
                         "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
        w0 = store.write_count
        t0 = time.perf_counter()
        with ReplayReader(path, seed=0) as uni, ReplayReader(path, seed=1, sampler="prioritized") as pri:
            for b in (256, 4096):
                results[f"uniform_sample_{b}_per_s"] = round(rate(lambda: uni.sample(b), args.seconds), 1)
                results[f"prioritized_sample_{b}_per_s"] = round(rate(lambda: pri.sample(b), args.seconds), 1)
                results[f"sequences_{b}x16_per_s"] = round(rate(lambda: uni.sample_sequences(b, 16), args.seconds), 2)
            s = pri.sample(256)
            prio = np.random.default_rng(0).uniform(0.1, 2.0, 256)
            update = rate(lambda: pri.update_priorities(s, prio), args.seconds)
            results["update_priorities_256_per_s"] = round(update, 1)
        results["writer_rows_per_s_during"] = round((store.write_count - w0) / (time.perf_counter() - t0))
        try:
            import torchrl  # noqa: F401
            results["torchrl"] = "importable (comparison not implemented yet)"
        except ImportError:
            results["torchrl"] = "not installed"
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
