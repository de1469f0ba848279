"""A tiny goal-conditioned gymnasium env with a Dict observation space, registered on import
(``gymnasium.make("gym_goal_env:Goal-v0")`` imports this module, in a daemon too).

Every entry is a function of (episode, step), so a stored row can be checked: ``observation``
is ``[step, episode]``, ``achieved_goal`` ``[step]``, ``desired_goal`` ``[episode]``, and
``phase`` (Discrete) is ``step % 3``. Episodes terminate after ``length`` steps. ``main``
renames the ``observation`` entry; ``nested`` adds a Dict entry, ``clash`` one named ``done``.
Infos: ``is_success`` (the episode's last step) and ``dist`` (steps left)."""
from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium import spaces


class Goal(gymnasium.Env):
    def __init__(self, length: int = 3, nested: bool = False, clash: bool = False, main: str = "observation"):
        self.main = main
        entries = {main: spaces.Box(-1e6, 1e6, (2,), np.float32),
                   "achieved_goal": spaces.Box(-1e6, 1e6, (1,), np.float32),
                   "desired_goal": spaces.Box(-1e6, 1e6, (1,), np.float32),
                   "phase": spaces.Discrete(3)}
        if nested:
            entries["inner"] = spaces.Dict({"x": spaces.Discrete(2)})
        if clash:
            entries["done"] = spaces.Discrete(2)
        self.observation_space = spaces.Dict(entries)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.length, self.episode, self.t = length, -1, 0

    def _obs(self) -> dict:
        return {self.main: np.array([self.t, self.episode], np.float32),
                "achieved_goal": np.array([self.t], np.float32),
                "desired_goal": np.array([self.episode], np.float32), "phase": self.t % 3}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.episode, self.t = self.episode + 1, 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(self.t), self.t >= self.length, False, {"is_success": self.t >= self.length,
                                                                             "dist": float(self.length - self.t)}


gymnasium.register("Goal-v0", entry_point=Goal)
