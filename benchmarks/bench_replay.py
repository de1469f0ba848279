"""Replay storage benchmark: write throughput against memcpy, sampling from another process
while a writer writes, and what that reader costs the writer. Prints JSON.

    python benchmarks/bench_replay.py [--seconds 2] [--rounds 3] [--kinds cartpole pixels]

Rows use TorchRL's layout with the ingestd stamps: CartPole (observation float32[4]) and
4x84x84 uint8 pixels (observation and next observation). The storage lives in a temporary
directory under /dev/shm, removed at the end. Rates are medians over ``--rounds`` windows.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from tensordict import TensorDict

from ingestd.replay import ReplayReader, ReplayStorage
from ingestd.replay.layout import WRITE_INDEX

KINDS = {  # capacity, rows per write, observation shape and dtype
    "cartpole": {"capacity": 1_000_000, "batch": 256, "obs": ((4,), torch.float32)},
    "pixels": {"capacity": 16_384, "batch": 64, "obs": ((4, 84, 84), torch.uint8)},
}
SAMPLE_SIZES = (256, 4096)


def reuse_freed_memory() -> None:
    """Keep glibc from returning big freed blocks to the kernel (and from serving big blocks
    with fresh mmaps), so each sample's output reuses warm pages instead of faulting in and
    zeroing new ones. Same as ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:...trim_threshold=...``."""
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 31)


def make_batch(kind: str, n: int) -> TensorDict:
    shape, dtype = KINDS[kind]["obs"]
    obs = (torch.rand(n, *shape) * 255).to(dtype)
    flags = {f: torch.zeros(n, 1, dtype=torch.bool) for f in ("done", "terminated", "truncated")}
    stamps = {f: torch.arange(n) for f in ("worker", "env", "episode", "step", "policy_version")}
    return TensorDict({"observation": obs, "action": torch.zeros(n, dtype=torch.int64), **flags,
                       "next": {"observation": obs.clone(), "reward": torch.rand(n, 1), **flags},
                       "ingestd": stamps}, batch_size=[n])


def payload_bytes(store: ReplayStorage) -> int:
    return sum(leaf.row_bytes for leaf in store.schema.values())


def median_rate(measure, rounds: int) -> float:
    return statistics.median(measure() for _ in range(rounds))


def write_rate(store: ReplayStorage, batch: TensorDict, seconds: float) -> float:
    """Rows per second written in-process."""
    n, rows, t0 = batch.batch_size[0], 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        store.write(batch)
        rows += n
    return rows / elapsed


def memcpy_rate(workdir: str, nbytes: int, seconds: float) -> float:
    """Bytes per second of a plain single-threaded memcpy of ``nbytes`` into a /dev/shm memmap."""
    slots = max(4, (256 << 20) // nbytes)
    path = os.path.join(workdir, "memcpy.bin")
    with open(path, "wb") as f:
        f.truncate(slots * nbytes)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), slots * nbytes)
    dst = np.frombuffer(mm, dtype=np.uint8).reshape(slots, nbytes)
    dst[:] = 1  # fault the pages in, as the ring's are after its first lap
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    copies, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        np.copyto(dst[copies % slots], src)
        copies += 1
    del dst
    mm.close()
    os.unlink(path)
    return copies * nbytes / elapsed


def sample_rate(reader: ReplayReader, n: int, seconds: float) -> float:
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        reader.sample(n)
        calls += 1
    return calls / elapsed


# -- child processes ----------------------------------------------------------------------
def _wait(start_at: float) -> None:
    while time.monotonic() < start_at:
        time.sleep(0.0005)


def writer_child(path: str, kind: str, threads: int, malloc_reuse: bool, ready, plan, out) -> None:
    torch.set_num_threads(threads)
    if malloc_reuse:
        reuse_freed_memory()
    batch = make_batch(kind, KINDS[kind]["batch"])
    with ReplayStorage.open(path) as store:
        for _ in range(store.capacity // batch.batch_size[0] + 1):  # map every page of the ring
            store.write(batch)
        ready.put("writer")
        for start, stop, _ in plan.get():
            _wait(start)
            rows = 0
            while time.monotonic() < stop:
                store.write(batch)
                rows += batch.batch_size[0]
            out.put(("writer", start, rows / (time.monotonic() - start)))


def reader_child(path: str, threads: int, malloc_reuse: bool, ready, plan, out) -> None:
    torch.set_num_threads(threads)
    if malloc_reuse:
        reuse_freed_memory()
    with ReplayReader(path, seed=0) as reader:
        for start in range(0, reader.capacity, 4096):  # map every page of the ring
            reader.gather(np.arange(start, min(start + 4096, reader.capacity)))
        ready.put("reader")
        for start, stop, n in plan.get():
            if n is None:
                continue
            _wait(start)
            calls = 0
            while time.monotonic() < stop:
                reader.sample(n)
                calls += 1
            out.put(("reader", start, calls / (time.monotonic() - start)))


def concurrent(ctx, path: str, kind: str, args) -> dict:
    """Windows in turn: writer alone, writer + reader sampling 256, alone, + reader 4096, ..."""
    ready, out, plans = ctx.Queue(), ctx.Queue(), [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=writer_child, args=(path, kind, args.writer_threads, args.malloc_reuse,
                                                    ready, plans[0], out)),
             ctx.Process(target=reader_child, args=(path, args.reader_threads, args.malloc_reuse,
                                                    ready, plans[1], out))]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        t0, span = time.monotonic() + 0.5, args.seconds + 0.3
        plan = []  # (start, stop, sample size or None for the writer alone)
        for _ in range(args.rounds):
            for n in (None, *SAMPLE_SIZES):
                start = t0 + len(plan) * span
                plan.append((start, start + args.seconds, n))
        for q in plans:
            q.put(plan)
        results = {}
        for _ in range(len(plan) + sum(1 for *_, n in plan if n)):
            who, start, rate = out.get(timeout=len(plan) * span + 60)
            results[(who, start)] = rate
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    alone = [results[("writer", a)] for a, _, n in plan if n is None]
    report = {"writer_alone_rows_per_s": statistics.median(alone)}
    for size in SAMPLE_SIZES:
        starts = [a for a, _, n in plan if n == size]
        writer = statistics.median(results[("writer", a)] for a in starts)
        report[f"sample_{size}"] = {
            "reader_calls_per_s": statistics.median(results[("reader", a)] for a in starts),
            "writer_rows_per_s": writer,
            "writer_slowdown_pct": 100.0 * (1 - writer / report["writer_alone_rows_per_s"]),
        }
    return report


def bench_kind(ctx, workdir: str, kind: str, args) -> dict:
    spec = KINDS[kind]
    path = os.path.join(workdir, kind)
    batch = make_batch(kind, spec["batch"])
    result: dict = {"capacity": spec["capacity"], "write_batch_rows": spec["batch"]}
    with ReplayStorage.create(path, batch, spec["capacity"]) as store:
        row_bytes = payload_bytes(store)
        result["row_bytes"] = row_bytes
        for _ in range(spec["capacity"] // spec["batch"] + 1):  # one lap: every page faulted in
            store.write(batch)
        torch.set_num_threads(args.writer_threads)
        writes, copies = [], []
        for _ in range(args.rounds):  # interleaved, so both see the same machine load
            writes.append(write_rate(store, batch, args.seconds))
            copies.append(memcpy_rate(workdir, spec["batch"] * row_bytes, args.seconds))
        rows_per_s, memcpy = statistics.median(writes), statistics.median(copies)
        result["write"] = {"rows_per_s": rows_per_s, "GB_per_s": rows_per_s * row_bytes / 1e9,
                           "memcpy_GB_per_s": memcpy / 1e9, "ratio_to_memcpy": rows_per_s * row_bytes / memcpy,
                           "torch_threads": args.writer_threads}
    torch.set_num_threads(args.reader_threads)
    with ReplayReader(path, seed=0) as reader:
        result["sample_in_process_calls_per_s"] = {
            str(n): median_rate(lambda n=n: sample_rate(reader, n, args.seconds), args.rounds) for n in SAMPLE_SIZES}
        assert reader.sample(8).get(WRITE_INDEX).max() < reader.write_count
    result["concurrent"] = concurrent(ctx, path, kind, args)
    result["concurrent"]["reader_torch_threads"] = args.reader_threads
    result["concurrent"]["writer_torch_threads"] = args.writer_threads
    shutil.rmtree(path)
    return result


def targets(results: dict) -> dict:
    out = {}
    if "pixels" in results:
        px = results["pixels"]
        out["pixel_write_ratio_to_memcpy>=0.5"] = px["write"]["ratio_to_memcpy"]
        out["pixel_sample256_calls_per_s>=1000"] = px["concurrent"]["sample_256"]["reader_calls_per_s"]
    if "cartpole" in results:
        out["cartpole_sample256_calls_per_s>=20000"] = \
            results["cartpole"]["concurrent"]["sample_256"]["reader_calls_per_s"]
    for kind, res in results.items():
        out[f"{kind}_writer_slowdown_pct_by_sample256_reader<=10"] = res["concurrent"]["sample_256"]["writer_slowdown_pct"]
    limits = {">=0.5": (0.5, 1), ">=1000": (1000, 1), ">=20000": (20000, 1), "<=10": (10, -1)}
    return {name: {"value": round(value, 3), "met": any(name.endswith(k) and (value - v) * sign >= 0
                                                        for k, (v, sign) in limits.items())}
            for name, value in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each timed window")
    parser.add_argument("--rounds", type=int, default=3, help="windows per measurement (median)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--writer-threads", type=int, default=1, help="torch threads of the writer")
    parser.add_argument("--reader-threads", type=int, default=1, help="torch threads of the reader")
    parser.add_argument("--malloc-reuse", action="store_true", help="see reuse_freed_memory()")
    args = parser.parse_args()
    if args.malloc_reuse:
        reuse_freed_memory()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensordict", "ingestd.replay"])
    workdir = tempfile.mkdtemp(prefix="ingestd-bench-", dir="/dev/shm")
    load_before = os.getloadavg()
    try:
        results = {kind: bench_kind(ctx, workdir, kind, args) for kind in args.kinds}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "settings": vars(args), "results": results, "targets": targets(results),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
