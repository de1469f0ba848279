"""End-to-end: the weight store a daemon starts with, across restarts of the daemon
(``service.start_weights``, versions that never go backwards)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from daemon_proc import DaemonProc, wait_for
from ingestd.replay import ReplayReader
from test_daemon import all_rows


def test_a_restarted_daemon_keeps_its_weight_store_and_versions_stay_monotonic():
    """The restarted daemon publishes into the same weights file (a trainer's weights_path= mapping
    follows it); with the file gone, new weights are numbered past every version in the replay."""
    import shutil
    import tempfile

    from ingestd import ControlClient
    from ingestd.weights import WeightStore

    root = Path(tempfile.mkdtemp(prefix="ingestd-w-", dir="/dev/shm"))
    dirs = {"service.data_dir": str(root / "data"), "service.runtime_dir": str(root / "run"),
            "replay.path": str(root / "data" / "replay"), "workers.count": 1}
    weights_path, address = root / "run" / "weights", f"ipc://{root}/run/control.sock"
    trainer = None
    try:
        with DaemonProc(overrides=dirs) as d:
            d.wait_ready(rows=1)
            with WeightStore.attach(weights_path) as store:
                first, state = store.read()
            with ControlClient(address) as ctl:
                pushed = ctl.push_weights(state, wait=True)
            assert pushed == first + 1
            assert d.stop() == 0
        trainer = WeightStore.attach(weights_path)  # mapped across the restart
        with ReplayReader(root / "data" / "replay") as reader:
            written = reader.write_count
        with DaemonProc(overrides=dirs) as d:
            d.wait_ready(rows=written + 1)  # rows of this daemon: it is up (the replay has the first one's)
            assert trainer.version == pushed
            with ControlClient(address) as ctl:
                again = ctl.push_weights(state, wait=True)
            assert again == pushed + 1 and trainer.version == again
            assert weights_path.stat().st_mode & 0o777 == 0o640
            with ReplayReader(d.replay_path) as reader:  # rows of the new version land in the replay
                wait_for(lambda: int(reader.gather(np.arange(len(reader)))["ingestd", "policy_version"].max())
                         == again, 20, f"rows of version {again}")
            assert d.stop() == 0
        weights_path.unlink()  # the runtime dir lost (a reboot) while the replay stayed
        with DaemonProc(overrides=dirs) as d:
            wait_for(weights_path.exists, 60, "the new daemon's weight store")
            with WeightStore.attach(weights_path) as store:
                wait_for(lambda: store.version > 0, 10, "the first weights")
                assert store.version == again + 1, "a fresh policy must not reuse a version in the replay"
            assert d.stop() == 0
    finally:
        if trainer is not None:
            trainer.close()
        shutil.rmtree(root, ignore_errors=True)


def test_start_weights_resume_keeps_the_pushed_weights_initial_starts_from_the_policys():
    """The previous daemon's weight store is still in the runtime dir (a stop outside systemd):
    by default (service.start_weights = "resume") the next daemon keeps the trainer's pushed
    weights current, and its log says how to start fresh; with "initial" it publishes the
    policy's initial weights as a new version, past the pushed one and every version in the
    replay, and its workers collect with them."""
    import shutil
    import tempfile

    from ingestd import ControlClient
    from ingestd.weights import WeightStore

    root = Path(tempfile.mkdtemp(prefix="ingestd-s-", dir="/dev/shm"))
    dirs = {"service.data_dir": str(root / "data"), "service.runtime_dir": str(root / "run"),
            "replay.path": str(root / "data" / "replay"), "workers.count": 1}
    weights_path, address = root / "run" / "weights", f"ipc://{root}/run/control.sock"

    def stored_weights() -> tuple[int, dict]:
        with WeightStore.attach(weights_path) as store:
            return store.read()

    def collected_with(d: DaemonProc, since: int) -> set[int]:
        """The versions stamped on rows this daemon's worker wrote (write index >= ``since``),
        once there are some. (write_count counts a chunk's slots once they are taken, a moment
        before its rows are committed and readable: wait for the rows themselves.)"""
        def versions() -> set[int]:
            d.wait_ready(rows=since + 1)
            rows = all_rows(d.replay_path)
            return set(rows["ingestd", "policy_version"][rows["ingestd", "write_index"] >= since].tolist())
        return wait_for(versions, 30, f"committed rows from write index {since}")

    def written(d: DaemonProc) -> int:
        with ReplayReader(d.replay_path) as reader:
            return reader.write_count

    try:
        with DaemonProc(overrides=dirs) as d:
            d.wait_ready(rows=1)
            first, initial = stored_weights()
            trained = {k: v if k == "epsilon" else v + 1.0 for k, v in initial.items()}
            with ControlClient(address) as ctl:
                pushed = ctl.push_weights(trained, wait=True)
            assert pushed == first + 1
            since = written(d)
            wait_for(lambda: pushed in collected_with(d, since), 20, f"rows of version {pushed}")
            assert d.stop() == 0
            since = written(d)
        with DaemonProc(overrides=dirs) as d:  # resume, the default
            assert collected_with(d, since) == {pushed}
            version, state = stored_weights()
            assert version == pushed and all(torch.equal(state[k], trained[k]) for k in trained)
            assert d.stop() == 0
            since = written(d)
            assert f"resuming from weights version {pushed}" in d.log()
            assert "service.start_weights = \"initial\"" in d.log(), d.log()
        with DaemonProc(overrides={**dirs, "service.start_weights": "initial"}) as d:
            assert collected_with(d, since) == {pushed + 1}, "a new version, past the pushed one and every row's"
            version, state = stored_weights()
            assert version == pushed + 1
            assert all(torch.equal(state[k], initial[k]) for k in initial), "the policy's initial weights"
            assert d.stop() == 0
            assert f"starting from the policy's initial weights as version {version}" in d.log(), d.log()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- the weight store a daemon starts with (ingestd.service.layout._weight_store) ---------------------
# (version the runtime dir's store reached (None: no store), newest version in the replay,
#  service.start_weights, version published at start, which weights it holds)
START_WEIGHTS = [
    (5, 2, "resume", 5, "old"),  # the previous daemon's weights stay current
    (2, 5, "resume", 6, "old"),  # ... renumbered past rows of later versions in the replay
    (5, 2, "initial", 6, "initial"),  # the policy's initial weights, past the old store's version
    (2, 5, "initial", 6, "initial"),  # ... and past the replay's
    (None, 0, "resume", 1, "initial"),  # nothing left: version 1
    (None, 4, "initial", 5, "initial"),
]


@pytest.mark.parametrize("left, stored, mode, version, holds", START_WEIGHTS)
def test_start_weights_versions_never_go_backwards(tmp_path, left, stored, mode, version, holds):
    from ingestd.service.layout import _weight_store
    from ingestd.weights import WeightStore
    from ingestd.weights.wire import manifest_of

    path = tmp_path / "weights"
    old, initial = {"w": torch.full((3,), 7.0)}, {"w": torch.zeros(3)}
    if left is not None:
        with WeightStore.create(path, manifest_of(old)) as store:
            store.publish(old, version=left)
    with _weight_store(path, manifest_of(initial), initial, stored, resume=mode == "resume") as store:
        got, state = store.read()
    assert got == version and torch.equal(state["w"], (old if holds == "old" else initial)["w"])


@pytest.mark.parametrize("fresh, level", [(True, "WARNING"), (False, "INFO")])
def test_resumed_weights_into_an_empty_replay_are_a_warning(tmp_path, caplog, fresh, level):
    """Pixel-DQN review: a new experiment (a new, empty replay, other policy_kwargs) silently
    collected with the greedy weights an old trainer had pushed, said at INFO only."""
    import logging

    from ingestd.service.layout import _weight_store
    from ingestd.weights import WeightStore
    from ingestd.weights.wire import manifest_of

    path, old = tmp_path / "weights", {"w": torch.full((3,), 7.0)}
    with WeightStore.create(path, manifest_of(old)) as store:
        store.publish(old, version=23)
    with caplog.at_level(logging.INFO, logger="ingestd"):
        with _weight_store(path, manifest_of(old), {"w": torch.zeros(3)}, 0, resume=True, fresh_replay=fresh):
            pass
    said = [r for r in caplog.records if "resuming from weights version 23" in r.getMessage()]
    assert [r.levelname for r in said] == [level] and ("into an empty replay" in said[0].getMessage()) == fresh


@pytest.mark.parametrize("resumed, configured, warned", [(0.0, 1.0, True), (0.25, 0.25, False)])
def test_a_configured_epsilon_the_resumed_weights_override_is_a_warning(tmp_path, caplog, resumed, configured,
                                                                      warned):
    """Weights review: a restart with workers.policy_kwargs.epsilon changed from 0 to 1 collected
    fully greedy (the resumed weights carry epsilon as a buffer), said only at INFO as a resume."""
    import logging

    from ingestd.service.layout import _warn_overridden_kwargs, _weight_store
    from ingestd.weights import WeightStore
    from ingestd.weights.wire import manifest_of

    path = tmp_path / "weights"
    old = {"w": torch.full((3,), 7.0), "epsilon": torch.tensor(resumed)}
    with WeightStore.create(path, manifest_of(old)) as store:
        store.publish(old, version=4)
    initial = {"w": torch.zeros(3), "epsilon": torch.tensor(configured)}
    with caplog.at_level(logging.WARNING, logger="ingestd"):
        with _weight_store(path, manifest_of(initial), initial, 0, resume=True) as store:
            _warn_overridden_kwargs(store, initial, {"epsilon": configured, "hidden": [64]})
    said = [r.getMessage() for r in caplog.records if "is not in effect" in r.getMessage()]
    assert len(said) == warned, caplog.text
    if warned:
        assert "workers.policy_kwargs.epsilon = 1 " in said[0] and "epsilon = 0 " in said[0], said
        assert "service.start_weights" in said[0]


@pytest.mark.parametrize("mode", ["resume", "initial"])
def test_a_store_of_another_policy_shape_is_replaced_past_its_version(tmp_path, mode):
    from ingestd.service.layout import _weight_store
    from ingestd.weights import WeightStore
    from ingestd.weights.wire import manifest_of

    path = tmp_path / "weights"
    with WeightStore.create(path, manifest_of({"w": torch.ones(5)})) as store:
        store.publish({"w": torch.ones(5)}, version=7)
    initial = {"w": torch.zeros(3)}
    with _weight_store(path, manifest_of(initial), initial, 2, resume=mode == "resume") as store:
        assert store.read()[0] == 8 and torch.equal(store.read()[1]["w"], initial["w"])


def test_versions_pushed_without_rows_are_not_given_out_again_after_the_runtime_dir_is_removed(tmp_path):
    """Weights review: v4-v6 pushed to paused workers (no rows of them), ``systemctl stop`` (the
    runtime dir and its store removed), a start: the new store was numbered past the replay's
    newest rows only, and v4 named the policy's initial weights. Every version published for a
    replay is kept beside it (``<replay>.weights-version``), and numbered past."""
    from ingestd.service.layout import _weight_store
    from ingestd.weights.mark import mark_of
    from ingestd.weights.wire import manifest_of

    initial, pushed = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    replay = tmp_path / "data" / "replay"
    for directory in ("data", "run1", "run2"):
        (tmp_path / directory).mkdir()
    with _weight_store(tmp_path / "run1" / "weights", manifest_of(initial), initial, 3, mark=mark_of(replay)) as store:
        assert store.read()[0] == 4
        for version in (5, 6, 7):
            assert store.publish(pushed) == version  # (as a push does) no rows of them stored
    assert (tmp_path / "data" / "replay.weights-version").read_text().strip() == "7"
    # a new, empty runtime dir (run2); the replay's newest rows are still of v3
    with _weight_store(tmp_path / "run2" / "weights", manifest_of(initial), initial, 3, mark=mark_of(replay)) as store:
        version, state = store.read()
    assert version == 8 and torch.equal(state["w"], initial["w"])


@pytest.mark.parametrize("content", ["", "garbage\n", "-4\n"])
def test_an_unreadable_version_mark_is_ignored_and_rewritten(tmp_path, content):
    from ingestd.service.layout import _weight_store
    from ingestd.weights.mark import mark_of
    from ingestd.weights.wire import manifest_of

    initial = {"w": torch.zeros(3)}
    (mark := tmp_path / "replay.weights-version").write_text(content)
    with _weight_store(tmp_path / "weights", manifest_of(initial), initial, 2, mark=mark_of(tmp_path / "replay")):
        pass
    assert mark.read_text().strip() == "3"
