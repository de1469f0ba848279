"""Envs that misbehave on purpose, loaded by the daemon by import path
(``faulty_envs:Raising`` with ``tests/`` on PYTHONPATH)."""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from ingestd.collect.envs.base import TorchEnv
from ingestd.collect.interfaces import EnvSpec
from ingestd.collect.registry import make_env
from ingestd.service.probe import PROBE_ENVS


class _Wrapped:
    def __init__(self, ctx, after_steps: int = 0, inner: str = "Checksum", only_worker: int = -1,
                 delay_s: float = 0.0):
        """``delay_s``: sleep that long before the first fault (a worker that raises on its first
        step stays visibly running for a moment, instead of a window a poll may miss)."""
        self.inner = make_env(inner, ctx, {})
        self.active = only_worker < 0 or ctx.worker == only_worker
        self.num_envs, self.spec = self.inner.num_envs, self.inner.spec
        self.after_steps, self.steps, self.delay_s = after_steps, 0, delay_s

    def reset(self):
        return self.inner.reset()

    def close(self):
        self.inner.close()

    def step_and_maybe_reset(self, td):
        self.steps += 1
        transition, root = self.inner.step_and_maybe_reset(td)
        if self.active and self.steps > self.after_steps:
            if self.delay_s:
                time.sleep(self.delay_s)
                self.delay_s = 0.0
            self.fault(transition)
        return transition, root


class Raising(_Wrapped):
    def __init__(self, ctx, connection: bool = False, **kw):
        """``connection``: raise ConnectionRefusedError (a simulator server not up yet)."""
        super().__init__(ctx, **kw)
        self.connection = connection

    def fault(self, transition):
        if self.connection:
            raise ConnectionRefusedError("simulated simulator server not up yet")
        raise RuntimeError("simulated env failure in step")


class WrongShape(_Wrapped):
    def fault(self, transition):
        obs = transition.get(("next", "observation"))
        transition.set(("next", "observation"), torch.cat([obs, obs], dim=-1))


class Dropping(_Wrapped):
    """Transitions without ``("next", key)``: stored without it until the probe refused it."""

    def __init__(self, ctx, key: str = "observation", **kw):
        super().__init__(ctx, **kw)
        self.key = key

    def fault(self, transition):
        transition.get("next").del_(self.key)


class WideRoot(_Wrapped):
    """A root after a step of another shape than the reset's: the policy fails on it in every
    worker (a crash loop to failed) until the probe refused it."""

    def step_and_maybe_reset(self, td):
        transition, root = super().step_and_maybe_reset(td)
        obs = root.get("observation")
        root.set("observation", torch.cat([obs, obs], dim=-1))
        return transition, root

    def fault(self, transition):
        pass


class NaNReward(_Wrapped):
    def fault(self, transition):
        reward = transition.get(("next", "reward"))
        transition.set(("next", "reward"), torch.full_like(reward, float("nan")))


class NaNObservation(_Wrapped):
    """Sub-env 1's next observation turns NaN (one element of it)."""

    def fault(self, transition):
        obs = transition.get(("next", "observation")).clone()
        obs[1, 0] = float("nan")
        transition.set(("next", "observation"), obs)


class DoneNotTerminated(_Wrapped):
    """Episodes that end as terminated (or truncated) with ``("next", "done")`` left False."""

    def fault(self, transition):
        transition.set(("next", "done"), torch.zeros_like(transition.get(("next", "done"))))


def done_not_terminated(ctx, **kw):
    return DoneNotTerminated(ctx, **{"inner": "CartPole", **kw})


def nan_observation(ctx, **kw):
    return NaNObservation(ctx, **{"inner": "CartPole", **kw})


def hanging_build(ctx, only_worker: int = -1, **kw):
    """An env whose constructor never returns (a simulator waiting on a server for ever); with
    ``only_worker``, only in that worker (the start-up probe builds as worker 0)."""
    while only_worker < 0 or ctx.worker == only_worker:
        time.sleep(1.0)
    return make_env("Checksum", ctx, {})


class LyingSpec(_Wrapped):
    """CartPole whose EnvSpec says ``observation`` (another shape or dtype than it returns), or
    whose rewards and flags are ``[B]`` instead of TorchRL's ``[B, 1]`` (``flat``), or whose
    observation is named ``observation_key`` (TorchRL pixel envs have ``pixels``)."""

    def __init__(self, ctx, shape=(4,), dtype: str = "float32", flat: bool = False, observation_key: str = "",
                 **kw):
        super().__init__(ctx, inner="CartPole", **kw)
        self.spec = dataclasses.replace(self.spec, observation_shape=tuple(shape),
                                        observation_dtype=getattr(torch, dtype))
        self.flat, self.key = flat, observation_key

    def _renamed(self, td):
        if self.key:
            td.rename_key_("observation", self.key)
            if "next" in td.keys():
                td["next"].rename_key_("observation", self.key)
        return td

    def reset(self):
        return self._renamed(super().reset())

    def step_and_maybe_reset(self, td):
        if self.key:
            td.rename_key_(self.key, "observation")
        transition, root = super().step_and_maybe_reset(td)
        return self._renamed(transition), self._renamed(root)

    def fault(self, transition):
        if self.flat:
            for key in ("reward", "done", "terminated", "truncated"):
                transition.set(("next", key), transition.get(("next", key)).view(-1))


def lying_spec(ctx, **kw):
    return LyingSpec(ctx, **kw)


def failing_constructor(ctx, **kw):
    raise RuntimeError("simulated scene file missing")


def raising(ctx, **kw):
    return Raising(ctx, **kw)


def wrong_shape(ctx, **kw):
    return WrongShape(ctx, **kw)


def dropping(ctx, **kw):
    return Dropping(ctx, **kw)


def wide_root(ctx, **kw):
    return WideRoot(ctx, **kw)


def nan_reward(ctx, **kw):
    return NaNReward(ctx, **kw)


def slow_start(ctx, seconds: float = 2.0):
    """A Checksum env whose workers take ``seconds`` to build it (a simulator loading its assets);
    the daemon's start-up probe (at most PROBE_ENVS sub-envs) builds it at once."""
    import time

    if ctx.num_envs > PROBE_ENVS:
        time.sleep(seconds)
    return make_env("Checksum", ctx, {})


class FailingReset(_Wrapped):
    def reset(self):
        raise RuntimeError("simulated scene that will not load")


def failing_reset(ctx, **kw):
    return FailingReset(ctx, **kw)


class SlowSteps(_Wrapped):
    """Every step takes ``step_s`` (a slow simulator); the daemon's start-up probe does not wait."""

    def __init__(self, ctx, step_s: float = 0.5):
        super().__init__(ctx)
        self.step_s = step_s if ctx.num_envs > PROBE_ENVS else 0.0

    def fault(self, transition):
        time.sleep(self.step_s)


def slow_steps(ctx, **kw):
    return SlowSteps(ctx, **kw)


def failing_build(ctx, only_worker: int = -1):
    """A Checksum env that worker ``only_worker`` (every worker: -1) cannot build: it fails
    before it ever runs (the daemon's start-up probe, of at most PROBE_ENVS sub-envs, builds it fine)."""
    if ctx.num_envs > PROBE_ENVS and only_worker in (-1, ctx.worker):
        raise RuntimeError("simulated env build failure")
    return make_env("Checksum", ctx, {})


def forking(ctx, pid_file: str = "", seconds: float = 120.0):
    """A Checksum env whose workers fork a helper that outlives them (as a multiprocessing pool
    or gymnasium's async vector env would), its pid appended to ``pid_file``. The helper only
    sleeps: a forked child must not run torch ops. Not in the daemon's start-up probe (whose env
    has at most ``PROBE_ENVS`` sub-envs): a helper of the daemon itself is another test."""
    import os

    if ctx.num_envs > PROBE_ENVS:
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(seconds)
            finally:
                os._exit(0)
        with open(pid_file, "a") as f:
            f.write(f"{pid}\n")
    return make_env("Checksum", ctx, {})


def odd_policy(spec, mode: str = "fits", value: float = 0.0, after: int = 0):
    """Actions of ``value`` (zero) for a continuous-action env: ``fits`` its spec; ``wide`` has
    twice the elements, ``int64`` the wrong kind, ``key`` none (another key), ``raise`` fails on
    the first observation (all refused); ``flat`` (``[B]`` for ``[B, 1]``) and ``float64`` are
    accepted. ``after``: the first ``after`` calls act with zeros (a policy that goes bad later)."""
    calls = [0]

    def act(td):
        n = td.batch_size[0]
        if mode == "raise":
            raise RuntimeError("simulated policy failure")
        while mode == "hang":
            time.sleep(1.0)
        shape = {"flat": (n,), "wide": (n, 2 * math.prod(spec.action_shape))}.get(mode, (n, *spec.action_shape))
        dtype = {"float64": torch.float64, "int64": torch.int64}.get(mode, spec.action_dtype)
        calls[0] += 1
        fill = value if calls[0] > after else 0.0
        td.set("act" if mode == "key" else "action", torch.full(shape, fill, dtype=dtype))
        return td
    return act


def gradient_planner(spec, steps: int = 2, calibrate: bool = False):
    """A discrete policy that plans with autograd inside its step (``torch.enable_grad``, one
    backward per step), as a gradient-based planner does: it runs under ``torch.no_grad``
    (``workers.inference_mode = false``), and fails under inference mode, where autograd
    cannot be turned back on. ``calibrate``: it plans once as it is built, too. Records the
    autograd mode of every call in ``modes``."""
    def plan(obs):
        with torch.enable_grad():
            plan = torch.zeros(obs.shape[0], spec.num_actions, requires_grad=True)
            for _ in range(steps):
                loss = ((plan - obs[:, :1]) ** 2).sum()
                (grad,) = torch.autograd.grad(loss, plan)
                plan = (plan - 0.1 * grad).detach().requires_grad_()
        return plan.argmax(-1).detach()

    def act(td):
        act.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        td.set("action", plan(td.get("observation")))
        return td
    act.modes = []
    if calibrate:
        plan(torch.zeros(1, *spec.observation_shape))
    return act


class Drift(TorchEnv):
    """docs/from-torchrl.md's plugin env: a point on a line pushed by a continuous action ``[B, 1]``
    (its state ``[B, 1]`` += the action: a ``[B]`` action broadcasts it to ``[B, B]``)."""

    def __init__(self, ctx):
        super().__init__(ctx, EnvSpec(observation_shape=(1,), observation_dtype=torch.float32, action_shape=(1,),
                                      action_dtype=torch.float32, action_low=(-1.0,), action_high=(1.0,)))
        self.x = torch.zeros(ctx.num_envs, 1)

    def _reset(self, mask):
        self.x.zero_()
        return self.x.clone()

    def _step(self, action):
        self.x += 0.1 * action.clamp(-1, 1)
        return self.x.clone(), -self.x.abs().squeeze(-1), self.x.abs().squeeze(-1) > 1, self.x[:, 0] != self.x[:, 0], {}


def grab_signals(native: bool = False) -> None:
    """What an env library may do as it loads: SIGTERM ignored, SIGINT and SIGHUP handled its way;
    ``native``: through libc's ``signal()``, which Python's ``signal.getsignal`` does not see."""
    import ctypes
    import signal

    if native:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        for signum, how in ((signal.SIGTERM, 1), (signal.SIGINT, 0), (signal.SIGHUP, 0)):  # SIG_IGN, SIG_DFL
            libc.signal(signum, how)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, lambda *a: None)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def grabbing_signals(ctx, in_reset: bool = False, native: bool = False, **kw):
    """Checksum, with an env library that sets its own signal handling (:func:`grab_signals`)
    when the env is made, or, with ``in_reset``, in its first reset."""
    env = make_env("Checksum", ctx, {})
    if not in_reset:
        grab_signals(native)
        return env
    reset = env.reset

    def grabbing_reset():
        grab_signals(native)
        return reset()

    env.reset = grabbing_reset
    return env
