"""Packing a batch's small leaves into the storage's records (``files.Layout.fields``).

Each small leaf of a row lives at a fixed byte offset of the row's record; a
batch's leaves are copied into the ring's records (or, for a batch that wraps
the ring, a staging array that ``ReplayStorage._fill`` then lands with one
memcpy per segment), one strided copy per leaf. The per-element cost of those
strided copies dominates a write of small rows, so leaves that lie side by side
in the record *and* in the batch's memory (the rollout keeps the stamps as one
``[rows, 5]`` buffer in the record's order) are copied as one opaque item: one
pass instead of five.

A pass over the records costs about as much as the cache lines it touches,
not as the bytes it copies (a CartPole record is two lines, each pass writes a
few bytes of each). So narrow leaves side by side in the record but not in
memory (a CartPole row's six bool flags) are first gathered into a small
staging array (a few bytes a row: it stays in cache) and land in one pass, and
the records are packed a block at a time, every copy of a block before the
next. For a 16,384-row CartPole chunk here (2 MB of records; 2 MB of L2 a
core), the six flags' passes took ~600 us and gathered ~200 us, and the whole
pack, interleaved in one worker-like process, 1.23 ms unblocked and ~1.0 ms in
blocks of 512 KB to 1 MB (0.13 ms blocks: 1.29 ms).
"""
from __future__ import annotations

import math
import threading
from typing import Iterator, NamedTuple

import numpy as np
import torch

NARROW = 8  # bytes a row: copies this narrow, side by side in the record, are gathered first
BLOCK_BYTES = 512 << 10  # records packed a block at a time (see above)


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


class Copy(NamedTuple):
    """One copy of a batch's rows into records: ``n`` items of ``item`` (a row shape of them,
    at ``strides`` within the row) from ``source``, or, for a key the storage fills in
    (``key`` set, ``source`` None), from the values given at each write."""

    offset: int  # bytes into the record
    item: np.dtype
    shape: tuple
    strides: tuple
    source: np.ndarray | None
    key: tuple | None

    @property
    def width(self) -> int:
        """Bytes a row."""
        return self.item.itemsize * math.prod(self.shape)

    def land(self, target: np.ndarray, stride: int, m: int, at: int, first: int, offset: int, filled: dict) -> None:
        """Rows ``first .. first + m`` into the ``m`` rows ``stride`` bytes apart from byte ``at``
        of ``target``, ``offset`` bytes into each."""
        values = self.source if self.key is None else filled[self.key]
        np.ndarray((m, *self.shape), self.item, target, at + offset, (stride, *self.strides))[...] = (
            values[first:first + m])


class Packer:
    """Packs batches into records, keeping the copies it worked out for the last batch: a worker
    writes the same tensors (its rollout's buffers) chunk after chunk, and finding the runs and
    making their numpy views cost ~60 us of a 4,096-row CartPole write here (a tenth of it).

    The copies read memory by address (:func:`_unowned`: no batch is kept alive), so they are
    reused exactly when the batch has as many rows and every leaf the address and strides it
    had: with the schema's shapes and dtypes (checked before a write) and no negative view
    (resolved before), those decide every copy. Other tensors, or the same ones moved or
    re-strided, are worked out afresh.

    The kept plan includes the staging arrays that narrow leaves are gathered in, which each
    batch writes into: one batch is packed at a time (a lock; two threads may commit slots of
    one storage handle at once)."""

    def __init__(self, record: int, fields: dict, plan: list[tuple], ring: tuple[int, int] = (0, 0),
                 block_bytes: int | None = None):
        """``fields``: key -> (numpy dtype, offset, row shape, row strides); ``plan``: ``(key,
        offset, row_bytes)`` in offset order; ``ring``: the ``[start, end)`` addresses of the
        records a batch's leaves could be views of (then packed in one block, as the block
        order could read rows an earlier block overwrote); ``block_bytes``: records packed at
        a time (:data:`BLOCK_BYTES`)."""
        self.record, self.fields, self.plan, self._ring = record, fields, plan, ring
        self.block = max(1, (BLOCK_BYTES if block_bytes is None else block_bytes) // record)  # records
        # the last batch's rows, each leaf's (address, strides), the records a block, and the
        # (staging array or None, copies) groups
        self._last: tuple | None = None
        self._lock = threading.Lock()

    def pack(self, records: np.ndarray, leaves: dict, n: int, filled: dict) -> None:
        """Copy the rows' small leaves (``leaves``: key -> the batch's tensors) into ``records``
        (``n`` records); ``filled``: key -> a numpy array the storage fills in instead (the
        write index)."""
        places = [(t.data_ptr(), t.stride()) if isinstance(t, torch.Tensor) else None
                  for t in (leaves.get(key) for key, _, _ in self.plan)]
        with self._lock:
            last = self._last
            if last is None or last[0] != n or last[1] != places:
                start, end = self._ring
                aliased = any(p is not None and start <= p[0] < end for p in places)
                block = n if aliased else min(n, self.block)
                planned = copies(self.record, self.fields, self.plan, leaves, n, filled)
                last = self._last = (n, places, block, list(gathered(planned, block)))
            _, _, block, groups = last
            record = self.record
            for first in range(0, n, block):  # every copy of a block of records while they are in cache
                m = min(block, n - first)
                at = first * record
                for stage, members in groups:
                    if stage is None:
                        members[0].land(records, record, m, at, first, members[0].offset, filled)
                        continue
                    base = members[0].offset
                    for copy in members:
                        copy.land(stage, stage.itemsize, m, 0, first, copy.offset - base, filled)
                    np.ndarray((m,), stage.dtype, records, at + base, (record,))[...] = stage[:m]


def gathered(planned: Iterator[Copy], rows: int) -> Iterator[tuple[np.ndarray | None, list[Copy]]]:
    """``planned`` copies (in offset order) grouped as ``(staging array, copies)``: each run
    of two or more copies at most :data:`NARROW` bytes a row and side by side in the record
    shares a staging array of ``rows`` items of their total width (a block's rows are copied
    into it, then land as one item a row); any other copy stands alone (no staging array)."""
    run: list[Copy] = []

    def flush() -> Iterator[tuple]:
        if len(run) > 1:
            yield np.empty(rows, np.dtype(f"V{sum(c.width for c in run)}")), list(run)
        else:
            yield from ((None, [c]) for c in run)
        run.clear()

    for copy in planned:
        narrow = copy.width <= NARROW
        if run and not (narrow and copy.offset == run[-1].offset + run[-1].width):
            yield from flush()
        run.append(copy)
        if not narrow:
            yield from flush()
    yield from flush()


def copies(record: int, fields: dict, plan: list[tuple], leaves: dict, n: int, filled: dict) -> Iterator[Copy]:
    """The copies that pack ``leaves`` into records (in the plan's offset order)."""
    for offset, width, keys, where in runs(plan, leaves, n, filled):
        if len(keys) > 1:  # side by side in memory too: one opaque item per row
            ptr, stride = where
            yield Copy(offset, np.dtype(f"V{width}"), (), (), _raw(ptr, n, width, stride), None)
            continue
        key = keys[0]
        dtype, _, shape, strides = fields[key]
        if key in filled:
            yield Copy(offset, dtype, shape, strides, None, key)
            continue
        value = as_numpy(leaves[key])
        if value.size > n and value.flags.c_contiguous:  # rows of several elements: one opaque item each
            item = np.dtype(f"V{value.nbytes // n}")
            yield Copy(offset, item, (), (), _unowned(value.reshape(n, -1).view(item).reshape(n)), None)
        else:
            yield Copy(offset, dtype, shape, strides, _unowned(value), None)


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()
