"""What users plug in: batched envs and policies (``Protocol``s), and what
ingestd hands their factories.

Envs and policies are named by import path, ``"package.module:factory"``,
plus keyword arguments from the config::

    env_factory(ctx: EnvContext, **env_kwargs) -> Env
    policy_factory(spec: EnvSpec, **policy_kwargs) -> Policy

Rows use TorchRL's layout (see ``ingestd.replay.layout``). Flags and
rewards have shape ``[num_envs, 1]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from ingestd.replay.layout import EPISODE_BITS


def episode_base_of(incarnation: int) -> int:
    """The first episode id of a worker incarnation (its sub-envs count on from there)."""
    if not 0 <= incarnation < 1 << (63 - EPISODE_BITS):
        raise ValueError(f"worker incarnation {incarnation} is past the {1 << (63 - EPISODE_BITS)} episode ids "
                         "can tell apart; start a new replay (a new replay.path)")
    return incarnation << EPISODE_BITS  # see ingestd.replay.layout


@dataclass(frozen=True)
class EnvContext:
    """Handed to an env factory by the worker that runs it."""

    num_envs: int
    seed: int  # distinct per worker incarnation and stable for a given config seed
    worker: int  # worker index (0..N-1)
    # sub-env i's k-th episode has id episode_base + i + k * num_envs: unique among all the
    # workers' sub-envs and, with episode_base = episode_base_of(incarnation), across restarts
    episode_base: int
    device: str = "cpu"


@dataclass(frozen=True)
class EnvSpec:
    """Shapes a policy needs to know (per sub-env, without the batch dimension)."""

    observation_shape: tuple[int, ...]
    observation_dtype: torch.dtype
    action_shape: tuple[int, ...]  # () for a discrete action index
    action_dtype: torch.dtype
    num_actions: int | None = None  # discrete action count, None for continuous
    # continuous actions: the bounds of each action element (flattened, C order), if the env has
    # them (a gymnasium Box's low and high); the Random policy and the warm-up draw within them
    action_low: tuple[float, ...] | None = None
    action_high: tuple[float, ...] | None = None


@runtime_checkable
class Env(Protocol):
    """A batched env over ``num_envs`` sub-envs that auto-resets finished ones.

    ``reset()`` returns the first root TensorDict ``[num_envs]``: ``observation``
    (plus any extra keys) and ``done``/``terminated``/``truncated`` all False.

    ``step_and_maybe_reset(td)`` takes a root td holding ``action`` and returns
    ``(transition, next_root)`` (the worker sets the rows' ``("ingestd", ...)``
    stamps after each chunk: the env and the policy do not see them):

    - ``transition``: the input root plus ``"next"`` with ``observation`` (the true
      final observation where an episode ended), ``reward``, ``done``,
      ``terminated``, ``truncated`` and any extra keys;
    - ``next_root``: what to act on next; finished sub-envs were reset, so their
      ``observation`` is the first observation of the next episode.

    ``terminated`` means the MDP ended; ``truncated`` means a time limit cut it;
    ``done = terminated | truncated``.
    """

    num_envs: int
    spec: EnvSpec

    def reset(self) -> TensorDict: ...

    def step_and_maybe_reset(self, td: TensorDict) -> tuple[TensorDict, TensorDict]: ...

    def close(self) -> None: ...


@runtime_checkable
class Policy(Protocol):
    """Writes ``"action"`` into the root td it gets and returns it.

    A policy that can receive weights is a ``torch.nn.Module``: pushed weights
    are matched against its ``state_dict()`` names, shapes and dtypes, and must be
    finite. It may also define ``check_weights(state: dict[str, Tensor])``, which
    the daemon calls on every push before publishing it; a ``ValueError`` it
    raises rejects the push (``bad_weights``, with its message) and changes
    nothing (the built-in MLP refuses an ``epsilon`` outside [0, 1])."""

    def __call__(self, td: TensorDict) -> TensorDict: ...
