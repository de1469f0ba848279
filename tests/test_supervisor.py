"""Supervisor hang detection, driven by a fake clock with real (sleeping) processes as workers; the
worker processes' lifecycle around it (forked to die with the daemon, a fresh stats block, the
worker loop's weights and limiter hold)."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from ingestd.collect.stats import State, StatsBlock
from ingestd.service.supervisor import RestartPolicy, Slot, Supervisor

TIMEOUT_S = 5.0


class Sleeper:
    """What the supervisor uses of a worker's ``multiprocessing.Process``, over a ``sleep`` child."""

    def __init__(self):
        self._popen = subprocess.Popen(["sleep", "60"])
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        pass

    def stop(self) -> None:
        self._popen.kill()
        self._popen.wait()


class Failer(Sleeper):
    """A worker that ends by ``how`` when ``stop`` is called: ``exit 1`` (as one reporting its
    error does) or ``kill -SEGV $$`` (a crash of its own)."""

    def __init__(self, how: str = "exit 1"):
        self._popen = subprocess.Popen(["sh", "-c", f"read x; {how}"], stdin=subprocess.PIPE)
        self.pid = self._popen.pid

    def stop(self) -> None:
        if self._popen.stdin and not self._popen.stdin.closed:
            self._popen.stdin.close()
        self._popen.wait()


def spec_of(index: int) -> SimpleNamespace:
    """A worker's spec as the supervisor reads it (it starts no real worker here)."""
    return SimpleNamespace(index=index, threads=1)


@pytest.fixture
def sleepers(tmp_path):
    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    now = [100.0]
    supervisor = Supervisor(spec_of, stats, RestartPolicy(heartbeat_timeout_s=TIMEOUT_S),
                            clock=lambda: now[0])
    procs = [Sleeper(), Sleeper()]
    for index, proc in enumerate(procs):
        supervisor.slots[index] = Slot(spec=None, process=proc)
        stats[index]["state"], stats[index]["pid"] = State.RUNNING, proc.pid
    try:
        yield supervisor, stats, procs, now
    finally:
        for proc in procs:
            proc.stop()
        stats.close()


def test_a_hang_kill_excuses_the_workers_that_were_waiting_on_it(sleepers):
    """Worker 0 stops beating first (say, stuck holding the storage's lock); worker 1 stops just
    after (blocked on that lock). Both are past the timeout in the same tick: only the stalest is
    killed, and worker 1 gets a full timeout from that kill to beat again."""
    supervisor, stats, procs, now = sleepers
    stats[0]["heartbeat"], stats[1]["heartbeat"] = 90.0, 90.05
    now[0] = 90.05 + TIMEOUT_S + 0.5
    supervisor.tick()
    procs[0].join(5)
    assert not procs[0].is_alive() and procs[1].is_alive()
    assert "hung" in stats.error(0) and stats.error(1) == ""
    now[0] += TIMEOUT_S - 0.1  # worker 1 still silent, but within the timeout since the kill
    supervisor.tick()
    assert procs[1].is_alive()
    now[0] += 0.2  # really hung too: killed one timeout after the first kill
    supervisor.tick()
    procs[1].join(5)
    assert not procs[1].is_alive() and "hung" in stats.error(1)


def test_a_beating_worker_is_left_alone(sleepers):
    supervisor, stats, procs, now = sleepers
    stats[0]["heartbeat"], stats[1]["heartbeat"] = 99.0, 90.0
    now[0] = 100.0
    supervisor.tick()
    procs[1].join(5)
    assert procs[0].is_alive() and not procs[1].is_alive()


def test_scaled_down_then_up_before_it_stopped_is_restarted_not_counted_as_a_death(sleepers):
    """scale(1) asks worker 1 to stop; scale(2) before it has exited keeps the slot. The worker
    still stops (it may have seen the request already): that exit is the scale's doing, so it
    is started again at once, without a death, a failure or a backoff."""
    supervisor, stats, procs, now = sleepers
    events, started = [], []
    supervisor._on_event = lambda kind, **fields: events.append(kind)
    supervisor._start = lambda index, slot: started.append(index)
    stats[0]["heartbeat"] = stats[1]["heartbeat"] = now[0]
    supervisor.scale(1)
    supervisor.scale(2)
    assert supervisor.count == 2
    procs[1].stop()  # the worker obeys the stop it was sent
    supervisor.tick()
    assert "worker.died" not in events and supervisor.slots[1].failures == 0
    assert started == [1]


def test_scaled_down_then_up_while_waiting_to_restart_is_still_restarted(sleepers):
    supervisor, stats, procs, now = sleepers
    started = []
    supervisor._start = lambda index, slot: started.append(index)
    stats[0]["heartbeat"] = now[0] + 1.0
    procs[1].stop()
    supervisor.slots[1].process, supervisor.slots[1].start_at = None, now[0] + 1.0  # dead, in its backoff
    supervisor.scale(1)
    supervisor.scale(2)
    now[0] += 1.0
    supervisor.tick()
    assert started == [1] and 1 in supervisor.slots


def test_workers_are_numbered_in_start_order_before_they_fork(tmp_path):
    """Each worker's seed and episode ids derive from its incarnation number. Workers took it from
    the storage themselves once forked, so with several workers the order of the race decided
    which seed each got (runs with one service.seed were not reproducible): the supervisor now
    numbers them in index order, in the stats record, before each fork."""
    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    numbers = iter(range(1, 100))
    seen: dict[int, int] = {}

    class Recorded(Sleeper):
        def __init__(self, target, args, name, daemon):
            self.index = int(name.rsplit("-", 1)[1])

        def start(self) -> None:  # the number is in the record when the child would read it
            seen[self.index] = int(stats[self.index]["incarnation"])
            super().__init__()

    supervisor = Supervisor(spec_of, stats, RestartPolicy(), incarnation=lambda: next(numbers))
    supervisor._ctx = type("Ctx", (), {"Process": Recorded})()
    try:
        supervisor.scale(3)
        supervisor.tick()
        assert seen == {0: 1, 1: 2, 2: 3}
    finally:
        for slot in supervisor.slots.values():
            if slot.process is not None:
                slot.process.stop()
        stats.close()


def test_a_worker_gone_without_a_word_has_its_exit_in_the_error(sleepers):
    """A worker killed by a signal (the OOM killer) or by os._exit leaves no error of its own:
    status showed a failed worker with no reason; the supervisor now records how it ended."""
    supervisor, stats, procs, now = sleepers
    assert stats.error(0) == ""
    procs[0].stop()  # SIGKILL
    supervisor.tick()
    assert stats.error(0).startswith("killed by SIGKILL"), stats.error(0)
    stats.set_error(1, "ValueError: the env's own words")
    procs[1].stop()
    supervisor.tick()
    assert stats.error(1) == "ValueError: the env's own words"  # a worker's own error is kept


def test_each_death_is_reported_with_its_own_reason_not_an_earlier_ones(tmp_path):
    """The error word keeps the last death's text for status; a later death that left no error
    of its own took it over: SIGSEGVs after one SIGKILL were all logged, evented and finally
    marked failed as "killed by SIGKILL ... the OOM killer?", a crash after a hang kill as
    "hung" (ops review). Each death now reports how it ended."""

    class Forks:  # real processes, each ended by the test as the next death
        def __init__(self):
            self.made = []

        def Process(self, **kwargs):  # noqa: N802 - multiprocessing's name
            return self

        def start(self):
            self.made.append(Failer("kill -SEGV $$"))

        def __getattr__(self, name):  # pid, exitcode, join, close: the process last started
            return getattr(self.made[-1], name)

    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    now = [100.0]
    supervisor = Supervisor(spec_of, stats, RestartPolicy(budget=3, heartbeat_timeout_s=TIMEOUT_S),
                            clock=lambda: now[0])
    events = []
    supervisor._on_event = lambda name, **fields: events.append((name, fields))
    supervisor._ctx = forks = Forks()
    try:
        supervisor.scale(1)
        supervisor.tick()
        forks.made[-1]._popen.kill()  # from outside: SIGKILL
        forks.made[-1]._popen.wait()
        supervisor.tick()
        assert stats.error(0).startswith("killed by SIGKILL"), stats.error(0)
        from ingestd.collect import profiling

        lost = profiling.request(stats[0], tmp_path / "lost.json", 1.0)  # one the dead worker never wrote
        for _ in range(2):  # crashes of its own, each with the reason of its own end (the budget: 3 deaths)
            now[0] += 60.0
            supervisor.tick()  # restarted
            assert profiling.outcome(stats[0], lost)[0] is False  # answered as failed as the next one started
            stats[0]["heartbeat"] = now[0]
            forks.made[-1].stop()  # SIGSEGV
            supervisor.tick()
        died = [fields["error"] for name, fields in events if name == "worker.died"]
        assert died[0].startswith("killed by SIGKILL") and len(died) == 3, died
        assert all(e.startswith("killed by SIGSEGV") for e in died[1:]), died
        failed = [fields["error"] for name, fields in events if name == "worker.failed"]
        assert failed and failed[0].startswith("killed by SIGSEGV"), failed
        assert stats.error(0).startswith("killed by SIGSEGV")
    finally:
        for proc in forks.made:
            if proc.is_alive():
                proc._popen.kill()
                proc._popen.wait()
        stats.close()


def test_a_fork_that_fails_is_retried_with_backoff_then_marked_failed(tmp_path):
    """A fork failing with EMFILE (descriptors exhausted) was not handled: the daemon began
    stopping, then crashed joining the process that never started."""
    import errno

    class NoFork:
        def Process(self, **kwargs):  # noqa: N802 - multiprocessing's name
            return self

        def start(self):
            raise OSError(errno.EMFILE, "Too many open files")

    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    now = [100.0]
    supervisor = Supervisor(spec_of, stats, RestartPolicy(budget=3), clock=lambda: now[0])
    supervisor._ctx = NoFork()
    try:
        supervisor.scale(1)
        for _ in range(3):
            supervisor.tick()
            assert supervisor.slots[0].process is None and "Too many open files" in stats.error(0)
            now[0] += 60.0  # past any backoff
        assert stats.state(0) == State.FAILED
        assert supervisor.stop_all(1.0)  # nothing to join: no crash
    finally:
        stats.close()


def _open_fds() -> set[int]:
    import os
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.mark.parametrize("failing", ["fork", "second pipe"])
def test_a_failed_fork_closes_the_pipes_it_opened(tmp_path, monkeypatch, failing):
    """multiprocessing's fork Popen opens two pipes before forking and leaked all four
    descriptors when the fork (EAGAIN, ENOMEM) or the second pipe (EMFILE) failed; the
    supervisor retries failed starts, so a host short of processes or descriptors lost more
    descriptors with every retry."""
    import errno
    import os

    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    now = [100.0]
    supervisor = Supervisor(spec_of, stats, RestartPolicy(budget=3), clock=lambda: now[0])
    real_pipe, pipes = os.pipe, []

    def fail_fork():
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    def pipe():
        if pipes:
            raise OSError(errno.EMFILE, "Too many open files")
        pipes.append(real_pipe())
        return pipes[-1]

    try:
        before = _open_fds()
        with monkeypatch.context() as patch:
            patch.setattr(os, "fork", fail_fork) if failing == "fork" else patch.setattr(os, "pipe", pipe)
            supervisor.scale(1)
            supervisor.tick()
        assert supervisor.slots[0].process is None and stats.error(0), stats.error(0)
        assert not _open_fds() - before  # (another test's garbage may close some meanwhile)
    finally:
        supervisor.stop_all(1.0)
        stats.close()


def test_a_worker_scaled_back_goes_on_counting_and_has_no_old_error(sleepers):
    """A worker scaled away and back had its restarts set to 0 while frames, episodes and the
    last error carried over from its predecessor (soak review): restarts in status and
    ``ingestd_worker_restarts_total`` went back. Every counter of a slot now goes on; the error,
    which belongs to the old worker, is cleared."""
    supervisor, stats, procs, now = sleepers
    supervisor._start = lambda index, slot: None
    stats[1]["restarts"], stats[1]["frames"], stats[1]["episodes"] = 3, 4096, 17
    stats.set_error(1, "RuntimeError: the old worker's")
    supervisor.scale(1)
    procs[1].stop()
    supervisor.tick()  # reaped: the slot is gone
    assert 1 not in supervisor.slots
    supervisor.scale(2)
    assert (int(stats[1]["restarts"]), int(stats[1]["frames"]), int(stats[1]["episodes"])) == (3, 4096, 17)
    assert stats.error(1) == ""


def _register_exit_note(path: str) -> None:
    import atexit

    atexit.register(lambda: open(path, "w").close())


def test_forked_workers_run_their_atexit_handlers_as_the_stdlib_fork_does(tmp_path):
    """ingestd forks workers with its own copy of the stdlib's fork launch (to close pipes on a
    failed fork); the child's side must stay the stdlib's: Python 3.13 runs the atexit handlers
    a forked child registers, earlier versions do not."""
    import multiprocessing as mp

    from ingestd.service.forking import ForkContext

    outcomes = []
    for name, ctx in (("stdlib", mp.get_context("fork")), ("ingestd", ForkContext())):
        note = tmp_path / name
        process = ctx.Process(target=_register_exit_note, args=(str(note),))
        process.start()
        process.join(30)
        assert process.exitcode == 0
        outcomes.append(note.exists())
    assert outcomes[0] == outcomes[1], outcomes


_FORK_THEN_DIE = """
import os, signal, sys, time
from ingestd.service.forking import ForkContext
child = ForkContext.Process(target=time.sleep, args=(60,))
child.start()
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
os.kill(os.getpid(), signal.SIGKILL)  # the daemon SIGKILLed (the OOM killer) right after a fork
"""


def test_a_worker_forked_just_before_the_daemon_is_sigkilled_dies_with_it(tmp_path):
    """PDEATHSIG was set in the worker's setup, ~10 ms after the fork: a daemon SIGKILLed in
    between left 1 worker in 10 running for ever, writing into the replay the next daemon took
    (lifecycle review). It is set straight after the fork, and a child whose parent is already
    gone exits."""
    import os
    import signal
    import sys

    from daemon_proc import wait_for

    from ingestd.collect.stats import pid_alive

    children = []
    try:
        for i in range(5):  # (files, not pipes: a surviving child would hold a pipe open)
            pid_file, err = tmp_path / f"pid{i}", tmp_path / f"err{i}"
            with open(err, "w") as stderr:
                code = subprocess.run([sys.executable, "-c", _FORK_THEN_DIE, str(pid_file)], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=stderr, timeout=120).returncode
            assert code == -signal.SIGKILL and pid_file.exists(), err.read_text()
            children.append(int(pid_file.read_text()))
        wait_for(lambda: not any(pid_alive(pid) for pid in children), 10, "the children to die with their parent")
    finally:
        for pid in children:
            if pid_alive(pid):  # (a build without the fix) stopped by its PID
                os.kill(pid, signal.SIGKILL)


def test_a_stop_overwritten_by_a_racing_pause_is_told_again(sleepers):
    """A pause or resume from the control thread writes every worker's desired word; one that
    raced a scale-down (or a withdrawn one writing back its old value) could replace the stop a
    retiring worker was sent, and nothing sent it again."""
    from ingestd.collect.stats import Desired

    supervisor, stats, procs, now = sleepers
    stats[0]["heartbeat"] = stats[1]["heartbeat"] = now[0]
    supervisor.scale(1)
    assert int(stats[1]["desired"]) == Desired.STOP
    stats[1]["desired"] = Desired.PAUSE  # the racing write
    supervisor.tick()
    assert int(stats[1]["desired"]) == Desired.STOP and int(stats[0]["desired"]) == Desired.RUN


def test_every_restarted_event_says_after_how_long(sleepers):
    """docs/protocol.md lists after_s on worker.restarted; a requested restart left it out."""
    supervisor, stats, procs, now = sleepers
    events = []
    supervisor._on_event = lambda kind, **fields: events.append((kind, fields))
    supervisor._start = lambda index, slot: None
    stats[0]["heartbeat"] = stats[1]["heartbeat"] = now[0]
    supervisor.restart([0])
    procs[0].stop()  # the worker obeys the stop it was sent
    supervisor.tick()
    restarted = [fields for kind, fields in events if kind == "worker.restarted"]
    assert restarted == [{"worker": 0, "reason": "requested", "after_s": 0.0}]


def test_status_shows_a_dead_worker_as_starting_again_not_as_it_was(sleepers):
    """During the restart backoff a SIGKILLed worker still read ``running`` with its dead pid
    (and so an ever older heartbeat), while ``ingestd_worker_up`` said 0 (chaos review)."""
    from ingestd.collect.stats import heartbeat_age

    supervisor, stats, procs, now = sleepers
    supervisor._start = lambda index, slot: None
    procs[0].stop()
    supervisor.tick()
    rec = stats[0]
    assert (State(int(rec["state"])), int(rec["pid"])) == (State.STARTING, 0)
    assert heartbeat_age(rec, now[0] + 10) is None
    assert supervisor.slots[0].start_at is not None  # the restart is still scheduled


def test_a_slot_added_by_scale_reads_starting_not_the_last_workers_state(sleepers):
    """Until the next tick started it, a new slot showed the undocumented ``empty`` with the pid
    of a worker long gone."""
    supervisor, stats, procs, now = sleepers
    supervisor._start = lambda index, slot: None
    stats[3]["state"], stats[3]["pid"] = State.EMPTY, procs[1].pid  # what a retired slot leaves
    supervisor.scale(4)
    assert [(State(int(stats[i]["state"])), int(stats[i]["pid"])) for i in (2, 3)] == [(State.STARTING, 0)] * 2


def test_restart_of_a_retiring_worker_names_only_the_workers_there_are(sleepers):
    """``no such worker(s) [1]; workers are [0, 1]``: the retiring slot was refused and listed."""
    supervisor, stats, procs, now = sleepers
    supervisor.scale(1)  # worker 1 retires, its process not gone yet
    with pytest.raises(KeyError, match=r"no such worker\(s\) \[1\]; workers are \[0\]"):
        supervisor.restart([1])


def test_a_failed_worker_shows_no_pid_and_its_restart_is_an_event_and_counted(sleepers):
    """SAC review: a failed worker kept its dead pid in status (the OS may give it to another
    process, which an operator might then kill), and ``restart`` of it emitted only
    ``worker.started``: no ``worker.restarted reason=requested`` (docs/protocol.md), and
    ``restarts`` stayed as it was."""
    supervisor, stats, procs, now = sleepers
    supervisor.policy = RestartPolicy(heartbeat_timeout_s=TIMEOUT_S, budget=1)
    events = []
    supervisor._on_event = lambda kind, **fields: events.append((kind, fields))
    supervisor._start = lambda index, slot: None
    procs[0].stop()
    supervisor.tick()
    assert (State(int(stats[0]["state"])), int(stats[0]["pid"])) == (State.FAILED, 0)
    restarts = int(stats[0]["restarts"])
    supervisor.restart([0])
    assert ("worker.restarted", {"worker": 0, "reason": "requested", "after_s": 0.0}) in events
    assert int(stats[0]["restarts"]) == restarts + 1
    assert State(int(stats[0]["state"])) == State.STARTING


def test_a_failed_worker_is_retried_after_failed_retry_s_with_a_fresh_budget(sleepers):
    """SAC review: a simulator down for three seconds left workers failed until an operator came."""
    supervisor, stats, procs, now = sleepers
    supervisor.policy = RestartPolicy(heartbeat_timeout_s=TIMEOUT_S, budget=1, failed_retry_s=60.0)
    events = []
    supervisor._on_event = lambda kind, **fields: events.append((kind, fields))
    started = []
    supervisor._start = lambda index, slot: started.append(index) or setattr(slot, "start_at", None)
    procs[0].stop()
    supervisor.tick()
    assert State(int(stats[0]["state"])) == State.FAILED
    now[0] += 59.0
    supervisor.tick()
    assert started == [] and State(int(stats[0]["state"])) == State.FAILED
    now[0] += 2.0
    supervisor.tick()
    assert started == [0] and supervisor.slots[0].failures == 0
    assert ("worker.restarted", {"worker": 0, "reason": "retry after failed", "after_s": 0.0}) in events


@pytest.mark.parametrize("collected_s, reset_s, own, failed, delays, budget", [
    (2.0, 10.0, True, True, [0.1, 0.2], 3),  # fails on its own a few chunks in every time: marked failed
    (2.0, 10.0, "segv", True, [0.1, 0.2], 3),  # a crash of its own (SIGSEGV) counts as its own
    (2.0, 10.0, False, False, [0.1, 0.2, 0.4], 3),  # SIGKILLed from outside after writing: later and later only
    (2.0, 10.0, False, False, [0.1], 1),  # ... even with a budget of 1
    (12.0, 10.0, True, False, [0.1] * 3, 3),  # collected past restart_reset_s each time: a fresh count
    (12.0, 10.0, True, False, [0.1] * 3, 1),  # ... which that death does not use up, even with a budget of 1
    (12.0, 10.0, False, False, [0.1] * 3, 1),  # (an OOM kill after an hour of collecting was marked failed)
    (2.0, 0.0, True, False, [0.1] * 3, 3),  # restart_reset_s = 0: the first chunk is progress enough (the old rule)
])
def test_a_worker_dying_soon_after_its_first_chunk_is_restarted_later_and_later(tmp_path, collected_s, reset_s,
                                                                                own, failed, delays, budget):
    """A worker that wrote a chunk and then died the same way every time (an env failing at step
    17, a NaN reward every 40 steps) reset its failure count with each chunk: it was restarted for
    ever at the first backoff, rebuilding its env every time (custom-env review: 27 restarts in
    8 s). Unless it had collected for workers.restart_reset_s, its death now grows the backoff and,
    when it failed on its own (an error it reported), counts against the budget; a worker killed
    from outside (SIGKILL, the OOM killer) is never marked failed for it."""
    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    now = [100.0]
    policy = RestartPolicy(heartbeat_timeout_s=1e9, backoff_s=0.1, backoff_max_s=10.0, budget=budget, reset_s=reset_s)
    supervisor = Supervisor(spec_of, stats, policy, clock=lambda: now[0])
    procs = []

    def start(index, slot):  # a sleeper stands in for the worker process: it exits 1, or is SIGKILLed
        slot.start_at, slot.collecting_since = None, None
        stats.reset(index)
        procs.append(Failer("kill -SEGV $$" if own == "segv" else "exit 1") if own else Sleeper())
        slot.process = procs[-1]
        stats[index]["state"], stats[index]["pid"] = State.RUNNING, slot.process.pid
    supervisor._start = start
    got = []
    try:
        supervisor.scale(1)
        for _ in range(max(policy.budget, len(delays))):
            supervisor.tick()  # starts it
            slot = supervisor.slots[0]
            stats[0]["chunks"] = 1
            supervisor.tick()  # sees its first chunk
            now[0] += collected_s
            stats.set_error(0, "RuntimeError: the same fault again" if own else "")
            slot.process.stop()
            supervisor.tick()  # reaps it
            if stats.state(0) == State.FAILED:
                break
            got.append(round(slot.start_at - now[0], 3))
            now[0] = slot.start_at
        assert (stats.state(0) == State.FAILED) is failed
        assert got == delays
    finally:
        for proc in procs:
            proc.stop()
        stats.close()


def test_the_backoff_of_a_long_streak_stays_at_its_cap():
    """A worker SIGKILLed from outside after every first chunk grows its streak for ever: the
    backoff's 2 ** streak overflowed a float at death 1025 and stopped the daemon."""
    policy = RestartPolicy(backoff_s=0.1, backoff_max_s=2.0)
    assert policy.backoff(1) == 0.1 and policy.backoff(64) == 2.0 and policy.backoff(5000) == 2.0


def test_more_workers_than_cores_is_warned_of_once_per_scale_up(tmp_path, caplog):
    """User review: ``ingestctl scale 100`` on 2 cores was taken silently; the workers then
    starved and were restarted as hung."""
    import logging
    import os

    cores = len(os.sched_getaffinity(0))
    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    try:
        supervisor = Supervisor(spec_of, stats, RestartPolicy())
        with caplog.at_level(logging.WARNING, logger="ingestd.supervisor"):
            supervisor.scale(cores)
            assert not caplog.records
            supervisor.scale(cores + 1)
            supervisor.scale(cores + 1)  # no change: said once
        assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"{cores + 1} workers on {cores} cores"]
    finally:
        stats.close()


def test_a_new_stats_block_is_a_new_file_not_the_old_one_truncated(tmp_path):
    """A stray worker of an earlier daemon still maps the old stats file: with that file
    truncated and reused, its pid and heartbeat landed in the new daemon's record of its index."""
    path = tmp_path / "workers.stats"
    old = StatsBlock(path, create=True)
    new = StatsBlock(path, create=True)
    old[0]["pid"], old[0]["heartbeat"] = 4242, 12345.0
    assert new[0]["pid"] == 0 and new[0]["heartbeat"] == 0.0
    assert StatsBlock(path)[0]["pid"] == 0  # a worker the new daemon starts maps the new file


def test_a_push_landing_as_a_held_worker_applies_weights_ends_the_hold(tmp_path):
    """The worker read the store's version after applying the weights: a push landing between
    the two was taken as seen, so the worker stayed held by the limiter with the old weights,
    the push waited in vain, and a trainer with ``max_policy_lag`` waiting for rows of the new
    version never sampled to release it (lifecycle review). Exactly one chunk of it is written."""
    import contextlib
    import threading
    import time

    from ingestd.collect.rollout import Finished
    from ingestd.collect.stats import Desired, PauseReason
    from ingestd.collect.worker import Worker

    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    worker = Worker(SimpleNamespace(index=0), stats)
    rec = worker.rec
    rec["desired"] = Desired.RUN
    store = SimpleNamespace(version=1)  # the weight store (``_published`` reads its version)
    written: list[int] = []

    def apply(weights, policy, current):
        seen = weights.version
        if written == [1] and weights.version == 1:
            weights.version = 2  # a push lands just after this read
        return max(current, seen)

    def collect(rollout, storage):
        written.append(worker.version)
        worker._written_version = worker.version
        return 0, Finished()

    worker._apply_weights, worker._collect, worker._account = apply, collect, lambda *a: None
    worker.version, worker._written_version = 1, 0
    worker.extras = SimpleNamespace(profile=SimpleNamespace(poll=lambda: None, chunk=contextlib.nullcontext),
                                    paused=lambda storage: PauseReason.NONE, flush=lambda storage: None)
    worker.limiter = SimpleNamespace(insert_blocked=lambda: 1.0)  # holds every chunk after a version's first
    loop = threading.Thread(target=worker._loop, args=(None, None, store, None), daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 3
        while written != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
    finally:
        rec["desired"] = Desired.STOP  # ends the hold and the loop
        loop.join(10)
    assert not loop.is_alive() and written == [1, 2], written


def test_a_slot_cleared_for_a_restart_never_reads_empty(tmp_path):
    """``reset`` zeroed the state (``EMPTY``) and the supervisor set ``starting`` only later: a
    scrape or status in between dropped every series of the worker (metrics review)."""
    stats = StatsBlock(tmp_path / "workers.stats", create=True)
    stats[0]["state"], stats[0]["pid"], stats[0]["restarts"] = State.RUNNING, 4242, 3
    stats.reset(0)
    assert stats.state(0) == State.STARTING and stats[0]["pid"] == 0 and stats[0]["restarts"] == 3
    stats.close()
