"""The on-disk (or tmpfs) form of a replay storage directory.

::

    <path>/meta.json          format, version, capacity, schema (written last)
    <path>/header.bin         int64 words: magic, version, capacity, write_count,
                              incarnations, reserved..., then one seq per slot
    <path>/lock               flock target for slot reservation
    <path>/leaves/<key>.bin   one memmap per leaf, leading dimension = capacity

A slot's sequence number is the seqlock *and* the sentinel: ``0`` never
written (or cleared by recovery), ``2*w+1`` being written as write index
``w``, ``2*w+2`` committed as write index ``w``.
"""
from __future__ import annotations

import json
import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ingestd.errors import CorruptStorage, StorageNotFound
from ingestd.replay.layout import Key, Leaf, leaf_name, numpy_dtype, schema_from_json, schema_to_json

FORMAT = "ingestd-replay"
VERSION = 1
MAGIC = 0x494E47455354_0001  # "INGEST" + 1

HEADER_WORDS = 64
H_MAGIC, H_VERSION, H_CAPACITY, H_WRITE_COUNT, H_INCARNATIONS = 0, 1, 2, 3, 4


def header_bytes(capacity: int) -> int:
    return 8 * (HEADER_WORDS + capacity)


def read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not path.is_dir():
        raise StorageNotFound(f"no replay storage at {str(path)!r}: directory does not exist "
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
        meta["schema"] = schema_from_json(meta["schema"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptStorage(f"{meta_path}: unreadable metadata ({exc}); "
                             "restore it from a backup or move the directory away") from None
    return meta


def write_meta(path: Path, schema: dict[Key, Leaf], capacity: int) -> None:
    meta = {"format": FORMAT, "version": VERSION, "capacity": capacity, "schema": schema_to_json(schema)}
    tmp = path / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, path / "meta.json")


def leaf_path(path: Path, key: Key) -> Path:
    return path / "leaves" / f"{leaf_name(key)}.bin"


def allocate(path: Path, schema: dict[Key, Leaf], capacity: int) -> None:
    """Create sparse files for the header and every leaf (meta.json comes last)."""
    (path / "leaves").mkdir(parents=True, exist_ok=True)
    (path / "lock").touch()
    with open(path / "header.bin", "wb") as f:
        f.truncate(header_bytes(capacity))
    header = np.memmap(path / "header.bin", dtype=np.int64, mode="r+", shape=(HEADER_WORDS + capacity,))
    header[H_MAGIC], header[H_VERSION], header[H_CAPACITY] = MAGIC, VERSION, capacity
    header.flush()
    del header
    for key, leaf in schema.items():
        with open(leaf_path(path, key), "wb") as f:
            f.truncate(capacity * leaf.row_bytes)


def _map(file: Path, size: int, writable: bool) -> mmap.mmap:
    try:
        fd = os.open(file, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptStorage(f"{file} is missing; the storage is incomplete") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptStorage(f"{file} has {actual} bytes, expected {size}; the storage is damaged")
        if size == 0:
            return None  # type: ignore[return-value]
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)


def map_tensor(file: Path, leaf: Leaf, capacity: int, writable: bool) -> tuple[mmap.mmap | None, torch.Tensor]:
    """Map a leaf file as a tensor of shape ``(capacity, *leaf.shape)`` sharing the pages."""
    size = capacity * leaf.row_bytes
    mm = _map(file, size, writable)
    shape = (capacity, *leaf.shape)
    if mm is None:
        return None, torch.empty(shape, dtype=leaf.dtype)
    arr = np.frombuffer(mm, dtype=numpy_dtype(leaf.dtype)).reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mapping; we never write through it
        return mm, torch.from_numpy(arr)


def map_header(path: Path, capacity: int, writable: bool) -> tuple[mmap.mmap, np.ndarray]:
    file = path / "header.bin"
    mm = _map(file, header_bytes(capacity), writable)
    header = np.frombuffer(mm, dtype=np.int64)
    if header[H_MAGIC] != MAGIC or header[H_CAPACITY] != capacity:
        raise CorruptStorage(f"{file}: bad magic or capacity; the header does not belong to this storage")
    return mm, header
