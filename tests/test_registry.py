"""Naming envs and policies by import path; kwargs checked against signatures."""
from __future__ import annotations

import pytest
import torch

from ingestd.collect import EnvContext, make_env, make_policy, resolve, resolve_env, resolve_policy, validate_kwargs
from ingestd.collect.envs import CartPole, Checksum, Gym, Pixels
from ingestd.collect.policies import MLP, Random

CTX = EnvContext(num_envs=3, seed=0, worker=0, episode_base=0)


@pytest.mark.parametrize("resolver, name, expected", [
    (resolve_env, "CartPole", CartPole),
    (resolve_env, "Pixels", Pixels),
    (resolve_env, "Checksum", Checksum),
    (resolve_env, "Gym", Gym),
    (resolve_env, "ingestd.collect.envs.pixels:Pixels", Pixels),
    (resolve_policy, "Random", Random),
    (resolve_policy, "MLP", MLP),
    (resolve_policy, "ingestd.collect.policies:MLP", MLP),
    (resolve_policy, "ingestd.collect.policies:MLP.q_values", MLP.q_values),  # dotted attribute
])
def test_builtin_names_and_import_paths(resolver, name, expected):
    assert resolver(name) is expected


@pytest.mark.parametrize("resolver, path, message", [
    (resolve_env, "cartpole", "expected 'package.module:attr' or one of the built-in names CartPole"),
    (resolve_env, "MLP", "expected 'package.module:attr'"),  # a policy name is not an env
    (resolve_policy, "ingestd.collect.policies", "expected 'package.module:attr'"),
    (resolve_policy, "ingestd.collect.policies:", "expected"),
    (resolve_policy, ":MLP", "expected"),
    (resolve_policy, "a:b:c", "expected"),
    (resolve_env, "no_such_package_xyz.envs:Env", "module 'no_such_package_xyz.envs' not found"),
    (resolve_env, "ingestd.no_such_module:Env", "module 'ingestd.no_such_module' not found"),
    (resolve_policy, "ingestd.collect.policies:Nope", "has no attribute 'Nope'"),
    (resolve_env, "ingestd.collect.envs.cartpole:X_THRESHOLD", "names a float, not a callable factory"),
])
def test_bad_paths_name_the_path_and_what_was_expected(resolver, path, message):
    with pytest.raises(ValueError) as err:
        resolver(path)
    assert repr(path) in str(err.value) and message in str(err.value)


def test_non_string_path():
    with pytest.raises(ValueError, match="must be a string"):
        resolve(42)


def _factory(ctx, size, scale=1.0, *, mode="a"):
    return ctx


def _open_factory(ctx, **anything):
    return ctx


@pytest.mark.parametrize("factory, kwargs, message", [
    (_factory, {"size": 1}, None),
    (_factory, {"size": 1, "scale": 2.0, "mode": "b"}, None),
    (_factory, {"size": 1, "colour": 1, "depth": 2}, r"unknown keyword arguments \['colour', 'depth'\]"),
    (_factory, {"scale": 2.0}, r"missing required keyword arguments \['size'\]"),
    (_factory, {"size": 1, "ctx": 0}, "'ctx' is supplied by ingestd"),
    (_open_factory, {"anything": 1, "at_all": 2}, None),
    (lambda: None, {}, "takes no positional argument"),
    (CartPole, {"max_steps": 10}, None),
    (CartPole, {"max_step": 10}, r"unknown keyword arguments \['max_step'\]; it accepts \['max_steps'\]; "
                                 r"did you mean 'max_steps' for 'max_step'\?$"),
    (Checksum, {"anything": 1}, r"it accepts none"),
    (Gym, {"id": "CartPole-v1", "max_episode_steps": 5}, None),  # **gym_kwargs
    (MLP, {"hidden": [8], "epsilon": 0.1, "seed": 1}, None),
    (MLP, {"hiden": [8]}, r"unknown keyword arguments \['hiden'\]; .* did you mean 'hidden' for 'hiden'\?"),
    (MLP, {"zzz": [8]}, r"unknown keyword arguments \['zzz'\]; it accepts \[[^]]*\]$"),  # nothing close: no guess
    (MLP, {"hiden": [8], "epsilom": 0.1}, r"did you mean 'epsilon' for 'epsilom', 'hidden' for 'hiden'\?$"),
    (MLP, {"hidden": [8], "hiden": [8]}, r"unknown keyword arguments \['hiden'\]; it accepts \[[^]]*\]$"),  # given
    (MLP, {"spec": None}, "'spec' is supplied by ingestd"),
])
def test_validate_kwargs(factory, kwargs, message):
    if message is None:
        validate_kwargs(factory, kwargs)
    else:
        with pytest.raises(ValueError, match=message):
            validate_kwargs(factory, kwargs)


def test_make_env_and_policy_round_trip():
    env = make_env("Pixels", CTX, {"max_steps": 7})
    assert isinstance(env, Pixels) and env.max_steps == 7 and env.num_envs == 3
    policy = make_policy("MLP", env.spec, {"hidden": [8], "seed": 0})
    root = policy(env.reset())
    assert root["action"].shape == (3,) and root["action"].dtype == torch.int64
    env.close()


@pytest.mark.parametrize("path, kwargs, error, message", [
    ("CartPole", {"bogus": 1}, ValueError, "unknown keyword arguments"),
    ("test_registry:_factory", {"size": 1}, TypeError, "is not an Env"),
    ("test_registry:_wrong_size", {}, ValueError, "built 5 sub-envs; ctx asked for 3"),
])
def test_make_env_errors(path, kwargs, error, message):
    with pytest.raises(error, match=message):
        make_env(path, CTX, kwargs)


def _wrong_size(ctx):
    return Checksum(EnvContext(num_envs=5, seed=0, worker=0, episode_base=0))


def _create_env_fn():  # a TorchRL create_env_fn: no EnvContext argument
    return None


def test_a_factory_that_takes_no_context_is_blamed_on_its_key_not_its_kwargs():
    """The message named workers.env_kwargs, which the user had not even set."""
    import dataclasses

    from ingestd.errors import ConfigError
    from ingestd.service.config import Config
    from ingestd.service.probe import check_factories

    workers = dataclasses.replace(Config().workers, env="test_registry:_create_env_fn")
    with pytest.raises(ConfigError, match="takes no positional argument.*create_env_fn") as err:
        check_factories(workers)
    assert err.value.key == "workers.env"
    workers = dataclasses.replace(Config().workers, policy="test_registry:_create_env_fn")
    with pytest.raises(ConfigError) as err:
        check_factories(workers)
    assert err.value.key == "workers.policy"


def test_the_configs_built_in_names_are_the_registrys():
    """The config accepts a built-in name in any case (``policy = "mlp"`` was refused at startup
    as "bad import path", while ``env = "cartpole"`` worked): the names it knows are these."""
    from ingestd.collect import registry
    from ingestd.service import config_schema

    assert set(config_schema.ENV_ALIASES) == set(registry.ENV_ALIASES)
    assert set(config_schema.POLICY_ALIASES) == set(registry.POLICY_ALIASES)
