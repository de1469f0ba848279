"""Rolling a batched env forward: stamps, episode bookkeeping, chunk assembly.

A chunk is ``chunk_steps`` transitions of every sub-env, flattened to rows
``[chunk_steps * num_envs]`` in TorchRL layout with the ingestd stamps set
(``write_index`` is filled by the storage).

The hot path is built to add as little as possible to the env and policy:

- the stamps live in one ``[chunk_steps, num_envs, 5]`` int64 buffer made once
  (its fields in the storage record's order, so they are packed as one item)
  and are filled once per chunk, after it: ``worker`` and ``env`` never
  change, ``policy_version`` is one fill, and ``episode``/``step`` follow from
  the chunk's ``[T, B]`` done flags with a cumulative sum and a cumulative max
  (a handful of torch and numpy ops per chunk). Nothing is done per step: three small
  torch ops per step to advance them cost ~30 us between the env's and the
  policy's ops (a tenth of a 256-env CartPole step), several times their cost
  alone. The env and the policy do not see the stamps (``Env``'s contract);
  they are set on the rows;
- the transitions' leaves are not stacked as TensorDicts: each small leaf
  is stacked once per chunk straight into its own ``[chunk_steps, num_envs,
  ...]`` buffer, and each large one (image batches) is copied into its buffer
  right after the step, while in cache, so the env's allocator gets the
  memory back at once; the buffers are reused across chunks (no allocation
  per chunk) and the rows are views of them. A large leaf's buffer is made
  only when a chunk cannot be copied into the storage's slots (``into``);
- the episode accounting (returns, lengths, finished episodes) is done once
  per chunk, in numpy, on the ``[chunk_steps, num_envs]`` rewards and flags,
  with the same float64 left-to-right sums as a step-by-step accumulation.

The rows returned by :meth:`Rollout.chunk` share memory with those buffers:
they are valid until the next ``chunk()`` call (the worker writes them to the
storage, which copies them, before rolling the next chunk). ``chunk(into=...)``
copies the large leaves straight into given ``[T * B, ...]`` tensors instead
(the storage's reserved slots: ``ReplayStorage.reserved``), which saves the
storage copying them again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from ingestd.collect.checks import RowChecks, check_action, check_rows, scanned
from ingestd.collect.interfaces import Env, Policy
from ingestd.errors import EnvFault, blame

_STAMPS = ("worker", "env", "episode", "step", "policy_version")
_STAMP_KEYS = frozenset(("ingestd", f) for f in _STAMPS)
_DONE = ("next", "done")
_REWARD = ("next", "reward")
# a leaf at least this large per step (an image batch) is copied into its buffer right after
# the step, while still in cache, and released so the env's allocator reuses the memory
_EAGER_BYTES = 64 << 10
# dtypes numpy copies (not bfloat16, for one): large leaves of these are copied with numpy's copy
_NUMPY_DTYPES = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
                           torch.float16, torch.float32, torch.float64))
_FRESH_CHUNKS = 2  # an env reusing its buffers does so from its first steps: checking these is enough


@dataclass
class Finished:
    """Episodes that ended during a chunk."""

    returns: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


class Rollout:
    """Steps one batched env with one policy and stamps every transition."""

    def __init__(self, env: Env, policy: Policy, worker: int, episode_base: int, chunk_steps: int,
                 beat: Callable[[], None] = lambda: None, checks: RowChecks | None = None,
                 inference_mode: bool = True):
        """``beat`` is called after every step (the worker's heartbeat: a chunk may take longer
        than the heartbeat timeout, a step may not). ``checks``: what every chunk must satisfy
        to be stored (``ingestd.collect.checks``; the defaults from the env's spec if None).
        ``inference_mode``: the steps run under ``torch.inference_mode()``, else ``torch.no_grad()``
        (``no_autograd``)."""
        n, t = env.num_envs, chunk_steps
        self.env, self.policy, self.chunk_steps, self._beat = env, policy, chunk_steps, beat
        self.inference_mode = inference_mode
        self.checks = checks if checks is not None else RowChecks.of(env.spec) if hasattr(env, "spec") else RowChecks()
        self._n = n
        # carried from chunk to chunk: the state of the step about to be taken
        # sub-env i's episodes are episode_base + i, then + num_envs per finished episode: unique ids
        self._episode = episode_base + np.arange(n, dtype=np.int64)
        self._step = np.zeros(n, dtype=np.int64)
        self._return = np.zeros(n, dtype=np.float64)
        with torch.inference_mode(False):  # plain buffers (the rows view them), in whatever mode we are built
            # the stamps of a whole chunk: one [T, B, 5] int64 buffer, its fields in the storage record's
            # order (sorted names), so the storage packs all five as one item (ingestd.replay.packing)
            names = sorted(_STAMPS)
            stamps = torch.empty((t, n, len(names)), dtype=torch.int64)
            self._stamps = dict(zip(names, stamps.unbind(-1)))
            self._stamps["worker"].fill_(worker)
            self._stamps["env"].copy_(torch.arange(n, dtype=torch.int64).expand(t, n))
            self._step_np, self._episode_np = self._stamps["step"].numpy(), self._stamps["episode"].numpy()
            # (_stamp_chunk) scratch: the dones before each step, where episodes begin and the scan of that
            # (its indices unused), all [T, B] int64 (the first [T - 1, B])
            self._dones_before = torch.empty((t - 1, n), dtype=torch.int64)
            self._starts_t, self._began, self._began_at = (torch.empty((t, n), dtype=torch.int64) for _ in range(3))
            self._starts = self._starts_t.numpy()
            self._t_col_t = torch.arange(t, dtype=torch.int64)[:, None]
            self._t_col = self._t_col_t.numpy()
            # the episode accounting's [T, B] done flags and returns; numpy views for the accounting itself
            self._done_buffer: torch.Tensor | None = None  # the ("next", "done") buffer self._done views
            self._done = np.zeros((t, n), dtype=bool)  # (_done_flags) each step's done, per chunk
            self._returns_t = torch.empty((t, n), dtype=torch.float64)
            self._returns = self._returns_t.numpy()
        self._leaves: dict = {}  # key (as items() gives it) -> the [T, B, ...] buffer of a non-stamp leaf
        # (a large leaf's buffer is made only for a chunk that cannot go into given slots: None until then)
        self._specs: dict = {}  # key -> (per-step shape, dtype, device) of every non-stamp leaf
        self._eager: list = []  # keys of large leaves, copied step by step
        self._lazy: list[tuple] = []  # (key, buffer) of small leaves, stacked once per chunk
        self._floats: list[tuple] = []  # keys of the float leaves scanned for NaN (checks.scanned)
        self._width = 0  # leaves per transition
        self._rows: TensorDictBase | None = None  # [T * B] views of all the buffers, in the rows' key order
        self._fresh_checks = _FRESH_CHUNKS  # chunks whose steps are checked for reused env buffers
        try:
            self._root = env.reset()
        except Exception as exc:
            blame(exc, "workers.env")
            raise

    @property
    def root(self) -> TensorDictBase:
        """The root the next step acts on (the env's reset, at first)."""
        return self._root

    @property
    def rows_per_chunk(self) -> int:
        return self.chunk_steps * self._n

    def chunk(self, policy_version: int, into: Mapping[tuple, torch.Tensor] | None = None
              ) -> tuple[TensorDict, Finished]:
        """Roll ``chunk_steps`` steps; returns the rows and the finished episodes.

        The rows are views of buffers the next ``chunk()`` overwrites (plain tensors, never
        inference tensors). ``into`` maps keys (tuples) of large leaves to ``[chunk_steps *
        num_envs, ...]`` tensors: a leaf whose shape and dtype fit is copied there step by step,
        and its rows are that tensor."""
        with no_autograd(self.inference_mode):  # a policy module builds no autograd graph
            return self._chunk(policy_version, into)

    def _chunk(self, policy_version: int, into: Mapping[tuple, torch.Tensor] | None) -> tuple[TensorDict, Finished]:
        steps = self.chunk_steps
        self._stamps["policy_version"].fill_(policy_version)
        per_step: list[dict] = []
        returned: dict = {}  # (checked chunks) small leaf key -> {data_ptr: its values when first returned}
        policy, env, root, beat = self.policy, self.env, self._root, self._beat
        for t in range(steps):
            try:
                acted = policy(root)
            except Exception as exc:  # (free unless raised) the worker's message names the part
                blame(exc, "workers.policy")
                raise
            before = _snapshot(acted) if self._fresh_checks else None
            try:
                transition, root = env.step_and_maybe_reset(acted)
            except Exception as exc:  # an action the env could not take explains it
                check_action(acted, self.checks)
                blame(exc, "workers.env")
                raise
            beat()
            leaves = _leaves_of(transition)
            if t == 0:
                if not self._buffers_fit(leaves):
                    self._allocate(leaves)
                eager = self._eager_targets(into)
            if len(leaves) != self._width:
                raise EnvFault(self._keys_changed(leaves, t))
            if before is not None:
                _check_fresh(leaves, before)
                _check_reused(leaves, self._lazy, returned)
            _copy_eager(eager, leaves, t)
            per_step.append(leaves)
        self._root = root
        self._fresh_checks = max(0, self._fresh_checks - 1)
        return self._rows_of(per_step, eager)

    def _rows_of(self, per_step: list[dict], eager: list[tuple]) -> tuple[TensorDict, Finished]:
        """The chunk's rows from its steps' leaves (the small ones stacked into their buffers,
        the large ones already copied), checked, and the episodes that ended in it."""
        for key, buf in self._lazy:  # small leaves: one stack per leaf and chunk
            parts = [_pick(leaves, key) for leaves in per_step]
            dtype = buf.dtype
            if any(getattr(part, "dtype", None) != dtype for part in parts):  # stack(out=) would cast (fuzz)
                raise EnvFault(_changed(key, buf, parts))
            try:
                torch.stack(parts, out=buf)
            except (RuntimeError, TypeError):  # torch's message does not name the key
                raise EnvFault(_changed(key, buf, parts)) from None
        # the chunk's [T, B, ...] values of each leaf: its buffer, or for a large one its rows this chunk
        chunk = {**self._leaves, **{key: dest.view(self.chunk_steps, *self._specs[key][0]) for key, _, dest in eager}}
        self._done_flags(chunk.get(_DONE))
        self._stamp_chunk()
        rows = self._rows.clone(recurse=False)  # a fresh shell: a caller's edits do not stick
        for key, _, dest in eager:
            rows.set(key, dest)
        finished = self._account(chunk.get(_REWARD))
        check_rows(rows, self.checks, [(k, rows.get(k)) for k in self._floats])
        return rows, finished

    # -- stamping ---------------------------------------------------------------------------
    def _done_flags(self, buf: torch.Tensor | None) -> None:
        """``self._done`` (numpy bool ``[T, B]``): whether each step ended its sub-env's episode,
        from the chunk's ``[T, B, ...]`` ``("next", "done")`` values ``buf``: those themselves in
        TorchRL's layout (bool ``[B, 1]`` on the CPU), else any of a sub-env's entries."""
        if buf is None:
            raise EnvFault("the env's transitions have no ('next', 'done') entry")
        t, n = self.chunk_steps, self._n
        if buf.dtype == torch.bool and buf.shape[1:] == (n, 1) and buf.is_cpu:
            if self._done_buffer is not buf:  # new buffers (the first chunk, or changed leaves)
                self._done_buffer, self._done = buf, buf.view(t, n).numpy()
            return
        flags = buf.reshape(t, n, -1).any(-1)  # any() of uint8 is uint8
        self._done = flags.to(device="cpu", dtype=torch.bool).numpy()

    def _stamp_chunk(self) -> None:
        """The chunk's ``episode`` and ``step`` stamps, from its done flags and the state carried
        in: sub-env i's episode goes up by ``num_envs`` after each done, and its step counts from
        the step its episode began (for the episode running into the chunk: ``-carried step``)."""
        done, starts, n = self._done, self._starts, self._n
        episode, carried = self._stamps["episode"], torch.from_numpy(self._episode)
        episode[0] = carried
        # (the scans along T are torch's: numpy's along axis 0 take 3-5x as long)
        torch.cumsum(torch.from_numpy(done[:-1]), 0, out=self._dones_before)
        torch.add(carried, self._dones_before, alpha=n, out=episode[1:])
        starts[0] = -self._step
        starts[1:] = np.iinfo(np.int64).min
        np.copyto(starts[1:], self._t_col[1:], where=done[:-1])  # an episode begins after a done
        torch.cummax(self._starts_t, 0, out=(self._began, self._began_at))
        torch.sub(self._t_col_t, self._began, out=self._stamps["step"])

    # -- rows --------------------------------------------------------------------------------
    def _buffers_fit(self, first: dict) -> bool:
        """Whether the buffers made for earlier chunks fit this chunk's first transition."""
        if self._rows is None or len(first) != self._width:
            return False
        if sum(1 for key in first if _as_tuple(key) not in _STAMP_KEYS) != len(self._specs):
            return False  # as many leaves, but one of them new (one named like a stamp gone)
        for key, (shape, dtype, device) in self._specs.items():
            leaf = first.get(key)
            if leaf is None or leaf.shape != shape or leaf.dtype != dtype or leaf.device != device:
                return False
        return True

    def _allocate(self, first: dict) -> None:
        """One [T, B, ...] buffer per small leaf of ``first``, and the [T * B] rows viewing them
        (a large leaf's rows are set per chunk: ``_eager_targets``)."""
        steps, n = self.chunk_steps, self._n
        total = steps * n
        self._leaves, self._specs, self._eager, self._lazy, self._floats = {}, {}, [], [], []
        rows = TensorDict({}, batch_size=[total])
        for key, leaf in first.items():  # the first transition's key order, like a stack of them
            key = _as_tuple(key)
            if key in _STAMP_KEYS:  # an env's own leaf of a stamp's name: the stamp wins
                continue
            name = key if len(key) > 1 else key[0]
            self._specs[name] = (leaf.shape, leaf.dtype, leaf.device)
            if scanned(name, leaf):  # a float leaf checks.check_rows scans for NaN
                self._floats.append(key)
            if leaf.numel() * leaf.element_size() >= _EAGER_BYTES:  # its rows: slots, or a buffer made then
                self._leaves[name] = None
                self._eager.append(name)
                continue
            buf = _plain_empty((steps, *leaf.shape), leaf.dtype, leaf.device)
            self._leaves[name] = buf
            self._lazy.append((name, buf))
            rows.set(key, buf.view(total, *leaf.shape[1:]))
        for name in _STAMPS:
            rows.set(("ingestd", name), self._stamps[name].view(total))
        self._rows, self._width = rows, len(first)

    def _keys_changed(self, leaves: dict, t: int) -> str:
        """Which keys a step's transition gained or lost against the chunk's first one."""
        now = {_as_tuple(k) for k in leaves} - _STAMP_KEYS
        first = {_as_tuple(k) for k in self._specs}
        return (f"the env's transitions changed their keys at step {t} of a chunk: new {sorted(now - first)}, "
                f"missing {sorted(first - now)}; every step must produce the same keys (a key the env sets "
                "only sometimes: set it on every step)")

    def _eager_targets(self, into: Mapping[tuple, torch.Tensor] | None) -> list[tuple]:
        """``(key, per-step rows to copy into, the chunk's rows)`` of each large leaf: the tensor
        ``into`` gives for it if its shape, dtype and device fit, else the leaf's own buffer
        (made the first time a chunk needs it: with the storage's slots, a chunk whose slots
        wrap around the ring; a 64 x 64 Pixels chunk's two image buffers are 231 MB)."""
        steps, n = self.chunk_steps, self._n
        out = []
        for name in self._eager:
            shape, dtype, device = self._specs[name]
            dest = into.get(_as_tuple(name)) if into else None
            if (dest is None or dest.dtype != dtype or dest.device != device
                    or dest.shape != (steps * shape[0], *shape[1:]) or not dest.is_contiguous()):
                buf = self._leaves[name]
                if buf is None:
                    buf = self._leaves[name] = _plain_empty((steps, *shape), dtype, device)
                dest = buf.view(steps * n, *shape[1:])
            out.append((name, dest.view(steps, *shape).unbind(0), dest))
        return out

    # -- episode accounting --------------------------------------------------------------------
    def _account(self, reward: torch.Tensor | None) -> Finished:
        """Returns and lengths of the episodes that ended, and the state carried to the next chunk.

        Each return is the float64 sum of the episode's rewards added in step order, from
        0 (or from the return carried in from the previous chunk), exactly as a per-step
        ``ret = ret + reward`` would give."""
        done, step, ret = self._done, self._step_np, self._returns
        _rewards_into(self._returns_t, reward)  # where an episode begins: its first reward
        np.add(ret, 0.0, out=ret)  # (as from 0.0: an episode of -0.0 rewards returns 0.0 + -0.0 = 0.0)
        np.add(self._return, ret[0], out=ret[0])
        keep = np.logical_not(done)
        for t in range(1, self.chunk_steps):  # ret[t] = ret[t-1] + reward[t] where the episode goes on
            np.add(ret[t - 1], ret[t], out=ret[t], where=keep[t - 1])
        finished = Finished()
        ended = np.flatnonzero(done)  # once for both lists: a boolean index would search twice
        if ended.size:
            finished.returns = ret.take(ended).tolist()
            finished.lengths = (step.take(ended) + 1).tolist()
        last = done[-1]
        self._return = np.where(last, 0.0, ret[-1])
        self._step = np.where(last, 0, step[-1] + 1)
        self._episode = self._episode_np[-1] + last * self._n
        return finished


def no_autograd(inference: bool = True):
    """How a worker runs its env and policy (``workers.inference_mode``): under
    ``torch.inference_mode()`` (no autograd graph, and no version counters or view tracking
    either: a 256-env CartPole step with the MLP takes ~9 % less time than under ``no_grad``
    here), else under ``torch.no_grad()`` (for a policy that turns autograd on inside a step,
    as a gradient-based planner does: inference tensors cannot be saved for backward)."""
    return torch.inference_mode() if inference else torch.no_grad()


def _plain_empty(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A buffer of the rows: a plain tensor even under inference mode, so what a caller does
    with the rows outside it (an in-place edit) works as on any tensor."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device=device)


def _as_tuple(key) -> tuple:
    """A key as ``items()`` gives it (a string at the root) as a tuple."""
    return key if isinstance(key, tuple) else (key,)


def _snapshot(root: TensorDictBase) -> dict:
    """Copies of the root's leaves as the env is handed them (its stamps and action aside)."""
    return {key: leaf.clone() for key, leaf in _leaves_of(root).items()
            if key != "action" and key not in _STAMP_KEYS and isinstance(leaf, torch.Tensor)}


def _check_fresh(leaves: dict, before: dict) -> None:
    """Refuse a step that wrote into a tensor the env had handed out before: a root leaf it
    stepped from (the one the row stores as the step's ``observation``, say) whose values
    changed during the step (``before``: copies taken when the env was handed the root). The
    rows would hold the new values: with the buffer also returned as the next leaf, observation
    == next observation in every row, without an error (pixel-DQN review: a frame stack rolled
    in its own buffer); with a copy returned as the next leaf, the same for large leaves, and
    for small ones with one step a chunk (rollout fuzz). A tensor handed out again unchanged
    (a constant goal, a cached flag) is fine."""
    for key, old in before.items():
        root = leaves.get(key)
        if not (isinstance(root, torch.Tensor) and root.numel() and _changed_values(root, old)):
            continue
        nxt = ("next", *_as_tuple(key))
        after = leaves.get(nxt)
        if isinstance(after, torch.Tensor) and after.data_ptr() == root.data_ptr() and after.shape == root.shape:
            raise EnvFault(f"the env wrote step values into the tensor it had returned for {key!r} and returned it "
                           f"again as {nxt!r}: the stored rows would hold the new values for both (e.g. a frame "
                           "stack rolled in place); return a fresh tensor every step (torch.roll, or .clone() of "
                           "the buffer)")
        raise EnvFault(f"the env wrote into the tensor it had returned for {key!r} while stepping from it: the "
                       f"stored rows would hold the new values as {key!r} (e.g. a frame stack rolled in place "
                       "and handed out as the observation); return a fresh tensor every step (torch.roll, or "
                       ".clone() of the buffer)")


def _check_reused(leaves: dict, lazy: list[tuple], returned: dict) -> None:
    """Refuse a small leaf whose memory the env returned at an earlier step of the chunk, with
    other values now: the rows keep every step's small leaves until the chunk is stacked, so all
    would show the last values (a reward buffer reused, two buffers alternated). The same tensor
    handed out again unchanged (a constant) is fine. Large leaves are copied and released after
    each step, so the env's allocator may lawfully hand their memory out again."""
    for key, _ in lazy:  # (the stamps are the rollout's own buffers, never among them)
        leaf = leaves.get(key)
        if not isinstance(leaf, torch.Tensor) or not leaf.numel():
            continue
        seen = returned.setdefault(key, {})
        first = seen.get(leaf.data_ptr())
        if first is None:
            seen[leaf.data_ptr()] = leaf.clone()
        elif first.shape == leaf.shape and _changed_values(leaf, first):
            who = ("the policy", "workers.policy") if key == "action" else ("the env", "workers.env")
            raise EnvFault(f"{who[0]} returned the same tensor memory for {key!r} at two steps of a chunk, with new "
                           "values written into it: the stored rows would all hold the last values; return a fresh "
                           "tensor every step (.clone() of a buffer it keeps)", who[1])


def _changed_values(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Whether ``now``'s memory holds other bytes than the copy ``before`` (so a NaN, real or
    complex, equals itself; a tensor moved to another device is not the memory that was copied)."""
    if now.device != before.device or now.dtype != before.dtype:
        return False
    return now.shape != before.shape or not torch.equal(_bytes(now), _bytes(before))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def _rewards_into(out: torch.Tensor, reward: torch.Tensor | None) -> None:
    """``out`` (float64 ``[T, B]``) = the reward of each step and sub-env (summed over a reward's extra dims)."""
    if reward is None:  # check_rows refuses it with the message
        out.zero_()
    elif reward.numel() == out.numel():
        out.copy_(reward.detach().view(out.shape))  # copy_ casts to float64: exact, one op
    else:
        out.copy_(reward.detach().reshape(*out.shape, -1).sum(-1, dtype=torch.float64))  # not float16's inf


def _copy_eager(eager: list[tuple], leaves: dict, t: int) -> None:
    """Copy the step's large leaves while hot, and drop them for the env's allocator to reuse."""
    for key, rows, _ in eager:
        leaf = _pop(leaves, key)
        if leaf.shape != rows[t].shape or leaf.dtype != rows[t].dtype:  # copy_ would broadcast/cast
            raise EnvFault(f"the env's transitions changed {key} within a chunk: {tuple(rows[t].shape)} "
                           f"{rows[t].dtype}, then {tuple(leaf.shape)} {leaf.dtype}; every step must produce the "
                           "same shapes and dtypes")
        copy_into(rows[t], leaf)


def copy_into(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest[...] = source`` of the same shape and dtype: numpy's copy where numpy can (CPU
    tensors of its dtypes, no grad), ~5 % faster than torch's ``copy_`` for image batches here."""
    if source.dtype in _NUMPY_DTYPES and source.is_cpu and dest.is_cpu and not source.requires_grad:
        np.copyto(dest.numpy(), source.numpy())
    else:
        dest.copy_(source)


def _leaves_of(td: TensorDictBase) -> dict:
    """``dict(td.items(include_nested=True, leaves_only=True))``, read straight from the
    entries of plain TensorDicts holding plain tensors (a tenth of the cost); anything
    else (other td types, non-tensor data, another tensordict release) the public way."""
    out: dict = {}
    if type(td) is TensorDict and _walk(td, (), out):
        return out
    return dict(td.items(include_nested=True, leaves_only=True))


def _walk(td: TensorDict, prefix: tuple, out: dict) -> bool:
    entries = getattr(td, "_tensordict", None)
    if type(entries) is not dict:
        return False
    for key, value in entries.items():
        if type(value) is torch.Tensor:
            out[prefix + (key,) if prefix else key] = value
        elif type(value) is not TensorDict or not _walk(value, prefix + (key,), out):
            return False
    return True


def _pop(leaves: dict, key) -> torch.Tensor:
    try:
        return leaves.pop(key)
    except KeyError:
        raise EnvFault(f"the env's transitions do not all have the key {key}; every step must "
                       "produce the same keys") from None


def _changed(key, buf: torch.Tensor, parts: list) -> str:
    """Why the steps of a small leaf could not be stacked into its [T, B, ...] buffer."""
    def kind(part) -> tuple:
        if isinstance(part, torch.Tensor):
            return tuple(part.shape), part.dtype
        return "a", type(part).__name__  # not a tensor at all

    want = (tuple(buf.shape[1:]), buf.dtype)
    got = next((kind(p) for p in parts if kind(p) != want), want)
    return (f"the env's transitions changed {key} within a chunk: {want[0]} {want[1]}, then {got[0]} {got[1]}; "
            "every step must produce the same shapes and dtypes")


def _pick(leaves: dict, key) -> torch.Tensor:
    try:
        return leaves[key]
    except KeyError:
        raise EnvFault(f"the env's transitions do not all have the key {key}; every step must "
                       "produce the same keys") from None
