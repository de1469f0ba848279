"""The control wire protocol: envelopes, error codes, limits and framing.

A request is one ZeroMQ multipart message::

    frame 0     UTF-8 JSON header {"v": 1, "id": <str|int>, "cmd": <name>, "args": {...}}
    frame 1..n  binary payloads (only ``push_weights`` has any: the weights wire format)

A reply is one frame of UTF-8 JSON::

    {"v": 1, "id": <the request's id>, "ok": true,  "result": ...}
    {"v": 1, "id": <the request's id>, "ok": false, "error": {"code": ..., "message": ...}}

Nothing here touches a socket; the server and the client do. The command
messages themselves (one typed class per command) are in
:mod:`ingestd.control.commands`. See ``docs/protocol.md``.
"""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, Sequence

from ingestd.errors import BadReply, CommandFailed, WeightsRejected

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024  # frame 0; the JSON header is small, payloads go in frames 1..n
MAX_ID_CHARS = 128
MAX_ERROR_MESSAGE = 2000


class ErrorCode(str, enum.Enum):
    """Stable error codes: scripts and clients match on these, never on messages."""

    BAD_REQUEST = "bad_request"  # malformed header, wrong argument types, missing/extra frames
    UNSUPPORTED_VERSION = "unsupported_version"  # header "v" is not a version this daemon speaks
    UNKNOWN_COMMAND = "unknown_command"
    TOO_LARGE = "too_large"  # over the frame-count or total-size cap
    BAD_WEIGHTS = "bad_weights"  # a push that does not fit the policy (nothing changed)
    NO_WEIGHTS = "no_weights"  # the configured policy has no weights to push
    NO_SUCH_WORKER = "no_such_worker"
    WORKER_FAILED = "worker_failed"  # a (re)started worker did not come up: it failed (status shows why)
    TIMEOUT = "timeout"  # workers did not acknowledge within the deadline (the change stays requested)
    BUSY = "busy"  # too many slow commands in flight; retry later
    RELOAD_FAILED = "reload_failed"  # the config file is wrong; the running config is kept
    PROFILE_FAILED = "profile_failed"  # profiling is off, or the worker could not record or write the trace
    SNAPSHOT_EXISTS = "snapshot_exists"  # a snapshot of that name exists (it is left as it was)
    SNAPSHOT_FAILED = "snapshot_failed"  # the snapshot could not be written (disk full, no storage...)
    UNAVAILABLE = "unavailable"  # the daemon is shutting down
    INTERNAL = "internal"  # a bug: the daemon logged a traceback

    @property
    def retryable(self) -> bool:
        """True when the same request may succeed later without changes."""
        return self in (ErrorCode.TIMEOUT, ErrorCode.BUSY, ErrorCode.UNAVAILABLE)


class RequestError(Exception):
    """Raised while decoding or handling a request; becomes an error reply (server side)."""

    def __init__(self, code: ErrorCode, message: str, details: dict | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}  # extra fields of the error object (a timed-out push's ``version``)


@dataclass(frozen=True)
class Limits:
    """What the daemon accepts in one request (``MAXMSGSIZE`` is set per frame on the socket)."""

    max_frames: int = 8  # header + payloads
    max_total_bytes: int = 256 << 20
    max_header_bytes: int = MAX_HEADER_BYTES

    def check_sizes(self, sizes: Sequence[int]) -> None:
        if not sizes:
            raise RequestError(ErrorCode.BAD_REQUEST, "empty message: frame 0 must be the JSON header")
        if len(sizes) > self.max_frames:
            raise RequestError(ErrorCode.TOO_LARGE, f"{len(sizes)} frames, over the limit of {self.max_frames}")
        total = sum(sizes)
        if total > self.max_total_bytes:
            raise RequestError(ErrorCode.TOO_LARGE,
                               f"{total} bytes in one request, over the limit of {self.max_total_bytes} "
                               "(control.max_message_bytes)")
        if sizes[0] > self.max_header_bytes:
            raise RequestError(ErrorCode.TOO_LARGE,
                               f"header frame is {sizes[0]} bytes, over the limit of {self.max_header_bytes}; "
                               "binary data belongs in payload frames")


@dataclass(frozen=True)
class Header:
    """A parsed frame 0."""

    id: str | int
    cmd: str
    args: dict[str, Any]


RequestId = str | int | None


def socket_file(address: str) -> str | None:
    """The file of an ipc:// address (None for tcp:// and abstract ``ipc://@name`` sockets)."""
    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        return address[len("ipc://"):]
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Built once: json.loads/dumps with options construct a new decoder/encoder on every call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _loads(data: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity constants."""
    return _DECODER.decode(data.decode("utf-8"))


def dumps(obj: Any) -> bytes:
    """Compact, strict JSON (NaN is not JSON: encode it as ``None`` before calling)."""
    return _ENCODER.encode(obj).encode()


def peek_id(data: bytes) -> RequestId:
    """The request id of a header that failed to parse fully, if it can be found (else None)."""
    try:
        obj = _loads(data)
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict):
        return _valid_id(obj.get("id"))
    return None


def _valid_id(value: Any) -> RequestId:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and -2**63 <= value < 2**63:
        return value
    if isinstance(value, str) and len(value) <= MAX_ID_CHARS:
        return value
    return None


HEADER_FIELDS = frozenset({"v", "id", "cmd", "args"})


def parse_header(data: bytes) -> Header:
    """Validate frame 0; raise ``RequestError`` naming what is wrong."""
    try:
        obj = _loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(ErrorCode.BAD_REQUEST, f"frame 0 is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, f"frame 0 must be a JSON object, got {type(obj).__name__}")
    if not obj.keys() <= HEADER_FIELDS:
        raise RequestError(ErrorCode.BAD_REQUEST, f"unknown header field(s) {sorted(obj.keys() - HEADER_FIELDS)[:5]}")
    version = obj.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise RequestError(ErrorCode.UNSUPPORTED_VERSION,
                           f"protocol version {version!r} is not supported; this daemon speaks v={PROTOCOL_VERSION}")
    request_id = _valid_id(obj.get("id"))
    if request_id is None:
        raise RequestError(ErrorCode.BAD_REQUEST,
                           f"'id' must be a string of at most {MAX_ID_CHARS} characters or a 64-bit integer")
    cmd = obj.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise RequestError(ErrorCode.BAD_REQUEST, "'cmd' must be a non-empty string")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, f"'args' must be a JSON object, got {type(args).__name__}")
    return Header(request_id, cmd, args)


def encode_header(request_id: str | int, cmd: str, args: dict[str, Any]) -> bytes:
    return b'{"v":%d,"id":%s,"cmd":%s,"args":%s}' % (PROTOCOL_VERSION, encode_id(request_id), dumps(cmd),
                                                      dumps(args) if args else b"{}")


class Preencoded:
    """A JSON value encoded once and spliced into many replies as it is (the config in every
    status reply: encoding it per request would cost more than the rest of the status)."""

    __slots__ = ("text",)

    def __init__(self, value: Any):
        self.text = encode_value(value)


def encode_value(value: Any) -> bytes:
    """Strict JSON of a result: NaN and infinities become null, and the top-level ``Preencoded``
    values of a dict (or the value itself) are spliced in as they are."""
    if isinstance(value, Preencoded):
        return value.text
    spliced = b""
    if isinstance(value, dict) and any(isinstance(v, Preencoded) for v in value.values()):
        spliced = b",".join(dumps(k) + b":" + v.text for k, v in value.items() if isinstance(v, Preencoded))
        value = {k: v for k, v in value.items() if not isinstance(v, Preencoded)}
    try:
        text = dumps(value)
    except ValueError:  # a NaN or infinity somewhere: strict JSON says null
        text = dumps(jsonable(value))
    if spliced:
        text = text[:-1] + (b"," if len(text) > 2 else b"") + spliced + b"}"
    return text


def encode_id(request_id: RequestId) -> bytes:
    """The JSON of a valid request id (``_valid_id``), without the general encoder's cost."""
    if type(request_id) is str:
        return encode_basestring_ascii(request_id).encode()
    if type(request_id) is int:
        return b"%d" % request_id
    return dumps(request_id)


def encode_result(request_id: RequestId, result: Any) -> bytes:
    """A success reply (``result`` as ``encode_value`` encodes it)."""
    return b'{"v":%d,"id":%s,"ok":true,"result":%s}' % (PROTOCOL_VERSION, encode_id(request_id), encode_value(result))


def encode_error(request_id: RequestId, code: ErrorCode, message: str, details: dict | None = None) -> bytes:
    message = message if len(message) <= MAX_ERROR_MESSAGE else message[:MAX_ERROR_MESSAGE] + "..."
    return dumps({"v": PROTOCOL_VERSION, "id": request_id, "ok": False,
                  "error": {**(details or {}), "code": code.value, "message": message}})


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class Reply:
    """A decoded reply (client side)."""

    id: RequestId
    ok: bool
    result: Any = None
    code: str | None = None
    message: str | None = None
    details: dict | None = None  # the error object's other fields

    def unwrap(self) -> Any:
        """The result, or ``CommandFailed`` carrying the stable error code (for ``bad_weights``
        its subclass ``WeightsRejected``, which is a ``BadWeights`` too)."""
        if self.ok:
            return self.result
        raise _FAILURES.get(self.code, CommandFailed)(self.code, self.message, self.details)


_FAILURES: dict[str | None, type[CommandFailed]] = {ErrorCode.BAD_WEIGHTS.value: WeightsRejected}


def decode_reply(frames: Sequence[bytes]) -> Reply:
    """Parse a reply; raise ``BadReply`` if it is not one."""
    if len(frames) != 1:
        raise BadReply(f"a reply is one frame, got {len(frames)}; is this an ingestd control socket?")
    try:
        obj = _loads(frames[0])
    except (ValueError, RecursionError) as exc:
        raise BadReply(f"reply is not UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("v") != PROTOCOL_VERSION or not isinstance(obj.get("ok"), bool):
        raise BadReply(f"reply is not a v{PROTOCOL_VERSION} ingestd reply: {str(obj)[:200]}")
    if obj["ok"]:
        if "result" not in obj:
            raise BadReply("success reply without 'result'")
        return Reply(obj.get("id"), True, result=obj["result"])
    error = obj.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        raise BadReply(f"error reply without an error code: {str(obj)[:200]}")
    details = {k: v for k, v in error.items() if k not in ("code", "message")}
    return Reply(obj.get("id"), False, code=error["code"], message=str(error.get("message", "")), details=details)
