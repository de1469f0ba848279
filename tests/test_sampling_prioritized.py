"""Prioritized sampling: the shared sum tree (its descent against a brute-force prefix-sum
search), its statistics (chi-square over many draws), max-priority entry of new rows, stale
updates, importance weights, and a multi-process stress test (two writers and a trainer
updating priorities at once)."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from sampling_rows import rows

from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.errors import LockBusy
from ingestd.replay.priority import H_CHANGING, K, PriorityTree


def chisquare_p(counts: np.ndarray, expected: np.ndarray | None = None) -> float:
    """Pearson's chi-square test p-value (``scipy.stats.chisquare``'s, without scipy): the
    upper tail of chi-square with ``k - 1`` degrees of freedom, ``Q(df / 2, x / 2)``."""
    if expected is None:
        expected = np.full(counts.size, counts.mean())
    x = float((((counts - expected) ** 2) / expected).sum())
    df = counts.size - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def make(path, capacity=64, n=64) -> ReplayStorage:
    store = ReplayStorage.create(path, rows(1), capacity)
    if n:
        store.write(rows(n))
    return store


def tree_consistent(tree: PriorityTree) -> bool:
    return all(np.allclose(tree.levels[l + 1], tree.levels[l].reshape(-1, K).sum(1), rtol=1e-12, atol=1e-9)
               for l in range(len(tree.levels) - 1))


# -- the descent: exactly the brute-force prefix-sum search -----------------------------------------
def brute_force(leaves: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.cumsum(leaves), u, side="right")


def tree_of(path, leaves: np.ndarray) -> PriorityTree:
    tree = PriorityTree.attach(path, leaves.size)
    tree.update(np.arange(leaves.size), leaves)
    return tree


def edges_and_between(leaves: np.ndarray, rng, n: int = 2000) -> np.ndarray:
    """Every interval edge below the total, just below each edge, and random points; all
    multiples of 1/16, so with leaves in 1/8 steps every sum is exact in float64."""
    edges = np.unique(np.concatenate(([0.0], np.cumsum(leaves))))
    total = edges[-1]
    u = np.concatenate((edges, edges - 1 / 16, rng.integers(0, int(total * 16), n) / 16))
    return u[(u >= 0) & (u < total)]


@pytest.mark.parametrize("capacity", [1, 16, 17, 300, 4096, 4097, 70_000])  # 2 to 6 levels
@pytest.mark.parametrize("zeros", [0.0, 0.5, 0.97])
def test_descent_is_the_brute_force_search(shm_dir, capacity, zeros):
    rng = np.random.default_rng(capacity)
    leaves = rng.integers(1, 25, capacity) / 8 * (rng.random(capacity) >= zeros)
    if not leaves.any():
        leaves[-1] = 1.0
    tree = tree_of(shm_dir, leaves)
    try:
        u = edges_and_between(leaves, rng)
        got = tree.descend(u)
        assert (got == brute_force(leaves, u)).all()
        assert (leaves[got] > 0).all()
    finally:
        tree.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5000).filter(any), st.integers(0, 2**32 - 1))
def test_descent_property(values, seed):
    leaves = np.array(values, dtype=np.float64) / 4
    with tempfile.TemporaryDirectory(prefix="ingestd-test-", dir="/dev/shm") as d:
        tree = tree_of(Path(d), leaves)
        try:
            u = edges_and_between(leaves, np.random.default_rng(seed), 200)
            assert (tree.descend(u) == brute_force(leaves, u)).all()
        finally:
            tree.close()


def test_descent_at_the_total_stays_in_the_tree(shm_dir):
    tree = tree_of(shm_dir, np.ones(5000))
    try:
        got = tree.descend(np.array([tree.total, np.nextafter(tree.total, 0), 1e9]))
        assert (got < tree.leaf_count).all() and got[1] == 4999
    finally:
        tree.close()


@pytest.mark.parametrize("n", [6, 600])  # numpy's matrix product, and torch's above 512 rows
def test_descent_stays_in_the_tree_when_sums_are_not_finite(shm_dir, n):
    """Leaves near the float64 maximum make the sums above them inf (and ``0 * inf`` a NaN in
    the children's prefix sums), and a NaN or negative ``u`` is never drawn: every descent
    still ends on a leaf of the tree, and a ``u`` inside the first leaf on that leaf."""
    with np.errstate(over="ignore", invalid="ignore"):
        tree = tree_of(shm_dir, np.full(70_000, 1e308))
        try:
            u = np.resize([0.0, 1e300, tree.total, np.nan, -1.0, 5.0], n)
            got = tree.descend(u)
            assert ((got >= 0) & (got < tree.leaf_count)).all(), got[:6]
            assert (got[(u >= 0) & (u < 1e308)] == 0).all(), got[:6]
        finally:
            tree.close()


# -- sampling statistics --------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_frequencies_match_priorities_chi_square(shm_dir, alpha):
    with make(shm_dir / "r") as store, ReplayReader(store.path, seed=7, sampler="prioritized", alpha=alpha) as r:
        slots = np.arange(64)
        prio = np.random.default_rng(0).uniform(0.1, 10.0, 64)
        assert r.update_priorities(slots, prio, write_index=store.seq[slots] // 2 - 1) == 64
        counts = np.zeros(64)
        for _ in range(100):
            s = r.sample(512)
            np.add.at(counts, s["ingestd", "index"].numpy(), 1)
            assert (s["ingestd", "write_index"].numpy() % 64 == s["ingestd", "index"].numpy()).all()
        expected = (prio + 1e-6) ** alpha
        expected = expected / expected.sum() * counts.sum()
        p_value = chisquare_p(counts, expected)
        assert p_value > 1e-3, p_value
        # and the uniform hypothesis is clearly rejected
        assert chisquare_p(counts) < 1e-6


def test_rows_that_keep_changing_are_not_called_an_empty_replay(shm_dir, monkeypatch):
    """A full replay whose drawn rows kept changing under every re-draw said "no committed rows
    could be copied; wait for the workers" (trainer review); it now says what happened."""
    import ingestd.replay.sampling as sampling
    from ingestd.errors import EmptyReplay

    with make(shm_dir / "r") as store, ReplayReader(store.path, seed=7, sampler="prioritized") as r:
        assert r.sample(8).batch_size == (8,)
        monkeypatch.setattr(sampling, "_MAX_ROUNDS", 2)
        monkeypatch.setattr(sampling.Sampling, "_rejected", lambda self, records, bad, n, leaves: np.arange(n))
        with pytest.raises(EmptyReplay, match="the drawn rows kept changing under 2 rounds of re-draws"):
            r.sample(8)
        monkeypatch.undo()
        assert r.sample(8).batch_size == (8,)  # and the next sample is fine


def test_reset_max_priority_brings_a_blown_up_maximum_back(shm_dir):
    """One huge TD error made every later row enter at it, for good (the word only grows, across
    restarts and trainers; trainer review); reset_max_priority sets it back."""
    with make(shm_dir / "r") as store, ReplayReader(store.path, seed=7, sampler="prioritized", alpha=1.0) as r:
        slots = np.arange(64)
        assert r.update_priorities(slots, np.full(64, 2.0), write_index=store.seq[slots] // 2 - 1) == 64
        assert r.update_priorities([40], [1e180], write_index=store.seq[[40]] // 2 - 1) == 1
        tree = r._sampling.tree
        assert tree.max_leaf == pytest.approx(1e180)
        assert r.reset_max_priority(3.0) == pytest.approx(3.0 + 1e-6)
        store.write(rows(8))  # new rows enter at the reset maximum, not at 1e180
        entered = tree.levels[0][(store.write_count - 8 + np.arange(8)) % 64]
        assert np.allclose(entered, 3.0 + 1e-6)
        assert r.reset_max_priority() == pytest.approx(1e180)  # the largest a row holds now: slot 40's
        with pytest.raises(ValueError, match="finite and > 0"):
            r.reset_max_priority(float("nan"))
        for bad in (True, "2.0", [1.0, 2.0], torch.ones(3)):  # True was taken as 1.0 (review)
            with pytest.raises(TypeError, match="priority must be a number > 0"):
                r.reset_max_priority(bad)
        assert r.reset_max_priority(torch.tensor(2.0)) == pytest.approx(2.0 + 1e-6)  # td_error.max()
        assert r.reset_max_priority(np.float32(4.0)) == pytest.approx(4.0 + 1e-6)
    with ReplayReader(store.path) as uniform, pytest.raises(RuntimeError, match="sampler='prioritized'"):
        uniform.reset_max_priority(1.0)


def test_stratified_draw_is_exact_per_batch_and_shuffled(shm_dir):
    """One point per equal range of the total: a slot holding half the priority mass fills half
    of every batch, give or take the two ranges its interval only partly covers (an iid draw
    would vary by +-8 at one sigma), and the batch is not in slot order."""
    with make(shm_dir / "r", capacity=64, n=64) as store, \
            ReplayReader(store.path, seed=5, sampler="prioritized", alpha=1.0) as r:
        prio = np.ones(64)
        prio[10] = 63.0  # half the total
        r.update_priorities(np.arange(64), prio, write_index=store.seq[np.arange(64)] // 2 - 1)
        for _ in range(20):
            idx = r.sample(256)["ingestd", "index"].numpy()
            assert 127 <= (idx == 10).sum() <= 129
            assert (np.diff(idx) < 0).any() and (np.diff(idx) > 0).any()


@pytest.mark.parametrize("first,n", [(0, 1), (0, 16), (5, 4096), (69_990, 10), (12_345, 20_000),
                                     (69_995, 10), (60_000, 70_000)])
def test_a_run_of_slots_enters_consistently(shm_dir, first, n):
    """Chunks enter by slices (two where they wrap the ring); the sums above must match a full
    re-sum."""
    tree = PriorityTree.attach(shm_dir, 70_000)
    tree.update(np.arange(70_000), np.random.default_rng(first).random(70_000))
    tree.update(np.array([0]), np.array([3.0]))  # the max leaf new rows enter at
    slots = np.arange(first, first + n) % 70_000
    tree.enter(first, n)
    assert np.all(tree.levels[0][slots] == 3.0) and tree_consistent(tree)
    tree.close()


def test_prioritized_sample_into_a_reused_batch(shm_dir):
    """empty_batch of a prioritized reader carries the slot and weight keys; sampling into it
    gives the same statistics, and the batch can be handed to update_priorities."""
    with make(shm_dir / "r", capacity=64, n=64) as store, \
            ReplayReader(store.path, seed=9, sampler="prioritized", alpha=1.0) as r:
        out = r.empty_batch(256)
        prio = np.ones(64)
        prio[10] = 63.0
        r.update_priorities(np.arange(64), prio, write_index=store.seq[np.arange(64)] // 2 - 1)
        assert r.sample(256, out=out) is out
        idx = out["ingestd", "index"].numpy()
        assert 127 <= (idx == 10).sum() <= 129 and (out["ingestd", "write_index"].numpy() % 64 == idx).all()
        assert 0 < float(out["ingestd", "weight"].min()) and float(out["ingestd", "weight"].max()) == 1.0
        assert r.update_priorities(out, torch.ones(256)) == 256


def test_new_rows_enter_at_max_priority_and_reset_overwritten_slots(shm_dir):
    with make(shm_dir / "r", capacity=64, n=32) as store, \
            ReplayReader(store.path, seed=1, sampler="prioritized", alpha=1.0) as r:
        tree = r._sampling.tree
        assert np.allclose(tree.levels[0][:32], 1.0) and not tree.levels[0][32:].any()
        s = r.sample(16)
        r.update_priorities(s, torch.full((16,), 9.0))
        store.write(rows(40))  # 32 new slots, and 8 of the first ones overwritten
        leaves = tree.levels[0]
        assert np.allclose(leaves[32:64], 9.0) and np.allclose(leaves[:8], 9.0)
        assert tree_consistent(tree)


def test_new_rows_are_in_the_tree_before_their_slots_are_released(shm_dir):
    """A writer lapping the ring may take the slots once released (and clear them if it fails):
    a late enter() would put priority back on empty slots."""
    with make(shm_dir / "r", capacity=64, n=60) as store:
        tree, seen = PriorityTree.attach(store.path, 64, store.seq), []
        release = store._release

        def check_then_release(index):
            seen.append(tree.levels[0][index % 64].copy())
            release(index)

        store._release = check_then_release
        tree.update(np.arange(64), np.zeros(64))  # so that entering is visible
        store.write(rows(8))  # slots 60..63, 0..3: wraps
        assert len(seen) == 1 and np.allclose(seen[0], tree.max_leaf), seen
        tree.close()


def test_update_for_an_overwritten_slot_is_ignored(shm_dir):
    with make(shm_dir / "r", capacity=64, n=64) as store, \
            ReplayReader(store.path, seed=2, sampler="prioritized", alpha=1.0) as r:
        s = r.sample(32)
        store.write(rows(64))  # every slot now holds a newer row
        assert r.update_priorities(s, torch.full((32,), 50.0)) == 0
        assert np.allclose(r._sampling.tree.levels[0][:64], 1.0)
        fresh = r.sample(32)
        assert r.update_priorities(fresh, torch.full((32,), 50.0)) == 32


def test_updates_need_integer_slots_or_a_prioritized_sample(shm_dir):
    with make(shm_dir / "r", capacity=64, n=64) as store, \
            ReplayReader(store.path, seed=2, sampler="prioritized", alpha=1.0) as r:
        with pytest.raises(TypeError, match="index must hold integers"):
            r.update_priorities([1.5, 2.0], [5.0, 5.0])  # would have updated slots 1 and 2
        with pytest.raises(TypeError, match="write_index must hold integers"):
            r.update_priorities([1, 2], [5.0, 5.0], write_index=[1.9, 2.0])  # 1.9 would have been row 1
        with pytest.raises(ValueError, match="write_index'\\) % capacity"):
            r.update_priorities(r.gather([1, 2]), [5.0, 5.0])  # a batch without ("ingestd", "index")
        assert np.allclose(r._sampling.tree.levels[0][:64], 1.0)
        assert r.update_priorities(np.array([1, 2]), [5.0, 5.0]) == 2


def test_importance_weights(shm_dir):
    with make(shm_dir / "r", capacity=16, n=16) as store, \
            ReplayReader(store.path, seed=3, sampler="prioritized", alpha=1.0, beta=1.0) as r:
        prio = np.ones(16)
        prio[0] = 15.0  # P(0) = 1/2, P(others) = 1/30
        r.update_priorities(np.arange(16), prio, write_index=np.arange(16))
        s = r.sample(4096)
        idx, w = s["ingestd", "index"].numpy(), s["ingestd", "weight"].numpy()
        assert w.max() == pytest.approx(1.0)
        # w ~ 1 / P: the rare rows weigh 1, the frequent one 1/15
        assert np.allclose(w[idx == 0], 1 / 15, rtol=1e-4) and np.allclose(w[idx != 0], 1.0, rtol=1e-4)
        assert 0.45 < (idx == 0).mean() < 0.55


def test_existing_storage_gets_a_tree_with_its_committed_rows(shm_dir):
    with make(shm_dir / "r", capacity=64, n=20) as store:
        pass
    (shm_dir / "r" / "priority.bin").unlink()
    with ReplayReader(shm_dir / "r", seed=0, sampler="prioritized") as r:
        assert np.allclose(r._sampling.tree.levels[0][:20], 1.0) and r._sampling.tree.total == pytest.approx(20)
        assert set(r.sample(500)["ingestd", "index"].tolist()) == set(range(20))


def _killed_between_commit_and_enter(path):
    store = ReplayStorage.open(path)
    store._priorities.enter = lambda *args: os._exit(9)  # as a kill -9 right after the commit
    store.write(rows(8))


def test_rows_committed_by_a_writer_killed_before_they_entered_the_tree_are_sampled_after_recovery(shm_dir):
    with make(shm_dir / "r", capacity=64, n=16) as store:
        path = str(store.path)
    child = mp.get_context("fork").Process(target=_killed_between_commit_and_enter, args=(path,))
    child.start()
    child.join(20)
    assert child.exitcode == 9
    with ReplayStorage.open(path, recover=True) as store, ReplayReader(path, seed=0, sampler="prioritized") as r:
        assert store.write_count == 24 and list(store.seq[16:24]) == [2 * w + 2 for w in range(16, 24)]
        tree = r._sampling.tree
        assert np.allclose(tree.levels[0][:24], 1.0) and tree_consistent(tree)  # at the maximum, as if entered
        assert set(r.sample(2000)["ingestd", "index"].tolist()) == set(range(24))


def test_bad_arguments(shm_dir):
    with make(shm_dir / "r") as store:
        with pytest.raises(ValueError, match="sampler"):
            ReplayReader(store.path, sampler="rank")
        with ReplayReader(store.path) as r, pytest.raises(RuntimeError, match="prioritized"):
            r.update_priorities([0], [1.0])
        with ReplayReader(store.path, sampler="prioritized") as r:
            with pytest.raises(ValueError, match="finite"):
                r._sampling.tree.update(np.array([0]), np.array([np.nan]))
            with pytest.raises(IndexError):
                r.update_priorities([64], [1.0], write_index=[0])
            for bad in (np.nan, np.inf, -np.inf):
                with pytest.raises(ValueError, match="priorities must be finite"):
                    r.update_priorities([0, 1], [1.0, bad])
            assert np.allclose(r._sampling.tree.levels[0][:64], 1.0)  # nothing was updated


@pytest.mark.parametrize("bad, said", [(None, "got None"), ([1 + 2j, 1.0], "complex128"),
                                        (["1", "2"], "<U1"), ([True, False], "bool")])
def test_priorities_that_are_not_real_numbers_are_refused(shm_dir, bad, said):
    """Trainer review: None was called "not finite", and complex (the imaginary part dropped),
    string and bool priorities were taken."""
    with make(shm_dir / "r") as store, ReplayReader(store.path, sampler="prioritized") as r:
        with pytest.raises(ValueError, match="nothing was updated") as refused:
            r.update_priorities([0, 1], bad)
        assert said in str(refused.value)
        assert np.allclose(r._sampling.tree.levels[0][:64], 1.0)


def test_an_update_cut_short_is_repaired_before_the_next_draw_or_change(shm_dir, monkeypatch):
    """Trainer review: a KeyboardInterrupt (or SIGKILL) in update_priorities between writing the
    leaves and re-summing their ancestors left the sums stale (biased draws, a total that is not
    the leaves' sum) until the daemon's next start. The cut is marked in the shared header: the
    next change or draw, in any process, re-sums the tree first."""
    with make(shm_dir / "r", capacity=4096, n=4096) as store, \
            ReplayReader(store.path, seed=0, sampler="prioritized", alpha=1.0) as r:
        tree = r._sampling.tree

        def cut(idx):
            raise KeyboardInterrupt

        monkeypatch.setattr(tree, "_propagate", cut)
        with pytest.raises(KeyboardInterrupt):
            r.update_priorities(np.arange(0, 4096, 7), np.full(586, 50.0))
        monkeypatch.undo()
        assert not tree_consistent(tree) and tree.interrupted
        other = PriorityTree.attach(store.path, 4096)  # another process's handle sees the mark
        assert other.interrupted
        other.close()
        r.sample(64)  # a draw repairs it first
        assert tree_consistent(tree) and not tree.interrupted
        assert tree.total == pytest.approx(float(tree.levels[0][:4096].sum()))
        # a change (a worker entering rows) repairs it as well
        monkeypatch.setattr(tree, "_propagate", cut)
        with pytest.raises(KeyboardInterrupt):
            r.update_priorities(np.arange(5), np.full(5, 9.0))
        monkeypatch.undo()
        store.write(rows(8))
        assert tree_consistent(store._priorities) and not tree.interrupted


def test_a_draw_in_one_thread_leaves_a_change_under_way_in_another_alone(shm_dir):
    """Review: the flock belongs to the reader's open file, shared by its threads, so a draw's
    repair in one thread took priority.lock while another thread of the same reader was
    mid-change, re-summed under it, cleared its mark and released its lock."""
    with make(shm_dir / "r", capacity=4096, n=4096) as store, \
            ReplayReader(store.path, seed=0, sampler="prioritized") as r:
        tree, drawn = r._sampling.tree, []
        other = PriorityTree.attach(store.path, 4096)  # another open file: its own flock
        try:
            with tree.locked():
                tree._begin_change()  # this thread's change is under way
                thread = threading.Thread(target=lambda: drawn.append(r.sample(64)))
                thread.start()
                thread.join(30)
                assert drawn and drawn[0].batch_size[0] == 64  # the draw went on, without waiting
                assert tree.interrupted  # and left the change's mark alone
                with pytest.raises(LockBusy), other.locked(timeout=0.0):
                    pass  # the lock is still held for the change
                tree._header[H_CHANGING] = 0
            assert not tree.repair()  # nothing to repair once the change is done
            updated = []
            with tree.locked():  # a second thread's update waits for this thread's change
                thread = threading.Thread(target=lambda: updated.append(r.update_priorities([0], [3.0])))
                thread.start()
                thread.join(0.3)
                assert not updated
            thread.join(30)
            assert updated == [1]
        finally:
            other.close()


class _InterruptedAcquire:
    """A handle's thread lock whose acquire takes it, then a KeyboardInterrupt lands as it returns."""

    def __init__(self, lock):
        self.lock = lock

    def acquire(self, *args, **kwargs):
        self.lock.acquire(*args, **kwargs)
        raise KeyboardInterrupt

    def release(self):
        self.lock.release()

    def _is_owned(self):
        return self.lock._is_owned()


def test_a_ctrl_c_as_the_tree_lock_is_taken_leaves_nothing_held(shm_dir):
    """Review: the thread lock was acquired before the try that releases it; a Ctrl-C landing as
    acquire returned left it held, and every later update on the reader hung."""
    with make(shm_dir / "r", capacity=64, n=64) as store, ReplayReader(store.path, sampler="prioritized") as r:
        tree = r._sampling.tree
        lock, tree._threads = tree._threads, _InterruptedAcquire(tree._threads)
        with pytest.raises(KeyboardInterrupt):
            r.update_priorities([0], [2.0])
        with pytest.raises(KeyboardInterrupt):
            tree.repair()
        tree._threads = lock
        with tree.locked(timeout=0.0):  # neither the thread lock nor the flock was left held
            pass
        assert r.update_priorities([0], [2.0]) == 1


def test_changes_of_the_tree_do_not_nest(shm_dir):
    """A nested change's exit would drop the outer one's flock: refused, and the outer holds."""
    with make(shm_dir / "r", capacity=64, n=64) as store:
        tree = store._priorities
        other = PriorityTree.attach(store.path, 64)
        try:
            with tree.locked():
                with pytest.raises(RuntimeError, match="do not nest"), tree.locked():
                    pass
                assert not tree.repair()  # nor does a repair run inside a change
                with pytest.raises(LockBusy), other.locked(timeout=0.0):
                    pass  # still held
        finally:
            other.close()


def test_a_forked_child_does_not_inherit_a_held_thread_lock(shm_dir):
    """Review: a trainer thread mid-update while a DataLoader forks its workers left the child's
    copy of the thread lock held for good. The child waits for the parent's flock (the lock file
    is its own in the child) and then gets the lock."""
    with make(shm_dir / "r", capacity=64, n=64) as store, ReplayReader(store.path, sampler="prioritized") as r:
        tree = r._sampling.tree
        inside, leave = threading.Event(), threading.Event()

        def hold():
            with tree.locked():
                inside.set()
                leave.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert inside.wait(10)
            pid = os.fork()
            if pid == 0:  # the child: only the forking thread runs here
                code = 1
                try:
                    with tree.locked(timeout=20.0):
                        code = 0
                finally:
                    os._exit(code)
            time.sleep(0.2)
        finally:
            leave.set()
            holder.join(10)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("alpha", [0.6, 1.0, 8.0])
def test_huge_finite_priorities_keep_the_tree_finite_and_sampling(shm_dir, alpha):
    """32 x 1e307 ** alpha would overflow the tree's total (and every draw after): leaves are capped."""
    with make(shm_dir / "r", capacity=64, n=64) as store, \
            ReplayReader(store.path, seed=0, sampler="prioritized", alpha=alpha) as r:
        assert r.update_priorities(np.arange(32), np.full(32, 1e307)) == 32
        tree = r._sampling.tree
        assert np.isfinite(tree.total) and tree_consistent(tree)
        assert set(r.sample(256)["ingestd", "index"].tolist()) <= set(range(32))  # the huge ones dominate


@pytest.mark.parametrize("write_index", [[0], [0, 1]])  # [0] was broadcast: one row compared, two dropped
def test_write_indices_of_another_length_are_refused_and_change_nothing(shm_dir, write_index):
    with make(shm_dir / "r", capacity=64, n=64), \
            ReplayReader(shm_dir / "r", seed=0, sampler="prioritized", alpha=1.0) as r:
        with pytest.raises(ValueError, match=f"3 indices but {len(write_index)} write indices"):
            r.update_priorities(np.arange(3), np.full(3, 5.0), write_index=write_index)
        tree = r._sampling.tree
        assert np.allclose(tree.levels[0][:64], 1.0) and tree.max_leaf == 1.0 and tree.total == 64.0


# -- no room for the tree ------------------------------------------------------------------------
def _private_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` on ``path`` in a mount namespace of this (forked, single-threaded)
    process alone, gone when it exits; False where that is not allowed (not root)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 0x40000
    return (os.geteuid() == 0 and libc.unshare(clone_newns) == 0
            and libc.mount(b"none", b"/", None, ms_rec | ms_private, None) == 0  # nothing leaks out
            and libc.mount(b"tmpfs", bytes(path), b"tmpfs", 0, f"size={size}".encode()) == 0)


def _create_without_room_for_the_tree(fs: Path, report: Path) -> None:
    # capacity 4097: data.bin (528,384 bytes) and header.bin fit in 800 KiB; priority.bin (559,304) does not
    import resource
    import signal

    from ingestd.errors import StorageFull

    how = "tmpfs"
    if not _private_tmpfs(fs, "800k"):
        how = "rlimit"  # a file past RLIMIT_FSIZE: EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (540_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        ReplayStorage.create(fs / "r", rows(1), 4097).close()
    except StorageFull as exc:
        left = sorted(p.name for p in (fs / "r").iterdir() if p.name.endswith(".tmp"))
        report.write_text(f"{how}: {exc} | left: {left}")
        os._exit(3)
    os._exit(0)


def test_no_room_for_the_tree_is_a_clear_error_not_a_sigbus(shm_dir):
    """priority.bin is allocated up front, as the storage's files are: a file system with room
    for the rows but not for the tree fails with StorageFull (the storage says where and how
    much), never a SIGBUS in the process that first touches a page of a sparse tree."""
    fs, report = shm_dir / "fs", shm_dir / "report"
    fs.mkdir()
    child = mp.get_context("fork").Process(target=_create_without_room_for_the_tree, args=(fs, report))
    child.start()
    child.join(60)
    assert child.exitcode == 3, child.exitcode  # was -7 (SIGBUS) on the small tmpfs
    text = report.read_text()
    assert "priority tree" in text and "4097 rows" in text and text.endswith("left: []"), text
    with ReplayStorage.create(shm_dir / "r", rows(1), 4097):  # with room: allocated, not sparse
        tree = (shm_dir / "r" / "priority.bin").stat()
        assert tree.st_blocks * 512 >= tree.st_size


# -- multi-process stress -----------------------------------------------------------------------
def _writer(path, worker, stop):
    with ReplayStorage.open(path) as store:
        while not stop.value:
            store.write(rows(37, start=worker * 1000))


def _trainer(path, stop, out):
    errors = updates = samples = 0
    try:  # numpy only on the samples: no torch op in a forked child
        with ReplayReader(path, seed=5, sampler="prioritized", alpha=0.7) as r:
            rng = np.random.default_rng(0)
            while not stop.value:
                s = r.sample(128, timeout=5.0)  # a 512-slot ring two writers lap: a draw may find none
                samples += 1
                wi, idx = s["ingestd", "write_index"].numpy(), s["ingestd", "index"].numpy()
                errors += int((wi % r.capacity != idx).sum()) + int((s["ingestd", "weight"].numpy() <= 0).sum())
                updates += r.update_priorities(s, rng.uniform(0.1, 5.0, 128))
    except BaseException as exc:  # said, rather than a queue that stays empty
        out.put(repr(exc))
        raise
    out.put((errors, updates, samples))


def test_stress_two_writers_and_a_trainer(shm_dir):
    ctx = mp.get_context("fork")
    with make(shm_dir / "r", capacity=512, n=512) as store:
        path = str(store.path)
    stop, out = ctx.Value("b", 0, lock=False), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, w, stop)) for w in range(2)]
    procs.append(ctx.Process(target=_trainer, args=(path, stop, out)))
    for p in procs:
        p.start()
    try:
        time.sleep(2.0)
        stop.value = 1
        got = out.get(timeout=20)
        assert isinstance(got, tuple), f"the trainer failed: {got}"
        errors, updates, samples = got
    finally:
        stop.value = 1
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    assert errors == 0 and samples > 50 and updates > 0
    with ReplayStorage.open(path) as store, ReplayReader(path, sampler="prioritized") as r:
        tree = r._sampling.tree
        assert tree_consistent(tree)
        committed = (store.seq > 0) & (store.seq % 2 == 0)
        assert committed.all() and (tree.levels[0][:512] > 0).all()
        assert tree.max_leaf >= tree.levels[0].max() - 1e-12


def test_the_files_trainers_write_are_group_writable_under_the_units_umask(shm_dir):
    """Under the unit's UMask=0027 every file was 0640: a trainer in the daemon's group could
    sample rows but could not open the priority tree or the limiter for writing."""
    import stat

    old = os.umask(0o027)
    try:
        with ReplayStorage.create(shm_dir / "r", rows(8), 64) as store:
            store.write(rows(8))
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (shm_dir / "r").iterdir()}
    assert mode["priority.bin"] == mode["priority.lock"] == mode["limiter.bin"] == 0o660, mode
    assert mode["data.bin"] == mode["header.bin"] == 0o640, mode  # the rows stay read-only for the group


def test_beta_can_be_annealed_on_a_live_reader(shm_dir):
    """PER and Ape-X anneal beta towards 1; only the private reader._sampling.beta could change."""
    import pickle

    with make(shm_dir / "r", capacity=16, n=16) as store, \
            ReplayReader(store.path, seed=0, sampler="prioritized", alpha=1.0, beta=0.0) as r:
        prio = np.ones(16)
        prio[0] = 15.0
        r.update_priorities(np.arange(16), prio, write_index=np.arange(16))
        assert np.allclose(r.sample(256)["ingestd", "weight"].numpy(), 1.0)  # beta 0: no correction
        r.beta = 1.0
        s = r.sample(4096)
        w, idx = s["ingestd", "weight"].numpy(), s["ingestd", "index"].numpy()
        assert np.allclose(w[idx == 0], 1 / 15, rtol=1e-4) and r.beta == 1.0
        for bad in (-0.1, float("nan"), float("inf"), True, "1"):
            with pytest.raises(ValueError, match="beta must be"):
                r.beta = bad
        with pickle.loads(pickle.dumps(r)) as copy:
            assert copy.beta == 1.0
        with ReplayReader(store.path) as uniform, pytest.raises(ValueError, match="samples uniformly"):
            uniform.beta = 0.7  # was taken in silence, then a pickled copy (a DataLoader worker) was refused
