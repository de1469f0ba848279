"""The open-file limit: raised by `ingestd run`, watched by the control thread, and named when a
worker or a reader runs out (exhaustion review: 1,100 idle control connections made libzmq abort a
daemon under the usual soft limit of 1024)."""
from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
from sampling_rows import rows

from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.service import limits


def _soft_limit_of(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


def test_ingestd_run_raises_its_soft_open_file_limit_to_the_hard_one(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit here ({hard}) leaves nothing to raise")
    want = limits.CEILING if hard == resource.RLIM_INFINITY else min(hard, limits.CEILING)
    args = [sys.executable, "-m", "ingestd.service.cli", "run", "--set", f'service.data_dir="{tmp_path / "data"}"',
            "--set", f'service.runtime_dir="{tmp_path / "run"}"', "--set", "metrics.enabled=false",
            "--set", "workers.count=1", "--set", "workers.num_envs=8", "--set", "workers.chunk_steps=8",
            "--set", "replay.capacity=20000"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        deadline = time.monotonic() + 60
        seen = 256
        while time.monotonic() < deadline and proc.poll() is None:
            seen = _soft_limit_of(proc.pid)
            if seen == want:
                break
            time.sleep(0.05)
        assert seen == want, (seen, want, proc.poll())
    finally:
        proc.send_signal(signal.SIGTERM)  # (still starting: it may die of it before its handler is set)
        try:
            assert proc.wait(60) in (0, -signal.SIGTERM)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise


def test_descriptor_use_near_the_limit_is_warned_once_per_crossing(monkeypatch, caplog):
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = [int(0.5 * soft)]
    monkeypatch.setattr(limits, "fds_in_use", lambda: used[0])
    watch = limits.FdWatch()
    with caplog.at_level(logging.WARNING, logger="ingestd"):
        for value in (0.5, 0.85, 0.9, 0.5, 0.95):
            used[0] = int(value * soft)
            watch.check()
    said = [r.getMessage() for r in caplog.records if "file descriptors this daemon may open" in r.getMessage()]
    assert len(said) == 2 and "LimitNOFILE" in said[0], said  # at 0.85, and again at 0.95 after it fell


def test_a_reader_out_of_descriptors_says_so_and_what_to_do(shm_dir):
    store = ReplayStorage.create(shm_dir / "r", rows(1), 64)
    store.write(rows(8))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    readers = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.fds_in_use() + 12, hard))
        with pytest.raises(OSError) as refused:
            for _ in range(50):
                readers.append(ReplayReader(store.path))
    finally:
        for r in readers:
            r.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        store.close()
    message = str(refused.value)
    assert "out of file descriptors" in message and "close() the readers" in message, message
    assert readers, "no reader could be opened at all"


def test_a_worker_out_of_descriptors_names_the_limit():
    import errno

    assert limits.out_of_fds(OSError(errno.EMFILE, "Too many open files"))
    assert not limits.out_of_fds(OSError(errno.ENOENT, "gone")) and not limits.out_of_fds(ValueError())
    assert "raise LimitNOFILE" in limits.fd_hint("this worker") and str(
        resource.getrlimit(resource.RLIMIT_NOFILE)[0]) in limits.fd_hint("x")


def test_a_workers_failure_line_gives_the_hint_also_for_a_wrapped_emfile():
    """Review: only a bare OSError got the hint; an env that wraps it (its own "could not start")
    left errno 24 buried in the traceback."""
    import errno

    from ingestd.collect.worker import failure_message

    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as inner:
            raise RuntimeError("could not start the simulator") from inner
    except RuntimeError as exc:
        wrapped = exc
    line = failure_message(wrapped, inference_mode=True)
    assert line.startswith("RuntimeError: could not start the simulator") and "out of file descriptors" in line, line
    assert "raise LimitNOFILE" in failure_message(OSError(errno.EMFILE, "Too many open files"), True)
    assert "descriptors" not in failure_message(RuntimeError("scene file missing"), True)


def test_out_of_fds_follows_the_chain_but_not_past_from_none():
    import errno

    def raised(outer, inner, cut: bool):
        try:
            try:
                raise inner
            except BaseException as caught:
                if cut:
                    raise outer from None
                raise outer from caught
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            return exc

    emfile = OSError(errno.EMFILE, "Too many open files")
    assert limits.out_of_fds(raised(RuntimeError("wrapped"), emfile, cut=False))
    assert not limits.out_of_fds(raised(RuntimeError("cut"), OSError(errno.EMFILE, "x"), cut=True))
    assert not limits.out_of_fds(raised(RuntimeError("other"), ValueError("no"), cut=False))
