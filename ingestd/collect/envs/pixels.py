"""``Pixels``: an Atari-shaped env that costs almost nothing to simulate.

Observations are stacks of 4 frames of 84x84 uint8 pixels cut from a tape of
random frames made once at construction; a step moves each sub-env's read
position along the tape (by 1 + action) and copies its window out, then
writes the episode step into one corner pixel. No per-pixel arithmetic.

Episodes end at a random step: each episode draws an end in
``[1, 2 * max_steps]``; ends at or before ``max_steps`` terminate, the rest
are truncated at ``max_steps`` (about half of each).
Reward is 1.0 when the action equals the episode's (hidden) rewarded action.
"""
from __future__ import annotations

import torch

from ingestd.collect.envs.base import StepResult, TorchEnv
from ingestd.collect.interfaces import EnvContext, EnvSpec

FRAME = 84
STACK = 4
NUM_ACTIONS = 6

SPEC = EnvSpec(observation_shape=(STACK, FRAME, FRAME), observation_dtype=torch.uint8,
               action_shape=(), action_dtype=torch.int64, num_actions=NUM_ACTIONS)


class Pixels(TorchEnv):
    """``Pixels(ctx, max_steps=100, tape_frames=64)``: observation uint8
    ``[4, 84, 84]``, action int64 ``[]`` in ``0..5``."""

    def __init__(self, ctx: EnvContext, max_steps: int = 100, tape_frames: int = 64):
        if max_steps < 1:
            raise ValueError(f"Pixels max_steps must be >= 1, got {max_steps}")
        if tape_frames < STACK:
            raise ValueError(f"Pixels tape_frames must be >= {STACK}, got {tape_frames}")
        super().__init__(ctx, SPEC)
        self.max_steps = max_steps
        n, dev = ctx.num_envs, self.device
        self._windows = _frame_windows(tape_frames, self._gen, dev)
        self._tape_frames = tape_frames
        self._pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self._steps = torch.zeros(n, dtype=torch.int64, device=dev)
        self._end = torch.zeros(n, dtype=torch.int64, device=dev)
        self._rewarded = torch.zeros(n, dtype=torch.int64, device=dev)

    def _reset(self, mask: torch.Tensor | None) -> torch.Tensor:
        n, gen, dev = self.num_envs, self._gen, self.device
        fresh = (
            torch.randint(0, self._tape_frames, (n,), generator=gen, device=dev),
            torch.randint(1, 2 * self.max_steps + 1, (n,), generator=gen, device=dev),
            torch.randint(0, NUM_ACTIONS, (n,), generator=gen, device=dev),
        )
        for field, new in zip((self._pos, self._end, self._rewarded), fresh):
            if mask is None:
                field.copy_(new)
            else:
                torch.where(mask, new, field, out=field)
        if mask is None:
            self._steps.zero_()
        else:
            self._steps.masked_fill_(mask, 0)
        return self._observation()

    def _step(self, action: torch.Tensor) -> StepResult:
        action = action.view(-1)
        self._pos.add_(action).add_(1).remainder_(self._tape_frames)
        self._steps.add_(1)
        terminated = self._steps >= self._end
        truncated = self._steps >= self.max_steps
        reward = (action == self._rewarded).to(torch.float32)
        return self._observation(), reward, terminated, truncated, {}

    def _observation(self) -> torch.Tensor:
        obs = self._windows.index_select(0, self._pos)
        obs[:, -1, 0, 0] = self._steps.to(torch.uint8)  # the newest frame's corner: step mod 256
        return obs


def _frame_windows(frames: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A ``[frames, 4, 84, 84]`` view over a looping tape of random frames:
    window ``p`` is frames ``p .. p+3`` (wrapping), without copying."""
    tape = torch.randint(0, 256, (frames + STACK - 1, FRAME, FRAME), generator=gen,
                         dtype=torch.uint8, device=device)
    tape[frames:] = tape[: STACK - 1]
    px = FRAME * FRAME
    return tape.as_strided((frames, STACK, FRAME, FRAME), (px, px, FRAME, 1))
