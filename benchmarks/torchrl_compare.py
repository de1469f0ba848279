"""TorchRL's samplers on the same rows, for ``bench_sampling.py`` (benchmark-only; torchrl is
never needed by ingestd).

The rows are copied out of the ingestd storage into a ``LazyTensorStorage`` of the same
capacity, ordered by trajectory so that ``SliceSampler`` (``traj_key``) sees each one as a
contiguous run, as a TorchRL collector with ``split_trajs`` would give it. TorchRL's buffer
lives in this process and nothing writes to it meanwhile, which favours TorchRL: ingestd's
figures are taken while 2 writer processes write.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ingestd.replay import ReplayReader


def trajectory_rows(path: str):
    """Every committed row of the storage, sorted by (trajectory, step), with an int64 ``traj`` id."""
    with ReplayReader(path) as reader:
        seq = np.array(reader.seq)
        rows = reader.gather(np.flatnonzero((seq > 0) & (seq % 2 == 0)))
    stamps = torch.stack([rows["ingestd", f] for f in ("worker", "env", "episode")], 1)
    _, traj = torch.unique(stamps, dim=0, return_inverse=True)
    order = np.lexsort((rows["ingestd", "step"].numpy(), traj.numpy()))
    rows = rows[torch.from_numpy(order)]
    rows["traj"] = traj[torch.from_numpy(order)]
    return rows


def measure(path: str, capacity: int, seconds: float, rate) -> dict:
    """Calls/s (wall, per CPU-s) of TorchRL's random, prioritized and slice sampling and of
    ``update_priority``, through ``rate(fn, seconds)``."""
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, RandomSampler, SliceSampler, TensorDictReplayBuffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # it logs to stdout, where our JSON goes

    rows = trajectory_rows(path)
    out: dict = {"torchrl_rows": rows.batch_size[0]}

    def buffer(sampler):
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler)
        rb.extend(rows)
        return rb

    def record(name: str, fn, digits: int = 1) -> None:
        wall, cpu = rate(fn, seconds)
        out[f"torchrl_{name}_per_s"], out[f"torchrl_{name}_per_cpu_s"] = round(wall, digits), round(cpu, digits)

    samplers = {"uniform": RandomSampler, "prioritized": lambda: PrioritizedSampler(capacity, alpha=0.6, beta=0.4),
                "slices": lambda: SliceSampler(slice_len=16, traj_key="traj", strict_length=True)}
    buffers = {}
    for name, make in samplers.items():
        try:
            buffers[name] = buffer(make())
        except Exception as exc:  # noqa: BLE001 - e.g. the C++ sum tree missing from this torchrl build
            out[f"torchrl_{name}"] = f"unavailable: {type(exc).__name__}: {exc}"
    for b in (256, 4096):
        for name in buffers:
            size, label = (b * 16, f"slices_{b}x16") if name == "slices" else (b, f"{name}_sample_{b}")
            record(label, lambda rb=buffers[name], size=size: rb.sample(size), 2 if name == "slices" else 1)
    if "prioritized" in buffers:
        index = buffers["prioritized"].sample(256)["index"]
        priority = torch.from_numpy(np.random.default_rng(0).uniform(0.1, 2.0, 256))
        record("update_priority_256", lambda: buffers["prioritized"].update_priority(index, priority))
    return out
