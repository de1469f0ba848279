"""Ingest rate of a real ``ingestd run``: frames/s into the replay storage, against the in-process limit.

    python benchmarks/bench_ingest.py            # the full run (about 5 minutes)
    python benchmarks/bench_ingest.py --quick    # a smoke run (about 1 minute)
    python benchmarks/bench_ingest.py --cases cartpole --workers 2 --no-sweep --no-startup

For every case (an env, a policy, ``num_envs``, ``chunk_steps``) and worker
count, a real daemon runs in a subprocess (``tests/daemon_proc.py``: tmp dirs
under /dev/shm, every process killed and every file removed afterwards) with
``workers.threads=1``. The rate is read from the storage itself: a
``ReplayReader`` attached by path reads ``write_count`` before and after a
fixed window that starts after a warm-up (never from the daemon's logs). The
window is cut into sub-windows; the median sub-window rate is reported with
the whole-window rate, since other work on the machine comes and goes.

In the same run, the in-process limit is measured for the same env, policy
and ``num_envs``: ``bench_env_loop.inprocess_rate`` (one process, no storage,
no stamps, no IPC), before and after the case's daemon runs. Efficiency is
ingestd's per-worker rate divided by that limit; the same ratio per CPU
second (frames per second of worker CPU time, from /proc, against the loop's
frames per CPU second) is reported too, as it is much less sensitive to
other load on the machine. Every figure carries ``os.getloadavg()``.

Also measured: the time from ``ingestd run`` (the Popen) to the first stored
frame, against the time from the Popen of a bare ``python -c 'import torch, tensordict'``
to its import done (median of 3; the time to its exit, which adds the interpreter's
teardown, is reported beside it), and, for CartPole, a sweep of ``num_envs`` x ``chunk_steps``.

Prints ONE JSON document on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from bench_env_loop import Case, inprocess_rate  # noqa: E402
from daemon_proc import DaemonProc, descendants  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
MLP = {"hidden": [64, 64]}
# glibc malloc settings that keep large freed blocks in the heap (no mmap/munmap and page
# faults per image batch); --malloc-tunables runs the daemon with them, as an experiment
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824"

TARGETS = {
    "efficiency_min": 0.90,
    "first_frame_over_bare_import_max_s": 1.0,
    "gym_cartpole_2w_min_fps": 60_000,
    "cartpole_2w_256envs_min_fps": 1_000_000,
    "pixels_min_fps": 30_000,
}


@dataclass(frozen=True)
class IngestCase:
    name: str
    env: str
    policy: str
    num_envs: int
    chunk_steps: int
    capacity: int
    warm_laps: float = 0.0  # also warm up until the ring was filled this many times (first-touch page faults)
    n_step: int = 1  # workers.n_step (rows stored as n-step windows, ingestd.collect.nstep)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_kwargs: dict[str, Any] = field(default_factory=dict)

    def loop_case(self) -> Case:
        return Case(self.env, self.num_envs, self.policy, dict(self.env_kwargs), dict(self.policy_kwargs))

    def overrides(self, workers: int) -> dict[str, Any]:
        out = {"workers.count": workers, "workers.env": self.env, "workers.policy": self.policy,
               "workers.num_envs": self.num_envs, "workers.chunk_steps": self.chunk_steps,
               "workers.threads": 1, "replay.capacity": self.capacity, "service.log_level": "warning"}
        if self.env_kwargs:
            out["workers.env_kwargs"] = dict(self.env_kwargs)
        if self.policy_kwargs:
            out["workers.policy_kwargs"] = dict(self.policy_kwargs)
        if self.n_step > 1:
            out["workers.n_step"] = self.n_step
        return out

    def describe(self) -> dict[str, Any]:
        return {"env": self.env, "env_kwargs": self.env_kwargs, "policy": self.policy,
                "policy_kwargs": self.policy_kwargs, "num_envs": self.num_envs,
                "chunk_steps": self.chunk_steps, "replay_capacity": self.capacity,
                "warm_laps": self.warm_laps, "n_step": self.n_step}


def make_cases(args) -> dict[str, IngestCase]:
    t, n = args.chunk_steps, getattr(args, "n_step", 1)
    return {
        "cartpole": IngestCase("cartpole", "CartPole", "MLP", 256, t, 1_000_000, policy_kwargs=MLP, n_step=n),
        "gym_cartpole": IngestCase("gym_cartpole", "Gym", "MLP", args.gym_envs, t, 1_000_000,
                                   env_kwargs={"id": "CartPole-v1"}, policy_kwargs=MLP, n_step=n),
        # a Pixels row is ~56 KB (observation and next observation): a 16384-row ring is 0.9 GB of
        # tmpfs; the window starts after one full lap, when every page of the ring exists
        "pixels": IngestCase("pixels", "Pixels", "Random", args.pixels_envs, t, 32_768, warm_laps=1.0, n_step=n),
    }


def log(msg: str) -> None:
    print(f"[bench_ingest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- /proc -----------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_of(pids: list[int]) -> dict[int, float]:
    return {pid: s for pid in pids if (s := cpu_seconds(pid)) is not None}


# -- the in-process limit ----------------------------------------------------------------------
def measure_limit(case: IngestCase, seconds: float, repeat: int) -> dict[str, Any]:
    """The bare env + policy loop of ``case`` in this process (wall and CPU clocks), under the
    workers' allocator settings (``keep_heap``)."""
    from ingestd.collect.worker import keep_heap

    keep_heap()
    torch.set_num_threads(1)
    env, policy = case.loop_case().build(seed=0)
    before = load()
    try:
        wall = [inprocess_rate(env, policy, seconds=seconds) for _ in range(repeat)]
        cpu = [inprocess_rate(env, policy, seconds=seconds, clock=time.process_time) for _ in range(repeat)]
    finally:
        env.close()
    return {"frames_per_s_median": round(statistics.median(wall)), "frames_per_s_best": round(max(wall)),
            "frames_per_cpu_s_median": round(statistics.median(cpu)), "frames_per_cpu_s_best": round(max(cpu)),
            "load_average": before}


def combine_limits(samples: list[dict]) -> dict[str, Any]:
    return {
        "frames_per_s": round(statistics.median(s["frames_per_s_median"] for s in samples)),
        "frames_per_cpu_s": round(statistics.median(s["frames_per_cpu_s_median"] for s in samples)),
        "samples": samples,
    }


# -- one daemon run ----------------------------------------------------------------------------
def any_committed(reader) -> bool:
    """Whether a row is committed. ``write_count`` alone also counts rows reserved and still
    being filled: a worker storing images (Pixels) reserves its chunk's slots before rolling it."""
    seq = reader.seq[:min(reader.write_count, reader.capacity)]
    return bool(((seq > 0) & (seq % 2 == 0)).any())


def wait_first_frame(d: DaemonProc, t_launch: float, timeout: float) -> tuple[float, Any]:
    """Seconds from the launch to the first committed row seen (polled every ms), and the reader."""
    from ingestd.replay import ReplayReader

    deadline = time.perf_counter() + timeout
    reader = None
    while time.perf_counter() < deadline:
        if reader is None and (d.replay_path / "meta.json").exists():
            try:
                reader = ReplayReader(d.replay_path)
            except Exception:
                reader = None
        if reader is not None and any_committed(reader):
            return time.perf_counter() - t_launch, reader
        if d.proc.poll() is not None:
            break
        time.sleep(0.001)
    if reader is not None:
        reader.close()
    raise RuntimeError(f"no stored frame within {timeout} s (daemon exit code {d.proc.poll()}); "
                       f"log:\n{d.log()[-3000:]}")


def run_daemon(case: IngestCase, workers: int, warmup: float, window: float, parts: int,
               env: dict | None = None) -> dict[str, Any]:
    """Start a daemon, wait for the first frame, warm up, then count frames over the window."""
    result: dict[str, Any] = {"workers": workers, "load_average_before": load()}
    d = DaemonProc(overrides=case.overrides(workers), env=env, launch="exec")  # timed from the exec
    t_launch = time.perf_counter()
    with d:  # __enter__ is the launch; close() kills and removes everything
        first, reader = wait_first_frame(d, t_launch, timeout=120)
        result["first_frame_s"] = round(first, 3)
        try:
            time.sleep(warmup)
            deadline = time.perf_counter() + 60
            while reader.write_count < case.warm_laps * reader.capacity and time.perf_counter() < deadline:
                time.sleep(0.05)
            pids = [p for p in descendants(d.proc.pid)]
            d.remember_children()
            daemon_cpu0 = cpu_seconds(d.proc.pid)
            cpu0 = cpu_of(pids)
            marks = [(time.perf_counter(), reader.write_count)]
            for _ in range(parts):
                time.sleep(window / parts)
                marks.append((time.perf_counter(), reader.write_count))
            cpu1 = cpu_of(pids)
            daemon_cpu1 = cpu_seconds(d.proc.pid)
            capacity = reader.capacity
        finally:
            reader.close()
        if d.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited during the window; log:\n{d.log()[-3000:]}")
        code = d.stop(timeout=30)
        problems = [line for line in d.log().splitlines() if "died" in line or "failed" in line]
    (t0, c0), (t1, c1) = marks[0], marks[-1]
    frames, seconds = c1 - c0, t1 - t0
    sub = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:])]
    worker_cpu = sum(cpu1[p] - cpu0[p] for p in cpu0 if p in cpu1)
    result.update({
        "frames_per_s": round(frames / seconds),
        "frames_per_s_subwindow_median": round(statistics.median(sub)),
        "frames_per_s_subwindow_max": round(max(sub)),
        "per_worker_frames_per_s": round(frames / seconds / workers),
        "window_s": round(seconds, 2), "warmup_s": warmup, "frames_in_window": frames,
        "ring_laps_before_window": round(c0 / capacity, 2),
        "worker_processes": len(cpu0),
        "worker_cpu_s": round(worker_cpu, 2),
        "worker_cpu_utilisation": round(worker_cpu / seconds / max(1, workers), 3),
        "frames_per_worker_cpu_s": round(frames / worker_cpu) if worker_cpu > 0 else None,
        "daemon_main_cpu_s": round((daemon_cpu1 or 0) - (daemon_cpu0 or 0), 3),
        "daemon_exit_code": code,
        "load_average_after": load(),
    })
    if problems:
        result["worker_problems"] = problems[:5]
    return result


def with_efficiency(run: dict[str, Any], limit: dict[str, Any]) -> dict[str, Any]:
    run = dict(run)
    run["efficiency"] = round(run["per_worker_frames_per_s"] / limit["frames_per_s"], 3)
    run["efficiency_subwindow_median"] = round(
        run["frames_per_s_subwindow_median"] / run["workers"] / limit["frames_per_s"], 3)
    if run.get("frames_per_worker_cpu_s"):
        run["efficiency_per_cpu_s"] = round(run["frames_per_worker_cpu_s"] / limit["frames_per_cpu_s"], 3)
    return run


# -- startup -------------------------------------------------------------------------------
BARE_IMPORT = "import torch, tensordict"


def bare_import_once() -> tuple[float, float]:
    """Seconds from the Popen of ``python -c 'import torch, tensordict'`` to the import done
    (the child says so on stdout), and to the child's exit. The first is the reference for the
    first frame, which is also an instant inside a live process; the exit adds the interpreter's
    teardown of torch, which ``ingestd run`` never pays before its first frame."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", f"{BARE_IMPORT}; print('imported', flush=True)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        imported = time.perf_counter() - t0
        proc.stdout.close()
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0 or line.strip() != "imported":
        raise RuntimeError(f"python -c '{BARE_IMPORT}' failed (exit code {code})")
    return imported, time.perf_counter() - t0


def first_frame_once(case: IngestCase, workers: int) -> float:
    d = DaemonProc(overrides=case.overrides(workers), launch="exec")  # as a user runs it, not forked
    t_launch = time.perf_counter()
    with d:  # __enter__ is the launch (Popen of `ingestd run`)
        first, reader = wait_first_frame(d, t_launch, timeout=120)
        reader.close()
        d.stop(timeout=30)
    return first


def startup(case: IngestCase, workers: int, repeat: int) -> tuple[dict, dict]:
    """Bare imports and time to first frame, measured alternately (bare, daemon, bare, ...) so
    both see the same load; the paired differences are reported too."""
    bare, bare_exit, first, loads = [], [], [], []
    for _ in range(repeat):
        loads.append(load())
        imported, exited = bare_import_once()
        bare.append(imported)
        bare_exit.append(exited)
        first.append(first_frame_once(case, workers))
    bare_out = {"median_s": round(statistics.median(bare), 3), "runs_s": [round(t, 3) for t in bare],
                "command": f"python -c '{BARE_IMPORT}'", "timed_to": "the import done (not the exit)",
                "to_exit_median_s": round(statistics.median(bare_exit), 3),
                "to_exit_runs_s": [round(t, 3) for t in bare_exit], "load_averages": loads}
    first_out = {"median_s": round(statistics.median(first), 3), "runs_s": [round(t, 3) for t in first],
                 "over_bare_import_s": round(statistics.median(first) - statistics.median(bare), 3),
                 "paired_over_bare_import_s_median": round(statistics.median(f - b for f, b in zip(first, bare)), 3),
                 "case": case.describe(), "workers": workers, "load_averages": loads}
    return bare_out, first_out


# -- the run ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~1-minute smoke run (short windows, no sweep)")
    parser.add_argument("--cases", default="cartpole,gym_cartpole,pixels",
                        help="comma-separated: cartpole, gym_cartpole, pixels")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--warmup", type=float, help="seconds after the first frame before the window")
    parser.add_argument("--window", type=float, help="seconds of the measuring window")
    parser.add_argument("--parts", type=int, default=3, help="sub-windows of the window")
    parser.add_argument("--limit-seconds", type=float, help="seconds per in-process limit run")
    parser.add_argument("--limit-repeat", type=int, help="in-process runs per clock (default 3; 2 with --quick)")
    parser.add_argument("--chunk-steps", type=int, default=64, help="workers.chunk_steps of the cases (the daemon's default)")
    parser.add_argument("--gym-envs", type=int, default=64, help="num_envs of the gymnasium CartPole case")
    parser.add_argument("--pixels-envs", type=int, default=64, help="num_envs of the Pixels case")
    parser.add_argument("--n-step", type=int, default=1, help="workers.n_step of the cases (the limit stays the plain loop)")
    parser.add_argument("--sweep", dest="sweep", action="store_true", default=None,
                        help="run the CartPole num_envs x chunk_steps sweep (default: not with --quick)")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false")
    parser.add_argument("--sweep-envs", default="64,256,1024")
    parser.add_argument("--sweep-steps", default="8,16,32,64")
    parser.add_argument("--sweep-workers", type=int, default=2)
    parser.add_argument("--no-startup", dest="startup", action="store_false", default=True,
                        help="skip the bare-import and first-frame measurements")
    parser.add_argument("--startup-repeat", type=int, help="bare-import and first-frame runs (median; default 3)")
    parser.add_argument("--malloc-tunables", action="store_true",
                        help=f"run the daemons with GLIBC_TUNABLES={MALLOC_TUNABLES} (an experiment)")
    args = parser.parse_args(argv)
    quick = args.quick
    warmup = args.warmup if args.warmup is not None else (0.5 if quick else 3.0)
    window = args.window if args.window is not None else (1.5 if quick else 6.0)
    limit_s = args.limit_seconds if args.limit_seconds is not None else (0.4 if quick else 1.5)
    limit_repeat = args.limit_repeat or (2 if quick else 3)
    sweep = args.sweep if args.sweep is not None else not quick
    startup_repeat = args.startup_repeat or 3
    worker_counts = [int(w) for w in args.workers.split(",") if w]
    cases = make_cases(args)
    chosen = [c for c in args.cases.split(",") if c]
    unknown = set(chosen) - set(cases)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {sorted(cases)}")
    daemon_env = {"GLIBC_TUNABLES": MALLOC_TUNABLES} if args.malloc_tunables else None
    started = time.perf_counter()

    report: dict[str, Any] = {
        "benchmark": "ingest", "mode": "quick" if quick else "full",
        "load_average_start": load(), "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
        "torch": torch.__version__, "workers_threads": 1,
        "settings": {"warmup_s": warmup, "window_s": window, "subwindows": args.parts,
                     "limit_seconds": limit_s, "limit_repeat": limit_repeat,
                     "daemon_env": daemon_env or {}},
        "targets_spec": TARGETS,
    }

    if args.startup:
        log(f"startup: bare imports and first stored frame, alternately, x{startup_repeat} "
            "(CartPole, 2 workers)")
        report["bare_import"], report["first_frame"] = startup(cases["cartpole"], 2, startup_repeat)
        log(f"  -> bare {report['bare_import']['median_s']} s, first frame {report['first_frame']['median_s']} s")

    results: dict[str, Any] = {}
    for name in chosen:
        case = cases[name]
        log(f"{name}: in-process limit ({case.num_envs} envs)")
        limits = [measure_limit(case, limit_s, limit_repeat)]
        runs = []
        for workers in worker_counts:
            log(f"{name}: daemon with {workers} worker(s)")
            try:
                runs.append(run_daemon(case, workers, warmup, window, args.parts, daemon_env))
            except Exception as exc:  # report it and go on with the other cases
                runs.append({"workers": workers, "error": str(exc)[:2000]})
            log(f"  -> {runs[-1].get('frames_per_s', 'error')} frames/s, load {load()}")
        limits.append(measure_limit(case, limit_s, limit_repeat))
        limit = combine_limits(limits)
        results[name] = {"case": case.describe(), "inprocess_limit": limit,
                         "runs": [with_efficiency(r, limit) if "error" not in r else r for r in runs]}
    report["cases"] = results

    if sweep:
        report["sweep"] = run_sweep(cases["cartpole"], args, warmup, window, limit_s, limit_repeat, daemon_env)

    report["targets"] = evaluate(report)
    report["load_average_end"] = load()
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))
    return report


def run_sweep(base: IngestCase, args, warmup: float, window: float, limit_s: float, limit_repeat: int,
              daemon_env: dict | None) -> dict[str, Any]:
    """CartPole with ``--sweep-workers`` workers over num_envs x chunk_steps."""
    out: dict[str, Any] = {"workers": args.sweep_workers, "env": base.env, "policy": base.policy, "points": []}
    warm, win = min(warmup, 2.0), min(window, 4.0)
    limits: dict[int, dict] = {}
    for n in [int(x) for x in args.sweep_envs.split(",") if x]:
        log(f"sweep: in-process limit, {n} envs")
        limits[n] = combine_limits([measure_limit(replace(base, num_envs=n), limit_s, limit_repeat)])
        for steps in [int(x) for x in args.sweep_steps.split(",") if x]:
            case = replace(base, num_envs=n, chunk_steps=steps)
            log(f"sweep: num_envs={n} chunk_steps={steps}")
            try:
                run = with_efficiency(run_daemon(case, args.sweep_workers, warm, win, args.parts, daemon_env),
                                      limits[n])
            except Exception as exc:
                run = {"error": str(exc)[:2000]}
            point = {"num_envs": n, "chunk_steps": steps,
                     **{k: run.get(k) for k in ("frames_per_s", "frames_per_s_subwindow_median",
                                                "frames_per_worker_cpu_s", "efficiency", "efficiency_per_cpu_s",
                                                "worker_cpu_utilisation", "load_average_before", "error")
                        if k in run}}
            out["points"].append(point)
            log(f"  -> {point.get('frames_per_s')} frames/s")
    out["inprocess_limits"] = {str(n): {k: v for k, v in lim.items() if k != "samples"} for n, lim in limits.items()}
    ok = [p for p in out["points"] if p.get("frames_per_s")]
    if ok:
        best = max(ok, key=lambda p: p["frames_per_s"])
        best_cpu = max(ok, key=lambda p: p.get("frames_per_worker_cpu_s") or 0)
        out["best_by_frames_per_s"] = {"num_envs": best["num_envs"], "chunk_steps": best["chunk_steps"],
                                       "frames_per_s": best["frames_per_s"]}
        out["best_by_frames_per_worker_cpu_s"] = {"num_envs": best_cpu["num_envs"],
                                                  "chunk_steps": best_cpu["chunk_steps"],
                                                  "frames_per_worker_cpu_s": best_cpu.get("frames_per_worker_cpu_s")}
    return out


def _run(report: dict, case: str, workers: int) -> dict | None:
    for run in report.get("cases", {}).get(case, {}).get("runs", []):
        if run.get("workers") == workers and "error" not in run:
            return run
    return None


def evaluate(report: dict) -> dict[str, Any]:
    """Each target: met / not met / not measured, with the numbers it was judged on."""
    out: dict[str, Any] = {}
    effs = []
    for name, res in report.get("cases", {}).items():
        for run in res["runs"]:
            if "efficiency" in run:
                effs.append({"case": name, "workers": run["workers"], "efficiency": run["efficiency"],
                             "efficiency_per_cpu_s": run.get("efficiency_per_cpu_s"),
                             "per_worker_frames_per_s": run["per_worker_frames_per_s"],
                             "limit_frames_per_s": res["inprocess_limit"]["frames_per_s"],
                             "load_average": run["load_average_before"]})
    if effs:
        out["efficiency_at_least_90pct"] = {
            "met": all(e["efficiency"] >= TARGETS["efficiency_min"] for e in effs), "runs": effs}
    else:
        out["efficiency_at_least_90pct"] = {"met": None, "note": "not measured"}
    if "first_frame" in report:
        over = report["first_frame"]["over_bare_import_s"]
        out["first_frame_within_1s_of_bare_import"] = {
            "met": over <= TARGETS["first_frame_over_bare_import_max_s"],
            "first_frame_s": report["first_frame"]["median_s"], "bare_import_s": report["bare_import"]["median_s"],
            "over_s": over, "paired_over_s_median": report["first_frame"]["paired_over_bare_import_s_median"],
            "load_averages": report["first_frame"]["load_averages"]}
    else:
        out["first_frame_within_1s_of_bare_import"] = {"met": None, "note": "not measured (--no-startup)"}
    for key, case, workers, floor, extra in (
            ("gym_cartpole_2_workers_60k", "gym_cartpole", 2, TARGETS["gym_cartpole_2w_min_fps"], {}),
            ("cartpole_2_workers_256_envs_1M", "cartpole", 2, TARGETS["cartpole_2w_256envs_min_fps"], {}),
            ("pixels_30k", "pixels", 2, TARGETS["pixels_min_fps"], {})):
        run = _run(report, case, workers)
        if run is None:
            out[key] = {"met": None, "note": "not measured"}
            continue
        cfg = report["cases"][case]["case"]
        out[key] = {"met": run["frames_per_s"] >= floor, "frames_per_s": run["frames_per_s"],
                    "frames_per_s_subwindow_max": run["frames_per_s_subwindow_max"], "target": floor,
                    "num_envs": cfg["num_envs"], "chunk_steps": cfg["chunk_steps"],
                    "frames_per_worker_cpu_s": run.get("frames_per_worker_cpu_s"),
                    "load_average": run["load_average_before"], **extra}
    return out


if __name__ == "__main__":
    from ingestd.service.tunables import exec_with_copy_tunable

    exec_with_copy_tunable()  # the copy mode `ingestd run` gives its workers, here and in the limits
    main()
