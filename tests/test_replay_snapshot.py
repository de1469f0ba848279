"""Snapshots of a replay storage: exact round trips, snapshots taken while real writer
processes write (every row in them intact), slots mid-write left out, and refusals of
existing destinations and damaged snapshots."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import replay_payload as rp
from test_replay_concurrency import check_all_rows, children, create, ctx, wait_until  # noqa: F401 (fixture)

from ingestd.errors import BadSnapshot, SnapshotExists, StorageNotFound
from ingestd.replay import ReplayReader, ReplayStorage, snapshot
from ingestd.control.context import pid_alive
from ingestd.service import cli


def filled(path, kind: str, capacity: int, rows: int) -> str:
    with rp.PayloadStorage.create(path, rp.spec(kind), capacity) as store:
        for _ in range(rows // 50):
            store.write(rp.template(store.schema, 50))
        store.next_incarnation()
        store.next_incarnation()
    return str(path)


def leftovers(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize("kind, capacity", [("cartpole", 2048), ("pixels", 200)])  # pixels: image columns
def test_round_trip_is_exact(shm_dir, kind, capacity):
    written = (capacity + capacity // 2) // 50 * 50  # wrapped once
    src = filled(shm_dir / "src", kind, capacity, rows=written)
    saved = snapshot.save(src, shm_dir / "snap")
    assert (saved.rows, saved.skipped, saved.capacity, saved.write_count) == (capacity, 0, capacity, written)
    assert saved.bytes > 0 and sorted(p.name for p in (shm_dir / "snap").iterdir()) == \
        ["data.lz4", "meta.json", "priority.lz4", "seq.lz4", "snapshot.json"]
    restored = snapshot.restore(shm_dir / "snap", shm_dir / "dst")
    assert (restored.rows, restored.write_count) == (capacity, saved.write_count)
    with ReplayReader(src) as a, ReplayReader(shm_dir / "dst") as b:
        assert np.array_equal(np.array(a.seq), np.array(b.seq)) and b.write_count == a.write_count
        every = np.arange(capacity)
        assert (a.gather(every) == b.gather(every)).all()
    assert check_all_rows(shm_dir / "dst") == (capacity, 0)
    with ReplayStorage.open(shm_dir / "dst") as store:  # a working storage: writes go on from write_count
        assert store.next_incarnation() == 3
        assert store.write(rp.template(store.schema, 10)) == saved.write_count
    with ReplayReader(shm_dir / "dst", sampler="prioritized", seed=0) as reader:  # its tree is rebuilt
        assert reader.sample(32).batch_size == (32,)
    assert leftovers(shm_dir) == []


def test_priorities_are_kept(shm_dir):
    src = filled(shm_dir / "src", "cartpole", 1024, rows=1000)
    with ReplayReader(src, sampler="prioritized", alpha=1.0, seed=0) as reader:
        batch = reader.sample(200)
        assert reader.update_priorities(batch, np.linspace(0.5, 7.0, 200)) > 0
        want = np.array(reader._sampling.tree.levels[0][:1024])
        want_max = reader._sampling.tree.max_leaf
    snapshot.save(src, shm_dir / "snap")
    snapshot.restore(shm_dir / "snap", shm_dir / "dst")
    with ReplayReader(shm_dir / "dst", sampler="prioritized", alpha=1.0, seed=0) as reader:
        tree = reader._sampling.tree
        assert np.array_equal(np.array(tree.levels[0][:1024]), want)
        assert tree.max_leaf == want_max > 1.0 and tree.total == pytest.approx(want.sum())
    with ReplayStorage.open(shm_dir / "dst") as store:  # a new row enters at the kept maximum
        store.write(rp.template(store.schema, 1))
        assert store._priorities.levels[0][1000] == want_max


def test_a_storage_without_a_tree_restores_at_the_default_priority(shm_dir):
    src = filled(shm_dir / "src", "cartpole", 256, rows=200)
    (shm_dir / "src" / "priority.bin").unlink()
    snapshot.save(src, shm_dir / "snap")
    assert not (shm_dir / "snap" / "priority.lz4").exists()
    assert json.loads((shm_dir / "snap" / "snapshot.json").read_text())["priorities"] is False
    snapshot.restore(shm_dir / "snap", shm_dir / "dst")
    with ReplayReader(shm_dir / "dst", sampler="prioritized", seed=0) as reader:
        assert reader._sampling.tree.total == 200.0 and reader.sample(16).batch_size == (16,)


def test_the_nstep_settings_travel_with_a_snapshot(shm_dir):
    """A restored replay of n-step rows keeps its n_step and gamma: a daemon on it refuses another
    discount as it would on the original."""
    from ingestd.replay import nstep_record

    path = filled(shm_dir / "r", "cartpole", 128, 100)
    nstep_record.write(Path(path), 3, 0.9)
    snapshot.save(path, shm_dir / "snap")
    snapshot.restore(shm_dir / "snap", shm_dir / "back")
    assert nstep_record.read(shm_dir / "back") == {"n_step": 3, "gamma": 0.9}
    plain = filled(shm_dir / "plain", "cartpole", 128, 100)  # 1-step rows: nothing recorded, nothing restored
    snapshot.save(plain, shm_dir / "snap1")
    snapshot.restore(shm_dir / "snap1", shm_dir / "back1")
    assert nstep_record.read(shm_dir / "back1") is None


def test_an_empty_storage_round_trips(shm_dir):
    src = filled(shm_dir / "src", "cartpole", 64, rows=0)
    assert snapshot.save(src, shm_dir / "snap").rows == 0
    assert snapshot.restore(shm_dir / "snap", shm_dir / "dst").rows == 0
    with ReplayReader(shm_dir / "dst") as reader:
        assert len(reader) == 0 and reader.write_count == 0


@pytest.mark.parametrize("replay_modes", [(0o750, 0o640), (0o700, 0o600)])
def test_a_snapshot_is_as_private_as_its_replay_whatever_the_umask(shm_dir, replay_modes):
    """Walkthrough review: under umask 022 a snapshot was 0755 with 0644 files (every user could
    read the rows) while the replay it copied is 0750 with 0640 files; and (diff review) a replay
    made under umask 077 must not get a looser snapshot."""
    src = filled(shm_dir / "src", "cartpole", 64, rows=50)
    os.chmod(src, replay_modes[0])
    os.chmod(Path(src) / "data.bin", replay_modes[1])
    old = os.umask(0o022)
    try:
        snapshot.save(src, shm_dir / "snap")
    finally:
        os.umask(old)
    assert (shm_dir / "snap").stat().st_mode & 0o777 == replay_modes[0]
    modes = {p.name: p.stat().st_mode & 0o777 for p in (shm_dir / "snap").iterdir()}
    assert modes and set(modes.values()) == {replay_modes[1]}, modes


def test_snapshots_taken_while_writers_write_hold_only_intact_rows(ctx, shm_dir):  # noqa: F811
    path = create(shm_dir / "r", capacity=4096)
    infos = []
    with children(ctx) as kids:
        for i in range(3):
            kids.start(rp.writer_main, path, i, 48)
        with ReplayReader(path) as reader:
            wait_until(lambda: reader.write_count > 2 * reader.capacity, 60, "writers to wrap the ring twice")
        for i in range(3):
            infos.append(snapshot.save(path, shm_dir / f"snap{i}"))
        kids.halt()
        kids.reports(3)
    for i, info in enumerate(infos):
        assert info.rows > 0 and info.rows + info.skipped <= 4096, info
        snapshot.restore(shm_dir / f"snap{i}", shm_dir / f"dst{i}")
        committed, odd = check_all_rows(shm_dir / f"dst{i}")  # every row verified against its write index
        assert (committed, odd) == (info.rows, 0)
    assert leftovers(shm_dir) == []


def test_a_slot_being_written_is_left_out(ctx, shm_dir):  # noqa: F811
    path = create(shm_dir / "r", capacity=512)
    with rp.PayloadStorage.open(path) as store:
        store.write(rp.template(store.schema, 100))
    with children(ctx) as kids:
        stalled, release, where = ctx.Event(), ctx.Event(), ctx.Array("q", 2, lock=False)
        kids.start(rp.stalling_writer_main, path, 40, stalled, release, where, with_stop=False)
        assert stalled.wait(60), "the stalling writer never stalled"
        info = snapshot.save(path, shm_dir / "snap")
        release.set()
        kids.reports(1)
    assert (info.rows, info.skipped) == (100, 40)
    snapshot.restore(shm_dir / "snap", shm_dir / "dst")
    assert check_all_rows(shm_dir / "dst") == (100, 0)
    with ReplayReader(shm_dir / "dst") as reader:
        start, n = int(where[0]), int(where[1])
        assert (np.array(reader.seq)[start:start + n] == 0).all()


def test_a_row_rewritten_while_its_block_is_read_is_left_out(shm_dir, monkeypatch):
    """The seqlock rule: a slot whose sequence number changed during the copy is not kept,
    even though its bytes may look whole (they may mix the old and the new row)."""
    src = filled(shm_dir / "src", "cartpole", 500, rows=500)
    read_block = snapshot._read_block

    def rewrite_while_reading(store, lo, hi):
        parts = read_block(store, lo, hi)
        with rp.PayloadStorage.open(src) as writer:  # laps slots 0..9 (committed before the copy)
            writer.write(rp.template(writer.schema, 10))
        return parts

    monkeypatch.setattr(snapshot, "_read_block", rewrite_while_reading)
    info = snapshot.save(src, shm_dir / "snap")
    assert (info.rows, info.skipped) == (490, 10)
    snapshot.restore(shm_dir / "snap", shm_dir / "dst")
    assert check_all_rows(shm_dir / "dst") == (490, 0)
    with ReplayReader(shm_dir / "dst") as reader:
        assert (np.array(reader.seq)[:10] == 0).all() and reader.write_count == 510


def test_existing_destinations_are_never_replaced(shm_dir):
    src = filled(shm_dir / "src", "cartpole", 128, rows=100)
    (shm_dir / "taken").mkdir()
    (shm_dir / "taken" / "keep").write_text("mine")
    with pytest.raises(SnapshotExists, match="already exists"):
        snapshot.save(src, shm_dir / "taken")
    snapshot.save(src, shm_dir / "snap")
    with pytest.raises(SnapshotExists, match="already exists"):
        snapshot.restore(shm_dir / "snap", shm_dir / "taken")
    with pytest.raises(SnapshotExists):
        snapshot.restore(shm_dir / "snap", src)
    assert (shm_dir / "taken" / "keep").read_text() == "mine"
    with pytest.raises(StorageNotFound):
        snapshot.save(shm_dir / "nothing", shm_dir / "snap2")
    assert not (shm_dir / "snap2").exists() and leftovers(shm_dir) == []


def test_threads_racing_to_one_destination_leave_one_complete_snapshot(shm_dir):
    """Each thread writes its own partial directory: the first rename wins, the others are told
    the destination appeared, and none deletes another's work in progress."""
    src = filled(shm_dir / "src", "pixels", 200, rows=200)
    start, outcomes = threading.Barrier(4), []

    def save() -> None:
        start.wait()
        try:
            outcomes.append(snapshot.save(src, shm_dir / "snap").rows)
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=save) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes, key=str) == [200] + ["SnapshotExists"] * 3, outcomes
    assert snapshot.restore(shm_dir / "snap", shm_dir / "dst").rows == 200 and leftovers(shm_dir) == []
    assert check_all_rows(shm_dir / "dst") == (200, 0)


def test_a_destination_that_appears_just_before_the_rename_is_snapshot_exists(shm_dir, monkeypatch):
    """The race the threads above run, made certain: another saver's rename lands between this
    one's check and its rename. rename(2) then fails with ENOTEMPTY, which must read as the
    destination having appeared (SnapshotExists), and the winner's snapshot stays as it was."""
    src = filled(shm_dir / "src", "cartpole", 128, rows=100)
    snapshot.save(src, shm_dir / "winner")
    rename = os.rename

    def lose_the_race(a, b, *args, **kwargs):
        if str(b) == str(shm_dir / "snap") and not (shm_dir / "snap").exists():
            rename(shm_dir / "winner", shm_dir / "snap")  # the other saver's rename, just before ours
        return rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", lose_the_race)
    with pytest.raises(SnapshotExists, match="appeared"):
        snapshot.save(src, shm_dir / "snap")
    monkeypatch.undo()
    assert leftovers(shm_dir) == [] and snapshot.restore(shm_dir / "snap", shm_dir / "dst").rows == 100


def test_a_restored_storage_samples_prioritized_at_once(shm_dir):
    """The tree is rebuilt from the restored rows (every one at the maximum priority), not kept
    from the empty storage the restore started from."""
    src = filled(shm_dir / "src", "cartpole", 256, rows=200)
    snapshot.save(src, shm_dir / "snap")
    snapshot.restore(shm_dir / "snap", shm_dir / "dst")
    with ReplayReader(shm_dir / "dst", sampler="prioritized", seed=0) as reader:
        batch = reader.sample(64, timeout=5)
        assert (batch["ingestd", "write_index"] < 200).all()


def _killed_between_commit_and_enter(path):
    store = rp.PayloadStorage.open(path)
    store._priorities.enter = lambda *args: os._exit(9)  # as a kill -9 right after the commit
    store.write(rp.template(store.schema, 8))


def test_rows_a_dead_writer_never_entered_in_the_tree_are_sampled_after_a_restore(shm_dir):
    """A snapshot taken before recovery holds committed rows whose tree leaf is still 0; the
    restore enters them at the maximum, as recovery does, so a prioritized reader of the
    restored storage samples every row."""
    src = filled(shm_dir / "src", "cartpole", 64, rows=50)
    child = mp.get_context("fork").Process(target=_killed_between_commit_and_enter, args=(src,))
    child.start()
    child.join(20)
    assert child.exitcode == 9
    snapshot.save(src, shm_dir / "snap")
    snapshot.restore(shm_dir / "snap", shm_dir / "dst")
    with ReplayReader(shm_dir / "dst", sampler="prioritized", seed=0) as reader:
        tree = reader._sampling.tree
        assert (tree.levels[0][:58] == tree.max_leaf).all() and tree.total == pytest.approx(58 * tree.max_leaf)
        assert set(reader.sample(2000)["ingestd", "write_index"].tolist()) == set(range(58))


def _rewrite_json(path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _rewrite_seq(path, change) -> None:
    import lz4.frame

    values = np.frombuffer(lz4.frame.decompress(path.read_bytes()), dtype=np.int64).copy()
    change(values)
    path.write_bytes(lz4.frame.compress(values.tobytes(), block_checksum=True, content_checksum=True))


def _swap(values) -> None:
    values[[5, 6]] = values[[6, 5]]  # committed numbers, in range, each at the other's slot


def _retype(meta) -> None:  # same layout, other dtype: read_meta alone cannot tell
    schema = json.loads(meta.read_text())
    schema["schema"]["observation"]["dtype"] = "int32"
    meta.write_text(json.dumps(schema))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated data", "truncated seq", "odd seq", "format",
                                    "missing meta", "seq at another slot", "block_rows", "write_count",
                                    "incarnations", "rows", "meta dtype", "not an object", "missing priorities",
                                    "max_priority", "negative priority"])
def test_a_damaged_snapshot_is_refused_and_nothing_is_created(shm_dir, damage):
    kind = "pixels" if damage == "block_rows" else "cartpole"  # with columns, block_rows decides where bytes go
    src = filled(shm_dir / "src", kind, 200 if kind == "pixels" else 1024, rows=200 if kind == "pixels" else 1000)
    snap = shm_dir / "snap"
    snapshot.save(src, snap)
    data, seq, info = snap / "data.lz4", snap / "seq.lz4", snap / "snapshot.json"
    if damage == "flipped byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncated data":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "truncated seq":
        seq.write_bytes(seq.read_bytes()[:-9])
    elif damage == "odd seq":
        import lz4.frame

        values = np.frombuffer(lz4.frame.decompress(seq.read_bytes()), dtype=np.int64).copy()
        values[5] += 1
        seq.write_bytes(lz4.frame.compress(values.tobytes()))
    elif damage == "format":
        info.write_text(json.dumps({**json.loads(info.read_text()), "version": 99}))
    elif damage == "missing meta":
        (snap / "meta.json").unlink()
    elif damage == "seq at another slot":
        _rewrite_seq(seq, _swap)
    elif damage == "block_rows":
        _rewrite_json(info, block_rows=100)
    elif damage in ("write_count", "incarnations", "rows"):
        _rewrite_json(info, **{damage: json.loads(info.read_text())[damage] + 7})
    elif damage == "meta dtype":
        _retype(snap / "meta.json")
    elif damage == "missing priorities":
        (snap / "priority.lz4").unlink()
    elif damage == "max_priority":
        _rewrite_json(info, max_priority=9.0)
    elif damage == "negative priority":
        import lz4.frame

        leaves = np.frombuffer(lz4.frame.decompress((snap / "priority.lz4").read_bytes()), dtype=np.float64).copy()
        leaves[3] = -1.0
        (snap / "priority.lz4").write_bytes(lz4.frame.compress(leaves.tobytes()))
    else:
        info.write_text("[]")
    with pytest.raises(BadSnapshot):
        snapshot.restore(snap, shm_dir / "dst")
    assert not (shm_dir / "dst").exists() and leftovers(shm_dir) == []


def test_names(shm_dir):
    for good in ("nightly", "2026-11-30T10.00Z", "a", "x" * 100):
        assert snapshot.check_name(good) == good
    for bad in ("", ".hidden", "a/b", "../up", "x" * 101, "sp ace", None):
        with pytest.raises(ValueError, match="not allowed"):
            snapshot.check_name(bad)


def test_on_disk(disk_dir, shm_dir):
    src = filled(shm_dir / "src", "cartpole", 256, rows=200)
    info = snapshot.save(src, disk_dir / "snap")
    snapshot.restore(disk_dir / "snap", disk_dir / "dst")
    assert check_all_rows(disk_dir / "dst") == (info.rows, 0)


def test_cli(shm_dir, capsys):
    src = filled(shm_dir / "src", "cartpole", 256, rows=200)
    assert cli.main(["replay", "snapshot", src, str(shm_dir / "snap")]) == 0
    assert "200 rows" in capsys.readouterr().out
    assert cli.main(["replay", "snapshot", src, str(shm_dir / "snap")]) == 73  # EX_CANTCREAT
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["replay", "restore", str(shm_dir / "snap"), str(shm_dir / "dst")]) == 0
    assert "storage restored at" in capsys.readouterr().out
    assert cli.main(["replay", "restore", str(shm_dir / "nope"), str(shm_dir / "dst2")]) == 66  # EX_NOINPUT
    assert "no snapshot" in capsys.readouterr().err
    assert cli.main(["replay", "restore", str(shm_dir / "snap"), str(shm_dir / "dst")]) == 73
    capsys.readouterr()
    (shm_dir / "snap" / "seq.lz4").write_bytes(b"damaged")
    assert cli.main(["replay", "restore", str(shm_dir / "snap"), str(shm_dir / "dst3")]) == 65  # EX_DATAERR
    assert "snap" in capsys.readouterr().err and not (shm_dir / "dst3").exists()


def test_cli_says_an_unreadable_snapshot_is_an_io_error_not_a_damaged_one(shm_dir, capsys, monkeypatch):
    """A snapshot the user may not read was reported "not a usable snapshot" (65), and a missing
    one behind a link counted as present."""
    src = filled(shm_dir / "src", "cartpole", 256, rows=50)
    assert cli.main(["replay", "snapshot", src, str(shm_dir / "snap")]) == 0
    capsys.readouterr()
    (shm_dir / "dangling").symlink_to(shm_dir / "nowhere")
    assert cli.main(["replay", "restore", str(shm_dir / "dangling"), str(shm_dir / "d1")]) == 66
    real = Path.read_text

    def denied(self, *args, **kwargs):
        if self.name == "snapshot.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", denied)
    assert cli.main(["replay", "restore", str(shm_dir / "snap"), str(shm_dir / "d2")]) == 74  # EX_IOERR
    assert "Permission denied" in capsys.readouterr().err and not (shm_dir / "d2").exists()


def test_cli_errors_name_what_the_operator_got_wrong(shm_dir, capsys):
    src = filled(shm_dir / "src", "cartpole", 256, rows=200)
    assert cli.main(["replay", "snapshot", src, str(shm_dir / "missing" / "snap")]) == 74  # EX_IOERR: not the source
    err = capsys.readouterr().err
    assert f"{shm_dir / 'missing'} does not exist" in err and ".partial-" not in err  # not our temp name
    assert cli.main(["replay", "snapshot", src, str(shm_dir / "snap")]) == 0
    capsys.readouterr()
    # the arguments of restore given to snapshot: a snapshot is not a storage, and nothing is "incomplete"
    assert cli.main(["replay", "snapshot", str(shm_dir / "snap"), str(shm_dir / "again")]) == 65
    err = capsys.readouterr().err
    assert "is a snapshot" in err and "ingestd replay restore" in err and "incomplete" not in err
    assert not (shm_dir / "again").exists() and leftovers(shm_dir) == []
    # a trainer attaching to the snapshot said "header.bin is missing; the storage is incomplete" (review)
    from ingestd.errors import StorageNotFound
    from ingestd.replay import ReplayReader

    with pytest.raises(StorageNotFound, match="is a snapshot, not a replay storage.*ingestd replay restore"):
        ReplayReader(shm_dir / "snap")
    # and the other way round: restore given a storage said "not a usable snapshot: [Errno 2] ... snapshot.json"
    assert cli.main(["replay", "restore", src, str(shm_dir / "again")]) == 65
    err = capsys.readouterr().err
    assert "is a replay storage, not a snapshot" in err and "Errno" not in err, err
    assert not (shm_dir / "again").exists() and leftovers(shm_dir) == []


def test_a_file_given_as_the_storage_is_named_a_file(shm_dir, capsys):
    """``ingestd replay snapshot FILE DEST`` said "directory does not exist" about a path that
    exists (a typo naming replay/meta.json, say); it goes through files.read_meta, which says what it is."""
    source = shm_dir / "meta.json"
    source.write_text("{}")
    assert cli.main(["replay", "snapshot", str(source), str(shm_dir / "snap")]) == 65
    err = capsys.readouterr().err
    assert "is a file, not a storage directory" in err and "does not exist" not in err, err
    assert not (shm_dir / "snap").exists() and leftovers(shm_dir) == []


def test_partial_snapshots_of_dead_writers_are_removed(tmp_path):
    """A daemon killed mid-snapshot left its partial directory for ever, and its megabytes made
    the next snapshot fail on a full disk; a live writer's partial is left alone."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        dead_partial = tmp_path / f".s4.partial-{gone.pid}-7"
        live_partial = tmp_path / f".s5.partial-{live.pid}-8"
        own_partial = tmp_path / f".s6.partial-{os.getpid()}-9"  # this process writes none now
        for folder in (dead_partial, live_partial, own_partial):
            folder.mkdir()
            (folder / "data").write_bytes(b"x" * 100)
        (tmp_path / "kept").mkdir()  # a finished snapshot
        removed = snapshot.remove_stale_partials(tmp_path, pid_alive)
        assert sorted(removed) == sorted([dead_partial, own_partial])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_partial.name, "kept"])
    finally:
        live.kill()
        live.wait()


def test_a_daemon_starting_removes_the_partial_snapshot_of_one_killed_mid_snapshot():
    """The partial (as large as the replay) stayed until the next snapshot (chaos review)."""
    import subprocess

    from daemon_proc import DaemonProc

    gone = subprocess.Popen(["true"])
    gone.wait()
    daemon = DaemonProc(overrides={"workers.count": 1})  # (its dirs are chosen, not yet made)
    left = daemon.data_dir / "snapshots" / f".s1.partial-{gone.pid}-7"
    kept = daemon.data_dir / "snapshots" / "s0"
    for folder in (left, kept):
        folder.mkdir(parents=True, mode=0o700)
    (left / "data.bin").write_bytes(b"x" * 4096)
    for folder in (daemon.data_dir / "snapshots", daemon.data_dir):
        folder.chmod(0o700)
    with daemon as d:
        d.wait_ready(rows=1)
        assert not left.exists() and kept.is_dir()
        assert "a snapshot a killed process left half-written" in d.log()


def test_a_restore_killed_by_sigkill_leaves_nothing_the_next_one_trips_on(shm_dir):
    """A restore preallocates the whole storage in ``.<dest>.partial-<pid>-<tid>``: one killed by
    SIGKILL left it for ever (on a tmpfs, that much memory), and a retry found no room naming
    only its own partial (snapshot review). The next save or restore of that dest removes it."""
    import subprocess

    src = filled(shm_dir / "src", "cartpole", 64, rows=64)
    snapshot.save(src, shm_dir / "snap")
    gone = subprocess.Popen(["true"])
    gone.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        dead = shm_dir / f".restored.partial-{gone.pid}-1"
        writing = shm_dir / f".restored.partial-{live.pid}-2"  # another process restoring it now
        other = shm_dir / f".other.partial-{gone.pid}-3"  # another dest's: not this restore's to judge
        for folder in (dead, writing, other):
            folder.mkdir()
        snapshot.restore(shm_dir / "snap", shm_dir / "restored")
        assert not dead.exists() and writing.exists() and other.exists()
        with ReplayStorage.open(shm_dir / "restored") as restored, ReplayStorage.open(src) as original:
            assert restored.write_count == original.write_count > 0
    finally:
        live.kill()
        live.wait()


def test_a_restore_without_room_says_so_for_a_restore(shm_dir, monkeypatch):
    """The no-room error of ``ReplayStorage.create`` advises lowering replay.capacity or choosing
    a replay.path, which a restore cannot do (its capacity is the snapshot's; snapshot review)."""
    from ingestd.errors import StorageFull

    snapshot.save(filled(shm_dir / "src", "cartpole", 64, rows=64), shm_dir / "snap")

    def full(*args, **kwargs):
        raise StorageFull("no room for a replay ...; lower replay.capacity or choose a replay.path with space")
    monkeypatch.setattr(snapshot.ReplayStorage, "create", full)
    with pytest.raises(StorageFull, match=r"no room to restore .* it needs [\d.]+ MiB, [\d.]+ MiB are free") as err:
        snapshot.restore(shm_dir / "snap", shm_dir / "restored")
    assert "replay.capacity" not in str(err.value) and not (shm_dir / "restored").exists()


def test_a_dest_name_too_long_with_the_partial_suffix_is_refused_saying_so(shm_dir):
    """A 245-character name is a valid directory name, but its partial (``.<name>.partial-PID-TID``)
    is not: the error was a bare "File name too long" naming the partial (snapshot review)."""
    src = filled(shm_dir / "src", "cartpole", 64, rows=64)
    with pytest.raises(OSError, match="is too long: at most 2[0-9][0-9] bytes here"):
        snapshot.save(src, shm_dir / ("s" * 245))
    assert sorted(p.name for p in shm_dir.iterdir()) == ["src"]
