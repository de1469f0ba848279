"""The row layout shared by workers, storage and trainers (TorchRL's).

A row is one transition::

    observation, action, done, terminated, truncated
    ("next", observation | reward | done | terminated | truncated)
    ("ingestd", worker | env | episode | step | policy_version | write_index)

plus any extra keys an env produces. Keys are tuples of strings; on disk a
leaf is named by joining its key with ``.``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch

Key = tuple[str, ...]

STAMP_FIELDS = ("worker", "env", "episode", "step", "policy_version", "write_index")
STAMP_KEYS: tuple[Key, ...] = tuple(("ingestd", f) for f in STAMP_FIELDS)
WRITE_INDEX: Key = ("ingestd", "write_index")
POLICY_VERSION: Key = ("ingestd", "policy_version")
FLAG_FIELDS = ("done", "terminated", "truncated")
# episode ids: sub-env i of a worker incarnation numbers its episodes (incarnation << EPISODE_BITS)
# + i + k * num_envs, k = 0, 1, ...: unique over every sub-env, worker and restart of a storage,
# for 2**23 worker starts per storage and 2**40 episodes per incarnation (num_envs x episodes each)
EPISODE_BITS = 40

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored; use one of {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        raise ValueError("bfloat16 leaves are not supported by the memmap storage")
    return torch.empty((), dtype=dtype).numpy().dtype


def as_key(key: str | Iterable[str]) -> Key:
    k = (key,) if isinstance(key, str) else tuple(key)
    if not k or any((not p) or "." in p or "/" in p for p in k):
        raise ValueError(f"bad key {key!r}: parts must be non-empty and contain no '.' or '/'")
    return k


def leaf_name(key: Key) -> str:
    return ".".join(key)


@dataclass(frozen=True)
class Leaf:
    """One stored field: its per-row shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


Schema = Mapping[Key, Leaf]


def schema_to_json(schema: Schema) -> dict:
    return {leaf_name(k): {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in schema.items()}


def schema_from_json(obj: dict) -> dict[Key, Leaf]:
    out: dict[Key, Leaf] = {}
    for name, spec in obj.items():
        out[as_key(name.split("."))] = Leaf(tuple(int(s) for s in spec["shape"]), dtype_from_name(spec["dtype"]))
    return out


def with_stamps(schema: Schema) -> dict[Key, Leaf]:
    """The schema plus the int64 ingestd stamps (added when missing)."""
    out = dict(schema)
    for key in STAMP_KEYS:
        leaf = out.setdefault(key, Leaf((), torch.int64))
        if leaf != Leaf((), torch.int64):
            raise ValueError(f"stamp {key} must be a scalar int64, got {leaf}")
    return out
