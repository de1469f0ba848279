"""Snapshots: a compressed copy of a replay storage, taken while workers keep writing.

::

    <snapshot>/meta.json       the storage's own meta.json (format, schema, capacity, layout)
    <snapshot>/snapshot.json   this format's name and version, write_count, incarnations,
                               rows, skipped, block_rows, priorities, max_priority, nstep
                               (the rows' n-step settings, or null), written_at, and sha256 (of meta.json's bytes and the
                               other values of snapshot.json)
    <snapshot>/seq.lz4         one int64 sequence number per slot; 0 for slots left out
    <snapshot>/priority.lz4    one float64 priority-tree leaf per slot (when the storage had a
                               tree, as every storage a daemon wrote has: ``priorities``)
    <snapshot>/data.lz4        for each block of ``block_rows`` slots: the block's records,
                               then each column's rows of the block (raw bytes)

The ``.lz4`` files are lz4 frames with block and content checksums, and ``sha256``
covers the two ``.json`` files, so a damaged snapshot is refused on restore rather than
restored wrong.

**Consistency without stopping anyone.** A block of slots is copied between two
reads of its sequence numbers, as a sample is: a slot whose number changed during
the copy, or was odd (being written), is left out (its number is stored as 0, so it
reads as never written). Every row in a snapshot is a committed row, intact. Rows a
worker commits while the snapshot runs may or may not be in it.

**Atomic.** A snapshot is written to ``.<name>.partial-<pid>-<tid>`` beside its destination,
synced, and renamed into place: a directory with the destination's name is always
complete. A restore builds the new storage the same way.

Priorities are kept: the restored rows have the leaves (``(priority + eps) ** alpha``) they
had (a row whose leaf was still 0, committed by a writer that died before entering it, gets
the maximum, as recovery gives it), and new rows enter at the same maximum. Not in a
snapshot: the rate limiter's counters (a restored storage starts with the limiter's error at 0).
"""
from __future__ import annotations

import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import lz4.frame
import numpy as np

from ingestd.errors import BadSnapshot, CorruptStorage, SnapshotExists, StorageFull
from ingestd.replay import files, nstep_record, priority
from ingestd.replay.schema import schema_of
from ingestd.replay.storage import MappedStore, ReplayStorage, storage_bytes

log = logging.getLogger("ingestd.replay")

FORMAT = "ingestd-replay-snapshot"
VERSION = 1
BLOCK_BYTES = 16 << 20  # bytes of rows copied between two reads of their sequence numbers
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
_LZ4 = {"block_checksum": True, "content_checksum": True}


@dataclass(frozen=True)
class SnapshotInfo:
    path: str
    capacity: int
    write_count: int
    rows: int  # committed rows in the snapshot
    skipped: int  # rows being written (or rewritten) during the copy, left out
    bytes: int  # size of the snapshot on disk
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def check_name(name: str) -> str:
    """A snapshot name: a plain file name (letters, digits, ``.``, ``_``, ``-``; 1 to 100
    characters, not starting with ``.``). Raises ``ValueError`` otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"snapshot name {name!r} is not allowed: use 1 to 100 letters, digits, '.', '_' "
                         "or '-', not starting with '.'")
    return name


def save(replay_path: str | os.PathLike, dest: str | os.PathLike) -> SnapshotInfo:
    """Copy every committed row of the storage at ``replay_path`` into the new snapshot
    directory ``dest`` (its parent must exist). Safe while workers write."""
    started = time.monotonic()
    dest = Path(dest)
    if dest.exists():
        raise SnapshotExists(f"{dest} already exists; choose another snapshot name or path")
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"cannot write the snapshot {dest}: {dest.parent} does not exist (create it first)")
    store = MappedStore(replay_path, writable=False)  # (a snapshot given here: StorageNotFound, saying so)
    _remove_dead_partials(dest)
    tmp = _partial(dest)
    try:
        tmp.mkdir(mode=0o700)  # nobody else's until _as_the_replay opens it as the replay is
        shutil.copyfile(Path(replay_path) / "meta.json", tmp / "meta.json")
        seq, block, skipped = _copy_rows(store, tmp / "data.lz4")
        _write_lz4(tmp / "seq.lz4", [seq.tobytes()])
        top = _save_priorities(Path(replay_path), store.capacity, tmp / "priority.lz4")
        header = store._header
        info = {"format": FORMAT, "version": VERSION, "capacity": store.capacity,
                "write_count": int(header[files.H_WRITE_COUNT]),  # read last: above every copied row's index
                "incarnations": int(header[files.H_INCARNATIONS]), "rows": int(np.count_nonzero(seq)),
                "skipped": skipped, "block_rows": block, "priorities": top is not None, "max_priority": top,
                "nstep": nstep_record.read(Path(replay_path)),  # the rows' n-step settings (None: 1-step rows)
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        info["sha256"] = _digest(tmp / "meta.json", info)
        (tmp / "snapshot.json").write_text(json.dumps(info, indent=2))
        _as_the_replay(tmp, Path(replay_path))
        _publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        store.close()
    return SnapshotInfo(str(dest), info["capacity"], info["write_count"], info["rows"], skipped,
                        _size(dest), round(time.monotonic() - started, 6))


def restore(snapshot: str | os.PathLike, dest: str | os.PathLike) -> SnapshotInfo:
    """Create a new storage at ``dest`` (which must not exist) holding the snapshot's rows,
    ``write_count``, incarnations and priorities. Open it with ``ReplayStorage.open`` or point
    the daemon's ``replay.path`` at it."""
    started = time.monotonic()
    snapshot, dest = Path(snapshot), Path(dest)
    info, meta = read_info(snapshot)
    if dest.exists():
        raise SnapshotExists(f"{dest} already exists; restore into a new path (nothing was changed)")
    capacity = meta["capacity"]
    seq = np.frombuffer(_read_lz4(snapshot / "seq.lz4", [8 * capacity])[0], dtype=np.int64)
    _check_seq(snapshot, seq, info["write_count"], capacity)
    leaves = None
    if info["priorities"]:
        leaves = np.frombuffer(_read_lz4(snapshot / "priority.lz4", [8 * capacity])[0], dtype=np.float64)
        if not (np.isfinite(leaves).all() and (leaves >= 0).all()):
            raise BadSnapshot(f"{snapshot}/priority.lz4 holds priorities that are negative or not finite")
    _remove_dead_partials(dest)
    tmp = _partial(dest)
    try:
        try:
            store = ReplayStorage.create(tmp, meta["schema"], capacity)
        except StorageFull:  # its advice (replay.capacity, replay.path) is for `ingestd run`
            vfs = os.statvfs(dest.parent)
            need = storage_bytes(schema_of(meta["schema"]), capacity)
            raise StorageFull(f"no room to restore {snapshot} at {dest}: it needs {need / 2**20:.1f} MiB, "
                              f"{vfs.f_bavail * vfs.f_frsize / 2**20:.1f} MiB are free there (the capacity is the "
                              "snapshot's); free space, or restore to another dest") from None
        with store:
            if store._layout != meta["layout"]:
                raise BadSnapshot(f"{snapshot}: its layout differs from the one this ingestd builds for its schema")
            _fill_rows(store, snapshot / "data.lz4", info["block_rows"])
            with store._locked():
                store.seq[:] = seq  # last: until here every slot reads as never written
                store._header[files.H_WRITE_COUNT] = info["write_count"]
                store._header[files.H_INCARNATIONS] = info["incarnations"]
            _restore_priorities(store._priorities, seq, leaves, info["max_priority"])
        if info.get("nstep"):  # (absent from snapshots older than the record)
            nstep_record.write(tmp, **info["nstep"])
        _publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return SnapshotInfo(str(dest), capacity, info["write_count"], int(np.count_nonzero(seq)), info["skipped"],
                        _size(snapshot), round(time.monotonic() - started, 6))


def read_info(snapshot: str | os.PathLike) -> tuple[dict, dict]:
    """``(snapshot.json, the storage's meta)`` of a snapshot directory, validated."""
    snapshot = Path(snapshot)
    if not snapshot.is_dir():
        raise BadSnapshot(f"no snapshot at {str(snapshot)!r}: not a directory")
    if not (snapshot / "snapshot.json").exists() and (snapshot / "header.bin").exists():
        raise BadSnapshot(f"{snapshot} is a replay storage, not a snapshot: snapshot it first (`ingestd replay "
                          "snapshot REPLAY DEST`, or `ingestctl snapshot` while the daemon runs), or attach to it as is")
    try:
        info = json.loads((snapshot / "snapshot.json").read_text())
        if not isinstance(info, dict):
            raise ValueError("snapshot.json does not hold an object")
        if info.get("format") != FORMAT:
            raise ValueError(f"format is {info.get('format')!r}, expected {FORMAT!r}")
        if info.get("version") != VERSION:
            raise ValueError(f"version {info.get('version')} is not supported (this ingestd reads {VERSION})")
        for key in ("capacity", "write_count", "incarnations", "rows", "skipped", "block_rows"):
            if isinstance(info.get(key), bool) or not isinstance(info.get(key), int) or info[key] < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {info.get(key)!r}")
        if info["block_rows"] < 1:
            raise ValueError("block_rows must be positive")
        if not isinstance(info.get("priorities"), bool):
            raise ValueError(f"priorities must be true or false, got {info.get('priorities')!r}")
        top = info.get("max_priority")
        if info["priorities"] and (isinstance(top, bool) or not isinstance(top, (int, float))
                                   or not np.isfinite(top) or top < 0):
            raise ValueError(f"max_priority must be a finite number >= 0, got {top!r}")
        nstep = info.get("nstep")
        if nstep is not None and not nstep_record.valid(nstep):
            raise ValueError(f"nstep must be null or {nstep_record.FORM}, got {nstep!r}")
        if info.get("sha256") != _digest(snapshot / "meta.json", info):
            raise ValueError("snapshot.json or meta.json was changed or damaged (their sha256 does not match)")
        meta = files.read_meta(snapshot)
        if meta["capacity"] != info["capacity"]:
            raise ValueError(f"capacity {info['capacity']} differs from meta.json's {meta['capacity']}")
    except (OSError, ValueError, CorruptStorage) as exc:
        _raise_if_io(exc)
        raise BadSnapshot(f"{snapshot} is not a usable snapshot: {exc}") from None
    return info, meta


# errors reading a snapshot that say nothing about its data: raised as they are (no access, a
# failing disk, no memory or descriptors), not as a damaged snapshot
_IO_ERRNOS = frozenset((errno.EACCES, errno.EPERM, errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE))


def _raise_if_io(exc: BaseException) -> None:
    if isinstance(exc, OSError) and exc.errno in _IO_ERRNOS:
        raise exc


# -- rows ----------------------------------------------------------------------------------------
def _copy_rows(store: MappedStore, path: Path) -> tuple[np.ndarray, int, int]:
    """Write the rows block by block; ``(seq with the left-out slots at 0, block_rows, skipped)``."""
    capacity = store.capacity
    row_bytes = sum(view.nbytes for view in _block_views(store, 0, 1))
    block = max(1, BLOCK_BYTES // max(1, row_bytes))
    out = np.zeros(capacity, dtype=np.int64)
    skipped = 0
    with lz4.frame.open(path, "wb", **_LZ4) as f:
        for lo in range(0, capacity, block):
            hi = min(capacity, lo + block)
            before = store.seq[lo:hi].copy()
            parts = _read_block(store, lo, hi)
            after = store.seq[lo:hi]
            ok = (before == after) & (before > 0) & ((before & 1) == 0)
            out[lo:hi] = np.where(ok, before, 0)
            skipped += int(np.count_nonzero(before)) - int(np.count_nonzero(ok))
            for part in parts:
                f.write(part)
    return out, block, skipped


def _block_views(store: MappedStore, lo: int, hi: int) -> list[np.ndarray]:
    """Slots ``[lo, hi)`` of the mapped storage as they are laid out in ``data.lz4``: their
    records, then each column."""
    return [store._records[lo:hi]] + [store._arrays[k][lo:hi] for k in store._layout.columns]


def _read_block(store: MappedStore, lo: int, hi: int) -> list[bytes]:
    """The raw bytes of slots ``[lo, hi)`` (a separate step so that tests can write into the
    slots while they are being read)."""
    return [view.tobytes() for view in _block_views(store, lo, hi)]


def _fill_rows(store: ReplayStorage, path: Path, block: int) -> None:
    capacity = store.capacity
    try:
        with lz4.frame.open(path, "rb") as f:
            for lo in range(0, capacity, block):
                hi = min(capacity, lo + block)
                for target in _block_views(store, lo, hi):
                    data = f.read(target.nbytes)
                    if len(data) != target.nbytes:
                        raise BadSnapshot(f"{path} is truncated (slots {lo}..{hi - 1} incomplete)")
                    np.copyto(target.reshape(-1).view(np.uint8), np.frombuffer(data, dtype=np.uint8))
            if f.read(1):  # also makes lz4 check the frame's content checksum
                raise BadSnapshot(f"{path} holds more data than its storage's capacity")
    except (RuntimeError, EOFError, OSError) as exc:
        _raise_if_io(exc)
        raise BadSnapshot(f"{path} is damaged: {exc}") from None


def _save_priorities(replay_path: Path, capacity: int, path: Path) -> float | None:
    """Write the tree's leaves to ``path``; the maximum leaf, or None when there is no tree
    (a storage never opened for writing) or it cannot be read (the rows are still saved)."""
    if not (replay_path / priority.FILE).exists():
        return None
    try:
        tree = priority.PriorityTree(replay_path, capacity)
    except (OSError, ValueError):
        return None
    try:
        _write_lz4(path, [tree.levels[0][:capacity].tobytes()])
        return tree.max_leaf
    finally:
        tree.close()


def _restore_priorities(tree: priority.PriorityTree, seq: np.ndarray, leaves: np.ndarray | None,
                        top: float | None) -> None:
    """The kept rows' leaves, and the maximum. A kept row without a leaf (no saved priorities,
    or a 0 leaf: committed by a writer that died before entering it) gets the maximum, as
    recovery gives it."""
    kept = np.flatnonzero(seq)
    top_leaf = priority.DEFAULT_MAX if top is None else top
    values = np.zeros(kept.size) if leaves is None else leaves[kept]
    tree.update(kept, np.where(values > 0, values, top_leaf))
    if top is not None:
        with tree.locked():
            tree._max[0] = top


def _check_seq(snapshot: Path, seq: np.ndarray, write_count: int, capacity: int) -> None:
    """Every kept slot must hold a committed row written before ``write_count``, at its own slot."""
    slots = np.flatnonzero(seq)
    kept = seq[slots]
    if kept.size and ((kept & 1).any() or kept.min() < 2 or (kept.max() - 2) // 2 >= write_count
                      or ((kept - 2) // 2 % capacity != slots).any()):
        raise BadSnapshot(f"{snapshot}/seq.lz4 holds sequence numbers that no committed row can have")


def _digest(meta: Path, info: dict) -> str:
    """sha256 of ``meta``'s bytes and ``info``'s values but its own (the .lz4 files check themselves)."""
    fields = json.dumps({k: v for k, v in info.items() if k != "sha256"}, sort_keys=True)
    return hashlib.sha256(meta.read_bytes() + fields.encode()).hexdigest()


# -- files ---------------------------------------------------------------------------------------
def _write_lz4(path: Path, parts: list[bytes]) -> None:
    with lz4.frame.open(path, "wb", **_LZ4) as f:
        for part in parts:
            f.write(part)


def _read_lz4(path: Path, sizes: list[int]) -> list[bytes]:
    try:
        with lz4.frame.open(path, "rb") as f:
            out = [f.read(size) for size in sizes]
            extra = f.read(1)
    except (RuntimeError, EOFError, OSError) as exc:
        _raise_if_io(exc)
        raise BadSnapshot(f"{path} is damaged: {exc}") from None
    if extra or [len(part) for part in out] != sizes:
        raise BadSnapshot(f"{path} has the wrong size for its storage's capacity")
    return out


def remove_stale_partials(folder: Path, alive: Callable[[int], bool], name: str | None = None) -> list[Path]:
    """Remove the partial snapshots a killed writer left in ``folder`` (``.<name>.partial-<pid>-<tid>``
    of a process ``alive`` says is gone, or of this one, which writes one snapshot at a time and is
    not writing now); they would fill the disk for ever. With ``name``, only the partials of that
    destination, and none of this process (another of its threads may be writing it). Returns what
    was removed."""
    removed = []
    for entry in folder.glob(".*.partial-*-*" if name is None else f"{glob.escape(f'.{name}.partial-')}*-*"):
        match = _PARTIAL.fullmatch(entry.name)
        if match is None or not entry.is_dir():
            continue
        pid = int(match[1])
        own = pid == os.getpid()
        if (own and name is not None) or (not own and alive(pid)):
            continue  # another process (`ingestd replay snapshot`), or thread, is writing it now
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


_PARTIAL = re.compile(r"\..+\.partial-(\d+)-(\d+)")


def sweep(folder: Path) -> None:
    """Remove the partial snapshots that killed processes left in ``folder`` (the daemon's
    snapshots dir: as it starts, and before each snapshot). A daemon SIGKILLed mid-snapshot
    left one, as large as the replay, until the next snapshot (chaos review)."""
    from ingestd.collect.stats import pid_alive

    if folder.is_dir():
        for entry in remove_stale_partials(folder, pid_alive):
            log.warning("removed %s, a snapshot a killed process left half-written", entry)


def _remove_dead_partials(dest: Path) -> None:
    """Before writing ``dest``: remove the partials of ``dest`` that a process killed by SIGKILL
    left (a restore preallocates the whole storage: on a tmpfs it held that much memory, and
    the retry found no room, naming only its own partial). Those of live processes stay."""
    from ingestd.collect.stats import pid_alive

    if dest.parent.is_dir():
        for entry in remove_stale_partials(dest.parent, pid_alive, dest.name):
            log.warning("removed %s, left half-written by a killed process", entry)


def _partial(dest: Path) -> Path:
    """Private to this thread: two threads snapshotting to one destination never share it. A
    ``dest`` name valid on its own but too long with the suffix is refused, saying so (it was
    a bare "File name too long" naming the partial)."""
    name = f".{dest.name}.partial-{os.getpid()}-{threading.get_native_id()}"
    extra = len(os.fsencode(name)) - len(os.fsencode(dest.name))
    if len(os.fsencode(name)) > _NAME_MAX:
        raise OSError(errno.ENAMETOOLONG, f"the name {dest.name[:40]!r}... is too long: at most {_NAME_MAX - extra} "
                                          "bytes here (it is first written under a longer, partial name); choose a "
                                          "shorter one")
    return dest.with_name(name)


_NAME_MAX = 255  # bytes of a file name (Linux file systems)


def _as_the_replay(tmp: Path, replay: Path) -> None:
    """The snapshot's modes as its replay's: the directory's as the replay directory's, each
    file's as its ``data.bin``'s, whatever the umask of the process saving it (walkthrough
    review: a snapshot of a 0750 replay was 0755, its rows in 0644 files, under umask 022).
    Only the regular files the save wrote are changed (the partial dir is 0700 until here)."""
    files_mode = (replay / "data.bin").stat().st_mode & 0o666
    for entry in tmp.iterdir():
        if entry.is_file() and not entry.is_symlink():
            os.chmod(entry, files_mode)
    os.chmod(tmp, replay.stat().st_mode & 0o2777)  # (setgid kept: new files stay in the group)


def _publish(tmp: Path, dest: Path) -> None:
    """Sync ``tmp``'s files and rename it to ``dest`` (refused if ``dest`` appeared meanwhile)."""
    for entry in tmp.iterdir():
        if entry.is_file():
            _fsync(entry, os.O_RDONLY)
    _fsync(tmp, os.O_RDONLY | os.O_DIRECTORY)
    appeared = SnapshotExists(f"{dest} appeared while it was being written; nothing was replaced")
    if dest.exists():
        raise appeared
    try:
        os.rename(tmp, dest)
    except OSError as exc:  # another saver's rename landed between the check and this one
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise appeared from None
        raise
    _fsync(dest.parent, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file())
