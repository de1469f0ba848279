"""n-step transitions at ingest (TorchRL's ``MultiStep`` postproc), computed in the worker.

With ``workers.n_step = n > 1`` each stored row ``t`` of a sub-env covers the
``m <= n`` steps ``t .. t+m-1``, where ``m`` stops early at the end of the
episode (a window never crosses an episode end):

- ``("next", "reward")``  = ``sum_{k<m} gamma**k * reward[t+k]`` (the n-step return,
  summed in float64, stored in the reward's dtype);
- every other ``("next", ...)`` entry (observation, done, terminated, truncated
  and the env's extras) is the one of step ``t+m-1``: the observation ``m`` steps
  ahead and whether the episode ended within the window;
- ``steps_to_next_obs`` (int64 ``[1]``, TorchRL's name) = ``m``, so a target is
  ``reward + gamma**m * (1 - terminated) * V(next observation)``.

The root entries (observation, action, the ``("ingestd", ...)`` stamps) are
those of step ``t``. Rows are emitted ``n-1`` steps late: the last ``n-1``
steps of every sub-env are held across chunk boundaries until their windows
are complete, so the first chunk of a worker stores ``n-1`` steps fewer.
:meth:`NStep.flush` (called when a worker stops) emits the held steps with
the shorter windows they have, so nothing collected is lost.
"""
from __future__ import annotations

import torch
from tensordict import TensorDictBase

STEPS_KEY = "steps_to_next_obs"
_REWARD = ("next", "reward")


class NStep:
    """The stateful n-step transform of one worker's chunks (``[T * B]`` rows, step-major)."""

    def __init__(self, n: int, gamma: float, num_envs: int):
        if n < 1:
            raise ValueError(f"n_step must be >= 1, got {n}")
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        self.n, self.gamma, self.num_envs = n, float(gamma), num_envs
        self._held: TensorDictBase | None = None  # the last n-1 steps [<= n-1, B], not yet emitted

    @property
    def held_steps(self) -> int:
        return 0 if self._held is None else self._held.batch_size[0]

    def __call__(self, rows: TensorDictBase) -> TensorDictBase:
        """The rows whose windows are complete (``[K * B]``); holds the rest."""
        b = self.num_envs
        chunk = rows.reshape(rows.batch_size[0] // b, b)
        combined = chunk.clone() if self._held is None else torch.cat([self._held, chunk], 0)
        ready = max(0, combined.batch_size[0] - (self.n - 1))
        out = window(combined, ready, self.n, self.gamma)
        self._held = combined[ready:]
        return out

    def flush(self) -> TensorDictBase | None:
        """Every held step, with the (shorter) windows it has; ``None`` if nothing is held."""
        held, self._held = self._held, None
        if held is None or held.batch_size[0] == 0:
            return None
        return window(held, held.batch_size[0], self.n, self.gamma)


def window(steps: TensorDictBase, count: int, n: int, gamma: float) -> TensorDictBase:
    """n-step rows for the first ``count`` steps of ``steps`` ``[L, B]`` (windows cut at ``L``
    and at episode ends), flattened to ``[count * B]``."""
    length, b = steps.batch_size
    nxt = steps.get("next")
    reward = nxt.get("reward")
    per_env = reward.reshape(length, b, -1).to(torch.float64)
    done = nxt.get("done").reshape(length, b, -1).any(-1)
    t = torch.arange(count)
    total = torch.zeros((count, b, per_env.shape[-1]), dtype=torch.float64)
    steps_taken = torch.zeros((count, b), dtype=torch.int64)
    last = t[:, None].expand(count, b).clone()
    alive = torch.ones((count, b), dtype=torch.bool)
    for k in range(n):
        j = t + k
        valid = alive & (j < length)[:, None]
        j = j.clamp(max=max(length - 1, 0))
        total += per_env[j] * (valid.unsqueeze(-1) * gamma ** k)
        steps_taken += valid
        last = torch.where(valid, j[:, None], last)
        alive = valid & ~done[j]
    out = steps[:count]
    ahead = nxt[last, torch.arange(b).expand(count, b)]
    ahead.set("reward", total.to(reward.dtype).reshape(count, b, *reward.shape[2:]))
    out.set("next", ahead)
    out.set(STEPS_KEY, steps_taken.unsqueeze(-1))
    return out.reshape(count * b)


def schema_rows(rows: TensorDictBase, n: int, gamma: float) -> TensorDictBase:
    """The stored layout of ``rows`` (one step of one env) under n-step: for the storage schema."""
    transform = NStep(n, gamma, rows.batch_size[0])
    first = transform(rows)
    flushed = transform.flush()
    return first if flushed is None else flushed


__all__ = ["NStep", "STEPS_KEY", "schema_rows", "window"]
