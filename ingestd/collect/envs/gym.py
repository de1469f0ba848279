"""``Gym``: any gymnasium env id, vectorised in-process, as an ingestd ``Env``.

``Gym(ctx, id="CartPole-v1", **gym_kwargs)`` runs
``gymnasium.make_vec(id, num_envs=ctx.num_envs, vectorization_mode="sync")``
with ``AutoresetMode.SAME_STEP``: a finished sub-env is reset inside the
step that ended it and its final observation comes back in ``infos``; the
adapter puts that final observation in ``("next", "observation")`` and the
reset one in the next root. A reset the env did not ask for (a sub-env cut by
``workers.max_episode_steps``) goes through gymnasium's ``reset_mask``.
``gym_kwargs`` go to ``gymnasium.make`` (e.g. ``max_episode_steps``);
``wrappers`` (import paths, or ``{path, kwargs}`` tables) wrap each sub-env in
order. The first reset is seeded with ``ctx.seed``.

Spaces: ``Box`` and ``Discrete`` observations, or a ``Dict`` of them: its
``observation_key`` entry (default ``"observation"``) is the row's
``observation``, the other entries are row keys of their own (root and
``"next"``). ``Discrete`` actions become an int64 index ``[]`` (``0..n-1``,
shifted by the space's ``start``), ``Box`` actions keep their shape as
float32. ``info_keys`` (``{name = dtype}``) stores those scalar infos under ``"next"`` (the final
step's for a sub-env that ended); other ``infos`` are not stored.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ingestd.collect.envs.base import StepResult, TorchEnv
from ingestd.collect.interfaces import EnvContext, EnvSpec
from ingestd.collect.registry import resolve, validate_kwargs
from ingestd.errors import ConfigError, EnvFault

OBSERVATION = "observation"
RESERVED = frozenset((OBSERVATION, "action", "done", "terminated", "truncated", "reward", "next", "ingestd"))


def _import_gymnasium():
    try:
        import gymnasium
    except ImportError as e:
        raise ImportError("the Gym env adapter needs gymnasium; install it with "
                          "`pip install 'ingestd[gym]'`") from e
    return gymnasium


class Gym(TorchEnv):
    """A gymnasium vector env (sync, same-step autoreset) in the TorchRL layout."""

    def __init__(self, ctx: EnvContext, id: str | None = None, wrappers: Sequence = (),
                 observation_key: str = "observation", info_keys: Mapping[str, str] | None = None, **gym_kwargs):
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
                wrappers=_wrappers(wrappers) or None, **gym_kwargs,
            )
        except gymnasium.error.Error as e:  # an unknown id or version, a missing extra (box2d, atari)
            raise ConfigError("workers.env_kwargs", f"gym env {id!r} could not be made: {e}") from None
        except TypeError as e:  # a make kwarg the env does not take ("unexpected keyword argument 'gg'")
            named = re.search(r"keyword argument '(\w+)'", str(e))
            if named is None or named.group(1) not in gym_kwargs:  # an error in the env's own code
                raise
            raise ConfigError("workers.env_kwargs", f"gym env {id!r} could not be made with the env_kwargs "
                                                    f"{sorted(gym_kwargs)}: {e}") from None
        try:
            self._infos = _info_keys(info_keys or {})
            self._obs = Observations.of(id, self._env.single_observation_space, gymnasium.spaces, observation_key)
            clash = sorted(set(self._infos) & set(self._obs.entries))
            if clash:
                raise ConfigError("workers.env_kwargs", f"info_keys {clash} are observation entries too; name "
                                                        "other infos")
            spec, self._action_start = _spec_of(id, self._obs, self._env.single_action_space, gymnasium.spaces)
        except ValueError:
            self._env.close()
            raise
        super().__init__(ctx, spec)
        self._seed: int | None = ctx.seed
        self._after_reset: dict[str, torch.Tensor] = {}  # every observation entry after the last step or reset
        self._reset_in_step: np.ndarray | None = None  # the sub-envs gymnasium reset during the last step

    def _reset(self, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            obs, _ = self._env.reset(seed=self._seed)
            self._seed = None  # later full resets continue the seeded streams
            self._after_reset, self._reset_in_step = self._observation(obs), None
            return self._after_reset[OBSERVATION]
        forced = mask.cpu().numpy()  # the sub-envs that ended in the step were reset by gymnasium already;
        if self._reset_in_step is not None:  # the others (cut by StepLimit) are reset here
            forced = forced & ~self._reset_in_step
        if forced.any():
            obs, _ = self._env.reset(options={"reset_mask": forced})
            self._after_reset = self._observation(obs)
        return self._after_reset[OBSERVATION]

    def _root_extras(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._after_reset.items() if k != OBSERVATION}

    def _step(self, action: torch.Tensor) -> StepResult:
        obs, reward, terminated, truncated, infos = self._env.step(self._gym_action(action))
        after = self._observation(obs)
        self._after_reset = after
        self._reset_in_step = infos.get("_final_obs")
        final = after
        ended = np.flatnonzero(infos.get("_final_obs", ()))
        if ended.size:
            final = self._obs.with_final(after, infos["final_obs"], ended)
        device = self.device
        extras = {k: v for k, v in final.items() if k != OBSERVATION}
        for name, dtype in self._infos.items():
            extras[name] = _info(infos, name, dtype, self.num_envs).to(device)
        return (final[OBSERVATION], torch.tensor(reward, dtype=torch.float32, device=device),
                torch.tensor(terminated, device=device), torch.tensor(truncated, device=device), extras)

    def _close(self) -> None:
        self._env.close()

    def _gym_action(self, action: torch.Tensor) -> np.ndarray:
        action = action.cpu().numpy()  # a no-op on CPU; gymnasium steps on the host
        return action + self._action_start if self._action_start else action

    def _observation(self, obs) -> dict[str, torch.Tensor]:
        return self._obs.tensors(obs, self.num_envs, self.device)


class Observations:
    """How a gymnasium observation space maps to row keys: the entry the policy reads is stored
    as ``"observation"``; the other entries of a ``Dict`` space under their own names, in the
    root and under ``"next"`` (TorchRL's layout for goal-conditioned envs: ``achieved_goal``,
    ``desired_goal``)."""

    def __init__(self, entries: dict[str, tuple[str | None, tuple[int, ...], torch.dtype]]):
        # row key -> (the Dict space's key, None when the space is not a Dict; shape per sub-env;
        # dtype), OBSERVATION first
        self.entries = entries

    @classmethod
    def of(cls, id: str, space, spaces, observation_key: str = OBSERVATION) -> "Observations":
        if not isinstance(space, spaces.Dict):
            if observation_key != OBSERVATION:
                raise ConfigError("workers.env_kwargs", f"gym env {id!r}: observation_key picks an entry of a Dict "
                                                        f"observation space, and this env's is {space}; leave it out")
            return cls({OBSERVATION: (None, *_entry(id, "", space, spaces))})
        names = list(space.spaces)
        if observation_key not in names:
            raise ConfigError("workers.env_kwargs", f"gym env {id!r}: its Dict observation space has the entries "
                                                    f"{names}, none named {observation_key!r}; set env_kwargs."
                                                    "observation_key to the entry the policy acts on")
        entries = {OBSERVATION: (observation_key, *_entry(id, observation_key, space[observation_key], spaces))}
        for name in names:
            if name == observation_key:
                continue
            if not isinstance(name, str) or name in RESERVED:
                raise ConfigError("workers.env", f"gym env {id!r}: its Dict observation entry {name!r} would "
                                                 f"overwrite a row key ({', '.join(sorted(RESERVED))}); rename it "
                                                 "with a wrapper (env_kwargs.wrappers)")
            entries[name] = (name, *_entry(id, name, space[name], spaces))
        return cls(entries)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entries[OBSERVATION][1]

    @property
    def dtype(self) -> torch.dtype:
        return self.entries[OBSERVATION][2]

    def tensors(self, obs, n: int, device) -> dict[str, torch.Tensor]:
        """The vector env's observation (an array, or a dict of arrays) as ``[n, ...]`` tensors."""
        return {key: torch.tensor(obs if src is None else obs[src], dtype=dtype, device=device).view(n, *shape)
                for key, (src, shape, dtype) in self.entries.items()}

    def with_final(self, after: dict[str, torch.Tensor], final_obs, ended: np.ndarray) -> dict[str, torch.Tensor]:
        """``after`` with the rows of the sub-envs ``ended`` replaced by their final observations."""
        final = {key: value.clone() for key, value in after.items()}
        for i in ended:
            for key, (src, _, _) in self.entries.items():
                value = final_obs[i] if src is None else final_obs[i][src]
                final[key][i] = torch.as_tensor(np.asarray(value), dtype=final[key].dtype)
        return final


def _entry(id: str, name: str, space, spaces) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, dtype)`` of one observation (entry) space: a Box or a Discrete."""
    if isinstance(space, spaces.Box):
        return tuple(space.shape), _torch_dtype(space.dtype)
    if isinstance(space, spaces.Discrete):
        return (), torch.int64
    what = f"observation entry {name!r}" if name else "observation space"
    raise ConfigError("workers.env", f"gym env {id!r}: {what} {space} is not supported; the Gym adapter takes "
                                     "Box or Discrete observations, or a Dict of them (a nested space: flatten "
                                     "it with a wrapper, env_kwargs.wrappers = [\"gymnasium.wrappers:"
                                     "FlattenObservation\"])")


_INFO_DTYPES = ("bool", "int32", "int64", "float32", "float64")


def _info_keys(keys: Mapping[str, str]) -> dict[str, torch.dtype]:
    """``env_kwargs.info_keys``: the infos stored, each a scalar per sub-env of the dtype given."""
    if not isinstance(keys, Mapping):
        raise ConfigError("workers.env_kwargs", f"info_keys must be a table of info name = dtype (one of "
                                                f"{', '.join(_INFO_DTYPES)}), got {keys!r}")
    out = {}
    for name, dtype in keys.items():
        if not isinstance(name, str) or name in RESERVED or dtype not in _INFO_DTYPES:
            raise ConfigError("workers.env_kwargs", f"info_keys.{name} = {dtype!r}: an info is stored under its own "
                                                    f"name (not one of {', '.join(sorted(RESERVED))}) with a dtype of "
                                                    f"{', '.join(_INFO_DTYPES)}")
        out[name] = getattr(torch, dtype)
    return out


def _info(infos: dict, name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Info ``name`` of a step as ``[n, 1]``: each sub-env's value from the step's infos, the final
    step's (``final_info``) for the sub-envs that ended and were reset in it, 0 where absent."""
    out = torch.zeros(n, dtype=dtype)
    for source in (infos, infos.get("final_info")):
        if not source or name not in source or f"_{name}" not in source:
            continue
        values, mask = np.asarray(source[name]), np.asarray(source[f"_{name}"], dtype=bool)
        if values.shape != (n,):
            raise EnvFault(f"info {name!r} (env_kwargs.info_keys) is {values.shape} per step, not one scalar per "
                           f"sub-env ({n}); store scalar infos only")
        picked = torch.from_numpy(mask)
        out[picked] = torch.as_tensor(values[mask]).to(dtype)
    return out.view(n, 1)


def _wrappers(entries) -> list[Callable]:
    """gymnasium wrappers by import path: ``"module:Wrapper"`` or ``{path = "module:Wrapper",
    kwargs = {...}}``, applied to each sub-env in order (``wrappers=`` of ``gymnasium.make_vec``)."""
    if not isinstance(entries, (list, tuple)):
        raise ConfigError("workers.env_kwargs", f"wrappers must be a list of import paths (\"module:Wrapper\") "
                                                f"or tables {{ path = ..., kwargs = {{...}} }}, got {entries!r}")
    made = []
    for i, entry in enumerate(entries):
        path, kwargs = entry, {}
        if isinstance(entry, Mapping):  # a config's tables arrive frozen (Mappings, not dicts)
            unknown = sorted(set(entry) - {"path", "kwargs"})
            path, kwargs = entry.get("path"), entry.get("kwargs", {})
            if unknown or not isinstance(kwargs, Mapping):
                raise ConfigError("workers.env_kwargs", f"wrappers[{i}] must be {{ path = \"module:Wrapper\", "
                                                        f"kwargs = {{...}} }}, got {dict(entry)!r}")
            kwargs = dict(kwargs)
        try:
            wrapper = resolve(path)
            validate_kwargs(wrapper, kwargs)
        except ValueError as e:  # a bad path, unknown or missing kwargs
            raise ConfigError("workers.env_kwargs", f"wrappers[{i}]: {e}") from None
        made.append(functools.partial(wrapper, **kwargs))
    return made


def _spec_of(id: str, obs: Observations, action_space, spaces) -> tuple[EnvSpec, int | None]:
    """The EnvSpec of the observation entries and the action space, and the Discrete action
    ``start`` (None for Box)."""
    if isinstance(action_space, spaces.Discrete):
        spec = EnvSpec(obs.shape, obs.dtype, (), torch.int64, int(action_space.n))
        return spec, int(action_space.start)
    if isinstance(action_space, spaces.Box):
        low, high = (tuple(float(v) for v in np.asarray(b, dtype=np.float64).reshape(-1))
                     for b in (action_space.low, action_space.high))
        return EnvSpec(obs.shape, obs.dtype, tuple(action_space.shape), torch.float32, None, low, high), None
    raise ConfigError("workers.env", f"gym env {id!r}: action space {action_space} is not supported; "
                     "the Gym adapter takes Discrete or Box actions")


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros((), dtype=np_dtype)).dtype
