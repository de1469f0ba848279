"""The start-up probe: what ``ingestd run`` (and ``ingestd config check``) checks before it
creates anything. The env and policy factories import and take their kwargs, the device
exists, and the env and policy build and work together through one real transition, whose
rows give the storage its schema. A failure is a config error naming the key at fault (exit
78), not a worker crash-loop; the probe runs under a deadline (``workers.start_timeout_s``)
and gives way to a SIGTERM."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Callable

import torch

from ingestd.collect.checks import RowChecks, acting_policy, check_action
from ingestd.collect.features import check_device, ticking
from ingestd.collect.nstep import schema_rows
from ingestd.collect.rollout import Rollout, no_autograd
from ingestd.collect.worker import WorkerSpec, build_env, build_policy
from ingestd.errors import ConfigError, EnvFault, autograd_hint
from ingestd.service.signals import kept_signals

log = logging.getLogger("ingestd.daemon")


def check_buildable(config, paths, stopping: Callable[[], bool] = lambda: False):
    """What ``ingestd run`` checks before it creates anything, also run by ``ingestd config
    check``: the factories import and take their kwargs, the device exists, and the env and policy
    build and work together (one real transition). Returns ``(example rows, policy)``.
    ``stopping``: whether a SIGTERM asked the daemon to stop (the probe then gives way)."""
    if paths.curve_secret_key is not None and any(a.startswith("tcp://") for a in (paths.control, paths.events)):
        from ingestd.control.curve import check_files  # (the config's rules require both keys for tcp://)

        check_files(paths.curve_secret_key, paths.curve_authorized_keys)  # before the slow env build
    # the plug-ins' modules are imported here: one may set its own signal handlers as it loads
    with kept_signals("the env or policy (workers.env, workers.policy)"):
        check_factories(config.workers)
        check_device(config.workers.device)
        from ingestd.service.layout import Layout

        probe = Layout(config, paths, None, None, None, None, None).worker_spec(0)  # type: ignore[arg-type]
        # in the workers' autograd mode from the build on (workers.inference_mode), as they run
        with _deadline(config.workers.start_timeout_s, stopping), no_autograd(probe.inference_mode):
            rows, policy = _example_rows(probe, config.service.seed)
    _check_pushable(policy, config.control.max_message_bytes)
    return rows, policy


def replay_room(config, paths, rows) -> str:
    """One line on the replay the config makes: rows, bytes per row and in all, and the free
    space where it goes. A new replay that cannot fit on a memory file system (tmpfs) is a
    ``ConfigError`` naming ``replay.capacity`` (``ingestd config check`` said "ok" to a 56 GB
    pixel replay on a 24 GB tmpfs); elsewhere the line says what the file system reports, and the
    allocation at start decides."""
    from ingestd.replay import files
    from ingestd.replay.schema import schema_of
    from ingestd.replay.storage import storage_bytes

    replay, capacity = Path(paths.replay), config.replay.capacity
    try:
        if (replay / "meta.json").exists():
            from ingestd.service.layout import check_reopenable  # (layout imports this module)

            check_reopenable(replay, rows, capacity, config.workers)
            return f"replay {replay} exists: reopening it"
        if replay.exists() and not replay.is_dir():
            return f"replay {replay}: not a directory"  # refused next, naming replay.path
    except OSError as exc:  # a replay dir of the daemon's group, checked by someone outside it
        return f"replay {replay}: cannot look there ({exc.strerror})"
    need = storage_bytes(schema_of(rows), capacity)
    size = f"replay {replay}: {capacity} rows of {need // capacity} bytes, {files.human_bytes(need)}"
    room = files.free_space(replay)
    if room is None:
        return size
    free, memory = room
    if free >= need:
        return f"{size}; {files.human_bytes(free)} free there"
    if memory:
        raise ConfigError("replay.capacity", f"{size} does not fit: {files.human_bytes(free)} free on the memory "
                                             "file system there; lower replay.capacity or choose a replay.path "
                                             "with room")
    return (f"{size}; the file system reports only {files.human_bytes(free)} free there (the allocation at "
            "start decides)")


def _check_pushable(policy, max_message_bytes: int) -> None:
    """Warn if the policy's weights are too large for any push to reach it (a policy that is
    never pushed to may be that large: not an error)."""
    if not isinstance(policy, torch.nn.Module) or not policy.state_dict():
        return
    from ingestd.weights.wire import PUSH_OVERHEAD, encode

    size = sum(len(frame) for frame in encode(policy)) + PUSH_OVERHEAD  # what a push of them sends
    if size > max_message_bytes:
        log.warning("a push of the policy's weights is %d bytes (lz4), over control.max_message_bytes (%d): "
                    "push_weights of these weights would be refused; raise control.max_message_bytes above %d",
                    size, max_message_bytes, size)


def check_factories(workers) -> None:
    """The env and policy import paths resolve and their kwargs bind, else a config error naming
    the key: found before anything is created, instead of in every worker that starts."""
    from ingestd.collect.features import seeded_policy_kwargs
    from ingestd.collect.registry import NotAFactory, resolve_env, resolve_policy, validate_kwargs

    key = "workers.env"
    try:
        env = resolve_env(workers.env)
        key = "workers.env_kwargs"
        validate_kwargs(env, workers.env_kwargs)
        key = "workers.policy"
        policy = resolve_policy(workers.policy)
        key = "workers.policy_kwargs"
        validate_kwargs(policy, seeded_policy_kwargs(policy, workers.policy_kwargs, 0))  # + the worker's seed
    except NotAFactory as exc:  # the factory named, not its kwargs
        raise ConfigError(key.removesuffix("_kwargs"), str(exc)) from None
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _example_rows(spec: WorkerSpec, seed: int):
    """One real transition from the configured env and policy: the storage schema. An env or
    policy that cannot be built, that do not work together (an action with another number of
    elements than the env's spec, a float action for a discrete env or the reverse, spaces the
    adapter or the policy does not take), or a feature the env does not support, is a config
    error here (exit 78, before any worker crash-loops on it); an error raised by the env's or
    the policy's own code in the first reset, action or step too, with its traceback logged."""
    from ingestd.collect.features import StepLimit, random_policy

    log.info("start-up probe: env %s and policy %s, one transition (within workers.start_timeout_s)",
             spec.env, spec.policy)
    torch.manual_seed(seed)
    envs = min(spec.num_envs, PROBE_ENVS)
    env = _guarded("workers.env", f"env {spec.env} with env_kwargs {dict(spec.env_kwargs)} could not be built",
                   lambda: build_env(spec, seed, episode_base=0, num_envs=envs), quiet=_REFUSED_VALUE,
                   doing=f"building env {spec.env}")
    try:
        policy = _guarded("workers.policy", f"policy {spec.policy} with policy_kwargs "
                          f"{dict(spec.policy_kwargs)} could not be built", lambda: build_policy(spec, env, seed),
                          quiet=_REFUSED_VALUE, doing=f"building policy {spec.policy}")
        if spec.max_episode_steps > 0:
            StepLimit(env, spec.max_episode_steps)  # the env can reset single sub-envs
        if spec.init_random_frames > 0:
            random_policy(env.spec, seed)  # the warm-up's random policy fits the action space
        checks = RowChecks.of(env.spec, spec.action_bounds, spec.check_finite)
        acting = acting_policy(policy, env.spec, checks)
        rollout = _guarded("workers.env", f"env {spec.env} failed to reset",
                           lambda: Rollout(env, acting, worker=0, episode_base=0, chunk_steps=1, checks=checks,
                                           inference_mode=spec.inference_mode),
                           doing=f"env {spec.env}'s first reset")
        bent = _check_action(spec, env, acting, rollout)
        rows, _ = _guarded("workers.env", f"env {spec.env} failed stepping with policy {spec.policy}'s action"
                           + (f" ({bent}: make the policy's actions the spec's shape and dtype)" if bent else ""),
                           lambda: rollout.chunk(0), doing=f"env {spec.env}'s first step")
        _check_layout(spec, env, rows)
        _check_next(spec, rows, rollout)
    finally:
        env.close()
    if spec.n_step > 1:  # n-step rows carry steps_to_next_obs (ingestd.collect.nstep)
        rows = schema_rows(rows, spec.n_step, spec.gamma)
    return rows, policy


# sub-envs of the probe's env (workers.num_envs if fewer): with one, a [B] action for a [B, 1]
# spec held as many elements and passed, and every worker crash-looped on the broadcast to [B, B]
# of an env's ``x += action`` (walkthrough review); two show that, and cost a heavy env little
PROBE_ENVS = 2
_REFUSED_VALUE = (ValueError, TypeError)  # what a factory raises for a kwargs value it refuses
# not the config's fault: a restart may fix them (a simulator server not up yet, a GPU another
# process fills), so they keep exit status 1 and systemd's retries
_TRANSIENT = (OSError, MemoryError, TimeoutError, torch.cuda.OutOfMemoryError)


def _guarded(key: str, what: str, call, quiet: tuple = (), doing: str = ""):
    """``call()``; what it raises (but transient errors) is a config error naming ``key``. A
    factory refusing a value (``quiet``) needs no traceback (logged at debug); an error in the
    env's or policy's own code keeps it, in the log before the one-line reason. A constructor
    that fails for good (any other error) was exit 1 with a bare traceback: systemd retried it."""
    _PHASE[:] = [key, doing or what]  # what the deadline names if it hangs
    try:
        return call()
    except ConfigError:
        raise
    except _TRANSIENT:
        raise
    except EnvFault as exc:  # data a check refused (ingestd.collect.checks): it names the part at fault
        raise ConfigError(exc.key, f"{what}: {exc}") from None
    except Exception as exc:
        refused = isinstance(exc, quiet)
        log.log(logging.DEBUG if refused else logging.ERROR, "%s:", what, exc_info=True)
        where = 'logged with service.log_level = "debug"' if refused else "in the log above"
        detail = str(exc) if refused else f"{type(exc).__name__}: {exc}"
        detail += autograd_hint(exc, torch.is_inference_mode_enabled())  # (check_buildable: as the workers)
        raise ConfigError(key, f"{what}: {detail} (the traceback is {where})") from None


_PHASE = ["workers.env", "the start-up probe"]  # [key, what]: the step under way, for the deadline's message
EX_CONFIG = 78


def _deadline(seconds: float, stopping: Callable[[], bool]):
    """Run the block under a watchdog thread: past ``seconds`` (0: never) the process exits 78
    naming the step still running (a hung env or policy hung ``ingestd run`` and ``config
    check`` for ever, with nothing in the log); on ``stopping()`` it exits 0 (a SIGTERM during
    the probe was logged and ignored until systemd's SIGKILL). Nothing exists yet to clean up:
    the probe runs before the daemon creates anything."""
    def tick(elapsed: float) -> bool:
        if stopping():
            log.info("stopping during start-up (%s was still running)", _PHASE[1])
            os._exit(0)
        if seconds and elapsed > seconds:
            key, what = _PHASE
            log.error("cannot start: config key %r: %s did not finish within workers.start_timeout_s "
                      "(%g s): a hang in the %s's code? (raise workers.start_timeout_s if it is only slow; "
                      "0 waits for ever)", key, what, seconds, key.split(".")[1])
            os._exit(EX_CONFIG)
        return True

    return ticking(tick, 0.1, "ingestd-probe-deadline")


def _check_action(spec: WorkerSpec, env, policy, rollout) -> str:
    """The policy's action for the env's first observation fits the env's spec: as many
    elements per sub-env, and a float action for a float spec (an integer one for a discrete
    spec). A 2-vector for Pendulum's 1 was stored as it came. Another shape of as many elements
    (``[B]`` for ``[B, 1]``) or another dtype of the same kind (int32 for int64, float64 for
    float32) is stored as the policy makes it, with a warning: envs take those, and a replay
    made that way before must keep opening. Returns what differs from the spec, or ``""``."""
    note = observation_note(spec.env, env.spec, rollout.root)  # a policy sized from the spec fails on it
    out = _guarded("workers.policy", f"policy {spec.policy} failed on the env's first observation"
                   + (f" ({note}: make EnvSpec.observation_shape/dtype what the env returns)" if note else ""),
                   lambda: policy(rollout.root.clone()), doing=f"policy {spec.policy}'s first action")
    action = out.get("action", None) if hasattr(out, "get") else None
    if not isinstance(action, torch.Tensor):
        raise ConfigError("workers.policy", f"policy {spec.policy} returned no 'action' tensor (got "
                                            f"{type(out).__name__}); a policy returns its input TensorDict with "
                                            "'action' set")
    want_shape, want_dtype = (env.num_envs, *env.spec.action_shape), env.spec.action_dtype
    # the probe's batch is not the configured one: [B, ...] (it said float32[1, 2] with num_envs = 8)
    got, want = (_described(action.shape, action.dtype, env.num_envs), _described(want_shape, want_dtype, env.num_envs))
    per_env = math.prod(action.shape[1:]) if action.dim() else 0
    if (action.dim() == 0 or action.shape[0] != env.num_envs or per_env != math.prod(env.spec.action_shape)
            or action.dtype.is_floating_point != want_dtype.is_floating_point):
        raise ConfigError("workers.policy", f"policy {spec.policy} acts with {got} actions, but env {spec.env} "
                                            f"takes {want} (B: the sub-envs, workers.num_envs); make the policy fit "
                                            "the env's spec (EnvSpec.action_shape and action_dtype)")
    _guarded("workers.policy", f"policy {spec.policy}'s first action", lambda: check_action(out, rollout.checks))
    if tuple(action.shape) == want_shape and action.dtype == want_dtype:
        return ""
    log.warning("policy %s acts with %s actions, env %s's spec says %s; they are stored as the policy makes "
                "them", spec.policy, got, spec.env, want)
    return f"policy {spec.policy} acts with {got} actions, the env's spec says {want}"


def _check_layout(spec: WorkerSpec, env, rows) -> None:
    """Warn of rows that bend the env's own spec or TorchRL's layout, which were stored without a
    word (custom-env review): observation tensors of another shape or dtype than the spec says (a
    trainer sizing its networks from the spec goes wrong), and ``[B]`` rewards and flags (a loss
    broadcasts them against ``[B, 1]`` values into ``[B, B]``). Warnings, not errors: a policy
    may not use the spec at all, and a replay made so must keep opening. Envs without an
    ``observation`` tensor (``pixels``, a nested TensorDict) are not asked for one."""
    note = observation_note(spec.env, env.spec, rows)
    if note:
        log.warning("%s; stored as the env returns them", note)
    flat = [k for k in (("next", "reward"), ("next", "done"), ("next", "terminated"), ("next", "truncated"))
            if isinstance(rows.get(k, None), torch.Tensor) and tuple(rows.get(k).shape[1:]) != (1,)]
    if flat:
        log.warning("env %s returns %s with the per-row shapes %s, not [1] (TorchRL's [num_envs, 1] layout); "
                    "stored as they come, but a loss computing reward + gamma * (1 - done) * value with [B, 1] "
                    "values broadcasts them to [B, B]", spec.env, [".".join(k) for k in flat],
                    [list(rows.get(k).shape[1:]) for k in flat])


def _check_next(spec: WorkerSpec, rows, rollout) -> None:
    """What the rows must hold and what the policy must take after a step (custom-env review):
    a transition without ``("next", "observation")`` (of an env with an ``observation``), or
    without ``("next", "terminated")`` / ``("next", "truncated")``, was stored without them;
    and the policy acting on the first step's root (an env whose step returns observations of
    another shape or dtype than its reset) crash-looped every worker to failed, the config
    accepted. Both are errors naming workers.env here."""
    missing = [key for key in (("next", "terminated"), ("next", "truncated")) if key not in rows.keys(True)]
    if "observation" in rows.keys() and ("next", "observation") not in rows.keys(True):
        missing.insert(0, ("next", "observation"))
    if missing:
        raise ConfigError("workers.env", f"env {spec.env}'s transitions have no {', '.join(map(str, missing))}: "
                                         "TorchRL's layout stores the next observation and gymnasium's terminated "
                                         "and truncated flags of every step; set them in the step's 'next' "
                                         "TensorDict (ingestd.collect.envs.base.TorchEnv does)")
    _guarded("workers.env", f"policy {spec.policy} failed on the observation env {spec.env}'s step returned "
             "(its reset's worked: does the step return another shape or dtype?)",
             lambda: rollout.policy(rollout.root.clone()), doing=f"policy {spec.policy} after env {spec.env}'s step")


def observation_note(name: str, env_spec, td) -> str:
    """What the observation tensors of ``td`` (``[B, ...]``: a root, or rows) do not share with
    ``env_spec``, or ""."""
    want = _described(env_spec.observation_shape, env_spec.observation_dtype)
    notes = []
    for key in ("observation", ("next", "observation")):
        leaf = td.get(key, None)
        if isinstance(leaf, torch.Tensor) and _described(leaf.shape[1:], leaf.dtype) != want:
            notes.append(f"{_described(leaf.shape[1:], leaf.dtype)} in {key!r}")
    return f"env {name} returns {' and '.join(notes)}, its spec says {want}" if notes else ""


def _described(shape, dtype, batch: int | None = None) -> str:
    """``float32[4]``; with ``batch``, a first dimension of that size is ``B`` (``float32[B, 1]``)."""
    dims = [str(d) for d in shape]
    if batch is not None and dims and shape[0] == batch:
        dims[0] = "B"
    return f"{str(dtype).replace('torch.', '')}[{', '.join(dims)}]"
