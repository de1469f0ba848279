"""The in-process limit: frames/s of a bare env + policy loop in one process.

    python benchmarks/bench_env_loop.py [--seconds 2] [--repeat 3] [--threads 1] [--only cartpole_mlp]

No workers, no storage, no stamps: ``policy(root)`` then
``env.step_and_maybe_reset(root)``, as fast as one core goes, under inference mode as
the workers run it. Collectors are
later compared against these figures. Prints one JSON object: per case the
best and median rate of ``repeat`` runs, per wall-clock second and per CPU
second of this process (the latter is less sensitive to other load on the
machine; ``load_average_before`` says how busy it was).

``inprocess_rate`` and ``CASES`` are importable by other benchmarks.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ingestd.collect.interfaces import Env, EnvContext, Policy
from ingestd.collect.registry import make_env, make_policy
from ingestd.collect.rollout import no_autograd
from ingestd.collect.worker import keep_heap


def inprocess_rate(env: Env, policy: Policy, *, seconds: float = 2.0, warmup_steps: int = 20,
                   max_steps: int | None = None, clock: Callable[[], float] = time.perf_counter) -> float:
    """Frames per second (``num_envs`` frames per step) of the loop
    ``env.step_and_maybe_reset(policy(root))`` over about ``seconds`` of ``clock``
    (or ``max_steps`` steps, whichever comes first), after ``warmup_steps``. The loop runs
    in the workers' autograd mode (``workers.inference_mode``'s default: inference mode),
    so a limit and a worker step the same way."""
    with no_autograd():
        return _rate(env, policy, seconds, warmup_steps, max_steps, clock)


def _rate(env: Env, policy: Policy, seconds: float, warmup_steps: int, max_steps: int | None,
          clock: Callable[[], float]) -> float:
    root = env.reset()
    for _ in range(warmup_steps):
        _, root = env.step_and_maybe_reset(policy(root))
    steps, check_every = 0, 16
    start = clock()
    deadline = start + seconds
    while True:
        for _ in range(check_every):
            _, root = env.step_and_maybe_reset(policy(root))
        steps += check_every
        now = clock()
        if now >= deadline or (max_steps is not None and steps >= max_steps):
            return steps * env.num_envs / (now - start)


@dataclass(frozen=True)
class Case:
    """One loop to measure: an env and a policy by registry name, with kwargs."""

    env: str
    num_envs: int
    policy: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, seed: int = 0) -> tuple[Env, Policy]:
        ctx = EnvContext(num_envs=self.num_envs, seed=seed, worker=0, episode_base=0)
        env = make_env(self.env, ctx, self.env_kwargs)
        return env, make_policy(self.policy, env.spec, {**self.policy_kwargs, "seed": seed})


CASES: dict[str, Case] = {
    "cartpole_mlp": Case("CartPole", 256, "MLP", policy_kwargs={"hidden": (64, 64)}),
    "gym_cartpole_mlp": Case("Gym", 8, "MLP", env_kwargs={"id": "CartPole-v1"}, policy_kwargs={"hidden": (64, 64)}),
    "pixels_random": Case("Pixels", 64, "Random"),
    "checksum_random": Case("Checksum", 256, "Random"),
}


def run_case(case: Case, seconds: float, repeat: int) -> dict[str, Any]:
    env, policy = case.build()
    try:
        wall = [inprocess_rate(env, policy, seconds=seconds) for _ in range(repeat)]
        cpu = [inprocess_rate(env, policy, seconds=seconds, clock=time.process_time) for _ in range(repeat)]
    finally:
        env.close()
    return {
        "env": case.env, "num_envs": case.num_envs, "policy": case.policy,
        "env_kwargs": case.env_kwargs, "policy_kwargs": case.policy_kwargs,
        "frames_per_s_best": round(max(wall)), "frames_per_s_median": round(statistics.median(wall)),
        "frames_per_cpu_s_best": round(max(cpu)), "frames_per_cpu_s_median": round(statistics.median(cpu)),
        "us_per_step_best": round(case.num_envs / max(wall) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (best and median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--only", choices=sorted(CASES), action="append", help="cases to run (default: all)")
    args = parser.parse_args(argv)
    keep_heap()  # as every worker does: the limit is the same loop under the same allocator settings
    torch.set_num_threads(args.threads)
    report = {
        "benchmark": "env_loop_inprocess", "torch_threads": args.threads, "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "torch": torch.__version__,
        "cases": {name: run_case(CASES[name], args.seconds, args.repeat) for name in (args.only or CASES)},
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    from ingestd.service.tunables import exec_with_copy_tunable

    exec_with_copy_tunable()  # the copy mode `ingestd run` gives its workers, here and in the limits
    main()
