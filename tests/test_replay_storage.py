"""The replay storage in one process: round trips, sampling semantics, bad input and
damaged directories (each with a clear error and the store unchanged), disk paths."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import replay_payload as rp
import torch
from replay_payload import PayloadStorage
from tensordict import TensorDict

import ingestd.replay.reader as reader_module
from ingestd.errors import (ClosedError, ConfigError, CorruptStorage, EmptyReplay, SampleTimeout, SchemaMismatch,
                            StorageNotFound, StorageReplaced)
from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.replay.layout import WRITE_INDEX
from ingestd.replay.priority import PriorityTree

WI = WRITE_INDEX


def filled(path, kind="cartpole", capacity=64, rows=100) -> str:
    with PayloadStorage.create(path, rp.spec(kind), capacity) as store:
        while store.write_count < rows:
            store.write(rp.template(store.schema, min(rows - store.write_count, capacity // 2)))
    return str(path)


def fingerprint(path) -> dict[str, str]:
    """Hashes of every file of a storage directory (to show that nothing changed)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize("kind", ["cartpole", "pixels"])
def test_round_trip(shm_dir, kind):
    path = filled(shm_dir / "r", kind, capacity=64, rows=100)
    with ReplayReader(path, seed=1) as reader:
        assert (len(reader), reader.write_count, reader.capacity) == (64, 100, 64)
        td = reader.sample(300)
        assert td.batch_size == (300,)
        assert {k if isinstance(k, tuple) else (k,) for k in td.keys(True, True)} == set(reader.schema)
        for key, leaf in reader.schema.items():
            value = td.get(key)
            assert value.shape == (300, *leaf.shape) and value.dtype == leaf.dtype and value.is_contiguous()
        assert not rp.bad_rows(td, reader.schema).any()
        index = td.get(WI)
        assert int(index.min()) >= 36 and int(index.max()) <= 99  # FIFO: only the newest 64 rows
        exact = reader.gather(np.arange(64))
        assert sorted(exact.get(WI).tolist()) == list(range(36, 100))
        assert (exact.get(WI).numpy() % 64 == np.arange(64)).all()


STAMPS = ["env", "episode", "policy_version", "step", "worker"]  # the record's order (sorted)


def _interleaved_rows(n: int, order: list[str], gap: int = 0) -> TensorDict:
    """Rows whose stamps are the columns of one [n, 5 + gap] int64 buffer, in ``order``."""
    width = len(order) + gap
    buf = torch.arange(n * width, dtype=torch.int64).view(n, width) * 10
    stamps = TensorDict({name: buf[:, i] for i, name in enumerate(order)}, batch_size=[n])
    return TensorDict({"ingestd": stamps, "x": torch.rand(n, 2)}, batch_size=[n])


@pytest.mark.parametrize("order,gap,runs", [
    (STAMPS, 0, [STAMPS]),  # the record's order and the memory's agree: one item
    # env and episode swapped in memory: only the three after them lie side by side in both
    (STAMPS[1:2] + STAMPS[:1] + STAMPS[2:], 0, [["env"], ["episode"], STAMPS[2:]]),
    (STAMPS, 1, [STAMPS]),  # a gap after the last: the rows' stride is wider, the run the same
])
def test_leaves_side_by_side_in_memory_are_packed_as_one_item_and_read_back_exactly(shm_dir, order, gap, runs):
    from ingestd.replay import packing
    from ingestd.replay.schema import flat_leaves

    n = 48
    rows = _interleaved_rows(n, order, gap)
    with ReplayStorage.create(shm_dir / "r", rows, capacity=64) as store:
        planned = [keys for _, _, keys, _ in packing.runs(store._plan, flat_leaves(rows), n, {WI: None})]
        assert [[k[1] for k in keys] for keys in planned if keys[0][0] == "ingestd" and keys[0] != WI] == runs
        store.write(rows)
        store.write(rows[:40])  # wraps the ring: two segments
    with ReplayReader(shm_dir / "r") as reader:
        got = reader.gather(np.arange(64))
    by_index = np.argsort(got.get(WI).numpy())
    want = torch.cat([rows[24:], rows[:40]])  # write indices 24..87 survive in the 64 slots
    for key in [("ingestd", k) for k in STAMPS] + [("x",)]:
        assert torch.equal(got.get(key)[by_index], want.get(key)), key


def _check_round_trip(store, reader_path, rows) -> None:
    store.write(rows)
    with ReplayReader(reader_path) as reader:
        got = reader.gather(np.arange(rows.batch_size[0]))
    by_index = np.argsort(got.get(WI).numpy())
    for key in [("ingestd", k) for k in STAMPS] + [("x",)]:
        assert torch.equal(got.get(key)[by_index], rows.get(key)), key


def test_leaves_adjacent_in_memory_at_another_row_stride_are_not_merged(shm_dir):
    """env's row 0 ends where episode's begins, but episode's rows are 8 bytes apart, not 40:
    copied as one item, episode would read env's stride (every fifth value)."""
    n = 6
    rows = _interleaved_rows(n, STAMPS)
    buf = torch.arange(1, 5 * n + 2, dtype=torch.int64)
    rows.set(("ingestd", "env"), buf[0:5 * n:5])
    rows.set(("ingestd", "episode"), buf[1:n + 1])
    with ReplayStorage.create(shm_dir / "r", rows, capacity=8) as store:
        from ingestd.replay import packing
        from ingestd.replay.schema import flat_leaves
        planned = [keys for _, _, keys, _ in packing.runs(store._plan, flat_leaves(rows), n, {WI: None})]
        assert [("ingestd", "env")] in planned and [("ingestd", "episode")] in planned
        _check_round_trip(store, shm_dir / "r", rows)


def test_the_packer_reuses_its_copies_only_for_leaves_in_the_same_places(shm_dir):
    """The same buffers written again with new values (as a worker's rollout does) store the new
    values; the same tensor re-strided in place, and other tensors, are packed from themselves."""
    import gc
    import weakref

    n = 8
    rows = _interleaved_rows(n, STAMPS)
    with ReplayStorage.create(shm_dir / "r", rows, capacity=n) as store:  # every write fills the same slots
        for _ in range(3):  # same tensors, new values in place
            rows.get(("ingestd", "env")).add_(1000)
            rows.get("x").mul_(2)
            _check_round_trip(store, shm_dir / "r", rows)
        rows.get("x").as_strided_((n, 2), (1, n))  # same memory and address, other strides
        _check_round_trip(store, shm_dir / "r", rows)
        other = _interleaved_rows(n, STAMPS)
        other.get("x").add_(5)
        _check_round_trip(store, shm_dir / "r", other)
        held = weakref.ref(other.get("x"))
        del other
        gc.collect()
        assert held() is None  # the packer keeps no batch alive


def test_narrow_leaves_are_gathered_and_packed_in_blocks_exactly(shm_dir, monkeypatch):
    """Bool flags and other narrow leaves side by side in the record go through one staging
    array, and the records a block at a time: blocks of 8 rows here, batches of several
    blocks and a part, one of them wrapping the ring, all read back exactly."""
    from ingestd.replay import packing
    from ingestd.replay.schema import flat_leaves

    monkeypatch.setattr(packing, "BLOCK_BYTES", 8 * 128)  # 8 records of 128 bytes a block

    def rows_of(n: int, seed: int) -> TensorDict:
        g = torch.Generator().manual_seed(seed)
        flags = {name: torch.rand(n, 1, generator=g) < 0.5 for name in ("done", "terminated", "truncated")}
        return TensorDict({**flags, "code": torch.randint(0, 255, (n, 3), generator=g, dtype=torch.uint8),
                           "x": torch.rand(n, 2, generator=g), "action": torch.randint(0, 9, (n,), generator=g),
                           "next": {"reward": torch.rand(n, 1, generator=g), **{k: ~v for k, v in flags.items()}},
                           "ingestd": _interleaved_rows(n, STAMPS)["ingestd"]}, batch_size=[n])

    capacity = 40
    batches = [rows_of(n, seed) for seed, n in enumerate((27, 19, 33))]  # the second and third wrap
    with ReplayStorage.create(shm_dir / "r", batches[0], capacity=capacity) as store:
        assert store._packer.record == 128
        for rows in batches:
            store.write(rows)
        staged = [[key for *_, key in members] for stage, members in store._packer._last[3] if stage is not None]
        assert any(len(members) >= 6 for members in staged)  # the six flags: one gathered copy
    want = torch.cat(batches)[-capacity:]  # write indices 39..78 survive
    with ReplayReader(shm_dir / "r") as reader:
        got = reader.gather(np.arange(capacity))
    got = got[np.argsort(got.get(WI).numpy())]
    assert got.get(WI).tolist() == list(range(79 - capacity, 79))
    for key, value in flat_leaves(want).items():
        assert torch.equal(got.get(key), value), key


def _stamped(n: int, g: torch.Generator) -> TensorDict:
    return TensorDict({"x": torch.rand(n, 2, generator=g),  # float32 [2]: 8 bytes, narrow
                       "ingestd": {s: torch.randint(0, 1 << 40, (n,), generator=g) for s in STAMPS}}, batch_size=[n])


def test_slots_of_one_handle_committed_at_once_from_two_threads(shm_dir, monkeypatch):
    """Review: both commits reuse the packer's plan for the same tensors, and with it its
    staging arrays; without a lock one thread landed the other's staged rows (a pause after
    each copy widens the window)."""
    from ingestd.replay import packing

    monkeypatch.setattr(packing, "BLOCK_BYTES", 8 * 64)
    land = packing.Copy.land
    monkeypatch.setattr(packing.Copy, "land", lambda *a: (land(*a), time.sleep(1e-4)))
    n, capacity = 96, 384
    batch = _stamped(n, torch.Generator().manual_seed(0))
    with ReplayStorage.create(shm_dir / "r", batch, capacity=capacity) as store:
        store.write(batch)  # the plan for these tensors is kept
        for _ in range(2):
            with store.reserved(n) as first, store.reserved(n) as second:
                go = threading.Barrier(2)
                threads = [threading.Thread(target=lambda s=s: (go.wait(), s.commit(batch))) for s in (first, second)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
    with ReplayReader(shm_dir / "r") as reader:
        got = reader.gather(np.arange(5 * n - capacity, 5 * n) % capacity)
    assert got.get(WI).tolist() == list(range(5 * n - capacity, 5 * n))
    row = got.get(WI).numpy() % n  # the batch row each stored row holds
    for key in [("x",), ("ingestd", "step")]:
        assert torch.equal(got.get(key), batch.get(key)[row]), key


def test_rows_that_are_views_of_the_ring_are_packed_before_they_are_overwritten(shm_dir, monkeypatch):
    """Review: rows appended again from views of the storage's own slots, one slot behind the
    slots written: packed block by block, later blocks read rows an earlier one overwrote."""
    from ingestd.replay import packing

    monkeypatch.setattr(packing, "BLOCK_BYTES", 4 * 64)
    with ReplayStorage.create(shm_dir / "r", _stamped(8, torch.Generator()), capacity=64) as store:
        for part in _stamped(94, torch.Generator().manual_seed(1)).split(47):  # every slot, then slot 30 is next
            store.write(part)
        views = TensorDict({}, batch_size=[16])
        for key, leaf in store.leaves.items():
            if key != WI:
                views.set(key, leaf[29:45])  # slots 29..44, written into slots 30..45
        want = views.clone()
        store.write(views)
    with ReplayReader(shm_dir / "r") as reader:
        got = reader.gather(np.arange(30, 46))
    assert got.get(WI).tolist() == list(range(94, 110))
    for key in [("x",), ("ingestd", "step")]:
        assert torch.equal(got.get(key), want.get(key)), key


def test_a_negative_view_is_stored_with_its_values(shm_dir):
    """Review: ``c.conj().imag`` has ``c.imag``'s address and strides, but its values are those
    bytes negated: packed by address (from the copies kept for ``c.imag``) it was stored
    without its sign."""
    n = 6
    rows = _interleaved_rows(n, STAMPS)
    c = torch.complex(torch.rand(n, 2), torch.arange(1.0, 2 * n + 1).view(n, 2))
    with ReplayStorage.create(shm_dir / "r", rows, capacity=n) as store:
        for x in (c.imag, c.conj().imag):  # the same memory, the second read negated
            rows.set("x", x)
            _check_round_trip(store, shm_dir / "r", rows)
        assert bool((rows.get("x") < 0).all())


def test_a_leaf_whose_rows_are_not_contiguous_is_not_merged(shm_dir):
    """A [n, 2] leaf viewed out of a transposed buffer: row bytes not contiguous, copied on its own."""
    n = 6
    wide = torch.arange(2 * n, dtype=torch.float32).view(2, n).t()  # [n, 2], inner stride n
    rows = TensorDict({"ingestd": _interleaved_rows(n, STAMPS)["ingestd"], "x": wide}, batch_size=[n])
    from ingestd.replay import packing
    assert packing.row_bytes_at(wide) is None and packing.row_bytes_at(wide.contiguous()) is not None
    with ReplayStorage.create(shm_dir / "r", rows, capacity=8) as store:
        _check_round_trip(store, shm_dir / "r", rows)


def test_sample_is_owned_by_the_caller(shm_dir):
    path = filled(shm_dir / "r")
    with ReplayReader(path, seed=2) as reader, PayloadStorage.open(path) as store:
        first = reader.sample(32)
        again = first.clone()
        second = reader.sample(32)
        first.apply_(lambda t: t.zero_() if t.dtype != torch.bool else t.fill_(False))  # no effect on the store
        assert not rp.bad_rows(second, reader.schema).any()
        store.write(rp.template(store.schema, 64))  # overwrite the whole ring
        assert not rp.bad_rows(again, reader.schema).any()
        assert (again.get(WI) < 100).all()
        public = TensorDict(again.to_dict(), batch_size=[32])
        assert again.batch_size == public.batch_size and again.device == public.device
        assert set(again.keys(True)) == set(public.keys(True))
        assert isinstance(again["next"], TensorDict) and again["next"].batch_size == (32,)


@pytest.mark.parametrize("kind", ["cartpole", "pixels"])
def test_sample_into_a_reused_batch(shm_dir, kind):
    """sample(n, out=batch) fills the batch from empty_batch in place: valid rows, the same
    keys, shapes and dtypes as a fresh sample, new rows each call, and nothing allocated."""
    path = filled(shm_dir / "r", kind, capacity=64, rows=100)
    with ReplayReader(path, seed=3) as reader, PayloadStorage.open(path) as store:
        out = reader.empty_batch(48)
        fresh = reader.sample(48)
        assert set(out.keys(True, True)) == set(fresh.keys(True, True))
        assert all(out.get(k).shape == fresh.get(k).shape and out.get(k).dtype == fresh.get(k).dtype
                   for k in fresh.keys(True, True))
        pointers = {k: out.get(k).data_ptr() for k in out.keys(True, True)}
        seen = set()
        for _ in range(20):
            assert reader.sample(48, out=out) is out
            assert not rp.bad_rows(out, reader.schema).any()
            seen.update(out.get(WI).tolist())
            assert {k: out.get(k).data_ptr() for k in out.keys(True, True)} == pointers
        assert len(seen) > 48 and min(seen) >= 36
        store.write(rp.template(store.schema, 64))  # the ring moves on: so do the samples into out
        reader.sample(48, out=out)
        assert int(out.get(WI).min()) >= 100 and not rp.bad_rows(out, reader.schema).any()


def test_sample_into_refuses_a_foreign_or_misfit_batch(shm_dir):
    path = filled(shm_dir / "r")
    with ReplayReader(path) as reader, ReplayReader(path) as other:
        with pytest.raises(ValueError, match="batch size"):
            reader.sample(16, out=reader.empty_batch(8))
        with pytest.raises(ValueError, match="empty_batch"):
            reader.sample(8, out=reader.sample(8))
        with pytest.raises(ValueError, match="empty_batch"):
            reader.sample(8, out=other.empty_batch(8))
        with pytest.raises(ValueError, match="positive"):
            reader.empty_batch(0)


def test_sample_into_a_batch_whose_memory_moved(shm_dir):
    """share_memory_() (which sending the batch through a torch.multiprocessing queue does too)
    moves its storage in place: the rows must follow it. New keys are fine (a TorchRL loss
    writes its td_error), but a replaced leaf (set, pin_memory(inplace=True)) would be left out
    of every later sample, so sampling into that batch is refused."""
    path = filled(shm_dir / "r", capacity=64, rows=100)
    with ReplayReader(path, seed=4) as reader, PayloadStorage.open(path) as store:
        out = reader.empty_batch(32)
        reader.sample(32, out=out)
        out.share_memory_()
        assert out.get(WI).is_shared()
        store.write(rp.template(store.schema, 64))
        reader.sample(32, out=out)
        assert int(out.get(WI).min()) >= 100 and not rp.bad_rows(out, reader.schema).any()
        other = reader.empty_batch(32)  # (share_memory_ locks a TensorDict: a new one for the rest)
        other.set("td_error", torch.ones(32))
        reader.sample(32, out=other)
        assert not rp.bad_rows(other, reader.schema).any()
        other.set(WI, torch.zeros(32, dtype=torch.int64))
        with pytest.raises(ValueError, match="replaced"):
            reader.sample(32, out=other)


def test_sample_into_an_empty_store_waits_like_sample(shm_dir):
    with PayloadStorage.create(shm_dir / "r", rp.spec("cartpole"), 64) as store, ReplayReader(store.path) as reader:
        out = reader.empty_batch(4)
        with pytest.raises(EmptyReplay):
            reader.sample(4, out=out)
        with pytest.raises(SampleTimeout):
            reader.sample(4, timeout=0.05, out=out)
        store.write(rp.template(store.schema, 8))
        assert not rp.bad_rows(reader.sample(4, out=out), reader.schema).any()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_reader_whose_storage_left_its_path_is_told(shm_dir, monkeypatch, how):
    """``systemctl stop`` removes the runtime dir, and the next start makes a new replay there:
    a reader still mapping the old one would sample frozen rows for ever. Reopening the same
    storage in place (a restart) is not a replacement."""
    monkeypatch.setattr(reader_module, "_ATTACH_CHECK_S", 0.0)
    path = filled(shm_dir / "r", capacity=64, rows=100)
    with ReplayReader(path, seed=0) as uniform, ReplayReader(path, seed=0, sampler="prioritized") as prioritized:
        with ReplayStorage.open(path) as store:  # the daemon restarted: same files
            store.write(rp.template(store.schema, 10))
        assert uniform.sample(8).batch_size == (8,) and prioritized.sample(8).batch_size == (8,)
        shutil.rmtree(path)
        if how == "replaced":
            filled(path, capacity=64, rows=50)
        calls = [lambda: uniform.sample(8), lambda: uniform.sample(8, timeout=5.0), lambda: uniform.gather([0]),
                 lambda: uniform.sample(8, out=uniform.empty_batch(8)), lambda: prioritized.sample(8, timeout=5.0),
                 lambda: prioritized.sample_sequences(2, 2, timeout=5.0),
                 lambda: prioritized.update_priorities([0], [1.0])]  # "applied" to a frozen tree (review)
        for call in calls:
            with pytest.raises(StorageReplaced, match="removed or replaced since this reader attached"):
                call()
        assert uniform.write_count == 110  # the frozen rows are still there to look at


@pytest.mark.parametrize("call", ["uniform", "into", "prioritized", "sequences"])
def test_a_call_waiting_for_rows_is_told_when_its_storage_leaves(shm_dir, monkeypatch, call):
    """The storage leaves while ``sample(timeout=...)`` waits on it: no row will ever come."""
    monkeypatch.setattr(reader_module, "_ATTACH_CHECK_S", 0.0)
    path = filled(shm_dir / "r", capacity=64, rows=0)
    sampler = "prioritized" if call == "prioritized" else "uniform"
    with ReplayReader(path, seed=0, sampler=sampler) as reader:
        calls = {"uniform": lambda: reader.sample(4, timeout=5.0),
                 "into": lambda: reader.sample(4, timeout=5.0, out=reader.empty_batch(4)),
                 "prioritized": lambda: reader.sample(4, timeout=5.0),
                 "sequences": lambda: reader.sample_sequences(2, 2, timeout=5.0)}
        remover = threading.Timer(0.2, shutil.rmtree, (path,))
        remover.start()
        started = time.monotonic()
        try:
            with pytest.raises(StorageReplaced):
                calls[call]()
        finally:
            remover.join()
        assert time.monotonic() - started < 4.0


def test_a_reader_opened_by_a_relative_path_is_not_told_when_the_directory_changes(shm_dir, monkeypatch):
    """The path is the one given at attach: a trainer that chdirs after opening ``ReplayReader("r")``
    still reads the same storage, and is told only when that storage leaves."""
    monkeypatch.setattr(reader_module, "_ATTACH_CHECK_S", 0.0)
    filled(shm_dir / "r", capacity=64, rows=100)
    monkeypatch.chdir(shm_dir)
    with ReplayReader("r", seed=0) as reader:
        monkeypatch.chdir("/")
        assert reader.sample(4).batch_size == (4,)
        shutil.rmtree(shm_dir / "r")
        with pytest.raises(StorageReplaced):
            reader.sample(4)


def test_a_path_that_cannot_be_looked_at_for_now_is_not_a_replacement(shm_dir, monkeypatch):
    """Only a storage gone from its path is a replacement: an error looking at it (EIO, EACCES)
    says nothing, and must not make the reader fail for good."""
    monkeypatch.setattr(reader_module, "_ATTACH_CHECK_S", 0.0)
    real_stat = os.stat

    def failing_stat(path, *args, **kwargs):
        if str(path).endswith("header.bin"):
            raise OSError(5, "Input/output error", str(path))
        return real_stat(path, *args, **kwargs)

    with ReplayReader(filled(shm_dir / "r", capacity=64, rows=100), seed=0) as reader:
        monkeypatch.setattr(os, "stat", failing_stat)
        assert reader.sample(4).batch_size == (4,)
        monkeypatch.setattr(os, "stat", real_stat)
        assert reader.sample(4).batch_size == (4,)


@pytest.mark.parametrize("call", ["sample", "gather", "sample_sequences"])
def test_a_closed_reader_says_so_whatever_became_of_its_storage(shm_dir, monkeypatch, call):
    monkeypatch.setattr(reader_module, "_ATTACH_CHECK_S", 0.0)
    reader = ReplayReader(filled(shm_dir / "r", capacity=64, rows=100), seed=0)
    reader.close()
    shutil.rmtree(shm_dir / "r")
    calls = {"sample": lambda: reader.sample(4), "gather": lambda: reader.gather([0]),
             "sample_sequences": lambda: reader.sample_sequences(2, 2)}
    with pytest.raises(ClosedError):
        calls[call]()


def test_the_attachment_is_checked_at_most_once_a_second(shm_dir, monkeypatch):
    calls = []
    real = reader_module.file_identity
    monkeypatch.setattr(reader_module, "file_identity", lambda path: calls.append(path) or real(path))
    with ReplayReader(filled(shm_dir / "r", capacity=64, rows=100), seed=0) as reader:
        for _ in range(200):
            reader.sample(4)
    assert len(calls) <= 3, len(calls)  # the one at attach, then about one per second of sampling


def test_the_verifier_detects_damaged_rows(shm_dir):
    path = filled(shm_dir / "r")
    with ReplayStorage.open(path) as store:
        store.leaves[("next", "reward")][5] += 1  # a changed field
        store.leaves[("observation",)][9] = store.leaves[("observation",)][10]  # a field from another row
        store.leaves[WI][20] += 64  # a row claiming to be another write index
    with ReplayReader(path) as reader:
        td = reader.gather(np.arange(64))
        assert rp.bad_rows(td, reader.schema).nonzero().squeeze(1).tolist() == [5, 9, 20]
        zeros = rp.template(reader.schema, 2)
        zeros.set(WI, torch.tensor([0, 3]))
        assert rp.bad_rows(zeros, reader.schema).all(), "never-written (zero) rows must fail"


def test_uncommitted_slots_are_never_returned(shm_dir):
    path = filled(shm_dir / "r")
    with ReplayStorage.open(path) as store:
        hidden = {3: 0, 4: 2 * 200 + 1, 5: 2 * 300 + 1}  # empty, and two being written
        for slot, seq in hidden.items():
            store.seq[slot] = seq
    with ReplayReader(path, seed=3) as reader:
        for _ in range(50):
            slots = reader.sample(64).get(WI).numpy() % 64
            assert not np.isin(slots, list(hidden)).any()
        td = reader.gather([3, 4, 5, 6])  # stand-ins are drawn for the uncommitted ones
        assert not np.isin(td.get(WI).numpy() % 64, list(hidden)).any()
        assert td.get(WI)[3] == 70  # slot 6 is committed: its own row


def test_empty_store_errors_and_waiting(shm_dir):
    path = shm_dir / "r"
    with PayloadStorage.create(path, rp.spec("cartpole"), 16) as store, ReplayReader(path) as reader:
        with pytest.raises(EmptyReplay, match="no committed rows"):
            reader.sample(4)
        t0 = time.monotonic()
        with pytest.raises(SampleTimeout):
            reader.sample(4, timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 2
        later = threading.Timer(0.3, lambda: store.write(rp.template(store.schema, 2)))
        later.start()
        try:
            td = reader.sample(8, timeout=10)
        finally:
            later.join()
        assert set(td.get(WI).tolist()) <= {0, 1}
        with pytest.raises(ValueError):
            reader.sample(0)
        assert reader.gather([]).batch_size == (0,)
        with pytest.raises(IndexError):
            reader.gather([16])


BAD_SIZES = [(3.0, TypeError, "integer"), (2.5, TypeError, "integer"), (True, TypeError, "integer"),
             ("8", TypeError, "integer"), (0, ValueError, "positive"), (-3, ValueError, "positive")]


@pytest.mark.parametrize("size, error, message", BAD_SIZES, ids=[repr(c[0]) for c in BAD_SIZES])
def test_a_bad_batch_size_is_a_clear_error_and_the_reader_keeps_working(shm_dir, size, error, message):
    path = filled(shm_dir / "r")
    with ReplayReader(path, seed=0) as reader:
        with pytest.raises(error, match=message):
            reader.sample(size)
        with pytest.raises(error, match=message):
            reader.empty_batch(size)
        assert reader.sample(4).batch_size == (4,)  # a refused size leaves nothing behind
        for size in (np.int64(5), torch.tensor(5)):  # integers of other types are integers
            assert reader.sample(size).batch_size == (5,)
            assert reader.sample(5, out=reader.empty_batch(size)).batch_size == (5,)


def test_a_sample_too_large_for_memory_says_so_before_allocating(shm_dir, monkeypatch):
    """sample(10**9) raised numpy's bare "Unable to allocate"; now a MemoryError says how
    much the rows would take against the memory available, and what to do."""
    import ingestd.replay.reader as reader_module

    assert reader_module.available_memory() > 0  # this host's /proc/meminfo is read
    monkeypatch.setattr(reader_module, "available_memory", lambda: 1 << 30)
    path = filled(shm_dir / "r")
    with ReplayReader(path, seed=0) as reader:
        for call, what in ((lambda: reader.sample(10**9), r"sample\(1000000000\)"),
                           (lambda: reader.empty_batch(10**9), r"empty_batch\(1000000000\)"),
                           (lambda: reader.sample_sequences(10**7, 4), r"sample_sequences\(10000000, 4\)")):
            with pytest.raises(MemoryError, match=what + rf": \d+ rows of {reader.row_bytes} bytes would take "
                                                  r"[\d.]+ GiB, more than the 1.0 GiB .* sample fewer rows"):
                call()
        assert reader.sample(4).batch_size == (4,)  # the reader keeps working


def test_gather_keeps_the_shape_of_a_2d_index(shm_dir):
    """A trainer gathering [B, T] slots got a flat [B * T] batch; it gets [B, T] rows, each at
    its slot."""
    path = filled(shm_dir / "r")
    with ReplayReader(path, seed=0) as reader:
        index = torch.tensor([[1, 2, 3], [7, 8, 9]])
        rows = reader.gather(index)
        assert rows.batch_size == (2, 3)
        flat = reader.gather(index.reshape(-1))
        assert (rows.reshape(-1) == flat).all()
        assert reader.gather(np.array([[5]])).batch_size == (1, 1) and reader.gather([4, 5]).batch_size == (2,)


def test_alpha_or_beta_on_a_uniform_reader_is_refused(shm_dir):
    """``ReplayReader(path, alpha=0.7)`` sampled uniformly, silently (a forgotten sampler=)."""
    import pickle

    path = filled(shm_dir / "r")
    for kwargs in ({"alpha": 0.7}, {"beta": 1.0}):
        with pytest.raises(ValueError, match="alpha and beta shape prioritized sampling.*sampler='prioritized'"):
            ReplayReader(path, **kwargs)
    with ReplayReader(path) as uniform, ReplayReader(path, sampler="prioritized", alpha=0.7) as prioritized:
        for reader in (uniform, prioritized):  # both still travel to spawned DataLoader workers
            with pickle.loads(pickle.dumps(reader)) as copy:
                assert copy.sample(4).batch_size == (4,)
        assert prioritized._sampling.alpha == 0.7 and pickle.loads(pickle.dumps(prioritized))._sampling.alpha == 0.7


def test_gather_refuses_float_slots(shm_dir):
    path = filled(shm_dir / "r")
    with ReplayReader(path, seed=0) as reader:
        with pytest.raises(TypeError, match="index must hold integers"):
            reader.gather([1.7])  # was read as slot 1
        assert reader.gather(torch.tensor([1, 2])).batch_size == (2,)
        assert reader.gather([]).batch_size == (0,)


def test_a_path_under_home_is_expanded(shm_dir, monkeypatch):
    monkeypatch.setenv("HOME", str(shm_dir))
    with ReplayStorage.create("~/r", rp.spec("cartpole"), 16) as store:
        assert store.path == shm_dir / "r"
        store.write(rp.template(store.schema, 4))
    with ReplayReader("~/r") as reader, ReplayStorage.open_or_create("~/r", rp.spec("cartpole"), 16) as again:
        assert len(reader) == 4 and again.write_count == 4


def test_only_dead_slots_then_empty(shm_dir):
    path = filled(shm_dir / "r", capacity=16, rows=16)
    with ReplayStorage.open(path) as store:
        store.seq[:] = 2 * np.arange(16) + 1  # every slot left mid-write
        with ReplayReader(path) as reader:
            with pytest.raises(EmptyReplay):
                reader.sample(4)
            store.seq[7] = 2 * 7 + 2  # one committed row among dead ones: it is found
            assert (reader.sample(32).get(WI) == 7).all()


BAD_BATCHES = [
    ("missing key", lambda s: rp.template(s, 4).exclude("action"), "missing"),
    ("extra key", lambda s: rp.template(s, 4).set("bonus", torch.zeros(4)), "unexpected"),
    ("wrong shape", lambda s: rp.template(s, 4).set("observation", torch.zeros(4, 5)), "shape"),
    ("wrong dtype", lambda s: rp.template(s, 4).set("observation", torch.zeros(4, 4, dtype=torch.float64)),
     "float64"),
    ("too many rows", lambda s: rp.template(s, 65), "does not fit"),
    ("two batch dims", lambda s: rp.template(s, 4).reshape(2, 2), "one batch dimension"),
    ("not a TensorDict", lambda s: {"observation": torch.zeros(4, 4)}, "TensorDict"),
]


@pytest.mark.parametrize("case, make, message", BAD_BATCHES, ids=[c[0] for c in BAD_BATCHES])
def test_bad_batches_are_refused_and_change_nothing(shm_dir, case, make, message):
    path = filled(shm_dir / "r")
    before = fingerprint(shm_dir / "r")
    with PayloadStorage.open(path) as store:
        with pytest.raises(SchemaMismatch, match=message):
            store.write(make(store.schema))
        store.write(rp.template(store.schema, 0))  # an empty batch is fine and writes nothing
    assert fingerprint(shm_dir / "r") == before


def test_a_failing_fill_leaves_no_slot_odd(shm_dir):
    class Broken(PayloadStorage):
        def _fill(self, index, batch):
            self.leaves[WI][int(index[0]) % self.capacity] = -1
            raise RuntimeError("disk on fire")

    path = filled(shm_dir / "r")
    with Broken(path) as store, pytest.raises(RuntimeError):
        store.write(rp.template(store.schema, 3))
    with PayloadStorage.open(path) as store:
        assert store.write_count == 103 and list(store.seq[100 % 64:][:3]) == [0, 0, 0]
        store.write(rp.template(store.schema, 3))  # the slots were unlocked too
    with ReplayReader(path) as reader:
        assert not rp.bad_rows(reader.sample(200), reader.schema).any()


_VIEWS_AFTER_CLOSE = """
import sys, threading, time
import replay_payload as rp
from ingestd.replay import ReplayReader, ReplayStorage
path = sys.argv[1]
store = ReplayStorage.create(path, rp.spec("pixels"), 256)
store.write(rp.template(store.schema, 256))
kept = {key: leaf for key, leaf in store.leaves.items()}  # a caller's tensors over data.bin
reader = ReplayReader(path)
sampled, stop = [], threading.Event()

def sample():
    while not stop.is_set():
        try:
            sampled.append(reader.sample(64).batch_size[0])
        except Exception:  # ClosedError, or a None view once closed: anything but a crash
            return

thread = threading.Thread(target=sample)
thread.start()
while not sampled:
    time.sleep(0.001)
reader.close()  # while the thread copies images out of data.bin
store.close()
stop.set()
thread.join()
print(sum(int(leaf.double().sum() >= 0) for leaf in kept.values()), len(kept))
"""


def test_views_of_the_data_outlive_a_close_in_another_thread(shm_dir):
    """A handle closed (a trainer's main thread at exit) while another thread samples through it,
    or while a caller still holds its tensors: the mapping stays until the last view goes. Its
    views were built over the mmap without holding it, so close() unmapped under them: SIGSEGV
    (in a subprocess here, so that the crash fails this test and not the suite)."""
    script = shm_dir / "views.py"
    script.write_text(_VIEWS_AFTER_CLOSE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(shm_dir / "r")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    read, kept = map(int, done.stdout.split())
    assert read == kept > 0, done.stdout


def test_close_waits_for_a_write_in_flight_in_another_thread(shm_dir):
    """A handle closed while another thread's write is copying: the close waits for it (it
    unmapped under the copy, and the process died of SIGSEGV), and a later write is refused."""
    copying, copied, unmapped = threading.Event(), threading.Event(), []

    class Slow(PayloadStorage):
        def _fill(self, index, batch):
            copying.set()
            time.sleep(0.3)
            if self._records is None:  # (unfixed: the copy below would crash the test process)
                unmapped.append(True)
                raise RuntimeError("the storage was unmapped under the write")
            super()._fill(index, batch)
            copied.set()

    path = filled(shm_dir / "r", capacity=64, rows=10)
    store = Slow(path)
    errors = []
    writer = threading.Thread(target=lambda: _record_error(errors, store.write, rp.template(store.schema, 3)))
    writer.start()
    try:
        assert copying.wait(5)
        store.close()
        assert copied.is_set()  # waited for the copy (an event, not a time: a loaded machine slept late)
    finally:
        writer.join(10)
    assert not unmapped and errors == []
    with pytest.raises(ClosedError):
        store.write(rp.template(store.schema, 1))
    with PayloadStorage.open(path) as again:
        assert again.write_count == 13 and list(again.seq[10:13]) == [22, 24, 26]  # committed, even


def _record_error(errors: list, call, *args) -> None:
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 (the test looks at it)
        errors.append(exc)


def test_reserved_slots_are_filled_in_place_then_committed(shm_dir):
    path = filled(shm_dir / "r", "pixels", capacity=64, rows=40)
    with ReplayStorage.open(path) as store, ReplayReader(path) as reader:
        with store.reserved(8) as slots:
            assert (slots.first, slots.n, store.write_count) == (40, 8, 48)
            assert set(slots.columns) == {("observation",), ("next", "observation")}
            assert (store.seq[40:48] & 1).all()  # being written: readers re-draw them
            assert int(reader.gather(np.arange(64)).get(WI).max()) < 40  # never an odd slot
            batch = rp.rows(store.schema, slots.index)
            for key, view in slots.columns.items():
                assert view.shape == (8, 4, 84, 84)
                view.copy_(batch.get(key))
                batch.set(key, view)  # the rows are the slots themselves: not copied again
            slots.commit(batch)
            assert list(store.seq[40:48]) == [2 * w + 2 for w in range(40, 48)]
        exact = reader.gather(np.arange(48))
        assert exact.get(WI).tolist() == list(range(48)) and not rp.bad_rows(exact, reader.schema).any()


# case -> what leaving the block raises (each its own error, not whichever of them)
UNCOMMITTED = {"error in the block": (RuntimeError, "env failed"), "no commit": None,
               "wrong row count": (SchemaMismatch, "a batch of 7 rows cannot fill 8")}


@pytest.mark.parametrize("case", UNCOMMITTED)
def test_uncommitted_reservations_are_cleared(shm_dir, case):
    path = filled(shm_dir / "r", "pixels", capacity=64, rows=60)
    raised = UNCOMMITTED[case]
    with ReplayStorage.open(path) as store:
        with pytest.raises(raised[0], match=raised[1]) if raised else contextlib.nullcontext():
            with store.reserved(8) as slots:
                assert slots.columns == {}  # 60..67 wraps around the ring: no views
                if case == "error in the block":
                    raise RuntimeError("env failed mid-chunk")
                if case == "wrong row count":
                    slots.commit(rp.template(store.schema, 7))
        assert store.write_count == 68 and (store.seq[[60, 61, 62, 63, 0, 1, 2, 3]] == 0).all()
        tree = PriorityTree.attach(path, 64, store.seq)
        assert (tree.levels[0][[60, 61, 62, 63, 0, 1, 2, 3]] == 0).all()  # no mass for draws to land on
        assert tree.total == pytest.approx(float(tree.levels[0].sum())) and tree.total > 0
        tree.close()
        store.write(rp.rows(store.schema, np.arange(68, 72)))  # the slots were unlocked too
    with ReplayReader(path) as reader:
        assert not rp.bad_rows(reader.sample(200), reader.schema).any()


def test_reservation_misuse_is_refused(shm_dir):
    path = filled(shm_dir / "r", capacity=64, rows=10)
    with ReplayStorage.open(path) as store:
        for n in (0, 65):
            with pytest.raises(SchemaMismatch, match="reserve 1 to capacity rows"):
                with store.reserved(n):
                    pass
        with store.reserved(2) as slots:
            assert slots.columns == {}  # no large leaves
            slots.commit(rp.rows(store.schema, slots.index))
            with pytest.raises(RuntimeError, match="already committed"):
                slots.commit(rp.rows(store.schema, slots.index))
        assert store.write_count == 12 and list(store.seq[10:12]) == [22, 24]


def test_threads_sharing_a_handle(shm_dir):
    path = filled(shm_dir / "r", capacity=256, rows=256)
    with PayloadStorage.open(path) as store:
        threads = [threading.Thread(target=lambda: [store.write(rp.template(store.schema, 7)) for _ in range(40)])
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.write_count == 256 + 3 * 40 * 7
    with ReplayReader(path) as reader:
        assert not rp.bad_rows(reader.gather(np.arange(256)), reader.schema).any()


def test_missing_paths(shm_dir):
    for opener in (ReplayReader, ReplayStorage.open):
        with pytest.raises(StorageNotFound, match="does not exist"):
            opener(shm_dir / "nowhere")
        with pytest.raises(StorageNotFound, match="meta.json is missing"):
            opener(shm_dir)
    (shm_dir / "a_file").write_bytes(b"x")  # e.g. the weight store's path given for the replay's
    for opener in (ReplayReader, ReplayStorage.open):
        with pytest.raises(StorageNotFound, match="is a file, not a storage directory"):
            opener(shm_dir / "a_file")


def test_a_forked_reader_draws_its_own_slots(shm_dir):
    """A DataLoader worker forked with the trainer's reader must not repeat the parent's draws."""
    with PayloadStorage.create(shm_dir / "r", rp.spec("cartpole"), 512) as store:
        store.write(rp.template(store.schema, 512))
        with ReplayReader(store.path, seed=3) as r:
            r.sample(8)  # the random pool is drawn before the fork
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: one sample's slots through the pipe, then out without cleanup
                try:
                    os.write(write_fd, r.sample(64).get(WRITE_INDEX).numpy().tobytes())
                finally:
                    os._exit(0)
            os.close(write_fd)
            child = b""
            while len(child) < 64 * 8:
                part = os.read(read_fd, 4096)
                if not part:
                    break
                child += part
            os.close(read_fd)
            os.waitpid(pid, 0)
            parent = r.sample(64).get(WRITE_INDEX).numpy()
            assert len(child) == 64 * 8 and not np.array_equal(np.frombuffer(child, np.int64), parent)


class _Draws(torch.utils.data.IterableDataset):
    """Each DataLoader worker yields the write indices of two samples of its (inherited) reader."""

    def __init__(self, reader):
        self.reader = reader

    def __iter__(self):
        for _ in range(2):
            yield self.reader.sample(32).get(WRITE_INDEX)


def test_dataloader_workers_draw_reproducibly_from_the_readers_seed(shm_dir):
    """``seed=`` was lost in DataLoader workers (reseeded from OS entropy, trainer review): with it
    the workers' draws follow the seed and torch's per-worker seed, so a run under
    torch.manual_seed repeats, while workers and epochs still differ; without it they do not."""
    with PayloadStorage.create(shm_dir / "r", rp.spec("cartpole"), 4096) as store:
        store.write(rp.template(store.schema, 4096))

    def run(seed, torch_seed=0):
        torch.manual_seed(torch_seed)
        with ReplayReader(shm_dir / "r", seed=seed) as reader:
            loader = torch.utils.data.DataLoader(_Draws(reader), batch_size=None, num_workers=2,
                                                 multiprocessing_context="fork")
            return [tuple(b.tolist()) for b in loader]

    first, again = run(seed=7), run(seed=7)
    assert first == again and len(set(first)) == 4  # reproducible; every worker its own stream
    assert run(seed=7, torch_seed=1) != first and run(seed=8) != first  # another epoch or seed: new draws
    assert run(seed=None) != run(seed=None)  # no seed: OS entropy


def test_a_pickled_reader_attaches_again_with_its_options_and_its_own_draws(shm_dir):
    """DataLoader workers under spawn/forkserver got "cannot pickle 'mmap.mmap' object"."""
    import pickle

    with PayloadStorage.create(shm_dir / "r", rp.spec("cartpole"), 512) as store:
        store.write(rp.template(store.schema, 512))
        with ReplayReader(store.path, seed=3, sampler="prioritized", alpha=0.7, rate_limited=False) as r:
            with pickle.loads(pickle.dumps(r)) as copy:
                assert copy is not r and copy.path == r.path and copy.capacity == r.capacity
                assert copy._sampling.sampler == "prioritized" and copy._sampling.alpha == 0.7
                assert copy._sampling.limiter is None
                mine, theirs = (x.sample(64).get(WRITE_INDEX).numpy() for x in (r, copy))
                assert not np.array_equal(mine, theirs)  # a seed of its own, not the original's
        with pytest.raises(ClosedError):
            pickle.dumps(r)


def test_reader_given_the_daemons_data_dir_names_its_replay_subdirectory(shm_dir):
    """replay.path defaults to <data_dir>/replay: a reader given the data dir says where the replay is."""
    data_dir = shm_dir / "state"
    (data_dir / "snapshots").mkdir(parents=True)
    (data_dir / "replay").mkdir()
    with pytest.raises(StorageNotFound, match="meta.json is missing") as info:  # replay/ is not a storage (yet)
        ReplayReader(data_dir)
    assert "did you mean" not in str(info.value)
    filled(data_dir / "replay")
    for given in (data_dir, str(data_dir)):
        with pytest.raises(StorageNotFound, match="meta.json is missing") as info:
            ReplayReader(given)
        assert str(info.value).endswith(f"; did you mean {str(data_dir / 'replay')!r}?"), str(info.value)
    with ReplayReader(data_dir / "replay") as reader:  # the hint's path works
        assert len(reader) == 64


def _meta_edit(field, value):
    def edit(meta):
        meta[field] = value
        return json.dumps(meta)
    return edit


CORRUPT_META = [
    ("truncated", lambda meta: json.dumps(meta)[:40]),
    ("not json", lambda meta: "\x00\x01garbage"),
    ("a list", lambda meta: "[]"),
    ("other format", _meta_edit("format", "zarr")),
    ("future version", _meta_edit("version", 99)),
    ("zero capacity", _meta_edit("capacity", 0)),
    ("capacity not a number", _meta_edit("capacity", "many")),
    ("unknown dtype", lambda meta: json.dumps(meta).replace('"float32"', '"float31"')),
    ("negative shape", lambda meta: json.dumps(meta).replace('"shape": [4]', '"shape": [-4]')),
    ("schema missing", lambda meta: json.dumps({k: v for k, v in meta.items() if k != "schema"})),
    ("layout moved", lambda meta: json.dumps(meta).replace('"record_bytes": 128', '"record_bytes": 64')),
    ("other capacity", _meta_edit("capacity", 65)),
]


@pytest.mark.parametrize("case, damage", CORRUPT_META, ids=[c[0] for c in CORRUPT_META])
def test_corrupt_metadata_is_refused_and_left_alone(shm_dir, case, damage):
    path = filled(shm_dir / "r")
    meta_path = shm_dir / "r" / "meta.json"
    meta_path.write_text(damage(json.loads(meta_path.read_text())))
    before = fingerprint(shm_dir / "r")
    for opener in (ReplayReader, ReplayStorage.open, lambda p: ReplayStorage.open_or_create(p, rp.spec("cartpole"), 64)):
        with pytest.raises(CorruptStorage):
            opener(path)
    assert fingerprint(shm_dir / "r") == before


@pytest.mark.parametrize("damage", ["no data", "short data", "no header", "bad magic", "no lock"])
def test_damaged_files_are_refused(shm_dir, damage):
    path = shm_dir / "r"
    filled(path)
    if damage == "no data":
        (path / "data.bin").unlink()
    elif damage == "short data":
        with open(path / "data.bin", "r+b") as f:
            f.truncate(4096)
    elif damage == "no header":
        (path / "header.bin").unlink()
    elif damage == "bad magic":
        with open(path / "header.bin", "r+b") as f:
            f.write(b"\x00" * 8)
    else:
        (path / "lock").unlink()
    with pytest.raises(CorruptStorage):
        ReplayStorage.open(path)
    if damage != "no lock":
        with pytest.raises(CorruptStorage):
            ReplayReader(path)


@pytest.mark.parametrize("change", ["capacity", "shape", "dtype", "extra key", "missing key"])
def test_reopen_with_another_schema_or_capacity(shm_dir, change):
    path = filled(shm_dir / "r")
    before = fingerprint(shm_dir / "r")
    spec, capacity = rp.spec("cartpole"), 64
    if change == "capacity":
        capacity = 128
    elif change == "shape":
        spec[("observation",)] = ((5,), torch.float32)
    elif change == "dtype":
        spec[("action",)] = ((), torch.int32)
    elif change == "extra key":
        spec[("next", "info")] = ((2,), torch.float32)
    else:
        del spec[("truncated",)]
    for opener in (ReplayStorage.open, ReplayStorage.open_or_create):
        with pytest.raises(SchemaMismatch, match="capacity|schema"):
            opener(path, spec, capacity)
    assert fingerprint(shm_dir / "r") == before
    with ReplayStorage.open(path, rp.spec("cartpole"), 64) as store:
        assert store.write_count == 100


@pytest.mark.parametrize("change, key", [("capacity", "replay.capacity"), ("shape", "replay.path")])
def test_the_daemon_names_the_config_key_an_existing_replay_refuses(shm_dir, change, key):
    """User review: the daemon's exit 78 for a replay of another capacity named no key (the
    README promises it does); the fix names the key, and the storage is left as it was."""
    from ingestd.service.layout import _open_replay

    path = filled(shm_dir / "r")
    before = fingerprint(shm_dir / "r")
    spec, capacity = rp.spec("cartpole"), 64
    if change == "capacity":
        capacity = 128
    else:
        spec[("observation",)] = ((5,), torch.float32)
    with pytest.raises(ConfigError, match=f"config key '{key}': .*(capacity 64, not 128|different schema)"):
        _open_replay(path, spec, capacity)
    assert fingerprint(shm_dir / "r") == before


def test_a_replay_of_other_nstep_rows_names_workers_n_step(shm_dir):
    """Reopening a replay of n-step rows with n_step = 1 (or the other way round) said "use a new
    replay path for a different env", while the env was the same (review): it names workers.n_step."""
    from ingestd.collect.nstep import STEPS_KEY
    from ingestd.service.layout import _open_replay

    path = filled(shm_dir / "r")  # 1-step rows
    before = fingerprint(shm_dir / "r")
    nstep = {**rp.spec("cartpole"), (STEPS_KEY,): ((1,), torch.int64)}
    with pytest.raises(ConfigError, match=r"config key 'workers.n_step': .*this replay holds 1-step rows"):
        _open_replay(path, nstep, 64)
    assert fingerprint(shm_dir / "r") == before
    ReplayStorage.create(shm_dir / "n", nstep, 64).close()  # n-step rows, reopened for 1-step ones
    with pytest.raises(ConfigError, match=r"config key 'workers.n_step': .*this replay holds n-step rows"):
        _open_replay(shm_dir / "n", rp.spec("cartpole"), 64)


def test_create_refuses_existing_or_foreign_directories(shm_dir):
    path = filled(shm_dir / "r")
    with pytest.raises(FileExistsError, match="already holds"):
        ReplayStorage.create(path, rp.spec("cartpole"), 64)
    (shm_dir / "other").mkdir()
    (shm_dir / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        ReplayStorage.create(shm_dir / "other", rp.spec("cartpole"), 64)
    assert (shm_dir / "other" / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="capacity"):
        ReplayStorage.create(shm_dir / "new", rp.spec("cartpole"), 0)


def test_disk_path_persists_across_close_and_reopen(disk_dir):
    path = disk_dir / "replay"
    with PayloadStorage.open_or_create(path, rp.spec("cartpole"), 64) as store:
        assert store.next_incarnation() == 1
        assert store.write(rp.template(store.schema, 40)) == 0
        assert store.write(rp.template(store.schema, 28)) == 40
        assert store.write(rp.template(store.schema, 32)) == 68
    with PayloadStorage.open_or_create(path, rp.spec("cartpole"), 64) as store:
        assert (store.write_count, len(store), store.next_incarnation()) == (100, 64, 2)
    with ReplayReader(path) as reader:
        td = reader.gather(np.arange(64))
        assert sorted(td.get(WI).tolist()) == list(range(36, 100))
        assert not rp.bad_rows(td, reader.schema).any()
        assert not rp.bad_rows(reader.sample(500), reader.schema).any()


def test_closed_handles_say_so(shm_dir):
    path = filled(shm_dir / "r")
    store, reader = PayloadStorage.open(path), ReplayReader(path)
    td = reader.sample(8)
    store.close()
    reader.close()
    store.close()  # twice is fine
    for call in (lambda: store.write(rp.template(store.schema, 1)), lambda: store.write_count,
                 lambda: reader.sample(1), lambda: len(reader), store.next_incarnation,
                 lambda: setattr(reader, "beta", 0.5)):  # (the setter took it in silence: review)
        with pytest.raises(ClosedError, match="closed"):
            call()
    with ReplayReader(path) as again:
        assert not rp.bad_rows(td, again.schema).any()  # a sample outlives the reader it came from


NO_ROOM = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE: EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
import replay_payload as rp
from ingestd.errors import StorageFull
from ingestd.replay import ReplayStorage
try:
    ReplayStorage.create(sys.argv[1], rp.spec("cartpole"), 1 << 16)
except StorageFull as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_storage_without_room_is_a_clear_error_at_create_and_leaves_nothing(shm_dir):
    """Files are allocated up front: no room is an error when the storage is created, never a
    SIGBUS in a worker that first touches an unbacked page later."""
    path = shm_dir / "r"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run([sys.executable, "-c", NO_ROOM, str(path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 3, out.stderr
    assert "no room for a replay of 65536 rows" in out.stdout and "replay.capacity" in out.stdout
    assert {p.name for p in path.iterdir()} <= {"lock"}  # no half-made files
    with ReplayStorage.create(path, rp.spec("cartpole"), 1 << 16):  # the same create, with room
        pass
    data = path / "data.bin"
    assert data.stat().st_blocks * 512 >= data.stat().st_size  # allocated, not sparse


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root only)")
def test_a_storage_whose_priority_tree_does_not_fit_leaves_nothing_and_says_the_whole_need(tmp_path):
    """Operator review: when the data fitted but the priority tree did not, a storage with
    meta.json stayed behind (holding the tmpfs's memory), its message left the tree out of the
    need, and a lower replay.capacity then failed on the half-made storage again."""
    from ingestd.errors import StorageFull
    from ingestd.replay import files, priority
    from ingestd.replay.schema import schema_of

    capacity = 1 << 16
    schema = schema_of(rp.spec("cartpole"))
    data = files.header_bytes(capacity) + files.plan_layout(schema, capacity).data_bytes
    whole = data + priority.file_bytes(capacity)
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={data + (whole - data) // 2}", "tmpfs", str(mount)]
                      ).returncode:
        pytest.skip("cannot mount a tmpfs here (root without CAP_SYS_ADMIN)")
    try:
        with pytest.raises(StorageFull) as err:
            ReplayStorage.create(mount / "r", rp.spec("cartpole"), capacity)
        assert f"it needs {whole / 2**20:.1f} MiB with its priority tree" in str(err.value), err.value
        assert {p.name for p in (mount / "r").iterdir()} <= {"lock", "priority.lock"}  # no half-made storage
        with ReplayStorage.create(mount / "r", rp.spec("cartpole"), capacity // 4):  # a smaller one fits there
            pass
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # lazy: a leaked descriptor must not keep it


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root only)")
def test_a_storage_that_cannot_fit_is_refused_before_any_block_is_allocated(tmp_path, monkeypatch):
    """Pixel-DQN review: a replay too big for its tmpfs was refused only once posix_fallocate had
    filled the tmpfs to its last block (every other user of /dev/shm got ENOSPC or SIGBUS
    meanwhile). The free space is read first: nothing is allocated, and the message says it."""
    from ingestd.errors import StorageFull
    from ingestd.replay import files

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a tmpfs here (root without CAP_SYS_ADMIN)")
    allocated = []
    monkeypatch.setattr(files, "allocate_file", lambda file, size: allocated.append(file))
    try:
        with pytest.raises(StorageFull, match=r"no room for a replay of 65536 rows .*only [\d.]+ MiB free"):
            ReplayStorage.create(mount / "r", rp.spec("cartpole"), 1 << 16)
        assert allocated == [] and {p.name for p in (mount / "r").iterdir()} <= {"lock"}
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_non_blocking_sample_while_the_first_chunk_is_in_flight_copies_no_rows_to_redraw(shm_dir):
    """Pixel-DQN review: with the first chunk reserved but not committed, sample(256) of pixel rows
    re-drew by copying 256 image rows per round, 64 rounds (1-2 s) before EmptyReplay. Draws are
    now re-drawn by their seqlocks alone: one copy, then EmptyReplay; once a row commits, it is
    the one returned."""
    with PayloadStorage.create(shm_dir / "r", rp.spec("pixels"), 1024) as store, \
            ReplayReader(shm_dir / "r") as reader:
        copies = []
        real_copy = reader._copy
        reader._copy = lambda idx, into=None: copies.append(idx.size) or real_copy(idx, into)
        with store.reserved(64) as slots:
            assert len(reader) == 64  # rows in flight count: the reader must look at their seqlocks
            with pytest.raises(EmptyReplay):
                reader.sample(256)
            assert copies == [256]
            copies.clear()
            slots.commit(rp.rows(store.schema, slots.index))
        batch = reader.sample(256)
        assert not rp.bad_rows(batch, reader.schema).any() and len(copies) <= 3


@pytest.mark.parametrize("memory", [True, False])
def test_free_space_refuses_early_only_on_a_memory_file_system(shm_dir, monkeypatch, memory):
    """Without root: the statvfs reading is trusted on tmpfs (where allocating first fills the
    RAM other processes share) and left to the allocation elsewhere (btrfs, ZFS and network file
    systems report estimates, or nothing)."""
    from ingestd.errors import StorageFull
    from ingestd.replay import files

    monkeypatch.setattr(files, "free_space", lambda path: (1 << 20, memory))
    allocated = []
    real = files.allocate_file
    monkeypatch.setattr(files, "allocate_file", lambda file, size: allocated.append(file) or real(file, size))
    if memory:
        with pytest.raises(StorageFull, match="only 1.0 MiB free"):
            ReplayStorage.create(shm_dir / "r", rp.spec("cartpole"), 1 << 16)
        assert allocated == []
    else:
        with ReplayStorage.create(shm_dir / "r", rp.spec("cartpole"), 1 << 16):
            assert allocated


def test_free_space_knows_memory_file_systems_and_counts_an_interrupted_creates_files(shm_dir):
    """statfs's f_type tells a tmpfs (the mount lookup missed escaped mount points and
    over-mounts); the files of a create killed mid-allocation are counted as room, since create
    truncates them (else every later start was refused)."""
    from ingestd.replay import files

    assert files.free_space(shm_dir / "not" / "yet")[1] is True  # the nearest existing ancestor
    assert files._memory_fs(Path("/proc")) is False
    replay = shm_dir / "r"
    replay.mkdir()
    with open(replay / "data.bin", "wb") as f:
        f.write(b"\1" * (8 << 20))
    free, memory = files.free_space(replay)
    fs = os.statvfs(replay)
    assert memory and abs(free - fs.f_bavail * fs.f_frsize - (8 << 20)) < (1 << 20)
