"""The on-disk (or tmpfs) form of a replay storage directory.

::

    <path>/meta.json     format, version, capacity, schema, layout (written last)
    <path>/header.bin    int64 words: magic, version, capacity, write_count,
                         incarnations, reserved..., then one seq per slot
    <path>/lock          flock target for slot reservation; its byte range
                         ``[slot, slot+1)`` is write-locked (OFD lock) while a
                         writer fills that slot
    <path>/data.bin      the rows: small leaves interleaved as one fixed-size
                         *record* per slot (so a sampled row costs one or two
                         cache misses, not one per leaf), then one page-aligned
                         ``(capacity, *shape)`` *column* per large leaf (images)

A slot's sequence number is the seqlock *and* the sentinel: ``0`` never
written (or cleared by recovery), ``2*w+1`` being written as write index
``w``, ``2*w+2`` committed as write index ``w``.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import time
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from ingestd.errors import CorruptStorage, LockBusy, StorageFull, StorageNotFound
from ingestd.replay.layout import Key, Leaf, dtype_name, leaf_name, numpy_dtype, schema_from_json, schema_to_json

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ingestd.replay")

FORMAT = "ingestd-replay"
VERSION = 2
MAGIC = 0x494E47455354_0001  # "INGEST" + 1

HEADER_WORDS = 64
H_MAGIC, H_VERSION, H_CAPACITY, H_WRITE_COUNT, H_INCARNATIONS = 0, 1, 2, 3, 4
ALIGN = 4096
LARGE_ROW_BYTES = 2048  # a leaf with at least this many bytes per row gets its own column
CREATION_FILES = frozenset({"lock", "header.bin", "data.bin", "meta.json.tmp", "priority.bin", "priority.bin.tmp",
                            "priority.lock"})


def header_bytes(capacity: int) -> int:
    return 8 * (HEADER_WORDS + capacity)


def group_of(leaf: Leaf) -> tuple[str, tuple[int, ...]]:
    """Leaves with the same group lie side by side in the record and are gathered together."""
    return dtype_name(leaf.dtype), leaf.shape


@dataclass(frozen=True)
class Layout:
    """Where each leaf lives in ``data.bin`` (a pure function of schema and capacity)."""

    record_bytes: int  # bytes per slot in the record area at offset 0
    fields: dict[Key, int]  # small leaf -> byte offset inside a record
    columns: dict[Key, int]  # large leaf -> byte offset of its column in data.bin
    data_bytes: int

    def to_json(self) -> dict:
        return {"record_bytes": self.record_bytes, "data_bytes": self.data_bytes,
                "fields": {leaf_name(k): o for k, o in self.fields.items()},
                "columns": {leaf_name(k): o for k, o in self.columns.items()}}


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def plan_layout(schema: dict[Key, Leaf], capacity: int) -> Layout:
    """Fields ordered by falling item size (so no padding), equal groups side by side; the
    record padded to a power of two up to 64 bytes, else to whole cache lines."""
    import torch

    def itemsize(key: Key) -> int:
        return torch.empty((), dtype=schema[key].dtype).element_size()

    small = [k for k in schema if schema[k].row_bytes < LARGE_ROW_BYTES]
    fields: dict[Key, int] = {}
    pos = 0
    for key in sorted(small, key=lambda k: (-itemsize(k), group_of(schema[k]), k)):
        fields[key] = pos = _round_up(pos, itemsize(key))
        pos += schema[key].row_bytes
    record = 0 if pos == 0 else max(8, 1 << (pos - 1).bit_length()) if pos <= 64 else _round_up(pos, 64)
    end = _round_up(capacity * record, ALIGN)
    columns: dict[Key, int] = {}
    for key in sorted(k for k in schema if k not in fields):
        columns[key] = end
        end += _round_up(capacity * schema[key].row_bytes, ALIGN)
    return Layout(record, fields, columns, end)


def read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not path.is_dir():
        what = "is a file, not a storage directory" if path.exists() else "directory does not exist"
        raise StorageNotFound(f"no replay storage at {str(path)!r}: {what} "
                              "(check the path, or create the storage first)")
    if not meta_path.exists():
        raise StorageNotFound(f"no replay storage at {str(path)!r}: meta.json is missing "
                              "(the directory is not a storage, or its creation did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
        if meta["format"] != FORMAT:
            raise ValueError(f"format is {meta['format']!r}, expected {FORMAT!r}")
        if meta["version"] != VERSION:
            raise ValueError(f"format version {meta['version']} is not supported (this ingestd reads {VERSION})")
        meta["capacity"] = int(meta["capacity"])
        if meta["capacity"] <= 0:
            raise ValueError("capacity must be positive")
        meta["schema"] = schema = schema_from_json(meta["schema"])
        if any(d < 0 for leaf in schema.values() for d in leaf.shape):
            raise ValueError("a leaf has a negative dimension")
        layout = plan_layout(schema, meta["capacity"])
        if meta["layout"] != layout.to_json():
            raise ValueError("the leaf layout does not match the schema")
        meta["layout"] = layout
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptStorage(f"{meta_path}: unreadable metadata ({exc}); "
                             "restore it from a backup or move the directory away") from None
    return meta


def write_meta(path: Path, schema: dict[Key, Leaf], capacity: int) -> None:
    meta = {"format": FORMAT, "version": VERSION, "capacity": capacity, "schema": schema_to_json(schema),
            "layout": plan_layout(schema, capacity).to_json()}
    tmp = path / "meta.json.tmp"
    write_new(tmp, json.dumps(meta, indent=2, sort_keys=True).encode())
    os.replace(tmp, path / "meta.json")


def write_new(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Write ``data`` to ``path`` (a temporary name of ours), never through a link planted there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:  # a short write (a size limit, a full disk) raises on the next call
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


REPLAY_FILES = ("header.bin", "data.bin")  # what ``allocate`` creates


def replay_bytes(schema: dict[Key, Leaf], capacity: int) -> int:
    """What ``allocate`` allocates: the header and data files."""
    return header_bytes(capacity) + plan_layout(schema, capacity).data_bytes


def allocate(path: Path, schema: dict[Key, Leaf], capacity: int, need: int) -> None:
    """Create the header and data files with every block allocated (meta.json comes last).

    Allocating up front turns a full tmpfs or disk into a clear error here, instead of a
    SIGBUS in whichever worker first touches an unbacked page of a sparse file.
    ``need``: the bytes the whole storage takes (its priority tree too), for the message."""
    sizes = dict(zip(REPLAY_FILES, (header_bytes(capacity), plan_layout(schema, capacity).data_bytes)))
    try:
        for name, size in sizes.items():
            allocate_file(path / name, size)
    except OSError as exc:
        for name in sizes:
            (path / name).unlink(missing_ok=True)
        if exc.errno in NO_ROOM:
            raise no_room(path, capacity, need, exc) from exc
        raise
    header = np.memmap(path / "header.bin", dtype=np.int64, mode="r+", shape=(HEADER_WORDS + capacity,))
    header[H_MAGIC], header[H_VERSION], header[H_CAPACITY] = MAGIC, VERSION, capacity
    header.flush()
    del header


def check_room(path: Path, capacity: int, need: int) -> None:
    """Refuse, before allocating anything, a replay a memory file system (tmpfs) has no room for:
    allocating it first filled the tmpfs to the last block (other users of /dev/shm got ENOSPC or
    SIGBUS meanwhile) before the allocation failed. Elsewhere the allocation itself decides (free
    space is an estimate on btrfs or ZFS, and some network file systems report none)."""
    room = free_space(path)
    if room is not None and room[1] and room[0] < need:
        raise no_room(path, capacity, need, None, f"only {human_bytes(room[0])} free")


def free_space(path: Path) -> tuple[int, bool] | None:
    """``(bytes a replay created at path may take, whether that is a memory file system)``: the
    file system's free space where ``path`` is or would be created (its nearest existing
    ancestor), plus what the files of an interrupted create there hold (``create`` truncates
    them); None if that cannot be told."""
    try:
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        fs = os.statvfs(existing) if existing is not None else None
        leftovers = sum((path / name).stat().st_blocks * 512 for name in (*REPLAY_FILES, "priority.bin")
                        if (path / name).is_file()) if existing == path else 0
    except OSError:  # no access to look
        return None
    if fs is None or not fs.f_blocks:
        return None
    return fs.f_bavail * fs.f_frsize + leftovers, _memory_fs(existing)


_MEMORY_FS = (0x01021994, 0x858458F6)  # statfs f_type of tmpfs and ramfs (linux/magic.h)


def _memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs or ramfs, from ``statfs``'s ``f_type`` (the file system
    really mounted there: over-mounts, bind mounts and escaped mount points need no lookup)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on 64-bit Linux); f_type first
        if libc.statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return ctypes.c_long.from_buffer(buf).value in _MEMORY_FS


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def no_room(path: Path, capacity: int, need: int, exc: OSError | None, why: str = "") -> StorageFull:
    """The error for a replay that does not fit where it is to be created."""
    why = why or getattr(exc, "strerror", None) or os.strerror(errno.ENOSPC)
    return StorageFull(f"no room for a replay of {capacity} rows at {path}: it needs {need / 2**20:.1f} MiB with "
                       f"its priority tree ({why}); lower replay.capacity or choose a replay.path with space. If "
                       f"the files there do not account for the space in use, processes may still map a removed "
                       f"replay (a trainer attached before a restart): `lsof +L1 {path.parent}` lists them")


NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a full file system, a file-size limit, a quota
# the files trainers write (priorities, the limiter's counters, the priority lock): read and write
# for the owner and the group, whatever the umask (the unit's UMask=0027 would make them 0640, and a
# trainer in the daemon's group could then sample but not update priorities or take part in limiting)
TRAINER_WRITABLE = 0o660


def allocate_file(file: Path, size: int) -> None:
    """Create ``file`` of ``size`` bytes, its blocks allocated with posix_fallocate where the file
    system has it (tmpfs, ext4, xfs; elsewhere it stays sparse). Raises an ``OSError`` whose
    errno is in ``NO_ROOM`` when there is no room."""
    # never through a planted link; 0640 whatever the umask (with 002, a trainer in the group
    # could have overwritten rows): only the files trainers write are group-writable (TRAINER_WRITABLE)
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
    try:
        reserve(fd, size)
    finally:
        os.close(fd)


def reserve(fd: int, size: int) -> None:
    """Size the open file ``fd`` to ``size`` bytes with its blocks allocated where the file system
    can (a mapping of a sparse file SIGBUSes the first process that touches a page a full
    file system cannot back; this raises ENOSPC here instead)."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def map_file(file: Path, size: int, writable: bool) -> mmap.mmap | None:
    try:
        fd = os.open(file, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptStorage(f"{file} is missing; the storage is incomplete") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptStorage(f"{file} has {actual} bytes, expected {size}; the storage is damaged")
        if size == 0:
            return None
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)


def map_header(path: Path, capacity: int, writable: bool) -> tuple[mmap.mmap, np.ndarray]:
    file = path / "header.bin"
    mm = map_file(file, header_bytes(capacity), writable)
    header = np.frombuffer(mm, dtype=np.int64)
    if header[H_MAGIC] != MAGIC or header[H_CAPACITY] != capacity:
        del header
        mm.close()
        raise CorruptStorage(f"{file}: bad magic or capacity; the header does not belong to this storage")
    return mm, header


def leaf_arrays(buffer, schema: dict[Key, Leaf], layout: Layout, capacity: int) -> dict[Key, np.ndarray]:
    """``(capacity, *shape)`` numpy views of every leaf inside the mapped ``data.bin``
    (strided through the records for small leaves, contiguous for columns)."""
    out = {}
    for key, leaf in schema.items():
        dtype = numpy_dtype(leaf.dtype)
        inner: list[int] = []
        step = dtype.itemsize
        for dim in reversed(leaf.shape):
            inner.insert(0, step)
            step *= dim
        if key in layout.fields:
            offset, strides = layout.fields[key], (layout.record_bytes, *inner)
        else:
            offset, strides = layout.columns[key], (leaf.row_bytes, *inner)
        out[key] = np.ndarray((capacity, *leaf.shape), dtype, buffer, offset, strides)
    return out


def record_array(buffer, layout: Layout, capacity: int) -> np.ndarray:
    """The record area as ``capacity`` opaque items of ``record_bytes`` (one fancy-index gathers rows)."""
    return np.ndarray((capacity,), np.dtype(f"V{layout.record_bytes}"), buffer, 0)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s pages (read-only mappings included; we never write through them)."""
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


# -- per-slot write locks ------------------------------------------------------
# Open-file-description locks: owned by one open() of the lock file (so two
# handles in one process exclude each other) and dropped by the kernel when
# the holder dies. ``struct flock`` on Linux: short, short, off_t, off_t, pid_t.
_FLOCK = struct.Struct("hhqqi4x")
_SETLKW = getattr(fcntl, "F_OFD_SETLKW", fcntl.F_SETLKW)
_SETLK = getattr(fcntl, "F_OFD_SETLK", fcntl.F_SETLK)


_LOCK_FILES: dict[int, tuple[str, int, int]] = {}  # descriptor -> (absolute path, device, inode)


def open_lock_file(path, flags: int = os.O_RDWR, mode: int = 0o666, owner: object = None) -> int:
    """Open a file this process locks through (``flocked``, slot locks). A forked child opens
    it again on the same descriptor number (:func:`_reopen_lock_files`). With ``owner``, the
    descriptor is closed when the owner is garbage-collected without closing it (a trainer
    dropping readers without ``close()`` leaked one or two descriptors per reader)."""
    fd = os.open(path, flags, mode)
    st = os.fstat(fd)
    entry = (os.path.abspath(path), st.st_dev, st.st_ino)  # absolute: a chdir does not move it
    _LOCK_FILES[fd] = entry
    if owner is not None:
        weakref.finalize(owner, _close_if_still_open, fd, entry)
    return fd


def _close_if_still_open(fd: int, entry: tuple) -> None:
    """Close ``fd`` if it is still the lock file opened as ``entry`` (not closed already and
    the number reused for another file since)."""
    if _LOCK_FILES.get(fd) is entry:
        close_lock_file(fd)


def close_lock_file(fd: int) -> None:
    _LOCK_FILES.pop(fd, None)
    os.close(fd)


def _reopen_lock_files() -> None:
    """In a forked child: ``flock`` and open-file-description locks belong to the open file,
    which a fork shares, so a parent and its forked children (DataLoader workers sampling
    through one reader) would not exclude each other: limiter counts were lost. Each lock
    file is opened anew, on the same descriptor number (a file gone or replaced since keeps the
    shared description: locking another storage's file would be worse)."""
    for fd, (path, device, inode) in list(_LOCK_FILES.items()):
        try:
            fresh = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fresh)
        if (st.st_dev, st.st_ino) == (device, inode):
            os.dup2(fresh, fd, inheritable=False)
        os.close(fresh)


os.register_at_fork(after_in_child=_reopen_lock_files)


@contextmanager
def flocked(fd: int, *, wait: Callable[[], None] | None = None, timeout: float | None = None,
            name: str = "a lock file") -> Iterator[None]:
    """An exclusive ``flock`` on ``fd`` for the block (the kernel drops it if the holder dies).

    Lock files trainers write (``priority.lock``, ``limiter.bin``) can be held for as long as a
    trainer is stopped inside a call (Ctrl-Z, a debugger, SIGSTOP). So a worker passes ``wait``
    (its heartbeat, called while it waits: it is not taken for hung and killed), and the
    daemon's main thread a ``timeout`` (``LockBusy`` after it: supervision goes on). With
    neither, it blocks (a trainer)."""
    try:  # taken inside the try: a KeyboardInterrupt raised as flock returns must not leave it held
        take_flock(fd, wait=wait, timeout=timeout, name=name)  # (unlocking a lock not taken does nothing)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def take_flock(fd: int, *, wait: Callable[[], None] | None = None, timeout: float | None = None,
               name: str = "a lock file") -> None:
    """Take the exclusive ``flock`` of :func:`flocked`, without releasing it."""
    if wait is None and timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    else:
        _poll_flock(fd, wait, timeout, name)


_LOCK_WARN_S = 5.0  # a wait this long is logged once (naming the file)


def _poll_flock(fd: int, wait: Callable[[], None] | None, timeout: float | None, name: str) -> None:
    start = time.monotonic()
    delay, warned = 0.0002, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise LockBusy(f"{name} is locked by another process (a trainer stopped inside a call, e.g. by "
                           f"Ctrl-Z or a debugger?) for {waited:.1f} s; try again, or find it with "
                           f"`fuser {name}`")
        if not warned and waited >= _LOCK_WARN_S:
            warned = True
            log.warning("waiting %.0f s for %s, locked by another process (a trainer stopped inside a call, "
                        "e.g. by Ctrl-Z or a debugger?); `fuser %s` names it", waited, name, name)
        if wait is not None:
            wait()
        time.sleep(delay)
        delay = min(2 * delay, 0.01)


def unmap(mm: mmap.mmap) -> None:
    """Close a mapping; if a caller still holds a view of it, it goes when that view does."""
    try:
        mm.close()
    except BufferError:
        pass


def lock_slots(fd: int, first: int, count: int) -> None:
    """Write-lock slots ``[first, first+count)``, waiting for a writer still filling them."""
    fcntl.fcntl(fd, _SETLKW, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, first, count, 0))


def try_lock_slots(fd: int, first: int, count: int) -> bool:
    """Write-lock slots ``[first, first+count)`` if no other handle holds any of them; whether it did."""
    try:
        fcntl.fcntl(fd, _SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, first, count, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):  # (EACCES: a classic lock, without OFD locks)
            return False
        raise
    return True


def unlock_slots(fd: int, first: int, count: int) -> None:
    fcntl.fcntl(fd, _SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, first, count, 0))


def segments(start: int, n: int, capacity: int) -> list[tuple[slice, slice]]:
    """The (slot slice, batch slice) pairs covering write indices ``[start, start+n)`` of a
    ring of ``capacity`` slots: one, or two where the range wraps."""
    first = start % capacity
    head = min(n, capacity - first)
    parts = [(slice(first, first + head), slice(0, head))]
    if head < n:
        parts.append((slice(0, n - head), slice(head, n)))
    return parts
