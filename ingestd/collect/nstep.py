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

from typing import Mapping

import torch
from tensordict import TensorDictBase

from ingestd.collect.rollout import copy_into

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

    def ready_steps(self, steps: int) -> int:
        """How many steps the next call emits for a chunk of ``steps`` steps."""
        return max(0, self.held_steps + steps - (self.n - 1))

    def __call__(self, rows: TensorDictBase, into: Mapping[tuple, torch.Tensor] | None = None) -> TensorDictBase:
        """The rows whose windows are complete (``[K * B]``, ``K = ready_steps``); holds the rest.

        ``into`` maps keys of large leaves (images) to ``[K * B, ...]`` tensors, the storage's
        reserved slots (``ReplayStorage.reserved``): those leaves are written there, straight
        from the chunk, and the rows returned hold them. Without it the held steps and the
        chunk are concatenated and every leaf is gathered from that: for image rows, three
        more copies of each image than the slots need."""
        b = self.num_envs
        chunk = rows.reshape(rows.batch_size[0] // b, b)
        ready = self.ready_steps(chunk.batch_size[0])
        large = _fitting(chunk, into, ready * b)
        if ready == 0 or not large:
            combined = _after(self._held, chunk)
            out = window(combined, ready, self.n, self.gamma)
            self._held = combined[ready:]
            return out
        return self._into_slots(chunk, ready, large, into)

    def _into_slots(self, chunk: TensorDictBase, ready: int, large: list[tuple],
                    into: Mapping[tuple, torch.Tensor]) -> TensorDictBase:
        """``__call__`` with the ``large`` leaves written into ``into``: the small leaves'
        windows as usual, each image copied or gathered once, straight from the chunk."""
        b, held = self.num_envs, self._held
        small = chunk.exclude(*large)
        combined = _after(None if held is None else held.exclude(*large), small)
        last, out = _windows(combined, ready, self.n, self.gamma)
        h = min(self.held_steps, ready)  # emitted steps that were held; the chunk's first ready - h follow
        for key in large:
            dest = into[key].view(ready, b, *into[key].shape[1:])
            if key[0] == "next":  # each window's last step
                _gather_steps(dest, last, None if held is None else held.get(key), chunk.get(key), self.n)
            else:  # each emitted step's root
                if h:
                    copy_into(dest[:h], held.get(key)[:h])
                copy_into(dest[h:], chunk.get(key)[:ready - h])
        steps = chunk.batch_size[0]  # the last n - 1 steps are held for the next call (copies: the
        # chunk's buffers are the rollout's, overwritten by the next chunk)
        self._held = chunk[steps - (self.n - 1):].clone() if steps >= self.n - 1 else _after(held, chunk)[ready:]
        out = out.reshape(ready * b)
        for key in large:
            out.set(key, into[key])
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
    return _windows(steps, count, n, gamma)[1].reshape(count * steps.batch_size[1])


def _windows(steps: TensorDictBase, count: int, n: int, gamma: float) -> tuple[torch.Tensor, TensorDictBase]:
    """``(last, rows)``: for each of the first ``count`` steps of ``steps`` ``[L, B]`` and each
    sub-env, the step its window ends at (``[count, B]``), and the n-step rows ``[count, B]``."""
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
    return last, out


def _after(held: TensorDictBase | None, chunk: TensorDictBase) -> TensorDictBase:
    """The held steps followed by the chunk's, in new memory (the chunk's buffers are the
    rollout's, overwritten by its next chunk)."""
    return chunk.clone() if held is None else torch.cat([held, chunk], 0)


def _fitting(chunk: TensorDictBase, into: Mapping[tuple, torch.Tensor] | None, rows: int) -> list[tuple]:
    """Keys of ``into`` whose tensors fit ``rows`` rows of the chunk's leaf (else gathered as usual)."""
    if not into:
        return []
    keys = []
    for key, dest in into.items():
        leaf = chunk.get(key, None)
        if (isinstance(leaf, torch.Tensor) and dest.shape == (rows, *leaf.shape[2:]) and dest.dtype == leaf.dtype
                and dest.device == leaf.device and dest.is_contiguous()):
            keys.append(key)
    return keys


def _gather_steps(dest: torch.Tensor, last: torch.Tensor, held: torch.Tensor | None, chunk: torch.Tensor,
                  n: int) -> None:
    """``dest[t, i] = (held ++ chunk)[last[t, i], i]`` without concatenating anything. A whole
    window of step ``t`` ends at ``t + n - 1``, always inside the chunk (the held steps are its
    ``n - 1`` predecessors at most): one contiguous copy fills every row, and the rows whose
    window an episode's end cut short are then gathered one by one."""
    count, b = dest.shape[:2]
    h = 0 if held is None else held.shape[0]
    copy_into(dest, chunk[n - 1 - h:n - 1 - h + count])
    cut = (last != torch.arange(count)[:, None] + (n - 1)).reshape(-1).nonzero().squeeze(1)
    if cut.numel() == 0:
        return
    ends, envs = last.reshape(-1)[cut], cut % b
    rows = dest.flatten(0, 1)
    in_held = ends < h
    if bool(in_held.any()):
        rows[cut[in_held]] = held[ends[in_held], envs[in_held]]
    rest = ~in_held
    rows[cut[rest]] = chunk[ends[rest] - h, envs[rest]]


def schema_rows(rows: TensorDictBase, n: int, gamma: float) -> TensorDictBase:
    """The stored layout of ``rows`` (one step of one env) under n-step: for the storage schema."""
    transform = NStep(n, gamma, rows.batch_size[0])
    first = transform(rows)
    flushed = transform.flush()
    return first if flushed is None else flushed


__all__ = ["NStep", "STEPS_KEY", "schema_rows", "window"]
