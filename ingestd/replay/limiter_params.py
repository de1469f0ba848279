"""The rate limiter's parameters and their checks, torch- and numpy-free: the config loader
checks a ``[limiter]`` section with them before anything heavy is imported."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LimiterParams:
    enabled: bool = False
    min_size: int = 0
    samples_per_insert: float = 1.0
    min_diff: float = -1e6
    max_diff: float = 1e6


def params_of(config) -> LimiterParams:
    """The parameters of a ``[limiter]`` config section (or anything with those attributes)."""
    return LimiterParams(bool(config.enabled), int(config.min_size), float(config.samples_per_insert),
                         float(config.min_diff), float(config.max_diff))


def check_window(p: LimiterParams) -> None:
    """Raise ``ValueError`` for parameters that cannot work (names the bad one)."""
    if p.min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {p.min_size}")
    if not (math.isfinite(p.samples_per_insert) and p.samples_per_insert > 0):
        raise ValueError(f"samples_per_insert must be a finite number > 0, got {p.samples_per_insert}")
    if not (math.isfinite(p.min_diff) and math.isfinite(p.max_diff)):
        raise ValueError("min_diff and max_diff must be finite")
    need = 2 * max(1.0, p.samples_per_insert)
    if p.max_diff - p.min_diff < need:
        raise ValueError(f"the window max_diff - min_diff = {p.max_diff - p.min_diff:g} is narrower than "
                         f"2 * max(1, samples_per_insert) = {need:g}; widen it")
