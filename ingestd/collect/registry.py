"""Envs and policies named by import path: ``"package.module:attr"``.

Built-in short names: envs ``CartPole``, ``Pixels``, ``Checksum``, ``Gym``;
policies ``Random``, ``MLP``. Every user error is a ``ValueError`` that names
the bad path or kwargs and says what was expected, so a config checker can
reject a config before any worker starts.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping

from ingestd.collect.interfaces import Env, EnvContext, EnvSpec, Policy
from ingestd.service.config_toml import closest

ENV_ALIASES: Mapping[str, str] = {
    "CartPole": "ingestd.collect.envs.cartpole:CartPole",
    "Pixels": "ingestd.collect.envs.pixels:Pixels",
    "Checksum": "ingestd.collect.envs.checksum:Checksum",
    "Gym": "ingestd.collect.envs.gym:Gym",
}
POLICY_ALIASES: Mapping[str, str] = {
    "Random": "ingestd.collect.policies:Random",
    "MLP": "ingestd.collect.policies:MLP",
}
_FORMAT = "'package.module:attr'"


def resolve(path: str, aliases: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """The callable named by ``path`` (``"package.module:attr"``, or a key of ``aliases``)."""
    aliases = aliases or {}
    if not isinstance(path, str):
        raise ValueError(f"import path must be a string like {_FORMAT}, got {path!r}")
    target = aliases.get(path, path)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        names = f" or one of the built-in names {', '.join(aliases)}" if aliases else ""
        raise ValueError(f"bad import path {path!r}: expected {_FORMAT}{names}")
    module = _import(path, module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"bad import path {path!r}: module {module_name!r} has no attribute "
                             f"{attr!r}") from None
    if not callable(obj):
        raise ValueError(f"bad import path {path!r}: it names a {type(obj).__name__}, "
                         "not a callable factory")
    return obj


def _import(path: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(f"bad import path {path!r}: module {module_name!r} not found "
                             f"(no module named {missing!r})") from None
        raise  # the module exists but one of its own imports is missing


def resolve_env(path: str) -> Callable[..., Env]:
    """An env factory: a built-in name or an import path."""
    return resolve(path, ENV_ALIASES)


def resolve_policy(path: str) -> Callable[..., Policy]:
    """A policy factory: a built-in name or an import path."""
    return resolve(path, POLICY_ALIASES)


class NotAFactory(ValueError):
    """The factory itself cannot be called as ingestd calls it (not its kwargs): a config error
    about ``workers.env`` / ``workers.policy``, not ``..._kwargs``."""


def validate_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Check ``factory(first_arg, **kwargs)`` would bind: raises ``ValueError``
    naming unknown or missing keyword arguments. Factories whose signature
    cannot be read, or that take ``**kwargs``, accept any names."""
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return
    kinds = inspect.Parameter
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind is kinds.VAR_POSITIONAL for p in params):
        raise NotAFactory(f"{name} takes no positional argument; a factory must accept the "
                          "EnvContext (envs) or EnvSpec (policies) first (a TorchRL create_env_fn takes none: "
                          "wrap it, see docs/from-torchrl.md)")
    first = positional[0].name if positional else None
    named = {p.name: p for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
             and p.name != first}
    if first is not None and first in kwargs:
        raise ValueError(f"{name}: {first!r} is supplied by ingestd and cannot be set in the config")
    if not any(p.kind is kinds.VAR_KEYWORD for p in params):
        unknown = sorted(set(kwargs) - set(named))
        if unknown:
            free = [k for k in named if k not in kwargs]  # (not a name the config gives already)
            guesses = [(k, guess) for k in unknown if (guess := closest(k, free)) is not None]
            hint = "; did you mean " + ", ".join(f"{g!r} for {k!r}" for k, g in guesses) + "?" if guesses else ""
            raise ValueError(f"{name} got unknown keyword arguments {unknown}; "
                             f"it accepts {sorted(named) or 'none'}{hint}")
    missing = sorted(k for k, p in named.items() if p.default is kinds.empty and k not in kwargs)
    if missing:
        raise ValueError(f"{name} is missing required keyword arguments {missing}")


def make_env(path: str, ctx: EnvContext, kwargs: Mapping[str, Any] | None = None) -> Env:
    """Resolve, check the kwargs, build, and check the result is a batched ``Env``."""
    factory = resolve_env(path)
    kwargs = dict(kwargs or {})
    validate_kwargs(factory, kwargs)
    env = factory(ctx, **kwargs)
    if not isinstance(env, Env):
        raise TypeError(f"env factory {path!r} returned {type(env).__name__}, which is not an Env "
                        "(needs num_envs, spec, reset, step_and_maybe_reset, close)")
    if env.num_envs != ctx.num_envs:
        raise ValueError(f"env factory {path!r} built {env.num_envs} sub-envs; ctx asked for {ctx.num_envs}")
    return env


def make_policy(path: str, spec: EnvSpec, kwargs: Mapping[str, Any] | None = None) -> Policy:
    """Resolve, check the kwargs and build a policy for ``spec``."""
    factory = resolve_policy(path)
    kwargs = dict(kwargs or {})
    validate_kwargs(factory, kwargs)
    policy = factory(spec, **kwargs)
    if not callable(policy):
        raise TypeError(f"policy factory {path!r} returned {type(policy).__name__}, which is not callable")
    return policy
