"""Helpers for the sampling tests: CartPole-like rows, and Checksum rollouts written by
several simulated workers into one storage (chunks interleaved as the daemon's workers do)."""
from __future__ import annotations

import torch
from tensordict import TensorDict

from ingestd.collect.envs import Checksum
from ingestd.collect.interfaces import EnvContext
from ingestd.collect.policies import Random
from ingestd.collect.rollout import Rollout


def rows(n: int, version: int = 0, start: int = 0) -> TensorDict:
    flags = {f: torch.zeros(n, 1, dtype=torch.bool) for f in ("done", "terminated", "truncated")}
    stamps = {f: torch.arange(start, start + n) for f in ("worker", "env", "episode", "step")}
    stamps["policy_version"] = torch.full((n,), version)
    return TensorDict({"observation": torch.rand(n, 4), "action": torch.zeros(n, dtype=torch.int64), **flags,
                       "next": {"observation": torch.rand(n, 4), "reward": torch.rand(n, 1), **flags},
                       "ingestd": stamps}, batch_size=[n])


def checksum_rollouts(workers: int, num_envs: int, chunk_steps: int, seed: int = 0) -> list[Rollout]:
    out = []
    for w in range(workers):
        ctx = EnvContext(num_envs=num_envs, seed=seed + w, worker=w, episode_base=w << 32, device="cpu")
        env = Checksum(ctx)
        out.append(Rollout(env, Random(env.spec, seed=seed + w), w, w << 32, chunk_steps))
    return out


def example_rows(num_envs: int = 2) -> TensorDict:
    rollout = checksum_rollouts(1, num_envs, 1)[0]
    return rollout.chunk(0)[0].clone()
