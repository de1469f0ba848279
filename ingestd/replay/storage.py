"""The shared replay storage: a memmapped ring any process can write into.

Writers reserve a contiguous range of write indices under an ``flock``, take
a per-slot lock on that range (both dropped by the kernel if the holder
dies), mark the slots odd, copy, mark them even and release the slots. The
slot lock makes a writer that laps the ring wait for a slow writer still
filling a slot, instead of writing under it. Readers (``ReplayReader``)
never lock: they check each row's sequence number before and after copying
and re-draw rows that were not committed or changed.

``write`` does all of that in one call. ``reserved`` splits it for a writer
that produces large leaves (images) one piece at a time: it reserves the
slots first and hands out views of their columns, the writer fills them in
place (one copy fewer), then commits the batch; slots left uncommitted are
cleared, never left odd.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from tensordict import TensorDictBase

from ingestd.errors import (CapacityMismatch, ClosedError, CorruptStorage, LockBusy, SchemaMismatch, StorageFull,
                            StorageNotFound)
from ingestd.replay import files
from ingestd.replay import limiter, nstep_record, packing, priority
from ingestd.replay.priority import PriorityTree
from ingestd.replay.layout import WRITE_INDEX, Key, Leaf
from ingestd.replay.schema import describe_diff, flat_leaves, schema_of

log = logging.getLogger("ingestd.replay")


def check_matches(path, meta: dict, example_or_spec, capacity: int | None) -> None:
    """Whether the storage at ``path`` (its ``meta``: ``files.read_meta``) takes rows like
    ``example_or_spec`` (None: any) at ``capacity`` (None: any); ``CapacityMismatch`` or
    ``SchemaMismatch`` if not. ``ReplayStorage.open`` checks this, and ``ingestd config check``
    without opening it."""
    if capacity is not None and int(capacity) != meta["capacity"]:
        raise CapacityMismatch(
            f"{path} holds a storage of capacity {meta['capacity']}, not {capacity}; "
            "use the same capacity, or point the replay at a new path")
    if example_or_spec is None:
        return
    wanted = schema_of(example_or_spec)
    if wanted != meta["schema"]:
        raise SchemaMismatch(f"{path} holds a different schema: {describe_diff(meta['schema'], wanted)}; "
                             "use a new replay path for a different env (nothing was changed)")


def storage_bytes(schema: dict[Key, Leaf], capacity: int) -> int:
    """The bytes a storage of ``schema`` and ``capacity`` takes: its files and its priority tree."""
    return files.replay_bytes(schema, capacity) + priority.file_bytes(capacity)


class MappedStore:
    """Maps a storage directory: header, sequence numbers and one tensor per leaf."""

    def __init__(self, path: str | os.PathLike, writable: bool):
        self.path = Path(path).expanduser()
        if (self.path / "snapshot.json").exists():  # its meta.json reads, then "header.bin is missing" (review)
            raise StorageNotFound(f"{self.path} is a snapshot, not a replay storage: make a storage from it with "
                                  "`ingestd replay restore SNAPSHOT DEST` (ingestd.replay.restore) and attach to that")
        meta = files.read_meta(self.path)
        self.capacity: int = meta["capacity"]
        self.schema: dict[Key, Leaf] = meta["schema"]
        self._layout: files.Layout = meta["layout"]
        self._maps: list = []
        self._closed = True
        try:
            mm, self._header = files.map_header(self.path, self.capacity, writable)
            self._maps.append(mm)
            mm = files.map_file(self.path / "data.bin", self._layout.data_bytes, writable)
            self._maps.append(mm)
        except BaseException:
            self._header = None
            self._unmap()
            raise
        self._closed = False
        self.seq = self._header[files.HEADER_WORDS:]
        # the views go through frombuffer, which holds the mapping's buffer while any view of it
        # lives: close() then leaves data.bin mapped until the last view goes (a thread still
        # copying, a caller's tensor), instead of unmapping under it (SIGSEGV). np.ndarray over
        # the mmap itself held nothing, and its views dangled
        data = np.frombuffer(mm, np.uint8)
        self._arrays = files.leaf_arrays(data, self.schema, self._layout, self.capacity)
        self._records = files.record_array(data, self._layout, self.capacity)
        self.leaves: dict[Key, torch.Tensor] = {k: files.as_tensor(a) for k, a in self._arrays.items()}

    @property
    def write_count(self) -> int:
        """Rows ever written (64-bit, persistent, never goes backwards)."""
        self._check_open()
        return int(self._header[files.H_WRITE_COUNT])

    @property
    def nstep(self) -> dict | None:
        """``{"n_step": n, "gamma": g}`` when the rows are n-step rows (their ``("next", "reward")``
        the ``gamma``-discounted sum of up to ``n`` rewards, ``steps_to_next_obs`` the steps it
        covers), as the daemon recorded them; None for 1-step rows. A trainer bootstraps with
        ``gamma ** steps_to_next_obs`` of this ``gamma``."""
        self._check_open()
        return nstep_record.read(self.path)

    @property
    def has_columns(self) -> bool:
        """Whether some leaf is large enough (images) to be stored as its own column."""
        return bool(self._layout.columns)

    def __len__(self) -> int:
        """Rows currently held: ``min(write_count, capacity)`` (rows in flight included)."""
        return min(self.write_count, self.capacity)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"replay storage {self.path} was closed; open it again to use it")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.leaves.clear()
        self._arrays.clear()
        self.seq = self._header = self._records = None  # drop views before unmapping
        self._unmap()

    def _unmap(self) -> None:
        for mm in self._maps:
            if mm is not None:
                files.unmap(mm)
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReplayStorage(MappedStore):
    """Read-write handle: what workers (and the daemon) use to write rows.

    Any number of processes may write at once. A handle may be shared by threads
    (its writes are serialised); one handle per thread writes in parallel."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, writable=True)
        try:
            self._lock_fd = files.open_lock_file(self.path / "lock")
        except FileNotFoundError:
            super().close()
            raise CorruptStorage(f"{self.path / 'lock'} is missing; the storage is incomplete") from None
        self._write_lock = threading.RLock()  # held from reservation to commit
        # called while a write waits on priority.lock, which a trainer stopped inside
        # update_priorities may hold for long: a worker sets its heartbeat here (files.flocked)
        self.lock_wait: Callable[[], None] | None = None
        try:  # new rows enter the prioritized-sampling tree at max priority (ingestd.replay.priority)
            self._priorities = PriorityTree.attach(self.path, self.capacity, self.seq)
            limiter.ensure_file(self.path)  # the rate limiter's shared words (ingestd.replay.limiter)
        except BaseException:
            files.close_lock_file(self._lock_fd)
            super().close()
            raise
        self._expected = {k: (leaf.shape, leaf.dtype) for k, leaf in self.schema.items() if k != WRITE_INDEX}
        self._fields = {k: (a.dtype, self._layout.fields[k], a.shape[1:], a.strides[1:])
                        for k, a in self._arrays.items() if k in self._layout.fields}  # packing plan
        self._plan = sorted(((k, f[1], self.schema[k].row_bytes) for k, f in self._fields.items()),
                            key=lambda p: p[1])  # (key, offset, row bytes) in record order
        ring = self._records.ctypes.data, self._records.ctypes.data + self._records.nbytes
        self._packer = packing.Packer(self._layout.record_bytes, self._fields, self._plan, ring)

    # -- construction --------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, example_or_spec, capacity: int) -> "ReplayStorage":
        """Create a new storage at ``path`` (which must not hold one already)."""
        path = Path(path).expanduser()
        capacity = int(capacity)
        if capacity <= 0:
            raise ValueError(f"capacity must be a positive number of rows, got {capacity}")
        schema = schema_of(example_or_spec)
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"{path} is a file; choose an empty or new directory")
        if (path / "meta.json").exists():
            raise FileExistsError(f"{path} already holds a replay storage; use ReplayStorage.open to reopen it")
        if path.is_dir() and any(p.name not in files.CREATION_FILES for p in path.iterdir()):
            raise FileExistsError(f"{path} exists and is not empty; choose an empty or new directory")
        path.mkdir(parents=True, exist_ok=True, mode=0o750)  # the group reads, nobody else; whatever the umask
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # two creators: the second finds meta.json below
            if (path / "meta.json").exists():
                raise FileExistsError(f"{path} already holds a replay storage; use ReplayStorage.open")
            if any(p.name not in files.CREATION_FILES for p in path.iterdir()):
                raise FileExistsError(f"{path} exists and is not empty; choose an empty or new directory")
            need = storage_bytes(schema, capacity)
            files.check_room(path, capacity, need)
            files.allocate(path, schema, capacity, need)
            try:  # the tree too, before meta.json: a storage that does not fit leaves nothing behind
                PriorityTree.attach(path, capacity).close()
            except StorageFull as exc:
                for name in files.REPLAY_FILES:
                    (path / name).unlink(missing_ok=True)
                raise files.no_room(path, capacity, need, exc.__cause__) from exc
            files.write_meta(path, schema, capacity)
        finally:
            os.close(fd)
        return cls(path)

    @classmethod
    def open(cls, path: str | os.PathLike, example_or_spec=None, capacity: int | None = None,
             recover: bool = False) -> "ReplayStorage":
        """Reopen a storage. With ``example_or_spec``/``capacity`` given, a mismatch is an error
        (nothing is ever wiped). ``recover=True`` clears slots left mid-write by dead writers
        (slots that live writers are filling are left alone)."""
        store = cls(path)
        try:
            store._check_matches(example_or_spec, capacity)
            if recover:
                store.recover()
        except BaseException:
            store.close()
            raise
        return store

    @classmethod
    def open_or_create(cls, path: str | os.PathLike, example_or_spec, capacity: int,
                       recover: bool = True) -> "ReplayStorage":
        meta = Path(path).expanduser() / "meta.json"
        if not meta.exists():
            try:
                return cls.create(path, example_or_spec, capacity)
            except FileExistsError:
                if not meta.exists():
                    raise
        return cls.open(path, example_or_spec, capacity, recover=recover)

    def _check_matches(self, example_or_spec, capacity: int | None) -> None:
        check_matches(self.path, {"capacity": self.capacity, "schema": self.schema}, example_or_spec, capacity)

    # -- writing ---------------------------------------------------------------
    def _locked(self):
        self._check_open()
        return files.flocked(self._lock_fd)

    def recover(self) -> int:
        """Mark slots left odd by dead writers as empty; returns how many were cleared.

        A slot is odd while its writer fills it, and that writer holds a lock on it
        which the kernel drops when the writer dies: odd slots nobody locks are dead.
        Each is cleared under its own lock, after reading it again: a live writer may have
        committed it (and let go) since the scan; a check of the lock, then a clear, wiped
        such committed rows (replay review: 4,096 of them in 15 s of recoveries beside two
        writers). Writes through this handle wait (``_write_lock``): their slot locks are
        this handle's own, which its lock calls do not see. Committed rows whose writer died
        before entering them in the priority tree enter it now, at the maximum priority."""
        cleared, fd = 0, self._lock_fd
        with self._write_lock, self._locked():
            odd = np.flatnonzero(self.seq & 1)
            for run in np.split(odd, np.flatnonzero(np.diff(odd) != 1) + 1) if odd.size else ():
                first, count = int(run[0]), int(run.size)
                spans = ([(first, count)] if files.try_lock_slots(fd, first, count)
                         else [(slot, 1) for slot in range(first, first + count) if files.try_lock_slots(fd, slot, 1)])
                for start, n in spans:
                    try:
                        part = self.seq[start:start + n]
                        dead = (part & 1) == 1  # read again under the lock
                        part[dead] = 0
                        cleared += int(dead.sum())
                    finally:
                        files.unlock_slots(fd, start, n)
        if cleared:  # lock-free, as a writer's vacate: a trainer stopped inside update_priorities
            # holds priority.lock, and a daemon starting must not wait on it (it hung, silently)
            self._priorities.levels[0][np.flatnonzero(self.seq == 0)] = 0.0
            log.info("%s: %d slots left mid-write by dead writers are marked empty", self.path, cleared)
        try:
            self.enter_unentered(timeout=0.0)  # and re-sums the tree; else the daemon tries again later
        except LockBusy:
            log.warning("%s is busy (a writer entering its rows, or a trainer inside update_priorities): the "
                        "priority tree is repaired once it is free", self.path / "priority.lock")
        return cleared

    def enter_unentered(self, timeout: float | None = None) -> int:
        """Committed rows whose writer died between its commit and entering them in the priority
        tree (their leaves are 0: slots are vacated when reserved) enter now, at the maximum
        priority; returns how many. The daemon runs this at start and after a worker died, with
        a ``timeout`` (``LockBusy``: a trainer holds ``priority.lock``; try again later)."""
        tree = self._priorities
        unentered = np.flatnonzero((self.seq > 0) & ((self.seq & 1) == 0) & (tree.levels[0][:self.capacity] == 0))
        if unentered.size:
            tree.update(unentered, np.full(unentered.size, tree.max_leaf), timeout=timeout)
        tree.resum(timeout)  # and the ancestors of runs vacated by writers that died before entering them
        return int(unentered.size)

    def next_incarnation(self) -> int:
        """A persistent, never-repeating number (used to make episode ids unique forever)."""
        with self._locked():
            self._header[files.H_INCARNATIONS] += 1
            return int(self._header[files.H_INCARNATIONS])

    def write(self, batch: TensorDictBase) -> int:
        """Append a batch of rows; returns the write index of its first row.

        The batch must carry every schema key with shape ``(n, *row_shape)`` and the
        schema's dtype (``("ingestd", "write_index")`` is filled in here)."""
        n = self._validate(batch)
        if n == 0:
            return self.write_count
        with self.reserved(n) as slots:
            self._commit(slots, batch)
        return slots.first

    @contextmanager
    def reserved(self, n: int) -> Iterator["Slots"]:
        """Reserve the slots of the next ``n`` rows (locked and odd) for the block; see :class:`Slots`.

        Slots not committed when the block ends, by an error or otherwise, are cleared
        (sequence 0: empty, as recovery leaves them). Other threads' writes through this
        handle wait until the block ends."""
        if not 0 < n <= self.capacity:
            raise SchemaMismatch(f"cannot reserve {n} rows in a storage of capacity {self.capacity}; "
                                 "reserve 1 to capacity rows")
        with self._write_lock:
            index = self._reserve(n)
            slots = None
            first, wait = int(index[0]) % self.capacity, self.lock_wait
            try:
                self._priorities.vacate(first, index.size)  # the overwritten rows' priority goes
                slots = Slots(self, index)
                yield slots
            finally:
                try:  # the tree is set while the slots are still ours: a writer lapping the ring waits
                    if slots is not None and slots.committed:
                        self._priorities.enter(first, index.size, wait)
                    else:
                        self._set_seq(index, np.zeros_like(index))  # never leave a slot odd behind
                        self._priorities.clear(index % self.capacity, wait)  # nor any priority mass
                finally:
                    self._release(index)

    def _commit(self, slots: "Slots", batch: TensorDictBase) -> None:
        """Fill the reserved slots from a validated batch of their size and mark them committed."""
        self._fill(slots.index, batch)
        self._set_seq(slots.index, 2 * slots.index + 2)
        slots.committed = True

    def _column_views(self, index: np.ndarray) -> dict[Key, torch.Tensor]:
        """``[n, *shape]`` views of the large leaves' slots of ``index`` (none if it wraps the ring)."""
        first = int(index[0]) % self.capacity
        if first + index.size > self.capacity:
            return {}
        return {key: self.leaves[key][first:first + index.size] for key in self._layout.columns}

    def _reserve(self, n: int) -> np.ndarray:
        """Take write indices ``[start, start+n)``: lock their slots and mark them odd."""
        with self._locked():
            start = int(self._header[files.H_WRITE_COUNT])
            index = np.arange(start, start + n, dtype=np.int64)
            locked = []
            try:
                for dst, _ in self._segments(start, n):
                    # waits if a slow writer is still filling a slot of the previous lap
                    files.lock_slots(self._lock_fd, dst.start, dst.stop - dst.start)
                    locked.append(dst)
            except BaseException:
                for dst in locked:
                    files.unlock_slots(self._lock_fd, dst.start, dst.stop - dst.start)
                raise
            self._set_seq(index, 2 * index + 1)
            self._header[files.H_WRITE_COUNT] = start + n
        return index

    def _release(self, index: np.ndarray) -> None:
        for dst, _ in self._segments(int(index[0]), index.size):
            files.unlock_slots(self._lock_fd, dst.start, dst.stop - dst.start)

    def _set_seq(self, index: np.ndarray, values: np.ndarray) -> None:
        for dst, src in self._segments(int(index[0]), index.size):
            self.seq[dst] = values[src]

    def _fill(self, index: np.ndarray, batch: TensorDictBase) -> None:
        """Copy the rows (a batch of the storage's keys, row shapes and dtypes: ``_validate``)
        into their reserved slots (a separate step so tests can stall it).

        The small leaves are packed straight into the ring's records (one strided copy per leaf,
        or per run of leaves side by side: ``ingestd.replay.packing``); a batch that wraps the
        ring is packed into a staging buffer first, which lands with one memcpy per segment.
        Packing into the ring saves that memcpy, ~4 % of a 256-env CartPole worker's time here.
        Large leaves are copied column by column."""
        leaves = flat_leaves(batch)
        if any(v.is_neg() for v in leaves.values()):  # a negative view (x.conj().imag): its bytes are not its values
            leaves = {k: v.resolve_neg() for k, v in leaves.items()}
        n = index.size
        segments = self._segments(int(index[0]), n)
        if len(segments) == 1:  # straight into the ring's records (their padding stays as created: 0)
            target = self._records[segments[0][0]]
        else:  # (once a lap) its own: two threads may commit slots of one handle at once
            target = np.zeros(n, self._records.dtype)  # padding bytes zero, as in the ring
        self._packer.pack(target, leaves, n, {WRITE_INDEX: index})
        if len(segments) > 1:
            for dst, part in segments:
                self._records[dst] = target[part]
        for key in self._layout.columns:  # numpy's copy: ~20% faster than torch's copy_ for images here
            src, column, target = leaves[key], self.leaves[key], self._arrays[key]
            for dst, part in segments:
                if not _same_memory(column[dst], src[part]):  # else filled in place (``reserved``)
                    np.copyto(target[dst], packing.as_numpy(src[part]))

    def _segments(self, start: int, n: int) -> list[tuple[slice, slice]]:
        """The (slot slice, batch slice) pairs covering write indices ``[start, start+n)``."""
        return files.segments(start, n, self.capacity)

    def _validate(self, batch: TensorDictBase) -> int:
        self._check_open()
        if not isinstance(batch, TensorDictBase) or batch.batch_dims != 1:
            raise SchemaMismatch("write() takes a TensorDict with one batch dimension (rows)")
        n = batch.batch_size[0]
        if n > self.capacity:
            raise SchemaMismatch(f"a batch of {n} rows does not fit a storage of capacity {self.capacity}; "
                                 "write smaller batches or raise replay.capacity")
        got = flat_leaves(batch)
        got.pop(WRITE_INDEX, None)  # filled in by write()
        if got.keys() != self._expected.keys():
            missing, unexpected = set(self._expected) - set(got), set(got) - set(self._expected)
            raise SchemaMismatch(f"batch keys do not match the storage: missing {sorted(missing)}, "
                                 f"unexpected {sorted(unexpected)}")
        for key, value in got.items():
            shape, dtype = self._expected[key]
            if value.shape[1:] != shape or value.dtype != dtype:
                raise SchemaMismatch(f"leaf {key}: got shape {tuple(value.shape[1:])} {value.dtype} per row, "
                                     f"the storage holds {shape} {dtype}")
            if not value.is_cpu:
                raise SchemaMismatch(f"leaf {key} is on {value.device}; move the batch to the CPU first")
        return n

    def close(self) -> None:
        """Unmap the storage. A write in flight in another thread finishes first (unmapping under
        it crashed the process: SIGSEGV); writes started later raise ``ClosedError``."""
        if self._closed:
            return
        with self._write_lock:  # held by every write from reservation to commit
            if not self._closed:
                files.close_lock_file(self._lock_fd)
                self._priorities.close()
            super().close()


class Slots:
    """Slots reserved by :meth:`ReplayStorage.reserved` for write indices ``[first, first + n)``.

    ``columns`` maps each large leaf (a column of ``data.bin``) to the ``[n, *shape]`` view
    of these slots (empty when the range wraps around the ring). A writer may fill them
    in place before :meth:`commit`: rows of the batch that already are those views are not
    copied again. Readers see the slots as being written (odd) until the commit."""

    def __init__(self, storage: ReplayStorage, index: np.ndarray):
        self._storage, self.index = storage, index
        self.first, self.n = int(index[0]), int(index.size)
        self.columns = storage._column_views(index)
        self.committed = False

    def commit(self, batch: TensorDictBase) -> None:
        """Store ``batch`` (``n`` rows, as for ``write``) in the slots and mark them committed."""
        if self.committed:
            raise RuntimeError(f"slots {self.first}..{self.first + self.n - 1} were already committed")
        n = self._storage._validate(batch)
        if n != self.n:
            raise SchemaMismatch(f"a batch of {n} rows cannot fill {self.n} reserved slots; "
                                 "commit exactly as many rows as were reserved")
        self._storage._commit(self, batch)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same view of the same memory (copying one to the other is a no-op)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())
