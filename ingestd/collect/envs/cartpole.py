"""CartPole in torch, vectorised: the dynamics of gymnasium's ``CartPole-v1``.

Same constants, explicit Euler integrator, termination thresholds, reset
distribution ``U(-0.05, 0.05)`` per state variable, reward 1.0 on every step
(the terminal one included) and truncation after ``max_steps`` (500) steps.
As with gymnasium's ``TimeLimit``, a step that both drops the pole and hits
the time limit is terminated *and* truncated.

The state is float64 like gymnasium's; the formulas are gymnasium's with the
constants folded together (fewer torch calls per step), so one step from a
shared state agrees with gymnasium to within a few float64 ulps.
"""
from __future__ import annotations

import math

import torch

from ingestd.collect.envs.base import StepResult, TorchEnv
from ingestd.collect.interfaces import EnvContext, EnvSpec

GRAVITY = 9.8
MASSCART = 1.0
MASSPOLE = 0.1
TOTAL_MASS = MASSPOLE + MASSCART
LENGTH = 0.5  # half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds per step
THETA_THRESHOLD = 12 * 2 * math.pi / 360
X_THRESHOLD = 2.4
RESET_BOUND = 0.05

SPEC = EnvSpec(observation_shape=(4,), observation_dtype=torch.float32,
               action_shape=(), action_dtype=torch.int64, num_actions=2)


class CartPole(TorchEnv):
    """``CartPole(ctx, max_steps=500)``: observation float32 ``[4]``
    (x, x_dot, theta, theta_dot), action int64 ``[]`` in {0: push left, 1: push right}."""

    def __init__(self, ctx: EnvContext, max_steps: int = 500):
        if max_steps < 1:
            raise ValueError(f"CartPole max_steps must be >= 1, got {max_steps}")
        super().__init__(ctx, SPEC)
        self.max_steps = max_steps
        n, dev = ctx.num_envs, self.device
        # one row per state variable: every op below runs on contiguous rows
        self._state = torch.zeros((4, n), dtype=torch.float64, device=dev)
        self._draw = torch.empty((4, n), dtype=torch.float64, device=dev)
        self._steps = torch.zeros(n, dtype=torch.int64, device=dev)
        self._forces_by_mass = torch.tensor([-FORCE_MAG, FORCE_MAG], dtype=torch.float64, device=dev) / TOTAL_MASS
        self._four_thirds_length = torch.tensor(4.0 / 3.0 * LENGTH, dtype=torch.float64, device=dev)
        inf = math.inf
        self._limits = torch.tensor([[X_THRESHOLD], [inf], [THETA_THRESHOLD], [inf]], dtype=torch.float64, device=dev)

    # -- state access (tests, debugging) -------------------------------------------
    @property
    def state(self) -> torch.Tensor:
        """A copy of the float64 state ``[num_envs, 4]`` (x, x_dot, theta, theta_dot)."""
        return self._state.t().clone(memory_format=torch.contiguous_format)

    @property
    def steps(self) -> torch.Tensor:
        """A copy of the steps taken in each sub-env's current episode ``[num_envs]``."""
        return self._steps.clone()

    def set_state(self, state: torch.Tensor, steps: torch.Tensor | None = None) -> None:
        """Overwrite the physical state ``[num_envs, 4]`` (and optionally the step counts)."""
        self._state.copy_(state.t())
        if steps is not None:
            self._steps.copy_(steps)

    # -- simulation -------------------------------------------------------------------
    def _reset(self, mask: torch.Tensor | None) -> torch.Tensor:
        fresh = self._draw.uniform_(-RESET_BOUND, RESET_BOUND, generator=self._gen)
        if mask is None:
            self._state.copy_(fresh)
            self._steps.zero_()
        else:
            torch.where(mask, fresh, self._state, out=self._state)
            self._steps.masked_fill_(mask, 0)
        return self._observation()

    def _step(self, action: torch.Tensor) -> StepResult:
        state = self._state
        _, x_dot, theta, theta_dot = state.unbind(0)
        cos, sin = theta.cos(), theta.sin()
        # gymnasium's formulas with the constants folded in (fewer torch calls):
        #   temp = (force + PML * theta_dot^2 * sin) / M
        #   theta_acc = (G * sin - cos * temp) / (L * (4/3 - MP * cos^2 / M))
        #   x_acc = temp - PML * theta_acc * cos / M
        force_by_mass = self._forces_by_mass.index_select(0, action)
        temp = torch.addcmul(force_by_mass, theta_dot * theta_dot, sin, value=POLEMASS_LENGTH / TOTAL_MASS)
        numerator = torch.addcmul(sin * GRAVITY, cos, temp, value=-1.0)
        denominator = torch.addcmul(self._four_thirds_length, cos, cos, value=-LENGTH * MASSPOLE / TOTAL_MASS)
        theta_acc = numerator.div_(denominator)
        x_acc = torch.addcmul(temp, theta_acc, cos, value=-POLEMASS_LENGTH / TOTAL_MASS)
        state.add_(torch.stack((x_dot, x_acc, theta_dot, theta_acc)), alpha=TAU)  # explicit Euler
        self._steps.add_(1)
        terminated = (state.abs() > self._limits).any(0)
        truncated = self._steps >= self.max_steps
        reward = torch.ones(self._flag_shape, dtype=torch.float32, device=self.device)
        return self._observation(), reward, terminated, truncated, {}

    def _observation(self) -> torch.Tensor:
        return self._state.t().to(torch.float32, memory_format=torch.contiguous_format)
