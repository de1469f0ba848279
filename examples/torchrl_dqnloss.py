#!/usr/bin/env python3
"""The DQN example with TorchRL's ``DQNLoss`` in place of the hand-written loss.

Everything else (attach by path, the max-lag filter, pushing weights and the
annealed epsilon, watching the daemon's returns) is ``dqn_cartpole.py``'s.
The point is that the batch ``ReplayReader.sample`` returns goes into the
TorchRL loss **unchanged**. It is a TensorDict in TorchRL's layout
(``observation``, ``action``, ``("next", "reward" | "done" | "terminated" |
"observation")``), and the extra ``("ingestd", ...)`` stamps are ignored::

    loss_td = dqn_loss(reader.sample(256))      # TensorDict with "loss"

``DQNLoss`` trains the very parameters of the ``mlp_qnet`` it wraps, so
``push_weights(qnet)`` sends what it learned under the names the daemon's MLP
policy expects.

Needs ``pip install torchrl`` (ingestd does not depend on it; tried with
torchrl 0.14.1 on torch 2.13 and tensordict 0.15.3). Same command line as
``dqn_cartpole.py``::

    python examples/torchrl_dqnloss.py --replay ~/.local/state/ingestd/replay --seconds 120
"""
from __future__ import annotations

import sys

import torch

import dqn_cartpole
from dqn_cartpole import TrainConfig, adam

try:
    from torchrl.data import Categorical
    from torchrl.modules import QValueActor
    from torchrl.objectives import DQNLoss, SoftUpdate
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise SystemExit(f"this example needs torchrl ({exc}); pip install torchrl") from None


class TorchRLLearner:
    """``dqn_cartpole.Learner`` backed by ``torchrl.objectives.DQNLoss`` and ``SoftUpdate``."""

    def __init__(self, qnet: torch.nn.Module, cfg: TrainConfig):
        self.cfg = cfg
        actor = QValueActor(qnet, in_keys=["observation"], spec=Categorical(qnet.num_actions))
        self.loss = DQNLoss(actor, loss_function="smooth_l1", delay_value=True, double_dqn=cfg.double,
                            action_space="categorical")
        self.loss.make_value_estimator(gamma=cfg.gamma)
        self.target_update = SoftUpdate(self.loss, tau=cfg.tau)
        self.params = list(self.loss.parameters())
        self.optim = adam(self.params, cfg.lr)

    def step(self, batch) -> torch.Tensor:
        loss = self.loss(batch)["loss"]  # the ingestd sample as it came out of the reader
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optim.step()
        self.target_update.step()
        return loss.detach()


if __name__ == "__main__":
    sys.exit(dqn_cartpole.main(learner=TorchRLLearner, description=__doc__.splitlines()[0]))
