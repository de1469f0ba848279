"""What a chunk must satisfy to be stored (ingestd.collect.checks), in-process: actions finite
and within the env's bounds (workers.action_bounds), rewards and small float leaves finite
(workers.check_finite); and the start-up probe refusing the same, naming the part at fault.

SAC review: a policy acting 100x outside Pendulum's [-2, 2] had 19,997 of 20,000 rows stored
out of bounds with no word; a NaN action was blamed on the env (through the NaN reward it
caused), or stored when the env sanitised its input; NaN observations were stored."""
from __future__ import annotations

import math
import os

import pytest
import torch

import faulty_envs
from ingestd.collect.checks import ClippedActions, RowChecks
from ingestd.collect.interfaces import EnvContext
from ingestd.collect.registry import make_env
from ingestd.collect.rollout import Rollout
from ingestd.errors import ConfigError, EnvFault
from ingestd.service.config import load_config, resolve_paths
from ingestd.service.probe import check_buildable

ENVS, STEPS = 4, 8


def pendulum():
    return make_env("Gym", EnvContext(num_envs=ENVS, seed=0, worker=0, episode_base=0), {"id": "Pendulum-v1"})


def cartpole():
    return make_env("CartPole", EnvContext(num_envs=ENVS, seed=0, worker=0, episode_base=0), {})


def discrete_policy(action: int):
    def act(td):
        td.set("action", torch.full((td.batch_size[0],), action, dtype=torch.int64))
        return td
    return act


def rolled(env, policy, bounds: str = "refuse", finite: bool = True):
    checks = RowChecks.of(env.spec, bounds, finite)
    acting = ClippedActions(policy, env.spec) if bounds == "clip" else policy
    try:
        return Rollout(env, acting, 0, 0, STEPS, checks=checks).chunk(0)[0]
    finally:
        env.close()


@pytest.mark.parametrize("value", [5.0, -200.0])
def test_continuous_actions_outside_the_bounds_are_refused_naming_the_policy(value):
    env = pendulum()
    with pytest.raises(EnvFault) as err:
        rolled(env, faulty_envs.odd_policy(env.spec, value=value, after=3))
    message = str(err.value)
    assert err.value.key == "workers.policy"
    assert "outside the env's action bounds" in message and f"= {value:g}" in message, message
    assert "bounds [-2, 2]" in message and "sub-env 0, episode 0, step 3" in message, message
    assert 'workers.action_bounds = "clip"' in message, message


def test_actions_on_a_bound_or_past_it_by_rounding_are_stored():
    env = pendulum()
    rows = rolled(env, faulty_envs.odd_policy(env.spec, value=2.0 + 1e-6))
    assert rows.get("action").max().item() == pytest.approx(2.0, abs=1e-5)


def test_clip_clamps_before_the_env_steps_and_stores_the_clamped_action():
    env = pendulum()
    rows = rolled(env, faulty_envs.odd_policy(env.spec, value=7.0), bounds="clip")
    assert bool((rows.get("action") == 2.0).all())


def test_off_stores_actions_as_they_come():
    env = pendulum()
    rows = rolled(env, faulty_envs.odd_policy(env.spec, value=7.0), bounds="off")
    assert bool((rows.get("action") == 7.0).all())


@pytest.mark.parametrize("bounds", ["refuse", "clip", "off"])
def test_non_finite_actions_are_refused_naming_the_policy_whatever_the_bounds(bounds):
    """Before the reward check: Pendulum turns a NaN action into a NaN reward, which blamed the env."""
    env = pendulum()
    with pytest.raises(EnvFault) as err:
        rolled(env, faulty_envs.odd_policy(env.spec, value=math.nan, after=2), bounds=bounds)
    assert err.value.key == "workers.policy" and "non-finite action" in str(err.value), err.value


def test_discrete_actions_outside_the_action_count_are_refused_or_clipped():
    with pytest.raises(EnvFault) as err:
        rolled(cartpole(), discrete_policy(2))
    assert err.value.key == "workers.policy" and "bounds [0, 1]" in str(err.value), err.value
    assert bool((rolled(cartpole(), discrete_policy(2), bounds="clip").get("action") == 1).all())
    assert bool((rolled(cartpole(), discrete_policy(-1), bounds="clip").get("action") == 0).all())


def test_non_finite_observations_are_refused_naming_the_env_unless_check_finite_is_off():
    ctx = EnvContext(num_envs=ENVS, seed=0, worker=0, episode_base=0)
    with pytest.raises(EnvFault) as err:
        rolled(faulty_envs.nan_observation(ctx, after_steps=2), discrete_policy(0))
    message = str(err.value)
    assert err.value.key == "workers.env" and "non-finite ('next', 'observation')" in message, message
    assert "sub-env 1, episode 1, step 2" in message and "workers.check_finite = false" in message, message
    rows = rolled(faulty_envs.nan_observation(ctx, after_steps=2), discrete_policy(0), finite=False)
    assert bool(rows.get(("next", "observation")).isnan().any())


def test_a_done_flag_other_than_terminated_or_truncated_is_refused_naming_the_env():
    """Chaos review: an env whose done stayed False on terminated steps had its rows stored: the
    episode stamps (which follow done) ran on for ever while a loss read terminated."""
    ctx = EnvContext(num_envs=ENVS, seed=0, worker=0, episode_base=0)
    env = faulty_envs.done_not_terminated(ctx)
    rollout = Rollout(env, discrete_policy(0), 0, 0, STEPS, checks=RowChecks.of(env.spec))
    with pytest.raises(EnvFault) as err:
        for _ in range(5):  # a CartPole episode pushed one way ends within ~10 steps
            rollout.chunk(0)
    message = str(err.value)
    assert err.value.key == "workers.env" and "('next', 'done') is not terminated or truncated" in message, message
    assert "done False, terminated True" in message and "done = terminated | truncated" in message, message
    right = cartpole()  # the same episodes with the flags right: stored
    rollout = Rollout(right, discrete_policy(0), 0, 0, STEPS, checks=RowChecks.of(right.spec))
    assert any(bool(rollout.chunk(0)[0].get(("next", "done")).any()) for _ in range(5))


@pytest.mark.parametrize("settings,named,said", [
    (['workers.policy_kwargs={mode="fits", value=9.0}'], "workers.policy", "outside the env's action bounds"),
    (['workers.policy_kwargs={mode="fits", value=nan}'], "workers.policy", "non-finite action"),
])
def test_the_start_up_probe_refuses_the_first_bad_action_naming_the_policy(settings, named, said):
    config = load_config(None, ['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1"}',
                                'workers.policy="faulty_envs:odd_policy"', *settings])
    with pytest.raises(ConfigError) as err:
        check_buildable(config, resolve_paths(config, os.environ))
    assert err.value.key == named and said in str(err.value), err.value


def test_the_start_up_probe_finds_an_action_that_only_one_sub_env_hides():
    """A ``[B]`` action for a ``[B, 1]`` spec: with the probe's one sub-env it held as many elements
    and passed, then every worker crash-looped on the env's broadcast to ``[B, B]`` (walkthrough)."""
    config = load_config(None, ['workers.env="faulty_envs:Drift"', 'workers.policy="faulty_envs:odd_policy"',
                                'workers.policy_kwargs={mode="flat"}', "workers.num_envs=8"])
    with pytest.raises(ConfigError) as err:
        check_buildable(config, resolve_paths(config, os.environ))
    assert err.value.key == "workers.env" and "policy faulty_envs:odd_policy's action" in str(err.value), err.value
    assert "acts with float32[B] actions, the env's spec says float32[B, 1]" in str(err.value), err.value
    fits = load_config(None, ['workers.env="faulty_envs:Drift"', 'workers.policy="faulty_envs:odd_policy"',
                              "workers.num_envs=1"])  # one sub-env: the probe has no second to take
    rows, _ = check_buildable(fits, resolve_paths(fits, os.environ))
    assert rows.get("action").shape == (1, 1)


def test_the_start_up_probe_accepts_them_with_clip():
    config = load_config(None, ['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1"}',
                                'workers.policy="faulty_envs:odd_policy"', 'workers.action_bounds="clip"',
                                'workers.policy_kwargs={mode="fits", value=9.0}'])
    rows, _ = check_buildable(config, resolve_paths(config, os.environ))
    assert bool((rows.get("action") == 2.0).all())


def test_an_action_of_another_shape_at_run_time_is_blamed_on_the_policy():
    """The probe checks the first action; one that changes shape later failed deep in the env
    with a raw torch or numpy error."""
    env = pendulum()
    with pytest.raises(EnvFault) as err:
        rolled(env, faulty_envs.odd_policy(env.spec, mode="wide"))
    assert err.value.key == "workers.policy" and "2 action elements per sub-env" in str(err.value), err.value


def test_done_flags_on_different_devices_are_left_unchecked_not_a_crash():
    """Diff review: a done on the CPU beside a terminated elsewhere raised in numpy (the worker
    crashed) where flags it cannot compare are left alone."""
    from tensordict import TensorDict

    from ingestd.collect.checks import _check_done

    n = 4
    flags = {"done": torch.zeros(n, 1, dtype=torch.bool), "terminated": torch.ones(n, 1, dtype=torch.bool, device="meta"),
             "truncated": torch.zeros(n, 1, dtype=torch.bool)}
    _check_done(TensorDict({"next": TensorDict(flags, batch_size=[n])}, batch_size=[n]))
    flags["terminated"] = torch.ones(n, 1, dtype=torch.bool)  # the same flags, comparable: refused
    with pytest.raises(EnvFault, match="is not terminated or truncated in 4 rows"):
        _check_done(TensorDict({"next": TensorDict(flags, batch_size=[n])}, batch_size=[n]))
