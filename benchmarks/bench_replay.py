"""Replay storage benchmark: write throughput against memcpy, sampling from another process
while a writer writes, and what that reader costs the writer. Prints JSON.

    python benchmarks/bench_replay.py [--seconds 2] [--rounds 3] [--kinds cartpole pixels]

Rows use TorchRL's layout with the ingestd stamps: CartPole (observation float32[4]) and
4x84x84 uint8 pixels (observation and next observation). The storage lives in a temporary
directory under /dev/shm, removed at the end. Every rate is a median over ``--rounds``
windows and is given twice: per wall-clock second, and per CPU second of the measuring
process (``process_time``). On a machine shared with other work the wall rates fall with
the load; the CPU rates estimate what an otherwise idle machine would do (each of the
writer and the reader on its own core), and still show memory-bandwidth interference.

``control_busy_loop`` is the control for the writer-slowdown figures: the reader process
spins a pure-Python loop that touches no storage. The writer "slowdown" it causes is what
the machine itself does to a writer when the other core is busy (on a shared VM: +-15 %
from window to window), the yardstick for the slowdowns the samplers cause.
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
from typing import Callable, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict

from ingestd.replay import ReplayReader, ReplayStorage

KINDS = {  # capacity, rows per write, observation shape and dtype
    "cartpole": {"capacity": 1_000_000, "batch": 256, "obs": ((4,), torch.float32)},
    # 3.7 GB: the writer laps it in under a second here, while one sample(4096) copies 231 MB
    # (~0.25 s); a smaller ring is overwritten during the copy, every row is re-drawn and the
    # call takes seconds (and SampleTimeout when the writer laps the ring during every copy)
    "pixels": {"capacity": 65_536, "batch": 64, "obs": ((4, 84, 84), torch.uint8)},
}
SAMPLE_SIZES = (256, 4096)
# the reader's modes in the concurrent windows: name -> (batch size, into a reused empty_batch)
READER_MODES = {"sample_256": (256, False), "sample_4096": (4096, False), "sample_256_into": (256, True),
                "control_busy_loop": (0, False)}  # the control: the reader's core busy, no storage touched


class Rate(NamedTuple):
    wall: float  # units per wall-clock second
    cpu: float  # units per CPU second of this process


def run(step: Callable[[], int], seconds: float | None = None, until: float | None = None) -> Rate:
    """Call ``step`` (it returns the units it did) until ``seconds`` pass or ``time.monotonic()``
    reaches ``until``."""
    w0, c0, units = time.monotonic(), time.process_time(), 0
    end = until if until is not None else w0 + seconds
    while time.monotonic() < end:
        units += step()
    return Rate(units / (time.monotonic() - w0), units / max(time.process_time() - c0, 1e-9))


def median(rates: list[Rate]) -> Rate:
    return Rate(statistics.median(r.wall for r in rates), statistics.median(r.cpu for r in rates))


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


def memcpy_step(workdir: str, nbytes: int):
    """A step copying ``nbytes`` with one plain memcpy into a /dev/shm memmap (pages faulted
    in, as the ring's are after its first lap), cycling over 256 MB; and its cleanup."""
    slots = max(4, (256 << 20) // nbytes)
    path = os.path.join(workdir, "memcpy.bin")
    with open(path, "wb") as f:
        f.truncate(slots * nbytes)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), slots * nbytes)
    dst = np.frombuffer(mm, dtype=np.uint8).reshape(slots, nbytes)
    dst[:] = 1
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    count = [0]

    def step() -> int:
        np.copyto(dst[count[0] % slots], src)
        count[0] += 1
        return nbytes

    def cleanup() -> None:
        nonlocal dst
        del dst
        mm.close()
        os.unlink(path)
    return step, cleanup


# -- child processes ----------------------------------------------------------------------
def writer_child(path: str, kind: str, threads: int, malloc_reuse: bool, ready, plan, out) -> None:
    torch.set_num_threads(threads)
    if malloc_reuse:
        reuse_freed_memory()
    batch = make_batch(kind, KINDS[kind]["batch"])
    n = batch.batch_size[0]
    with ReplayStorage.open(path) as store:
        for _ in range(store.capacity // n + 1):  # map every page of the ring
            store.write(batch)
        ready.put("writer")
        for start, stop, _ in plan.get():
            while time.monotonic() < start:
                time.sleep(0.0005)
            out.put(("writer", start, run(lambda: store.write(batch) * 0 + n, until=stop)))


def reader_child(path: str, threads: int, malloc_reuse: bool, ready, plan, out) -> None:
    torch.set_num_threads(threads)
    if malloc_reuse:
        reuse_freed_memory()
    with ReplayReader(path, seed=0) as reader:
        for start in range(0, reader.capacity, 4096):  # map every page of the ring
            reader.gather(np.arange(start, min(start + 4096, reader.capacity)))
        outs = {size: reader.empty_batch(size) for size, into in READER_MODES.values() if into}
        ready.put("reader")
        for start, stop, mode in plan.get():
            if mode is None:
                continue
            size, into = READER_MODES[mode]
            batch = outs[size] if into else None
            step = (lambda: sum(range(1000)) * 0 + 1) if size == 0 else \
                (lambda: reader.sample(size, out=batch) is not None)
            while time.monotonic() < start:
                time.sleep(0.0005)
            late = time.monotonic() - start
            if late > 0.1 * (stop - start):  # the last call of the previous window overran into this one
                print(f"bench_replay: reader began the {mode} window {late:.2f} s late", file=sys.stderr)
            out.put(("reader", start, run(step, until=stop)))


def concurrent(ctx, path: str, kind: str, args) -> dict:
    """Windows in turn: writer alone, writer + reader sampling 256, + 4096, + 256 into a reused
    batch (``sample(256, out=...)``), ..."""
    ready, out, plans = ctx.Queue(), ctx.Queue(), [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=writer_child, args=(path, kind, args.writer_threads, args.malloc_reuse,
                                                    ready, plans[0], out)),
             ctx.Process(target=reader_child, args=(path, args.reader_threads, args.malloc_reuse,
                                                    ready, plans[1], out))]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=300)
        t0, span = time.monotonic() + 0.5, args.seconds + 0.3
        plan = []  # (start, stop, reader mode, or None: the writer alone)
        for _ in range(args.rounds):
            for mode in (None, *READER_MODES):
                start = t0 + len(plan) * span
                plan.append((start, start + args.seconds, mode))
        for q in plans:
            q.put(plan)
        results = {}
        for _ in range(len(plan) + sum(1 for *_, size in plan if size)):
            who, start, rate = out.get(timeout=len(plan) * span + 120)
            results[(who, start)] = Rate(*rate)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    alone = median([results[("writer", a)] for a, _, size in plan if size is None])
    report: dict = {"writer_alone_rows_per_s": alone._asdict()}
    for mode in READER_MODES:
        starts = [a for a, _, m in plan if m == mode]
        writer = median([results[("writer", a)] for a in starts])
        report[mode] = {
            "reader_calls_per_s": median([results[("reader", a)] for a in starts])._asdict(),
            "writer_rows_per_s": writer._asdict(),
            "writer_slowdown_pct": {f: 100.0 * (1 - getattr(writer, f) / getattr(alone, f)) for f in Rate._fields},
        }
    return report


def bench_kind(ctx, workdir: str, kind: str, args) -> dict:
    spec = KINDS[kind]
    path = os.path.join(workdir, kind)
    batch = make_batch(kind, spec["batch"])
    n = spec["batch"]
    result: dict = {"capacity": spec["capacity"], "write_batch_rows": n}
    torch.set_num_threads(args.writer_threads)
    with ReplayStorage.create(path, batch, spec["capacity"]) as store:
        row_bytes = sum(leaf.row_bytes for leaf in store.schema.values())
        result["row_bytes"] = row_bytes
        for _ in range(spec["capacity"] // n + 1):  # one lap: every page faulted in
            store.write(batch)
        memcpy, cleanup = memcpy_step(workdir, n * row_bytes)
        try:
            writes, copies = [], []
            for _ in range(args.rounds):  # interleaved, so both see the same machine load
                writes.append(run(lambda: store.write(batch) * 0 + n, args.seconds))
                copies.append(run(memcpy, args.seconds))
        finally:
            cleanup()
        rows, copy = median(writes), median(copies)
        result["write"] = {"rows_per_s": rows._asdict(),
                           "GB_per_s": {f: getattr(rows, f) * row_bytes / 1e9 for f in Rate._fields},
                           "memcpy_GB_per_s": {f: getattr(copy, f) / 1e9 for f in Rate._fields},
                           "ratio_to_memcpy": {f: getattr(rows, f) * row_bytes / getattr(copy, f)
                                               for f in Rate._fields},
                           "torch_threads": args.writer_threads}
    torch.set_num_threads(args.reader_threads)
    with ReplayReader(path, seed=0) as reader:
        result["sample_in_process_calls_per_s"] = {
            str(size): median([run(lambda size=size: reader.sample(size) is not None, args.seconds)
                               for _ in range(args.rounds)])._asdict() for size in SAMPLE_SIZES}
    result["concurrent"] = concurrent(ctx, path, kind, args)
    shutil.rmtree(path)
    return result


TARGETS = [  # name, (kind, path...) into the results, bound, at least (True) or at most (False)
    ("pixel writes / memcpy bandwidth >= 0.5", ("pixels", "write", "ratio_to_memcpy"), 0.5, True),
    ("pixel sample(256) calls/s >= 1000 (reader process, writer writing)",
     ("pixels", "concurrent", "sample_256", "reader_calls_per_s"), 1000, True),
    ("CartPole sample(256) calls/s >= 20000 (reader process, writer writing)",
     ("cartpole", "concurrent", "sample_256", "reader_calls_per_s"), 20000, True),
    ("CartPole sample(256, out=reused batch) calls/s >= 20000 (reader process, writer writing)",
     ("cartpole", "concurrent", "sample_256_into", "reader_calls_per_s"), 20000, True),
    ("pixel sample(256, out=reused batch) calls/s >= 1000 (reader process, writer writing)",
     ("pixels", "concurrent", "sample_256_into", "reader_calls_per_s"), 1000, True),
    ("CartPole writer slowdown by a sample(256) reader <= 10%",
     ("cartpole", "concurrent", "sample_256", "writer_slowdown_pct"), 10, False),
    ("pixel writer slowdown by a sample(256) reader <= 10%",
     ("pixels", "concurrent", "sample_256", "writer_slowdown_pct"), 10, False),
]


def targets(results: dict) -> list[dict]:
    out = []
    for name, path, bound, at_least in TARGETS:
        if path[0] not in results:
            continue
        value = results
        for part in path:
            value = value[part]
        out.append({"target": name, **{f"{f}_value": round(value[f], 3) for f in Rate._fields},
                    **{f"met_{f}": (value[f] >= bound) if at_least else (value[f] <= bound) for f in Rate._fields}})
    return out


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
