"""``TorchEnv``: the base the built-in envs share; it owns the row layout.

A subclass only simulates. It implements

- ``_reset(mask)``: reset the sub-envs where ``mask`` is True (all of them when
  ``mask`` is None) and return the observation of *every* sub-env;
- ``_step(action)``: advance every sub-env one step and return
  ``(observation, reward, terminated, truncated, extras)``;
- optionally ``_root_extras()``: extra keys for the root it is about to hand out.

The base class builds the TensorDicts: TorchRL layout, flags and rewards of
shape ``[num_envs, 1]``, ``done = terminated | truncated``, root flags all
False, and the auto-reset of finished sub-envs in ``step_and_maybe_reset``.

Tensors a subclass returns become part of the rows; they must be fresh
(never a buffer the env overwrites on a later step).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from tensordict import TensorDict

from ingestd.collect.interfaces import EnvContext, EnvSpec

StepResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _as_flag(flag: torch.Tensor) -> torch.Tensor:
    """A subclass's terminated/truncated as the layout's bool (an int32 flag made the auto-reset's
    ``torch.where`` fail at the first episode end: custom-env review); nonzero is True."""
    return flag if flag.dtype == torch.bool else flag != 0


def _tensordict(source: dict, batch_size: torch.Size) -> TensorDict:
    """A TensorDict over tensors we built with the right batch size ourselves.
    ``_new_unsafe`` skips the per-key checks, which cost as much as a CartPole
    step; older tensordict releases lack it and get the checked constructor."""
    if _NEW_UNSAFE is not None:
        return _NEW_UNSAFE(source, batch_size=batch_size)
    return TensorDict(source, batch_size=batch_size)


_NEW_UNSAFE = getattr(TensorDict, "_new_unsafe", None)


class TorchEnv(ABC):
    """A batched env of ``ctx.num_envs`` sub-envs implementing the ``Env`` protocol."""

    def __init__(self, ctx: EnvContext, spec: EnvSpec):
        if ctx.num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {ctx.num_envs}")
        self.ctx = ctx
        self.num_envs = ctx.num_envs
        self.spec = spec
        self.device = torch.device(ctx.device)
        self._batch = torch.Size([ctx.num_envs])
        self._flag_shape = (ctx.num_envs, 1)
        self._gen = torch.Generator(device=self.device)  # the env's own stream, from the worker's seed
        self._gen.manual_seed(ctx.seed)

    # -- what subclasses implement --------------------------------------------
    @abstractmethod
    def _reset(self, mask: torch.Tensor | None) -> torch.Tensor:
        """Reset the sub-envs where ``mask`` (bool ``[B]``) is True, or all when
        it is None; return the observations of all sub-envs ``[B, *obs_shape]``."""

    @abstractmethod
    def _step(self, action: torch.Tensor) -> StepResult:
        """Step every sub-env with ``action [B, *action_shape]``; return
        ``observation [B, *obs_shape]``, ``reward [B]`` or ``[B, 1]``,
        ``terminated [B]``, ``truncated [B]`` (bool) and ``extras`` (``[B, ...]``
        tensors placed under ``"next"``). Where an episode ended, ``observation``
        is its final observation; the base calls ``_reset`` afterwards."""

    def _root_extras(self) -> dict[str, torch.Tensor]:
        """Extra keys for the root about to be handed out, from the sub-envs'
        current state (called after every ``_step`` and ``_reset``). ``_step``'s
        extras go to ``"next"`` only; keys wanted in the root come from here."""
        return {}

    def _close(self) -> None:
        """Release resources (subclasses that hold any)."""

    # -- the Env protocol -------------------------------------------------------
    def reset(self) -> TensorDict:
        """Reset every sub-env; the first root ``[num_envs]``."""
        return self._root(self._reset(None))

    def step(self, td: TensorDict) -> TensorDict:
        """Step with ``td["action"]``; returns ``td`` with ``"next"`` filled in (the transition)."""
        return self._transition(td)[0]

    def step_and_maybe_reset(self, td: TensorDict) -> tuple[TensorDict, TensorDict]:
        """The transition, and the next root with finished sub-envs reset."""
        transition, done, obs = self._transition(td)
        if bool(done.any()):
            obs = self._reset(done)
        return transition, self._root(obs)

    def close(self) -> None:
        self._close()

    # -- layout -------------------------------------------------------------------
    def _transition(self, td: TensorDict) -> tuple[TensorDict, torch.Tensor, torch.Tensor]:
        """``td`` with ``"next"`` set, plus ``done [B]`` and the next observation."""
        obs, reward, terminated, truncated, extras = self._step(td.get("action"))
        terminated, truncated = _as_flag(terminated), _as_flag(truncated)  # int flags: the reset mask needs bool
        done = terminated | truncated
        shape = self._flag_shape
        nxt = {
            "observation": obs,
            "reward": reward.view(shape),
            "done": done.view(shape),
            "terminated": terminated.view(shape),
            "truncated": truncated.view(shape),
            **extras,
        }
        td.set("next", _tensordict(nxt, self._batch))
        return td, done, obs

    def _root(self, obs: torch.Tensor) -> TensorDict:
        flags = torch.zeros((3, *self._flag_shape), dtype=torch.bool, device=self.device)
        done, terminated, truncated = flags.unbind(0)
        root = {"observation": obs, "done": done, "terminated": terminated, "truncated": truncated}
        root.update(self._root_extras())
        return _tensordict(root, self._batch)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_envs={self.num_envs}, worker={self.ctx.worker})"
