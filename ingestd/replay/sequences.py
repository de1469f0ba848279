"""Sequence sampling: ``[batch, length]`` runs of consecutive steps of one trajectory.

A trajectory is one ``(worker, env)`` pair. A worker writes a chunk as
``[chunk_steps, num_envs]`` rows flattened step-major in one contiguous range of
write indices, so inside a chunk the next step of sub-env ``e`` is ``num_envs``
rows further; the chunk's last step continues at sub-env ``e`` of the worker's
next chunk, after whatever other workers wrote in between. The continuation of
a row is therefore *the first later row with the same worker and env stamps*.

To find it without scanning, the sampler keeps a table of *runs* (maximal ranges
of rows written by one worker, i.e. one or more whole chunks): where each run
starts, its width (``num_envs``: the largest env stamp + 1) and the next run of
the same worker. Each call brings the table up to date by reading only the rows
committed since the previous call. The next row of a row is then ``width`` rows
further inside its run, else at the same place within a step of the worker's
next run: one vectorised computation for the whole batch. A proposed row is used
only if its slot holds that write index with the same worker and env stamps;
otherwise (rows written in another layout, overwritten, or past the table) the
stamps are scanned forward, so correctness needs no knowledge of the workers'
settings.

Every candidate sequence is then copied with the usual seqlock check and
verified *on the copied rows*: each row's ``write_index`` stamp is the one the
search found (no slot was overwritten mid-sequence), worker and env are
constant, and each step follows the previous one (same episode and step + 1,
or, only with ``cross_episodes=True``, the previous row was ``done`` and this
is step 0 of a later episode of the same worker incarnation). Sequences failing any check are drawn again.
Starts are drawn uniformly over the stored rows, so a sequence that cannot be
completed (too close to the newest row, or, without crossing, to its episode's
end) is re-drawn: short episodes are less likely to be sampled from, as in
TorchRL's slice sampling.
"""
from __future__ import annotations

import numpy as np
from tensordict import TensorDict

from ingestd.replay.layout import EPISODE_BITS

WORKER, ENV, EPISODE, STEP, WRITE_INDEX, VERSION = (("ingestd", f) for f in ("worker", "env", "episode", "step",
                                                                             "write_index", "policy_version"))
DONE = ("next", "done")
_FIELDS = (WORKER, ENV, EPISODE, STEP, WRITE_INDEX, VERSION, DONE)  # what a sequence is cut and stamped by
_SCAN_BLOCKS = (256, 4096, 65536, 1 << 20)  # rows scanned forward for a continuation, growing
_MAX_ROUNDS = 64
_EMPTY = np.empty(0, dtype=np.int64)
_NO_WORKER = np.iinfo(np.int64).min  # the run-table worker of rows that are gone or were never written


class SequenceSampler:
    """Draws sequences for one reader (uses its private copy and assemble steps)."""

    def __init__(self, reader):
        self.reader = reader
        r = reader
        missing = [k for k in _FIELDS if k not in r._layout.fields]
        if missing:
            raise ValueError(f"sample_sequences needs the stamps and done flags the daemon's workers store; "
                             f"replay {r.path} has no {missing} (made by ReplayStorage.create with other "
                             "keys?): sample single rows from it instead")
        self._w, self._e, self._ep = r._arrays[WORKER], r._arrays[ENV], r._arrays[EPISODE]
        self._wi, self._version = r._arrays[WRITE_INDEX], r._arrays[VERSION]
        self._fields = {k: self._field_view(k) for k in _FIELDS}
        self._runs = _Runs(self._w, self._e, r.seq, r.capacity)
        self._yield = 0.5  # the share of drawn starts that became sequences lately: sizes the next draw

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

    def sample(self, batch: int, length: int, cross_episodes: bool = False,
               min_version: int | None = None) -> TensorDict | None:
        """``[batch, length]`` sequences (of rows with ``policy_version >= min_version``, if
        given), or None if none could be completed this time."""
        if batch <= 0 or length <= 0:
            raise ValueError(f"batch and length must be positive, got {batch}, {length}")
        r = self.reader
        done_records, done_columns = [], []
        need = batch
        for _ in range(_MAX_ROUNDS):
            filled = len(r)
            if filled == 0:
                return None
            drawn = min(int(1.25 * need / max(self._yield, 1 / 64)) + 8, 64 * batch)
            got = self._round(drawn, length, cross_episodes, filled, min_version)
            accepted = 0 if got is None else got[0].shape[0]
            self._yield = 0.5 * self._yield + 0.5 * accepted / drawn
            if got is not None:
                records, columns = got
                take = min(need, accepted)
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
    def _round(self, n: int, length: int, cross: bool, filled: int, min_version: int | None = None):
        r = self.reader
        cap = r.capacity
        wc = r.write_count
        self._runs.refresh(wc)
        starts = r._draw(n, filled)
        first = self._wi[starts]
        live = (first >= max(wc - cap, 0)) & (first < wc) & (first % cap == starts)
        if min_version is not None:  # an early cut only, as for episodes
            live &= self._version[starts] >= min_version
        starts = starts[live]
        wi = np.empty((starts.size, length), dtype=np.int64)
        wi[:, 0] = first[live]
        worker, env, episode = self._w[starts], self._e[starts], self._ep[starts]
        run = self._runs.locate(wi[:, 0])
        alive = np.arange(starts.size)
        for k in range(1, length):
            nxt, run = self._follow(wi[alive, k - 1], run, worker[alive], env[alive], wc)
            good = nxt >= 0
            if not cross:  # an early cut only: the copied rows are verified below
                good &= self._ep[nxt % cap] == episode[alive]
            alive, run = alive[good], run[good]
            if alive.size == 0:
                return None
            wi[alive, k] = nxt[good]
        if alive.size == 0:
            return None
        wi = wi[alive]
        m = alive.size
        records, columns, bad = r._copy((wi % cap).reshape(-1))
        valid = self._verify(records, bad, wi, m, length, cross, min_version)
        if not valid.any():
            return None
        records = records.reshape(m, length)[valid]
        columns = [c.reshape(m, length, *c.shape[1:])[valid] for c in columns]
        return records, columns

    def _follow(self, cur: np.ndarray, run: np.ndarray, worker: np.ndarray, env: np.ndarray,
                wc: int) -> tuple[np.ndarray, np.ndarray]:
        """Write index of the next row of each ``(worker, env)`` after ``cur`` (or -1), and its run."""
        cap = self.reader.capacity
        cand, run, run_end, ended = self._runs.step(cur, run)
        slots = cand % cap
        hit = (cand >= 0) & (cand < wc) & (self._wi[slots] == cand) & (self._w[slots] == worker) \
            & (self._e[slots] == env)
        out = np.where(hit, cand, -1)
        miss = np.flatnonzero(~hit)
        for i in miss:
            c, w, e = int(cur[i]), int(worker[i]), int(env[i])
            if ended[i]:  # no later run of this worker in the table: the rest of its run, then past the table
                found = self._scan(c + 1, int(run_end[i]), w, e)
                out[i] = found if found >= 0 else self._scan(max(self._runs.upto, c + 1), wc, w, e)
            else:
                out[i] = self._scan(c + 1, min(wc, c + cap), w, e)
        if miss.size:
            run[miss] = self._runs.locate(out[miss])
        return out, run

    def _scan(self, lo: int, hi: int, worker: int, env: int) -> int:
        """The first write index in ``[lo, hi)`` whose row has these worker and env stamps, or -1."""
        cap = self.reader.capacity
        start = lo
        for block in _SCAN_BLOCKS:
            stop = min(lo + block, hi)
            if start >= stop:
                return -1
            for a, b in _ring_ranges(start, stop, cap):
                s0 = a % cap
                found = np.flatnonzero((self._w[s0:s0 + b - a] == worker) & (self._e[s0:s0 + b - a] == env))
                if found.size:
                    return a + int(found[0])
            start = stop
        return -1

    def _verify(self, records: np.ndarray, bad, wi: np.ndarray, m: int, length: int, cross: bool,
                min_version: int | None = None) -> np.ndarray:
        """Per sequence: every row committed, unchanged, the row searched for, recent enough, and
        a step of one trajectory following the previous one."""
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
        # not "& ~done": an n-step row is done when its episode ended within its window, which
        # may be before the episode's last step (ingestd.collect.nstep); the stamps decide
        same = (episode[:, 1:] == episode[:, :-1]) & (step[:, 1:] == step[:, :-1] + 1)
        if cross:  # the next episode of the same worker incarnation (its ids go up by num_envs)
            later = (episode[:, 1:] > episode[:, :-1]) & (
                episode[:, 1:] >> EPISODE_BITS == episode[:, :-1] >> EPISODE_BITS)
            same |= done[:, :-1] & later & (step[:, 1:] == 0)
        ok &= same.all(1)
        if min_version is not None:
            ok &= (f[VERSION](records).reshape(shape) >= min_version).all(1)
        return ok


class _Runs:
    """The run table (see the module docstring), in write indices: ``starts`` (sorted),
    ``workers``, ``widths``, ``ends`` and ``next`` (the index of the worker's next run, or -1)
    of the runs holding rows ``[.., upto)``."""

    def __init__(self, worker: np.ndarray, env: np.ndarray, seq: np.ndarray, capacity: int):
        self._w, self._e, self._seq, self._cap = worker, env, seq, capacity
        self.upto = 0
        self.starts = self.workers = self.widths = self.ends = self.next = _EMPTY

    def refresh(self, wc: int) -> None:
        """Add the rows written since the last call, in write order up to the first one still
        being written, and drop the runs that have left the ring. Rows already overwritten
        (the oldest, lapped by the writers) and rows left unwritten long ago (a writer that
        died) join the table as runs of no worker."""
        oldest = max(wc - self._cap, 0)
        if self.upto < oldest:  # more than a ring behind: start again from the oldest row
            self.upto, self.starts, self.workers, self.widths = oldest, _EMPTY, _EMPTY, _EMPTY
        index = np.arange(self.upto, wc)
        slots = index % self._cap
        seq = self._seq[slots]
        expected = 2 * index + 2
        pending = np.flatnonzero((seq < expected) & (index >= wc - self._cap // 4))
        n = int(pending[0]) if pending.size else index.size
        if n:
            w = np.where(seq[:n] == expected[:n], self._w[slots[:n]], _NO_WORKER)
            self._append(w, self._e[slots[:n]])
        keep = max(int(np.searchsorted(self.starts, oldest, side="right")) - 1, 0)
        if n == 0 and keep == 0 and self.next.size == self.starts.size:  # no change since the last link
            return
        self.starts, self.workers, self.widths = self.starts[keep:], self.workers[keep:], self.widths[keep:]
        self.ends = np.append(self.starts[1:], self.upto)
        order = np.argsort(self.workers, kind="stable")  # by worker, then by start
        same = self.workers[order[1:]] == self.workers[order[:-1]]
        self.next = np.full(self.starts.size, -1)
        self.next[order[:-1][same]] = order[1:][same]

    def _append(self, w: np.ndarray, e: np.ndarray) -> None:
        cuts = np.concatenate(([0], np.flatnonzero(w[1:] != w[:-1]) + 1))
        widths = np.maximum(np.maximum.reduceat(e, cuts) + 1, 1)
        if self.starts.size and self.workers[-1] == w[0]:  # the last run goes on
            self.widths[-1] = max(self.widths[-1], widths[0])
            cuts, widths = cuts[1:], widths[1:]
        self.starts = np.concatenate((self.starts, self.upto + cuts))
        self.workers = np.concatenate((self.workers, w[cuts]))
        self.widths = np.concatenate((self.widths, widths))
        self.upto += w.size

    def locate(self, index: np.ndarray) -> np.ndarray:
        """The run holding each write index, or -1."""
        run = np.searchsorted(self.starts, index, side="right") - 1
        run[(index < 0) | (index >= self.upto)] = -1
        return run

    def step(self, cur: np.ndarray, run: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For rows ``cur`` in runs ``run``: the proposed next row of each trajectory (-1: the
        table does not know) and its run, the end of the current run, and whether the table
        holds no later run of the worker."""
        known = run >= 0
        if not known.any():
            return np.full(cur.size, -1), run, cur + 1, known
        r = np.where(known, run, 0)
        width, start, end, nxt = self.widths[r], self.starts[r], self.ends[r], self.next[r]
        cand = cur + width
        beyond = cand >= end
        across = self.starts[nxt] + (cur - start) % width  # the same place in a step of the next run
        cand = np.where(beyond, np.where(nxt >= 0, across, -1), cand)
        cand[~known] = -1
        return cand, np.where(beyond | ~known, nxt, r), end, known & beyond & (nxt < 0)


def _ring_ranges(lo: int, hi: int, cap: int) -> list[tuple[int, int]]:
    """Split write indices ``[lo, hi)`` where they wrap around the ring."""
    edge = (lo // cap + 1) * cap
    return [(lo, hi)] if hi <= edge else [(lo, edge), (edge, hi)]


def _cat(parts):
    import torch

    return torch.cat(parts) if parts else parts
