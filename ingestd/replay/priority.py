"""The shared priority tree for prioritized sampling (``priority.bin`` beside the storage).

::

    <replay>/priority.bin    int64/float64 words: magic, capacity, leaves, levels, max leaf (f64),
                             changing (1 while a change is under way), reserved..., then the
                             tree levels, leaves first
    <replay>/priority.lock   flock target serialising every change to the tree

The tree is a ``K``-ary sum tree (``K = 16``) of float64: level 0 holds one
leaf per slot (padded with zeros to a power of ``K``), each level above holds
the sums of ``K`` consecutive entries of the one below, the last level is the
root (the total). Wide nodes keep the tree shallow: 1M slots is 5 levels, so a
change re-sums 5 short runs.

A batch finds its leaves (:meth:`PriorityTree.descend`) by searching the widest
level of at most ``TOP_NODES`` nodes whole, with one ``cumsum`` and one
``searchsorted`` (cheaper than descending the levels above it one by one), and
then descending the levels below it, one vectorised step per level (2 at 1M slots).

A leaf holds ``(priority + eps) ** alpha`` (the reader that updates applies its
``alpha``); ``0`` means "not sampleable" (never written). Parents are always
recomputed from their children (never adjusted by differences), so float error
cannot drift.

Concurrency: every change (writers entering new rows, trainers updating
priorities) takes ``priority.lock`` (and the handle's thread lock: threads share
the flock). Sampling takes no lock (only a draw that finds a change marked cut
short tries it once, without waiting, to repair the sums): a descent racing
a change may land on a stale leaf, and the reader validates every drawn row
with the slot's seqlock as uniform sampling does (a zero or out-of-range leaf
is re-drawn). Writers call :meth:`PriorityTree.enter` *after* committing a
chunk; :meth:`PriorityTree.update` checks, under the same lock, that the slot
still holds the write index the trainer sampled, so an update aimed at a row
that has since been overwritten is dropped and the new row keeps the maximum
priority it entered with.
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ingestd.errors import LockBusy, StorageFull
from ingestd.replay import files

K = 16
MAGIC = 0x5052494F_0001  # "PRIO" + 1
HEADER_WORDS = 8
H_MAGIC, H_CAPACITY, H_LEAVES, H_LEVELS, H_MAX, H_CHANGING = 0, 1, 2, 3, 4, 5
FILE, LOCK = "priority.bin", "priority.lock"
DEFAULT_MAX = 1.0
TOP_NODES = 4096  # descend() searches the widest level of at most this many nodes whole
# children @ _EXCLUSIVE: per row, the sum of the children before each child
_EXCLUSIVE = np.triu(np.ones((K, K)), 1)
_NUMPY_ROWS = 512  # numpy's BLAS goes multithreaded above ~1k rows, and stalls on a busy machine
_trees: "weakref.WeakSet[PriorityTree]" = weakref.WeakSet()  # given fresh thread locks in a forked child
assert K == 16  # descend() counts K booleans as two 64-bit words


def tree_shape(capacity: int) -> tuple[int, list[int]]:
    """``(leaves, level sizes from the leaves up to the root)`` for ``capacity`` slots."""
    leaves = K
    while leaves < capacity:
        leaves *= K
    sizes = [leaves]
    while sizes[-1] > 1:
        sizes.append(sizes[-1] // K)
    return leaves, sizes


def file_bytes(capacity: int) -> int:
    return 8 * (HEADER_WORDS + sum(tree_shape(capacity)[1]))


def _unique_sorted(idx: np.ndarray) -> np.ndarray:
    if idx.size < 2:
        return idx
    return idx[np.concatenate(([True], idx[1:] != idx[:-1]))]


class PriorityTree:
    """A process's handle on ``priority.bin``. ``attach`` creates the file when missing."""

    def __init__(self, path: Path, capacity: int):
        self.path, self.capacity = Path(path), capacity
        self.leaf_count, sizes = tree_shape(capacity)
        fd = os.open(self.path / FILE, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != file_bytes(capacity):
                raise ValueError(f"{self.path / FILE} has the wrong size for capacity {capacity}")
            self._mm = mmap.mmap(fd, file_bytes(capacity), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._header = np.frombuffer(self._mm, dtype=np.int64, count=HEADER_WORDS)
        if self._header[H_MAGIC] != MAGIC or self._header[H_CAPACITY] != capacity:
            raise ValueError(f"{self.path / FILE} does not belong to a storage of capacity {capacity}")
        self._max = np.frombuffer(self._mm, dtype=np.float64, count=1, offset=8 * H_MAX)
        self.levels: list[np.ndarray] = []
        offset = 8 * HEADER_WORDS
        for size in sizes:
            self.levels.append(np.frombuffer(self._mm, dtype=np.float64, count=size, offset=offset))
            offset += 8 * size
        self._blocks = [level.reshape(-1, K) for level in self.levels[:-1]]  # level l as [parents, K]
        self._top = min(i for i, size in enumerate(sizes) if size <= TOP_NODES)
        self._top_t = torch.from_numpy(self.levels[self._top])
        self._prefix_t = torch.zeros(sizes[self._top] + 1, dtype=torch.float64)  # 0, then the top's prefix sums
        self._prefix = self._prefix_t.numpy()
        self._lock_fd = files.open_lock_file(self.path / LOCK, os.O_RDWR | os.O_CREAT, owner=self)
        self._threads = threading.RLock()  # taken before the flock (see locked()); never re-entered
        _trees.add(self)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def attach(cls, path: str | os.PathLike, capacity: int, seq: np.ndarray | None = None) -> "PriorityTree":
        """Open ``<path>/priority.bin``, creating it if missing. A new tree gives every committed
        slot (``seq`` even and non-zero) the default maximum priority, so reopening an older
        storage makes its rows sampleable at once."""
        path = Path(path)
        if not (path / FILE).exists():
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, files.TRAINER_WRITABLE)
            try:
                with contextlib.suppress(PermissionError):  # made by another user before: theirs to set
                    os.fchmod(fd, files.TRAINER_WRITABLE)
                fcntl.flock(fd, fcntl.LOCK_EX)
                if not (path / FILE).exists():
                    _create(path, capacity, seq)
            finally:
                os.close(fd)
        return cls(path, capacity)

    # -- changes (under the lock) ---------------------------------------------------------
    def locked(self, wait: Callable[[], None] | None = None, timeout: float | None = None):
        """``priority.lock`` (trainers hold it in ``update_priorities``): see ``files.flocked``
        for ``wait`` (a worker's heartbeat) and ``timeout`` (the daemon's main thread).

        The flock belongs to this handle's open file, which every thread of the process shares:
        so the handle's threads also take a thread lock first (two trainer threads updating
        through one reader were not serialised, and a draw's repair could take the flock another
        thread held and release it mid-change)."""
        return _HandleLock(self, wait, timeout, change=False)

    def _changing(self, wait: Callable[[], None] | None = None, timeout: float | None = None):
        """:meth:`locked`, for a change of the tree, marked in the header while it lasts. A
        change cut short (a KeyboardInterrupt in a trainer's ``update_priorities``, a process
        killed between writing leaves and re-summing their ancestors) leaves the mark, and the
        next change or draw re-sums the whole tree first: stale ancestors (biased draws, a total
        that is not the leaves' sum) lasted until the daemon's next start (trainer review)."""
        return _HandleLock(self, wait, timeout, change=True)

    def _begin_change(self) -> None:
        """Under the lock: repair a change cut short, then mark this one under way."""
        if self._header[H_CHANGING]:
            self._resum_all()
        self._header[H_CHANGING] = 1

    @property
    def interrupted(self) -> bool:
        """Whether a change is marked under way: one cut short and not yet repaired, or one in
        progress in some process right now."""
        return bool(self._header[H_CHANGING])

    def repair(self) -> bool:
        """Re-sum the tree if a change was cut short; returns whether it did. Readers call this
        before drawing when the mark is set. It never waits: if the lock is held (by another
        thread of this process or by another process), the change under way is live, or its
        holder's next change repairs it, and the draw goes on (its descent is validated as any
        descent racing a change). One non-blocking ``flock`` call, no exception object built."""
        if self._threads._is_owned():  # inside this thread's own change: never under it
            return False
        try:
            if not self._threads.acquire(blocking=False):
                return False
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not self._header[H_CHANGING]:
                return False
            self._resum_all()
            self._header[H_CHANGING] = 0
            return True
        except BlockingIOError:
            return False
        finally:
            self._let_go()

    def _take(self, wait: Callable[[], None] | None, timeout: float | None) -> None:
        """The handle's thread lock, then the flock, ``timeout`` for both together. However a
        KeyboardInterrupt falls (even as an acquire returns), neither is left held: an RLock
        knows whether this thread owns it, so the handler releases only what it took."""
        threads, name = self._threads, str(self.path / LOCK)
        if threads._is_owned():  # a nested change's exit would drop the outer change's flock
            raise RuntimeError(f"{name} is already held by this thread: changes of the priority tree do not nest")
        start = time.monotonic()
        try:
            if not threads.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise LockBusy(f"{name} is held by another thread of this process for {timeout:.1f} s; try again")
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            files.take_flock(self._lock_fd, wait=wait, timeout=left, name=name)
        except BaseException:
            self._let_go()
            raise

    def _let_go(self) -> None:
        """Release what :meth:`_take` (or :meth:`repair`) took. While this thread owns the
        thread lock no other thread of the handle holds the flock, so unlocking it is safe
        whether or not it was taken (unlocking a lock not held does nothing)."""
        if self._threads._is_owned():
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                self._threads.release()

    @property
    def max_leaf(self) -> float:
        return float(self._max[0])

    @property
    def total(self) -> float:
        return float(self.levels[-1][0])

    def enter(self, first: int, n: int, wait: Callable[[], None] | None = None) -> None:
        """New rows (just committed: ``n`` slots from slot ``first``, wrapping around the ring)
        enter at the current maximum priority, by slices: one run, or two where they wrap."""
        if n <= 0:
            return
        with self._changing(wait):
            for run, _ in files.segments(first, n, self.capacity):
                self.levels[0][run] = self._max[0]
                self._propagate_run(run.start, run.stop)

    def vacate(self, first: int, n: int) -> None:
        """Slots just reserved for new rows: their leaves (the overwritten rows' priorities) are
        zeroed, so a writer that dies between its commit and ``enter`` leaves leaves of 0, which
        :meth:`ingestd.replay.storage.ReplayStorage.enter_unentered` finds, rather than the old
        rows' priorities. No lock and no re-summing (a write costs no second tree update): the
        ancestors keep the old mass until ``enter`` re-sums the run (a descent meanwhile may end
        on a zero leaf, which the sampler draws again, as for any descent racing a change)."""
        for run, _ in files.segments(first, n, self.capacity):
            self.levels[0][run] = 0.0

    def update(self, slots: np.ndarray, leaves: np.ndarray, seq: np.ndarray | None = None,
               expected_seq: np.ndarray | None = None, timeout: float | None = None) -> int:
        """Set leaf values; with ``seq``/``expected_seq`` only where the slot still holds the
        sampled row (``seq[slot] == expected_seq``). Returns how many leaves were set."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        leaves = np.asarray(leaves, dtype=np.float64).reshape(-1)
        if slots.size != leaves.size:
            raise ValueError(f"{slots.size} indices but {leaves.size} priorities")
        if slots.size and (slots.min() < 0 or slots.max() >= self.capacity):
            raise IndexError(f"slot indices must be in [0, {self.capacity})")
        if not np.isfinite(leaves).all() or (leaves < 0).any():
            raise ValueError("priorities must be finite and >= 0")
        if expected_seq is not None and np.size(expected_seq) != slots.size:
            raise ValueError(f"{slots.size} indices but {np.size(expected_seq)} write indices")
        with self._changing(timeout=timeout):
            if seq is not None:
                keep = seq[slots] == expected_seq
                slots, leaves = slots[keep], leaves[keep]
            if slots.size == 0:
                return 0
            self.levels[0][slots] = leaves
            top = float(leaves.max())
            if top > self._max[0]:
                self._max[0] = top
            self._propagate(np.sort(slots))
        return int(slots.size)

    def reset_max(self, leaf: float | None = None, timeout: float | None = None) -> float:
        """Set the leaf new rows enter at: ``leaf``, or (None) the largest leaf the rows hold now
        (``DEFAULT_MAX`` when none holds one). The word otherwise only ever grows, so one huge TD
        error would make every later row enter above every updated one. Returns it."""
        if leaf is not None and not (np.isfinite(leaf) and leaf > 0):
            raise ValueError(f"the maximum priority leaf must be finite and > 0, got {leaf}")
        with self.locked(timeout=timeout):
            if leaf is None:
                held = float(self.levels[0][:self.capacity].max(initial=0.0))
                leaf = held if held > 0 else DEFAULT_MAX
            self._max[0] = leaf
        return float(leaf)

    def clear(self, slots: np.ndarray, wait: Callable[[], None] | None = None) -> None:
        """Make slots unsampleable (rows cleared by recovery)."""
        slots = np.sort(np.asarray(slots, dtype=np.int64).reshape(-1))
        if slots.size:
            with self._changing(wait):
                self.levels[0][slots] = 0.0
                self._propagate(slots)

    def resum(self, timeout: float | None = None) -> None:
        """Re-sum every node from the leaves (a few ms at 1M slots): after writers died between
        ``vacate`` and ``enter``, their runs' ancestors still held the overwritten rows' mass."""
        with self.locked(timeout=timeout):
            self._resum_all()
            self._header[H_CHANGING] = 0

    def _resum_all(self) -> None:
        for lvl, block in enumerate(self._blocks):
            self.levels[lvl + 1][:] = block.sum(axis=1)

    def _propagate(self, idx: np.ndarray) -> None:
        """Re-sum the ancestors of sorted leaf indices ``idx``, level by level."""
        for lvl, block in enumerate(self._blocks):
            idx = _unique_sorted(idx // K)
            self.levels[lvl + 1][idx] = block[idx].sum(axis=1)

    def _propagate_run(self, lo: int, hi: int) -> None:
        """Re-sum the ancestors of leaves ``[lo, hi)``: one slice per level, no fancy indexing."""
        for lvl, block in enumerate(self._blocks):
            lo, hi = lo // K, (hi - 1) // K + 1
            self.levels[lvl + 1][lo:hi] = block[lo:hi].sum(axis=1)

    # -- sampling (no lock) -------------------------------------------------------------
    def descend(self, u: np.ndarray) -> np.ndarray:
        """The leaf whose prefix-sum interval holds each ``u`` (in ``[0, total)``): the first leaf
        whose inclusive prefix sum exceeds ``u``, so zero leaves are never chosen.

        A ``u`` at or past the end of a node (a descent racing a change) ends in its last child,
        possibly a zero leaf or padding past the capacity; the caller draws those again.

        Below the searched top level, each step takes the ``K`` children of every point's node,
        their exclusive prefix sums (one matrix product), and counts the children whose sum
        before them is at most ``u``: that count is the chosen child plus one, and the sum
        before it comes from the same matrix. Child 0 is counted whatever the comparison says
        (a NaN, from a NaN ``u`` or from sums that overflowed to inf, compares false), so the
        count is 1 to ``K`` and every descent ends inside the tree."""
        top = self.levels[self._top]
        torch.cumsum(self._top_t, 0, out=self._prefix_t[1:])  # a third of numpy's time at 4096 nodes
        prefix = self._prefix
        idx = np.searchsorted(prefix[1:], u, side="right")
        np.minimum(idx, top.size - 1, out=idx)
        u = u - prefix[idx]
        n = u.size
        passed = np.empty((n, K), dtype=bool)
        before_child = np.arange(-1, n * K - 1, K)  # flat position of (row, child - 1): chosen + 1 is counted
        column = u[:, None]
        for block in reversed(self._blocks[:self._top]):
            before = _exclusive_sums(np.take(block, idx, axis=0))  # [n, K]: the sum before each child
            np.less_equal(before, column, out=passed)
            passed[:, 0] = True  # child 0 counts even where a NaN compared false
            counts = np.bitwise_count(passed.view(np.uint64))  # K bools = 2 words of 0/1 bytes
            j = counts[:, 0] + counts[:, 1]  # the chosen child + 1
            u -= before.ravel().take(before_child + j)  # (column is a view of u)
            idx *= K
            idx += j
            idx -= 1
        return idx

    def close(self) -> None:
        if self._mm is None:
            return
        files.close_lock_file(self._lock_fd)
        self.levels = self._blocks = []
        self._top_t = None
        self._header = self._max = None
        files.unmap(self._mm)
        self._mm = None


def _exclusive_sums(children: np.ndarray) -> np.ndarray:
    """``children @ _EXCLUSIVE``, ``_NUMPY_ROWS`` rows at a time: numpy's BLAS stays on one
    thread for such small products. Larger ones went multithreaded (numpy's, or torch's
    intra-op pool), and on a busy machine a thread waiting for a core stalled the product: a
    1024-row descent (a lag-filtered prioritized re-draw) took 2 ms instead of 20 us."""
    n = children.shape[0]
    if n <= _NUMPY_ROWS:
        return children @ _EXCLUSIVE
    out = np.empty_like(children)
    for lo in range(0, n, _NUMPY_ROWS):
        np.matmul(children[lo:lo + _NUMPY_ROWS], _EXCLUSIVE, out=out[lo:lo + _NUMPY_ROWS])
    return out


def _create(path: Path, capacity: int, seq: np.ndarray | None) -> None:
    """Write a new tree to ``priority.bin.tmp`` and rename it into place. Its blocks are
    allocated first (as the storage's files are): a full tmpfs is a ``StorageFull`` here,
    not a SIGBUS in whichever process first touches an unbacked page of a sparse file."""
    tmp, size = path / (FILE + ".tmp"), file_bytes(capacity)
    try:
        files.allocate_file(tmp, size)
        _fill(tmp, capacity, seq)
        os.chmod(tmp, files.TRAINER_WRITABLE)
        os.replace(tmp, path / FILE)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in files.NO_ROOM:
            raise StorageFull(f"no room for the priority tree of a replay of {capacity} rows at {path}: it needs "
                              f"{size / 2**20:.1f} MiB ({exc.strerror}); free space there, or move the storage "
                              "to a replay.path with space") from exc
        raise


def _fill(tmp: Path, capacity: int, seq: np.ndarray | None) -> None:
    tree = np.memmap(tmp, dtype=np.int64, mode="r+", shape=(file_bytes(capacity) // 8,))
    tree[H_MAGIC], tree[H_CAPACITY] = MAGIC, capacity
    _, sizes = tree_shape(capacity)
    tree[H_LEAVES], tree[H_LEVELS] = sizes[0], len(sizes)
    floats = tree.view(np.float64)
    floats[H_MAX] = DEFAULT_MAX
    if seq is not None:
        committed = (seq > 0) & ((seq & 1) == 0)
        offset = HEADER_WORDS
        level = floats[offset:offset + sizes[0]]
        level[:capacity] = np.where(committed, DEFAULT_MAX, 0.0)
        for size in sizes[1:]:
            offset += level.size
            parent = floats[offset:offset + size]
            parent[:] = level.reshape(-1, K).sum(axis=1)
            level = parent
    tree.flush()
    del tree, floats


class _HandleLock:
    """:meth:`PriorityTree.locked` and, with ``change``, :meth:`PriorityTree._changing` (a
    class, not a generator: a worker takes it once a chunk). The change's mark is cleared only
    when its block ends without an exception: one cut short keeps it, for the next to repair."""

    __slots__ = ("_tree", "_wait", "_timeout", "_change")

    def __init__(self, tree: PriorityTree, wait: Callable[[], None] | None, timeout: float | None, change: bool):
        self._tree, self._wait, self._timeout, self._change = tree, wait, timeout, change

    def __enter__(self) -> None:
        tree = self._tree
        tree._take(self._wait, self._timeout)
        if self._change:
            try:
                tree._begin_change()
            except BaseException:
                tree._let_go()
                raise

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if self._change and exc_type is None:
                self._tree._header[H_CHANGING] = 0
        finally:
            self._tree._let_go()


def _fresh_thread_locks() -> None:
    """A forked child (a DataLoader worker) gets its own thread locks: one copied while a parent
    thread held it would stay held in the child for good (its flock is reopened as its own:
    ``files.open_lock_file``)."""
    for tree in list(_trees):
        tree._threads = threading.RLock()


os.register_at_fork(after_in_child=_fresh_thread_locks)
