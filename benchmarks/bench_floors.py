"""The machine's own floors under the speed targets ingestd does not meet; prints JSON.

    flock /tmp/ingestd-bench.lock python benchmarks/bench_floors.py [--seconds 1.5] [--rounds 5]

Each figure is work that any implementation of the target must do, measured here with no
ingestd code on its path (or only the unavoidable part of it), so the ceiling it implies
can be set beside the target:

- ``pixel_gather``: one thread copying 256 random 28,224-byte rows (a 4x84x84 uint8
  observation) out of a /dev/shm memmap ring into a fresh output, twice per call (the
  observation and the next observation of a TorchRL-layout row), as ``sample(256)`` of
  pixel rows must. Its rate is the ceiling of ``sample(256)`` on one core before any
  seqlock check or TensorDict (issue 2's target: 1,000 calls/s).
- ``pixels_store``: the bare in-process Pixels loop (64 envs, Random policy: what
  ``bench_efficiency`` calls the limit) against the same loop plus one memcpy of each
  step's observation and next observation into a /dev/shm ring, which storing a
  TorchRL-layout row needs at the least. Their ratio is the ceiling of the Pixels worker
  efficiency (issue 3's target: 0.9), before stamps, seqlocks or bookkeeping. Two more
  loops bound what a storage-format change could reach: ``one_copy`` copies only the next
  observation (a replay that stores each frame once, as frame deduplication would), and
  ``produced_in_ring`` has the env cut its frames straight into the ring (each frame stored
  once and never copied: deduplication plus an env that writes into the storage's slots).
  The last is the ceiling of any implementation that keeps every frame.
- ``cartpole_designs`` (only with ``--only cartpole_designs``): floors of three ways a
  1-worker CartPole rollout could hand its rows on (its docstring), against the bare loop.
- ``sample_batch_objects``: what a ``sample(256)`` returning a new TensorDict pays for its
  objects alone, with no rows copied: the 16 leaf tensors of a CartPole row, viewed out
  of 4 numpy blocks, and the 3 nested TensorDicts (tensordict's unchecked constructor),
  beside a ``sample(256, out=batch)`` of the same storage (which makes no object). Their
  sum bounds ``sample(256)`` with a new TensorDict (issue 2's target: 20,000 calls/s).

Rates are per CPU second of this process (``process_time``), which other load on a shared
VM disturbs less than wall time; each is the median of ``--rounds`` windows. The ZeroMQ
floor of issue 4's status target has its own benchmark, ``bench_zmq_floor.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_env_loop import CASES  # noqa: E402

PIXEL_ROW = 4 * 84 * 84  # bytes of one uint8 observation
TARGETS = {"pixel_sample_256_calls_per_s": 1000, "pixels_efficiency": 0.9, "cartpole_efficiency": 0.9,
           "cartpole_sample_256_calls_per_s": 20000}


def per_cpu_second(step: Callable[[], int], seconds: float, rounds: int) -> float:
    """Median over ``rounds`` windows of the units ``step`` does per CPU second."""
    step()  # warm
    rates = []
    for _ in range(rounds):
        c0, units = time.process_time(), 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            units += step()
        rates.append(units / max(time.process_time() - c0, 1e-9))
    return statistics.median(rates)


def ring(workdir: str, name: str, rows: int, row_bytes: int) -> np.ndarray:
    """A ``[rows, row_bytes]`` uint8 memmap in ``workdir`` with every page faulted in."""
    ring = np.memmap(os.path.join(workdir, name), dtype=np.uint8, mode="w+", shape=(rows, row_bytes))
    ring[:] = 1
    return ring


def pixel_gather(workdir: str, seconds: float, rounds: int) -> dict:
    rows = 32768  # 925 MB: far past the caches, as a replay is
    source = ring(workdir, "pixels.bin", rows, PIXEL_ROW)
    rng = np.random.default_rng(0)

    def call() -> int:
        for _ in range(2):  # observation and next observation
            np.take(source, rng.integers(0, rows, 256), axis=0)
        return 1
    calls = per_cpu_second(call, seconds, rounds)
    return {"calls_per_cpu_s": round(calls, 1), "bytes_per_call": 2 * 256 * PIXEL_ROW,
            "gigabytes_per_cpu_s": round(calls * 2 * 256 * PIXEL_ROW / 1e9, 2),
            "target_calls_per_s": TARGETS["pixel_sample_256_calls_per_s"]}


def pixels_store(workdir: str, seconds: float, rounds: int) -> dict:
    env, policy = CASES["pixels_random"].build()
    n = env.num_envs
    slots = 512  # frame batches in the ring: 64 envs x 28 KB each = 0.9 GB
    dest = ring(workdir, "store.bin", slots, n * PIXEL_ROW)
    frames = torch.from_numpy(np.asarray(dest)).view(slots, n, *env._windows.shape[1:])
    state = {"root": env.reset(), "slot": 0}
    produce = env._observation

    def next_slot() -> int:
        s = state["slot"] = (state["slot"] + 1) % slots
        return s

    def bare() -> int:
        _, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
        return n

    def two_copies() -> int:
        transition, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
        np.copyto(dest[next_slot()], transition["observation"].numpy().reshape(-1))
        np.copyto(dest[next_slot()], transition["next", "observation"].numpy().reshape(-1))
        return n

    def one_copy() -> int:
        transition, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
        np.copyto(dest[next_slot()], transition["next", "observation"].numpy().reshape(-1))
        return n

    def in_ring() -> torch.Tensor:  # Pixels._observation, its output a slot of the ring
        out = frames[next_slot()]
        torch.index_select(env._windows, 0, env._pos, out=out)
        out[:, -1, 0, 0] = env._steps.to(torch.uint8)
        return out

    def produced_in_ring() -> int:
        env._observation = in_ring
        try:
            return bare()
        finally:
            env._observation = produce
    loops = {"bare": bare, "two_copies": two_copies, "one_copy": one_copy, "produced_in_ring": produced_in_ring}
    try:
        rates: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(rounds):  # in alternation: the VM's speed drifts
            for name, loop in loops.items():
                rates[name].append(per_cpu_second(loop, seconds, 1))
    finally:
        env.close()
    rate = {name: statistics.median(values) for name, values in rates.items()}
    return {"bare_frames_per_cpu_s": round(rate["bare"]), "with_two_copies_frames_per_cpu_s": round(rate["two_copies"]),
            "efficiency_ceiling": round(rate["two_copies"] / rate["bare"], 3),
            "one_copy_frames_per_cpu_s": round(rate["one_copy"]),
            "one_copy_ceiling": round(rate["one_copy"] / rate["bare"], 3),
            "produced_in_ring_frames_per_cpu_s": round(rate["produced_in_ring"]),
            "produced_in_ring_ceiling": round(rate["produced_in_ring"] / rate["bare"], 3),
            "target": TARGETS["pixels_efficiency"]}


def cartpole_store(workdir: str, seconds: float, rounds: int) -> dict:
    """The bare CartPole loop (256 envs, MLP: bench_efficiency's limit) against the same loop
    plus the least that storing its rows needs: once per 64-step chunk, one memcpy of the
    chunk's rows, already packed (16,384 records of 128 bytes, ingestd's record for a CartPole
    row), into a pre-faulted ring of a million records (the default capacity)."""
    env, policy = CASES["cartpole_mlp"].build()
    steps, n, record = 64, env.num_envs, 128
    rows = steps * n
    dest = ring(workdir, "records.bin", 1_000_000 // rows * rows, record)
    packed = np.ones((rows, record), dtype=np.uint8)
    state = {"root": env.reset(), "slot": 0}

    def bare() -> int:
        for _ in range(steps):
            _, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
        return rows

    def stored() -> int:
        bare()
        s = state["slot"]
        np.copyto(dest[s:s + rows], packed)
        state["slot"] = (s + rows) % dest.shape[0]
        return rows
    rates = {"bare": [], "stored": []}
    for _ in range(rounds):  # in alternation: the VM's speed drifts
        rates["bare"].append(per_cpu_second(bare, seconds, 1))
        rates["stored"].append(per_cpu_second(stored, seconds, 1))
    bare_rate, stored_rate = statistics.median(rates["bare"]), statistics.median(rates["stored"])
    return {"bare_frames_per_cpu_s": round(bare_rate), "with_one_copy_frames_per_cpu_s": round(stored_rate),
            "efficiency_ceiling": round(stored_rate / bare_rate, 3), "target": TARGETS["cartpole_efficiency"]}



def cartpole_designs(workdir: str, seconds: float, rounds: int) -> dict:
    """Floors of three ways a 1-worker CartPole rollout could hand its rows on (256 envs, MLP,
    64-step chunks), each against the bare loop, to see which could reach 0.9 before stamps,
    episode accounting, checks or the priority tree (together ~1 ms a chunk here):

    - ``walk``: each step's transition read into a dict of its leaves (``rollout._leaves_of``)
      and kept until the next step: the least any rollout that reads the env's rows does;
    - ``keep_stack``: the 64 steps' leaves kept and each stacked once into a ``[64, 256, ...]``
      buffer (ingestd's rollout without its bookkeeping): what the worker alone would still
      pay if another process packed its chunks into the ring from shared buffers;
    - ``step_copy``: each step's leaves copied at once (one ``torch._foreach_copy_``) into
      strided views of a staging area in the ring's record layout (128-byte records), then
      one memcpy of the chunk into a million-row ring: no stack and no pack."""
    from ingestd.collect.rollout import _leaves_of

    env, policy = CASES["cartpole_mlp"].build()
    steps, n, record = 64, env.num_envs, 128
    rows = steps * n
    dest = torch.from_numpy(ring(workdir, "designs.bin", 1_000_000 // rows * rows, record))
    state = {"root": env.reset(), "slot": 0}
    first = _leaves_of(env.step_and_maybe_reset(policy(state["root"]))[0])
    keys = sorted(first, key=lambda k: -first[k].element_size())  # the record's order: no padding
    staging, views, offset = torch.zeros((rows, record), dtype=torch.uint8), {}, 0
    buffers = {k: torch.empty((steps, *v.shape), dtype=v.dtype) for k, v in first.items()}
    for key in keys:
        leaf, size = first[key], first[key].element_size()
        width = leaf[0].numel()
        typed = staging.view(leaf.dtype)[:, offset // size:offset // size + width]
        views[key] = typed.reshape(steps, *leaf.shape)
        offset += width * size
    per_step = [[views[k][t] for k in keys] for t in range(steps)]

    def bare() -> int:
        for _ in range(steps):
            _, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
        return rows

    def walk() -> int:
        for _ in range(steps):
            transition, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
            leaves = _leaves_of(transition)
        del leaves
        return rows

    def keep_stack() -> int:
        kept = []
        for _ in range(steps):
            transition, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
            kept.append(_leaves_of(transition))
        for key, buf in buffers.items():
            torch.stack([leaves[key] for leaves in kept], out=buf)
        return rows

    def step_copy() -> int:
        for t in range(steps):
            transition, state["root"] = env.step_and_maybe_reset(policy(state["root"]))
            leaves = _leaves_of(transition)
            torch._foreach_copy_(per_step[t], [leaves[k] for k in keys])
        s = state["slot"]
        dest[s:s + rows].copy_(staging)
        state["slot"] = (s + rows) % dest.shape[0]
        return rows

    # one chunk of each loop in turn, the order reversed every other time, each timed in CPU seconds
    # (as bench_chunk_costs): windows of seconds per loop read 0.75-0.89 for step_copy in two runs
    loops = {"bare": bare, "walk": walk, "keep_stack": keep_stack, "step_copy": step_copy}
    times: dict[str, list[float]] = {name: [] for name in loops}
    order = list(loops.items())
    for fn in loops.values():
        fn()  # warm: first-touch faults of the ring and the buffers
    calls = max(20, int(rounds * seconds * 60))  # ~60 chunks of each loop a second asked for
    for call in range(calls):
        for name, fn in (order if call % 2 else order[::-1]):
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"calls": calls, "median_ms_per_chunk": {name: round(v, 3) for name, v in ms.items()},
            "bare_frames_per_cpu_s": round(rows / ms["bare"] * 1e3),
            "efficiency_ceiling": {name: round(ms["bare"] / ms[name], 3) for name in loops if name != "bare"},
            "target": TARGETS["cartpole_efficiency"]}

def cartpole_batch(n: int) -> TensorDict:
    obs = torch.zeros(n, 4)
    flags = {f: torch.zeros(n, 1, dtype=torch.bool) for f in ("done", "terminated", "truncated")}
    stamps = {f: torch.zeros(n, dtype=torch.int64) for f in ("worker", "env", "episode", "step", "policy_version")}
    return TensorDict({"observation": obs, "action": torch.zeros(n, dtype=torch.int64), **flags,
                       "next": {"observation": obs.clone(), "reward": torch.zeros(n, 1), **flags},
                       "ingestd": stamps}, batch_size=[n])


def sample_batch_objects(workdir: str, seconds: float, rounds: int) -> dict:
    from ingestd.replay import ReplayReader, ReplayStorage

    storage = ReplayStorage.create(os.path.join(workdir, "cartpole"), cartpole_batch(256), 1 << 20)
    rows = cartpole_batch(4096)
    for _ in range(64):
        storage.write(rows)
    reader = ReplayReader(os.path.join(workdir, "cartpole"), seed=0)
    records, seq = reader._records, reader.seq  # the storage's own memory: the record ring and the seqlocks
    new = TensorDict._new_unsafe
    size = torch.Size([256])
    # the sample's leaves by dtype and shape: float [4] x2, int64 x7 (action, 6 stamps), bool x6, float x1
    blocks = [((2, 256, 4), np.float32), ((7, 256), np.int64), ((6, 256, 1), np.bool_), ((1, 256, 1), np.float32)]
    root_keys = ("observation", "action", "done", "terminated", "truncated")
    next_keys = ("observation", "reward", "done", "terminated", "truncated")
    stamp_keys = ("worker", "env", "episode", "step", "policy_version", "write_index")

    def objects() -> int:
        (o0, o1), ints, (b0, b1, b2, b3, b4, b5), (r,) = (torch.from_numpy(np.empty(s, d)).unbind(0) for s, d in blocks)
        stamps = new({k: v for k, v in zip(stamp_keys, ints[1:])}, batch_size=size, nested=False)
        nxt = new(dict(zip(next_keys, (o1, r, b3, b4, b5))), batch_size=size, nested=False)
        root = dict(zip(root_keys, (o0, ints[0], b0, b1, b2)))
        root["next"], root["ingestd"] = nxt, stamps
        new(root, batch_size=size, nested=False)
        return 1
    groups = [np.empty((shape[0], 256, *shape[1:]), dtype) for _, shape, dtype, _, _ in reader._groups]
    rng = np.random.default_rng(0)
    filled = len(reader)

    def bare_copy() -> int:
        """The copy itself: the seqlocks read twice around a gather of the rows' records, then
        one strided copy per run of leaves into its block (``ReplayReader._fill_blocks``)."""
        idx = rng.integers(0, filled, 256)
        before, rows, after = seq[idx], records[idx], seq[idx]
        reader._fill_blocks(rows, 256, groups)
        return int(before.tobytes() == after.tobytes())
    try:
        out = reader.empty_batch(256)
        copied = per_cpu_second(bare_copy, seconds, rounds)
        made = per_cpu_second(objects, seconds, rounds)
        into = per_cpu_second(lambda: reader.sample(256, out=out) is not None, seconds, rounds)
        fresh = per_cpu_second(lambda: reader.sample(256) is not None, seconds, rounds)
    finally:
        reader.close()
        storage.close()
    made_us, into_us, copy_us = 1e6 / made, 1e6 / into, 1e6 / copied
    return {"objects_us": round(made_us, 1), "bare_copy_us": round(copy_us, 1), "sample_into_us": round(into_us, 1),
            "sample_new_us": round(1e6 / fresh, 1),
            "ceiling_calls_per_cpu_s": round(1e6 / (made_us + copy_us)),
            "ceiling_with_into_calls_per_cpu_s": round(1e6 / (made_us + into_us)),
            "note": "in this process with no writer; a writer on the other core adds ~10-40 us per call "
                    "(bench_replay: reader process)",
            "target_calls_per_s": TARGETS["cartpole_sample_256_calls_per_s"]}


FLOORS = {"pixel_gather": pixel_gather, "pixels_store": pixels_store, "cartpole_store": cartpole_store,
          "sample_batch_objects": sample_batch_objects}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="length of each timed window")
    parser.add_argument("--rounds", type=int, default=5, help="windows per figure (median)")
    parser.add_argument("--only", choices=(*FLOORS, "cartpole_designs"), action="append",
                        help="one floor (repeatable); cartpole_designs runs only when named")
    args = parser.parse_args(argv)
    from ingestd.collect.rollout import no_autograd
    from ingestd.collect.worker import keep_heap

    keep_heap()  # the workers' allocator settings (the bare Pixels loop reads 2-3x low without them)
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="ingestd-floors-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    report = {"benchmark": "floors", "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "load_average_start": [round(x, 2) for x in os.getloadavg()],
              "settings": {"seconds": args.seconds, "rounds": args.rounds}}
    try:
        for name, fn in (*FLOORS.items(), ("cartpole_designs", cartpole_designs)):
            if (args.only is None and name in FLOORS) or name in (args.only or ()):
                stepping = name in ("pixels_store", "cartpole_store", "cartpole_designs")  # env loops: the workers' mode
                with no_autograd() if stepping else contextlib.nullcontext():
                    report[name] = fn(work, args.seconds, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    from ingestd.service.tunables import exec_with_copy_tunable

    exec_with_copy_tunable()  # the copy mode `ingestd run` gives its workers, here and in the limits
    main()
