"""Replay rows whose every field derives from their write index, and the processes that
write and read them in the concurrency tests.

A row for write index ``w`` holds, in every element of every leaf, a value computed
from ``w``, the leaf's name and the element's position, so a torn row (leaves from
different writes), a foreign row or a never-written (zero) row fails ``bad_rows``.
``PayloadStorage`` fills each reserved range with the rows of the indices it got, so
writers need not know their write indices in advance.
"""
from __future__ import annotations

import os
import time
import zlib

import numpy as np
import torch
from tensordict import TensorDict

from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.replay.layout import WRITE_INDEX, Key, Leaf, leaf_name

CARTPOLE = {  # TorchRL layout of a CartPole transition (the ingestd stamps are added by the storage)
    "observation": ((4,), torch.float32), "action": ((), torch.int64),
    "done": ((1,), torch.bool), "terminated": ((1,), torch.bool), "truncated": ((1,), torch.bool),
    "next.observation": ((4,), torch.float32), "next.reward": ((1,), torch.float32),
    "next.done": ((1,), torch.bool), "next.terminated": ((1,), torch.bool), "next.truncated": ((1,), torch.bool),
    **{f"ingestd.{f}": ((), torch.int64) for f in ("worker", "env", "episode", "step", "policy_version")},
}
PIXELS = {**CARTPOLE, "observation": ((4, 84, 84), torch.uint8), "next.observation": ((4, 84, 84), torch.uint8)}
SPECS = {"cartpole": CARTPOLE, "pixels": PIXELS}


def spec(kind: str) -> dict[Key, tuple]:
    return {tuple(name.split(".")): value for name, value in SPECS[kind].items()}


def leaf_values(key: Key, leaf: Leaf, index: torch.Tensor) -> torch.Tensor:
    """The value of leaf ``key`` in the rows of write indices ``index``."""
    if key == WRITE_INDEX:
        return index.clone()
    n, numel = index.numel(), int(np.prod(leaf.shape, dtype=np.int64))
    salt = zlib.crc32(leaf_name(key).encode()) % 997 + 1
    raw = index.reshape(n, 1) * 131 + salt * 7 + torch.arange(numel).reshape(1, numel)
    if leaf.dtype == torch.bool:
        value = raw % 3 == 0
    elif leaf.dtype.is_floating_point:  # integers + 0.5, exact in the dtype, never 0
        value = (raw % _FLOAT_RANGE[leaf.dtype]).to(leaf.dtype) + 0.5
    else:
        value = (raw % _INT_RANGE[torch.iinfo(leaf.dtype).bits] if leaf.dtype != torch.int64 else raw).to(leaf.dtype)
    return value.reshape(n, *leaf.shape)


_FLOAT_RANGE = {torch.float16: 1 << 10, torch.float32: 1 << 20, torch.float64: 1 << 40}
_INT_RANGE = {8: 127, 16: 32749, 32: (1 << 31) - 1}


def rows(schema: dict[Key, Leaf], index) -> TensorDict:
    """A batch ``[len(index)]`` of the rows of write indices ``index``."""
    index = torch.as_tensor(np.asarray(index, dtype=np.int64))
    td = TensorDict({}, batch_size=[index.numel()])
    for key, leaf in schema.items():
        td.set(key, leaf_values(key, leaf, index))
    return td


def template(schema: dict[Key, Leaf], n: int) -> TensorDict:
    """A batch of ``n`` zero rows: what a ``PayloadStorage`` writer passes to ``write``."""
    td = TensorDict({}, batch_size=[n])
    for key, leaf in schema.items():
        if key != WRITE_INDEX:
            td.set(key, torch.zeros(n, *leaf.shape, dtype=leaf.dtype))
    return td


def bad_rows(td: TensorDict, schema: dict[Key, Leaf]) -> torch.Tensor:
    """Boolean mask of the rows in ``td`` that are not exactly the row of their write index."""
    index = td.get(WRITE_INDEX)
    bad = index < 0
    for start in range(0, len(index), 64):  # bounded memory for image rows
        part = slice(start, start + 64)
        expected = rows(schema, index[part].clamp(min=0))
        for key in schema:
            got, want = td.get(key)[part], expected.get(key)
            bad[part] |= (got != want).reshape(len(want), -1).any(dim=1)
    return bad


class PayloadStorage(ReplayStorage):
    """Writes, into each reserved range, the rows of the write indices it was given."""

    def _fill(self, index: np.ndarray, batch: TensorDict) -> None:
        super()._fill(index, rows(self.schema, index))


class StallingStorage(PayloadStorage):
    """Copies only some of the leaves of its rows (write index first, so the slots hold torn
    rows), puts ``(start, n)`` into ``where``, sets ``stalled`` and then waits for ``release``
    (forever when it is None: the test kills it). It shares no lock with the other processes
    while it stalls, so killing it cannot leave one held."""

    def __init__(self, path, stalled, release, where):
        super().__init__(path)
        self._stalled, self._resume, self._where = stalled, release, where

    def _fill(self, index: np.ndarray, batch: TensorDict) -> None:
        full = rows(self.schema, index)
        keys = [WRITE_INDEX] + [k for k in self.leaves if k != WRITE_INDEX]
        for key in keys[: len(keys) // 2]:
            for dst, part in self._segments(int(index[0]), index.size):
                self.leaves[key][dst].copy_(full.get(key)[part])
        self._where[0], self._where[1] = int(index[0]), int(index.size)
        self._stalled.set()
        if self._resume is None:
            while True:
                time.sleep(1)
        self._resume.wait()
        super()._fill(index, batch)


# -- child processes (started from a "forkserver"/"spawn" context) ------------------------
def _child_setup() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def writer_main(path: str, seed: int, max_batch: int, stop, report) -> None:
    """Write batches of random sizes until ``stop.value``; report ``(rows, batches)``."""
    _child_setup()
    rng = np.random.default_rng(seed)
    written = batches = 0
    with PayloadStorage.open(path) as store:
        templates = {n: template(store.schema, n) for n in range(1, max_batch + 1)}
        while not stop.value or written == 0:
            n = int(rng.integers(1, max_batch + 1))
            store.write(templates[n])
            written, batches = written + n, batches + 1
    report.put(("writer", written, batches))


def reader_main(path: str, seed: int, batch: int, progress, stop, report, into: bool = False) -> None:
    """Sample and verify until ``stop.value`` (counting samples in ``progress.value``); report
    samples, bad rows and the write indices seen. ``into``: sample into one reused batch."""
    _child_setup()
    samples = bad = 0
    seen = []
    with ReplayReader(path, seed=seed) as reader:
        schema = reader.schema
        out = reader.empty_batch(batch) if into else None
        while not stop.value or samples == 0:  # at least one sample, however late this process started
            td = reader.sample(batch, timeout=5.0, out=out)
            bad += int(bad_rows(td, schema).sum())
            seen.append(td.get(WRITE_INDEX).numpy().copy())
            samples += 1
            progress.value = samples
    report.put(("reader", samples, bad, np.unique(np.concatenate(seen)) if seen else np.zeros(0, np.int64)))


def stalling_writer_main(path: str, n: int, stalled, release, where, report) -> None:
    """Reserve ``n`` rows, fill them halfway, stall until ``release`` (or SIGKILL)."""
    _child_setup()
    with StallingStorage(path, stalled, release, where) as store:
        store.write(template(store.schema, n))
    report.put(("stalling writer done",))


def lapping_writer_main(path: str, rows_to_write: int, batch: int, report) -> None:
    """Write ``rows_to_write`` rows in batches, reporting the time it finished."""
    _child_setup()
    with PayloadStorage.open(path) as store:
        tpl = template(store.schema, batch)
        for _ in range(rows_to_write // batch):
            store.write(tpl)
    report.put(("lapping writer done", time.monotonic()))
