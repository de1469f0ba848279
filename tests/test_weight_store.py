"""The shared weight store: round trips, versions, errors, and torn-read freedom across processes."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import time

import numpy as np
import pytest
import torch

from ingestd.errors import BadWeights, ClosedError, CorruptStorage, StorageNotFound
from ingestd.weights import NoWeightsYet, WeightStore, manifest_of
from ingestd.weights.store import H_ACTIVE, H_BUFVER, H_SEQ, H_VERSION


def policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def state():
    return {"w": torch.randn(4, 5), "b": torch.randn(4).bfloat16(), "n": torch.tensor(7),
            "m": torch.ones(3).bool(),
            "e": torch.zeros(0, 3), "h": torch.randn(2, 1, 3).half(), "i": torch.arange(5, dtype=torch.int16)}


@pytest.fixture
def writer(tmp_path, state):
    with WeightStore.create(tmp_path / "weights", manifest_of(state)) as store:
        yield store


def test_publish_read_round_trip_and_versions(writer, state):
    assert writer.version == 0
    for expected in (1, 2, 3):
        state["w"] += 1
        assert writer.publish(state) == expected
    with WeightStore.attach(writer.path) as reader:
        assert reader.version == 3 and reader.manifest == writer.manifest
        version, got = reader.read()
        assert version == 3
        assert_same(got, state)
        assert reader.read_if_newer(3) is None
        assert reader.read_if_newer(2)[0] == 3
        got["w"].zero_()  # the copy is private
        assert_same(reader.read()[1], state)


def test_nothing_published_yet(writer):
    with WeightStore.attach(writer.path) as reader:
        assert reader.version == 0
        assert reader.read_if_newer(0) is None
        assert reader.load_into(policy(), if_newer_than=0) is None
        with pytest.raises(NoWeightsYet, match="wait until version > 0"):
            reader.read()


def test_new_buffers_hold_sentinels(writer):
    raw = np.array(writer._buffers[0])  # buffer 0 is never written by the first publish
    sentinels = writer._tensors_over(raw)
    assert torch.isnan(sentinels["w"]).all() and torch.isnan(sentinels["b"].float()).all()
    assert (sentinels["n"] == torch.iinfo(torch.int64).max).all() and sentinels["m"].all()


def test_load_into_module(tmp_path):
    source, target = policy(), policy()
    with WeightStore.create(tmp_path / "w", manifest_of(source)) as store:
        store.publish(source)
        with WeightStore.attach(store.path) as reader:
            assert reader.load_into(target) == 1
            assert reader.load_into(target, if_newer_than=1) is None
            assert_same(target.state_dict(), source.state_dict())
            with pytest.raises(BadWeights, match="do not fit Linear"):
                reader.load_into(torch.nn.Linear(5, 4))
            # a policy factory returning a torch.compile'd module: the store holds its module's names
            # (wire.tensors_of), so a strict load into the wrapper failed and every worker crash-looped
            compiled = torch.compile(policy())
            assert reader.load_into(compiled) == 1
            assert_same(compiled._orig_mod.state_dict(), source.state_dict())


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("w"), "missing 'w'"),
    (lambda s: s.update(x=torch.ones(1)), "unexpected 'x'"),
    (lambda s: s.update(w=torch.randn(5, 4)), "'w' is float32\\[5, 4\\], expected float32\\[4, 5\\]"),
    (lambda s: s.update(n=torch.tensor(7.0)), "'n' is float32\\[\\], expected int64\\[\\]"),
    (lambda s: s.update(w=np.zeros((4, 5), np.float32)), "expected a dense torch.Tensor"),
], ids=["missing", "unexpected", "shape", "dtype", "not-a-tensor"])
def test_publish_validates_against_manifest(writer, state, change, message):
    change(state)
    with pytest.raises(BadWeights, match=message):
        writer.publish(state)
    assert writer.version == 0


def test_explicit_versions_must_increase(writer, state):
    assert writer.publish(state, version=10) == 10
    assert writer.publish(state) == 11
    with pytest.raises(ValueError, match="not newer"):
        writer.publish(state, version=11)


def test_readers_cannot_publish_or_be_pickled(writer, state):
    with WeightStore.attach(writer.path) as reader:
        with pytest.raises(PermissionError, match="read-only"):
            reader.publish(state)
        with pytest.raises(TypeError, match="attach"):
            pickle.dumps(reader)


def test_closed_store_raises(writer):
    reader = WeightStore.attach(writer.path)
    reader.close()
    reader.close()
    with pytest.raises(ClosedError, match="closed"):
        reader.version
    with pytest.raises(ClosedError):
        reader.read()
    assert "closed" in repr(reader)


@pytest.mark.parametrize("content, error", [(None, StorageNotFound), (b"", CorruptStorage),
                                            (b"\x01" * 65536, CorruptStorage)],
                         ids=["missing", "empty", "garbage"])
def test_attach_rejects_missing_or_foreign_files(tmp_path, content, error):
    path = tmp_path / "weights"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error):
        WeightStore.attach(path)


def test_create_replaces_an_old_store_atomically(tmp_path, state):
    with WeightStore.create(tmp_path / "w", manifest_of(state)) as old:
        old.publish(state)
        old.publish(state)
        with WeightStore.attach(old.path) as old_reader, \
                WeightStore.create(old.path, manifest_of({"x": torch.ones(2)})) as new:
            assert new.version == 0 and old_reader.version == 2  # the old mapping lives on
            assert WeightStore.attach(new.path).manifest.names == ("x",)
    assert [p.name for p in tmp_path.iterdir()] == ["w"]


def test_reopen_goes_on_publishing_into_the_same_file(tmp_path, state):
    """A restarted daemon reopens the store: readers mapped before the restart see its versions."""
    with WeightStore.create(tmp_path / "w", manifest_of(state)) as first:
        first.publish(state)
        inactive = 1 - int(first._header[H_ACTIVE])
        first._header[H_SEQ[inactive]] += 1  # the writer died filling the inactive buffer
        first._header[H_BUFVER[inactive]] = 0
    with WeightStore.attach(tmp_path / "w") as reader:
        with WeightStore.reopen(tmp_path / "w", manifest_of(state)) as again:
            assert again.writable and again.version == 1
            assert int(again._header[H_SEQ[inactive]]) % 2 == 0 and int(again._header[H_BUFVER[inactive]]) == 0
            version, got = again.read(timeout=1)
            assert version == 1 and torch.equal(got["w"], state["w"])  # the whole buffer stays current
            changed = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
            assert again.publish(changed) == 2
        version, got = reader.read()
        assert version == 2 and torch.equal(got["w"], state["w"] + 1)
    assert WeightStore.reopen(tmp_path / "w", manifest_of({"x": torch.ones(2)})) is None  # another shape
    assert WeightStore.reopen(tmp_path / "nothing", manifest_of(state)) is None
    (tmp_path / "junk").write_bytes(b"x" * 10_000)
    with pytest.raises(CorruptStorage):
        WeightStore.reopen(tmp_path / "junk", manifest_of(state))


def test_reopen_finishes_a_publish_killed_between_the_flip_and_the_version(tmp_path, state):
    """publish makes the filled buffer active, then sets the version: a writer killed in between
    left a whole, active buffer numbered past the version; reopen makes it current, so the next
    publish cannot reuse its number for other weights."""
    with WeightStore.create(tmp_path / "w", manifest_of(state)) as first:
        first.publish(state)
        changed = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
        first.publish(changed)
        first._header[H_VERSION] = 1  # as if killed just before writing version 2
    with WeightStore.reopen(tmp_path / "w", manifest_of(state)) as again:
        assert again.version == 2 and torch.equal(again.read(timeout=1)[1]["w"], state["w"] + 1)
        assert again.publish(state) == 3


def test_reopen_refuses_a_header_publish_cannot_leave(tmp_path, state):
    with WeightStore.create(tmp_path / "w", manifest_of(state)) as first:
        first.publish(state)
        first._header[H_SEQ[int(first._header[H_ACTIVE])]] += 1  # the active buffer is never written
    with pytest.raises(CorruptStorage, match="active buffer"):
        WeightStore.reopen(tmp_path / "w", manifest_of(state))
    with WeightStore.create(tmp_path / "v", manifest_of(state)) as first:
        first.publish(state)
        first._header[H_VERSION] = 7  # newer than any buffer
    with pytest.raises(CorruptStorage, match="not the active buffer"):
        WeightStore.reopen(tmp_path / "v", manifest_of(state))


@pytest.mark.parametrize("word", [7, -1])
def test_an_active_word_other_than_0_or_1_is_damage_to_the_writer_and_to_readers(tmp_path, state, word):
    """Chaos review: 7 raised IndexError at every daemon start (exit 1, retried for ever by systemd)
    where other damage is replaced; -1 silently picked buffer 1."""
    with WeightStore.create(tmp_path / "w", manifest_of(state)) as first:
        first.publish(state)
        reader = WeightStore.attach(tmp_path / "w")
        first._header[H_ACTIVE] = word
        with pytest.raises(CorruptStorage, match=f"active-buffer word is {word}, not 0 or 1"):
            reader.read(timeout=1)
        reader.close()
    with pytest.raises(CorruptStorage, match=f"active-buffer word is {word}"):
        WeightStore.reopen(tmp_path / "w", manifest_of(state))


def test_reader_retries_when_its_buffer_is_overwritten_during_the_copy(writer, state):
    """Deterministic interleaving: two publishes land while the reader copies buffer 1."""
    writer.publish(state)
    reader = WeightStore.attach(writer.path)
    copy, calls = reader._copy_buffer, []

    def slow_copy(index, out):
        copy(index, out)
        if not calls:
            state["w"].fill_(42.0)
            writer.publish(state)  # into buffer 0
            writer.publish(state)  # into buffer 1: the one being "copied"
        calls.append(index)

    reader._copy_buffer = slow_copy
    version, got = reader.read()
    assert calls == [1, 1] and version == 3 and (got["w"] == 42).all()
    reader._copy_buffer = copy
    reader.close()


# -- a reader process racing a writer ---------------------------------------------------
def racing_state(version: int) -> dict[str, torch.Tensor]:
    """~5 MB whose every element equals ``version`` (fp16 is exact up to 2048)."""
    return {"big": torch.full((1_000_000,), version, dtype=torch.float32),
            "mid": torch.full((250, 250), version, dtype=torch.int64),
            "half": torch.full((4000,), version, dtype=torch.float16),
            "scalar": torch.tensor(version, dtype=torch.int32)}


def reader_main(path, ready, done, reads, results) -> None:
    """Child process: read as fast as possible and count reads that mix versions."""
    torch.set_num_threads(1)
    seen, torn = set(), 0
    with WeightStore.attach(path) as store:
        ready.set()
        while not done.is_set():
            version, state = store.read()
            if not all(bool((t == version).all()) for t in state.values()):
                torn += 1
            seen.add(version)
            reads.value += 1
    results.put((reads.value, torn, sorted(seen)))


def test_reader_process_never_sees_a_torn_state(tmp_path):
    ctx = mp.get_context("spawn")
    ready, done, reads, results = ctx.Event(), ctx.Event(), ctx.Value("l", 0, lock=False), ctx.Queue()
    with WeightStore.create(tmp_path / "w", manifest_of(racing_state(0))) as store:
        store.publish(racing_state(1))
        child = ctx.Process(target=reader_main, args=(str(store.path), ready, done, reads, results), daemon=True)
        child.start()
        try:
            assert ready.wait(60), "reader process did not start"
            state, deadline = racing_state(1), time.monotonic() + 8
            enough = lambda: reads.value >= 100 and store.version >= 100  # noqa: E731
            while not enough() and store.version < 2000 and time.monotonic() < deadline:
                version = store.version + 1
                for tensor in state.values():
                    tensor.numpy().fill(version)  # numpy: single-threaded, robust on a busy box
                store.publish(state)
            done.set()
            n_reads, torn, seen = results.get(timeout=30)
        finally:
            done.set()
            child.join(10)
            if child.is_alive():
                child.kill()
    assert torn == 0, f"{torn} torn reads out of {n_reads}"
    assert n_reads >= 50 and len(seen) >= 25, (n_reads, len(seen), store.version)


_CREATE_WITHOUT_ROOM = """
import resource, signal, sys
import torch
from ingestd.weights import WeightStore, manifest_of
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past RLIMIT_FSIZE: EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    WeightStore.create(sys.argv[1], manifest_of({"w": torch.zeros(1 << 20)}))  # 2 x 4 MiB buffers
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def test_no_room_for_the_weight_store_is_a_clear_error_not_sigbus(shm_dir):
    """The store was sized sparse and filled through the mapping: on a runtime dir without room
    the daemon died of SIGBUS (exit 135, nothing logged) and systemd restarted it in a loop.
    (A fresh interpreter, not a fork: torch's thread pool does not survive a fork.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CREATE_WITHOUT_ROOM, str(shm_dir / "weights")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr}"
    assert done.stdout.startswith("StorageFull: no room for the weight store") and "MiB" in done.stdout, done.stdout
    assert list(shm_dir.iterdir()) == []  # the half-made .weights.<pid>.tmp is gone
