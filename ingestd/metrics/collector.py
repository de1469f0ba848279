"""The scrape-time collector: shared stats blocks, replay header, weight store.

Nothing is pushed to the daemon per frame. At each scrape the collector
copies the live worker records out of the shared stats block (one numpy
fancy-index copy, at most ``MAX_WORKERS`` records), reads the replay header's
``write_count`` and the weight store's version, and turns them into metric
families. The only state it keeps is the episode-return histogram, fed from
each worker's returns ring since the previous scrape.
"""
from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ingestd.collect.stats import PAUSES, RING, WAITS, State, StatsBlock, heartbeat_age, shown_reason
from ingestd.control.protocol import ErrorCode
from ingestd.service.telemetry import INVALID_CMD, Telemetry

log = logging.getLogger("ingestd.metrics")

# Upper bounds of the default episode-return buckets (metrics.episode_return_buckets = []):
# symmetric, 10 per decade (the R10 preferred numbers) from 1 to 100000, so that CartPole
# (0..500), Atari-scale scores and negative-reward tasks all land in buckets 25 % wide. With
# 1-2-5 per decade, CartPole returns of 8-11 read p10 5.7, p50 8.3 and p90 16 (metrics review).
_R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
_POSITIVE = tuple(round(m * 10.0 ** e, 2) for e in range(5) for m in _R10) + (100000.0,)
RETURN_BUCKETS: tuple[float, ...] = tuple(-b for b in reversed(_POSITIVE)) + (0.0,) + _POSITIVE

# States exported by the one-hot gauge (an EMPTY record is not a worker).
STATES = tuple(s for s in State if s != State.EMPTY)
_ALIVE_STATES = {int(State.STARTING), int(State.RUNNING), int(State.PAUSED), int(State.STOPPING)}


# Per-worker families: (key, type, name, help). Counter names get ``_total`` from prometheus_client.
WORKER_METRICS = (
    ("frames", CounterMetricFamily, "ingestd_frames", "Transitions (env steps x sub-envs) written by the worker."),
    ("episodes", CounterMetricFamily, "ingestd_episodes", "Episodes finished by the worker."),
    ("up", GaugeMetricFamily, "ingestd_worker_up", "1 if the worker process is alive, else 0."),
    ("heartbeat", GaugeMetricFamily, "ingestd_worker_heartbeat_age_seconds", "Seconds since the worker's last "
     "heartbeat (NaN while it has no live process: stopped, failed, not started yet)."),
    ("version", GaugeMetricFamily, "ingestd_worker_weights_version",
     "Weights version the running or paused worker has applied (NaN while it has none: starting, restarting, "
     "failed)."),
    ("lag", GaugeMetricFamily, "ingestd_policy_lag_versions", "Current weights version minus the running or "
     "paused worker's applied version (0 when the policy has no weights; NaN while the worker applied none)."),
    ("mean", GaugeMetricFamily, "ingestd_worker_episode_return_mean",
     f"Mean return of the worker's last {RING} finished episodes (absent before the first one)."),
    ("limiter_s", CounterMetricFamily, "ingestd_limiter_blocked_seconds",
     "Time the worker spent held back by the rate limiter."),
    ("limiter_n", CounterMetricFamily, "ingestd_limiter_waits", "Times the rate limiter held the worker back."),
)


@dataclass(frozen=True)
class BuildInfo:
    version: str
    python: str
    torch: str

    @classmethod
    def current(cls) -> "BuildInfo":
        import platform

        import ingestd

        try:
            import torch
            torch_version = torch.__version__
        except ImportError:  # pragma: no cover - torch is a hard dependency of the daemon
            torch_version = "none"
        return cls(ingestd.__version__, platform.python_version(), str(torch_version))


def child_alive(pid: int, parent: int) -> bool:
    """True if ``pid`` is a live (non-zombie) child of ``parent`` (guards against PID reuse)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in (b"Z", b"X") and int(fields[1]) == parent


def known_outcomes(commands: Sequence[str]) -> list[tuple[str, str]]:
    """Every (cmd, outcome) ``ingestd_control_requests_total`` can count: a counter series that
    first appears at 1 has no earlier sample, so ``rate()`` and ``increase()`` never saw its
    first error (metrics review: a one-off rejected push or failed reload stayed invisible).
    Each command with ``ok`` and every error code, and an unparsed request (``invalid``) with
    every error code: len(commands) x 17 + 16 series of 0 (220 for the 12 commands), known in
    advance, as the Prometheus client guidelines ask of labels."""
    codes = [code.value for code in ErrorCode]
    return [(cmd, outcome) for cmd in commands for outcome in ("ok", *codes)] + [(INVALID_CMD, c) for c in codes]


class ReturnHistogram:
    """A cumulative histogram of episode returns, fed from per-worker rings by a cursor."""

    def __init__(self, buckets: Sequence[float] = RETURN_BUCKETS):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError("episode-return buckets must be strictly increasing")
        self.bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is (max bound, +Inf)
        self.dropped = 0
        self._cursor: dict[int, int] = {}
        self._lock = threading.Lock()

    def feed(self, worker: int, count: int, ring: np.ndarray) -> None:
        """Observe the returns finished since this worker's last ``count`` (the ring holds the last RING)."""
        with self._lock:
            seen = self._cursor.get(worker, 0)
            if count <= seen:  # nothing new, or an overlapping scrape already fed a newer snapshot
                return  # (returns_count never goes back: StatsBlock.reset keeps it)
            fresh = count - seen
            take = min(fresh, len(ring))
            self.dropped += fresh - take
            for k in range(count - take, count):
                value = float(ring[k % len(ring)])
                if np.isfinite(value):
                    self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._cursor[worker] = count

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        with self._lock:
            counts = list(self._counts)
        cumulative = np.cumsum(counts).tolist()
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)]
        buckets.append(("+Inf", cumulative[-1]))
        # No _sum (nor _count) whatever the bounds: returns can be negative under buckets that are
        # not (metrics.episode_return_buckets = [0, 100]), and a sum that decreases is no counter
        # (OpenMetrics; rate() would take it for a reset). The count is the +Inf bucket.
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=None)


class IngestdCollector(Collector):
    """Reads ingestd's shared state at scrape time. Every source comes in as an argument.

    ``commands`` are pre-initialised at 0 with every outcome (``known_outcomes``), so that dashboards
    show zeros, not gaps, and the first error of a kind shows in a ``rate()``.
    """

    def __init__(self, stats: StatsBlock, storage, weights, telemetry: Telemetry, started_at: float,
                 desired_workers: Callable[[], int] = lambda: 0, build: BuildInfo | None = None,
                 clock: Callable[[], float] = time.monotonic, parent_pid: int | None = None,
                 return_buckets: Sequence[float] = RETURN_BUCKETS, commands: Iterable[str] = ()):
        self.stats, self.storage, self.weights, self.telemetry = stats, storage, weights, telemetry
        self.started_at, self.desired_workers = started_at, desired_workers
        self.build = build or BuildInfo.current()
        self.clock = clock
        self.parent_pid = os.getpid() if parent_pid is None else parent_pid
        self.returns = ReturnHistogram(return_buckets)
        self.commands = tuple(commands)
        self._known_outcomes = known_outcomes(self.commands)
        self._errors: dict[str, int] = {}

    # -- the scrape -----------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        families: list[Metric] = []
        for section, build in (("workers", self._workers), ("replay", self._replay), ("sampling", self._sampling),
                               ("control", self._control), ("service", self._service)):
            try:
                families.extend(build())
            except Exception:  # one broken source must not blank the whole scrape
                self._errors[section] = self._errors.get(section, 0) + 1
                log.exception("metrics: reading %s failed", section)
        errors = CounterMetricFamily("ingestd_scrape_errors", "Scrapes in which reading a section of the "
                                     "shared state failed (see the daemon log).", labels=["section"])
        for section in ("workers", "replay", "sampling", "control", "service"):
            errors.add_metric([section], self._errors.get(section, 0))
        families.append(errors)
        families.append(GaugeMetricFamily("ingestd_scrape_duration_seconds",
                                          "Time this scrape took to read the shared state.",
                                          value=time.perf_counter() - t0))
        yield from families

    def _snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(indices, records, whether each record's returns ring is whole) of every non-empty
        worker slot, copied out of shared memory (``StatsBlock.snapshot``)."""
        records = self.stats.records
        indices = np.flatnonzero(records["state"] != int(State.EMPTY))
        recs, whole = self.stats.snapshot(indices)  # copies: later reads are self-consistent
        return indices, recs, whole

    def _workers(self) -> list[Metric]:
        indices, recs, whole = self._snapshot()
        current = self._weights_version()
        now = self.clock()
        families = {key: kind(name, doc, labels=["worker"]) for key, kind, name, doc in WORKER_METRICS}
        state = GaugeMetricFamily("ingestd_worker_state", "1 for the worker's current state, 0 for the others.",
                                  labels=["worker", "state"])
        restarts = CounterMetricFamily("ingestd_worker_restarts", "Times the supervisor restarted the worker: "
                                       "reason failure (a crash, a missed heartbeat or a failed start) or "
                                       "requested (a restart command).", labels=["worker", "reason"])
        paused = GaugeMetricFamily("ingestd_worker_paused", "1 for why the worker is paused (requested: a pause "
                                   "command; budget: workers.total_frames reached), 0 for the other reasons.",
                                   labels=["worker", "reason"])
        waiting = GaugeMetricFamily("ingestd_worker_waiting", "1 for why a running worker collects nothing "
                                    "(limiter: held back by the rate limiter; priority_lock: its commit waits "
                                    "over 0.5 s for a trainer's priority.lock), 0 for the other reasons.",
                                    labels=["worker", "reason"])
        for index, rec, ring_whole in zip(indices.tolist(), recs, whole.tolist()):
            w = [str(index)]
            for key, value in self._worker_values(rec, current, now, ring_whole).items():
                families[key].add_metric(w, value)
            restarts.add_metric(w + ["failure"], int(rec["failure_restarts"]))
            restarts.add_metric(w + ["requested"], int(rec["requested_restarts"]))
            for s in STATES:
                state.add_metric(w + [s.label], 1 if int(rec["state"]) == s else 0)
            shown = shown_reason(int(rec["state"]), int(rec["pause_reason"]))
            for family, reasons in ((paused, PAUSES), (waiting, WAITS)):
                for r in reasons:
                    family.add_metric(w + [r.label], 1 if shown == r else 0)
            if ring_whole:  # else the next scrape feeds them: the cursor stays where it was
                self.returns.feed(index, int(rec["returns_count"]), rec["returns"])
        return [*families.values(), restarts, state, paused, waiting,
                GaugeMetricFamily("ingestd_workers_desired", "Workers the daemon is configured to run.",
                                  value=int(self.desired_workers())),
                GaugeMetricFamily("ingestd_weights_version", "Version of the newest weights in the weight store "
                                  "(0: the policy has no weights).", value=current),
                self.returns.family("ingestd_episode_return", "Returns of finished episodes, sampled from "
                                    f"each worker's ring of the last {RING} at scrape time."),
                CounterMetricFamily("ingestd_episode_returns_dropped", "Finished episodes whose return was "
                                    "overwritten in the ring before a scrape could read it.",
                                    value=self.returns.dropped)]

    def _worker_values(self, rec: np.void, current: int, now: float, ring_whole: bool) -> dict[str, float]:
        """One worker's values, keyed as in ``WORKER_METRICS`` (``mean`` only once an episode finished,
        and with ``ring_whole``: the record's returns ring was not copied mid-write)."""
        applied = int(rec["weights_version"])
        alive = int(rec["state"]) in _ALIVE_STATES and child_alive(int(rec["pid"]), self.parent_pid)
        age = heartbeat_age(rec, now)  # None as in status; NaN, not an age that grows for ever
        # a version only for a worker that collects with one: a restarting worker read 0 and its lag
        # the whole store's version (a spike past every threshold at each restart)
        acting = int(rec["state"]) in (State.RUNNING, State.PAUSED) and (applied > 0 or current == 0)
        values = {
            "frames": int(rec["frames"]), "episodes": int(rec["episodes"]),
            "up": 1 if alive else 0, "heartbeat": math.nan if age is None else age,
            "version": applied if acting else math.nan,
            "lag": (max(0, current - applied) if current > 0 else 0) if acting else math.nan,
            "limiter_s": float(rec["limiter_blocked_s"]), "limiter_n": int(rec["limiter_waits"]),
        }
        recent = rec["returns"][:min(int(rec["returns_count"]), RING)]
        recent = recent[np.isfinite(recent)]
        if recent.size and ring_whole:  # (a torn ring: no mean this scrape rather than a mixed one)
            values["mean"] = float(recent.mean())
        return values

    def _weights_version(self) -> int:
        return int(self.weights.version) if self.weights is not None else 0

    def _replay(self) -> list[Metric]:
        writes, capacity = int(self.storage.write_count), int(self.storage.capacity)
        return [GaugeMetricFamily("ingestd_replay_rows", "Rows currently held by the replay storage.",
                                  value=min(writes, capacity)),
                GaugeMetricFamily("ingestd_replay_capacity_rows", "Rows the replay storage can hold.",
                                  value=capacity),
                CounterMetricFamily("ingestd_replay_writes", "Rows ever written to the replay storage "
                                    "(persists across daemon restarts).", value=writes)]

    def _sampling(self) -> list[Metric]:
        """Rate limiter and policy-lag families (ingestd.replay.lag_metrics.sampling_metrics)."""
        from ingestd.replay.lag_metrics import sampling_metrics

        return sampling_metrics(self.storage, self._weights_version(), self.stats)

    def _control(self) -> list[Metric]:
        requests = CounterMetricFamily("ingestd_control_requests", "Control requests answered, by command "
                                       "and outcome (ok or the error code).", labels=["cmd", "outcome"])
        seen = self.telemetry.requests()
        for key in self._known_outcomes:
            seen.setdefault(key, 0)
        for (cmd, outcome), n in sorted(seen.items()):
            requests.add_metric([cmd, outcome], n)
        buckets, count, total = self.telemetry.pushes()
        push = HistogramMetricFamily(
            "ingestd_weight_push_seconds", "Time from receiving a weight push to its reply.",
            buckets=[(floatToGoString(le), n) for le, n in buckets] + [("+Inf", count)], sum_value=total)
        refusals = CounterMetricFamily("ingestd_control_auth_refusals", "CURVE refusals on the tcp:// control "
                                       "and event sockets: handshakes with an unknown key (unknown_key), requests "
                                       "on a connection whose key was revoked since (revoked).", labels=["reason"])
        refused = self.telemetry.auth_refusals()
        for reason in ("unknown_key", "revoked"):
            refusals.add_metric([reason], refused.get(reason, 0))
        return [requests, push, refusals]

    def _service(self) -> list[Metric]:
        info = GaugeMetricFamily("ingestd_build_info", "Always 1; the labels name the versions running.",
                                 labels=["version", "python", "torch"])
        info.add_metric([self.build.version, self.build.python, self.build.torch], 1)
        ok, ok_at, pending = self.telemetry.reloads()
        return [info,
                GaugeMetricFamily("ingestd_up", "1 while the daemon answers scrapes.", value=1),
                GaugeMetricFamily("ingestd_start_time_seconds", "Unix time the daemon started.",
                                  value=self.started_at),
                GaugeMetricFamily("ingestd_config_last_reload_successful", "1 if the last config reload (SIGHUP or "
                                  "the reload command) was applied, 0 if the file was refused: the running config "
                                  "stays, and the next start would fail on that file.", value=int(ok)),
                GaugeMetricFamily("ingestd_config_last_reload_success_timestamp_seconds", "Unix time of the last "
                                  "applied config reload (the start, if none since).", value=ok_at),
                GaugeMetricFamily("ingestd_config_restart_pending_keys", "Config keys the file changed that apply only "
                                  "at the next restart (the last reload applied the rest; its log line names them).",
                                  value=len(pending))]
