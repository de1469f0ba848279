#!/usr/bin/env python3
"""DQN against a running ingestd daemon's CartPole, with only ingestd's public API and torch.

The daemon's workers collect with the built-in ``MLP`` epsilon-greedy policy.
This trainer attaches to the replay storage by path, samples batches in the
TorchRL layout, learns a Q-network with the same state_dict names as the
workers' policy (``ingestd.collect.policies.mlp_qnet``) and pushes it every
``--push-every`` updates through the control socket. Exploration is annealed
by pushing the ``epsilon`` buffer along with the weights.

Start a daemon whose policy starts out fully random, then the trainer::

    ingestd run --set workers.num_envs=16 --set workers.chunk_steps=8 --set replay.capacity=200000 \\
                --set 'workers.policy_kwargs={epsilon = 1.0, hidden = [128, 128]}'
    python examples/dqn_cartpole.py --replay ~/.local/state/ingestd/replay --seconds 120

Then watch ``ingestctl status`` (or the Grafana dashboard's episode-return
panel). The returns of the daemon's workers climb from about 20 (random) to
200 or more, usually within 1,000 updates.

**Freshness ("max lag").** The trainer trains only on rows whose
``("ingestd", "policy_version")`` is at least ``last pushed version - max_lag``.
It drops older rows and draws more (``FreshSampler``).
``ReplayReader(..., max_policy_lag=L, weights_path=...)`` filters the same way
against the weight store's newest version (docs/sampling.md); the example keeps
its own filter so that it can count the stale rows it refused. For every update the trainer records
the version it trained against and the oldest and newest versions of its
rows, and it counts the rows of each version, so the property can be checked
afterwards.

**The daemon's returns** are read from the daemon, never from the trainer's
own bookkeeping: ``DaemonReturns`` takes the last finished episodes of each
worker from ``status`` (``WorkerStatus.recent_returns``, the workers' stats
block that the metrics read too).

Import it to drive it from Python: ``train(TrainConfig(replay=...)) -> TrainResult``.
Another loss plugs in through ``train(..., learner=...)``; see ``torchrl_dqnloss.py``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
from torch.nn import functional as F

import ingestd
from ingestd.collect.policies import mlp_qnet

DEFAULT_HIDDEN = (64, 64)  # the MLP policy's default


def option(default: Any, help: str, type: Callable | None = None, metavar: str | None = None) -> Any:
    """A setting: its default and its --help text, in one place (the CLI is built from them)."""
    return field(default=default, metadata={"help": help, "type": type, "metavar": metavar})


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


@dataclass(frozen=True)
class TrainConfig:
    replay: str = option("", "the daemon's replay storage directory (required)", metavar="PATH")
    connect: str | None = option(None, "control address (default: $INGESTD_CONTROL, else the default ipc "
                                       "socket)", str, metavar="ADDR")
    wait: float = option(0.0, "seconds to wait for the daemon's replay and control socket to appear",
                         metavar="S")
    seconds: float = option(120.0, "training time budget", metavar="S")
    target_return: float | None = option(None, "stop early once the daemon's recent mean return reaches this",
                                         float, metavar="R")
    target_checks: int = option(3, "... at this many consecutive looks (check_every apart)", metavar="N")
    return_window: int = option(20, "'recent': the last N finished episodes across workers", metavar="N")
    push_every: int = option(100, "push the weights every K updates", metavar="K")
    max_lag: int = option(8, "train only on rows with policy_version >= last pushed version - L", metavar="L")
    batch_size: int = option(256, "rows per update")
    lr: float = option(1e-3, "Adam learning rate")
    gamma: float = option(0.99, "discount")
    tau: float = option(0.01, "soft target-network update per gradient step")
    double: bool = option(True, "Double DQN targets (--no-double: plain DQN)")
    grad_clip: float = option(10.0, "gradient norm clip")
    eps_start: float = option(1.0, "pushed epsilon at the first push ...")
    eps_end: float = option(0.02, "... annealed linearly to this ...")
    eps_updates: int = option(1000, "... over this many updates")
    learning_starts: int = option(2000, "rows written to the replay before the first update")
    hidden: tuple[int, ...] | None = option(None, "hidden sizes, e.g. 128,128 (default: the daemon's "
                                                  "workers.policy_kwargs.hidden, else 64,64)", _sizes,
                                            metavar="H1,H2")
    num_actions: int = option(2, "actions of the env (CartPole: 2)")
    threads: int = option(1, "torch intra-op threads (leave the cores to the workers)")
    seed: int = option(0, "seed of the network init and of the sampling")
    log_every: float = option(5.0, "seconds between progress lines", metavar="S")
    check_every: float = option(0.5, "seconds between looks at the daemon's returns", metavar="S")


@dataclass
class TrainResult:
    updates: int = 0
    pushes: int = 0
    seconds: float = 0.0
    first_version: int = 0  # the daemon's weights version when training started
    final_version: int = 0  # the last version this trainer pushed (first_version if none)
    reached_target: bool = False
    rows_trained: int = 0
    rows_dropped_stale: int = 0  # drawn but refused for being older than max_lag allows
    # per update: the version it trained against (the last pushed) and its rows' oldest and newest versions
    update_version: list[int] = field(default_factory=list)
    update_min_row_version: list[int] = field(default_factory=list)
    update_max_row_version: list[int] = field(default_factory=list)
    rows_per_version: dict[int, int] = field(default_factory=dict)
    # (seconds since start, updates, the daemon's mean return of the last `return_window` episodes)
    returns_seen: list[tuple[float, int, float | None]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # mean loss per progress line
    timing: dict[str, float] = field(default_factory=dict)  # seconds spent sampling, learning, pushing, watching

    def max_row_lag(self) -> int:
        """The largest ``trained-against version - row version`` over every row trained on."""
        return max((v - m for v, m in zip(self.update_version, self.update_min_row_version)), default=0)

    def to_json(self) -> dict:
        out = asdict(self)
        out["rows_per_version"] = {str(k): v for k, v in sorted(self.rows_per_version.items())}
        out["max_row_lag"] = self.max_row_lag()
        return out


# -- the daemon's episode returns ------------------------------------------------------------
class DaemonReturns:
    """The returns of the episodes the daemon's workers finished last (daemon state, not ours),
    from ``Status.workers[i].recent_returns``: each worker's ring of recent returns."""

    @staticmethod
    def per_worker(status) -> dict[int, list[float]]:
        """``{worker index: its recent returns, oldest first}``."""
        return {w.index: list(w.recent_returns) for w in status.workers}

    def recent_mean(self, status, last: int = 20) -> float | None:
        """Mean of the last ``last`` finished episodes, taken as the newest ``ceil(last / workers)``
        of each worker (the rings carry no timestamps to interleave them exactly); None until
        that many have finished."""
        rings = [r for r in self.per_worker(status).values() if r]
        if not rings:
            return None
        take = math.ceil(last / len(rings))
        chosen = [x for r in rings for x in r[-take:]]
        return float(np.mean(chosen)) if len(chosen) >= last else None


# -- sampling fresh rows -----------------------------------------------------------------------
class FreshSampler:
    """``sample(n, min_version)``: ``n`` uniform rows whose policy_version >= ``min_version``.

    Rejection sampling over ``ReplayReader.sample``, drawing more when many rows are
    stale. ``SampleTimeout`` if ``timeout`` passes without enough fresh rows (the
    workers are paused, or max_lag is tighter than the push rate allows)."""

    def __init__(self, reader, timeout: float = 30.0):
        self.reader, self.timeout = reader, timeout
        self.dropped = 0
        self._fresh = 1.0  # running estimate of the fraction of rows that pass

    def sample(self, n: int, min_version: int):
        deadline = time.monotonic() + self.timeout
        parts, have = [], 0
        while have < n:
            need = n - have
            draw = need if self._fresh > 0.98 else min(8 * n, math.ceil(need * 1.2 / max(self._fresh, 0.125)))
            batch = self.reader.sample(draw, timeout=max(0.001, deadline - time.monotonic()))
            keep = batch["ingestd", "policy_version"] >= min_version
            kept = int(keep.sum())
            self.dropped += draw - kept
            self._fresh = 0.8 * self._fresh + 0.2 * kept / draw
            if kept:
                parts.append(batch if kept == draw else batch[keep])
                have += kept
            elif time.monotonic() > deadline:
                raise ingestd.SampleTimeout(f"no rows with policy_version >= {min_version} in "
                                            f"{self.reader.path} for {self.timeout} s")
            else:
                time.sleep(0.001)  # every row is stale: let the workers write fresh ones
        batch = parts[0] if len(parts) == 1 else torch.cat(parts)
        return batch[:n] if have > n else batch


# -- learning -----------------------------------------------------------------------------------
class Learner(Protocol):
    """What the training loop needs from a loss: one gradient step on a batch of ingestd rows."""

    def step(self, batch) -> torch.Tensor:
        """Train on ``batch`` (as ``ReplayReader.sample`` gives it); the loss, detached."""


def adam(params, lr: float) -> torch.optim.Optimizer:
    """Adam, fused where this torch has it on CPU (half the time of the per-parameter loop)."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)


def dqn_loss(qnet, target, batch, gamma: float, double: bool) -> torch.Tensor:
    """Huber TD loss on a TorchRL-layout batch; bootstraps unless ``("next", "terminated")``
    (a time-limit truncation bootstraps). Rows that span ``m`` steps (an n-step
    ``steps_to_next_obs`` entry, TorchRL's name) are discounted by ``gamma ** m``."""
    reward = batch["next", "reward"].reshape(-1)
    steps = batch.get("steps_to_next_obs", None)
    discount = gamma if steps is None else gamma ** steps.reshape(-1).to(reward.dtype)
    terminated = batch["next", "terminated"].reshape(-1)
    next_obs = batch["next", "observation"]
    q = qnet(batch["observation"]).gather(1, batch["action"].reshape(-1, 1)).squeeze(1)
    with torch.no_grad():
        next_q = target(next_obs)
        if double:  # the online network picks, the target network values
            next_q = next_q.gather(1, qnet(next_obs).argmax(1, keepdim=True)).squeeze(1)
        else:
            next_q = next_q.max(1).values
        y = reward + discount * next_q * (~terminated).to(reward.dtype)
    return F.smooth_l1_loss(q, y)


class DQNLearner:
    """(Double) DQN in plain torch: Huber loss, Adam, a soft-updated target network."""

    def __init__(self, qnet: torch.nn.Module, cfg: TrainConfig):
        self.qnet, self.cfg = qnet, cfg
        self.target = copy.deepcopy(qnet).requires_grad_(False)
        self.params = list(qnet.parameters())
        self._target_params = list(self.target.parameters())
        self.optim = adam(self.params, cfg.lr)

    def step(self, batch) -> torch.Tensor:
        loss = dqn_loss(self.qnet, self.target, batch, self.cfg.gamma, self.cfg.double)
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optim.step()
        with torch.no_grad():
            torch._foreach_lerp_(self._target_params, self.params, self.cfg.tau)
        return loss.detach()


def epsilon_at(cfg: TrainConfig, updates: int) -> float:
    frac = min(1.0, updates / max(1, cfg.eps_updates))
    return cfg.eps_start + frac * (cfg.eps_end - cfg.eps_start)


def daemon_hidden(status) -> tuple[int, ...]:
    """The hidden sizes of the daemon's MLP policy, from its effective config."""
    kwargs = status.config.get("workers", {}).get("policy_kwargs", {}) or {}
    return tuple(int(h) for h in kwargs.get("hidden", DEFAULT_HIDDEN))


class BadArgument(ValueError):
    """A TrainConfig value (a command-line argument) that cannot work: reported in one line."""


# -- the training loop -----------------------------------------------------------------------------
def train(cfg: TrainConfig, log: Callable[[str], None] = print,
          learner: Callable[[torch.nn.Module, TrainConfig], Learner] = DQNLearner) -> TrainResult:
    """Attach, train until ``cfg.seconds`` pass or the daemon's returns reach ``cfg.target_return``."""
    if not cfg.replay:
        raise BadArgument("TrainConfig.replay: give the daemon's replay storage directory")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    try:
        ctl = ingestd.ControlClient(cfg.connect, timeout=10.0)
    except ValueError as exc:  # a malformed --connect
        raise BadArgument(str(exc)) from None
    try:
        reader, status = attach(cfg, ctl)
        try:
            return Trainer(cfg, reader, ctl, status, learner, log).run()
        finally:
            reader.close()
    finally:
        ctl.close()


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


class Trainer:
    """One training run: sample fresh rows, step the learner, push every K updates, watch the daemon."""

    def __init__(self, cfg: TrainConfig, reader, ctl, status, learner, log: Callable[[str], None]):
        nstep = reader.nstep  # n-step rows: their returns were discounted by the daemon's gamma
        if nstep is not None and nstep["gamma"] != cfg.gamma:
            log(f"the replay's rows are {nstep['n_step']}-step returns discounted by gamma={nstep['gamma']:g} "
                f"(workers.gamma); bootstrapping with that, not --gamma {cfg.gamma:g}")
            cfg = dataclasses.replace(cfg, gamma=nstep["gamma"])
        self.cfg, self.reader, self.ctl, self.log = cfg, reader, ctl, log
        obs_dim = math.prod(reader.schema[("observation",)].shape)
        hidden = cfg.hidden or daemon_hidden(status)
        self.qnet = mlp_qnet(obs_dim, cfg.num_actions, hidden)
        self.learner = learner(self.qnet, cfg)
        self.sampler = FreshSampler(reader)
        self.returns = DaemonReturns()
        self.result = TrainResult(first_version=status.weights_version, final_version=status.weights_version)
        self.version = status.weights_version  # the newest weights the workers collect with
        self.result.timing.update(sample=0.0, learn=0.0, push=0.0, watch=0.0)
        self._losses: list[torch.Tensor] = []
        self._versions: list[torch.Tensor] = []  # row versions not yet counted into rows_per_version
        self._held = 0
        log(f"attached to {cfg.replay} ({len(reader)} rows of {reader.capacity}); daemon weights version "
            f"{self.version}; Q-network {obs_dim}-{'-'.join(map(str, hidden))}-{cfg.num_actions}")

    def run(self) -> TrainResult:
        cfg, result, timing = self.cfg, self.result, self.result.timing
        deadline = time.monotonic() + cfg.seconds  # paused workers would keep this waiting for ever
        while self.reader.write_count < cfg.learning_starts:
            if time.monotonic() >= deadline:
                raise ingestd.SampleTimeout(f"the replay has {self.reader.write_count} rows, fewer than "
                                            f"--learning-starts {cfg.learning_starts}, after {cfg.seconds} s: "
                                            "are the workers paused (ingestctl status)?")
            time.sleep(0.05)
        self.start = time.monotonic()
        next_check = next_log = self.start
        while True:
            now = time.monotonic()
            if now >= next_check:
                progress = now >= next_log
                next_check, next_log = now + cfg.check_every, now + cfg.log_every if progress else next_log
                if self._watch(now, progress):
                    break
                timing["watch"] += time.monotonic() - now
            self._update()
            if result.updates % cfg.push_every == 0:
                t0 = time.monotonic()
                self._push()
                timing["push"] += time.monotonic() - t0
        return self._finish()

    def _update(self) -> None:
        t0 = time.monotonic()
        batch = self.sampler.sample(self.cfg.batch_size, self.version - self.cfg.max_lag)
        t1 = time.monotonic()
        self._losses.append(self.learner.step(batch))
        self.result.timing["sample"] += t1 - t0
        self.result.timing["learn"] += time.monotonic() - t1
        rows = batch["ingestd", "policy_version"]
        result = self.result
        result.updates += 1
        result.update_version.append(self.version)
        result.update_min_row_version.append(int(rows.min()))
        result.update_max_row_version.append(int(rows.max()))
        result.rows_trained += rows.numel()
        self._versions.append(rows)
        if len(self._versions) >= 256:
            self._count_versions()

    def _push(self) -> None:
        self.qnet.epsilon.fill_(epsilon_at(self.cfg, self.result.updates))
        self.version = self.result.final_version = self.ctl.push_weights(self.qnet, wait=True)
        self.result.pushes += 1

    def _watch(self, now: float, progress: bool) -> bool:
        """Look at the daemon; print a progress line if asked. True: time to stop."""
        cfg, result = self.cfg, self.result
        status = self.ctl.status()
        mean = self.returns.recent_mean(status, cfg.return_window)
        elapsed = now - self.start
        result.returns_seen.append((round(elapsed, 3), result.updates, mean))
        if progress:
            loss = float(torch.stack(self._losses).mean()) if self._losses else float("nan")
            self._losses.clear()
            result.losses.append(loss)
            result.rows_dropped_stale = self.sampler.dropped
            frames = sum(w.frames_per_s for w in status.workers)
            self.log(f"t={elapsed:6.1f}s updates={result.updates:6d} loss={loss:.4f} "
                     f"eps={epsilon_at(cfg, result.updates):.3f} version={self.version} "
                     f"stale-dropped={result.rows_dropped_stale} daemon: {frames:.0f} frames/s, "
                     f"return(last {cfg.return_window})={_shown(mean)}")
        reached = cfg.target_return is not None and mean is not None and mean >= cfg.target_return
        self._held = self._held + 1 if reached else 0
        result.reached_target = self._held >= cfg.target_checks
        return result.reached_target or elapsed >= cfg.seconds

    def _count_versions(self) -> None:
        if self._versions:
            values, counts = torch.unique(torch.cat(self._versions), return_counts=True)
            for v, c in zip(values.tolist(), counts.tolist()):
                self.result.rows_per_version[v] = self.result.rows_per_version.get(v, 0) + c
            self._versions.clear()

    def _finish(self) -> TrainResult:
        result = self.result
        self._count_versions()
        result.rows_dropped_stale = self.sampler.dropped
        result.seconds = round(time.monotonic() - self.start, 3)
        result.timing = {k: round(v, 3) for k, v in result.timing.items()}
        mean = self.returns.recent_mean(self.ctl.status(), self.cfg.return_window)
        self.log(f"done: {result.updates} updates in {result.seconds:.1f}s, {result.pushes} pushes (versions "
                 f"{result.first_version}..{result.final_version}), largest row lag {result.max_row_lag()} "
                 f"(max {self.cfg.max_lag}), daemon return(last {self.cfg.return_window})={_shown(mean)}")
        return result


def _shown(mean: float | None) -> str:
    return "n/a" if mean is None else f"{mean:.1f}"


# -- command line ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None, description: str = "") -> tuple[TrainConfig, str | None]:
    """``TrainConfig`` from the command line (one option per field), and ``--result-json``."""
    p = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            kind = f.metadata["type"] or type(f.default)
            p.add_argument(flag, type=kind, default=f.default, required=f.name == "replay",
                           metavar=f.metadata["metavar"], help=f.metadata["help"])
    p.add_argument("--result-json", metavar="FILE", help="write the TrainResult here as JSON")
    args = vars(p.parse_args(argv))
    result_json = args.pop("result_json")
    return TrainConfig(**args), result_json


def main(argv: list[str] | None = None, learner=DQNLearner, description: str = "") -> int:
    cfg, result_json = parse_args(argv, description)
    try:
        result = train(cfg, log=lambda line: print(line, flush=True), learner=learner)
    except (ingestd.IngestdError, BadArgument) as exc:
        print(f"{Path(sys.argv[0]).name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if result_json:
        Path(result_json).write_text(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
