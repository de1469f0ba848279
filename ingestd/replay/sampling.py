"""What ``ReplayReader`` adds to uniform sampling: prioritized draws, a policy-lag filter,
the rate limiter, and sequences (:mod:`ingestd.replay.sequences`).

The reader keeps its lock-free hot path (draw slots, copy rows between two reads
of their seqlocks, re-draw the bad ones); :class:`Sampling` only changes how slots
are drawn and which copied rows are accepted:

- ``sampler="prioritized"``: slots come from a descent of the shared sum tree
  (:mod:`ingestd.replay.priority`; drawn and updated by :mod:`ingestd.replay.prioritized`);
  the sample gains ``("ingestd", "index")`` (the slot) and ``("ingestd", "weight")``
  (importance weight ``(N * P(i)) ** -beta``, divided by the batch's largest so weights
  are in ``(0, 1]``);
- ``max_policy_lag=k``: rows whose ``policy_version`` is below the current weights
  version minus ``k`` are rejected and re-drawn (after a few rounds of rejection
  the eligible slots are listed and drawn from directly);
- the rate limiter (:mod:`ingestd.replay.limiter`) may hold ``sample`` back.
"""
from __future__ import annotations

import logging
import math
import os
import time
import weakref
from typing import Callable

import numpy as np
import torch
from tensordict import TensorDict

from ingestd.errors import EmptyReplay, LockBusy, SampleTimeout
from ingestd.replay import prioritized
from ingestd.replay.inputs import rows_count, wait_deadline
from ingestd.replay.layout import POLICY_VERSION
from ingestd.replay.limiter import FILE as LIMITER_FILE, READER_LOCK_WAIT_S, Limiter, RateLimited
from ingestd.replay.priority import PriorityTree
from ingestd.weights.follow import FollowedStore

log = logging.getLogger("ingestd.replay")

SAMPLERS = ("uniform", "prioritized")
_REJECT_ROUNDS = 32  # rounds of re-drawing rejected rows before listing the eligible slots
_MAX_ROUNDS = 256
_OVERSAMPLE_CAP = 1 << 16  # most slots drawn at once to find the recent ones among them
_POLL_S = 0.002


class Sampling:
    """The sampling features of one reader (one per ``ReplayReader``; not shared by threads)."""

    def __init__(self, reader, sampler: str = "uniform", alpha: float = 0.6, beta: float = 0.4,
                 max_policy_lag: int | None = None, weights_path: str | os.PathLike | None = None,
                 weights_version: Callable[[], int] | None = None, rate_limited: bool = True):
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        for name, value in (("alpha", alpha), ("beta", beta)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        if weights_version is not None and not callable(weights_version):
            raise TypeError(f"weights_version must be a callable that returns the current version (lambda: "
                            f"store.version), got {weights_version!r}")
        if not 0 <= alpha < math.inf or not 0 <= beta < math.inf:
            raise ValueError(f"alpha and beta must be finite and >= 0, got alpha={alpha}, beta={beta}")
        if max_policy_lag is not None:
            if isinstance(max_policy_lag, bool) or not isinstance(max_policy_lag, (int, np.integer)):
                raise TypeError(f"max_policy_lag must be a whole number of versions or None, got "
                                f"{max_policy_lag!r} ({type(max_policy_lag).__name__})")
            if max_policy_lag < 0:
                raise ValueError(f"max_policy_lag must be >= 0 or None, got {max_policy_lag}")
            max_policy_lag = int(max_policy_lag)
        # a proxy: a reference back would make a cycle, and a reader dropped without close() kept its
        # descriptors and mappings until the cycle collector ran (exhaustion review)
        self.reader = weakref.proxy(reader)
        self.sampler, self.alpha, self.beta = sampler, float(alpha), float(beta)
        self.max_policy_lag = max_policy_lag
        self._store = None
        if weights_version is None and weights_path is not None:
            self._store = FollowedStore(weights_path)
            weights_version = self._store.version
        if max_policy_lag is not None and weights_version is None:
            raise ValueError("max_policy_lag needs the current weights version: pass weights_path= (the "
                             "daemon's <runtime_dir>/weights) or weights_version=callable")
        self.weights_version = weights_version
        self.tree = PriorityTree.attach(reader.path, reader.capacity, reader.seq) if sampler == "prioritized" \
            else None
        self.limiter = _attach_limiter(reader) if rate_limited else None
        self._sequences = None
        layout = reader._layout
        self._version_at = layout.fields.get(POLICY_VERSION)  # byte offset of the stamp in a record
        self._record_bytes = layout.record_bytes
        self.last_lag: tuple[int, float, int] | None = None  # (min, mean, max) of the last sample
        self._min_version: int | None = None
        self._churned = False  # the last attempt gave up re-drawing rows that kept changing
        self._eligible_cache: tuple[int | None, int, np.ndarray] | None = None  # (min_version, write_count, slots)

    @property
    def active(self) -> bool:
        """Whether ``sample`` must go through here (else the reader's plain uniform path)."""
        return (self.tree is not None or self.weights_version is not None
                or (self.limiter is not None and self.limiter.enabled))

    # -- the public operations ---------------------------------------------------------------
    def sample(self, n: int, timeout: float | None, into: tuple | None = None) -> TensorDict:
        """``n`` rows: a new TensorDict, or copied into ``into`` = ``(batch, blocks, columns)`` of
        the reader's ``empty_batch``."""
        return self._blocking(lambda: self._sample(n, into), n, timeout)

    def sample_sequences(self, batch: int, length: int, cross_episodes: bool, timeout: float | None) -> TensorDict:
        batch, length = rows_count(batch, "batch_size"), rows_count(length, "length")
        if not isinstance(cross_episodes, (bool, np.bool_)):  # sample(256, 5.0) is a timeout; this was crossing
            raise TypeError(f"cross_episodes must be True or False, got {cross_episodes!r}; pass a wait as "
                            "timeout=")
        if length > self.reader.capacity:
            raise ValueError(f"length {length} is more steps than the storage's capacity {self.reader.capacity} "
                             "holds; sample shorter sequences")
        self.reader.check_memory(batch * length, f"sample_sequences({batch}, {length})")
        if self._sequences is None:
            from ingestd.replay.sequences import SequenceSampler

            self._sequences = SequenceSampler(self.reader)

        def attempt():
            out = self._sequences.sample(batch, length, cross_episodes, self._refresh_min_version())
            if out is not None:
                self._note_lag(out)
            return out
        unit = "trajectory" if cross_episodes else "episode (episodes may be shorter: sample shorter " \
            "sequences, or pass cross_episodes=True)"
        return self._blocking(attempt, batch * length, timeout, f"no {length} consecutive steps of one {unit}")

    def _blocking(self, attempt: Callable[[], TensorDict | None], n: int, timeout: float | None,
                  none_found: str | None = None) -> TensorDict:
        """Run ``attempt`` once the limiter allows, until it returns rows or the deadline passes
        (``none_found``: why, when there are rows but ``attempt`` found none that qualify)."""
        deadline = wait_deadline(timeout)
        waited_from = None
        while True:
            self.reader.check_attached()  # before every attempt: a storage that left would never fill
            why, taken = self._take(n, deadline)
            if why is None:
                try:
                    out = attempt()
                except BaseException:
                    if self.limiter is not None:
                        self.limiter.give_back(taken)
                    raise
                if out is not None:
                    if waited_from is not None:
                        self.limiter.add_reader_blocked(time.monotonic() - waited_from)
                    return out
                if self.limiter is not None:
                    self.limiter.give_back(taken)
                why = self._empty_reason(none_found)
            elif waited_from is None:
                waited_from = time.monotonic()
            if deadline is None:
                if self.limiter is not None and waited_from is not None:
                    self.limiter.add_reader_refused()
                    raise RateLimited(f"replay {self.reader.path}: {why}; pass timeout= to wait")
                raise EmptyReplay(f"replay {self.reader.path}: {why}; wait for the workers, or pass timeout= "
                                  "to block")
            if time.monotonic() >= deadline:
                if waited_from is not None:
                    self.limiter.add_reader_blocked(time.monotonic() - waited_from)
                raise SampleTimeout(f"replay {self.reader.path}: {why} (waited {timeout} s)")
            time.sleep(_POLL_S)

    def _take(self, n: int, deadline: float | None) -> tuple[str | None, int]:
        """The limiter's ``take_samples``, waiting for ``limiter.bin`` until the deadline at most
        (another trainer stopped inside a call holds it: a sample with a timeout waited for ever).
        Without a deadline, ``LockBusy`` after ``READER_LOCK_WAIT_S``; with one, the lock is a
        reason to wait, as a refusal is."""
        if self.limiter is None:
            return None, 0
        wait = READER_LOCK_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return self.limiter.take_samples(n, len(self.reader), timeout=wait)
        except LockBusy as exc:
            if deadline is None:
                raise
            return str(exc), 0

    def _refresh_min_version(self) -> int | None:
        """The oldest ``policy_version`` ``max_policy_lag`` accepts now (None: no lag limit); kept
        for the error message of an attempt that found no rows."""
        self._min_version = None if self.max_policy_lag is None else self.weights_version() - self.max_policy_lag
        return self._min_version

    def _empty_reason(self, none_found: str | None) -> str:
        churned, self._churned = self._churned, False
        if len(self.reader) == 0:
            return "no committed rows yet"
        if churned:
            return (f"the drawn rows kept changing under {_MAX_ROUNDS} rounds of re-draws (writers overwriting "
                    "them as they were copied, or, for prioritized draws, priorities updated as fast as the tree "
                    "was read); sample again, or smaller batches")
        if self.sampler == "prioritized" and self.tree.total <= 0:
            return "every priority is 0"
        if self._min_version is not None:
            lag = f"rows with policy_version >= {self._min_version} (max_policy_lag {self.max_policy_lag})"
            held = self.limiter.insert_blocked() if self.limiter is not None else None
            held = f"; the rate limiter holds the workers back ({held}): each writes one chunk per new " \
                   "weights version all the same" if held else (
                "; such rows come only from collecting workers, a chunk after they apply the version: paused, "
                "failed or stopped ones write none (`ingestctl status`)")  # (walkthrough review: said no why)
            return (f"no {lag}" if none_found is None else f"{none_found}, among {lag}") + held
        return none_found or "no committed rows could be copied"

    def reset_max_priority(self, priority: float | None = None) -> float:
        """New rows enter at ``priority`` from now on (None: at the largest the rows hold now);
        returns that leaf, ``(priority + eps) ** alpha``."""
        if self.tree is None:
            raise RuntimeError("reset_max_priority needs ReplayReader(..., sampler='prioritized')")
        return self.tree.reset_max(None if priority is None else prioritized.max_leaf(priority, self.alpha))

    def set_beta(self, value: float) -> None:
        """``ReplayReader.beta = value``: a finite number >= 0, for a prioritized reader only."""
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not 0 <= value < math.inf:
            raise ValueError(f"beta must be a finite number >= 0, got {value!r}")
        if self.tree is None:  # taken in silence, then a pickled copy was refused (a DataLoader worker)
            raise ValueError("beta shapes prioritized sampling, but this reader samples uniformly "
                             "(ReplayReader(..., sampler='prioritized'))")
        self.beta = float(value)

    def update_priorities(self, index, priority, write_index=None, timeout: float | None = None) -> int:
        """Set the priorities of sampled rows (:func:`ingestd.replay.prioritized.update`)."""
        if timeout is not None:
            wait_deadline(timeout)  # (checked as a sample's timeout, before the sampler's kind)
        if self.tree is None:
            raise RuntimeError("update_priorities needs ReplayReader(..., sampler='prioritized')")
        r = self.reader
        return prioritized.update(self.tree, r.seq, r.capacity, self.alpha, index, priority, write_index, timeout)

    # -- drawing and accepting rows -------------------------------------------------------------
    def _sample(self, n: int, into: tuple | None = None) -> TensorDict | None:
        r = self.reader
        filled = len(r)
        if filled == 0:
            return None
        min_version = self._refresh_min_version()
        if self.tree is None and min_version is None:
            out = r._sample(n, into)
            if out is not None:
                self._note_lag(out)
            return out
        draw = self._draw_prioritized if self.tree is not None else (lambda m: r._draw(m, filled))
        got = self._gather(n, draw, filled, None if into is None else into[2])
        if got is None:
            return None
        records, columns, slots, leaves = got
        out = r._finish(records, columns, n, self._priority_keys(slots, leaves) if self.tree is not None else None,
                        into)
        self._note_lag(out)
        return out

    def _gather(self, n: int, draw: Callable[[int], np.ndarray | None], filled: int, into: list | None = None):
        """Copy ``n`` rows drawn by ``draw`` (their large leaves into the tensors ``into``, if
        given), re-drawing those that were not committed, changed, or are too old;
        ``(records, columns, slots, leaves)`` or ``None`` when no row qualifies. ``leaves``
        (prioritized) are the drawn slots' leaves read before the copy: a writer reserving a
        slot later zeroes its leaf, but marks the slot odd first, so a leaf read as 0 here
        belongs to a row the copy rejects."""
        r = self.reader
        slots = draw(n)
        if slots is None:
            return None
        leaves = None if self.tree is None else self.tree.levels[0][slots]
        records, columns, bad = r._copy(slots, into)
        bad = self._rejected(records, bad, n, leaves)
        accept = 1.0 - (0 if bad is None else bad.size) / n  # the share of draws kept: how many more to draw
        rounds = 0
        while bad is not None:
            rounds += 1
            if rounds > _MAX_ROUNDS:
                self._churned = True  # (_empty_reason): there were rows, they kept changing
                return None
            if rounds == _REJECT_ROUNDS:
                draw = self._eligible_draw(filled)
                if draw is None:
                    return None
            fresh = self._candidates(draw, bad.size, accept)
            if fresh is None:
                return None
            fresh_leaves = None if leaves is None else self.tree.levels[0][fresh]
            sub_records, sub_columns, sub_bad = r._copy(fresh)
            records[bad] = sub_records
            slots[bad] = fresh
            if leaves is not None:
                leaves[bad] = fresh_leaves
            tbad = torch.from_numpy(bad)
            for column, sub in zip(columns, sub_columns):
                column[tbad] = sub
            still = self._rejected(sub_records, sub_bad, bad.size, fresh_leaves)
            bad = None if still is None else bad[still]
        return records, columns, slots, leaves

    def _candidates(self, draw: Callable[[int], np.ndarray | None], k: int, accept: float) -> np.ndarray | None:
        """``k`` slots to copy in place of rejected rows. With the lag filter on, about
        ``k / accept`` are drawn and those whose stamp is already too old are left out before
        anything is copied: rejection sampling still (each kept slot is a draw of the sampler
        restricted to recent rows), but in a round or two instead of a round per halving when
        most rows are old (16 rounds per batch with 28 % eligible). The copy checks again."""
        if self._min_version is None or self._version_at is None:  # (no stamp: _rejected filters nothing)
            return draw(k)
        m = min(_OVERSAMPLE_CAP, int(k / max(accept, 1 / _OVERSAMPLE_CAP) * 1.25) + 8)
        slots = draw(max(k, m))
        if slots is None:
            return None
        recent = self.reader._arrays[POLICY_VERSION][slots] >= self._min_version
        kept = slots[recent][:k]
        if kept.size < k:  # too few: some old ones, rejected after the copy and drawn again
            kept = np.concatenate((kept, slots[~recent][:k - kept.size]))
        return kept

    def _rejected(self, records: np.ndarray, bad: np.ndarray | None, n: int,
                  leaves: np.ndarray | None = None) -> np.ndarray | None:
        """Positions to re-draw: the seqlock's ``bad``, rows whose leaf was read as 0 (a writer
        had reserved the slot: the row copied may be its new one, not yet entered), and rows
        older than the lag allows."""
        if leaves is not None and not leaves.all():
            zero = np.flatnonzero(leaves == 0)
            bad = zero if bad is None else np.union1d(bad, zero)
        if self._min_version is None or self._version_at is None:
            return bad
        versions = np.ndarray((n,), np.int64, records, self._version_at, (self._record_bytes,))
        old = np.flatnonzero(versions < self._min_version)
        if old.size == 0:
            return bad
        return old if bad is None else np.union1d(bad, old)

    def _eligible_draw(self, filled: int) -> Callable[[int], np.ndarray] | None:
        """A draw among the eligible slots only (uniform, or by priority for a prioritized
        reader); None if there are none."""
        r = self.reader
        eligible = self._eligible(filled)
        if self.tree is None:
            return (lambda m: eligible[r._draw(m, eligible.size)]) if eligible.size else None
        leaves = self.tree.levels[0][eligible]
        eligible, leaves = eligible[leaves > 0], leaves[leaves > 0]
        if eligible.size == 0:
            return None
        cumulative = np.cumsum(leaves)
        last = eligible.size - 1
        return lambda m: eligible[np.minimum(np.searchsorted(
            cumulative, r._rng.random(m) * cumulative[-1], side="right"), last)]

    def _eligible(self, filled: int) -> np.ndarray:
        """Slots whose row is recent enough (the fallback when most are not), sorted.

        One scan of the whole storage per ``min_version``; after it, each call looks only at
        the slots written since (rows being written then are kept as candidates: the copy
        checks every drawn row anyway), so a trainer whose eligible rows are rare right after
        a push does not rescan a million slots per batch."""
        r = self.reader
        written = r.write_count
        cached = self._eligible_cache
        if cached is None or cached[0] != self._min_version or written - cached[1] >= r.capacity:
            seq = r.seq[:filled]
            ok = (seq > 0) & ((seq & 1) == 0)
            if self._min_version is not None:
                ok &= r._arrays[POLICY_VERSION][:filled] >= self._min_version
            eligible = np.flatnonzero(ok)
        else:
            eligible = cached[2]
            if written > cached[1]:
                fresh = np.arange(cached[1], written) % r.capacity
                if self._min_version is not None:
                    seq = r.seq[fresh]
                    fresh = fresh[(seq == 0) | ((seq & 1) == 1)
                                  | (r._arrays[POLICY_VERSION][fresh] >= self._min_version)]
                eligible = np.union1d(eligible, fresh)
        self._eligible_cache = (self._min_version, written, eligible)
        return eligible

    def _draw_prioritized(self, m: int) -> np.ndarray | None:
        return prioritized.draw(self.tree, self.reader._rng, m)

    def extra_keys(self, n: int) -> dict:
        """Empty ``[n]`` leaves of the keys this sampler adds to the storage's (for ``empty_batch``)."""
        return {} if self.tree is None else prioritized.empty_keys(n)

    def _priority_keys(self, slots: np.ndarray, leaves: np.ndarray) -> dict:
        return prioritized.sample_keys(slots, leaves, self.beta)

    def _note_lag(self, out: TensorDict) -> None:
        if self.weights_version is None:
            return
        versions = out.get(POLICY_VERSION, None)
        if versions is None or versions.numel() == 0:
            return
        lag = self.weights_version() - versions
        self.last_lag = (int(lag.min()), float(lag.double().mean()), int(lag.max()))
        if self.limiter is not None:
            self.limiter.record_sampled_lag(*self.last_lag)

    def close(self) -> None:
        for thing in (self.tree, self.limiter, self._store):
            if thing is not None:
                thing.close()
        self.tree = self.limiter = self._store = None
        self._sequences = None  # its views keep data.bin mapped


def _attach_limiter(reader) -> Limiter | None:
    """The storage's limiter (made by the storage when opened for writing), if there is one."""
    if not (reader.path / LIMITER_FILE).exists():
        return None
    try:
        ref = weakref.ref(reader)  # (no cycle through the limiter either)
        return Limiter(reader.path, inserts=lambda: ref().write_count)
    except PermissionError:  # no write access: this reader cannot take part in rate limiting; said
        # once, as a limiter the daemon enforces would otherwise be bypassed without a word
        log.warning("cannot open %s for writing: this reader's samples are not rate-limited nor counted; add "
                    "the trainer's user to the daemon's group (docs/systemd.md) to take part in rate limiting",
                    reader.path / LIMITER_FILE)
        return None
