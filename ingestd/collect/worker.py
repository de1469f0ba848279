"""The worker process: one loop of read desired state → apply weights → roll a
chunk → write it → update stats.

Weights are applied only between chunks, so every row's ``policy_version``
is exact. Pause and stop are acknowledged through the stats block after the
chunk in flight has been written: a pause never drops data.
"""
from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ingestd.collect.inherited import release_inherited
from ingestd.collect.stats import RING, Desired, PauseReason, State, StatsBlock
from ingestd.errors import EnvFault, autograd_hint, part_of
from ingestd.replay.limiter import hold_worker
from ingestd.service.limits import fd_hint, out_of_fds
from ingestd.service.signals import KEPT, kept_signals

# a worker has no children of ingestd's: an env's own SIGCHLD handling (reaping its simulator) stays
WORKER_KEPT = tuple(s for s in KEPT if s != signal.SIGCHLD)
log = logging.getLogger("ingestd.worker")

WORKER_NICE = 5
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_PAUSED_POLL_S = 0.001
LOCK_SHOWN_S = 0.5  # a wait for priority.lock this long shows in status (shorter ones are a busy trainer)


def _published(weights) -> int:
    """The newest version in the weight store (0 without one): one int64 load."""
    return 0 if weights is None else weights.version


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs: paths to shared objects, and its job."""

    index: int
    replay_path: str
    stats_path: str
    weights_path: str
    env: str
    policy: str
    num_envs: int
    chunk_steps: int
    seed: int
    threads: int = 1
    device: str = "cpu"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    # collector features (ingestd.collect.features; docs/collector-features.md)
    init_random_frames: int = 0
    max_episode_steps: int = 0  # 0: no limit
    total_frames: int = 0  # 0: no budget
    n_step: int = 1
    gamma: float = 0.99
    compile_policy: bool = False
    inference_mode: bool = True  # torch.inference_mode() around the env and policy, else no_grad
    enable_profile: bool = True
    action_bounds: str = "refuse"  # ingestd.collect.checks
    check_finite: bool = True
    start_timeout_s: float = 60.0  # building the env and policy, and the first reset, may take this long


def derive_seed(base: int, worker: int, incarnation: int) -> int:
    """A distinct, stable 63-bit seed per (base seed, worker, incarnation)."""
    state = np.random.SeedSequence([base, worker, incarnation]).generate_state(2, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def worker_main(spec: WorkerSpec) -> None:
    """Process entry point. Exits 0 after a requested stop, 1 after an error."""
    _child_setup()
    stats = StatsBlock(spec.stats_path)
    code = 0
    try:
        Worker(spec, stats).run()
    except BaseException as exc:  # report everything, then die; the supervisor decides what next
        message = failure_message(exc, spec.inference_mode)
        stats.set_error(spec.index, message)
        # logged, not printed: under systemd every line of it is stored at priority err (journal.py)
        log.error("ingestd worker %d (pid %d) failed: %s\n%s", spec.index, os.getpid(), message,
                  traceback.format_exc().rstrip())
        code = 1
    sys.stderr.flush()
    os._exit(code)  # no finalizers: the parent's zmq/threads are not ours to clean up


def failure_message(exc: BaseException, inference_mode: bool) -> str:
    """The one line a dead worker leaves in its stats block (and the journal): what raised, and
    the way out where one is known."""
    message = f"{type(exc).__name__}: {exc}" + autograd_hint(exc, inference_mode)
    part = None if isinstance(exc, EnvFault) else part_of(exc)  # (an EnvFault's message says it)
    if part is not None:  # first: the stats block keeps the message's first 240 bytes
        message = f"{part} raised {message}"
    if out_of_fds(exc):  # (scaled up under a low ulimit: a bare errno 24 said nothing of it)
        message += fd_hint("this worker")
    return message


def _child_setup() -> None:
    release_inherited()  # the daemon's locks and sockets: see ingestd.collect.inherited
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # the supervisor sends SIGUSR1 to a worker it found hung, just before it kills it: every
    # thread's Python stack goes to stderr (the journal), saying where it hung
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    os.nice(WORKER_NICE)  # collectors yield to the daemon's control thread and to trainers
    keep_heap()  # (PDEATHSIG, to die with the daemon, is set straight after the fork: service.forking)


def keep_heap() -> None:
    """Keep large buffers in glibc's heap instead of an mmap/munmap (and page faults) per fresh
    image batch: without it a bare Pixels loop runs at 90-150k frames/s here, with it 250-340k.
    Every worker does this at start; the benchmarks' in-process limits do too, to be comparable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mallopt(_M_MMAP_THRESHOLD, 256 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


class Worker:
    def __init__(self, spec: WorkerSpec, stats: StatsBlock):
        self.spec, self.stats = spec, stats
        self.rec = stats[spec.index]
        self._heartbeats, self._clock = stats.records["heartbeat"], time.monotonic  # _beat runs every env step
        self._lock_waited_from: float | None = None  # (_lock_wait) when this chunk began waiting for the lock

    def run(self) -> None:
        import torch

        from ingestd.collect.features import component_seeds
        from ingestd.collect.interfaces import episode_base_of
        from ingestd.collect.rollout import no_autograd
        from ingestd.replay.storage import ReplayStorage

        spec, rec = self.spec, self.rec
        rec["pid"], rec["state"] = os.getpid(), State.STARTING
        self._beat()
        torch.set_num_threads(max(1, spec.threads))
        rec["threads"] = torch.get_num_threads()
        storage = ReplayStorage.open(spec.replay_path)
        storage.lock_wait = self._lock_wait  # beat (and say so) while a stopped trainer holds priority.lock
        from ingestd.replay.limiter import Limiter

        self.limiter = Limiter.attach(spec.replay_path, inserts=lambda: storage.write_count)
        # the supervisor numbers workers in start order (reproducible seeds); a worker started on
        # its own takes a number itself
        incarnation = int(rec["incarnation"]) or storage.next_incarnation()
        seed = derive_seed(spec.seed, spec.index, incarnation)
        rec["incarnation"], rec["seed"] = incarnation, seed
        seeds = component_seeds(seed)
        torch.manual_seed(seeds.torch)
        np.random.seed(seeds.numpy)
        log.info("worker %d incarnation %d seed %d", spec.index, incarnation, seed)
        # all of it in one autograd mode (workers.inference_mode): a tensor the env or policy makes
        # in a chunk (a lazy module's weights) is then an inference tensor changed only in that mode
        with no_autograd(spec.inference_mode):
            env, policy, weights, rollout = self._build(seed, seeds, episode_base_of(incarnation))
            try:
                self._loop(rollout, storage, weights, policy)
            finally:
                self.extras.close(storage)
                env.close()
                storage.close()
        rec["state"] = State.STOPPED

    def _build(self, seed: int, seeds, episode_base: int):
        """The env, policy, weight store and rollout of this incarnation, its weights applied."""
        from ingestd.collect.features import ChunkExtras, keepalive
        from ingestd.collect.rollout import Rollout

        spec = self.spec
        # building an env can take longer than the heartbeat timeout; not longer than start_timeout_s
        with keepalive(self._beat, limit_s=spec.start_timeout_s, doing="building its env and policy"), \
                kept_signals(f"worker {spec.index}'s env or policy (workers.env, workers.policy)", WORKER_KEPT):
            env, policy = build_env_and_policy(spec, seed, episode_base)
        weights = _attach_weights(spec.weights_path, policy)
        self.version = self._apply_weights(weights, policy, -1)
        self._written_version = self.version  # the weights of the last chunk written (see _loop)
        self.extras = ChunkExtras(spec, env, policy, seeds, self.rec, self._beat)
        # the env's first reset (a simulator loading a scene) may be slow too
        with keepalive(self._beat, limit_s=spec.start_timeout_s, doing="its env's first reset"), \
                kept_signals(f"worker {spec.index}'s env (workers.env), in its first reset", WORKER_KEPT):
            rollout = Rollout(self.extras.env, self.extras.acting, spec.index, episode_base, spec.chunk_steps,
                              beat=self._beat, checks=self.extras.checks, inference_mode=spec.inference_mode)
        return env, policy, weights, rollout

    def _loop(self, rollout, storage, weights, policy) -> None:
        rec = self.rec
        while True:
            self._beat()
            desired = rec["desired"]
            self.extras.profile.poll()
            if desired == Desired.STOP:
                rec["state"] = State.STOPPING
                self.extras.flush(storage)
                return
            paused = PauseReason.REQUESTED if desired == Desired.PAUSE else self.extras.paused(storage)
            if paused:
                rec["state"], rec["pause_reason"] = State.PAUSED, paused
                time.sleep(_PAUSED_POLL_S)
                continue
            rec["state"], rec["pause_reason"] = State.RUNNING, PauseReason.NONE
            if 0 < rec["threads_wanted"] != rec["threads"]:  # the workers' share of the cores changed (scale)
                import torch

                torch.set_num_threads(int(rec["threads_wanted"]))
                rec["threads"] = torch.get_num_threads()
            # before the limiter's hold too: a worker held back applies a push (which waits for it).
            # The store's version is read first: a push landing after the apply's read then ends
            # the hold below (read after, it was taken as seen: held, the push never applied)
            published = _published(weights)
            self.version = self._apply_weights(weights, policy, self.version)
            # one chunk of each new weights version is written whatever the limiter says: a trainer
            # sampling with max_policy_lag may need rows of that version before it can sample (and
            # so release the workers) at all
            if self.version <= self._written_version and hold_worker(
                    self.limiter, rec, self._beat,
                    lambda: rec["desired"] == Desired.RUN and _published(weights) == published):
                continue  # held back by the rate limiter (ingestd.replay.limiter), until released, told
                # otherwise, or new weights are published (applied above): look again
            t0 = time.perf_counter()
            with self.extras.profile.chunk():
                frames, finished = self._collect(rollout, storage)
            if self._lock_waited_from is not None:  # the lock came: collecting again
                self._lock_waited_from = None
                if rec["pause_reason"] == PauseReason.PRIORITY_LOCK:
                    rec["pause_reason"] = PauseReason.NONE
            self._account(frames, finished, time.perf_counter() - t0)

    def _collect(self, rollout, storage) -> tuple[int, Any]:
        """Roll one chunk and store it; returns the frames collected and the finished episodes."""
        version = self.extras.before_chunk(rollout, storage, self.version)
        self._written_version = self.version
        nstep = self.extras.nstep
        emitted = (rollout.rows_per_chunk if nstep is None
                   else nstep.ready_steps(rollout.chunk_steps) * rollout.env.num_envs)
        if storage.has_columns and emitted:
            # large leaves (images) go straight into their reserved slots: rolled there, or with
            # n-step copied and gathered there from the chunk (ingestd.collect.nstep)
            with storage.reserved(emitted) as slots:
                if nstep is None:
                    rows, finished = rollout.chunk(version, into=slots.columns)
                else:
                    rows, finished = rollout.chunk(version)
                    rows = nstep(rows, into=slots.columns)
                slots.commit(rows)
            return rollout.rows_per_chunk, finished
        rows, finished = rollout.chunk(version)
        storage.write(self.extras.stored(rows))
        return rows.batch_size[0], finished

    def _apply_weights(self, weights, policy, current: int) -> int:
        if weights is None:
            return max(current, 0)
        applied = weights.load_into(policy, if_newer_than=current)
        if applied is None:
            return current
        self.rec["weights_version"] = applied
        return applied

    def _account(self, frames: int, finished, seconds: float) -> None:
        rec = self.rec
        count, n = int(rec["returns_count"]), len(finished.returns)
        if n:  # only the newest RING episodes can survive in the ring: write just those, at once
            take = min(n, RING)
            slots = (count + n - take + np.arange(take)) % RING
            rec["returns_seq"] += 1  # odd: a reader copying the record now reads it again (stats.consistent)
            rec["returns"][slots] = finished.returns[n - take:]
            rec["lengths"][slots] = finished.lengths[n - take:]
            rec["returns_count"] = count + n
            rec["returns_seq"] += 1
        rec["episodes"] += n
        rec["frames"] += frames
        rec["chunks"] += 1
        rec["chunk_seconds"] = seconds

    def _lock_wait(self) -> None:
        """Called while another process holds ``priority.lock`` (a trainer stopped inside
        ``update_priorities`` stops every worker's commit): beat, and once the wait passes
        ``LOCK_SHOWN_S`` show it in the stats record (``status``: ``running (priority_lock)``)."""
        self._beat()
        now = self._clock()
        if self._lock_waited_from is None:
            self._lock_waited_from = now
        elif now - self._lock_waited_from >= LOCK_SHOWN_S and self.rec["pause_reason"] == PauseReason.NONE:
            self.rec["pause_reason"] = PauseReason.PRIORITY_LOCK

    def _beat(self) -> None:
        """A heartbeat: before every chunk and after every env step, so only a step (not a chunk)
        slower than ``heartbeat_timeout_s`` is a hang. ~0.1 us: a store through a field view."""
        self._heartbeats[self.spec.index] = self._clock()


def build_env_and_policy(spec: WorkerSpec, seed: int, episode_base: int, num_envs: int | None = None):
    """Construct the configured env and policy (also used by the daemon for the schema)."""
    env = build_env(spec, seed, episode_base, num_envs)
    try:
        return env, build_policy(spec, env, seed)
    except BaseException:
        env.close()
        raise


def build_env(spec: WorkerSpec, seed: int, episode_base: int, num_envs: int | None = None):
    from ingestd.collect.features import component_seeds
    from ingestd.collect.interfaces import EnvContext
    from ingestd.collect.registry import make_env

    ctx = EnvContext(num_envs=num_envs or spec.num_envs, seed=component_seeds(seed).env, worker=spec.index,
                     episode_base=episode_base, device=spec.device)
    return make_env(spec.env, ctx, dict(spec.env_kwargs))


def build_policy(spec: WorkerSpec, env, seed: int):
    from ingestd.collect.features import component_seeds, seeded_policy_kwargs
    from ingestd.collect.registry import make_policy, resolve_policy

    kwargs = seeded_policy_kwargs(resolve_policy(spec.policy), spec.policy_kwargs, component_seeds(seed).policy)
    policy = make_policy(spec.policy, env.spec, kwargs)
    if hasattr(policy, "to") and spec.device != "cpu":
        policy = policy.to(spec.device)
    return policy


def _attach_weights(path: str, policy):
    """The shared weight store, if this policy takes weights."""
    import torch

    if not isinstance(policy, torch.nn.Module) or not policy.state_dict():
        return None
    from ingestd.weights.store import WeightStore

    return WeightStore.attach(path)
