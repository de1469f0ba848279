"""``ReplayReader``: attach to a storage by path, read-only, and sample from it.

No lock is taken. Each drawn row's sequence number is read before and after
the copy; rows that were never written, are being written, or changed during
the copy are re-drawn, so a sample never holds a torn row.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch
from tensordict import TensorDict

from ingestd.errors import EmptyReplay, SampleTimeout
from ingestd.replay.storage import MappedStore

_REDRAW_ROUNDS = 64
_POLL_S = 0.002


class ReplayReader(MappedStore):
    """Read-only view of a replay storage. Safe to use while workers write."""

    def __init__(self, path: str | os.PathLike, seed: int | None = None):
        super().__init__(path, writable=False)
        self._rng = np.random.default_rng(seed)
        self._keys = list(self.leaves)

    def sample(self, batch_size: int, timeout: float | None = None) -> TensorDict:
        """Uniform sample of committed rows, shape ``[batch_size]``.

        Without ``timeout`` this never blocks: an empty storage raises ``EmptyReplay``.
        With ``timeout`` (seconds) it waits for data and raises ``SampleTimeout``."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            index = self._draw_valid(batch_size)
            if index is not None:
                return self.gather(index)
            if deadline is None:
                raise EmptyReplay(f"replay {self.path} has no committed rows yet; "
                                  "wait for the workers, or pass timeout= to block")
            if time.monotonic() >= deadline:
                raise SampleTimeout(f"no committed rows in replay {self.path} after {timeout} s")
            time.sleep(_POLL_S)

    def _draw_valid(self, n: int) -> np.ndarray | None:
        """Slot indices of ``n`` committed rows, or None if none can be found."""
        self._check_open()
        filled = len(self)
        if filled == 0:
            return None
        index = self._rng.integers(0, filled, size=n)
        for _ in range(_REDRAW_ROUNDS):
            seq = self.seq[index]
            bad = (seq <= 0) | (seq & 1 == 1)
            if not bad.any():
                return index
            index[bad] = self._rng.integers(0, filled, size=int(bad.sum()))
        return None

    def gather(self, index: np.ndarray) -> TensorDict:
        """Copy the rows at slot ``index``; rows that changed meanwhile are re-drawn."""
        idx = torch.from_numpy(index)
        before = self.seq[index]
        out = {key: torch.index_select(self.leaves[key], 0, idx) for key in self._keys}
        after = self.seq[index]
        changed = np.flatnonzero(before != after)
        if changed.size:
            self._replace(out, changed)
        return _nest(out, len(index))

    def _replace(self, out: dict, positions: np.ndarray) -> None:
        fresh = self._draw_valid(positions.size)
        if fresh is None:
            raise SampleTimeout(f"replay {self.path}: rows kept changing under the reader")
        redo = self.gather(fresh)
        pos = torch.from_numpy(positions)
        for key in self._keys:
            out[key][pos] = redo.get(key)


def _nest(flat: dict, n: int) -> TensorDict:
    nested: dict = {}
    for key, value in flat.items():
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return TensorDict(nested, batch_size=[n])
