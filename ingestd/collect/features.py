"""Collector features the worker loop applies around each chunk.

The worker owns the loop; this module owns the rules of the TorchRL-style
options (see docs/collector-features.md):

- seeding: :func:`component_seeds` splits a worker's seed into distinct,
  stable streams for torch, numpy, the env and the policy, and
  :func:`seeded_policy_kwargs` hands the policy factory its seed;
- episode limits: :class:`StepLimit` truncates episodes at
  ``max_episode_steps`` (``truncated``, never ``terminated``);
- warm-up and budget: :class:`Schedule` decides, from the replay's
  ``write_count``, whether the next chunk uses the uniform random policy
  (stamped ``policy_version = -1``) and whether the frame budget is spent;
- devices and compile: :func:`check_device`, :func:`compiled`.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
from tensordict import TensorDictBase

from ingestd.collect.interfaces import EnvSpec
from ingestd.collect.stats import PauseReason
from ingestd.errors import ConfigError

log = logging.getLogger("ingestd.worker")

WARMUP_VERSION = -1  # the policy_version stamped on rows collected by the warm-up random policy


# -- seeding ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seeds:
    """One worker incarnation's streams; no two are equal, none equal another worker's."""

    torch: int
    numpy: int  # < 2**32 (np.random.seed's range)
    env: int
    policy: int


def component_seeds(worker_seed: int) -> Seeds:
    """Distinct, stable seeds for each random stream of a worker, from its derived seed."""
    state = np.random.SeedSequence([worker_seed, 0x1D6E]).generate_state(4, dtype=np.uint64)
    torch_seed, numpy_seed, env_seed, policy_seed = (int(s >> np.uint64(1)) for s in state)
    return Seeds(torch_seed, numpy_seed % 2**32, env_seed, policy_seed)


def seeded_policy_kwargs(factory, kwargs: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """``kwargs`` plus ``seed=seed`` if the factory takes a ``seed`` keyword and the config did
    not set one, so that the built-in policies' exploration streams are reproducible."""
    out = dict(kwargs)
    if "seed" in out:
        return out
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return out
    if "seed" in params and params["seed"].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY):
        out["seed"] = seed
    return out


# -- episode limits --------------------------------------------------------------------------
class StepLimit:
    """Wraps a batched env so that no episode is longer than ``max_steps`` steps.

    The step that reaches the limit is marked ``truncated`` and ``done`` (an episode
    that terminates on that very step stays ``terminated``), and the sub-env is reset.
    Forcing a reset needs the env to be a :class:`~ingestd.collect.envs.base.TorchEnv`
    (every built-in env is one)."""

    def __init__(self, env, max_steps: int):
        if not (hasattr(env, "_reset") and hasattr(env, "_root")):
            raise ConfigError("workers.max_episode_steps",
                              f"needs an env derived from ingestd.collect.envs.base.TorchEnv, which can reset "
                              f"single sub-envs; {type(env).__name__} is not one (set a time limit in the env "
                              "itself, e.g. gymnasium's max_episode_steps)")
        self.env, self.max_steps = env, max_steps
        self.num_envs, self.spec = env.num_envs, env.spec
        self._steps = torch.zeros(env.num_envs, dtype=torch.int64)

    def reset(self) -> TensorDictBase:
        self._steps.zero_()
        return self.env.reset()

    def step_and_maybe_reset(self, td: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        transition, root = self.env.step_and_maybe_reset(td)
        nxt = transition.get("next")
        done = nxt.get("done")
        shape = done.shape
        ended = done.reshape(self.num_envs, -1).any(-1).cpu()
        self._steps += 1
        cut = (self._steps >= self.max_steps) & ~ended
        if bool(cut.any()):
            flag = cut.view(shape).to(done.device)
            nxt.set("truncated", nxt.get("truncated") | flag)
            nxt.set("done", done | flag)
            root = self.env._root(self.env._reset(cut.to(done.device)))
            ended = ended | cut
        self._steps.masked_fill_(ended, 0)
        return transition, root

    def close(self) -> None:
        self.env.close()

    def __getattr__(self, name: str):  # anything else (device, ctx, ...) is the env's
        return getattr(self.env, name)


# -- warm-up and budget --------------------------------------------------------------------------
def random_policy(spec: EnvSpec, seed: int):
    """The uniform random policy of the warm-up: discrete actions, or bounded continuous ones."""
    from ingestd.collect.policies import Random

    try:
        return Random(spec, seed=seed)
    except ConfigError as exc:
        raise ConfigError("workers.init_random_frames", f"the warm-up's random policy cannot act on this env: "
                                                        f"{exc.message}; set init_random_frames = 0") from None


@dataclass(frozen=True)
class Schedule:
    """What the next chunk does, from the frames the replay holds (``write_count``,
    counted over the whole daemon and across restarts of it)."""

    init_random_frames: int = 0
    total_frames: int = 0  # 0: no budget

    def warming_up(self, write_count: int) -> bool:
        return write_count < self.init_random_frames

    def spent(self, write_count: int) -> bool:
        return 0 < self.total_frames <= write_count


# -- devices and compile ---------------------------------------------------------------------
def check_device(device: str) -> torch.device:
    """The torch device, or a ``ConfigError`` naming ``workers.device`` if this host lacks it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError("workers.device", f"{device!r} is not a torch device: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("workers.device", f"{device!r} asked for CUDA, but this host has no usable CUDA "
                                                f"device (torch {torch.__version__}, "
                                                f"torch.cuda.is_available() is False); use \"cpu\"")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError("workers.device", f"{device!r}: this host has {torch.cuda.device_count()} CUDA "
                                                "device(s)")
    elif dev.type != "cpu":
        backend = getattr(torch.backends, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ConfigError("workers.device", f"{device!r} is not available on this host; use \"cpu\"")
    return dev


def compiled(policy, beat=None, *, compile_fn=None, every_s: float = 0.5, limit_s: float = 0.0):
    """``torch.compile`` of a module policy's forward (the module itself keeps receiving weights).

    Compiling happens in the first call and can take a minute on a small CPU; ``beat()`` (the
    worker's heartbeat) is called from a helper thread meanwhile so the supervisor does not
    take the worker for hung. ``torch.compile`` itself imports the inductor backend (5-10 s on
    a cold machine, past the heartbeat timeout): it runs under the same keepalive. Each of the
    two is kept alive for ``limit_s`` at most (``workers.start_timeout_s``; 0: no limit), so a
    compile that hangs is restarted as hung, not kept alive for ever."""
    if not isinstance(policy, torch.nn.Module):
        log.warning("workers.compile_policy: %s is not a torch.nn.Module; running it uncompiled",
                    type(policy).__name__)
        return policy
    compile_fn = compile_fn or torch.compile
    with (keepalive(beat, every_s, limit_s, "torch.compile of the policy") if beat is not None
          else contextlib.nullcontext()):
        return KeepaliveFirstCall(compile_fn(policy, dynamic=False), beat, every_s, limit_s)


class KeepaliveFirstCall:
    """Calls ``fn``; during the first call a thread calls ``beat()`` every ``every_s`` seconds
    (for ``limit_s`` at most: ``keepalive``)."""

    def __init__(self, fn, beat=None, every_s: float = 0.5, limit_s: float = 0.0):
        self.fn, self.beat, self.every_s, self.limit_s = fn, beat, every_s, limit_s
        self._first = True

    def __call__(self, td):
        if not self._first or self.beat is None:
            return self.fn(td)
        t0 = time.perf_counter()
        try:
            with keepalive(self.beat, self.every_s, self.limit_s, "the compiled policy's first call (compiling)"):
                return self.fn(td)
        finally:
            self._first = False
            log.info("compiled the policy in %.1f s", time.perf_counter() - t0)


@contextlib.contextmanager
def ticking(tick: Callable[[float], bool], every_s: float, name: str):
    """While the block runs, a thread calls ``tick(seconds since the block began)`` every
    ``every_s`` seconds, until the block ends or ``tick`` returns False."""
    done = threading.Event()
    start = time.monotonic()

    def run() -> None:
        while not done.wait(every_s) and tick(time.monotonic() - start):
            pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def keepalive(beat, every_s: float = 0.5, limit_s: float = 0.0, doing: str = ""):
    """A thread calls ``beat()`` every ``every_s`` seconds while the block runs: for the slow,
    one-off steps of a worker (building its env, compiling its policy) that must not be taken
    for a hang. After ``limit_s`` (0: never) it stops beating, saying so, and the supervisor's
    heartbeat check restarts the worker: a hung build is not kept alive for ever."""
    def tick(elapsed: float) -> bool:
        if limit_s and elapsed > limit_s:
            log.error("%s has taken longer than workers.start_timeout_s (%g s); no more heartbeats: "
                      "the supervisor will restart this worker as hung", doing or "a start-up step", limit_s)
            return False
        beat()
        return True

    return ticking(tick, every_s, "ingestd-keepalive")


# -- the worker's view -------------------------------------------------------------------------
class ChunkExtras:
    """Everything the features add around one worker's chunks; built once in ``Worker.run``."""

    def __init__(self, spec, env, policy, seeds: Seeds, rec, beat: Callable[[], None]):
        """``beat``: the worker's heartbeat (kept going while a compiled policy compiles)."""
        from ingestd.collect.checks import RowChecks, acting_policy
        from ingestd.collect.nstep import NStep
        from ingestd.collect.profiling import ProfileRequests

        self.env = StepLimit(env, spec.max_episode_steps) if spec.max_episode_steps > 0 else env
        self.checks = RowChecks.of(env.spec, spec.action_bounds, spec.check_finite)
        acting = compiled(policy, beat, limit_s=spec.start_timeout_s) if spec.compile_policy else policy
        self.acting = acting_policy(acting, env.spec, self.checks)
        self.schedule = Schedule(spec.init_random_frames, spec.total_frames)
        self.random = random_policy(env.spec, seeds.policy ^ 0x5EED) if spec.init_random_frames > 0 else None
        self.nstep = NStep(spec.n_step, spec.gamma, env.num_envs) if spec.n_step > 1 else None
        self.profile = ProfileRequests(rec, spec.index, beat) if spec.enable_profile else _NoProfile()

    def paused(self, storage):
        """``PauseReason.BUDGET`` once ``total_frames`` are stored, else ``PauseReason.NONE``."""
        return PauseReason.BUDGET if self.schedule.spent(storage.write_count) else PauseReason.NONE

    def before_chunk(self, rollout, storage, version: int) -> int:
        """Pick the chunk's policy (warm-up or configured); returns the version to stamp."""
        if self.random is not None and self.schedule.warming_up(storage.write_count):
            rollout.policy = self.random
            return WARMUP_VERSION
        rollout.policy = self.acting
        return version

    def stored(self, rows: TensorDictBase) -> TensorDictBase:
        """The rows as stored: n-step windows when ``n_step > 1``."""
        return rows if self.nstep is None else self.nstep(rows)

    def flush(self, storage) -> None:
        """On a requested stop: store the n-step rows still held (shorter windows)."""
        rows = self.nstep.flush() if self.nstep is not None else None
        if rows is not None:
            storage.write(rows)

    def close(self, storage) -> None:
        self.profile.finish()


class _NoProfile:
    """``workers.enable_profile = false``: requests are never picked up."""

    active = False

    def poll(self) -> None:
        pass

    def chunk(self):
        import contextlib

        return contextlib.nullcontext()

    def finish(self) -> None:
        pass
