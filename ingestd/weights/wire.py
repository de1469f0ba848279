"""The network wire format for policy weights: a JSON manifest plus lz4 bytes.

A weight message is two ZeroMQ frames, never pickle::

    frame A  UTF-8 JSON {"v": 1, "codec": "lz4", "raw_bytes": N, "entries": [
                 {"name": "fc.weight", "dtype": "float32", "shape": [4, 3]}, ...]}
    frame B  one lz4 *frame* (``lz4.frame``: content size and content checksum set)
             holding the raw tensor bytes: C-contiguous, little-endian, entries in
             manifest order, no padding, N bytes in total.

``codec: "lz4"`` means ``lz4.frame``, not ``lz4.block``. The frame format is
streamed (``encode`` never concatenates the tensors), has no 2 GiB limit, states
the content size in its header (cross-checked against ``raw_bytes`` before any
decompression) and carries an xxhash32 checksum of the content, which ``decode``
requires: random-looking float weights do not compress, lz4 stores them verbatim,
and without the checksum a flipped bit would go unnoticed. Decompression is bounded
by ``raw_bytes`` (itself capped by ``max_raw_bytes``), so a decompression bomb costs
nothing. bfloat16 travels as its 16 raw bits.

Hosts must be little-endian (x86-64, aarch64): tensors are sent as their memory.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import lz4.frame
import numpy as np
import torch

from ingestd.errors import BadWeights

if sys.byteorder != "little":  # pragma: no cover - no such host in use
    raise ImportError("ingestd.weights needs a little-endian host")

WIRE_VERSION = 1
CODEC = "lz4"
DEFAULT_MAX_RAW_BYTES = 1 << 30  # 1 GiB of raw tensor bytes (~268M float32 parameters)
DEFAULT_MAX_MANIFEST_BYTES = 8 << 20
MAX_NDIM = 32
PUSH_OVERHEAD = 1024  # bytes a push_weights request adds to the encoded weights (its JSON header, with room)
_BLOCK_SIZE = lz4.frame.BLOCKSIZE_MAX4MB  # measured faster than the 64 KiB default
_CHUNK = 4 << 20  # decode reads and writes the payload in pieces of this size

# dtype name -> (torch dtype, numpy dtype of the bytes on the wire)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "bool": (torch.bool, np.dtype("|b1")), "uint8": (torch.uint8, np.dtype("|u1")),
    "int8": (torch.int8, np.dtype("|i1")), "int16": (torch.int16, np.dtype("<i2")),
    "int32": (torch.int32, np.dtype("<i4")), "int64": (torch.int64, np.dtype("<i8")),
    "float16": (torch.float16, np.dtype("<f2")), "bfloat16": (torch.bfloat16, np.dtype("<i2")),
    "float32": (torch.float32, np.dtype("<f4")), "float64": (torch.float64, np.dtype("<f8")),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in _DTYPES.items()}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(_short(n, 40) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@dataclass(frozen=True)
class Entry:
    """One tensor of a state dict: its name, dtype name and shape (validated)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise BadWeights(f"'name' must be a non-empty string, got {_short(self.name)}")
        where = _short(self.name, 40)
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise BadWeights(f"{where}: unknown dtype {_short(self.dtype)}; expected one of {sorted(_DTYPES)}")
        if not isinstance(self.shape, tuple) or len(self.shape) > MAX_NDIM:
            raise BadWeights(f"{where}: 'shape' must be a list of at most {MAX_NDIM} sizes, "
                             f"got {_short(self.shape)}")
        if any(type(s) is not int or s < 0 for s in self.shape):
            raise BadWeights(f"{where}: shape sizes must be non-negative integers, got {_short(list(self.shape))}")
        if any(s >= 2**62 for s in self.shape) or math.prod(s for s in self.shape if s) >= 2**62:
            # (of no bytes with a 0 size, yet numpy cannot make it: a ValueError, not BadWeights)
            raise BadWeights(f"{where}: shape {_short(list(self.shape))} is too large for any tensor")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of the raw bytes (bfloat16 is carried as int16 bits)."""
        return _DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.numpy_dtype.itemsize

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Manifest:
    """The ordered list of tensors a state dict holds; fixes the raw byte layout."""

    entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        seen: set[str] = set()
        dupes = [e.name for e in self.entries if e.name in seen or seen.add(e.name)]
        if dupes:
            raise BadWeights(f"manifest names must be unique; repeated: {_names(dupes)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def total_bytes(self) -> int:
        """Raw bytes of all tensors, packed without padding (the wire's ``raw_bytes``)."""
        return sum(e.nbytes for e in self.entries)

    def offsets(self, align: int = 1) -> tuple[list[int], int]:
        """Start offset of every entry when each starts at a multiple of ``align``, and the end."""
        offsets, end = [], 0
        for e in self.entries:
            end = -(-end // align) * align
            offsets.append(end)
            end += e.nbytes
        return offsets, end

    def to_dict(self) -> dict:
        return {"v": WIRE_VERSION, "entries": [
            {"name": e.name, "dtype": e.dtype, "shape": list(e.shape)} for e in self.entries]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, obj: Any, max_bytes: int | None = DEFAULT_MAX_RAW_BYTES) -> Manifest:
        """Validate an untrusted parsed manifest; raise ``BadWeights`` saying what is wrong.

        ``max_bytes`` bounds each entry's size (``None``: no bound).
        """
        if not isinstance(obj, dict):
            raise BadWeights(f"manifest must be a JSON object, got {type(obj).__name__}")
        if obj.get("v") != WIRE_VERSION:
            raise BadWeights(f"manifest version {_short(obj.get('v'))} is not supported "
                             f"(this ingestd reads v={WIRE_VERSION}); upgrade the sender or the daemon")
        entries = obj.get("entries")
        if not isinstance(entries, list):
            raise BadWeights(f"manifest 'entries' must be a list, got {type(entries).__name__}")
        if not entries:
            raise BadWeights("manifest has no entries; a policy has at least one tensor")
        return cls(tuple(_entry_from_json(i, e, max_bytes) for i, e in enumerate(entries)))

    @classmethod
    def from_json(cls, text: str | bytes, max_bytes: int | None = DEFAULT_MAX_RAW_BYTES) -> Manifest:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; too deeply nested
            raise BadWeights(f"manifest is not valid UTF-8 JSON: {exc}") from None
        return cls.from_dict(obj, max_bytes)

    def differences(self, other: Manifest) -> list[str]:
        """What keeps ``other`` (what arrived) from matching this manifest (what is expected)."""
        mine, theirs = {e.name: e for e in self.entries}, {e.name: e for e in other.entries}
        missing = [n for n in mine if n not in theirs]
        unexpected = [n for n in theirs if n not in mine]
        mismatched = [f"{_short(n, 40)} is {theirs[n].describe()}, expected {e.describe()}"
                      for n, e in mine.items() if n in theirs and theirs[n] != e]
        problems = []
        if missing:
            problems.append(f"missing {_names(missing)}")
        if unexpected:
            problems.append(f"unexpected {_names(unexpected)}")
        if mismatched:
            problems.append("mismatched: " + "; ".join(mismatched[:8])
                            + (f" and {len(mismatched) - 8} more" if len(mismatched) > 8 else ""))
        prefix = _common_prefix(mine, theirs) if missing else None
        if prefix:  # a DistributedDataParallel or torch.compile wrapper's state_dict
            problems.append(f"the pushed names are the policy's with {prefix!r} in front: push the unwrapped "
                            f"module's state_dict (model.module for DistributedDataParallel, model._orig_mod for "
                            f"torch.compile), or strip the prefix")
        inner = _inner_prefix(mine, {n: theirs[n] for n in unexpected}) if missing and unexpected else None
        if inner:  # the trainer's own network, not the policy module around it (review: a bare Sequential)
            mlp = (" (for the built-in MLP, ingestd.collect.policies.mlp_qnet(obs_dim, num_actions, hidden))"
                   if _is_builtin_mlp(mine) else "")
            problems.append(f"the pushed names are the policy's without {inner!r} in front (a network of its own, "
                            f"not the policy module): push a module with the policy's names{mlp}, or add the prefix")
        if "epsilon" in missing and not prefix and not any(n.endswith(".epsilon") for n in unexpected):
            problems.append("'epsilon' is the built-in MLP's exploration rate (a 0-dim float32 buffer): "
                            "mlp_qnet(...) has it, or add it to the state dict")
        return problems

    def check(self, other: Manifest) -> None:
        """Raise ``BadWeights`` listing every difference unless ``other`` matches (any order)."""
        problems = self.differences(other)
        if problems:
            raise BadWeights("weights do not match the policy: " + "; ".join(problems))


def _common_prefix(mine: dict[str, Entry], theirs: dict[str, Entry]) -> str | None:
    """The shortest dotted prefix (``"module."``) that turns every name of ``mine`` (the
    policy's) into the names of ``theirs`` (what was pushed), each of the same dtype and
    shape, if there is one; else None."""
    if not mine or len(mine) != len(theirs):
        return None
    first = next(iter(mine))
    candidates = sorted({name[:-len(first)] for name in theirs if name.endswith("." + first)}, key=len)
    return next((p for p in candidates if all(_same(theirs.get(p + name), e) for name, e in mine.items())), None)


def _inner_prefix(mine: dict[str, Entry], theirs: dict[str, Entry]) -> str | None:
    """The dotted prefix of the policy's names (``"net."``) that, put in front of every pushed
    name the policy does not have (``theirs``), gives a policy name of the same dtype and shape:
    those are the network inside the policy (a right top-level name such as ``epsilon`` may be
    pushed beside them). A pushed ``nn.Linear(4, 2)`` is not the MLP's ``net.2`` of ``[64, 64]``:
    "add the prefix" would not have fixed it (walkthrough review)."""
    if not theirs:
        return None
    first = next(iter(theirs))
    candidates = sorted({name[:-len(first)] for name in mine if name.endswith("." + first)}, key=len)
    return next((p for p in candidates if all(_same(mine.get(p + name), e) for name, e in theirs.items())), None)


def _same(entry: Entry | None, other: Entry) -> bool:
    return entry is not None and entry.dtype == other.dtype and entry.shape == other.shape


def _is_builtin_mlp(names) -> bool:
    """Whether a policy's names are the built-in MLP's (``epsilon`` and ``net.*``)."""
    return "epsilon" in names and all(n == "epsilon" or n.startswith("net.") for n in names)


def _entry_from_json(index: int, obj: Any, max_bytes: int | None) -> Entry:
    if not isinstance(obj, dict):
        raise BadWeights(f"manifest entry {index} must be an object with name, dtype and shape, "
                         f"got {type(obj).__name__}")
    shape = obj.get("shape")
    try:
        entry = Entry(obj.get("name"), obj.get("dtype"), tuple(shape) if isinstance(shape, list) else shape)
    except BadWeights as exc:
        raise BadWeights(f"manifest entry {index}: {exc}") from None
    if max_bytes is not None and entry.nbytes > max_bytes:
        raise BadWeights(f"manifest entry {index} ({_short(entry.name, 40)}): shape {list(entry.shape)} needs "
                         f"{entry.nbytes} bytes, over the limit of {max_bytes} (raise max_raw_bytes if genuine)")
    return entry


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise BadWeights(f"dtype {dtype} cannot travel as weights; use one of {sorted(_DTYPES)}") from None


_COMPILED = "_orig_mod."  # the prefix torch.compile's wrapper puts on a module's state dict names


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile``d one wraps (whose state dict names travel), else ``module``."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def tensors_of(state: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict as detached, contiguous CPU tensors; ``BadWeights`` for anything else.

    A ``torch.compile``d module (or its state dict, every name prefixed ``_orig_mod.``) gives
    the names of the module it wraps: the policy's."""
    if isinstance(state, torch.nn.Module):
        state = unwrapped(state).state_dict()
    if not isinstance(state, Mapping):
        raise BadWeights(f"expected an nn.Module or a mapping of name -> tensor, got {type(state).__name__}")
    if state and all(isinstance(name, str) and name.startswith(_COMPILED) for name in state):
        state = {name[len(_COMPILED):]: value for name, value in state.items()}
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise BadWeights(f"state dict keys must be non-empty strings, got {_short(name)}")
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_quantized:
            kind = type(value).__name__ if not isinstance(value, torch.Tensor) else \
                f"{'quantized' if value.is_quantized else value.layout} tensor"
            raise BadWeights(f"{name!r} is a {kind}, expected a dense torch.Tensor"
                             + (" (torch.from_numpy makes one)" if type(value).__module__ == "numpy" else ""))
        dtype_name(value.dtype)
        if value.is_nested:
            raise BadWeights(f"{name!r} is a nested tensor, expected a dense torch.Tensor")
        if value.is_meta:
            raise BadWeights(f"{name!r} is a meta tensor: it has no data (a module built on the meta device and "
                             "not materialized yet, e.g. with to_empty() and loaded weights)")
        out[name] = value.detach().resolve_conj().resolve_neg().to("cpu").contiguous()  # (numpy() refuses the bits)
    return out


def manifest_of(state: torch.nn.Module | Mapping[str, torch.Tensor]) -> Manifest:
    """The manifest describing a module's state dict or a mapping of name -> tensor."""
    return Manifest(tuple(Entry(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors_of(state).items()))


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat uint8 array (no copy)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().reshape(-1).view(np.uint8)


def encode(state: torch.nn.Module | Mapping[str, torch.Tensor]) -> list[bytes]:
    """Encode a state dict as ``[manifest JSON, lz4 frame of the raw bytes]`` (see module doc)."""
    tensors = tensors_of(state)
    manifest = manifest_of(tensors)
    if not manifest.entries:
        raise BadWeights("cannot encode an empty state dict; a policy has at least one tensor")
    raw_bytes = manifest.total_bytes
    compressor = lz4.frame.LZ4FrameCompressor(block_size=_BLOCK_SIZE, content_checksum=True)
    parts = [compressor.begin(source_size=raw_bytes)]
    parts.extend(compressor.compress(tensor_bytes(t)) for t in tensors.values() if t.numel())
    parts.append(compressor.flush())
    header = {**manifest.to_dict(), "codec": CODEC, "raw_bytes": raw_bytes}
    return [json.dumps(header, separators=(",", ":")).encode(), b"".join(parts)]


def decode(frames: Sequence[Any], expected: Manifest | None = None,
           max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES, *,
           max_manifest_bytes: int = DEFAULT_MAX_MANIFEST_BYTES) -> dict[str, torch.Tensor]:
    """Validate and decode ``encode``'s frames into a fresh state dict of owned CPU tensors.

    Frames may be any bytes-like objects (bytes, memoryview, ``zmq.Frame``). Every check
    that bounds memory runs before decompression. Raises ``BadWeights`` saying what is wrong.
    """
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(frames, Sequence):
        raise BadWeights(f"weights must be a list of 2 frames, got {type(frames).__name__}")
    if len(frames) != 2:
        raise BadWeights(f"weights must be 2 frames (manifest JSON, lz4 payload), got {len(frames)}")
    head, payload = (_as_buffer(i, f) for i, f in enumerate(frames))
    if head.nbytes > max_manifest_bytes:
        raise BadWeights(f"manifest frame is {head.nbytes} bytes, over the limit of {max_manifest_bytes}")
    header = _parse_header(head)
    # With an expected manifest, an oversized entry is better reported as a mismatch.
    manifest = Manifest.from_dict(header, max_raw_bytes if expected is None else None)
    raw_bytes = header["raw_bytes"]
    if manifest.total_bytes != raw_bytes:
        raise BadWeights(f"manifest declares raw_bytes={raw_bytes} but its entries add up to "
                         f"{manifest.total_bytes}; the manifest is inconsistent")
    if expected is not None:
        expected.check(manifest)
    if raw_bytes > max_raw_bytes:  # nothing has been decompressed or allocated yet
        raise BadWeights(f"payload declares {raw_bytes} raw bytes, over the limit of {max_raw_bytes} "
                         "(raise max_raw_bytes if the policy is really that large)")
    return _unpack(payload, manifest)


def _as_buffer(index: int, frame: Any) -> memoryview:
    try:
        return memoryview(frame).cast("B")
    except TypeError:
        raise BadWeights(f"frame {index} is a {type(frame).__name__}, not bytes") from None


def _parse_header(head: memoryview) -> dict:
    try:
        header = json.loads(head.tobytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; too deeply nested
        raise BadWeights(f"frame 0 is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise BadWeights(f"frame 0 must be a JSON object, got {type(header).__name__}")
    if header.get("codec") != CODEC:
        raise BadWeights(f"unsupported codec {_short(header.get('codec'))}; expected {CODEC!r}")
    raw_bytes = header.get("raw_bytes")
    if type(raw_bytes) is not int or raw_bytes < 0:
        raise BadWeights(f"'raw_bytes' must be a non-negative integer, got {_short(raw_bytes)}")
    return header


def _decompress_into(payload: memoryview, targets: list[np.ndarray], raw_bytes: int) -> None:
    """Stream-decompress ``payload`` into the flat uint8 ``targets`` in order.

    Input and output go in chunks of at most ``_CHUNK`` bytes and the output is
    capped at ``raw_bytes + 1`` in total, so memory stays bounded whatever the
    payload claims; each byte is written once, straight into its final tensor.
    """
    if payload.nbytes == 0:
        raise BadWeights("payload frame is empty (zero-length); expected an lz4 frame")
    try:
        info = lz4.frame.get_frame_info(payload)
    except RuntimeError as exc:
        raise BadWeights(f"payload is not an lz4 frame ({exc})") from None
    if not info["content_checksum"]:
        raise BadWeights("payload lz4 frame has no content checksum; encode it with ingestd.weights.encode")
    if info["content_size"] and info["content_size"] != raw_bytes:
        raise BadWeights(f"payload lz4 header says {info['content_size']} bytes, manifest says {raw_bytes}")
    context, sink = lz4.frame.create_decompression_context(), _Sink(targets)
    position, done = 0, False
    while not done:
        left = raw_bytes - sink.written
        try:
            out, used, done = lz4.frame.decompress_chunk(
                context, payload[position:position + _CHUNK], max_length=min(left + 1, _CHUNK))
        except RuntimeError as exc:
            raise BadWeights(f"payload is corrupt ({exc})") from None
        position += used
        if len(out) > left:
            raise BadWeights(f"payload decompresses to more than the declared {raw_bytes} bytes")
        sink.write(out)
        if not done and not out and (position >= payload.nbytes or not used):
            raise BadWeights(f"payload is truncated: {sink.written} of {raw_bytes} bytes, lz4 frame unfinished")
    if position < payload.nbytes:
        raise BadWeights(f"payload has {payload.nbytes - position} bytes after the end of the lz4 frame")
    if sink.written != raw_bytes:
        raise BadWeights(f"payload decompresses to {sink.written} bytes, manifest declares {raw_bytes}")


class _Sink:
    """Writes a byte stream across a list of flat uint8 arrays, one after another."""

    def __init__(self, targets: list[np.ndarray]):
        self.targets = [t for t in targets if t.size]
        self.index = self.offset = self.written = 0

    def write(self, data: bytes) -> None:
        source, done = np.frombuffer(data, np.uint8), 0
        while done < source.size:
            target = self.targets[self.index]
            n = min(target.size - self.offset, source.size - done)
            target[self.offset:self.offset + n] = source[done:done + n]
            done, self.offset = done + n, self.offset + n
            if self.offset == target.size:
                self.index, self.offset = self.index + 1, 0
        self.written += source.size


def _unpack(payload: memoryview, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Fresh owned tensors filled from the payload; rejects invalid bools and non-finite floats."""
    arrays = [np.empty(e.shape, e.numpy_dtype) for e in manifest.entries]
    _decompress_into(payload, [a.reshape(-1).view(np.uint8) for a in arrays], manifest.total_bytes)
    out: dict[str, torch.Tensor] = {}
    for entry, array in zip(manifest.entries, arrays):
        if entry.dtype == "bool" and array.size and array.view(np.uint8).max() > 1:
            raise BadWeights(f"bool tensor {entry.name!r} holds bytes other than 0 and 1")
        out[entry.name] = torch.from_numpy(array).view(entry.torch_dtype)
    check_finite(out)
    return out


def check_finite(state: Mapping[str, torch.Tensor]) -> None:
    """Raise ``BadWeights`` naming every floating tensor that holds NaN or +-Inf."""
    bad = [name for name, t in state.items() if t.is_floating_point() and t.numel() and _non_finite(t)]
    if bad:
        raise BadWeights(f"non-finite values (NaN/Inf) in {_names(bad)}; the trainer diverged or sent garbage")


def _non_finite(tensor: torch.Tensor) -> bool:
    """numpy's isfinite (torch's is ~10x slower on CPU); bfloat16 by its exponent bits."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return bool(((tensor.view(torch.int16).numpy().view(np.uint16) & 0x7F80) == 0x7F80).any())
    return not bool(np.isfinite(tensor.numpy()).all())
