"""The process layout, declared in one place: which shared objects exist,
where they live, and what each worker process is handed."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ingestd.collect.checks import ClippedActions, RowChecks, check_action
from ingestd.collect.features import check_device
from ingestd.collect.nstep import schema_rows
from ingestd.collect.rollout import Rollout
from ingestd.collect.stats import StatsBlock
from ingestd.collect.worker import WorkerSpec, build_env, build_policy
from ingestd.errors import ConfigError, CorruptStorage, EnvFault, IngestdError
from ingestd.replay.layout import POLICY_VERSION
from ingestd.replay.storage import ReplayStorage
from ingestd.service.instance import check_owned, make_dir, raise_unusable_path

log = logging.getLogger("ingestd.daemon")
WEIGHTS_MODE = 0o640  # trainers in the daemon's group may follow the version (``weights_path=``)


@dataclass
class Layout:
    """The daemon's handles on the shared objects its workers use."""

    config: object  # ingestd.service.config.Config
    paths: object  # ingestd.service.config.ResolvedPaths
    storage: ReplayStorage
    stats: StatsBlock
    weights: object | None  # ingestd.weights.store.WeightStore
    manifest: object | None  # ingestd.weights.wire.Manifest
    policy: torch.nn.Module | None  # the daemon's copy, for validating pushes
    limiter: object | None = None  # ingestd.replay.limiter.Limiter, set from [limiter]

    def worker_spec(self, index: int) -> WorkerSpec:
        w = self.config.workers
        return WorkerSpec(
            index=index, replay_path=str(self.paths.replay), stats_path=str(self.paths.stats),
            weights_path=str(self.paths.weights), env=w.env, policy=w.policy, num_envs=w.num_envs,
            chunk_steps=w.chunk_steps, seed=self.config.service.seed, threads=worker_threads(w.threads, w.count),
            device=w.device, env_kwargs=dict(w.env_kwargs), policy_kwargs=dict(w.policy_kwargs),
            init_random_frames=w.init_random_frames, max_episode_steps=w.max_episode_steps,
            total_frames=w.total_frames, n_step=w.n_step, gamma=w.gamma, compile_policy=w.compile_policy,
            enable_profile=w.enable_profile, action_bounds=w.action_bounds, check_finite=w.check_finite)

    def close(self) -> None:
        if self.limiter is not None:
            self.limiter.close()
        self.storage.close()
        self.stats.close()
        if self.weights is not None:
            self.weights.close()


def worker_threads(configured: int, workers: int, cores: int | None = None) -> int:
    """Intra-op threads per worker: as configured, else the cores shared out (at least 1)."""
    if configured > 0:
        return configured
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // max(1, workers))


def check_buildable(config, paths):
    """What ``ingestd run`` checks before it creates anything, also run by ``ingestd config
    check``: the factories import and take their kwargs, the device exists, and the env and policy
    build and work together (one real transition). Returns ``(example rows, policy)``."""
    if paths.curve_secret_key is not None and any(a.startswith("tcp://") for a in (paths.control, paths.events)):
        from ingestd.control.curve import check_files  # (the config's rules require both keys for tcp://)

        check_files(paths.curve_secret_key, paths.curve_authorized_keys)  # before the slow env build
    check_factories(config.workers)
    check_device(config.workers.device)
    probe = Layout(config, paths, None, None, None, None, None).worker_spec(0)  # type: ignore[arg-type]
    rows, policy = _example_rows(probe, config.service.seed)
    _check_pushable(policy, config.control.max_message_bytes)
    return rows, policy


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


def build_layout(config, paths) -> Layout:
    """Create (or reopen) every shared object before any worker exists."""
    example, policy = check_buildable(config, paths)
    for key, directory in (("service.data_dir", paths.data_dir), ("service.runtime_dir", paths.runtime_dir),
                           ("replay.path", Path(paths.replay).parent)):
        make_dir(directory, key)
    # the data and runtime dirs were checked by Daemon.run and lock_runtime_dir, before the locks
    if Path(paths.replay).exists():
        check_owned(paths.replay, "replay.path")
    storage = _open_replay(paths.replay, example, config.replay.capacity)
    stats = StatsBlock(paths.stats, create=True)
    weights = manifest = None
    if isinstance(policy, torch.nn.Module) and policy.state_dict():
        from ingestd.weights.store import WeightStore
        from ingestd.weights.wire import manifest_of

        state = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        manifest = manifest_of(state)
        weights = _weight_store(paths.weights, manifest, state, _newest_stored_version(storage),
                                resume=config.service.start_weights == "resume")
    else:
        policy = None
    log.info("replay %s: %d rows of %d, write_count %d", paths.replay, len(storage), storage.capacity,
             storage.write_count)
    from ingestd.replay.limiter import Limiter, params_of

    limiter = Limiter.attach(paths.replay, inserts=lambda: storage.write_count)
    limiter.configure(params_of(config.limiter))
    return Layout(config, paths, storage, stats, weights, manifest, policy, limiter)


def _open_replay(path, example, capacity: int) -> ReplayStorage:
    """Reopen (recovering) or create the replay. A path that cannot hold it (a file, a directory
    with other files, a damaged storage, no write access) is a config error naming replay.path:
    no restart fixes it. Nothing there is changed. (SchemaMismatch and StorageFull keep their
    own types; ``ingestd run`` exits 78 for them too.)"""
    try:
        return ReplayStorage.open_or_create(path, example, capacity, recover=True)
    except CorruptStorage as exc:
        raise ConfigError("replay.path", f"{exc} (nothing there was changed; restore the storage, move it "
                                         "away, or point replay.path at a new directory)") from None
    except FileExistsError as exc:  # a file, or a directory holding other files
        raise ConfigError("replay.path", f"{exc} (nothing there was changed)") from None
    except OSError as exc:
        if isinstance(exc, IngestdError):
            raise
        raise_unusable_path("replay.path", exc, f"cannot use {path} as the replay storage ({exc.filename})")


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


def _weight_store(path, manifest, initial: dict, stored: int, resume: bool = True):
    """The daemon's weight store, versions kept monotonic across daemon restarts.

    The previous daemon's store, if it holds the same policy shape, is reopened in place, so
    readers that mapped the file keep following it: with ``resume`` (``service.start_weights``)
    its last weights stay current, else ``initial`` is published into it. Otherwise a new store
    starts from ``initial``. New weights are numbered past the old store's version and past
    ``stored`` (the newest version in the replay), so a version never names two different sets
    of weights."""
    from ingestd.weights.store import WeightStore

    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a previous daemon killed while creating one
        stale.unlink(missing_ok=True)
    weights = None
    try:
        weights = WeightStore.reopen(path, manifest)
        if weights is None and path.exists():
            log.warning("the weight store at %s holds another policy shape: starting a new one", path)
    except (CorruptStorage, OSError) as exc:  # damaged, or not ours to open: start over, but say so
        log.warning("replacing the weight store at %s: %s", path, exc)
    if weights is not None and weights.version > 0:
        os.chmod(path, WEIGHTS_MODE)  # a store made by an older daemon was 0600
        previous = weights.version
        if not resume:
            version = weights.publish(initial, version=max(previous, stored) + 1)
            log.info("starting from the policy's initial weights as version %d (service.start_weights = "
                     "\"initial\"; the previous daemon left version %d in %s)", version, previous, path)
            return weights
        log.info("resuming from weights version %d left by the previous daemon in %s; to start from the "
                 "policy's initial weights instead, set service.start_weights = \"initial\" (ingestd run "
                 "--set service.start_weights=initial) or use a new service.runtime_dir", previous, path)
        if previous < stored:  # this replay holds rows of later versions (another store's)
            weights.publish(weights.read()[1], version=stored + 1)
        return weights
    if weights is not None:  # made, but its creator died before publishing
        weights.close()
    left = _version_in(path)  # an old store of another shape (or damaged): numbered past it too
    weights = WeightStore.create(path, manifest, mode=WEIGHTS_MODE)
    weights.publish(initial, version=max(left, stored) + 1)
    return weights


def _version_in(path) -> int:
    """The version a weight store at ``path`` had reached, whatever its policy shape (0 if it
    cannot be read)."""
    from ingestd.weights.store import WeightStore

    try:
        with WeightStore.attach(path) as old:
            return old.version
    except (IngestdError, OSError):
        return 0


def _newest_stored_version(storage: ReplayStorage) -> int:
    """The largest ``policy_version`` among the replay's rows (0 if none)."""
    written = min(storage.write_count, storage.capacity)
    return max(0, int(storage.leaves[POLICY_VERSION][:written].max())) if written else 0


def _example_rows(spec: WorkerSpec, seed: int):
    """One real transition from the configured env and policy: the storage schema. An env or
    policy that cannot be built, that do not work together (an action with another number of
    elements than the env's spec, a float action for a discrete env or the reverse, spaces the
    adapter or the policy does not take), or a feature the env does not support, is a config
    error here (exit 78, before any worker crash-loops on it); an error raised by the env's or
    the policy's own code in the first reset, action or step too, with its traceback logged."""
    from ingestd.collect.features import StepLimit, random_policy

    torch.manual_seed(seed)
    env = _guarded("workers.env", f"env {spec.env} with env_kwargs {dict(spec.env_kwargs)} could not be built",
                   lambda: build_env(spec, seed, episode_base=0, num_envs=1), _REFUSED_VALUE)
    try:
        policy = _guarded("workers.policy", f"policy {spec.policy} with policy_kwargs "
                          f"{dict(spec.policy_kwargs)} could not be built", lambda: build_policy(spec, env, seed),
                          _REFUSED_VALUE)
        if spec.max_episode_steps > 0:
            StepLimit(env, spec.max_episode_steps)  # the env can reset single sub-envs
        if spec.init_random_frames > 0:
            random_policy(env.spec, seed)  # the warm-up's random policy fits the action space
        checks = RowChecks.of(env.spec, spec.action_bounds, spec.check_finite)
        acting = ClippedActions(policy, env.spec) if spec.action_bounds == "clip" and checks.low is not None else policy
        rollout = _guarded("workers.env", f"env {spec.env} failed to reset",
                           lambda: Rollout(env, acting, worker=0, episode_base=0, chunk_steps=1, checks=checks),
                           Exception)
        _check_action(spec, env, acting, rollout)
        rows, _ = _guarded("workers.env", f"env {spec.env} failed stepping with policy {spec.policy}'s action",
                           lambda: rollout.chunk(0), Exception)
    finally:
        env.close()
    if spec.n_step > 1:  # n-step rows carry steps_to_next_obs (ingestd.collect.nstep)
        rows = schema_rows(rows, spec.n_step, spec.gamma)
    return rows, policy


_REFUSED_VALUE = (ValueError, TypeError)  # what a factory raises for a kwargs value it refuses
# not the config's fault: a restart may fix them (a simulator server not up yet, a GPU another
# process fills), so they keep exit status 1 and systemd's retries
_TRANSIENT = (OSError, MemoryError, TimeoutError, torch.cuda.OutOfMemoryError)


def _guarded(key: str, what: str, call, errors):
    """``call()``; ``errors`` it raises (but transient ones) are a config error naming ``key``.
    A factory refusing a value needs no traceback (logged at debug); an error in the env's or
    policy's own code keeps it, in the log before the one-line reason."""
    try:
        return call()
    except ConfigError:
        raise
    except _TRANSIENT:
        raise
    except EnvFault as exc:  # data a check refused (ingestd.collect.checks): it names the part at fault
        raise ConfigError(exc.key, f"{what}: {exc}") from None
    except errors as exc:
        refused = errors is _REFUSED_VALUE
        log.log(logging.DEBUG if refused else logging.ERROR, "%s:", what, exc_info=True)
        where = 'logged with service.log_level = "debug"' if refused else "in the log above"
        detail = str(exc) if refused else f"{type(exc).__name__}: {exc}"
        raise ConfigError(key, f"{what}: {detail} (the traceback is {where})") from None


def _check_action(spec: WorkerSpec, env, policy, rollout) -> None:
    """The policy's action for the env's first observation fits the env's spec: as many
    elements per sub-env, and a float action for a float spec (an integer one for a discrete
    spec). A 2-vector for Pendulum's 1 was stored as it came. Another shape of as many elements
    (``[B]`` for ``[B, 1]``) or another dtype of the same kind (int32 for int64, float64 for
    float32) is stored as the policy makes it, with a warning: envs take those, and a replay
    made that way before must keep opening."""
    with torch.no_grad():
        out = _guarded("workers.policy", f"policy {spec.policy} failed on the env's first observation",
                       lambda: policy(rollout.root.clone()), Exception)
    action = out.get("action", None) if hasattr(out, "get") else None
    if not isinstance(action, torch.Tensor):
        raise ConfigError("workers.policy", f"policy {spec.policy} returned no 'action' tensor (got "
                                            f"{type(out).__name__}); a policy returns its input TensorDict with "
                                            "'action' set")
    want_shape, want_dtype = (env.num_envs, *env.spec.action_shape), env.spec.action_dtype
    got, want = _described(action.shape, action.dtype), _described(want_shape, want_dtype)
    per_env = math.prod(action.shape[1:]) if action.dim() else 0
    if (action.dim() == 0 or action.shape[0] != env.num_envs or per_env != math.prod(env.spec.action_shape)
            or action.dtype.is_floating_point != want_dtype.is_floating_point):
        raise ConfigError("workers.policy", f"policy {spec.policy} acts with {got} actions, but env {spec.env} "
                                            f"takes {want} (the first dimension is num_envs); make the policy fit "
                                            "the env's spec (EnvSpec.action_shape and action_dtype)")
    _guarded("workers.policy", f"policy {spec.policy}'s first action", lambda: check_action(out, rollout.checks),
             ())
    if tuple(action.shape) != want_shape or action.dtype != want_dtype:
        log.warning("policy %s acts with %s actions, env %s's spec says %s; they are stored as the policy makes "
                    "them", spec.policy, got, spec.env, want)


def _described(shape, dtype) -> str:
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"
