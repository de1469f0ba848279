#!/usr/bin/env python3
"""DQN on a running ingestd daemon's CartPole, using only ingestd's public API and torch.

The daemon's workers collect with the built-in ``MLP`` epsilon-greedy policy.
This trainer attaches to the replay storage by path, samples TorchRL-layout
batches, learns a Q-network with the same state_dict names as the workers'
policy (``ingestd.collect.policies.mlp_qnet``) and pushes it every
``--push-every`` updates through the control socket. Exploration is annealed
by pushing the ``epsilon`` buffer along with the weights.

Start a daemon whose policy begins fully random, then the trainer::

    ingestd run --set workers.num_envs=16 --set workers.chunk_steps=8 \\
                --set replay.capacity=100000 --set 'workers.policy_kwargs={epsilon = 1.0}'
    python examples/dqn_cartpole.py --replay ~/.local/state/ingestd/replay --seconds 120

and watch ``ingestctl status`` (or the Grafana dashboard's episode-return
panel): the returns the *daemon's workers* get climb from ~20 (random) to
several hundred.

Freshness ("max lag"): the trainer trains only on rows whose
``("ingestd", "policy_version")`` is at least ``last pushed version - max_lag``;
older rows are dropped and more are drawn. ``ReplayReader`` has no such
option yet, so the filter lives here (``FreshSampler``). Every update
records the version it trained against and the oldest and newest row
versions, and the result counts the rows per version, so the property can be
checked after the fact.

Import it to drive it from Python: ``train(TrainConfig(replay=...)) -> TrainResult``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.nn import functional as F

import ingestd
from ingestd.collect.policies import mlp_qnet

DEFAULT_HIDDEN = (64, 64)  # the MLP policy's default


@dataclass(frozen=True)
class TrainConfig:
    replay: str  # path of the daemon's replay storage
    connect: str | None = None  # control address; None: $INGESTD_CONTROL or the default ipc socket
    wait: float = 0.0  # seconds to wait for the daemon to create the replay and answer (started together)
    seconds: float = 120.0  # wall-clock budget of the training loop
    target_return: float | None = None  # stop early once the daemon's recent mean return reaches it
    target_checks: int = 3  # ... at this many consecutive looks (check_every apart)
    return_window: int = 20  # "recent": the last N finished episodes across workers
    push_every: int = 100  # updates between weight pushes
    max_lag: int = 8  # train only on rows with policy_version >= last pushed - max_lag
    batch_size: int = 256
    lr: float = 1e-3
    gamma: float = 0.99
    tau: float = 0.01  # soft target-network update per gradient step
    double: bool = True  # Double DQN targets
    grad_clip: float = 10.0
    eps_start: float = 1.0
    eps_end: float = 0.02
    eps_updates: int = 3000  # updates over which epsilon is annealed linearly
    learning_starts: int = 2000  # rows in the replay before the first update
    hidden: tuple[int, ...] | None = None  # None: the daemon's workers.policy_kwargs.hidden, or (64, 64)
    num_actions: int = 2
    threads: int = 1  # torch intra-op threads: leave the cores to the workers
    seed: int = 0
    log_every: float = 5.0  # seconds between progress lines
    check_every: float = 0.5  # seconds between looks at the daemon's returns
    stats: str | None = None  # the daemon's workers.stats file; None: from the daemon's config


@dataclass
class TrainResult:
    updates: int = 0
    pushes: int = 0
    seconds: float = 0.0
    first_version: int = 0  # the daemon's weights version when training started
    final_version: int = 0  # the last version this trainer pushed
    reached_target: bool = False
    rows_trained: int = 0
    rows_dropped_stale: int = 0  # drawn but refused for being older than max_lag allows
    # per update: the version it trained against (last pushed) and its rows' oldest/newest versions
    update_version: list[int] = field(default_factory=list)
    update_min_row_version: list[int] = field(default_factory=list)
    update_max_row_version: list[int] = field(default_factory=list)
    rows_per_version: dict[int, int] = field(default_factory=dict)
    # (seconds since start, updates, the daemon's mean return of the last `return_window` episodes)
    returns_seen: list[tuple[float, int, float | None]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # mean loss per log interval
    timing: dict[str, float] = field(default_factory=dict)  # seconds spent sampling, learning, pushing, watching

    def max_row_lag(self) -> int:
        """The largest ``trained-against version - row version`` over every row trained on."""
        return max((v - m for v, m in zip(self.update_version, self.update_min_row_version)), default=0)

    def to_json(self) -> dict:
        out = asdict(self)
        out["rows_per_version"] = {str(k): v for k, v in sorted(self.rows_per_version.items())}
        out["max_row_lag"] = self.max_row_lag()
        return out


# -- the daemon's episode returns ------------------------------------------------------
class DaemonReturns:
    """The last episode returns the daemon's workers finished (daemon state, not the trainer's).

    ``Status.workers[i].last_return`` is only the latest one, so until the
    status reply carries the per-worker ring this reads the daemon's stats
    block file (read-only, a copy per call)."""

    def __init__(self, ctl, stats_path: str | os.PathLike | None = None):
        self.ctl = ctl
        self._stats_path = Path(stats_path) if stats_path else None

    def _ring_reader(self, status) -> Path:
        if self._stats_path is None:
            runtime = status.config.get("service", {}).get("runtime_dir") or ""
            if not runtime:
                from ingestd.service.config import default_runtime_dir
                runtime = str(default_runtime_dir(os.environ))
            self._stats_path = Path(os.path.expanduser(runtime)) / "workers.stats"
        return self._stats_path

    def per_worker(self, status=None) -> dict[int, list[float]]:
        """``{worker index: its recent returns, oldest first}``."""
        status = status or self.ctl.status()
        if status.workers and all(hasattr(w, "recent_returns") for w in status.workers):
            return {w.index: list(w.recent_returns) for w in status.workers}
        from ingestd.collect.stats import RECORD, RING

        records = np.fromfile(self._ring_reader(status), dtype=RECORD)
        out = {}
        for w in status.workers:
            rec = records[w.index]
            count = int(rec["returns_count"])
            take = min(count, RING)
            out[w.index] = [float(rec["returns"][(count - take + k) % RING]) for k in range(take)]
        return out

    def recent_mean(self, last: int = 20, status=None) -> float | None:
        """Mean of about the last ``last`` finished episodes: the newest ``ceil(last / workers)``
        of every worker (the rings carry no timestamps to interleave them exactly).
        None until that many episodes have finished."""
        rings = [r for r in self.per_worker(status).values() if r]
        if not rings:
            return None
        take = math.ceil(last / len(rings))
        chosen = [x for r in rings for x in r[-take:]]
        return float(np.mean(chosen)) if len(chosen) >= last else None


# -- sampling fresh rows -----------------------------------------------------------------
class FreshSampler:
    """``sample(n, min_version)``: ``n`` uniform rows whose policy_version >= ``min_version``.

    Rejection sampling over ``ReplayReader.sample``; ``SampleTimeout`` if ``timeout``
    passes without enough fresh rows (the workers are paused, or max_lag is too tight)."""

    def __init__(self, reader, timeout: float = 30.0):
        self.reader, self.timeout = reader, timeout
        self.dropped = 0

    def sample(self, n: int, min_version: int):
        deadline = time.monotonic() + self.timeout
        parts, have = [], 0
        while have < n:
            batch = self.reader.sample(max(n - have, n // 2), timeout=max(0.001, deadline - time.monotonic()))
            keep = batch["ingestd", "policy_version"] >= min_version
            kept = int(keep.sum())
            self.dropped += batch.batch_size[0] - kept
            if kept:
                parts.append(batch if kept == batch.batch_size[0] else batch[keep])
                have += kept
            elif time.monotonic() > deadline:
                raise ingestd.SampleTimeout(f"no rows with policy_version >= {min_version} in "
                                            f"{self.reader.path} for {self.timeout} s")
            else:
                time.sleep(0.001)
        batch = parts[0] if len(parts) == 1 else torch.cat(parts)
        return batch[:n]


# -- DQN ------------------------------------------------------------------------------
def dqn_loss(qnet, target, batch, gamma: float, double: bool) -> torch.Tensor:
    """Huber TD loss on a TorchRL-layout batch; bootstraps unless ``("next", "terminated")``."""
    obs, action = batch["observation"], batch["action"]
    next_obs = batch["next", "observation"]
    reward = batch["next", "reward"].reshape(-1)
    terminated = batch["next", "terminated"].reshape(-1)
    q = qnet(obs).gather(1, action.reshape(-1, 1)).squeeze(1)
    with torch.no_grad():
        next_q_target = target(next_obs)
        if double:
            best = qnet(next_obs).argmax(1, keepdim=True)
            next_q = next_q_target.gather(1, best).squeeze(1)
        else:
            next_q = next_q_target.max(1).values
        y = reward + gamma * next_q * (~terminated).to(reward.dtype)
    return F.smooth_l1_loss(q, y)


def epsilon_at(cfg: TrainConfig, updates: int) -> float:
    frac = min(1.0, updates / max(1, cfg.eps_updates))
    return cfg.eps_start + frac * (cfg.eps_end - cfg.eps_start)


def daemon_hidden(status) -> tuple[int, ...]:
    kwargs = status.config.get("workers", {}).get("policy_kwargs", {}) or {}
    return tuple(int(h) for h in kwargs.get("hidden", DEFAULT_HIDDEN))


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    result = TrainResult()
    ctl = ingestd.ControlClient(cfg.connect, timeout=10.0)
    try:
        reader, status = attach(cfg, ctl)
        try:
            _train(cfg, reader, ctl, status, result, log)
        finally:
            reader.close()
    finally:
        ctl.close()
    return result


def attach(cfg: TrainConfig, ctl) -> tuple:
    """Open the replay and get the daemon's status, waiting up to ``cfg.wait`` seconds for both."""
    deadline = time.monotonic() + cfg.wait
    while True:
        reader = None
        try:
            reader = ingestd.ReplayReader(cfg.replay, seed=cfg.seed)
            return reader, ctl.status()
        except (ingestd.StorageNotFound, ingestd.DaemonUnavailable):
            if reader is not None:
                reader.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _train(cfg: TrainConfig, reader, ctl, status, result: TrainResult, log: Callable[[str], None]) -> None:
    returns = DaemonReturns(ctl, cfg.stats)
    obs_dim = math.prod(reader.schema[("observation",)].shape)
    hidden = cfg.hidden or daemon_hidden(status)
    qnet = mlp_qnet(obs_dim, cfg.num_actions, hidden)
    target = copy.deepcopy(qnet).requires_grad_(False)
    params = list(qnet.parameters())
    optim = _adam(params, cfg.lr)
    sampler = FreshSampler(reader)
    version = result.first_version = result.final_version = status.weights_version
    log(f"attached to {cfg.replay} ({len(reader)} rows of {reader.capacity}); daemon weights version {version}; "
        f"Q-network {obs_dim}-{'-'.join(map(str, hidden))}-{cfg.num_actions}")

    while reader.write_count < cfg.learning_starts:
        time.sleep(0.05)
    start = time.monotonic()
    next_check = next_log = start
    held = 0  # consecutive looks at which the daemon's returns were at or above target_return
    interval_losses: list[float] = []
    pending: list[torch.Tensor] = []  # row versions not yet counted into result.rows_per_version
    timing = result.timing
    timing.update(sample=0.0, learn=0.0, push=0.0, watch=0.0)
    while True:
        now = time.monotonic()
        if now >= next_check:
            next_check = now + cfg.check_every
            mean = returns.recent_mean(cfg.return_window)
            result.returns_seen.append((round(now - start, 3), result.updates, mean))
            if now >= next_log:
                next_log = now + cfg.log_every
                loss = float(np.mean(interval_losses)) if interval_losses else float("nan")
                result.losses.append(loss)
                interval_losses.clear()
                shown = "n/a" if mean is None else f"{mean:.1f}"
                result.rows_dropped_stale = sampler.dropped
                log(f"t={now - start:6.1f}s updates={result.updates:6d} loss={loss:.4f} "
                    f"eps={epsilon_at(cfg, result.updates):.3f} version={version} "
                    f"stale-dropped={result.rows_dropped_stale} daemon-return(last {cfg.return_window})={shown}")
            held = held + 1 if cfg.target_return is not None and mean is not None and mean >= cfg.target_return else 0
            if held >= cfg.target_checks:
                result.reached_target = True
                break
            if now - start >= cfg.seconds:
                break
            timing["watch"] += time.monotonic() - now

        t0 = time.monotonic()
        batch = sampler.sample(cfg.batch_size, version - cfg.max_lag)
        row_versions = batch["ingestd", "policy_version"]
        t1 = time.monotonic()
        timing["sample"] += t1 - t0
        loss = dqn_loss(qnet, target, batch, cfg.gamma, cfg.double)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optim.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(target.parameters()), params, cfg.tau)
        result.updates += 1
        interval_losses.append(loss.item())
        result.update_version.append(version)
        result.update_min_row_version.append(int(row_versions.min()))
        result.update_max_row_version.append(int(row_versions.max()))
        result.rows_trained += row_versions.numel()
        pending.append(row_versions)
        if len(pending) >= 256:
            _count_versions(pending, result)

        t2 = time.monotonic()
        timing["learn"] += t2 - t1
        if result.updates % cfg.push_every == 0:
            qnet.epsilon.fill_(epsilon_at(cfg, result.updates))
            version = ctl.push_weights(qnet, wait=True)
            result.final_version = version
            result.pushes += 1
            timing["push"] += time.monotonic() - t2

    _count_versions(pending, result)
    result.rows_dropped_stale = sampler.dropped
    result.seconds = round(time.monotonic() - start, 3)
    result.timing = {k: round(v, 3) for k, v in timing.items()}
    mean = returns.recent_mean(cfg.return_window)
    log(f"done: {result.updates} updates in {result.seconds:.1f}s, {result.pushes} pushes "
        f"(versions {result.first_version}..{result.final_version}), largest row lag {result.max_row_lag()} "
        f"(max {cfg.max_lag}), daemon-return(last {cfg.return_window})="
        f"{'n/a' if mean is None else f'{mean:.1f}'}")


def _adam(params, lr: float) -> torch.optim.Optimizer:
    """Adam, fused where this torch has it on CPU (half the time of the per-parameter loop)."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)


def _count_versions(pending: list[torch.Tensor], result: TrainResult) -> None:
    if pending:
        values, counts = torch.unique(torch.cat(pending), return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            result.rows_per_version[v] = result.rows_per_version.get(v, 0) + c
        pending.clear()


# -- command line ----------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, str | None]:
    defaults = TrainConfig(replay="")
    p = argparse.ArgumentParser(description="DQN trainer for a running ingestd daemon (CartPole, MLP policy).")
    p.add_argument("--replay", required=True, help="the daemon's replay storage directory")
    p.add_argument("--connect", help="control address (default: $INGESTD_CONTROL, else the default ipc socket)")
    p.add_argument("--wait", type=float, default=defaults.wait, metavar="S",
                   help="wait up to S seconds for the daemon's replay and control socket to appear")
    p.add_argument("--seconds", type=float, default=defaults.seconds, help="training time budget")
    p.add_argument("--target-return", type=float, help="stop once the daemon's recent mean return reaches this")
    p.add_argument("--target-checks", type=int, default=defaults.target_checks, metavar="N",
                   help="... at N consecutive looks, half a second apart")
    p.add_argument("--push-every", type=int, default=defaults.push_every, metavar="K",
                   help="push the weights every K updates")
    p.add_argument("--max-lag", type=int, default=defaults.max_lag, metavar="L",
                   help="train only on rows with policy_version >= last pushed version - L")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--gamma", type=float, default=defaults.gamma)
    p.add_argument("--tau", type=float, default=defaults.tau, help="soft target update rate per step")
    p.add_argument("--no-double", action="store_true", help="plain DQN targets instead of Double DQN")
    p.add_argument("--eps-start", type=float, default=defaults.eps_start)
    p.add_argument("--eps-end", type=float, default=defaults.eps_end)
    p.add_argument("--eps-updates", type=int, default=defaults.eps_updates,
                   help="updates over which the pushed epsilon is annealed")
    p.add_argument("--learning-starts", type=int, default=defaults.learning_starts, metavar="ROWS")
    p.add_argument("--hidden", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="hidden sizes, e.g. 64,64 (default: the daemon's policy_kwargs.hidden)")
    p.add_argument("--num-actions", type=int, default=defaults.num_actions)
    p.add_argument("--threads", type=int, default=defaults.threads)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--log-every", type=float, default=defaults.log_every, metavar="S")
    p.add_argument("--stats", help="the daemon's workers.stats file (default: <runtime_dir>/workers.stats)")
    p.add_argument("--result-json", metavar="FILE", help="write the TrainResult as JSON here")
    a = p.parse_args(argv)
    cfg = TrainConfig(
        replay=a.replay, connect=a.connect, wait=a.wait, seconds=a.seconds, target_return=a.target_return,
        target_checks=a.target_checks, push_every=a.push_every, max_lag=a.max_lag, batch_size=a.batch_size,
        lr=a.lr, gamma=a.gamma, tau=a.tau,
        double=not a.no_double, eps_start=a.eps_start, eps_end=a.eps_end, eps_updates=a.eps_updates,
        learning_starts=a.learning_starts, hidden=a.hidden, num_actions=a.num_actions, threads=a.threads,
        seed=a.seed, log_every=a.log_every, stats=a.stats)
    return cfg, a.result_json


def main(argv: list[str] | None = None) -> int:
    cfg, result_json = parse_args(argv)
    try:
        result = train(cfg, log=lambda line: print(line, flush=True))
    except ingestd.IngestdError as exc:
        print(f"dqn_cartpole: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if result_json:
        Path(result_json).write_text(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
