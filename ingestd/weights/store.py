"""The shared weight store: one writer (the daemon), many readers (the workers).

One file (the daemon keeps it in its runtime dir, on tmpfs), mapped by every process::

    [0, PAGE)             header: int64 words (magic, format, version, active, ...)
    [PAGE, B0)            the manifest as JSON (fixed at creation)
    [B0, B0 + size)       buffer 0 \\  each holds a whole state dict, every tensor
    [B1, B1 + size)       buffer 1 /  starting on a 64-byte boundary

Publishing writes the *inactive* buffer under that buffer's seqlock (odd while
being written), records the buffer's version, then flips ``active`` and
``version``. A reader copies the active buffer into private memory and keeps the
copy only if the buffer's sequence number was even and unchanged across the
copy; otherwise it retries, so it never returns a torn state dict. ``version`` is
a single int64 load, cheap enough to poll every chunk. Version 0 means nothing
has been published; versions live as long as the file (``create`` starts at 0;
``reopen`` lets a restarted daemon go on publishing into the same file).

Memory ordering: this relies on x86-64 TSO (stores are seen in program order,
loads are not reordered with older loads) and on aligned 8-byte loads and stores
being atomic; header words are written and read one at a time through numpy.
Weakly ordered CPUs (ARM) would need fences that Python cannot issue.
"""
from __future__ import annotations

import mmap
import os
import stat
import time
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ingestd.errors import BadWeights, ClosedError, CorruptStorage, IngestdError, StorageFull, StorageNotFound
from ingestd.replay import files
from ingestd.weights.wire import Manifest, manifest_of, tensor_bytes, tensors_of, unwrapped

MAGIC = 0x494E4745_5754_0001  # "INGEWT" + 1
FORMAT = 1
PAGE = mmap.PAGESIZE
ALIGN = 64
HEADER_WORDS = PAGE // 8
H_MAGIC, H_FORMAT, H_VERSION, H_ACTIVE, H_MANIFEST_LEN, H_BUFFER_BYTES = range(6)
H_SEQ = (8, 9)  # per-buffer seqlock: odd while the writer fills that buffer
H_BUFVER = (10, 11)  # version a buffer holds; 0 while it is being written or never written
DEFAULT_READ_TIMEOUT = 5.0


class NoWeightsYet(IngestdError, LookupError):
    """``read()`` was called before any version was published (version is 0); poll ``version``."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class WeightStore:
    """A double-buffered, versioned state dict in a shared file. Use ``create`` or ``attach``.

    Not picklable: pass ``path`` to other processes and ``attach`` there.
    """

    def __init__(self, path: Path, mm: mmap.mmap, writable: bool):
        self.path, self._mm, self.writable = path, mm, writable
        self.on_publish = None  # called with each version published (the daemon's VersionMark.save)
        self._header = np.frombuffer(mm, np.int64, HEADER_WORDS)
        if int(self._header[H_MAGIC]) != MAGIC or int(self._header[H_FORMAT]) != FORMAT:
            raise CorruptStorage(f"{path} is not an ingestd weight store (bad magic or format); "
                                 "it may belong to another program: remove it and restart the daemon")
        length = int(self._header[H_MANIFEST_LEN])
        try:
            self.manifest = Manifest.from_json(mm[PAGE:PAGE + length], max_bytes=len(mm))
        except BadWeights as exc:
            raise CorruptStorage(f"{path}: unreadable manifest ({exc})") from None
        self._offsets, self._used = self.manifest.offsets(ALIGN)
        self._size = int(self._header[H_BUFFER_BYTES])
        self._bases = _buffer_bases(length, self._size)
        if self._size != _buffer_bytes(self.manifest) or len(mm) != self._bases[1] + self._size:
            raise CorruptStorage(f"{path} has {len(mm)} bytes, which does not fit its manifest; it is damaged")
        self._buffers = [np.frombuffer(mm, np.uint8, self._used, base) for base in self._bases]
        self._slots = [[buf[o:o + e.nbytes] for e, o in zip(self.manifest.entries, self._offsets)]
                       for buf in self._buffers] if writable else None  # flat uint8 per entry

    # -- construction -------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, manifest: Manifest, *, mode: int = 0o600) -> WeightStore:
        """Create (atomically replacing any old file) an empty store and return its writer.

        Buffers start filled with sentinels (NaN, integer max, True) so stray reads are visible.
        """
        path = Path(path)
        manifest_json = manifest.to_json().encode()
        size = _buffer_bytes(manifest)
        bases = _buffer_bases(len(manifest_json), size)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        try:
            try:
                files.reserve(fd, bases[1] + size)
            except OSError as exc:
                if exc.errno not in files.NO_ROOM:
                    raise
                need = bases[1] + size  # (a small policy's store "needed 0.0 MiB")
                raise StorageFull(f"no room for the weight store at {path}: it needs "
                                  f"{f'{need / 2**20:.1f} MiB' if need >= 2**20 else f'{need / 1024:.0f} KiB'} "
                                  f"({exc.strerror}); free space where service.runtime_dir is, or choose a "
                                  "runtime dir with room") from exc
            mm = mmap.mmap(fd, bases[1] + size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            mm[PAGE:PAGE + len(manifest_json)] = manifest_json
            header = np.frombuffer(mm, np.int64, HEADER_WORDS)
            header[H_FORMAT], header[H_MANIFEST_LEN], header[H_BUFFER_BYTES] = FORMAT, len(manifest_json), size
            header[H_MAGIC] = MAGIC
            del header
            store = cls(path, mm, writable=True)
            for buffer in store._buffers:
                for view in store._tensors_over(buffer).values():
                    view.fill_(_sentinel(view.dtype))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return store

    @classmethod
    def attach(cls, path: str | os.PathLike) -> WeightStore:
        """Map an existing store read-only (from any process) and return a reader."""
        return cls._map(Path(path), writable=False)

    @classmethod
    def reopen(cls, path: str | os.PathLike, manifest: Manifest) -> WeightStore | None:
        """The existing store at ``path`` as its writer again, if it holds ``manifest``; else None.

        A restarted daemon publishes into the same file, so readers that mapped it (workers, a
        trainer's ``weights_path=``) keep seeing new versions. A previous writer killed in
        ``publish`` is finished for it: a buffer it died filling (never the active one) is marked
        empty, and a buffer it made active but died before numbering becomes the current
        version. ``CorruptStorage`` if the header fits no state ``publish`` can leave."""
        try:
            store = cls._map(Path(path), writable=True)
        except StorageNotFound:
            return None
        if store.manifest != manifest:
            store.close()
            return None
        header = store._header
        try:
            active = store._active(header)
        except CorruptStorage:
            store.close()
            raise
        if int(header[H_SEQ[active]]) % 2:
            store.close()
            raise CorruptStorage(f"{path}: the active buffer is marked as being written; it is damaged")
        inactive = 1 - active
        if int(header[H_SEQ[inactive]]) % 2:  # died filling it: the active buffer is whole
            header[H_BUFVER[inactive]] = 0
            header[H_SEQ[inactive]] += 1
        if int(header[H_BUFVER[active]]) > int(header[H_VERSION]):  # died between the flip and the number
            header[H_VERSION] = header[H_BUFVER[active]]
        if int(header[H_BUFVER[active]]) != int(header[H_VERSION]):
            store.close()
            raise CorruptStorage(f"{path}: version {int(header[H_VERSION])} is not the active buffer's "
                                 f"({int(header[H_BUFVER[active]])}); it is damaged")
        return store

    @classmethod
    def _map(cls, path: Path, writable: bool) -> WeightStore:
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise StorageNotFound(f"no weight store at {str(path)!r}; has the daemon started? (a daemon makes "
                                  "<runtime_dir>/weights only for a policy with weights: the Random policy has "
                                  "none, and its rows all carry version 0)") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                hint = f"; did you mean {str(path / 'weights')!r}?" if (path / "weights").is_file() else ""
                raise StorageNotFound(f"{str(path)!r} is a directory, not a weight store: pass the file "
                                      f"<runtime_dir>/weights{hint}")
            size = st.st_size
            if size < 2 * PAGE:
                raise CorruptStorage(f"{path} has only {size} bytes; it is not a weight store")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        return cls(path, mm, writable=writable)

    # -- writer -------------------------------------------------------------------
    def publish(self, state: torch.nn.Module | Mapping[str, torch.Tensor], *, version: int | None = None) -> int:
        """Write ``state`` to the inactive buffer, then make it current; return its version.

        ``version`` defaults to the current one plus 1 and must be larger than it.
        Raises ``BadWeights`` if the state does not match the manifest (values are not
        checked for NaN here: ``decode`` does that). One writer, one thread.
        """
        header = self._open_header()
        if not self.writable:
            raise PermissionError(f"{self.path} was attached read-only; only the store's creator publishes")
        tensors = tensors_of(state)
        self.manifest.check(manifest_of(tensors))
        current = int(header[H_VERSION])
        new = current + 1 if version is None else int(version)
        if new <= current:
            raise ValueError(f"version {new} is not newer than the published version {current}")
        target = 1 - int(header[H_ACTIVE])
        header[H_SEQ[target]] += 1  # odd: readers of this buffer will retry
        header[H_BUFVER[target]] = 0
        try:
            for entry, slot in zip(self.manifest.entries, self._slots[target]):
                np.copyto(slot, tensor_bytes(tensors[entry.name]))  # numpy: no thread pool to stall
            header[H_BUFVER[target]] = new
        finally:
            header[H_SEQ[target]] += 1  # even again (on failure the buffer holds version 0: skipped)
        header[H_ACTIVE] = target
        header[H_VERSION] = new
        if self.on_publish is not None:
            self.on_publish(new)
        return new

    # -- readers (the writer can read too) ----------------------------------------
    @property
    def version(self) -> int:
        """The latest published version (0: none yet). One int64 load."""
        return int(self._open_header()[H_VERSION])

    def read(self, timeout: float = DEFAULT_READ_TIMEOUT) -> tuple[int, dict[str, torch.Tensor]]:
        """A consistent copy of the latest state dict and its version.

        Raises ``NoWeightsYet`` if nothing was published, ``TimeoutError`` if the
        writer kept overwriting the buffer being copied for ``timeout`` seconds.
        """
        if self.version == 0:
            raise NoWeightsYet(f"no weights published in {self.path} yet; wait until version > 0")
        private = np.empty(self._used, np.uint8)
        deadline = time.monotonic() + timeout
        attempts = 0
        while True:
            version = self._try_copy(private)
            if version:
                return version, self._tensors_over(private)
            attempts += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path}: no consistent read in {timeout}s ({attempts} attempts); "
                                   "is the writer publishing in a tight loop?")
            time.sleep(0 if attempts < 8 else 0.001)

    def read_if_newer(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``read()`` if a version newer than ``version`` is published, else ``None``."""
        if self.version <= version:
            return None
        return self.read()

    def load_into(self, module: torch.nn.Module, if_newer_than: int | None = None) -> int | None:
        """Load the latest weights into ``module`` (strict); return the version, or ``None``
        if ``if_newer_than`` is given and nothing newer is published."""
        got = self.read() if if_newer_than is None else self.read_if_newer(if_newer_than)
        if got is None:
            return None
        version, state = got
        try:  # a torch.compile'd module: the names are its module's
            unwrapped(module).load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise BadWeights(f"weights in {self.path} do not fit {type(module).__name__}: {exc}") from None
        return version

    def _try_copy(self, private: np.ndarray) -> int:
        """Copy the active buffer; return its version, or 0 if it changed meanwhile (retry)."""
        header = self._open_header()
        active = self._active(header)
        seq = int(header[H_SEQ[active]])
        version = int(header[H_BUFVER[active]])
        if seq & 1 or version == 0:
            return 0
        self._copy_buffer(active, private)
        return version if int(header[H_SEQ[active]]) == seq else 0

    def _active(self, header: np.ndarray) -> int:
        """The active buffer's index, 0 or 1: any other word (a negative one picked a buffer
        by Python's indexing, a larger one raised IndexError at every start) is damage."""
        active = int(header[H_ACTIVE])
        if active not in (0, 1):
            raise CorruptStorage(f"{self.path}: the active-buffer word is {active}, not 0 or 1; it is damaged")
        return active

    def _copy_buffer(self, index: int, out: np.ndarray) -> None:
        np.copyto(out, self._buffers[index])

    def _tensors_over(self, buffer: np.ndarray) -> dict[str, torch.Tensor]:
        """Tensors aliasing a buffer: the writer's views of the mapping, or a reader's private copy."""
        state = {}
        for entry, offset in zip(self.manifest.entries, self._offsets):
            array = buffer[offset:offset + entry.nbytes].view(entry.numpy_dtype).reshape(entry.shape)
            state[entry.name] = torch.from_numpy(array).view(entry.torch_dtype)
        return state

    # -- lifetime -------------------------------------------------------------------
    def _open_header(self) -> np.ndarray:
        if self._mm is None:
            raise ClosedError(f"the weight store {self.path} was closed; attach it again")
        return self._header

    def close(self) -> None:
        """Unmap the file (idempotent). The file stays; its owner removes the runtime dir."""
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        self._header = self._buffers = self._slots = None
        try:
            mm.close()
        except BufferError:  # a view is still referenced somewhere; unmapped when collected
            pass

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError("a WeightStore cannot be pickled; pass its path and call WeightStore.attach(path)")

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"version={self.version}"
        return f"WeightStore({str(self.path)!r}, {'writer' if self.writable else 'reader'}, {state})"


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    """What an unwritten buffer holds: NaN, True, or the dtype's largest integer."""
    if dtype.is_floating_point:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).max


def _buffer_bytes(manifest: Manifest) -> int:
    return _round_up(max(manifest.offsets(ALIGN)[1], 1), PAGE)


def _buffer_bases(manifest_len: int, size: int) -> tuple[int, int]:
    base0 = PAGE + _round_up(max(manifest_len, 1), PAGE)
    return base0, base0 + size
