"""Benchmark the weight path: encode -> decode -> publish -> read, against raw lz4 and memcpy.

    python benchmarks/bench_weights.py [--params 1000000 25000000] [--repeat 5] [--dir /dev/shm]

Prints one JSON object. Times are milliseconds (median and best of ``repeat``);
the baselines run on the same raw bytes in the same process. The helpers
(``make_state_dict``, ``timed``, ``bench_wire``, ``bench_store``, ``bench_baselines``,
``run``) are importable, e.g. by a control-plane benchmark that adds the ZeroMQ hop.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import lz4.frame
import numpy as np
import torch

from ingestd.weights import WeightStore, decode, encode, manifest_of

DEFAULT_SIZES = (1_000_000, 25_000_000)


def make_state_dict(n_params: int, seed: int = 0, layers: int = 4) -> dict[str, torch.Tensor]:
    """An MLP-shaped float32 state dict with about ``n_params`` parameters.

    Values are small Gaussians, like trained weights: lz4 barely compresses them.
    """
    width = max(1, round(math.sqrt(n_params / layers)))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = torch.randn(width, width, generator=gen) * 0.02
        state[f"layers.{i}.bias"] = torch.randn(width, generator=gen) * 0.02
    return state


def timed(fn: Callable[[], Any], repeat: int = 5) -> tuple[dict[str, float], Any]:
    """Run ``fn`` once to warm up, then ``repeat`` times; return ms stats and the last result."""
    result = fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": round(statistics.median(times), 2), "best_ms": round(min(times), 2)}, result


def bench_wire(state: dict[str, torch.Tensor], repeat: int = 5) -> dict[str, Any]:
    """Encode and decode (with the manifest check and finiteness check) times."""
    manifest = manifest_of(state)
    enc, frames = timed(lambda: encode(state), repeat)
    dec, _ = timed(lambda: decode(frames, expected=manifest), repeat)
    return {"encode": enc, "decode": dec, "manifest_bytes": len(frames[0]),
            "compressed_bytes": len(frames[1]), "ratio": round(len(frames[1]) / manifest.total_bytes, 4)}


def bench_store(state: dict[str, torch.Tensor], directory: str | os.PathLike, repeat: int = 5) -> dict[str, Any]:
    """Publish (writer) and read / load_into (reader attached in the same process) times."""
    module = torch.nn.Module()
    for name, tensor in state.items():  # a module whose state dict matches ``state``
        module.register_buffer(name.replace(".", "_"), torch.empty_like(tensor))
    renamed = {name.replace(".", "_"): tensor for name, tensor in state.items()}
    path = Path(directory) / f"bench-weights-{os.getpid()}"
    try:
        with WeightStore.create(path, manifest_of(renamed)) as writer, WeightStore.attach(path) as reader:
            publish, _ = timed(lambda: writer.publish(renamed), repeat)
            read, _ = timed(reader.read, repeat)
            load, _ = timed(lambda: reader.load_into(module), repeat)
            poll, _ = timed(lambda: [reader.version for _ in range(1000)], repeat)
        return {"publish": publish, "read": read, "load_into": load,
                "version_poll_us": round(poll["median_ms"], 3), "file_bytes": path.stat().st_size}
    finally:
        path.unlink(missing_ok=True)


def bench_baselines(raw: np.ndarray, repeat: int = 5) -> dict[str, Any]:
    """One-shot lz4.frame compress/decompress (same settings as ``encode``) and memcpy of ``raw``."""
    options = {"block_size": lz4.frame.BLOCKSIZE_MAX4MB, "content_checksum": True}
    comp, packed = timed(lambda: lz4.frame.compress(raw, **options), repeat)
    decomp, _ = timed(lambda: lz4.frame.decompress(packed), repeat)
    comp_fast, packed_fast = timed(lambda: lz4.frame.compress(raw, block_size=options["block_size"]), repeat)
    decomp_fast, _ = timed(lambda: lz4.frame.decompress(packed_fast), repeat)
    target = np.empty_like(raw)
    copy, _ = timed(lambda: np.copyto(target, raw), repeat)
    alloc_copy, _ = timed(lambda: raw.copy(), repeat)
    return {"lz4_compress": comp, "lz4_decompress": decomp,
            "lz4_compress_no_checksum": comp_fast, "lz4_decompress_no_checksum": decomp_fast,
            "memcpy": copy, "alloc_and_memcpy": alloc_copy}


def run(sizes=DEFAULT_SIZES, repeat: int = 5, directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """All benchmarks for each size; the store lives in ``directory`` (default /dev/shm)."""
    directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    report = {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
              "lz4": lz4.version.version, "torch_threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "repeat": repeat, "store_dir": str(directory), "results": []}
    for n_params in sizes:
        state = make_state_dict(n_params)
        raw_bytes = sum(t.numel() * t.element_size() for t in state.values())
        raw = np.concatenate([t.numpy().reshape(-1).view(np.uint8) for t in state.values()])
        result = {"params": sum(t.numel() for t in state.values()), "raw_bytes": raw_bytes,
                  **bench_wire(state, repeat), **bench_store(state, directory, repeat),
                  "baseline": bench_baselines(raw, repeat)}
        steps = ("encode", "decode", "publish", "read")
        result["pipeline_ms"] = round(sum(result[s]["median_ms"] for s in steps), 2)
        result["pipeline_MBps"] = round(raw_bytes / 1e3 / result["pipeline_ms"], 1)
        report["results"].append(result)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the store file goes (default /dev/shm)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.params, args.repeat, args.dir), indent=2))


if __name__ == "__main__":
    main()
