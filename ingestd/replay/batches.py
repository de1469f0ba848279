"""How a reader puts its samples together: the nested TensorDict built from flat leaves by a
key plan made once, and the parts of a batch from ``ReplayReader.empty_batch`` that
``sample(out=...)`` copies into."""
from __future__ import annotations

import weakref
from typing import Callable

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase


def plan_nodes(order: list) -> list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]:
    """How to build the nested TensorDict from the flat leaves (in ``order``), deepest node
    first: for each node, its ``(name, leaf position)`` and ``(name, built node)`` entries."""
    prefixes = {k[:d] for k in order for d in range(len(k))}
    nodes = sorted(prefixes, key=lambda p: (-len(p), p))
    number = {p: i for i, p in enumerate(nodes)}
    plan = []
    for prefix in nodes:
        leaves = [(k[-1], i) for i, k in enumerate(order) if k[:-1] == prefix]
        children = [(p[-1], number[p]) for p in nodes if len(p) == len(prefix) + 1 and p[:-1] == prefix]
        plan.append((leaves, children))
    return plan


class Out:
    """The parts of a batch from ``empty_batch``: a weak reference to it, its blocks of small
    leaves (``(leaves, n, *shape)`` tensors) and its columns, and a test that its nodes and
    leaves are still the ones made."""

    __slots__ = ("batch", "blocks", "columns", "unchanged", "_arrays", "_addresses")

    def __init__(self, batch: TensorDict, blocks: list[torch.Tensor], columns: list[torch.Tensor]):
        self.batch, self.blocks, self.columns = weakref.ref(batch), blocks, columns
        self.unchanged = _unchanged(batch)
        self._addresses: list[int] = []
        self._arrays: list[np.ndarray] = []

    def arrays(self) -> list[np.ndarray]:
        """The blocks as numpy arrays of their memory as it is now (``share_memory_`` moves it in
        place); made again only then, as ``Tensor.numpy`` costs a microsecond each."""
        addresses = [block.data_ptr() for block in self.blocks]
        if addresses != self._addresses:
            self._arrays, self._addresses = [block.numpy() for block in self.blocks], addresses
        return self._arrays


def _unchanged(batch: TensorDict) -> Callable[[], bool]:
    """A test that every node and leaf of ``batch`` is still the object it is now (keys added
    since do not matter): a dict lookup per entry through tensordict's own mapping when it is a
    dict (~0.6 us for CartPole rows), else the public ``get`` of every entry (~10 us)."""
    entries: list[tuple] = []  # (mapping or None, node, name, value)

    def walk(node) -> None:
        mapping = getattr(node, "_tensordict", None)
        for name in list(node.keys()):
            value = node.get(name)
            entries.append((mapping if isinstance(mapping, dict) else None, node, name, value))
            if isinstance(value, TensorDictBase):
                walk(value)
    walk(batch)
    if all(mapping is not None for mapping, *_ in entries):
        fast = [(mapping, name, value) for mapping, _, name, value in entries]
        return lambda: all(mapping.get(name) is value for mapping, name, value in fast)
    return lambda: all(node.get(name, None) is value for _, node, name, value in entries)


def td_factory() -> Callable[[dict, torch.Size], TensorDict]:
    """TensorDict's unchecked constructor when this tensordict has it, else the public one.

    Safe here: every leaf is a CPU tensor with leading dimension ``n`` and every child was
    built with the same batch size."""
    def public(node: dict, batch: torch.Size) -> TensorDict:
        return TensorDict(node, batch_size=batch)

    def fast(node: dict, batch: torch.Size) -> TensorDict:
        return TensorDict._new_unsafe(source=node, batch_size=batch, nested=False)

    try:
        probe = fast({"a": torch.zeros(2), "b": fast({"c": torch.ones(2, 1)}, torch.Size([2]))}, torch.Size([2]))
        if (probe.batch_size == torch.Size([2]) and probe["b", "c"].shape == (2, 1)
                and set(probe.keys(True, True)) == {"a", ("b", "c")}):
            return fast
    except Exception:  # noqa: BLE001 - a tensordict without the private fast path
        pass
    return public
