"""A policy whose actions show its weights, for the control-plane tests and benchmark.

``readable(spec, pad=0)``: every action is ``round(bias) % num_actions``, so a
stored row's ``action`` tells which weights produced it. ``pad`` adds an unused
float32 parameter of that many elements (a large push costs no compute).

The daemon imports it as ``control_plugins:readable``: put ``tests/`` on its
PYTHONPATH.
"""
from __future__ import annotations

import torch
from torch import nn


class Readable(nn.Module):
    def __init__(self, num_actions: int, pad: int = 0):
        super().__init__()
        self.num_actions = num_actions
        self.bias = nn.Parameter(torch.zeros(1), requires_grad=False)
        if pad:
            self.pad = nn.Parameter(torch.zeros(pad), requires_grad=False)

    @staticmethod
    def check_weights(state: dict) -> None:
        """The policy's own test of a push (``Policy.check_weights``): a bias past 1000 is refused."""
        if abs(float(state["bias"][0])) > 1000:
            raise ValueError(f"bias {float(state['bias'][0]):g} is past 1000")

    def action(self) -> int:
        return int(round(float(self.bias[0]))) % self.num_actions

    def forward(self, td):
        td.set("action", torch.full(td.batch_size, self.action(), dtype=torch.int64))
        return td


def readable(spec, pad: int = 0) -> Readable:
    if spec.num_actions is None:
        raise ValueError("the readable policy needs a discrete action space")
    return Readable(spec.num_actions, pad)


def weights(bias: float, pad: int = 0) -> dict[str, torch.Tensor]:
    """A state dict for ``readable`` whose actions will be ``round(bias) % num_actions``."""
    state = {"bias": torch.tensor([float(bias)])}
    if pad:
        state["pad"] = torch.zeros(pad)
    return state
