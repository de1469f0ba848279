"""What a chunk must satisfy before it is stored (docs/reliability.md, "Env and policy faults").

- The action is finite, and within the env's bounds (a continuous spec's
  ``action_low``/``action_high``, a discrete one's ``[0, num_actions)``),
  unless ``workers.action_bounds`` says otherwise: ``clip`` clamps the
  policy's actions before the env steps (:class:`ClippedActions`, stored
  clamped, as the env executed them), ``off`` stores them as they come.
- The reward is finite.
- ``("next", "done")`` is ``terminated | truncated`` where the env gives all
  three as same-shaped bool leaves (TorchRL's layout): the episode and step
  stamps follow ``done``, a TorchRL loss reads ``terminated``, so rows that
  disagree would be wrong for one of them.
- Every other small float leaf (observations, extra keys) is finite, unless
  ``workers.check_finite = false`` (envs that use inf on purpose). Large
  leaves (images) are not scanned: that would be a pass over all their bytes.

A chunk that fails is not stored: the worker raises ``EnvFault``, naming the
config key at fault (``key``) and the first bad row's sub-env, episode and
step. Each check is one vectorised pass per chunk, not per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDictBase

from ingestd.collect.interfaces import EnvSpec
from ingestd.errors import EnvFault

SMALL_ROW_BYTES = 64 << 10  # leaves this large per row (images) are not scanned for NaN
_REWARD = ("next", "reward")
# float actions may pass a bound by rounding (loc + scale * tanh(x)): this much is not "outside"
_SLACK = 1e-5


@dataclass(frozen=True)
class RowChecks:
    low: np.ndarray | None = None  # the env's bounds per action element (flattened); None: unbounded
    high: np.ndarray | None = None
    bounds: str = "refuse"  # workers.action_bounds
    finite: bool = True  # workers.check_finite
    elements: int | None = None  # action elements per sub-env the env takes (None: not known)
    # what an action is compared with: the bounds widened by rounding slack for float actions;
    # ``uniform`` when one (lo, hi) holds for every element (two reductions then decide)
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    uniform: tuple[float, float] | None = None

    @classmethod
    def of(cls, spec: EnvSpec, bounds: str = "refuse", finite: bool = True) -> RowChecks:
        low, high = action_bounds(spec)
        lo = hi = uniform = None
        if low is not None:
            slack = _SLACK if spec.action_dtype.is_floating_point else 0.0
            lo, hi = low - slack * (1 + np.abs(low)), high + slack * (1 + np.abs(high))
            if (lo == lo[0]).all() and (hi == hi[0]).all():
                uniform = (float(lo[0]), float(hi[0]))
        return cls(low, high, bounds, finite, math.prod(spec.action_shape), lo, hi, uniform)


def action_bounds(spec: EnvSpec) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The env's action bounds per element (float64, flattened), or ``(None, None)``."""
    if spec.num_actions is not None:
        return np.zeros(1), np.full(1, float(spec.num_actions - 1))
    if spec.action_low is None or spec.action_high is None:
        return None, None
    low, high = np.asarray(spec.action_low, np.float64), np.asarray(spec.action_high, np.float64)
    if np.isinf(low).all() and np.isinf(high).all():
        return None, None
    return low, high


class ClippedActions:
    """``workers.action_bounds = "clip"``: the policy's actions clamped into the env's bounds
    before the env steps (and stored so: the action the env executed)."""

    def __init__(self, policy, spec: EnvSpec):
        self.policy = policy
        low, high = action_bounds(spec)
        self._low = torch.as_tensor(low, dtype=spec.action_dtype)
        self._high = torch.as_tensor(high, dtype=spec.action_dtype)
        self._shaped: tuple | None = None  # (per-env shape, low, high) as the policy's actions come

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        td = self.policy(td)
        action = td.get("action")
        shape = action.shape[1:]
        if self._shaped is None or self._shaped[0] != shape:
            low, high = (b.to(action.dtype).reshape(shape) if b.numel() == shape.numel() else b.to(action.dtype)
                         for b in (self._low, self._high))
            self._shaped = (shape, low.to(action.device), high.to(action.device))
        td.set("action", torch.clamp(action, self._shaped[1], self._shaped[2]))
        return td


def acting_policy(policy, spec: EnvSpec, checks: RowChecks):
    """The policy the rollout acts with: ``policy``, or clipped into the env's bounds
    (``workers.action_bounds = "clip"`` on an env that has bounds)."""
    return ClippedActions(policy, spec) if checks.bounds == "clip" and checks.low is not None else policy


def scanned(key, leaf: torch.Tensor) -> bool:
    """Whether ``check_finite`` scans this leaf of rows (beyond the action and the reward)."""
    return (key != "action" and key != _REWARD and isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
            and leaf[:1].numel() * leaf.element_size() < SMALL_ROW_BYTES)


def check_rows(rows: TensorDictBase, checks: RowChecks, floats: list) -> None:
    """Refuse a chunk that must never be stored (``EnvFault``; see the module's docstring).
    ``floats``: the ``(key, leaf)`` pairs of ``rows`` that :func:`scanned` picks (the rollout
    knows them, once per buffer layout)."""
    action = rows.get("action", None)
    if isinstance(action, torch.Tensor):
        _check_action(rows, action, checks)
    reward = rows.get(_REWARD, None)
    if reward is None:
        raise EnvFault("the env's transitions have no ('next', 'reward') entry", key="workers.env")
    _check_finite(rows, reward, "the env returned a non-finite reward", "fix the env")
    _check_done(rows)
    if not checks.finite:
        return
    for key, leaf in floats:
        _check_finite(rows, leaf, f"the env returned a non-finite {key!r}",
                      "fix the env, or set workers.check_finite = false to store such values")


def check_action(td: TensorDictBase, checks: RowChecks) -> None:
    """Refuse a policy's output whose ``action`` has another number of elements per sub-env
    than the env takes, or is non-finite, or (``refuse``) out of bounds: ``EnvFault`` naming
    ``workers.policy``. (The rollout calls it when the env's step raised: the env's own
    message, an index error deep in its dynamics, hid that the action was at fault.)"""
    action = td.get("action", None)
    if isinstance(action, torch.Tensor) and action.dim() > 0:
        _check_action(td, action, checks)


def _check_action(rows: TensorDictBase, action: torch.Tensor, checks: RowChecks) -> None:
    per_env = math.prod(action.shape[1:])
    if checks.elements is not None and per_env != checks.elements:
        raise EnvFault(f"the policy acted with {per_env} action elements per sub-env ({str(action.dtype)[6:]}"
                       f"{list(action.shape)}), but the env takes {checks.elements}; make the policy fit the "
                       "env's spec (EnvSpec.action_shape)", key="workers.policy")
    if action.is_floating_point():
        _check_finite(rows, action, "the policy returned a non-finite action",
                      "fix the policy (or the weights pushed to it)", at_fault="workers.policy")
    if checks.bounds != "refuse" or checks.low is None:
        return
    values = _numpy(action).reshape(action.shape[0], -1)
    if checks.uniform is not None and values.size:
        if values.min() >= checks.uniform[0] and values.max() <= checks.uniform[1]:
            return
    outside = (values < checks.lo) | (values > checks.hi)
    if not outside.any():
        return
    bad = np.flatnonzero(outside.any(1))
    row, col = int(bad[0]), int(np.flatnonzero(outside[bad[0]])[0])
    i = col if checks.low.size > 1 else 0
    raise EnvFault(f"the policy acted outside the env's action bounds in {bad.size} rows (first: {_where(rows, row)}, "
                   f"action element {col} = {values[row, col]:g}, bounds [{_bound(checks.low[i], action)}, "
                   f"{_bound(checks.high[i], action)}]); the chunk was not stored. Make the policy squash or clip "
                   "its actions, or set workers.action_bounds = \"clip\" (clamped before the env steps, and "
                   "stored clamped) or \"off\" (stored as they come)", key="workers.policy")


def _check_done(rows: TensorDictBase) -> None:
    """Refuse ``("next", "done")`` other than ``terminated | truncated`` (bool leaves of one shape)."""
    flags = [rows.get(("next", name), None) for name in ("done", "terminated", "truncated")]
    if not all(isinstance(f, torch.Tensor) and f.dtype == torch.bool for f in flags):
        return
    done, terminated, truncated = flags
    if not done.shape == terminated.shape == truncated.shape or done.dim() == 0:
        return
    if terminated.device != done.device or truncated.device != done.device:  # (not comparable where they are)
        return
    if done.is_cpu:  # (numpy: 5 µs for a 16,384-row chunk's flags here, torch 13 µs)
        done, terminated, truncated = (f.numpy() for f in flags)
        wrong = done != np.logical_or(terminated, truncated)
        if not wrong.any():
            return
        bad = np.flatnonzero(wrong.reshape(done.shape[0], -1).any(-1))
    else:  # an env on a GPU: compared there, only the rows at fault come back
        wrong = done != (terminated | truncated)
        if not bool(wrong.any()):
            return
        bad = wrong.reshape(done.shape[0], -1).any(-1).nonzero().flatten().cpu().numpy()
        done, terminated, truncated = (f.cpu().numpy() for f in flags)
    row = int(bad[0])
    raise EnvFault(f"the env's ('next', 'done') is not terminated or truncated in {bad.size} rows (first: "
                   f"{_where(rows, row)}: done {bool(done[row].any())}, terminated {bool(terminated[row].any())}, "
                   f"truncated {bool(truncated[row].any())}); the chunk was not stored. Set done = terminated | "
                   "truncated in the env (TorchRL's layout): the episode stamps follow done, losses read "
                   "terminated", key="workers.env")


def _check_finite(rows: TensorDictBase, values: torch.Tensor, what: str, todo: str,
                  at_fault: str = "workers.env") -> None:
    if not values.is_floating_point():
        return
    array = _numpy(values)
    if array is not None:
        flat = array.reshape(-1)
        if np.isfinite(np.dot(flat, flat)):  # NaN and inf carry into x.x (BLAS: a third of isfinite's cost)
            return
        finite = np.isfinite(array.reshape(array.shape[0], -1)).all(-1)  # or x.x overflowed: look closer
    else:
        finite = torch.isfinite(values).reshape(values.shape[0], -1).all(-1).cpu().numpy()
    bad = np.flatnonzero(~finite)
    if bad.size == 0:
        return
    first = values[int(bad[0])].reshape(-1)
    value = first[~torch.isfinite(first)][0].item()
    raise EnvFault(f"{what} in {bad.size} rows (first: {_where(rows, int(bad[0]))}, value {value}); the chunk was "
                   f"not stored: {todo}", key=at_fault)


def _numpy(values: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor numpy can read (a fifth of torch's cost for these checks)."""
    if values.is_cpu and values.dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8):
        return values.detach().numpy()
    return None if values.is_floating_point() else values.detach().cpu().to(torch.int64).numpy()


def _where(rows: TensorDictBase, row: int) -> str:
    """Which transition row ``row`` of a chunk is, by its stamps."""
    try:
        env, episode, step = (int(rows.get(("ingestd", f))[row]) for f in ("env", "episode", "step"))
    except (KeyError, IndexError, TypeError):
        return f"row {row} of the chunk"
    return f"sub-env {env}, episode {episode}, step {step}"


def _bound(value: float, action: torch.Tensor) -> str:
    return f"{value:g}" if action.is_floating_point() else str(int(value))

