"""The process layout, declared in one place: which shared objects exist,
where they live, and what each worker process is handed."""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ingestd.collect.stats import StatsBlock
from ingestd.collect.worker import WorkerSpec
from ingestd.errors import CapacityMismatch, ConfigError, CorruptStorage, IngestdError, SchemaMismatch
from ingestd.replay.layout import POLICY_VERSION
from ingestd.replay.snapshot import sweep
from ingestd.replay.storage import ReplayStorage
from ingestd.service.instance import check_owned, make_dir, raise_unusable_path
from ingestd.service.probe import check_buildable, replay_room
from ingestd.weights.mark import mark_of

log = logging.getLogger("ingestd.daemon")
START_LOCK_WAIT_S = 10.0  # the start waits this long for a lock file a trainer holds
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
            inference_mode=w.inference_mode, enable_profile=w.enable_profile, action_bounds=w.action_bounds,
            check_finite=w.check_finite, start_timeout_s=w.start_timeout_s)

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


def build_layout(config, paths, stopping=lambda: False) -> Layout:
    """Create (or reopen) every shared object before any worker exists."""
    example, policy = check_buildable(config, paths, stopping)
    log.info("%s", replay_room(config, paths, example))  # a new replay that cannot fit: exit 78 here
    for key, directory in (("service.data_dir", paths.data_dir), ("service.runtime_dir", paths.runtime_dir),
                           ("replay.path", Path(paths.replay).parent)):
        make_dir(directory, key)
    sweep(Path(paths.data_dir) / "snapshots")  # the partial of a daemon killed mid-snapshot (one replay's size)
    # the data and runtime dirs were checked by Daemon.run and lock_runtime_dir, before the locks
    if Path(paths.replay).exists():
        check_owned(paths.replay, "replay.path")
    storage = _open_replay(paths.replay, example, config.replay.capacity)
    try:
        _check_nstep(storage, config.workers)
    except BaseException:
        storage.close()
        raise
    stats = StatsBlock(paths.stats, create=True)
    weights = manifest = None
    if isinstance(policy, torch.nn.Module) and policy.state_dict():
        from ingestd.weights.store import WeightStore
        from ingestd.weights.wire import manifest_of

        state = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        manifest = manifest_of(state)
        weights = _weight_store(paths.weights, manifest, state, _newest_stored_version(storage),
                                resume=config.service.start_weights == "resume", fresh_replay=storage.write_count == 0,
                                mark=mark_of(paths.replay))
        _warn_overridden_kwargs(weights, state, config.workers.policy_kwargs)
    else:
        policy = None
    log.info("replay %s: %d rows of %d, write_count %d", paths.replay, len(storage), storage.capacity,
             storage.write_count)
    from ingestd.replay.limiter import Limiter, params_of

    limiter = Limiter.attach(paths.replay, inserts=lambda: storage.write_count)
    # limiter.bin is trainer-writable: one stopped inside a rate-limited sample holds its lock
    # (the start waited for it for ever, silently); LockBusy: ``ingestd run`` exits 75, retried
    limiter.configure(params_of(config.limiter), timeout=START_LOCK_WAIT_S)
    return Layout(config, paths, storage, stats, weights, manifest, policy, limiter)


def _open_replay(path, example, capacity: int) -> ReplayStorage:
    """Reopen (recovering) or create the replay. A path that cannot hold it (a file, a directory
    with other files, a damaged storage, another schema, no write access) is a config error
    naming replay.path, and another capacity one naming replay.capacity: no restart fixes
    them. Nothing there is changed. (StorageFull keeps its type; ``ingestd run`` exits 78 for
    it too.)"""
    with _replay_errors(path, example):
        return ReplayStorage.open_or_create(path, example, capacity, recover=True)


def check_reopenable(path, example, capacity: int, workers) -> None:
    """``ingestd config check`` on an existing replay: what ``_open_replay`` and ``_check_nstep``
    would refuse (another capacity, schema or n-step setting, a damaged meta.json), from its
    files alone, changing nothing (it said "ok; reopening it", then ``run`` exited 78 on the
    schema of the env the user had just changed: walkthrough review)."""
    from ingestd.replay.files import read_meta
    from ingestd.replay.storage import check_matches

    with _replay_errors(path, example, unusable=False):  # (an OSError: replay_room's "cannot look there")
        meta = read_meta(Path(path))
        check_matches(path, meta, example, capacity)
        _nstep_conflict(path, meta["schema"], workers)


@contextlib.contextmanager
def _replay_errors(path, example, unusable: bool = True):
    """The replay's refusals as config errors naming the key at fault (see ``_open_replay``);
    an ``OSError`` too with ``unusable``, else as it came."""
    try:
        yield
    except CapacityMismatch as exc:
        raise ConfigError("replay.capacity", f"{exc} (nothing there was changed)") from None
    except SchemaMismatch as exc:
        from ingestd.collect.nstep import STEPS_KEY
        from ingestd.replay.files import read_meta
        from ingestd.replay.schema import schema_of

        stored = (STEPS_KEY,) in read_meta(Path(path))["schema"]  # (read fine: the open got past it)
        if stored != ((STEPS_KEY,) in schema_of(example)):  # n-step rows carry it, 1-step rows do not
            raise ConfigError("workers.n_step", f"{exc}. The difference is workers.n_step: this replay holds "
                                                f"{'n-step' if stored else '1-step'} rows; set workers.n_step as "
                                                "it was written, or use a new replay.path") from None
        raise ConfigError("replay.path", str(exc)) from None
    except CorruptStorage as exc:
        raise ConfigError("replay.path", f"{exc} (nothing there was changed; restore the storage, move it "
                                         "away, or point replay.path at a new directory)") from None
    except FileExistsError as exc:  # a file, or a directory holding other files
        raise ConfigError("replay.path", f"{exc} (nothing there was changed)") from None
    except OSError as exc:
        if isinstance(exc, IngestdError) or not unusable:
            raise
        raise_unusable_path("replay.path", exc, f"cannot use {path} as the replay storage ({exc.filename})")


def _check_nstep(storage: ReplayStorage, workers) -> None:
    """A replay of n-step rows keeps the ``n_step`` and ``gamma`` its rows were made with
    (``nstep.json``): rows of another discount would be mixed in silently (the schema is the
    same), and a trainer could not tell them apart. Another setting is a config error naming the
    key; a replay of n-step rows that recorded none (made before ingestd recorded it) records
    the running ones."""
    from ingestd.replay import nstep_record

    if _nstep_conflict(storage.path, storage.schema, workers) == "unrecorded":
        want = {"n_step": workers.n_step, "gamma": float(workers.gamma)}
        if storage.write_count:
            log.warning("replay %s: its n-step rows recorded no settings; recording the running ones (n_step=%d, "
                        "gamma=%g)", storage.path, want["n_step"], want["gamma"])
        nstep_record.write(storage.path, **want)


def _nstep_conflict(path, schema, workers) -> str:
    """``_check_nstep``'s refusal, reading only: ``"unrecorded"`` for n-step rows that recorded no
    settings, else ``""``."""
    from ingestd.collect.nstep import STEPS_KEY
    from ingestd.replay import nstep_record

    if (STEPS_KEY,) not in schema:
        return ""  # 1-step rows: gamma is not in them (and n_step > 1 would be another schema)
    want = {"n_step": workers.n_step, "gamma": float(workers.gamma)}
    try:
        recorded = nstep_record.read(path)
    except CorruptStorage as exc:
        raise ConfigError("replay.path", f"{exc} (nothing there was changed)") from None
    if recorded is None:
        return "unrecorded"
    if recorded != want:
        key = "workers.n_step" if recorded["n_step"] != want["n_step"] else "workers.gamma"
        raise ConfigError(key, f"the replay at {path} holds n-step rows of n_step={recorded['n_step']}, "
                               f"gamma={recorded['gamma']:g}; rows of n_step={want['n_step']}, "
                               f"gamma={want['gamma']:g} would mix returns of another discount into it, and no "
                               "row says which it has. Set workers.n_step and workers.gamma back, or point "
                               "replay.path at a new replay (nothing there was changed)")
    return ""


def _weight_store(path, manifest, initial: dict, stored: int, resume: bool = True, fresh_replay: bool = False,
                  mark=None):
    """The daemon's weight store, versions kept monotonic across daemon restarts.

    The previous daemon's store, if it holds the same policy shape, is reopened in place, so
    readers that mapped the file keep following it: with ``resume`` (``service.start_weights``)
    its last weights stay current, else ``initial`` is published into it. Otherwise a new store
    starts from ``initial``. New weights are numbered past the old store's version, past
    ``stored`` (the newest version in the replay) and past ``mark`` (``ingestd.weights.mark``:
    every version published for this replay, rows or not), so a version never names two
    different sets of weights; every version published from here on is saved in ``mark``."""
    if mark is not None:
        stored = max(stored, mark.saved)
    weights = _weight_store_past(path, manifest, initial, stored, resume, fresh_replay)
    if mark is not None:
        mark.save(weights.version)
        weights.on_publish = mark.save
    return weights


def _weight_store_past(path, manifest, initial: dict, stored: int, resume: bool, fresh_replay: bool):
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
        # an empty replay with the last run's weights is most likely a new experiment (pixel-DQN review:
        # a new replay and policy_kwargs silently collected with a greedy policy an old trainer had pushed)
        log.log(logging.WARNING if fresh_replay else logging.INFO,
                "resuming from weights version %d left by the previous daemon in %s%s; to start from the "
                "policy's initial weights instead, set service.start_weights = \"initial\" (ingestd run "
                "--set service.start_weights=initial) or use a new service.runtime_dir", previous, path,
                " into an empty replay" if fresh_replay else "")
        if previous < stored:  # this replay holds rows of later versions (another store's)
            weights.publish(weights.read()[1], version=stored + 1)
        return weights
    if weights is not None:  # made, but its creator died before publishing
        weights.close()
    left = _version_in(path)  # an old store of another shape (or damaged): numbered past it too
    weights = WeightStore.create(path, manifest, mode=WEIGHTS_MODE)
    weights.publish(initial, version=max(left, stored) + 1)
    return weights


def _warn_overridden_kwargs(weights, initial: dict, kwargs: dict) -> None:
    """Warn when the weights in effect set a configured policy kwarg (a scalar of the state dict
    named like it: the MLP's ``epsilon``) to another value than the config: resumed weights carry
    the value of the push or config they came from, and a changed ``workers.policy_kwargs.epsilon``
    was silently ignored after a restart (weights review)."""
    import torch

    current = weights.read()[1]
    for key in sorted(kwargs):
        ours, theirs = initial.get(key), current.get(key)
        if not (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)
                and ours.numel() == theirs.numel() == 1):
            continue
        if float(ours) != float(theirs):
            log.warning("workers.policy_kwargs.%s = %g is not in effect: the weights resumed as version %d set "
                        "%s = %g (the previous run's push or config; a push sets it); to apply the config's, "
                        "set service.start_weights = \"initial\" or push weights with it", key, float(ours),
                        weights.version, key, float(theirs))


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
