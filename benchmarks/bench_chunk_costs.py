"""What a worker's chunk costs over the bare loop, in one process. Prints JSON.

    python benchmarks/bench_chunk_costs.py [--case cartpole_mlp] [--chunk-steps 64] [--calls 200]

Three loops over the same env and policy (``bench_env_loop.CASES``), each one chunk
(``chunk_steps`` steps of every sub-env) per call, called in turn (the order reversed
every other time) and timed in CPU seconds of this process, so the VM's drift and the
order's cache effects fall on all three alike:

- ``bare``: the in-process limit (``policy``, then ``env.step_and_maybe_reset``, under
  inference mode as the rollout's steps);
- ``rollout``: ``Rollout.chunk`` alone (stamps, episode accounting, checks, the rows);
- ``stored``: ``Rollout.chunk`` into the storage's reserved slots and the commit, as a
  worker does, into a ring of ``--capacity`` rows (fewer if it would pass ``--max-gib``)
  in /dev/shm, filled once beforehand (its ``write`` part is timed on its own too).

The figures are medians over the calls. ``efficiency`` is ``bare / stored``: the worker
efficiency without IPC, the supervisor or a second process on the machine. A single
median moves by a few percent from run to run on a shared VM; compare runs of the same
build before reading a change of that size.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_env_loop import CASES  # noqa: E402
from ingestd.collect.rollout import Rollout, no_autograd  # noqa: E402
from ingestd.collect.worker import keep_heap  # noqa: E402
from ingestd.replay.storage import ReplayStorage  # noqa: E402


def measure(case: str, chunk_steps: int, calls: int, capacity: int, max_bytes: int) -> dict:
    env, policy = CASES[case].build()
    rolled = Rollout(*CASES[case].build(), worker=0, episode_base=0, chunk_steps=chunk_steps)
    writer = Rollout(*CASES[case].build(), worker=1, episode_base=0, chunk_steps=chunk_steps)
    rows = writer.rows_per_chunk
    example = writer.chunk(0)[0]
    row_bytes = sum(leaf[0].numel() * leaf.element_size() for leaf in example.values(True, True))
    capacity = max(min(capacity, max_bytes // row_bytes) // rows, 2) * rows  # whole chunks, within max_bytes
    workdir = tempfile.mkdtemp(prefix="ingestd-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    state = {"root": env.reset()}
    times: dict[str, list[float]] = {"bare": [], "rollout": [], "stored": [], "write": []}
    clock = time.process_time

    def bare() -> None:
        root = state["root"]
        with no_autograd():  # as Rollout.chunk runs its steps
            for _ in range(chunk_steps):
                _, root = env.step_and_maybe_reset(policy(root))
        state["root"] = root

    def rollout() -> None:
        rolled.chunk(0)

    def stored() -> None:
        with storage.reserved(rows) as slots:
            chunk, _ = writer.chunk(0, into=slots.columns)
            t0 = clock()
            slots.commit(chunk)
        times["write"].append(clock() - t0)

    try:
        storage = ReplayStorage.create(Path(workdir) / "replay", example, capacity)
        for _ in range(capacity // rows + 1):  # every slot written once: no first-touch faults below
            stored()
        for fn in (bare, rollout):
            fn()
        times["write"].clear()
        loops = [("bare", bare), ("rollout", rollout), ("stored", stored)]
        for call in range(calls):
            for name, fn in (loops if call % 2 else loops[::-1]):
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
        storage.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        env.close()
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"case": case, "num_envs": env.num_envs, "chunk_steps": chunk_steps, "rows_per_chunk": rows,
            "calls": calls, "capacity": capacity, "median_ms_per_chunk": {k: round(v, 3) for k, v in ms.items()},
            "rollout_over_bare_ms": round(ms["rollout"] - ms["bare"], 3),
            "rollout_efficiency": round(ms["bare"] / ms["rollout"], 3),
            "efficiency": round(ms["bare"] / ms["stored"], 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="cartpole_mlp", choices=sorted(CASES))
    parser.add_argument("--chunk-steps", type=int, default=64, help="workers.chunk_steps (the daemon's default)")
    parser.add_argument("--calls", type=int, default=200, help="chunks per loop")
    parser.add_argument("--capacity", type=int, default=1_000_000, help="rows of the ring (the default config's)")
    parser.add_argument("--max-gib", type=float, default=1.0, help="fewer rows if the ring would be larger (images)")
    args = parser.parse_args(argv)
    keep_heap()  # the workers' allocator settings
    torch.set_num_threads(1)  # as the workers
    report = measure(args.case, args.chunk_steps, args.calls, args.capacity, int(args.max_gib * 2**30))
    report["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                         "load_average": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    from ingestd.service.tunables import exec_with_copy_tunable

    exec_with_copy_tunable()  # the copy mode `ingestd run` gives its workers, here and in the limits
    main()
