"""Prioritized sampling's own steps, for :class:`ingestd.replay.sampling.Sampling`: the
stratified draw from the shared sum tree (:mod:`ingestd.replay.priority`), the keys a
prioritized sample gains (the slot and its importance weight) and the trainer's priority
updates, each checked with a message that says what to pass instead.

A leaf of the tree is ``(priority + PRIORITY_EPS) ** alpha``, capped at :data:`LEAF_MAX`.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tensordict import TensorDictBase

from ingestd.replay.inputs import slot_indices
from ingestd.replay.priority import PriorityTree

INDEX, WEIGHT = ("ingestd", "index"), ("ingestd", "weight")
PRIORITY_EPS = 1e-6
LEAF_MAX = 1e290  # a leaf's cap: the tree's float64 total stays finite for any capacity that fits in memory
_DRAW_ROUNDS = 8  # descents per prioritized draw before giving up (the tree keeps changing)


def draw(tree: PriorityTree, rng: np.random.Generator, m: int) -> np.ndarray | None:
    """``m`` slots drawn by priority, stratified: the total is cut into ``m`` equal ranges and
    one point is drawn in each (as in the prioritized replay paper), so every slot's expected
    count is exactly ``m * P(i)`` and the points come sorted, which makes the descent walk
    the tree in order (about a third cheaper at 1M slots). The slots are then shuffled, so
    the batch is not ordered by slot.

    A descent racing a change may end on a zero leaf (a slot never written or cleared, or
    padding past the capacity): those few are drawn again."""
    if tree.interrupted:  # a change cut short left stale sums: repaired before drawing from them
        tree.repair()
    slots = np.empty(0, dtype=np.int64)
    for _ in range(_DRAW_ROUNDS):
        total = tree.total
        if total <= 0:
            return None
        k = m - slots.size
        more = tree.descend((np.arange(k) + rng.random(k)) * (total / k))
        slots = np.concatenate((slots, more)) if slots.size else more
        zero = tree.levels[0][slots] == 0
        if not zero.any():
            return slots[rng.permutation(m)]
        slots = slots[~zero]
    return None


def empty_keys(n: int) -> dict:
    """Empty ``[n]`` leaves of the keys a prioritized sample adds to the storage's."""
    return {INDEX: torch.empty(n, dtype=torch.int64), WEIGHT: torch.empty(n, dtype=torch.float32)}


def sample_keys(slots: np.ndarray, leaves: np.ndarray, beta: float) -> dict:
    """The slots, and importance weights ``(N * P(i)) ** -beta`` over the batch's largest:
    ``N`` and the total cancel, leaving ``(min leaf / leaf) ** beta`` (the leaves they were
    drawn with)."""
    leaf = np.maximum(leaves, np.finfo(np.float64).tiny)
    w = (leaf.min() / leaf) ** beta
    return {INDEX: torch.from_numpy(slots.copy()), WEIGHT: torch.from_numpy(w.astype(np.float32))}


def max_leaf(priority, alpha: float) -> float:
    """The leaf new rows enter at for ``reset_max_priority(priority)`` (a number > 0)."""
    if isinstance(priority, (bool, np.bool_, str, bytes)):  # True was taken as 1.0, "2" failed in math
        raise TypeError(f"priority must be a number > 0 (or None: the largest the rows hold now), got "
                        f"{priority!r} ({type(priority).__name__})")
    try:
        value = float(priority)  # a 0-d tensor (td_error.max()) is a number too
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"priority must be a number > 0 (or None: the largest the rows hold now), got "
                        f"{type(priority).__name__} {priority!r:.80}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"priority must be finite and > 0, got {priority}")
    return min((value + PRIORITY_EPS) ** alpha, LEAF_MAX)


def update(tree: PriorityTree, seq: np.ndarray, capacity: int, alpha: float, index, priority,
           write_index=None, timeout: float | None = None) -> int:
    """``ReplayReader.update_priorities``: set the priorities of sampled rows; returns how
    many were applied.

    ``index`` is the sample itself (its ``("ingestd", "index")`` and ``("ingestd",
    "write_index")`` are used) or the slot indices; ``write_index`` (from the sample)
    makes the update skip slots overwritten since. Without it, only committed slots
    are updated, whatever row they now hold. ``timeout``: ``LockBusy`` (nothing updated)
    if another trainer holds ``priority.lock`` that long (None: wait for it; checked by the caller,
    ``Sampling.update_priorities``, as a sample's timeout)."""
    if isinstance(index, TensorDictBase):
        if INDEX not in index.keys(include_nested=True):
            raise ValueError("update_priorities takes a batch from sample() of this prioritized reader (it "
                             "carries ('ingestd', 'index')), or slot numbers; sequence samples carry none: "
                             "pass their ('ingestd', 'write_index') % capacity as slots")
        write_index = index.get(("ingestd", "write_index")) if write_index is None else write_index
        index = index.get(INDEX)
    slots = slot_indices(index, "index")
    prio = np.abs(_priorities(priority))
    if prio.size == 1 and slots.size > 1:
        prio = np.full(slots.size, prio[0])
    if not np.isfinite(prio).all():
        raise ValueError("priorities must be finite (a NaN or inf TD error?); nothing was updated")
    with np.errstate(over="ignore"):  # huge priorities ** alpha: inf, then capped
        leaves = np.minimum((prio + PRIORITY_EPS) ** alpha, LEAF_MAX)
    if write_index is not None:
        expected = 2 * slot_indices(write_index, "write_index") + 2
    else:
        bound = np.clip(slots, 0, capacity - 1)
        expected = seq[bound]
        committed = (expected > 0) & ((expected & 1) == 0)
        expected = np.where(committed, expected, -1)
    return tree.update(slots, leaves, seq=seq, expected_seq=expected, timeout=timeout)


def _priorities(priority) -> np.ndarray:
    """``priority`` as a flat float64 array: real numbers only (a bool, a string or a complex
    value was cast silently, or failed with numpy's message; None said "must be finite")."""
    if priority is None:
        raise ValueError("update_priorities needs the priorities (a tensor or array of |TD error|), got None; "
                         "nothing was updated")
    values = priority.detach().cpu().numpy() if isinstance(priority, torch.Tensor) else np.asarray(priority)
    if values.dtype.kind not in "fiu":
        raise ValueError(f"priorities must be real numbers (a float tensor or array of |TD error|), got "
                         f"{values.dtype} values; nothing was updated")
    return values.astype(np.float64).reshape(-1)
