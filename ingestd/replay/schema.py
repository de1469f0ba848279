"""A storage's schema: made from an example batch or a ``{key: (shape, dtype)}`` spec, and
compared with what a storage holds (``ReplayStorage.open`` refuses a mismatch, naming it)."""
from __future__ import annotations

from typing import Mapping

import torch
from tensordict import TensorDictBase

from ingestd.replay.layout import Key, Leaf, as_key, dtype_from_name, with_stamps


def schema_of(example_or_spec: TensorDictBase | Mapping) -> dict[Key, Leaf]:
    """A schema from an example TensorDict (one row, or a batch of rows) or from a
    ``{key: (shape, dtype)}`` mapping. The ingestd stamps are always added."""
    schema: dict[Key, Leaf] = {}
    if isinstance(example_or_spec, TensorDictBase):
        skip = 1 if example_or_spec.batch_dims else 0
        for key, value in example_or_spec.items(include_nested=True, leaves_only=True):
            schema[as_key(key)] = Leaf(tuple(value.shape[skip:]), value.dtype)
    else:
        for key, spec in example_or_spec.items():
            if isinstance(spec, Leaf):
                schema[as_key(key)] = spec
                continue
            shape, dtype = spec
            dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
            schema[as_key(key)] = Leaf(tuple(int(s) for s in shape), dtype)
    return with_stamps(schema)


def describe_diff(have: Mapping[Key, Leaf], want: Mapping[Key, Leaf]) -> str:
    parts = []
    if missing := sorted(set(want) - set(have)):
        parts.append(f"keys not stored {missing}")
    if extra := sorted(set(have) - set(want)):
        parts.append(f"stored keys not produced {extra}")
    for key in sorted(set(have) & set(want)):
        if have[key] != want[key]:
            parts.append(f"{key}: stored {have[key].shape} {have[key].dtype}, "
                         f"produced {want[key].shape} {want[key].dtype}")
    return "; ".join(parts)


def flat_leaves(td: TensorDictBase) -> dict[Key, torch.Tensor]:
    """``{key tuple: tensor}`` for every leaf of ``td``."""
    return {k if type(k) is tuple else (k,): v for k, v in td.items(include_nested=True, leaves_only=True)}
