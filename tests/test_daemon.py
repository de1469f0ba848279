"""End-to-end: the real daemon in a subprocess."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon_proc import DaemonProc, failed_starts, pid_alive, wait_for
from ingestd.collect.stats import State, StatsBlock
from ingestd.replay import ReplayReader

TESTS = str(Path(__file__).parent)
PLUGIN_ENV = {"PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}




def all_rows(path) -> "TensorDict":
    with ReplayReader(path) as reader:
        seq = np.array(reader.seq)
        committed = np.flatnonzero((seq > 0) & (seq % 2 == 0))
        return reader.gather(committed)


def test_default_config_ready_writes_and_stops_cleanly():
    # exec'd as systemd runs it (the issue's end-to-end test), not forked from the tests' fork server
    with DaemonProc(notify=True, overrides={"workers.num_envs": 64, "workers.chunk_steps": 64}, launch="exec") as d:
        ready = d.wait_notify("READY=1", timeout=60)
        assert "STATUS=" in ready
        with ReplayReader(d.replay_path) as reader:
            first = reader.write_count
            assert first > 0
            wait_for(lambda: reader.write_count > first, 10, "write_count to grow")
            sample = reader.sample(32)
            assert sample["observation"].shape == (32, 4)
            assert sample["next", "reward"].shape == (32, 1)
        children = d.remember_children()
        assert len(children) >= 2, "expected the two worker processes"
        t0 = time.monotonic()
        assert d.stop(signal.SIGTERM, timeout=15) == 0
        assert time.monotonic() - t0 < 12
        d.recv_notify(0.2)
        assert any("STOPPING=1" in m for m in d.messages)
        assert not [pid for pid in children if pid_alive(pid)], "a worker outlived the daemon"


def test_sigterm_with_a_stopped_worker_exits_within_the_stop_deadline():
    """A worker that cannot drain (SIGSTOPped) is killed at the deadline, and the daemon itself
    exits right after: not another second later in the interpreter's teardown of torch
    (``cli.exit_now``). Exec'd, as systemd runs it: the fork server ends its children itself."""
    stop_s = 2.0
    with DaemonProc(overrides={"workers.count": 1, "workers.num_envs": 16, "service.stop_timeout_s": stop_s},
                    launch="exec") as d:
        wait_for(lambda: "worker.started" in d.log() and d.remember_children(), 60, "the worker to start")
        (worker,) = d.remember_children()
        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        assert d.stop(signal.SIGTERM, timeout=stop_s + 10) == 0
        took = time.monotonic() - t0
        assert not pid_alive(worker), "the stopped worker outlived the daemon"
        assert "some workers had to be terminated" in d.log()
        assert stop_s * 0.85 <= took <= stop_s + 0.5, f"exit {took:.2f} s after SIGTERM, deadline {stop_s} s"


@pytest.mark.parametrize("stdout", ["file", "none"])
def test_exit_now_runs_the_atexit_handlers_flushes_and_exits_with_the_code(tmp_path, stdout):
    """What `ingestd run` ends with, in a fork of this process: the status given, the atexit
    handlers run (a plugin's too), and what was still buffered in stdout written; a daemon
    started with fd 1 closed (sys.stdout None) exits with its status too, not 1."""
    import atexit

    from ingestd.service.cli import exit_now

    out = tmp_path / "out"
    out.write_text("buffered")
    pid = os.fork()
    if pid == 0:  # (the child leaves only through os._exit)
        try:
            sys.stdout = open(out, "w") if stdout == "file" else None  # (pytest captures the real one)
            atexit.register(lambda: (tmp_path / "atexit").write_text("ran"))
            if sys.stdout is not None:
                sys.stdout.write("buffered")
            exit_now(3)
        finally:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert (tmp_path / "atexit").read_text() == "ran"
    assert out.read_text() == "buffered"


def test_checksum_rows_verify_and_steps_are_contiguous():
    from ingestd.collect.envs.checksum import verify_rows

    overrides = {"workers.env": "Checksum", "workers.policy": "Random", "workers.count": 2,
                 "replay.capacity": 400_000}
    with DaemonProc(overrides=overrides) as d:
        d.wait_ready(rows=20_000)
        assert d.stop() == 0
        rows = all_rows(d.replay_path)
    assert rows.batch_size[0] >= 20_000
    assert bool(verify_rows(rows).all()), "a stored row does not verify"
    assert_contiguous(rows)


PIXELS = {"workers.env": "Pixels", "workers.policy": "Random", "workers.count": 2,
          "workers.num_envs": 16, "workers.chunk_steps": 8, "replay.capacity": 2000}


def test_pixels_images_rolled_into_their_slots_are_exact():
    """Image leaves are copied straight into reserved slots (ReplayStorage.reserved): every stored
    observation is the one of its stamps, also where a chunk wrapped around the ring."""
    with DaemonProc(overrides=PIXELS) as d:
        d.wait_ready(rows=3 * 2000)  # several laps: some chunks wrapped around the ring
        assert d.stop() == 0
        rows = all_rows(d.replay_path)
    assert rows.batch_size[0] == 2000
    assert_images_match_stamps(rows)


def test_pixels_workers_killed_mid_rollout_leave_no_bad_image():
    """SIGKILL lands while a worker rolls images into its reserved slots: those slots stay
    uncommitted (never read as rows), the worker is replaced, and every committed image still
    matches its stamps."""
    kills = 0
    with DaemonProc(overrides=PIXELS) as d:
        d.wait_ready(rows=2000)
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            rng, killed = np.random.default_rng(0), {0: 0, 1: 0}

            def collecting(w: int) -> bool:  # a new incarnation, a few chunks into its collection
                return (int(stats[w]["pid"]) != killed[w] and stats.state(w) == State.RUNNING
                        and int(stats[w]["chunks"]) > 2)
            for _ in range(8):
                worker = int(rng.integers(2))
                wait_for(lambda: collecting(worker), 30, f"worker {worker} collecting")
                killed[worker] = int(stats[worker]["pid"])
                os.kill(killed[worker], signal.SIGKILL)
                kills += 1
                time.sleep(float(rng.uniform(0.05, 0.3)))
            wait_for(lambda: all(int(stats[w]["pid"]) != killed[w] and stats.state(w) == State.RUNNING
                                 for w in (0, 1)), 30, "both workers back")
            assert int(stats[0]["restarts"]) + int(stats[1]["restarts"]) == kills
        finally:
            stats.close()
        assert d.stop() == 0
        rows = all_rows(d.replay_path)
    assert rows.batch_size[0] > 1000
    assert_images_match_stamps(rows)


def assert_images_match_stamps(rows) -> None:
    """Pixels draws ``step % 256`` into a corner pixel: each stored image is its own row's, and each
    step's observation is the previous step's next observation."""
    step = rows["ingestd", "step"]
    obs, nxt = rows["observation"], rows["next", "observation"]
    assert (obs[:, -1, 0, 0] == step % 256).all() and (nxt[:, -1, 0, 0] == (step + 1) % 256).all()
    key = torch.stack([rows["ingestd", f] for f in ("worker", "env", "episode", "step")], 1).numpy()
    order = np.lexsort(key.T[::-1])
    key = key[order]
    follows = (key[1:, :3] == key[:-1, :3]).all(1) & (key[1:, 3] == key[:-1, 3] + 1)
    first, second = torch.as_tensor(order[:-1][follows]), torch.as_tensor(order[1:][follows])
    assert first.numel() > 500 and torch.equal(obs[second], nxt[first]), "a step's observation is not the last one's next"


def assert_contiguous(rows) -> None:
    """Per (worker, env): every episode's steps are 0..k without gaps or repeats, and the
    episodes of one incarnation follow each other (nothing lost between chunks)."""
    w, e = rows["ingestd", "worker"].numpy(), rows["ingestd", "env"].numpy()
    ep, st = rows["ingestd", "episode"].numpy(), rows["ingestd", "step"].numpy()
    done = rows["next", "done"].reshape(-1).numpy()
    order = np.lexsort((st, ep, e, w))
    w, e, ep, st, done = w[order], e[order], ep[order], st[order], done[order]
    key = np.stack([w, e, ep], 1)
    same_episode = (key[1:] == key[:-1]).all(1)
    assert (st[1:][same_episode] == st[:-1][same_episode] + 1).all(), "a step is missing or repeated"
    starts = np.concatenate([[True], ~same_episode])
    assert (st[starts] == 0).all(), "an episode does not start at step 0"
    same_env = (key[1:, :2] == key[:-1, :2]).all(1) & ~same_episode
    width = int(e.max()) + 1  # num_envs: a sub-env's next episode id is num_envs further
    assert (ep[1:][same_env] == ep[:-1][same_env] + width).all() or _only_new_incarnations(ep, same_env, width)
    ends = np.concatenate([~same_episode, [True]])
    closed = ends[:-1] & same_env  # episodes followed by another of the same env must have ended
    assert done[:-1][closed].all(), "an episode was cut without done"


def _only_new_incarnations(ep, boundary, width: int) -> bool:
    jumps = ep[1:][boundary] - ep[:-1][boundary]
    return bool(((jumps == width) | (jumps >= 2**39)).all())


def test_killed_worker_comes_back_and_collection_continues():
    with DaemonProc(overrides={"workers.count": 2}) as d:
        d.wait_ready(rows=1000)
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            old = int(stats[0]["pid"])
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: int(stats[0]["pid"]) not in (0, old) and stats.state(0) == State.RUNNING, 10,
                     "worker 0 to come back running")
            assert int(stats[0]["restarts"]) == 1
            frames = int(stats[0]["frames"])
            wait_for(lambda: int(stats[0]["frames"]) > frames, 10, "the restarted worker to collect")
        finally:
            stats.close()
        assert d.stop() == 0


def test_crash_looping_worker_is_marked_failed_others_continue():
    overrides = {"workers.env": "faulty_envs:raising", "workers.env_kwargs": {"only_worker": 1},
                 "workers.policy": "Random", "workers.count": 2, "workers.restart_budget": 3,
                 "workers.restart_backoff_s": 0.05}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready(rows=100)
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            wait_for(lambda: stats.state(1) == State.FAILED, 30, "worker 1 to be marked failed")
            assert "simulated env failure" in stats.error(1)
            assert int(stats[1]["restarts"]) == 2  # budget 3: two restarts, third death marks it failed
            frames = int(stats[0]["frames"])
            wait_for(lambda: int(stats[0]["frames"]) > frames, 10, "worker 0 to keep collecting")
            assert stats.state(0) == State.RUNNING
        finally:
            stats.close()
        assert d.stop() == 0
        assert "simulated env failure" in d.log()


def test_a_restart_whose_worker_never_comes_up_fails_naming_it():
    """`ingestctl restart` reported success for a worker that failed again at once."""
    from ingestd import CommandFailed, ControlClient

    overrides = {"workers.env": "faulty_envs:failing_build", "workers.env_kwargs": {"only_worker": 1},
                 "workers.policy": "Random", "workers.count": 2, "workers.restart_budget": 1}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready(rows=100)
        with ControlClient(d.control_address, timeout=10) as client:
            wait_for(lambda: client.status().workers[1].state == "failed", 30, "worker 1 to be marked failed")
            with pytest.raises(CommandFailed, match=r"workers \[1\] did not come up.*simulated env build failure"
                               ) as err:
                client.restart([0, 1])
            assert err.value.code == "worker_failed" and "workers [0] did" in err.value.message
        assert d.stop() == 0


def test_env_slower_to_build_than_the_heartbeat_timeout_is_not_taken_for_a_hang():
    # the build takes 2.5 heartbeat timeouts; the keepalive beats every 0.5 s, a quarter of the
    # timeout (at 1 s, a worker stalled for 0.5 s on a busy machine would be taken for hung)
    overrides = {"workers.env": "faulty_envs:slow_start", "workers.env_kwargs": {"seconds": 5.0},
                 "workers.policy": "Random", "workers.count": 1, "workers.heartbeat_timeout_s": 2.0}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready(rows=100)
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            assert int(stats[0]["restarts"]) == 0 and stats.error(0) == ""
        finally:
            stats.close()
        assert d.stop() == 0
        assert "worker.hung" not in d.log()


def test_a_worker_whose_env_build_hangs_is_restarted_as_hung_after_the_start_timeout():
    """The keepalive beat for a worker building its env for ever: it stayed ``starting`` with a
    fresh heartbeat, never restarted (SAC review). It now stops beating after
    workers.start_timeout_s, and the heartbeat check restarts the worker."""
    overrides = {"workers.env": "faulty_envs:hanging_build", "workers.env_kwargs": {"only_worker": 1},
                 "workers.policy": "Random", "workers.count": 2, "workers.heartbeat_timeout_s": 1.0,
                 "workers.start_timeout_s": 1.0}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready(rows=100)
        wait_for(lambda: 'event worker.hung {"worker": 1' in d.log(), 30, "worker 1 to be restarted as hung")
        assert "has taken longer than workers.start_timeout_s" in d.log()
        assert d.stop() == 0


def test_a_hung_worker_dumps_its_stacks_before_it_is_killed():
    """SAC review: "hung: no heartbeat for 3.0 s" said nothing of where it hung. The supervisor
    now has faulthandler write every thread's stack to the log first."""
    overrides = {"workers.env": "faulty_envs:slow_steps", "workers.env_kwargs": {"step_s": 5.0},
                 "workers.policy": "Random", "workers.count": 1, "workers.heartbeat_timeout_s": 1.0}
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        wait_for(lambda: "event worker.hung" in d.log(), 60, "the worker to be found hung")
        wait_for(lambda: "event worker.died" in d.log(), 10, "the hung worker to be killed")
        log = d.log()
        assert "faulty_envs.py" in log and "in fault" in log, log[-3000:]  # the stack shows where
        assert '"exitcode": -9' in log, log[-3000:]  # then SIGKILLed
        assert d.stop() == 0


def test_a_chunk_slower_than_the_heartbeat_timeout_is_not_taken_for_a_hang():
    """Workers beat only between chunks: a chunk of slow steps (a simulator, a large policy)
    longer than heartbeat_timeout_s got its worker killed as hung before it wrote anything,
    again and again until it was marked failed. They now beat after every step."""
    overrides = {"workers.env": "faulty_envs:slow_steps", "workers.env_kwargs": {"step_s": 0.3},
                 "workers.policy": "Random", "workers.count": 1, "workers.chunk_steps": 8,
                 "workers.heartbeat_timeout_s": 1.2}  # a chunk takes 2.4 s, a step 0.3 s
    with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
        d.wait_ready(rows=8 * 8, timeout=90)
        stats = StatsBlock(d.runtime_dir / "workers.stats")
        try:
            assert int(stats[0]["restarts"]) == 0 and stats.error(0) == "", stats.error(0)
            assert float(stats[0]["chunk_seconds"]) > 1.2  # the chunk did outlast the timeout
        finally:
            stats.close()
        assert d.stop() == 0
        assert "worker.hung" not in d.log()


BAD_CONFIGS = [
    ("workers.count=-1", "workers.count"),
    ("workers.count=\"two\"", "workers.count"),
    ("workers.chunk_steps=0", "workers.chunk_steps"),
    ("replay.capacity=0", "replay.capacity"),
    ("service.log_level=\"loud\"", "service.log_level"),
    ("workers.bogus=1", "workers.bogus"),
    ("metrics.port=70000", "metrics.port"),
    ("control.address=\"tcp://127.0.0.1:5555\"", "control.address"),
]


@pytest.mark.parametrize("override,key", BAD_CONFIGS)
def test_bad_config_exits_78_naming_the_key(override, key, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ingestd.service.cli", "run", "--set", override,
                           "--set", f"service.data_dir={str(tmp_path)!r}".replace("'", '"')],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 78, proc.stderr
    assert key in proc.stderr
    assert not (tmp_path / "replay").exists(), "nothing may be created before the config is valid"


def test_a_new_replay_that_cannot_fit_is_a_config_error_naming_the_capacity(shm_dir):
    """On a memory file system (/dev/shm here) a replay past its free space is refused by name;
    on others the line only says what the file system reports (the allocation decides)."""
    from ingestd.errors import ConfigError
    from ingestd.service.config import load_config, resolve_paths
    from ingestd.service.probe import check_buildable, replay_room

    tmp_path = shm_dir
    config = load_config(None, [f'service.data_dir="{tmp_path}/data"', f'service.runtime_dir="{tmp_path}/run"',
                                'workers.env="Pixels"', 'workers.policy="Random"', "replay.capacity=1000000000"])
    paths = resolve_paths(config, os.environ)
    rows, _ = check_buildable(config, paths)
    with pytest.raises(ConfigError, match=r"1000000000 rows of 56\d\d\d bytes, [\d.]+ GiB does not fit: [\d.]+ [MG]iB "
                                          r"free on the memory file system") as err:
        replay_room(config, paths, rows)
    assert err.value.key == "replay.capacity" and not (tmp_path / "data").exists()


def test_config_default_and_check(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ingestd.service.cli", "config", "default"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    good = tmp_path / "good.toml"
    good.write_text(out)
    checks = {name: subprocess.Popen([sys.executable, "-m", "ingestd.service.cli", "config", "check", str(good),
                                      *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for name, extra in (("ok", ["--set", f'service.data_dir="{tmp_path}/data"']),
                                  ("small", ["--set", "control.max_message_bytes=1024"]))}
    outputs = {name: proc.communicate(timeout=60) for name, proc in checks.items()}
    said = {name: (outputs[name][1], proc.returncode) for name, proc in checks.items()}
    stdout = outputs["ok"][0]
    assert said["ok"][1] == 0 and "max_message_bytes" not in said["ok"][0], said["ok"]
    # what the replay will take, and the room there (a 56 GB pixel replay was "ok" on a 24 GB tmpfs)
    assert re.search(r": ok; replay .*: 1000000 rows of \d+ bytes, [\d.]+ MiB; ([\d.]+ [MG]iB free there|the file system reports only)", stdout), stdout
    # weights no push could carry: said (not an error: a policy may never be pushed to)
    assert said["small"][1] == 0 and "over control.max_message_bytes (1024)" in said["small"][0], said["small"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[workers]\ncount = 1.5\nnum_envs = 0\n")
    res = subprocess.run([sys.executable, "-m", "ingestd.service.cli", "config", "check", str(bad)],
                         capture_output=True, text=True, timeout=30)
    lines = res.stderr.splitlines()  # every problem, each on its own line
    assert res.returncode == 78 and len(lines) == 2, res.stderr
    assert all(line.startswith("ingestd: config error: config key 'workers.") for line in lines), res.stderr
    assert "'workers.count'" in lines[0] and "'workers.num_envs'" in lines[1], res.stderr


@pytest.mark.parametrize("env_kwargs, said", [
    ("{dtype=\"float64\"}", "returns float32[4] in 'observation' and float32[4] in ('next', 'observation'), "
                              "its spec says float64[4]"),
    ("{shape=[2, 2]}", "returns float32[4] in 'observation' and float32[4] in ('next', 'observation'), its "
                       "spec says float32[2, 2]"),
    ("{shape=[3]}", "its spec says float32[3]"),  # a policy that does not size from the spec: a warning only
    ("{observation_key=\"pixels\"}", ""),  # no "observation" tensor at all (TorchRL's pixel envs): nothing to say
    ("{flat=true}", "['next.reward', 'next.done', 'next.terminated', 'next.truncated'] with the per-row shapes "
                    "[[], [], [], []], not [1]"),
])
def test_the_probe_warns_of_rows_that_only_bend_the_spec_or_the_layout(env_kwargs, said, caplog):
    """Observations of another dtype or shape of as many elements than the env's spec says, and
    [B] rewards and flags, were stored without a word (custom-env review: a trainer building its
    networks from the spec, or a loss broadcasting [B] against [B, 1], went wrong silently). They
    pass with a warning: a replay made that way must keep opening."""
    import logging

    from ingestd.service.config import load_config, resolve_paths
    from ingestd.service.probe import check_buildable

    config = load_config(None, ['workers.env="faulty_envs:lying_spec"', f"workers.env_kwargs={env_kwargs}",
                                'workers.policy="Random"'])
    with caplog.at_level(logging.WARNING, logger="ingestd"):
        check_buildable(config, resolve_paths(config, os.environ))
    assert said in caplog.text if said else "its spec says" not in caplog.text, caplog.text


@pytest.mark.parametrize("case", ["flat", "float64", "bug", "reset", "transient"])
def test_config_check_tells_a_misfit_action_a_bug_and_a_transient_failure_apart(case, caplog):
    """The probe's verdicts (what `ingestd config check` and `run` check first; in-process, as
    check_buildable): an action of another float dtype, or of as many elements in another shape,
    passes the action check with a warning (envs may take them, and replays were made so:
    refusing them broke deployments), and the env decides (Pendulum takes float64 actions, but
    fails on [B] ones: exit 78 naming workers.env, with the warning and the env's traceback); an
    error in the env's own step is exit 78 with its traceback; a transient one (a simulator server
    not up yet) is not a config error: exit 1, which systemd retries."""
    import logging

    from ingestd.errors import ConfigError
    from ingestd.service.config import load_config, resolve_paths
    from ingestd.service.probe import check_buildable

    pendulum = ["workers.env=\"Gym\"", "workers.env_kwargs={id=\"Pendulum-v1\"}",
                "workers.policy=\"faulty_envs:odd_policy\""]
    settings, status, said = {
        "flat": (pendulum + ["workers.policy_kwargs={mode=\"flat\"}"], 78, "float32[B] actions, env Gym's spec says"),
        "float64": (pendulum + ["workers.policy_kwargs={mode=\"float64\"}"], 0, "stored as the policy makes them"),
        "bug": (["workers.env=\"faulty_envs:raising\""], 78, "simulated env failure in step"),
        "reset": (["workers.env=\"faulty_envs:failing_reset\""], 78, "'workers.env': env faulty_envs:failing_reset "
                  "failed to reset: RuntimeError: simulated scene"),
        "transient": (["workers.env=\"faulty_envs:raising\"", "workers.env_kwargs={connection=true}"], 1,
                      "ConnectionRefusedError"),
    }[case]
    config = load_config(None, settings)
    outcome, error = 0, None
    with caplog.at_level(logging.DEBUG, logger="ingestd"):
        try:
            check_buildable(config, resolve_paths(config, os.environ))
        except ConfigError as exc:
            outcome, error = 78, exc
        except Exception as exc:  # what `ingestd config check` lets through: exit 1, with its traceback
            outcome, error = 1, exc
    text = f"{caplog.text}\n{type(error).__name__}: {error}" if error else caplog.text
    assert outcome == status and said in text, (case, outcome, text[-2000:])
    traceback = outcome == 1 or any(r.exc_info and r.levelno >= logging.ERROR for r in caplog.records)
    assert traceback == (case != "float64"), (case, text[-2000:])


@pytest.mark.parametrize("line,key", [('env = "no_such_package.envs:make"', "workers.env")])
def test_config_check_refuses_what_run_would_refuse(line, key, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(f"[workers]\n{line}\n")
    res = subprocess.run([sys.executable, "-m", "ingestd.service.cli", "config", "check", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 78 and key in res.stderr, res.stderr


def test_second_daemon_on_the_same_runtime_dir_refuses_to_start():
    with DaemonProc(overrides={"workers.count": 1}) as first:
        first.wait_ready(rows=100)
        proc = subprocess.run(first.args(), capture_output=True, text=True, timeout=90)
        assert proc.returncode == 75, proc.stderr
        assert "another ingestd daemon is running" in proc.stderr
        with ReplayReader(first.replay_path) as reader:  # the first one is untouched and still writing
            count = reader.write_count
            wait_for(lambda: reader.write_count > count, 10, "the first daemon to keep writing")
        assert first.stop() == 0


def test_a_helper_an_env_forked_keeps_no_lock_or_port_of_a_killed_daemon(tmp_path):
    """A helper process an env forked (a multiprocessing pool) outlives a SIGKILLed daemon. It
    inherited the daemon's lock files and sockets through the worker, so the daemon could not be
    started again until the helper exited: "another ingestd daemon is running"."""
    import urllib.request

    pid_file = tmp_path / "helpers"
    overrides = {"workers.env": "faulty_envs:forking", "workers.env_kwargs": {"pid_file": str(pid_file)},
                 "workers.policy": "Random", "workers.count": 1}
    helpers: list[int] = []
    try:
        with DaemonProc(overrides=overrides, env=PLUGIN_ENV) as d:
            d.wait_ready(rows=100)
            helpers = [int(p) for p in pid_file.read_text().split()]
            workers = set(d.remember_children()) - set(helpers)
            assert d.stop(signal.SIGKILL) == -signal.SIGKILL
            wait_for(lambda: not any(pid_alive(p) for p in workers), 10, "the workers to die with the daemon")
            assert helpers and all(pid_alive(p) for p in helpers)
            with ReplayReader(d.replay_path) as reader:
                count = reader.write_count
            d.start()  # the same runtime dir, replay and metrics port
            d.wait_ready(rows=count + 100)
            with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as page:
                assert b"ingestd_" in page.read()
            assert d.stop() == 0
            assert all(pid_alive(p) for p in helpers)  # still there: it was not the helper going away
    finally:
        for pid in helpers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _args_with(daemon: DaemonProc, **settings: str) -> list[str]:
    """``daemon``'s command line with some ``--set`` values replaced (already TOML-quoted)."""
    args = daemon.args()
    for key, value in settings.items():
        at = args.index(next(a for a in args if a.startswith(f"{key}=")))
        args[at] = f"{key}={value}"
    return args


def test_a_second_daemon_is_refused_even_when_the_lock_file_was_deleted(tmp_path):
    """With the first daemon's ingestd.lock deleted (tmpfiles ageing /tmp), a second daemon on
    the same runtime dir locked a new file, published its own initial weights into the first
    one's store and reset its stats block before failing on the control address."""
    from ingestd import ControlClient

    with DaemonProc(overrides={"workers.count": 1}) as first:
        first.wait_ready(rows=100)
        with ControlClient(first.control_address, timeout=10) as client:
            before = client.status()
            (first.runtime_dir / "ingestd.lock").unlink()
            second = _args_with(first, **{"service.data_dir": f'"{tmp_path / "data"}"'})
            proc = subprocess.run(second, capture_output=True, text=True, timeout=90)
            assert proc.returncode == 75, proc.stderr
            assert "a daemon answers on" in proc.stderr and "lock file was deleted" in proc.stderr
            after = client.status()
        assert after.weights_version == before.weights_version
        assert [w.pid for w in after.workers] == [w.pid for w in before.workers] and after.workers[0].frames > 0
        assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())
        assert first.stop() == 0


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="needs systemd-tmpfiles (apt install systemd)")
def test_systemd_tmpfiles_ageing_leaves_a_running_daemons_dirs_alone():
    """A daemon started outside a login session keeps its runtime files in /tmp/ingestd-<uid>,
    which a /tmp cleanup (tmpfiles.d age, 10 days on Fedora and Arch) emptied under it: the
    lock, the weight store, the stats block. The daemon holds a BSD lock on its directories,
    which systemd-tmpfiles leaves alone; a file beside them is still aged, so the cleanup ran."""
    with DaemonProc(overrides={"workers.count": 1}) as d:
        d.wait_ready(rows=100)
        mine = sorted(p for top in (d.runtime_dir, d.data_dir) for p in top.rglob("*"))
        assert any(p.name == "ingestd.lock" for p in mine) and any(p.name == "meta.json" for p in mine)
        stale = d.root / "stale"
        stale.write_text("")
        conf = d.root / "age.conf"
        conf.write_text(f"e {d.root} - - - 1s\n")
        time.sleep(2.5)  # everything above is older than the age now (ctime counts: it cannot be faked)
        subprocess.run(["systemd-tmpfiles", "--clean", str(conf)], check=True, capture_output=True, timeout=60)
        assert not stale.exists()  # the cleanup did age what nobody holds
        assert [p for p in mine if not p.exists()] == []
        assert d.stop() == 0


def test_a_second_daemon_on_the_same_replay_is_refused(tmp_path):
    """Other runtime dir, same replay.path: it would have recovered (cleared) the slots the
    first daemon was writing and numbered weights over its versions."""
    with DaemonProc(overrides={"workers.count": 1}) as first:
        first.wait_ready(rows=100)
        second = _args_with(first, **{"service.runtime_dir": f'"{tmp_path / "run"}"', "metrics.port": "0"})
        second += ["--set", f'replay.path="{first.replay_path}"']
        proc = subprocess.run(second, capture_output=True, text=True, timeout=90)
        assert proc.returncode == 75, proc.stderr
        assert "another ingestd daemon writes the replay" in proc.stderr
        with ReplayReader(first.replay_path) as reader:
            count = reader.write_count
            wait_for(lambda: reader.write_count > count, 10, "the first daemon to keep writing")
        assert first.stop() == 0


# Config errors found only once the daemon starts: case -> (settings, text the message must
# name, text explaining why). The probe's verdicts (PROBE_FAILURES) are checked in-process
# through check_buildable, what `ingestd run` calls first (each `ingestd run` costs a torch
# import, ~6 s of CPU); STARTUP_FAILURES run as `ingestd run` with `{tmp}` a fresh directory:
# the paths, the hangs (the deadline exits the process) and one failure in user code, whose
# traceback must reach stderr before exit 78.
PROBE_FAILURES = {
    # wrong only once the daemon resolves the factories
    "env path": (['workers.env="no_such_package.envs:make"'], "workers.env", ""),
    "env kwargs": (["workers.env_kwargs.bogus=1"], "workers.env_kwargs", ""),
    "policy path": (['workers.policy="no_such_package.policies:make"'], "workers.policy", ""),
    "policy kwargs": (["workers.policy_kwargs.bogus=1"], "workers.policy_kwargs", ""),
    # an env and policy or a feature that cannot work together: every worker would crash-loop
    "continuous actions": (['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1"}'], "workers.policy",
                           "discrete action space"),
    "kwargs value": (["workers.policy_kwargs={epsilon=2.0}"], "'workers.policy'", "epsilon must be in [0, 1]"),
    # a policy whose actions do not fit the env (they were stored as they came, or failed deep in
    # the env with a traceback and exit 1: a restart loop under systemd)
    **{f"policy {mode}": (['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1"}',
                           'workers.policy="faulty_envs:odd_policy"', f'workers.policy_kwargs={{mode="{mode}"}}'],
                          "workers.policy", why)
       for mode, why in (("wide", "float32[B, 2] actions, but env Gym takes float32[B, 1]"),
                         ("int64", "int64[B, 1] actions"), ("key", "no 'action' tensor"))},
    "env step": (['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1", g="heavy"}',
                  'workers.policy="faulty_envs:odd_policy"', 'workers.policy_kwargs={mode="fits"}'],
                 "workers.env", "failed stepping"),
    # a constructor that fails for good (was exit 1, which systemd retried)
    "env constructor raises": (['workers.env="faulty_envs:failing_constructor"'], "workers.env",
                               "RuntimeError: simulated scene file missing"),
    # an env whose spec says another observation than it returns: the policy sized from the spec fails,
    # and the message says why (it blamed the policy alone)
    "spec observation": (['workers.env="faulty_envs:lying_spec"', "workers.env_kwargs={shape=[3]}"],
                         "workers.policy", "(env faulty_envs:lying_spec returns float32[4] in 'observation', its "
                         "spec says float32[3]: make EnvSpec.observation_shape/dtype what the env returns)"),
    # transitions without TorchRL's next keys were stored without them, and a step's root the policy cannot
    # take crash-looped every worker to failed, the config accepted (custom-env review)
    **{f"no next {key}": (['workers.env="faulty_envs:dropping"', f'workers.env_kwargs={{key="{key}"}}'],
                          "workers.env", f"have no ('next', '{key}')") for key in ("observation", "terminated")},
    "step observation": (['workers.env="faulty_envs:wide_root"', 'workers.env_kwargs={inner="CartPole"}'],
                         "workers.env", "failed on the observation env faulty_envs:wide_root's step returned"),
    "gym make kwarg": (['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1", gg=3.0}'], "workers.env_kwargs",
                       "unexpected keyword argument 'gg'"),
    "unknown gym id": (['workers.env="Gym"', 'workers.env_kwargs={id="NoSuchEnv-v0"}'], "workers.env_kwargs",
                       "NoSuchEnv"),
    "tuple observations": (['workers.env="Gym"', 'workers.env_kwargs={id="Blackjack-v1"}'], "workers.env",
                           "observation space"),
    "step limit": (['workers.env="faulty_envs:raising"', "workers.env_kwargs={only_worker=1}",
                    "workers.max_episode_steps=10"], "workers.max_episode_steps", "TorchEnv"),
}
STARTUP_FAILURES = {
    # an error in the user's code: its traceback in the log, then the one-line reason
    "policy raise": (['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1"}',
                      'workers.policy="faulty_envs:odd_policy"', 'workers.policy_kwargs={mode="raise"}'],
                     "workers.policy", "simulated policy failure"),
    # a constructor or policy that hangs (hung `run` for ever): the probe's deadline
    "env constructor hangs": (['workers.env="faulty_envs:hanging_build"', "workers.start_timeout_s=1"],
                              "workers.env", "building env faulty_envs:hanging_build did not finish within"),
    "policy hangs": (['workers.env="Gym"', 'workers.env_kwargs={id="Pendulum-v1"}',
                      'workers.policy="faulty_envs:odd_policy"', 'workers.policy_kwargs={mode="hang"}',
                      "workers.start_timeout_s=1"], "workers.policy", "first action did not finish within"),
    # paths, found before torch's import
    "ipc path too long": (['service.runtime_dir="{tmp}/' + "r" * 110 + '"'], "control.address", ""),
    # a directory that cannot be created ({tmp}/a-file is a file)
    **{f"{key} under a file": ([f'{key}="{{tmp}}/a-file/dir"'], key, "cannot create")
       for key in ("service.data_dir", "service.runtime_dir")},
    "replay.path under a file": (['replay.path="{tmp}/a-file/dir"'], "replay.path", "a-file is a file, not a directory"),
    # the directory itself a file (said "cannot create the directory ...: File exists")
    **{f"{key} a file": ([f'{key}="{{tmp}}/a-file"'], key, "a-file is a file, not a directory; move it away")
       for key in ("service.data_dir", "service.runtime_dir")},
    # a directory another user could have planted files or a fake control socket in
    **{f"{key} writable by everyone": ([f'{key}="{{tmp}}/open"'], key, "writable by every user")
       for key in ("service.data_dir", "service.runtime_dir")},
    **({"runtime dir of another uid": (['service.runtime_dir="{tmp}/theirs"'], "service.runtime_dir",
                                       "owned by uid 4242")} if os.geteuid() == 0 else {}),
}


FAILED_FIRST_STEP = {"policy raise", "env step", "env constructor raises", "spec observation", "step observation"}


@pytest.fixture(scope="module")
def startup_failures(tmp_path_factory):
    """``{case: (exit status, stderr, its directory)}`` of every ``STARTUP_FAILURES`` case."""
    cases = {}
    for case, (settings, _, _) in STARTUP_FAILURES.items():
        tmp = tmp_path_factory.mktemp("startup")
        (tmp / "a-file").write_text("")
        (tmp / "open").mkdir()
        (tmp / "open").chmod(0o777)  # as /tmp/ingestd-<uid> made by someone else first
        if os.geteuid() == 0:
            (tmp / "theirs").mkdir()
            os.chown(tmp / "theirs", 4242, 4242)
        args = [f'service.data_dir="{tmp}/data"', f'service.runtime_dir="{tmp}/run"', "metrics.enabled=false",
                *(setting.replace("{tmp}", str(tmp)) for setting in settings)]
        cases[case] = ([], args, None, tmp)
    yield from failed_starts(cases, PLUGIN_ENV)


@pytest.mark.parametrize("case", PROBE_FAILURES)
def test_the_start_up_probe_names_the_key_and_logs_tracebacks_of_user_code_only(case, tmp_path, caplog):
    import logging

    from ingestd.errors import ConfigError
    from ingestd.service.config import load_config, resolve_paths
    from ingestd.service.probe import check_buildable

    settings, named, why = PROBE_FAILURES[case]
    config = load_config(None, [f'service.data_dir="{tmp_path}/data"', f'service.runtime_dir="{tmp_path}/run"',
                                *settings])
    with caplog.at_level(logging.DEBUG, logger="ingestd"), pytest.raises(ConfigError) as err:
        check_buildable(config, resolve_paths(config, os.environ))
    message = str(err.value)  # as `ingestd run` logs it
    assert named in message and why in message, message
    # a failure inside the user's env or policy code keeps its traceback (in the log, before the
    # one-line reason); a value the config got wrong needs none
    logged = any(r.exc_info and r.levelno >= logging.ERROR for r in caplog.records)
    assert logged == (case in FAILED_FIRST_STEP), caplog.text
    assert not (tmp_path / "data").exists(), "nothing may be created before the config is valid"


@pytest.mark.parametrize("case", STARTUP_FAILURES)
def test_config_errors_found_at_startup_exit_78_naming_the_key(case, startup_failures):
    _, named, why = STARTUP_FAILURES[case]
    status, stderr, tmp = startup_failures[case]
    assert status == 78, stderr
    assert named in stderr and why in stderr, stderr
    # a failure inside the user's env or policy code keeps its traceback (in the log, before the
    # one-line reason); a value the config got wrong needs none
    assert ("Traceback" in stderr) == (case in FAILED_FIRST_STEP), stderr
    assert not (tmp / "data" / "replay").exists(), "nothing may be created before the config is valid"


def test_sighup_with_a_bad_config_keeps_the_daemon_and_its_config():
    """As the reload command: a config that does not check fails the reload, the daemon keeps
    running on the config it has (and says READY=1 again)."""
    with DaemonProc(overrides={"workers.count": 1}, notify=True) as d:
        d.wait_ready(rows=100)
        d.wait_notify("READY=1")
        d.config_path.write_text("[workers]\nrestart_budget = 0\n")
        seen = len(d.messages)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in d.log(), 10, "the failed reload in the log")
        time.sleep(1.0)
        assert d.proc.poll() is None, d.log()
        d.recv_notify(0.3)
        sent = [m.split("\n")[0] for m in d.messages[seen:] if "STATUS=" not in m.split("\n")[0]]
        assert sent[:2] == ["RELOADING=1", "READY=1"], d.messages[seen:]
        with ReplayReader(d.replay_path) as reader:
            count = reader.write_count
            wait_for(lambda: reader.write_count > count, 10, "the daemon to keep collecting")
        assert "received SIGHUP" in d.log()
        # the metrics say the file on disk is refused (the next start would fail on it), and once a good
        # file is read, which of its changes wait for a restart
        assert _metric(d, "ingestd_config_last_reload_successful") == "0"
        d.config_path.write_text("[workers]\nrestart_budget = 3\npolicy_kwargs = { hidden = [32] }\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: _metric(d, "ingestd_config_last_reload_successful") == "1", 10, "the good reload")
        assert _metric(d, "ingestd_config_restart_pending_keys") == "1"  # workers.policy_kwargs
        assert time.time() - float(_metric(d, "ingestd_config_last_reload_success_timestamp_seconds")) < 30
        assert d.stop() == 0
        assert "workers.restart_budget" in d.log()


def _metric(d: DaemonProc, name: str) -> str | None:
    """The value of the sample ``name`` (with its labels, as exposed) on the daemon's /metrics page."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(name + " "):
                return line.split()[-1].replace(".0", "")
    return None


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its /proc status SigCgt mask)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    mask = int(next(line.split()[1] for line in text.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def test_sighup_while_starting_neither_kills_the_daemon_nor_is_lost():
    """SIGHUP's default action killed a daemon still importing torch (exit 129, nothing
    logged); now the first thing `run` does is catch it, and the daemon reloads once it runs."""
    with DaemonProc(overrides={"workers.count": 1}, launch="exec") as d:  # exec'd: the window is torch's import
        wait_for(lambda: _catches(d.proc.pid, signal.SIGHUP), 30, "the early SIGHUP handler")
        assert not (d.runtime_dir / "control.sock").exists(), "the daemon started before the signal was sent"
        d.config_path.write_text("[workers]\nrestart_budget = 7\n")  # changed after `run` read it
        d.proc.send_signal(signal.SIGHUP)
        d.wait_ready(rows=10)
        wait_for(lambda: "reload: applied workers.restart_budget" in d.log(), 10, "the deferred reload")
        assert "a SIGHUP arrived while starting" in d.log()
        assert d.stop() == 0
