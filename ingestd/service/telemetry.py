"""In-process counters the daemon's threads update and the metrics collector reads.

Kept free of prometheus_client so the control plane does not depend on it;
``ingestd.metrics`` turns these into metric families at scrape time.
"""
from __future__ import annotations

import threading
from collections import Counter

INVALID_CMD = "invalid"  # the cmd label of a request whose command is not known (bounded cardinality)

# Upper bounds (seconds) of the weight-push latency histogram buckets.
PUSH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Telemetry:
    """Thread-safe counters: control requests by (cmd, outcome), and push latencies."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._push_buckets = [0] * len(PUSH_BUCKETS)
        self._push_count = 0
        self._push_sum = 0.0
        self._auth_refusals: Counter[str] = Counter()
        # the config reloads (SIGHUP and the reload command): whether the last one applied, when the last
        # good one was (the start counts as one), and the changed keys that wait for a restart
        self._reload: tuple[bool, float, tuple[str, ...]] = (True, 0.0, ())

    def observe_request(self, cmd: str, outcome: str) -> None:
        """``outcome`` is ``ok`` or the stable error code of the reply."""
        with self._lock:
            self._requests[(cmd, outcome)] += 1

    def observe_push(self, seconds: float) -> None:
        with self._lock:
            self._push_count += 1
            self._push_sum += seconds
            for i, bound in enumerate(PUSH_BUCKETS):
                if seconds <= bound:
                    self._push_buckets[i] += 1

    def observe_auth_refusal(self, reason: str) -> None:
        """A CURVE refusal: ``unknown_key`` (a handshake) or ``revoked`` (a request dropped)."""
        with self._lock:
            self._auth_refusals[reason] += 1

    def observe_reload(self, ok: bool, at: float, restart_pending: tuple[str, ...] | None = None) -> None:
        """A reload at Unix time ``at``: applied (``ok``; ``restart_pending`` the keys it could not
        change live) or refused (the running config and its pending keys stay)."""
        with self._lock:
            _, last_ok_at, pending = self._reload
            self._reload = (True, at, tuple(restart_pending or ())) if ok else (False, last_ok_at, pending)

    def reloads(self) -> tuple[bool, float, tuple[str, ...]]:
        """``(last reload applied, Unix time of the last applied one, keys waiting for a restart)``."""
        with self._lock:
            return self._reload

    def auth_refusals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._auth_refusals)

    def requests(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._requests)

    def pushes(self) -> tuple[list[tuple[float, int]], int, float]:
        """Cumulative buckets ``[(le, count)]`` (without +Inf), the count and the sum."""
        with self._lock:
            return list(zip(PUSH_BUCKETS, self._push_buckets)), self._push_count, self._push_sum
