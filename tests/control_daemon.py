"""One real daemon shared by the control-plane test modules (it takes seconds to start).

``shared(pytestconfig)`` starts it on first use and stops it when the session
ends. Tests that change it (pause, scale, restart) put it back the way they
found it: two running workers (``restore``).
"""
from __future__ import annotations

import pytest

import contextlib
import os
import time
from pathlib import Path

import numpy as np

from daemon_proc import DaemonProc, wait_for  # noqa: F401  (re-exported for the control tests)

TESTS = str(Path(__file__).parent)
PLUGIN_ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
MAX_MESSAGE_BYTES = 64 * 1024
MAX_FRAMES = 4
SETTINGS = {
    "workers.count": 2, "workers.env": "Checksum", "workers.policy": "control_plugins:readable",
    "workers.num_envs": 8, "workers.chunk_steps": 8, "replay.capacity": 400_000, "metrics.enabled": False,
    "control.max_message_bytes": MAX_MESSAGE_BYTES, "control.max_frames": MAX_FRAMES, "control.ack_timeout_s": 10.0,
}

_daemon: DaemonProc | None = None


def shared(pytestconfig) -> DaemonProc:
    global _daemon
    if _daemon is None or _daemon.proc.poll() is not None:
        daemon = DaemonProc(overrides=dict(SETTINGS), env=PLUGIN_ENV)
        pytestconfig.add_cleanup(daemon.close)
        daemon.start()
        wait_collecting(daemon)
        _daemon = daemon
    return _daemon


def wait_collecting(daemon: DaemonProc, rows: int = 64, timeout: float = 60.0) -> None:
    """Until the daemon reports ``rows`` written and every worker has written, asked over the
    control socket."""
    from ingestd import ControlClient, DaemonUnavailable

    deadline = time.monotonic() + timeout
    with ControlClient(daemon.control_address, timeout=0.5, retries=0) as client:
        while time.monotonic() < deadline:
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {daemon.proc.returncode}; log:\n{daemon.log()}")
            daemon.remember_children()
            try:
                status = client.status()
                if status.replay.write_count >= rows and all(w.frames > 0 for w in status.workers):
                    return
            except DaemonUnavailable:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"daemon wrote fewer than {rows} rows in {timeout} s; log:\n{daemon.log()}")


@contextlib.contextmanager
def shared_paused():
    """While another module runs its own daemon: pause the shared one (if any) so that its
    workers do not take the CPU from the other daemon's."""
    from ingestd import ControlClient

    if _daemon is None or _daemon.proc.poll() is not None:
        yield
        return
    with ControlClient(_daemon.control_address, timeout=5.0) as client:
        if client.status().desired != "run":
            yield  # already paused (the ``daemon`` fixture pauses it after each module): leave it so
            return
        client.pause()
        try:
            yield
        finally:
            client.resume()


def pause_shared() -> None:
    """Pause the shared daemon's workers (if it runs), so that modules which do not use it do not
    share the CPU with them. Its users resume it: the ``daemon`` and ``client`` fixtures."""
    from ingestd import ControlClient

    if _daemon is None or _daemon.proc.poll() is not None:
        return
    with ControlClient(_daemon.control_address, timeout=5.0) as client:
        client.pause()


def restore(client) -> None:
    """Two running workers, nothing paused."""
    status = client.status()
    if status.count != 2:
        client.scale(2)
    if status.desired != "run":
        client.resume()




def rows_between(replay_path, first: int, last: int):
    """Committed rows whose write index is in ``[first, last)`` (TensorDict), sorted by write index."""
    import torch

    from ingestd.replay import ReplayReader

    with ReplayReader(replay_path) as reader:
        seq = np.array(reader.seq)
        committed = np.flatnonzero((seq > 0) & (seq % 2 == 0))
        rows = reader.gather(committed)
    index = rows.get(("ingestd", "write_index"))
    keep = ((index >= first) & (index < last)).nonzero().squeeze(-1)
    rows = rows[keep]
    rows = rows[torch.argsort(rows.get(("ingestd", "write_index")))]
    # once the ring is full, slots the writers overwrite during the gather come back as stand-in
    # draws of other committed rows (ReplayReader.gather): drop those repeats
    index = rows.get(("ingestd", "write_index"))
    first_seen = torch.ones_like(index, dtype=torch.bool)
    first_seen[1:] = index[1:] != index[:-1]
    return rows[first_seen]


def stream_breaks(rows) -> tuple[int, int]:
    """``(breaks, pairs checked)``: per (worker, env), consecutive rows (in write order) must
    continue the episode (same id, step + 1) or, after a done row, start the sub-env's next
    episode (id + num_envs, step 0), or come from a restarted worker (a later incarnation's first
    episode of that sub-env, step 0); a break is a lost or repeated step."""
    import torch

    from ingestd.replay.layout import EPISODE_BITS

    w, e = rows.get(("ingestd", "worker")), rows.get(("ingestd", "env"))
    episode, step = rows.get(("ingestd", "episode")), rows.get(("ingestd", "step"))
    done = rows.get(("next", "done")).reshape(-1)
    width = int(e.max()) + 1  # num_envs
    breaks = checked = 0
    for worker in w.unique().tolist():
        for env in e.unique().tolist():
            idx = ((w == worker) & (e == env)).nonzero().squeeze(-1)
            a, b = idx[:-1], idx[1:]
            follows = torch.where(done[a], (episode[b] == episode[a] + width) & (step[b] == 0),
                                  (episode[b] == episode[a]) & (step[b] == step[a] + 1))
            restarted = (episode[b] >> EPISODE_BITS > episode[a] >> EPISODE_BITS) & (step[b] == 0) & (
                episode[b] == ((episode[b] >> EPISODE_BITS) << EPISODE_BITS) + env)
            breaks += int((~(follows | restarted)).sum())
            checked += len(a)
    return breaks, checked


@pytest.fixture
def snapshots(daemon):
    """The shared daemon's snapshots directory; the snapshots a test writes are removed after it."""
    import shutil

    folder = daemon.data_dir / "snapshots"
    before = set(folder.iterdir()) if folder.exists() else set()
    yield folder
    for path in set(folder.iterdir()) - before if folder.exists() else ():
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(pytestconfig):
    """The shared control-test daemon (started once per session, see ``shared``), with two running
    workers while the module runs; paused after it, so that its workers take no CPU from the
    modules that do not use it (the next module that does resumes it here, or in ``client``)."""
    from ingestd import ControlClient

    d = shared(pytestconfig)
    with ControlClient(d.control_address, timeout=5.0) as c:
        restore(c)
    yield d
    pause_shared()


@pytest.fixture
def client(daemon):
    """A client on the shared daemon; the daemon is put back to running workers before and after."""
    from ingestd import ControlClient

    with ControlClient(daemon.control_address, timeout=5.0) as c:
        restore(c)
        yield c
        restore(c)
