"""workers.inference_mode: the workers' env and policy run under ``torch.inference_mode()``
(the default) or ``torch.no_grad()``; the rows are the same plain tensors either way, and a
policy that needs autograd inside a step is refused at start-up with the way out."""
from __future__ import annotations

import os

import pytest
import torch

from ingestd.collect.envs.cartpole import CartPole
from ingestd.collect.envs.pixels import Pixels
from ingestd.collect.interfaces import EnvContext
from ingestd.collect.policies import MLP, Random
from ingestd.collect.rollout import Rollout, no_autograd
from ingestd.errors import ConfigError, autograd_hint
from ingestd.service.config import load_config, resolve_paths
from ingestd.service.probe import PROBE_ENVS, check_buildable

import faulty_envs
from control_daemon import PLUGIN_ENV
from daemon_proc import DaemonProc
from test_collector_features import stored_rows

STEPS, ENVS = 4, 8
PLANNER = ['workers.env="CartPole"', 'workers.policy="faulty_envs:gradient_planner"']


def ctx(seed: int = 0) -> EnvContext:
    return EnvContext(num_envs=ENVS, seed=seed, worker=0, episode_base=0)


class Recording:
    """A policy that notes the autograd mode of each call: (inference mode, grad enabled)."""

    def __init__(self, policy):
        self.policy, self.modes = policy, []

    def __call__(self, td):
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return self.policy(td)


@pytest.mark.parametrize("inference,expected", [(True, (True, False)), (False, (False, False))])
def test_the_steps_run_in_the_mode_asked_for(inference, expected):
    env = CartPole(ctx())
    policy = Recording(MLP(env.spec, seed=0))
    Rollout(env, policy, 0, 0, STEPS, inference_mode=inference).chunk(0)
    assert policy.modes == [expected] * STEPS
    assert not torch.is_inference_mode_enabled()  # and it is left after the chunk


@pytest.mark.parametrize("make", [lambda c: CartPole(c), lambda c: Pixels(c, max_steps=3)], ids=["small", "images"])
def test_rows_are_the_same_plain_tensors_in_either_mode(make):
    chunks = {}
    for inference in (True, False):
        with no_autograd(inference):  # built in the mode too, as a worker builds it
            env = make(ctx(seed=3))
            rollout = Rollout(env, Random(env.spec, seed=3), 0, 0, STEPS, inference_mode=inference)
        chunks[inference] = [rollout.chunk(version)[0] for version in range(3)][-1]  # resets inside
    for key, leaf in chunks[True].items(include_nested=True, leaves_only=True):
        assert not leaf.is_inference(), key  # a caller may edit them outside inference mode
        assert torch.equal(leaf, chunks[False].get(key)), key
    chunks[True].get("observation").add_(1)  # an in-place edit outside the mode works


def probe_planner(tmp_path, *settings):
    """The start-up probe (``check_buildable``) of CartPole with the gradient planner."""
    config = load_config(None, [f'service.data_dir="{tmp_path}/data"', f'service.runtime_dir="{tmp_path}/run"',
                                *PLANNER, *settings])
    return check_buildable(config, resolve_paths(config, os.environ))


def test_a_policy_that_needs_autograd_is_refused_at_start_up_with_the_way_out(tmp_path):
    with pytest.raises(ConfigError) as err:
        probe_planner(tmp_path)
    assert err.value.key == "workers.policy", err.value
    assert "does not require grad" in str(err.value) and "workers.inference_mode = false" in str(err.value), err.value
    config = load_config(None, [f'service.data_dir="{tmp_path}/data"', *PLANNER])
    rows, _ = probe_planner(tmp_path, "workers.inference_mode=false")
    assert rows.batch_size[0] == min(PROBE_ENVS, config.workers.num_envs)  # one step of the probe's sub-envs


def test_a_policy_that_needs_autograd_to_be_built_is_refused_too(tmp_path):
    """The probe builds the env and policy in the workers' mode, as they do: a planner that
    calibrates itself with autograd as it is built would otherwise pass the probe and fail in
    every worker."""
    with pytest.raises(ConfigError) as err:
        probe_planner(tmp_path, "workers.policy_kwargs={calibrate=true}")
    assert "could not be built" in str(err.value) and "workers.inference_mode = false" in str(err.value), err.value


def test_the_hint_is_given_only_for_autograd_errors_under_inference_mode():
    grad = RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    saved = RuntimeError("Inference tensors cannot be saved for backward.")
    assert "workers.inference_mode = false" in autograd_hint(grad, True)
    assert "workers.inference_mode = false" in autograd_hint(saved, True)
    outside = RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed.")
    assert "workers.inference_mode = false" in autograd_hint(outside, True)
    assert autograd_hint(grad, False) == "" and autograd_hint(RuntimeError("scene file missing"), True) == ""
    for other in ("upgrade the sender or the daemon", "NaN gradient in the planner", "inference server down"):
        assert autograd_hint(RuntimeError(other), True) == "", other


def test_the_gradient_planner_plans_under_no_grad():
    env = CartPole(ctx())
    planner = faulty_envs.gradient_planner(env.spec)
    rows, _ = Rollout(env, planner, 0, 0, STEPS, inference_mode=False).chunk(0)
    assert planner.modes == [(False, False)] * STEPS and rows.batch_size[0] == STEPS * ENVS


def test_the_daemon_runs_its_workers_in_the_configured_mode():
    """workers.inference_mode = false reaches the workers: the planner collects (under inference
    mode every worker would fail its first step)."""
    overrides = {"workers.env": "CartPole", "workers.policy": "faulty_envs:gradient_planner",
                 "workers.inference_mode": False, "workers.count": 1}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready(timeout=60, rows=4 * 64)
        assert d.stop() == 0
        log, rows = d.log(), stored_rows(d.replay_path)
    assert rows.batch_size[0] >= 4 * 64 and ") failed:" not in log, log
