"""``Gym``: any gymnasium env id, vectorised in-process, as an ingestd ``Env``.

``Gym(ctx, id="CartPole-v1", **gym_kwargs)`` runs
``gymnasium.make_vec(id, num_envs=ctx.num_envs, vectorization_mode="sync")``
with ``AutoresetMode.SAME_STEP``: a finished sub-env is reset inside the
step that ended it and its final observation comes back in ``infos``; the
adapter puts that final observation in ``("next", "observation")`` and the
reset one in the next root. A reset the env did not ask for (a sub-env cut by
``workers.max_episode_steps``) goes through gymnasium's ``reset_mask``.
``gym_kwargs`` go to ``gymnasium.make`` (e.g. ``max_episode_steps``). The first
reset is seeded with ``ctx.seed``.

Spaces: ``Box`` and ``Discrete`` observations; ``Discrete`` actions become an
int64 index ``[]`` (``0..n-1``, shifted by the space's ``start``), ``Box``
actions keep their shape as float32. ``infos`` other than the final
observation are not stored.
"""
from __future__ import annotations

import numpy as np
import torch

from ingestd.collect.envs.base import StepResult, TorchEnv
from ingestd.collect.interfaces import EnvContext, EnvSpec
from ingestd.errors import ConfigError


def _import_gymnasium():
    try:
        import gymnasium
    except ImportError as e:
        raise ImportError("the Gym env adapter needs gymnasium; install it with "
                          "`pip install 'ingestd[gym]'`") from e
    return gymnasium


class Gym(TorchEnv):
    """A gymnasium vector env (sync, same-step autoreset) in the TorchRL layout."""

    def __init__(self, ctx: EnvContext, id: str | None = None, **gym_kwargs):
        gymnasium = _import_gymnasium()
        if not isinstance(id, str) or not id:  # no default: a typo'd "idd" made CartPole-v1 and failed on "idd"
            extra = f" (got the keys {sorted(gym_kwargs)})" if gym_kwargs else ""
            raise ConfigError("workers.env_kwargs", f"the Gym env needs env_kwargs.id, a gymnasium env id such "
                                                    f"as \"CartPole-v1\" or \"Pendulum-v1\"{extra}")
        self.id = id
        try:
            self._env = gymnasium.make_vec(
                id, num_envs=ctx.num_envs, vectorization_mode="sync",
                vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP},
                **gym_kwargs,
            )
        except gymnasium.error.Error as e:  # an unknown id or version, a missing extra (box2d, atari)
            raise ConfigError("workers.env_kwargs", f"gym env {id!r} could not be made: {e}") from None
        try:
            spec, self._action_start = _spec_of(id, self._env.single_observation_space,
                                                self._env.single_action_space, gymnasium.spaces)
        except ValueError:
            self._env.close()
            raise
        super().__init__(ctx, spec)
        self._seed: int | None = ctx.seed
        self._after_reset: torch.Tensor | None = None
        self._reset_in_step: np.ndarray | None = None  # the sub-envs gymnasium reset during the last step

    def _reset(self, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            obs, _ = self._env.reset(seed=self._seed)
            self._seed = None  # later full resets continue the seeded streams
            self._after_reset, self._reset_in_step = self._observation(obs), None
            return self._after_reset
        forced = mask.cpu().numpy()  # the sub-envs that ended in the step were reset by gymnasium already;
        if self._reset_in_step is not None:  # the others (cut by StepLimit) are reset here
            forced = forced & ~self._reset_in_step
        if forced.any():
            obs, _ = self._env.reset(options={"reset_mask": forced})
            self._after_reset = self._observation(obs)
        return self._after_reset

    def _step(self, action: torch.Tensor) -> StepResult:
        obs, reward, terminated, truncated, infos = self._env.step(self._gym_action(action))
        after = self._observation(obs)
        self._after_reset = after
        self._reset_in_step = infos.get("_final_obs")
        final = after
        ended = np.flatnonzero(infos.get("_final_obs", ()))
        if ended.size:
            final = after.clone()
            for i in ended:
                final[i] = torch.as_tensor(np.asarray(infos["final_obs"][i]), dtype=final.dtype)
        device = self.device
        return (final, torch.tensor(reward, dtype=torch.float32, device=device),
                torch.tensor(terminated, device=device), torch.tensor(truncated, device=device), {})

    def _close(self) -> None:
        self._env.close()

    def _gym_action(self, action: torch.Tensor) -> np.ndarray:
        action = action.cpu().numpy()  # a no-op on CPU; gymnasium steps on the host
        return action + self._action_start if self._action_start else action

    def _observation(self, obs: np.ndarray) -> torch.Tensor:
        return torch.tensor(obs, dtype=self.spec.observation_dtype, device=self.device).view(self.num_envs, *self.spec.observation_shape)


def _spec_of(id: str, obs_space, action_space, spaces) -> tuple[EnvSpec, int | None]:
    """The EnvSpec of gymnasium spaces, and the Discrete action ``start`` (None for Box)."""
    if isinstance(obs_space, spaces.Box):
        obs_shape, obs_dtype = tuple(obs_space.shape), _torch_dtype(obs_space.dtype)
    elif isinstance(obs_space, spaces.Discrete):
        obs_shape, obs_dtype = (), torch.int64
    else:
        raise ConfigError("workers.env", f"gym env {id!r}: observation space {obs_space} is not supported; "
                         "the Gym adapter takes Box or Discrete observations")
    if isinstance(action_space, spaces.Discrete):
        spec = EnvSpec(obs_shape, obs_dtype, (), torch.int64, int(action_space.n))
        return spec, int(action_space.start)
    if isinstance(action_space, spaces.Box):
        low, high = (tuple(float(v) for v in np.asarray(b, dtype=np.float64).reshape(-1))
                     for b in (action_space.low, action_space.high))
        return EnvSpec(obs_shape, obs_dtype, tuple(action_space.shape), torch.float32, None, low, high), None
    raise ConfigError("workers.env", f"gym env {id!r}: action space {action_space} is not supported; "
                     "the Gym adapter takes Discrete or Box actions")


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros((), dtype=np_dtype)).dtype
