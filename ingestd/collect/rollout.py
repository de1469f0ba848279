"""Rolling a batched env forward: stamps, episode bookkeeping, chunk assembly.

A chunk is ``chunk_steps`` transitions of every sub-env, flattened to rows
``[chunk_steps * num_envs]`` in TorchRL layout with the ingestd stamps set
(``write_index`` is filled by the storage).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from ingestd.collect.interfaces import Env, Policy
from ingestd.errors import EnvFault


@dataclass
class Finished:
    """Episodes that ended during a chunk."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


class Rollout:
    """Steps one batched env with one policy and stamps every transition."""

    def __init__(self, env: Env, policy: Policy, worker: int, episode_base: int, chunk_steps: int):
        n = env.num_envs
        self.env, self.policy, self.chunk_steps = env, policy, chunk_steps
        self._worker = torch.full((n,), worker, dtype=torch.int64)
        self._env_index = torch.arange(n, dtype=torch.int64)
        self._episode = torch.full((n,), episode_base, dtype=torch.int64)
        self._step = torch.zeros(n, dtype=torch.int64)
        self._return = torch.zeros(n, dtype=torch.float64)
        self._root = env.reset()

    def chunk(self, policy_version: int) -> tuple[TensorDict, Finished]:
        """Roll ``chunk_steps`` steps; returns the rows and the finished episodes."""
        version = torch.full_like(self._worker, policy_version)
        steps, finished = [], Finished()
        for _ in range(self.chunk_steps):
            root = self._root
            root.set(("ingestd", "worker"), self._worker)
            root.set(("ingestd", "env"), self._env_index)
            root.set(("ingestd", "episode"), self._episode)
            root.set(("ingestd", "step"), self._step)
            root.set(("ingestd", "policy_version"), version)
            root = self.policy(root)
            transition, self._root = self.env.step_and_maybe_reset(root)
            steps.append(transition)
            self._account(transition, finished)
        rows = torch.stack(steps, dim=0).reshape(-1)
        check_rows(rows)
        return rows, finished

    def _account(self, transition: TensorDict, finished: Finished) -> None:
        reward = transition.get(("next", "reward")).reshape(self.env.num_envs, -1).sum(-1)
        done = transition.get(("next", "done")).reshape(self.env.num_envs, -1).any(-1)
        self._return = self._return + reward.to(torch.float64)
        step = self._step + 1
        if done.any():
            ended = done.nonzero().squeeze(-1)
            finished.returns.extend(self._return[ended].tolist())
            finished.lengths.extend(step[ended].tolist())
            self._return = torch.where(done, torch.zeros_like(self._return), self._return)
            self._episode = self._episode + done.to(torch.int64)
            step = torch.where(done, torch.zeros_like(step), step)
        self._step = step


def check_rows(rows: TensorDict) -> None:
    """Refuse data that must never be stored: a non-finite reward (see docs: env faults)."""
    reward = rows.get(("next", "reward"), None)
    if reward is None:
        raise EnvFault("the env's transitions have no ('next', 'reward') entry")
    if reward.is_floating_point() and not torch.isfinite(reward).all():
        bad = (~torch.isfinite(reward)).reshape(reward.shape[0], -1).any(-1).nonzero().squeeze(-1)
        raise EnvFault(f"the env returned a non-finite reward in {bad.numel()} rows "
                       f"(first at row {int(bad[0])}); the chunk was not stored")
