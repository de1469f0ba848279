"""Packing a batch's small leaves into the storage's records (``files.Layout.fields``).

Each small leaf of a row lives at a fixed byte offset of the row's record; a
batch's leaves are copied into the ring's records (or, for a batch that wraps
the ring, a staging array that ``ReplayStorage._fill`` then lands with one
memcpy per segment), one strided copy per leaf. The per-element cost of those
strided copies dominates a write of small rows, so leaves that lie side by side
in the record *and* in the batch's memory (the rollout keeps the stamps as one
``[rows, 5]`` buffer in the record's order) are copied as one opaque item: one
pass instead of five.

Each pass over the records costs about as much as the cache lines it touches
(a record is a line or two), not as its bytes: narrow leaves side by side in
the record but not in memory (a CartPole row's six bool flags) are therefore
first gathered into a small staging array (a few bytes a row, so it stays in
cache) and land in one pass: six passes of a 16,384-row chunk's flags cost
~600 us here, gathered ~200 us.
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

NARROW = 8  # bytes a row: copies this narrow, side by side in the record, are gathered first
BLOCK_BYTES = 512 << 10  # records packed a block at a time: every copy of a block while in cache (~1 ms -> 0.8 ms)


class _Interface:
    """An object numpy reads an array from by its interface alone (no reference to its owner)."""

    def __init__(self, interface: dict):
        self.__array_interface__ = interface


def _unowned(array: np.ndarray) -> np.ndarray:
    """A view of ``array``'s memory that does not keep its owner (a tensor) alive."""
    return np.asarray(_Interface(dict(array.__array_interface__)))


def _raw(ptr: int, n: int, width: int, stride: int) -> np.ndarray:
    """A numpy view over raw memory: ``n`` items of ``width`` bytes, ``stride`` bytes apart."""
    return np.asarray(_Interface({"data": (ptr, True), "shape": (n,), "strides": (stride,),
                                  "typestr": f"|V{width}", "version": 3}))


def row_bytes_at(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(address of row 0, bytes between rows)`` when each row's bytes are contiguous
    (a ``[n, ...]`` tensor whose inner dims are C-ordered), else None."""
    if tensor.dim() == 0:
        return None
    size = tensor.element_size()
    expected = size
    for dim in range(tensor.dim() - 1, 0, -1):
        if tensor.shape[dim] != 1 and tensor.stride(dim) * size != expected:
            return None
        expected *= tensor.shape[dim]
    return tensor.data_ptr(), tensor.stride(0) * size


def runs(plan: list[tuple], leaves: dict, n: int, filled: dict) -> Iterator[tuple[int, int, list, tuple | None]]:
    """Group ``plan`` (``(key, offset, row_bytes)`` in offset order) into runs copied as one
    item: ``(offset, width, keys, (address of row 0, row stride) or None)``. A run's leaves are
    adjacent in the record and in memory: each row's bytes of one leaf end where the next leaf's
    begin, at the same row stride. Keys in ``filled`` (values the storage fills in) are never
    part of a longer run."""
    run = None  # [offset, width, keys, address where the next leaf must begin, row stride, where]
    for key, offset, width in plan:
        leaf = None if key in filled else leaves.get(key)
        where = row_bytes_at(leaf) if isinstance(leaf, torch.Tensor) and leaf.shape[:1] == (n,) else None
        if run is not None and where is not None and offset == run[0] + run[1] and where == (run[3], run[4]):
            run[1] += width
            run[2].append(key)
            run[3] += width
            continue
        if run is not None:
            yield run[0], run[1], run[2], run[5]
        run = [offset, width, [key], *((None, None) if where is None else (where[0] + width, where[1])), where]
    if run is not None:
        yield run[0], run[1], run[2], run[5]


class Packer:
    """Packs batches into records, keeping the copies it worked out for the last batch: a worker
    writes the same tensors (its rollout's buffers) chunk after chunk, and finding the runs and
    making their numpy views cost ~60 us of a 4,096-row CartPole write here (a tenth of it).

    The copies read memory by address (:func:`_unowned`: no batch is kept alive), so they are
    reused exactly when the batch has as many rows and every leaf the address and strides it
    had: with the schema's shapes and dtypes (checked before a write) and no negative view
    (resolved before), those decide every copy. Other tensors, or the same ones moved or
    re-strided, are worked out afresh."""

    def __init__(self, record: int, fields: dict, plan: list[tuple]):
        """``fields``: key -> (numpy dtype, offset, row shape, row strides); ``plan``: ``(key,
        offset, row_bytes)`` in offset order."""
        self.record, self.fields, self.plan = record, fields, plan
        self.block = max(1, BLOCK_BYTES // record)  # records a block
        self._last: tuple | None = None  # (n, each leaf's (address, strides), the copies)

    def pack(self, records: np.ndarray, leaves: dict, n: int, filled: dict) -> None:
        """Copy the rows' small leaves (``leaves``: key -> the batch's tensors) into ``records``
        (``n`` records); ``filled``: key -> a numpy array the storage fills in instead (the
        write index)."""
        places = [(t.data_ptr(), t.stride()) if isinstance(t, torch.Tensor) else None
                  for t in (leaves.get(key) for key, _, _ in self.plan)]
        last = self._last
        if last is None or last[0] != n or last[1] != places:
            planned = copies(self.record, self.fields, self.plan, leaves, n, filled)
            last = self._last = (n, places, list(gathered(planned, min(n, self.block))))
        record, block = self.record, self.block
        for first in range(0, n, block):  # every copy of a block of records while they are in cache
            m = min(block, n - first)
            at = first * record
            for stage, members in last[2]:
                if stage is None:
                    land(records, record, m, at, first, *members[0], filled)
                    continue
                for offset, item, shape, strides, source, key in members:
                    land(stage, stage.itemsize, m, 0, first, offset - members[0][0], item, shape, strides,
                         source, key, filled)
                np.ndarray((m,), stage.dtype, records, at + members[0][0], (record,))[...] = stage[:m]


def land(target: np.ndarray, record: int, m: int, at: int, first: int, offset: int, item: np.dtype, shape: tuple,
         strides: tuple, source: np.ndarray | None, key, filled: dict) -> None:
    """One copy into the ``m`` records of ``record`` bytes at byte ``at`` of ``target``: rows
    ``first ..`` of ``source``, or for a key the storage fills in, of ``filled[key]``."""
    values = source if key is None else filled[key]
    np.ndarray((m, *shape), item, target, at + offset, (record, *strides))[...] = values[first:first + m]


def gathered(planned: Iterator[tuple], rows: int) -> Iterator[tuple[np.ndarray | None, list[tuple]]]:
    """``planned`` copies (in offset order) grouped as ``(staging array, copies)``: each run
    of two or more copies at most :data:`NARROW` bytes a row and side by side in the record
    shares a staging array of ``rows`` items of their total width (a block's rows are copied
    into it, then land as one item a row); any other copy stands alone (no staging array)."""
    run: list[tuple] = []

    def flush() -> Iterator[tuple]:
        if len(run) > 1:
            width = sum(_width(c) for c in run)
            yield np.empty(rows, np.dtype(f"V{width}")), list(run)
        else:
            yield from ((None, [c]) for c in run)
        run.clear()

    for copy in planned:
        narrow = _width(copy) <= NARROW
        if run and not (narrow and copy[0] == run[-1][0] + _width(run[-1])):
            yield from flush()
        run.append(copy)
        if not narrow:
            yield from flush()
    yield from flush()


def _width(copy: tuple) -> int:
    """Bytes a row of one copy ``(offset, item, row shape, ...)``."""
    return copy[1].itemsize * math.prod(copy[2])


def copies(record: int, fields: dict, plan: list[tuple], leaves: dict, n: int, filled: dict) -> Iterator[tuple]:
    """The copies that pack ``leaves`` into records: ``(offset, dtype, row shape, row strides,
    source array, None)``, or ``(..., None, key)`` for a key the storage fills in (its values
    are given at each write)."""
    for offset, width, keys, where in runs(plan, leaves, n, filled):
        if len(keys) > 1:  # side by side in memory too: one opaque item per row
            ptr, stride = where
            yield offset, np.dtype(f"V{width}"), (), (), _raw(ptr, n, width, stride), None
            continue
        key = keys[0]
        dtype, _, shape, strides = fields[key]
        if key in filled:
            yield offset, dtype, shape, strides, None, key
            continue
        value = as_numpy(leaves[key])
        if value.size > n and value.flags.c_contiguous:  # rows of several elements: one opaque item each
            item = np.dtype(f"V{value.nbytes // n}")
            yield offset, item, (), (), _unowned(value.reshape(n, -1).view(item).reshape(n)), None
        else:
            yield offset, dtype, shape, strides, _unowned(value), None


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()
