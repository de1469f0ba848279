"""``ReplayReader``: attach to a storage by path, read-only, and sample from it.

No lock is taken. Every drawn row's sequence number is read before and after
the copy; rows that were never written, are being written, or changed during
the copy are re-drawn, so a sample never holds a torn row.

The hot path is built for many small leaves: the rows' records are gathered
with one fancy index (a row is one or two cache lines instead of one miss per
leaf), then each run of leaves with equal dtype and shape is copied out of the
gathered records as one contiguous ``(leaves, n, *shape)`` array and split
into per-leaf tensors by one ``unbind``. Large leaves (images) are gathered by
``torch.index_select``, which copies rows on torch's intra-op threads. The
nested TensorDict is put together from a key plan made once (:mod:`ingestd.replay.batches`).
"""
from __future__ import annotations

import math
import os
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tensordict import TensorDict

from ingestd.errors import EmptyReplay, SampleTimeout, StorageNotFound, StorageReplaced
from ingestd.replay import files
from ingestd.replay.batches import Out, plan_nodes, td_factory
from ingestd.replay.inputs import (available_memory, check_seed, child_seed, file_identity, rows_count, slot_indices,
                                   wait_deadline)
from ingestd.replay.layout import numpy_dtype
from ingestd.replay.storage import MappedStore
from ingestd.service.limits import attach_out_of_fds

_REDRAW_ROUNDS = 64  # rejection rounds (by seqlock, no copy) over [0, len) before scanning for committed slots
_MAX_ROUNDS = 1024  # then give up: rows keep changing faster than they can be copied
_POLL_S = 0.002
_POOL = 1 << 16  # random draws made at once
_ROOM_CHECK_BYTES = 256 << 20  # a sample this large checks that it fits in memory first
_ATTACH_CHECK_S = 1.0  # how often sampling checks that the storage is still the one at its path
_readers: "weakref.WeakSet[ReplayReader]" = weakref.WeakSet()  # reseeded in a forked child


def _reseed_after_fork() -> None:
    """A forked child (a DataLoader worker given the trainer's reader) draws its own slots,
    not a copy of its parent's random stream."""
    for reader in list(_readers):
        reader._reseed()


os.register_at_fork(after_in_child=_reseed_after_fork)


class ReplayReader(MappedStore):
    """Read-only view of a replay storage. Safe to use while workers write.

    One reader per thread: a reader keeps its own random state. A reader inherited through
    ``fork`` (DataLoader workers) is reseeded in the child, so children do not repeat their
    parent's draws (nor each other's); a pickled one (``spawn``) attaches again by path, with
    its own seed too. In a DataLoader worker, a reader made with ``seed=`` draws from that seed
    and the worker's torch seed (reproducible under ``torch.manual_seed``, new in every worker
    and epoch); elsewhere, and without ``seed=``, from OS entropy."""

    def __init__(self, path: str | os.PathLike, seed: int | None = None, *, sampler: str = "uniform",
                 alpha: float | None = None, beta: float | None = None, max_policy_lag: int | None = None,
                 weights_path: str | os.PathLike | None = None, weights_version: Callable[[], int] | None = None,
                 rate_limited: bool = True):
        """``sampler``: "uniform" or "prioritized" (``alpha``, default 0.6, and ``beta``, default 0.4:
        given to a uniform reader they are refused, as a forgotten ``sampler=``); ``max_policy_lag``
        (with ``weights_path`` or ``weights_version``) rejects rows collected by weights more than
        that many versions old; ``rate_limited``: obey the storage's rate limiter. See
        docs/sampling.md and :mod:`ingestd.replay.sampling`."""
        check_seed(seed)
        if sampler == "uniform" and (alpha is not None or beta is not None):
            raise ValueError("alpha and beta shape prioritized sampling, but this reader samples uniformly: pass "
                             "sampler='prioritized' with them, or leave them out")
        alpha, beta = 0.6 if alpha is None else alpha, 0.4 if beta is None else beta
        # the path given, even if the process chdirs later; looked at before mapping, so a storage
        # swapped meanwhile is reported by the first check rather than missed
        self._attached_at = Path(path).expanduser().absolute()
        try:
            self._identity = file_identity(self._attached_at / "header.bin")
            super().__init__(path, writable=False)
        except PermissionError as exc:  # a bare EACCES on header.bin said nothing of the cause
            raise PermissionError(exc.errno, f"{exc.strerror}: cannot read the replay at {self._attached_at} "
                                  f"({exc.filename}); trainers need read access: run as a user in the group that "
                                  "owns it (the daemon's group, docs/systemd.md)", exc.filename) from None
        except StorageNotFound as exc:
            inner = Path(path).expanduser() / "replay"
            try:
                suggest = (inner / "meta.json").is_file()
            except OSError:  # no access to look: say nothing more (Path.exists raises this on 3.11)
                suggest = False
            if not suggest:
                raise
            # the daemon's data dir given for its replay (replay.path defaults to <data_dir>/replay)
            raise StorageNotFound(f"{exc}; did you mean {str(inner)!r}?") from None
        except OSError as exc:
            if (refused := attach_out_of_fds(self._attached_at, exc)) is not None:
                raise refused from None
            raise
        self._next_attach_check = 0.0
        self._replaced: str | None = None
        # how to attach again in another process (pickling: DataLoader workers under spawn)
        weights_at = None if weights_path is None else str(Path(weights_path).expanduser().absolute())
        shape = {} if sampler == "uniform" else dict(alpha=alpha, beta=beta)  # (refused for a uniform one)
        self._options = dict(sampler=sampler, **shape, max_policy_lag=max_policy_lag,
                             weights_path=weights_at, weights_version=weights_version, rate_limited=rate_limited)
        self._seed, self._reseed_pending = seed, False
        self._stream = np.random.default_rng(seed)
        self._pool = np.empty(0, dtype=np.int64)
        self._pos = 0
        _readers.add(self)
        self._groups = self._plan_groups()
        # per run: None, or the opaque item its leaves' rows are copied as (see _fill_blocks)
        self._items = [None if len(shape) == 1 or math.prod(shape[1:]) == 1 else np.dtype(f"V{strides[0]}")
                       for _, shape, _, _, strides in self._groups]
        self._columns = [self.leaves[k] for k in self._layout.columns]
        self.row_bytes = sum(leaf.row_bytes for leaf in self.schema.values())  # of one sampled row
        self._order = [k for keys, *_ in self._groups for k in keys] + list(self._layout.columns)
        self._plans = {(): plan_nodes(self._order)}  # extra keys -> how to nest the leaves
        self._outs: dict[int, Out] = {}  # id of a batch from empty_batch -> its parts
        self._new_td = td_factory()
        from ingestd.replay.sampling import Sampling

        try:
            self._sampling = Sampling(self, sampler, alpha, beta, max_policy_lag, weights_path, weights_version,
                                      rate_limited)
        except BaseException as exc:
            super().close()
            if (refused := attach_out_of_fds(self._attached_at, exc)) is not None:
                raise refused from None
            raise

    def __reduce__(self):
        """Pickled (a ``spawn`` or ``forkserver`` DataLoader worker, a ``torch.multiprocessing``
        process): the copy attaches to the same path with the same options and its own random
        seed (OS entropy, as a forked copy is reseeded). A ``weights_version`` callable must be
        picklable; ``weights_path`` travels as a path."""
        self._check_open()
        return _attach, (str(self._attached_at), self._options, self._seed)

    def _reseed(self) -> None:
        """In a forked child, or a copy unpickled in another process: a stream of its own, made
        at the first draw (a DataLoader worker's torch seed is known only by then)."""
        self._reseed_pending = True
        self._pool, self._pos = np.empty(0, dtype=np.int64), 0

    @property
    def _rng(self) -> np.random.Generator:
        if self._reseed_pending:
            self._reseed_pending = False
            self._stream = np.random.default_rng(child_seed(self._seed))
        return self._stream

    def _plan_groups(self) -> list[tuple[list, tuple, np.dtype, int, tuple]]:
        """Runs of leaves with equal dtype and shape lying side by side in the record, each as
        ``(keys, shape, dtype, offset, strides)`` of a ``(leaves, *shape)`` view of one record."""
        runs: list[list] = []
        fields = self._layout.fields
        for key in sorted(fields, key=fields.__getitem__):
            if runs:
                last = runs[-1][-1]
                same = files.group_of(self.schema[last]) == files.group_of(self.schema[key])
                if same and fields[key] == fields[last] + self.schema[last].row_bytes:
                    runs[-1].append(key)
                    continue
            runs.append([key])
        groups = []
        for keys in runs:
            leaf = self.schema[keys[0]]
            strides = self._arrays[keys[0]].strides[1:]  # within one row: C order
            groups.append((keys, (len(keys), *leaf.shape), numpy_dtype(leaf.dtype), fields[keys[0]],
                           (leaf.row_bytes, *strides)))
        return groups

    # -- sampling --------------------------------------------------------------
    def sample(self, batch_size: int, timeout: float | None = None, *, out: TensorDict | None = None) -> TensorDict:
        """A sample of committed rows, shape ``[batch_size]``; the caller owns it. Uniform, or
        as the reader was made: by priority, only rows within ``max_policy_lag``, obeying the
        storage's rate limiter (docs/sampling.md).

        Without ``timeout`` this never blocks: an empty storage (or no row within the policy
        lag) raises ``EmptyReplay``, and a rate limiter holding the trainer back raises
        ``RateLimited``. With ``timeout`` (seconds >= 0, ``math.inf`` for ever) it waits and
        raises ``SampleTimeout`` (``RateLimited`` is one) at the deadline.

        ``out``: a batch from :meth:`empty_batch` to copy the rows into, in place (returned):
        no tensor is created, which makes small-row sampling about twice as fast; use it for a
        reused staging batch. The previous contents are overwritten (and are undefined if the
        call raises: rows may have been partly copied in)."""
        if type(batch_size) is not int or batch_size <= 0:
            batch_size = rows_count(batch_size, "batch_size")
        if out is not None:
            return self._sample_into(out, batch_size, timeout)
        if batch_size * self.row_bytes > _ROOM_CHECK_BYTES:
            self.check_memory(batch_size, f"sample({batch_size})")
        if self._sampling.active:  # prioritized, policy lag or rate limit: ingestd.replay.sampling
            return self._sampling.sample(batch_size, timeout)
        return self._retrying(lambda: self._sample(batch_size), timeout)

    def check_memory(self, rows: int, what: str) -> None:
        """Raise ``MemoryError`` saying so when ``rows`` sampled rows would not fit in the memory
        this host has available (``MemAvailable``), before any of it is allocated (numpy's bare
        "Unable to allocate" said nothing of the cause, and one that fits the overcommit but not
        the memory ends in the OOM killer)."""
        need = rows * self.row_bytes
        free = available_memory()
        if free is not None and need > free:
            raise MemoryError(f"{what}: {rows} rows of {self.row_bytes} bytes would take {need / 2**30:.1f} GiB, "
                              f"more than the {free / 2**30:.1f} GiB of memory this host has available; "
                              "sample fewer rows at a time")

    def _retrying(self, attempt: Callable[[], TensorDict | None], timeout: float | None) -> TensorDict:
        """``attempt()`` until it returns rows; ``EmptyReplay`` without ``timeout``."""
        deadline = wait_deadline(timeout)
        while True:
            self.check_attached()  # before every attempt: a storage that left would never fill
            out = attempt()
            if out is not None:
                return out
            if deadline is None:
                raise EmptyReplay(f"replay {self.path} has no committed rows yet; "
                                  "wait for the workers, or pass timeout= to block")
            if time.monotonic() >= deadline:
                raise SampleTimeout(f"no committed rows in replay {self.path} after {timeout} s")
            time.sleep(_POLL_S)

    def check_attached(self) -> None:
        """Raise ``StorageReplaced`` once the storage's files are no longer the ones at its path
        (removed, or replaced by a new storage: ``systemctl stop`` removes the runtime dir). The
        rows this reader maps are then frozen. Sampling calls this, looking at the path at most
        every ``_ATTACH_CHECK_S`` seconds; once replaced, every call raises."""
        if self._replaced is None:
            now = time.monotonic()
            if now < self._next_attach_check:
                return
            self._next_attach_check = now + _ATTACH_CHECK_S
            try:
                if file_identity(self._attached_at / "header.bin") == self._identity:
                    return
            except OSError:  # EIO, EACCES...: not a sign the storage left; look again next time
                return
            self._replaced = (f"the replay storage at {self.path} was removed or replaced since this reader "
                              "attached (`systemctl stop` removes the runtime dir); the rows it still maps are "
                              f"frozen: close it and open ReplayReader({str(self.path)!r}) again once the "
                              "daemon has made the new one")
        self._check_open()  # "you closed it" comes first
        raise StorageReplaced(self._replaced)

    def empty_batch(self, batch_size: int) -> TensorDict:
        """A ``[batch_size]`` TensorDict of this storage's rows (plus the prioritized sampler's
        keys) to pass as ``sample(batch_size, out=...)``. Its contents are undefined until then.

        Each run of small leaves of one dtype and shape is one block of memory, so a sample
        into it is one copy per run. New keys may be added (a TorchRL loss writing its
        ``td_error``); a leaf replaced (``set`` of an existing key, ``pin_memory(inplace=True)``)
        would no longer receive the rows, so the next ``sample`` into the batch raises. Moving
        its memory in place (``share_memory_``, or sending it through a ``torch.multiprocessing``
        queue) is followed: the next sample overwrites what the receiver holds. So never hand a
        batch you keep sampling into to another process (a DataLoader worker yielding it):
        yield ``sample(n)``, a new batch, there."""
        self._check_open()
        n = rows_count(batch_size, "batch_size")
        self.check_memory(n, f"empty_batch({n})")
        blocks = [torch.from_numpy(np.empty((shape[0], n, *shape[1:]), dtype))  # (leaves, n, *shape)
                  for _, shape, dtype, _, _ in self._groups]
        columns = [torch.empty((n, *c.shape[1:]), dtype=c.dtype) for c in self._columns]
        flat = [leaf for block in blocks for leaf in block.unbind(0)] + columns
        extra = self._sampling.extra_keys(n)
        batch = self._build(flat + list(extra.values()), n, self._plan_with(tuple(extra)) if extra else None)
        self._outs[id(batch)] = Out(batch, blocks, columns)
        weakref.finalize(batch, self._outs.pop, id(batch), None)
        return batch

    def _sample_into(self, out: TensorDict, n: int, timeout: float | None) -> TensorDict:
        if out.batch_size != torch.Size([n]):
            raise ValueError(f"out has batch size {list(out.batch_size)}, but {n} rows were asked for")
        made = self._outs.get(id(out))
        if made is None or made.batch() is not out:
            raise ValueError("out must be a batch made by this reader's empty_batch(n)")
        if not made.unchanged():
            raise ValueError("a leaf of out was replaced (set of an existing key, or pin_memory(inplace=True)), "
                             "so it would no longer receive rows; make a new batch with empty_batch(n)")
        into = (out, made.arrays(), made.columns)
        if self._sampling.active:  # prioritized, policy lag or rate limit: ingestd.replay.sampling
            return self._sampling.sample(n, timeout, into)
        return self._retrying(lambda: self._sample(n, into), timeout)

    def _finish(self, records: np.ndarray, columns: list, n: int, extra: dict | None, into: tuple | None):
        """The sample of the copied rows: a new TensorDict, or (``into``, whose large leaves were
        copied in place already) the small leaves and ``extra`` copied into ``into``'s batch."""
        if into is None:
            return self._assemble(records, columns, n, extra)
        batch, blocks, _ = into
        self._fill_blocks(records, n, blocks)
        for key, value in (extra or {}).items():
            batch.get(key).copy_(value)
        return batch

    def _sample(self, n: int, into: tuple | None = None) -> TensorDict | None:
        """``n`` uniform rows (a new TensorDict, or copied into ``into`` = ``(batch, blocks,
        columns)`` of an ``empty_batch``); None if there are none."""
        filled = len(self)
        if filled == 0:
            return None
        records, columns, bad = self._copy(self._draw(n, filled), None if into is None else into[2])
        if bad is not None and not self._redraw(records, columns, bad, filled):
            return None
        return self._finish(records, columns, n, None, into)

    def gather(self, index) -> TensorDict:
        """Copy the rows at slots ``index``; slots that are not committed, or change during
        the copy, are replaced by uniform draws of committed rows. An index of several dimensions
        (``[B, T]`` slots) gives a batch of that shape."""
        self._check_open()
        self.check_attached()
        shape = tuple(index.shape) if isinstance(index, torch.Tensor) else np.shape(index)
        idx = slot_indices(index, "index")
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise IndexError(f"slot indices must be in [0, {self.capacity}), got {idx.min()}..{idx.max()}")
        records, columns, bad = self._copy(idx)
        if bad is not None and not self._redraw(records, columns, bad, max(len(self), 1)):
            raise EmptyReplay(f"replay {self.path} has no committed rows to stand in for uncommitted slots")
        rows = self._assemble(records, columns, idx.size)
        return rows.reshape(*shape) if len(shape) > 1 else rows  # (it flattened a [B, T] index)

    def _draw(self, n: int, bound: int) -> np.ndarray:
        """``n`` uniform slot numbers in ``[0, bound)`` (from a pool drawn in bulk)."""
        pos = self._pos
        if pos + n > self._pool.size:
            if 4 * n > _POOL:
                return self._rng.integers(0, bound, size=n)
            self._pool = (self._rng.bit_generator.random_raw(_POOL) >> np.uint64(2)).view(np.int64)
            pos = 0
        self._pos = pos + n
        return self._pool[pos:pos + n] % bound  # modulo bias < bound / 2**62

    def _copy(self, idx: np.ndarray, into: list | None = None) -> tuple[np.ndarray, list, np.ndarray | None]:
        """Copy rows ``idx`` between two reads of their seqs: (records, columns (new, or the
        tensors ``into``), positions whose rows are not valid, or None)."""
        seq = self.seq
        before = seq[idx]
        records = self._records[idx]
        columns = []
        if self._columns:
            tidx = torch.from_numpy(idx)
            if into is None:
                columns = [torch.index_select(column, 0, tidx) for column in self._columns]
            else:
                columns = [torch.index_select(column, 0, tidx, out=o) for column, o in zip(self._columns, into)]
        after = seq[idx]
        # valid = committed (even, non-zero) and not touched by a writer meanwhile
        if (before.tobytes() == after.tobytes() and not np.count_nonzero(before & 1)
                and np.count_nonzero(before) == before.size):
            return records, columns, None
        return records, columns, np.flatnonzero((before != after) | (before == 0) | ((before & 1) != 0))

    def _redraw(self, records: np.ndarray, columns: list, bad: np.ndarray, filled: int) -> bool:
        """Replace the rows at positions ``bad`` by fresh committed ones; False if there are none."""
        listing = False
        for _ in range(_MAX_ROUNDS):
            fresh = None if listing else self._looking_committed(bad.size, filled)
            if fresh is None:  # mostly empty or in-flight slots (after a crash, before the first commit)
                listing = True
                seq = self.seq[:filled]
                committed = np.flatnonzero((seq > 0) & ((seq & 1) == 0))
                if committed.size == 0:
                    return False
                fresh = committed[self._draw(bad.size, committed.size)]
            sub_records, sub_columns, sub_bad = self._copy(fresh)
            records[bad] = sub_records
            tbad = torch.from_numpy(bad)
            for column, sub in zip(columns, sub_columns):
                column[tbad] = sub
            if sub_bad is None:
                return True
            bad = bad[sub_bad]
        raise SampleTimeout(f"replay {self.path}: rows kept changing under the reader "
                            f"(capacity {self.capacity} is too small for the write rate?)")

    def _looking_committed(self, n: int, filled: int) -> np.ndarray | None:
        """``n`` uniform draws in ``[0, filled)`` whose seqlocks read committed now, re-drawn by
        their seqlocks alone (nothing copied) for up to ``_REDRAW_ROUNDS`` rounds; None if some
        still do not. Re-drawing by copying rows instead cost a non-blocking ``sample`` of pixel
        rows 1-2 s of image copies before ``EmptyReplay`` while the first chunk was in flight."""
        fresh = self._draw(n, filled)
        for _ in range(_REDRAW_ROUNDS):
            seq = self.seq[fresh]
            bad = np.flatnonzero((seq == 0) | ((seq & 1) != 0))
            if bad.size == 0:
                return fresh
            fresh[bad] = self._draw(bad.size, filled)
        return None

    def _assemble(self, records: np.ndarray, columns: list, n: int, extra: dict | None = None) -> TensorDict:
        """The nested TensorDict of ``n`` copied rows, plus the ``extra`` leaves (key -> tensor
        with leading dimension ``n``), set as the tree is built (cheaper than setting them after)."""
        flat: list[torch.Tensor] = []
        blocks = [np.empty((shape[0], n, *shape[1:]), dtype) for _, shape, dtype, _, _ in self._groups]
        self._fill_blocks(records, n, blocks)
        for block in blocks:  # contiguous (leaves, n, *shape): one leaf each
            flat.extend(torch.from_numpy(block).unbind(0))
        flat.extend(columns)
        if extra:
            flat.extend(extra.values())
        return self._build(flat, n, self._plan_with(tuple(extra)) if extra else None)

    def _fill_blocks(self, records: np.ndarray, n: int, blocks: list[np.ndarray]) -> None:
        """Copy each run of small leaves out of the gathered records into its ``(leaves, n,
        *shape)`` block. A leaf of several elements per row (an observation vector) is copied
        as one opaque item per row: numpy's element-wise transposing copy is 3-4x slower."""
        if n == 0:
            return
        record_bytes = self._layout.record_bytes
        for (_, shape, dtype, offset, strides), item, block in zip(self._groups, self._items, blocks):
            if item is None:
                rows = np.ndarray((n, *shape), dtype, records, offset, (record_bytes, *strides))
                np.copyto(block, rows.swapaxes(0, 1))
            else:
                size = item.itemsize
                np.copyto(np.ndarray((shape[0], n), item, block, 0, (n * size, size)),
                          np.ndarray((shape[0], n), item, records, offset, (size, record_bytes)))

    def _build(self, flat: list[torch.Tensor], n: int, plan: list | None = None) -> TensorDict:
        """The nested TensorDict of the leaves ``flat`` (in the order of ``plan``)."""
        batch = torch.Size([n])
        built: list[TensorDict] = []
        new_td = self._new_td
        for leaves, children in plan or self._plans[()]:
            node = {name: flat[i] for name, i in leaves}
            for name, j in children:
                node[name] = built[j]
            built.append(new_td(node, batch))
        return built[-1]

    def _plan_with(self, keys: tuple) -> list:
        plan = self._plans.get(keys)
        if plan is None:
            plan = self._plans[keys] = plan_nodes(self._order + list(keys))
        return plan

    # -- prioritized and sequence sampling, policy lag (ingestd.replay.sampling) ------------------
    def update_priorities(self, index, priority, write_index=None, timeout: float | None = None) -> int:
        """Set the priorities of sampled rows (pass the sample itself as ``index``, or slots and
        ``write_index``); updates aimed at rows overwritten since are ignored. Returns how many
        were applied. ``timeout``: ``LockBusy`` (nothing updated) if another trainer holds
        ``priority.lock`` that long, stopped inside a call (None: wait)."""
        self._check_open()
        self.check_attached()  # into a removed storage's frozen tree, it "applied" updates nobody reads (review)
        return self._sampling.update_priorities(index, priority, write_index, timeout)

    def reset_max_priority(self, priority: float | None = None) -> float:
        """Make new rows enter the prioritized tree at ``priority`` (None: at the largest priority
        the rows hold now) instead of the largest ever set, which only grows and is shared by every
        trainer of the storage (one blown-up TD error made every later row outrank all updated
        ones). Returns the new entry leaf, ``(priority + 1e-6) ** alpha``."""
        self._check_open()
        return self._sampling.reset_max_priority(priority)

    def sample_sequences(self, batch_size: int, length: int, cross_episodes: bool = False,
                         timeout: float | None = None) -> TensorDict:
        """``[batch_size, length]`` runs of consecutive steps of one (worker, env) trajectory."""
        self._check_open()
        return self._sampling.sample_sequences(batch_size, length, cross_episodes, timeout)

    @property
    def beta(self) -> float:
        """The importance-sampling exponent of a prioritized reader's weights. Settable, for
        the usual annealing towards 1 over training (``reader.beta = min(1.0, b0 + k * step)``);
        the next sample uses it. A copy attached in another process keeps the value it had."""
        return self._sampling.beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._check_open()  # as every other use of a closed reader (review: it was taken in silence)
        self._sampling.set_beta(value)
        self._options["beta"] = self._sampling.beta

    @property
    def last_policy_lag(self) -> tuple[int, float, int] | None:
        """``(min, mean, max)`` policy lag of the last sample (needs the weights version)."""
        return self._sampling.last_lag

    def close(self) -> None:
        sampling = getattr(self, "_sampling", None)
        if sampling is not None:
            sampling.close()
        self._columns = []
        super().close()


def _attach(path: str, options: dict, seed: int | None = None) -> ReplayReader:
    reader = ReplayReader(path, seed=seed, **options)
    reader._reseed()  # a copy in another process: its own stream, as a forked one
    return reader
