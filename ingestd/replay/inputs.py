"""What a trainer hands a reader, checked (row counts, slot indices, timeouts), and what the
host tells it (the memory available, a file's identity, a DataLoader worker's seed): shared
by the reader, its samplers and the weight store's follower."""
from __future__ import annotations

import operator
import os
import sys
import time

import numpy as np
import torch


def file_identity(path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, None if there is none (other errors looking at
    it are raised): a file replaced by a new one under the same name has a new identity."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


def wait_deadline(timeout) -> float | None:
    """The ``time.monotonic()`` deadline of a sampling ``timeout`` (None: do not wait); a
    timeout must be None or a number of seconds >= 0 (``math.inf``: wait for ever)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r} ({type(timeout).__name__})")
    if not timeout >= 0:  # NaN too: a NaN deadline would never pass
        raise ValueError(f"timeout must be >= 0 seconds (or None: do not wait), got {timeout}")
    return time.monotonic() + float(timeout)


def available_memory() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes (None where there is none to read)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rows_count(value, name: str) -> int:
    """``value`` as a positive number of rows (any integer type: numpy's, a 0-d tensor); a float
    or a bool is refused rather than rounded."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer number of rows, got {value!r} "
                        f"({type(value).__name__}); pass an int") from None
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {n}")
    return n


def slot_indices(value, name: str) -> np.ndarray:
    """``value`` (a sequence, array or tensor of integers: slot numbers or write indices) as a
    flat int64 array; floats are refused rather than truncated to another slot or row."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}; pass the sample's "
                        f"('ingestd', {name!r}) or an integer array")
    return array.astype(np.int64).reshape(-1)


def child_seed(seed) -> np.random.SeedSequence | None:
    """The seed of a reader's stream in a child process: ``seed`` and the DataLoader worker's
    torch seed (drawn per worker and epoch from the trainer's torch generator), or None (OS
    entropy) without either."""
    data = sys.modules.get("torch.utils.data")
    if not isinstance(seed, (int, np.integer)) or data is None:
        return None
    info = data.get_worker_info()
    if info is None:
        return None
    return np.random.SeedSequence([int(seed) & (2**64 - 1), int(info.seed) & (2**64 - 1)])


def check_seed(seed) -> None:
    """A reader's ``seed``: None or a whole number (``ReplayReader(path, "prioritized")`` put the
    sampler there, and numpy's error said nothing of it; ``True`` sampled uniformly in silence)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"seed must be a whole number or None, got {seed!r} (the sampler is a keyword: "
                        "ReplayReader(path, sampler='prioritized'))")
