"""Helpers of the reliability suite (``tests/test_reliability_*.py``) and the session hygiene check.

- Knobs: the long scenarios read their length from test-only environment
  variables (``INGESTD_CHAOS_SECONDS``, ``INGESTD_LOAD_SECONDS``); the short
  defaults keep the test command within its time budget.
- Figures: each scenario ``record``s what it measured; the terminal summary
  prints them and ``INGESTD_RELIABILITY_FIGURES=FILE`` also appends them to
  FILE as JSON lines (docs/reliability.md quotes such a run).
- Storage checks: ``read_storage`` + ``check_integrity`` verify every
  committed row of a Checksum replay (no torn row, stamps consistent with the
  slot's sequence number, no duplicated or skipped step per (worker, env)).
- Processes: RSS, liveness, percentiles.
- Session hygiene (``Hygiene``): what this pytest session started (processes,
  /dev/shm entries, listening sockets) must be gone when it ends.

Only the standard library and numpy are imported at module level: conftest
imports this module when the session starts.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ingestd.replay.layout import EPISODE_BITS

TESTS = Path(__file__).resolve().parent
PLUGIN_ENV = {"PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# -- knobs -----------------------------------------------------------------------------------
def knob(name: str, default: float, unit: str = "seconds") -> float:
    """A scenario setting from a test-only environment variable (docs/reliability.md lists them)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return float(default)
    value = float(text)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of {unit}, got {text!r}")
    return value


# -- figures ---------------------------------------------------------------------------------
FIGURES: dict[str, dict] = {}
FIGURES_FILE = "INGESTD_RELIABILITY_FIGURES"


def record(scenario: str, **figures) -> dict:
    """Keep a scenario's measured figures (printed in the terminal summary)."""
    entry = FIGURES.setdefault(scenario, {})
    entry.update(figures)
    target = os.environ.get(FIGURES_FILE)
    if target:
        with open(target, "a") as f:
            f.write(json.dumps({"scenario": scenario, "loadavg_1m": round(os.getloadavg()[0], 2),
                                **figures}, default=str) + "\n")
    return entry


def summary_lines() -> list[str]:
    return [f"{name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
            for name, figures in FIGURES.items()]


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def percentiles(samples, *qs: float) -> list[float]:
    """The ``qs`` percentiles (0..100) of ``samples`` (nearest rank, so p99 is a real sample)."""
    s = np.sort(np.asarray(samples, dtype=np.float64))
    return [float(s[min(len(s) - 1, int(np.ceil(q / 100 * len(s))) - 1 if q > 0 else 0)]) for q in qs]


# -- waiting ---------------------------------------------------------------------------------
def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


# -- processes -------------------------------------------------------------------------------
def rss_kib(pid: int, kind: str = "RssAnon") -> int | None:
    """Resident memory of ``pid`` in KiB (None if it is gone). ``RssAnon`` by default: the
    process's private memory, where a leak shows. ``VmRSS`` also counts the pages of the shared
    replay and stats files a process has touched, which grow until the ring has wrapped."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(kind + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (R, S, T, Z, ...), or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0].decode()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """CPU seconds used so far by the threads of ``pid`` (children not included)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu(root: int | None = None) -> float:
    """CPU seconds used by ``root`` (default: this process) and its descendants, reaped ones
    included (through their parents' cutime/cstime)."""
    from daemon_proc import descendants

    root = os.getpid() if root is None else root
    total = 0
    for pid in [root, *descendants(root)]:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / _TICK


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy (steal included: the hypervisor gave it away)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


class ExternalLoad:
    """The share of the machine's CPU used by processes outside this test's process tree
    between ``start()`` and ``stop()`` (0.5 = one of two cores busy with someone else's work).

    Timing figures taken on a machine others keep busy say little about ingestd; tests judge
    their timing targets only when this stays under ``QUIET`` (the effects judged are ~5 %: as
    much CPU taken by others could move them as much)."""

    QUIET = 0.05

    def __init__(self):
        self.cores = len(os.sched_getaffinity(0))
        self.start()

    def start(self) -> None:
        self._t, self._busy, self._ours = time.monotonic(), machine_busy(), tree_cpu()

    def stop(self) -> float:
        t, busy, ours = time.monotonic(), machine_busy(), tree_cpu()
        share = ((busy - self._busy) - (ours - self._ours)) / max(1e-9, (t - self._t) * self.cores)
        return max(0.0, share)


@dataclass
class RssSeries:
    """RSS samples of a set of processes; ``drift`` compares the end with the start after warm-up."""

    samples: dict[int, list[tuple[float, int]]] = field(default_factory=dict)

    def sample(self, pids) -> None:
        now = time.monotonic()
        for pid in pids:
            rss = rss_kib(pid)
            if rss is not None:
                self.samples.setdefault(pid, []).append((now, rss))

    def drift(self, warmup_s: float, edge: int = 3) -> dict[int, float]:
        """Per pid: mean of the last ``edge`` samples over the mean of the first ``edge`` samples
        taken after ``warmup_s`` seconds, minus 1 (0.05 = grew by 5 %)."""
        out = {}
        for pid, series in self.samples.items():
            start = series[0][0]
            kept = [rss for t, rss in series if t - start >= warmup_s]
            if len(kept) >= 2 * edge:
                out[pid] = float(np.mean(kept[-edge:]) / np.mean(kept[:edge]) - 1)
        return out


# -- the replay storage ------------------------------------------------------------------------
@dataclass
class Stored:
    """Every committed row of a replay storage (read while no one writes)."""

    rows: object  # TensorDict [n], sorted by write index (None when there are none)
    slots: np.ndarray  # the slot of each row
    seq: np.ndarray  # a copy of every slot's sequence number
    write_count: int
    capacity: int

    @property
    def odd(self) -> np.ndarray:
        """Slots left mid-write (odd sequence number)."""
        return np.flatnonzero(self.seq & 1)

    @property
    def wrapped(self) -> bool:
        return self.write_count > self.capacity


def read_storage(path) -> Stored:
    from ingestd.replay import ReplayReader

    with ReplayReader(path) as reader:
        seq = np.array(reader.seq)
        write_count = reader.write_count
        slots = np.flatnonzero((seq > 0) & (seq % 2 == 0))
        rows = reader.gather(slots) if slots.size else None
        assert np.array_equal(np.array(reader.seq), seq), "the storage changed while it was read"
        capacity = reader.capacity
    if rows is not None:
        order = np.argsort(rows.get(("ingestd", "write_index")).numpy(), kind="stable")
        rows, slots = rows[order], slots[order]
    return Stored(rows, slots, seq, write_count, capacity)


def check_integrity(stored: Stored) -> dict:
    """Assert that every committed row of a Checksum replay is intact and in place, and that each
    (worker, env) stream goes on without a duplicated or skipped step; returns the counts.

    Per (worker, env), in write order, a row follows its predecessor as the next step of the
    same episode, the first step of the next episode after ``done``, or the first step of a
    later incarnation (the worker was restarted: the chunk it was rolling is lost). Only when
    the ring has wrapped may a stream begin mid-episode (its start was overwritten)."""
    from ingestd.collect.envs.checksum import verify_rows

    rows = stored.rows
    if rows is None:
        return {"rows": 0, "torn": 0, "duplicates": 0, "breaks": 0}
    n = rows.batch_size[0]
    index = rows.get(("ingestd", "write_index")).numpy()
    assert (index % stored.capacity == stored.slots).all(), "a row sits in another slot than its write index"
    assert (stored.seq[stored.slots] == 2 * index + 2).all(), "a row's write index disagrees with its seq"
    assert index.max() < stored.write_count, "a row's write index is beyond write_count"
    torn = int((~verify_rows(rows)).sum())
    w, e, ep, st = (rows.get(("ingestd", k)).numpy() for k in ("worker", "env", "episode", "step"))
    done = rows.get(("next", "done")).reshape(n).numpy()
    duplicates = n - np.unique(np.stack([w, e, ep, st], 1), axis=0).shape[0]
    inc = ep >> EPISODE_BITS
    width = int(e.max()) + 1  # num_envs: sub-env e's episodes are (inc << EPISODE_BITS) + e + k * num_envs
    pairs = np.unique(np.stack([inc, w], 1), axis=0)
    assert np.unique(pairs[:, 0]).size == pairs.shape[0], "one incarnation wrote as two workers"

    order = np.lexsort((index, e, w))
    w, e, ep, st, done, inc = (x[order] for x in (w, e, ep, st, done, inc))
    same_stream = (w[1:] == w[:-1]) & (e[1:] == e[:-1])
    a, b = slice(None, -1), slice(1, None)
    next_step = ~done[a] & (ep[b] == ep[a]) & (st[b] == st[a] + 1)
    next_episode = done[a] & (ep[b] == ep[a] + width) & (st[b] == 0)
    new_incarnation = (inc[b] > inc[a]) & (ep[b] == (inc[b] << EPISODE_BITS) + e[b]) & (st[b] == 0)
    follows = np.where(inc[b] == inc[a], next_step | next_episode, new_incarnation)
    breaks = int((same_stream & ~follows).sum())
    if not stored.wrapped:
        first = np.concatenate([[True], ~same_stream])
        breaks += int(((ep[first] != (inc[first] << EPISODE_BITS) + e[first]) | (st[first] != 0)).sum())
    assert torn == 0, f"{torn} of {n} stored rows do not verify (torn or foreign rows)"
    assert duplicates == 0, f"{duplicates} (worker, env, episode, step) stamps are stored twice"
    assert breaks == 0, f"{breaks} rows do not continue their (worker, env) stream (a step lost or repeated)"
    return {"rows": n, "torn": torn, "duplicates": duplicates, "breaks": breaks,
            "incarnations": int(pairs.shape[0])}


# -- session hygiene ------------------------------------------------------------------------------
SESSION_VARIABLE = "INGESTD_TEST_SESSION"
SHM = Path("/dev/shm")
_LISTEN_TCP = "0A"
_ACCEPTING_UNIX = 0x00010000  # __SO_ACCEPTCON in /proc/net/unix


class Hygiene:
    """What one pytest session started must be gone when it ends.

    Attribution, so that other sessions sharing the machine never count:

    - processes: every process the session starts inherits ``INGESTD_TEST_SESSION=<id>``
      (set here in ``os.environ`` before any test runs; forked workers keep it too), so a
      leftover is found through ``/proc/<pid>/environ`` even after it was re-parented;
    - /dev/shm: the directories the session's ``tempfile.mkdtemp`` calls made there (the
      test harnesses all use it) must be gone, and so must any other new entry that a
      process of this session still holds open;
    - sockets: listening TCP and unix sockets held by this process or its leftovers.
    """

    def __init__(self):
        self.session = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.pid = os.getpid()
        self.created: list[Path] = []
        self._mkdtemp = tempfile.mkdtemp
        self.shm_before: set[str] = set()
        self.sockets_before: set[int] = set()

    def start(self) -> None:
        os.environ[SESSION_VARIABLE] = self.session
        self.shm_before = _entries(SHM)
        self.sockets_before = self._listening_sockets([self.pid])
        original = self._mkdtemp

        def mkdtemp(*args, **kwargs):
            path = original(*args, **kwargs)
            if Path(path).resolve().is_relative_to(SHM):
                self.created.append(Path(path))
            return path

        tempfile.mkdtemp = mkdtemp  # observe only: every call goes to the original

    def finish(self, grace_s: float = 5.0) -> list[str]:
        """The leaks (also cleaned up here, after they are reported)."""
        tempfile.mkdtemp = self._mkdtemp
        deadline = time.monotonic() + grace_s
        while (procs := self._processes()) and time.monotonic() < deadline:
            time.sleep(0.1)  # workers of a killed daemon die by PDEATHSIG, a moment later
        problems = [f"process {pid} outlived the session: {_cmdline(pid)[:200]}" for pid in procs]
        sockets = self._listening_sockets([self.pid, *procs]) - self.sockets_before
        problems += [f"listening socket {s} ({desc}) left open" for s, desc in _describe_sockets(sockets).items()]
        held = {p for pid in procs for p in _open_shm_entries(pid)}
        shm = sorted({p for p in self.created if p.exists()} | (held - {SHM / n for n in self.shm_before}))
        problems += [f"/dev/shm entry left behind: {p}" for p in shm]
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for path in shm:
            _remove(path)
        return problems

    def _processes(self) -> list[int]:
        marker = f"{SESSION_VARIABLE}={self.session}".encode()
        found = []
        own = {self.pid, _resource_tracker_pid()}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in own:
                continue
            try:
                env = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in env.split(b"\0") and alive(int(entry.name)):
                found.append(int(entry.name))
        return sorted(found)

    @staticmethod
    def _listening_sockets(pids) -> set[int]:
        held = set()
        for pid in pids:
            for fd in _fd_paths(pid):
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    held.add(int(target[8:-1]))
        return held & set(_listening_inodes())


def _resource_tracker_pid() -> int | None:
    """This interpreter's multiprocessing resource tracker: it belongs to the interpreter (started
    on first use of a multiprocessing semaphore or shared memory) and exits with it."""
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    return getattr(tracker, "_pid", None)


def _entries(directory: Path) -> set[str]:
    try:
        return {p.name for p in directory.iterdir()}
    except OSError:
        return set()


def _fd_paths(pid: int) -> list[str]:
    """``/proc/PID/fd/N`` of each open descriptor of ``pid``; none if it is gone (it may exit while
    this lists them: a ``Path.glob`` would then raise from the ``for`` statement itself)."""
    try:
        return [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _listening_inodes() -> dict[int, str]:
    """inode -> description of every listening TCP socket and accepting unix socket."""
    out: dict[int, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == _LISTEN_TCP:
                out[int(parts[9])] = f"{table} port {int(parts[1].rsplit(':', 1)[1], 16)}"
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if int(parts[3], 16) & _ACCEPTING_UNIX:
            out[int(parts[6])] = f"unix {parts[7] if len(parts) > 7 else '(unnamed)'}"
    return out


def _describe_sockets(inodes: set[int]) -> dict[int, str]:
    table = _listening_inodes()
    return {i: table.get(i, "?") for i in sorted(inodes)}


def _open_shm_entries(pid: int) -> set[Path]:
    """Top-level /dev/shm entries that ``pid`` has open or mapped."""
    found = set()
    paths = []
    for fd in _fd_paths(pid):
        try:
            paths.append(os.readlink(fd))
        except OSError:
            pass
    try:
        paths += [line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                  if len(line.split(None, 5)) == 6]
    except OSError:
        pass
    for path in paths:
        if path.startswith("/dev/shm/"):
            found.add(SHM / path[len("/dev/shm/"):].split("/", 1)[0].split(" ", 1)[0])
    return found


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def report(problems: list[str], stream=None) -> None:
    stream = stream or sys.stderr
    stream.write("\nsession hygiene: FAILED, this test session leaked:\n")
    for line in problems:
        stream.write(f"  - {line}\n")
    stream.flush()


# -- env faults by worker index (the daemon loads it as reliability_util:faulty_by_worker) -------
FAULTS = {1: ("Raising", 0), 2: ("WrongShape", 0), 3: ("NaNReward", 0), 4: ("NaNReward", 20), 5: ("WrongShape", 20)}


def faulty_by_worker(ctx):
    """Worker 0: a healthy Checksum env. Workers 1-3 fault on their first step (they can never
    write a chunk: crash loop), workers 4-5 after 20 steps (two good chunks of 8 steps, then a
    bad one), as ``FAULTS`` says; see tests/faulty_envs.py."""
    import faulty_envs
    from ingestd.collect.registry import make_env

    name, after = FAULTS.get(ctx.worker, (None, 0))
    if name is None:
        return make_env("Checksum", ctx, {})
    return getattr(faulty_envs, name)(ctx, after_steps=after)


class _Slow:
    """The Checksum env, sleeping ``step_s`` per step: chunks that take a known, long time."""

    def __init__(self, ctx, step_s: float):
        from ingestd.collect.registry import make_env

        self.inner, self.step_s = make_env("Checksum", ctx, {}), step_s
        self.num_envs, self.spec = self.inner.num_envs, self.inner.spec

    def reset(self):
        return self.inner.reset()

    def step_and_maybe_reset(self, td):
        time.sleep(self.step_s)
        return self.inner.step_and_maybe_reset(td)

    def close(self):
        self.inner.close()


def slow_checksum(ctx, step_s: float = 0.001):
    """The daemon loads it as ``reliability_util:slow_checksum``."""
    return _Slow(ctx, step_s)


# -- status load (run in client processes: ``python -m reliability_util load ...``) ------------
def idle_and_loaded(counts: list[tuple[int, float, float, float]]):
    """``(rates, daemon CPU s, worker CPU s, seconds)``, each ``[idle, loaded]``, from samples
    ``(write_count, time, daemon CPU, workers' CPU)`` at the edges of alternating windows."""
    rates, daemon_cpu, worker_cpu, seconds = ([], []), [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    for k, ((c0, t0, u0, w0), (c1, t1, u1, w1)) in enumerate(zip(counts, counts[1:])):
        rates[k % 2].append((c1 - c0) / (t1 - t0))
        daemon_cpu[k % 2] += u1 - u0
        worker_cpu[k % 2] += w1 - w0
        seconds[k % 2] += t1 - t0
    return rates, daemon_cpu, worker_cpu, seconds


@contextlib.contextmanager
def load_clients(address: str, count: int, total_rate: float, start: float, window: float, rounds: int,
                 kind: str = "lean", timeout: float = 60.0):
    """``count`` status-load processes (tests/test_control_load.py, ``kind`` lean or client) sharing
    ``total_rate`` requests/s in the loaded windows from ``start``. Yields a list that holds each
    client's saved arrays once the block is left and every client has finished (stragglers are
    killed by PID)."""
    results: list = []
    with tempfile.TemporaryDirectory(prefix="ingestd-load-") as tmp:
        outs = [Path(tmp) / f"client{i}.npz" for i in range(count)]
        procs = [subprocess.Popen([sys.executable, str(TESTS / "test_control_load.py"), address,
                                   str(total_rate / count), str(start), str(window), str(rounds), str(out), kind],
                                  env={**os.environ, **PLUGIN_ENV}) for out in outs]
        try:
            yield results
            for proc in procs:
                assert proc.wait(timeout) == 0, "a load client failed"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results.extend(dict(np.load(out)) for out in outs)
