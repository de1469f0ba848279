"""Sequence sampling: ``[batch, length]`` runs of consecutive steps of one trajectory.

A trajectory is one ``(worker, env)`` pair. A worker writes a chunk as
``[chunk_steps, num_envs]`` rows flattened step-major in one contiguous range of
write indices, so inside a chunk the next step of sub-env ``e`` is ``num_envs``
rows further; the chunk's last step continues at sub-env ``e`` of the worker's
next chunk, after whatever other workers wrote in between. The continuation of
a row is therefore *the first later row with the same worker and env stamps*.
The sampler finds it with one gathered check at the learned stride (the
smallest distance seen so far for that sequence, which is ``num_envs``) and a
scan of the stamps forward when that check fails (a chunk boundary), so it
needs no knowledge of the workers' settings.

Every candidate sequence is then copied with the usual seqlock check and
verified *on the copied rows*: each row's ``write_index`` stamp is the one the
search found (no slot was overwritten mid-sequence), worker and env are
constant, and each step follows the previous one (same episode and step + 1,
or, only with ``cross_episodes=True``, the previous row was ``done`` and this
is step 0 of the next episode). Sequences failing any check are drawn again.
Starts are drawn uniformly over the stored rows, so a sequence that cannot be
completed (too close to the newest row, or, without crossing, to its episode's
end) is re-drawn: short episodes are less likely to be sampled from, as in
TorchRL's slice sampling.
"""
from __future__ import annotations

import numpy as np
from tensordict import TensorDict

WORKER, ENV, EPISODE, STEP, WRITE_INDEX = (("ingestd", f) for f in ("worker", "env", "episode", "step",
                                                                    "write_index"))
DONE = ("next", "done")
_SCAN_BLOCKS = (256, 4096, 65536, 1 << 20)  # rows scanned forward for a continuation, growing
_MAX_ROUNDS = 64


class SequenceSampler:
    """Draws sequences for one reader (uses its private copy and assemble steps)."""

    def __init__(self, reader):
        self.reader = reader
        r = reader
        self._w, self._e = r._arrays[WORKER], r._arrays[ENV]
        self._wi = r._arrays[WRITE_INDEX]
        self._fields = {k: self._field_view(k) for k in (WORKER, ENV, EPISODE, STEP, WRITE_INDEX, DONE)}

    def _field_view(self, key):
        """``records -> [m, ...] view`` of one small leaf inside gathered records."""
        r = self.reader
        offset = r._layout.fields[key]
        array = r._arrays[key]
        rb = r._layout.record_bytes

        def view(records: np.ndarray) -> np.ndarray:
            return np.ndarray((records.size, *array.shape[1:]), array.dtype, records, offset,
                              (rb, *array.strides[1:]))
        return view

    def sample(self, batch: int, length: int, cross_episodes: bool = False) -> TensorDict | None:
        """``[batch, length]`` sequences, or None if none could be completed this time."""
        if batch <= 0 or length <= 0:
            raise ValueError(f"batch and length must be positive, got {batch}, {length}")
        r = self.reader
        done_records, done_columns = [], []
        need = batch
        for _ in range(_MAX_ROUNDS):
            filled = len(r)
            if filled == 0:
                return None
            got = self._round(min(2 * need + 8, 4 * batch), length, cross_episodes, filled)
            if got is not None:
                records, columns = got
                take = min(need, records.shape[0])
                done_records.append(records[:take].reshape(-1))
                done_columns.append([c[:take].reshape(-1, *c.shape[2:]) for c in columns])
                need -= take
            if need == 0:
                break
        else:
            return None
        records = np.concatenate(done_records)
        columns = [_cat([cols[i] for cols in done_columns]) for i in range(len(r._columns))]
        out = r._assemble(records, columns, batch * length)
        return out.reshape(batch, length)

    # -- one round: draw, follow, copy, verify ------------------------------------------------
    def _round(self, n: int, length: int, cross: bool, filled: int):
        r = self.reader
        wc = r.write_count
        oldest = wc - r.capacity
        starts = r._draw(n, filled)
        wi = np.full((n, length), -1, dtype=np.int64)
        wi[:, 0] = self._wi[starts]
        ok = (wi[:, 0] >= max(oldest, 0)) & (wi[:, 0] < wc) & (wi[:, 0] % r.capacity == starts)
        worker, env = self._w[starts], self._e[starts]
        stride = np.zeros(n, dtype=np.int64)  # 0: not learned yet
        for k in range(1, length):
            idx = np.flatnonzero(ok)
            if idx.size == 0:
                return None
            cur = wi[idx, k - 1]
            nxt = self._follow(cur, stride[idx], worker[idx], env[idx], wc)
            good = nxt >= 0
            ok[idx[~good]] = False
            idx, cur, nxt = idx[good], cur[good], nxt[good]
            wi[idx, k] = nxt
            dist = nxt - cur
            stride[idx] = np.where(stride[idx] > 0, np.minimum(stride[idx], dist), dist)
        idx = np.flatnonzero(ok)
        if idx.size == 0:
            return None
        wi = wi[idx]
        m = idx.size
        slots = (wi % r.capacity).reshape(-1)
        records, columns, bad = r._copy(slots)
        valid = self._verify(records, bad, wi, m, length, cross)
        if not valid.any():
            return None
        records = records.reshape(m, length)[valid]
        columns = [c.reshape(m, length, *c.shape[1:])[valid] for c in columns]
        return records, columns

    def _follow(self, cur: np.ndarray, stride: np.ndarray, worker: np.ndarray, env: np.ndarray,
                wc: int) -> np.ndarray:
        """Write index of the next row of each ``(worker, env)`` after ``cur``, or -1."""
        cap = self.reader.capacity
        cand = cur + np.where(stride > 0, stride, 1)
        inside = cand < wc
        slots = cand % cap
        hit = inside & (self._wi[slots] == cand) & (self._w[slots] == worker) & (self._e[slots] == env)
        out = np.where(hit, cand, -1)
        for i in np.flatnonzero(~hit):
            out[i] = self._scan(int(cur[i]), int(worker[i]), int(env[i]), wc)
        return out

    def _scan(self, cur: int, worker: int, env: int, wc: int) -> int:
        """The first write index after ``cur`` whose row has these worker and env stamps, or -1."""
        cap = self.reader.capacity
        lo = cur + 1
        for block in _SCAN_BLOCKS:
            hi = min(cur + 1 + block, wc, cur + cap)
            if lo >= hi:
                return -1
            for start, stop in _ring_ranges(lo, hi, cap):
                s0 = start % cap
                w = self._w[s0:s0 + stop - start]
                e = self._e[s0:s0 + stop - start]
                found = np.flatnonzero((w == worker) & (e == env))
                if found.size:
                    return start + int(found[0])
            lo = hi
        return -1

    def _verify(self, records: np.ndarray, bad, wi: np.ndarray, m: int, length: int, cross: bool) -> np.ndarray:
        """Per sequence: every row committed, unchanged, the row searched for, and a step of one
        trajectory following the previous one."""
        f = self._fields
        shape = (m, length)
        ok = np.ones(m, dtype=bool)
        if bad is not None:
            ok[np.unique(bad // length)] = False
        got_wi = f[WRITE_INDEX](records).reshape(shape)
        worker, env = f[WORKER](records).reshape(shape), f[ENV](records).reshape(shape)
        episode, step = f[EPISODE](records).reshape(shape), f[STEP](records).reshape(shape)
        done = f[DONE](records).reshape(m, length, -1).any(-1)
        ok &= (got_wi == wi).all(1)
        ok &= (worker == worker[:, :1]).all(1) & (env == env[:, :1]).all(1)
        same = (episode[:, 1:] == episode[:, :-1]) & (step[:, 1:] == step[:, :-1] + 1) & ~done[:, :-1]
        if cross:
            same |= done[:, :-1] & (episode[:, 1:] == episode[:, :-1] + 1) & (step[:, 1:] == 0)
        ok &= same.all(1)
        return ok


def _ring_ranges(lo: int, hi: int, cap: int) -> list[tuple[int, int]]:
    """Split write indices ``[lo, hi)`` where they wrap around the ring."""
    edge = (lo // cap + 1) * cap
    return [(lo, hi)] if hi <= edge else [(lo, edge), (edge, hi)]


def _cat(parts):
    import torch

    return torch.cat(parts) if parts else parts
