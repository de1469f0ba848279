"""Built-in policies: ``Random`` and ``MLP`` (an epsilon-greedy Q-network).

Factories take ``(spec: EnvSpec, **kwargs)``; both need a discrete action
space (``spec.num_actions``).

``MLP`` state_dict names, in this order (stable: trainers push weights by name)::

    epsilon          []                  float32, the exploration rate
    net.0.weight     [h1, obs_dim]       net.0.bias  [h1]
    net.2.weight     [h2, h1]            net.2.bias  [h2]
    ...              (one Linear per hidden size, each followed by a ReLU)
    net.{2k}.weight  [num_actions, hk]   net.{2k}.bias  [num_actions]

where ``obs_dim`` is the flattened observation size and ``k = len(hidden)``.

``mlp_qnet`` builds the bare Q-network a trainer learns, with the same names,
so its ``state_dict()`` can be pushed to the collectors as is.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.nn import functional as F

from ingestd.collect.interfaces import EnvSpec
from ingestd.errors import ConfigError


def _num_actions(spec: EnvSpec, who: str) -> int:
    if spec.num_actions is None or spec.action_shape != ():
        raise ConfigError("workers.policy", f"{who} needs a discrete action space (num_actions set, action_shape "
                                            f"()); got action_shape={spec.action_shape}, num_actions={spec.num_actions}; "
                                            "for continuous actions give your own policy as workers.policy = "
                                            "\"package.module:factory\" (docs/from-torchrl.md)")
    return spec.num_actions


def _generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


class Random:
    """``Random(spec, seed=None)``: uniform actions, in ``0..num_actions-1`` for a discrete
    action space, in ``[action_low, action_high]`` for a continuous one with finite bounds.
    Not a module: it has no weights to receive."""

    def __init__(self, spec: EnvSpec, seed: int | None = None):
        self._gen = _generator(seed)
        self.num_actions = self._low = self._span = None
        if spec.num_actions is not None and spec.action_shape == ():
            self.num_actions = spec.num_actions
            return
        low, high = _bounds(spec)
        self._low, self._span, self._dtype = low, high - low, spec.action_dtype

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        if self.num_actions is not None:
            action = torch.randint(0, self.num_actions, td.batch_size, generator=self._gen)  # CPU stream
        else:
            u = torch.rand((*td.batch_size, *self._low.shape), generator=self._gen, dtype=torch.float64)
            action = (self._low + u * self._span).to(self._dtype)
        td.set("action", action if td.device is None else action.to(td.device))
        return td


def _bounds(spec: EnvSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A continuous action space's finite bounds, shaped like one action (float64)."""
    size = math.prod(spec.action_shape)
    bounds = (spec.action_low, spec.action_high)
    if any(b is None or len(b) != size for b in bounds) or not spec.action_dtype.is_floating_point:
        raise ConfigError("workers.policy", "uniform random actions need a discrete action space (num_actions "
                                            "set, action_shape ()) or a float one with bounds (EnvSpec.action_low "
                                            f"and action_high, one per element); got action_shape={spec.action_shape}, "
                                            f"action_dtype={spec.action_dtype}, num_actions={spec.num_actions}, "
                                            f"action_low={spec.action_low}, action_high={spec.action_high}")
    low, high = (torch.tensor(b, dtype=torch.float64).reshape(spec.action_shape) for b in bounds)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all() and (low <= high).all()):
        raise ConfigError("workers.policy", f"uniform random actions need finite bounds with low <= high; this "
                                            f"env's are {spec.action_low} .. {spec.action_high}")
    return low, high


class _QNet(nn.Module):
    """The Q-network layers and ``epsilon``; owns the state_dict names."""

    def __init__(self, obs_shape: Sequence[int], num_actions: int, hidden: Sequence[int], epsilon: float):
        super().__init__()
        if num_actions < 1 or any(h < 1 for h in hidden):
            raise ValueError(f"Q-network sizes must be positive: num_actions={num_actions}, hidden={tuple(hidden)}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        self.obs_ndim = len(obs_shape)
        self.obs_dim = math.prod(obs_shape)
        self.num_actions = num_actions
        sizes = [self.obs_dim, *hidden]
        layers: list[nn.Module] = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], num_actions))
        self.net = nn.Sequential(*layers)
        self.register_buffer("epsilon", torch.tensor(float(epsilon), dtype=torch.float32))

    @staticmethod
    def check_weights(state: dict) -> None:
        """Refuse pushed weights this policy cannot act on (called by the daemon on a push)."""
        epsilon = state.get("epsilon")
        if epsilon is not None and epsilon.numel() == 1 and not 0.0 <= float(epsilon) <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {float(epsilon):g} (a trainer's exploration "
                             "schedule gone past its end?)")

    def q_values(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``[*batch, num_actions]`` of observations ``[*batch, *obs_shape]`` (any dtype)."""
        batch = obs.shape[: obs.dim() - self.obs_ndim]
        return self.net(obs.reshape(*batch, self.obs_dim).to(torch.float32))


class QNetwork(_QNet):
    """A bare Q-network: ``forward(obs) -> Q-values``; see ``mlp_qnet``."""

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.q_values(obs)


def mlp_qnet(spec_or_obs_dim: EnvSpec | int, num_actions: int | None = None,
             hidden: Sequence[int] = (64, 64), epsilon: float = 0.0) -> QNetwork:
    """A Q-network with the same state_dict names, shapes and dtypes as
    ``MLP(spec, hidden=hidden)``. Give an ``EnvSpec`` (``num_actions`` defaults
    to the spec's) or a flat observation size and ``num_actions``.

    ``epsilon`` is part of the state dict, so a push of this network sets the
    workers' exploration too: give the value they should act with (the config's
    ``workers.policy_kwargs.epsilon``, or a schedule's current value through
    ``qnet.epsilon.fill_(eps)``); the default 0.0 makes them greedy."""
    if isinstance(spec_or_obs_dim, EnvSpec):
        obs_shape = spec_or_obs_dim.observation_shape
        num_actions = num_actions or _num_actions(spec_or_obs_dim, "mlp_qnet")
    else:
        obs_shape = (int(spec_or_obs_dim),)
        if num_actions is None:
            raise ValueError("mlp_qnet needs num_actions when given an observation size")
    return QNetwork(obs_shape, num_actions, tuple(hidden), epsilon=epsilon)


class MLP(_QNet):
    """``MLP(spec, hidden=(64, 64), epsilon=0.0, seed=None)``: epsilon-greedy on a
    Q-network. Calling it writes ``"action"`` (int64 ``[B]``) into the root td.
    ``seed`` fixes the initial weights and the exploration stream."""

    def __init__(self, spec: EnvSpec, hidden: Sequence[int] = (64, 64), epsilon: float = 0.0,
                 seed: int | None = None):
        num_actions = _num_actions(spec, "the MLP policy")
        if seed is None:
            super().__init__(spec.observation_shape, num_actions, tuple(hidden), epsilon)
        else:
            with torch.random.fork_rng(devices=[]):  # seeded init leaves the global stream alone
                torch.manual_seed(seed)
                super().__init__(spec.observation_shape, num_actions, tuple(hidden), epsilon)
        self._gen = _generator(None if seed is None else seed + 1)
        # the Parameter objects themselves: load_state_dict and .to() update them in place
        self._layers = tuple((m.weight, m.bias) for m in self.net if isinstance(m, nn.Linear))
        self.requires_grad_(False)  # acting only; weights arrive by load_state_dict

    @torch.no_grad()
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        action = self._fast_q_values(td.get("observation")).argmax(-1)
        if torch.compiler.is_compiling():  # (workers.compile_policy) exploration runs outside the graph
            action = self._explore_eagerly(action)
        else:
            action = self._explore(action)
        td.set("action", action)
        return td

    def _explore(self, action: torch.Tensor) -> torch.Tensor:
        """Epsilon-greedy: each action replaced by a uniform one with probability epsilon. It
        reads epsilon as a number (``.item()``), which ``torch.compile`` cannot trace."""
        epsilon = float(self.epsilon)
        if epsilon > 0.0:
            shape = action.shape
            explore = torch.rand(shape, generator=self._gen) < epsilon  # CPU stream
            random = torch.randint(0, self.num_actions, shape, generator=self._gen)
            action = torch.where(explore.to(action.device), random.to(action.device), action)
        return action

    @torch.compiler.disable
    def _explore_eagerly(self, action: torch.Tensor) -> torch.Tensor:
        """What the compiled forward calls (``self._explore``, a subclass's too, run eagerly): the
        graph is the Q-network and its argmax, without the graph break (and torch's warning) that
        tracing ``.item()`` gave. Eager callers skip disable()'s wrapper."""
        return self._explore(action)

    def _fast_q_values(self, obs: torch.Tensor) -> torch.Tensor:
        """``q_values`` without the per-module call overhead (a third of the
        policy's time at 256 envs); the same layers, applied functionally."""
        batch = obs.shape[: obs.dim() - self.obs_ndim]
        x = obs.reshape(*batch, self.obs_dim).to(torch.float32)
        *hidden, (weight, bias) = self._layers
        for w, b in hidden:
            x = F.linear(x, w, b).relu_()
        return F.linear(x, weight, bias)
