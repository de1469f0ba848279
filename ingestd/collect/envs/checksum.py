"""``Checksum``: an env whose every field is a function of where it came from,
so stored rows can be verified later (torn, foreign or mis-stamped rows).

For the transition taken at step ``s`` of episode ``e`` of sub-env ``i`` of
worker ``w``:

- ``observation`` = ``(w, i, e, s)`` and ``("next", "observation")`` = ``(w, i, e, s + 1)``
  (int64 ``[4]``); ``checksum`` / ``("next", "checksum")`` = ``tuple_hash`` of those;
- ``("next", "reward")`` = ``reward_of(tuple_hash(w, i, e, s))``, a multiple of 1/64 in [0, 16);
- the episode lasts ``L(w, i, e)`` in ``[3, 40]`` steps and ends *terminated* or
  *truncated* as the episode hash decides; ``done`` exactly at ``s + 1 == L``.

The env keeps its own ``(e, s)`` counters: sub-env ``i``'s episode ids start at
``ctx.episode_base + i`` and go up by ``num_envs`` per finished episode, exactly
as the worker's ``("ingestd", ...)`` stamps must, so ``verify_rows`` also checks
the worker's stamping. A second ``reset()`` abandons the running episodes and
starts episode ``e + num_envs`` everywhere. The action is ignored (2 discrete
actions; ``verify_rows`` only checks it is one of them).

Hashes are splitmix64 on int64 tensors (wrapping multiply, masked shifts),
identical in every process; Python's ``hash()`` is never used.
"""
from __future__ import annotations

import torch
from tensordict import TensorDictBase

from ingestd.collect.envs.base import StepResult, TorchEnv
from ingestd.collect.interfaces import EnvContext, EnvSpec

MIN_LENGTH, MAX_LENGTH = 3, 40
NUM_ACTIONS = 2
SPEC = EnvSpec(observation_shape=(4,), observation_dtype=torch.int64,
               action_shape=(), action_dtype=torch.int64, num_actions=NUM_ACTIONS)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_SALT = 0x1D6E57


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of every element of an int64 tensor (bits as uint64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def episode_hash(worker: torch.Tensor, env: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    return mix64(mix64(mix64(worker + _SALT) + env) + episode)


def tuple_hash(worker, env, episode, step) -> torch.Tensor:
    """The checksum of ``(worker, env, episode, step)`` (int64 tensors, broadcast)."""
    return mix64(episode_hash(worker, env, episode) + step)


def episode_shape(ep_hash: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(length, terminates)`` of the episodes with hash ``ep_hash``."""
    length = MIN_LENGTH + _shr(ep_hash, 33) % (MAX_LENGTH - MIN_LENGTH + 1)
    terminates = (_shr(ep_hash, 20) & 1) == 1
    return length, terminates


def reward_of(step_hash: torch.Tensor) -> torch.Tensor:
    """A float32 reward, exactly representable: a multiple of 1/64 in [0, 16)."""
    return (_shr(step_hash, 40) & 0x3FF).to(torch.float32) / 64


class Checksum(TorchEnv):
    """``Checksum(ctx)``: observation int64 ``[4]``, action int64 ``[]`` (ignored),
    extra int64 key ``"checksum"`` in the root and in ``"next"``."""

    def __init__(self, ctx: EnvContext):
        super().__init__(ctx, SPEC)
        n, dev = ctx.num_envs, self.device
        self._worker = torch.full((n,), ctx.worker, dtype=torch.int64, device=dev)
        self._env = torch.arange(n, dtype=torch.int64, device=dev)
        self._episode = ctx.episode_base + torch.arange(n, dtype=torch.int64, device=dev)
        self._step_index = torch.zeros(n, dtype=torch.int64, device=dev)
        self._started = False
        self._new_episodes()

    def _new_episodes(self) -> None:
        self._ep_hash = episode_hash(self._worker, self._env, self._episode)
        self._length, self._terminates = episode_shape(self._ep_hash)

    def _reset(self, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:  # a full reset abandons running episodes: each gets a new id
            self._episode = self._episode + self.num_envs * int(self._started)
            self._step_index = torch.zeros_like(self._step_index)
            self._started = True
        else:
            self._episode = self._episode + mask.to(torch.int64) * self.num_envs
            self._step_index = self._step_index.masked_fill(mask, 0)
        self._new_episodes()
        return self._tuple(self._step_index)

    def _step(self, action: torch.Tensor) -> StepResult:
        step = self._step_index
        nxt = step + 1
        done = nxt >= self._length
        reward = reward_of(mix64(self._ep_hash + step))
        extras = {"checksum": mix64(self._ep_hash + nxt)}
        self._step_index = nxt
        return self._tuple(nxt), reward, done & self._terminates, done & ~self._terminates, extras

    def _root_extras(self) -> dict[str, torch.Tensor]:
        return {"checksum": mix64(self._ep_hash + self._step_index)}

    def _tuple(self, step: torch.Tensor) -> torch.Tensor:
        return torch.stack((self._worker, self._env, self._episode, step), dim=1)


def verify_fields(td: TensorDictBase) -> dict[str, torch.Tensor]:
    """Per-field checks of stored Checksum rows ``[n]``: ``{field: bool [n]}``."""
    w, i, e, s = (td.get(("ingestd", f)).reshape(-1) for f in ("worker", "env", "episode", "step"))
    n = w.shape[0]
    ep_hash = episode_hash(w, i, e)
    length, terminates = episode_shape(ep_hash)
    end = s + 1 == length
    flat = {k: td.get(k).reshape(n, -1) for k in td.keys(include_nested=True, leaves_only=True)}
    checks = {
        "stamps": (s >= 0) & (s < length),
        "observation": (flat["observation"] == torch.stack((w, i, e, s), 1)).all(1),
        "checksum": flat["checksum"][:, 0] == mix64(ep_hash + s),
        "action": ((flat["action"] >= 0) & (flat["action"] < NUM_ACTIONS)).all(1),
        "next.observation": (flat[("next", "observation")] == torch.stack((w, i, e, s + 1), 1)).all(1),
        "next.checksum": flat[("next", "checksum")][:, 0] == mix64(ep_hash + s + 1),
        "next.reward": flat[("next", "reward")][:, 0] == reward_of(mix64(ep_hash + s)),
        "next.done": flat[("next", "done")][:, 0] == end,
        "next.terminated": flat[("next", "terminated")][:, 0] == (end & terminates),
        "next.truncated": flat[("next", "truncated")][:, 0] == (end & ~terminates),
    }
    for flag in ("done", "terminated", "truncated"):  # a root is never a finished state
        checks[flag] = ~flat[flag].any(1)
    return checks


def verify_rows(td: TensorDictBase) -> torch.Tensor:
    """True for each stored row ``[n]`` that is exactly what Checksum produced for
    its ``("ingestd", worker/env/episode/step)`` stamps; False for torn or foreign rows."""
    checks = iter(verify_fields(td).values())
    ok = next(checks).clone()
    for check in checks:
        ok &= check
    return ok
