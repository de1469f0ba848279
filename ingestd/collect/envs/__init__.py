"""Built-in batched envs (torch, vectorised) and the gymnasium adapter.

``Gym`` imports gymnasium only when constructed.
"""
from ingestd.collect.envs.base import TorchEnv
from ingestd.collect.envs.cartpole import CartPole
from ingestd.collect.envs.checksum import Checksum, verify_fields, verify_rows
from ingestd.collect.envs.gym import Gym
from ingestd.collect.envs.pixels import Pixels

__all__ = ["TorchEnv", "CartPole", "Checksum", "Gym", "Pixels", "verify_fields", "verify_rows"]
