"""The rate limiter's and the policy lag's metric families, read by the daemon's Prometheus
collector at scrape time."""
from __future__ import annotations

import time

import numpy as np

from ingestd.replay.layout import POLICY_VERSION
from ingestd.replay.limiter import FILE as LIMITER_FILE, Limiter

_LAG_SUBSAMPLE = 4096
SAMPLED_LAG_FRESH_S = 60.0  # an older report of a trainer's sampled lag is not exported
_limiters: dict = {}  # storage path -> (the storage handle, its limiter)


def stored_lag(store, current: int, n: int = _LAG_SUBSAMPLE, rng=None) -> tuple[int, float, int] | None:
    """``(min, mean, max)`` policy lag of the stored rows, from ``n`` committed slots drawn at
    random (a cheap estimate of min and max; exact when the storage holds at most ``n`` rows)."""
    filled = len(store)
    if filled == 0:
        return None
    rng = rng or np.random.default_rng()
    slots = np.arange(filled) if filled <= n else rng.integers(0, filled, n)
    seq = store.seq[slots]
    versions = store._arrays[POLICY_VERSION][slots][(seq > 0) & ((seq & 1) == 0)]
    versions = versions[versions >= 0]  # not the warm-up's rows (-1): no policy's, so no lag
    if versions.size == 0:
        return None
    lag = current - versions
    return int(lag.min()), float(lag.mean()), int(lag.max())


def sampling_metrics(storage, current: int, stats) -> list:
    """The limiter's and the policy lag's metric families."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from ingestd.collect.stats import PauseReason, State

    cached = _limiters.get(storage.path)
    lim = cached[1] if cached is not None and cached[0] is storage else None
    if lim is None and (storage.path / LIMITER_FILE).exists():
        if cached is not None:  # made for a handle on this path closed since
            cached[1].close()
        lim = Limiter(storage.path, inserts=lambda: storage.write_count)
        _limiters[storage.path] = (storage, lim)
    out = []
    stored = GaugeMetricFamily("ingestd_replay_policy_lag_versions", "Policy lag (current weights version minus "
                               "the row's policy_version) of stored rows, from a random subsample of "
                               f"{_LAG_SUBSAMPLE} at scrape time.", labels=["stat"])
    for stat, value in zip(("min", "mean", "max"), stored_lag(storage, current) or (float("nan"),) * 3):
        stored.add_metric([stat], value)  # NaN while the storage is empty
    sampled = GaugeMetricFamily("ingestd_sampled_policy_lag_versions", "Policy lag of the latest batch a "
                                "trainer sampled (readers that know the weights version report it); NaN "
                                f"when no trainer reported within {SAMPLED_LAG_FRESH_S:g} s.",
                                labels=["stat"])
    lag = lim.sampled_lag() if lim is not None else None
    if lag is not None and time.time() - lag[3] > SAMPLED_LAG_FRESH_S:
        lag = None  # kept in limiter.bin across daemon restarts: a trainer gone long ago is not sampling now
    for stat, value in zip(("min", "mean", "max"), lag[:3] if lag else (float("nan"),) * 3):
        sampled.add_metric([stat], value)  # NaN until a reader reported, and once its report is stale
    out += [stored, sampled]
    if lim is None:
        return out
    recs = stats.records
    held = int(((recs["pause_reason"] == PauseReason.LIMITER) & (recs["state"] == State.RUNNING)).sum())
    out += [
        GaugeMetricFamily("ingestd_limiter_enabled", "1 while the rate limiter is enabled.", value=int(lim.enabled)),
        GaugeMetricFamily("ingestd_limiter_error", "Rate limiter error: inserts * samples_per_insert - samples "
                          "(re-anchored on every change); kept within [min_diff, max_diff]. NaN while the "
                          "limiter is disabled.", value=lim.error() if lim.enabled else float("nan")),
        CounterMetricFamily("ingestd_limiter_samples",
                            "Rows sampled by rate-limited readers while the limiter is enabled.", value=lim.samples),
        CounterMetricFamily("ingestd_limiter_reader_blocked_seconds", "Time readers waited on the rate limiter.",
                            value=lim.reader_blocked_s),
        CounterMetricFamily("ingestd_limiter_reader_refusals", "Samples without a timeout that the rate limiter "
                            "refused at once (RateLimited).", value=lim.reader_refusals),
        GaugeMetricFamily("ingestd_limiter_workers_blocked", "Workers the rate limiter is holding back now.",
                          value=held),
    ]
    return out
