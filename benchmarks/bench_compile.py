"""Effect of ``workers.compile_policy`` on the worker's hot path: frames/s of a Rollout.

    python benchmarks/bench_compile.py                      # CartPole and Pixels, MLP, 64 envs
    python benchmarks/bench_compile.py --envs CartPole --num-envs 256 --seconds 5

For each case the same seeded env + MLP policy is rolled in this process
(``Rollout.chunk``, what a worker does between writes; one intra-op thread,
as a worker of a 2-worker daemon on 2 cores), first eager, then through
``ingestd.collect.features.compiled`` (``torch.compile``). Reported: the
one-off compile time (first chunk), and the median chunk rate over
``--repeats`` windows for each, with ``os.getloadavg()``.

Prints ONE JSON document on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def rate(rollout, seconds: float, repeats: int) -> float:
    steps = rollout.chunk_steps * rollout.env.num_envs
    rates = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / repeats:
            rollout.chunk(1)
            n += steps
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def case(env_name: str, num_envs: int, chunk_steps: int, seconds: float, repeats: int) -> dict:
    from ingestd.collect.features import compiled
    from ingestd.collect.interfaces import EnvContext
    from ingestd.collect.registry import make_env, make_policy
    from ingestd.collect.rollout import Rollout

    out: dict = {"env": env_name, "num_envs": num_envs, "chunk_steps": chunk_steps}
    for mode in ("eager", "compiled"):
        env = make_env(env_name, EnvContext(num_envs=num_envs, seed=0, worker=0, episode_base=0))
        policy = make_policy("MLP", env.spec, {"seed": 0, "epsilon": 0.1})
        acting = compiled(policy) if mode == "compiled" else policy
        rollout = Rollout(env, acting, 0, 0, chunk_steps)
        t0 = time.perf_counter()
        rollout.chunk(1)  # compiles on the first call
        out[f"{mode}_first_chunk_s"] = round(time.perf_counter() - t0, 3)
        out[f"{mode}_frames_per_s"] = round(rate(rollout, seconds, repeats))
        env.close()
        print(f"{env_name} {mode}: {out[f'{mode}_frames_per_s']} frames/s", file=sys.stderr)
    out["speedup"] = round(out["compiled_frames_per_s"] / out["eager_frames_per_s"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", nargs="+", default=["CartPole", "Pixels"])
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--chunk-steps", type=int, default=16)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = [case(e, args.num_envs, args.chunk_steps, args.seconds, args.repeats) for e in args.envs]
    print(json.dumps({"torch": torch.__version__, "cores": len(os.sched_getaffinity(0)),
                      "loadavg": os.getloadavg(), "cases": results}, indent=2))


if __name__ == "__main__":
    from ingestd.service.tunables import exec_with_copy_tunable

    exec_with_copy_tunable()  # the copy mode `ingestd run` gives its workers, here and in the limits
    main()
