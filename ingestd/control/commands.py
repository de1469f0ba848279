"""One small message type per command, and typed results.

A request class declares its arguments as dataclass fields whose metadata
holds a checker; :meth:`Request.decode` validates untrusted ``args`` and
payload frames with them (unknown keys, wrong types and out-of-range values
are ``bad_request``). The client builds the same classes and calls
:meth:`Request.encode`. ``COMMANDS`` maps wire names to classes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

from ingestd.collect import profiling
from ingestd.control.protocol import ErrorCode, RequestError
from ingestd.errors import BadReply

MAX_WORKERS = 256  # ingestd.collect.stats.MAX_WORKERS (kept import-free: clients need no torch)
MAX_WAIT_S = 3600.0

Check = Callable[[str, Any], Any]


def _fail(name: str, expected: str, value: Any) -> RequestError:
    try:
        shown = repr(value)
    except ValueError:  # an integer of more digits than Python prints (sys.get_int_max_str_digits)
        shown = "an integer too large to show"
    shown = shown if len(shown) <= 60 else shown[:60] + "..."
    return RequestError(ErrorCode.BAD_REQUEST, f"argument {name!r} must be {expected}, got {shown}")


def _int(lo: int, hi: int) -> Check:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _fail(name, f"an integer in {lo}..{hi}", value)
        return value
    return check


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "true or false", value)
    return value


def _finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number (not a bool), else None: also an integer
    too large for a float (``math.isfinite(10**400)`` raises OverflowError: an ``internal`` reply)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _seconds(name: str, value: Any) -> float | None:
    if value is None:
        return None
    number = _finite(value)
    if number is None or not 0 < number <= MAX_WAIT_S:
        raise _fail(name, f"null or a number of seconds in (0, {MAX_WAIT_S:g}]", value)
    return number


def _workers(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > MAX_WORKERS:
        raise _fail(name, f"null (all) or a non-empty list of at most {MAX_WORKERS} worker indices", value)
    check = _int(0, MAX_WORKERS - 1)
    return tuple(sorted({check(f"{name}[{i}]", v) for i, v in enumerate(value)}))


def arg(default: Any, check: Check) -> Any:
    return field(default=default, metadata={"check": check})


def _timeout() -> Any:
    return arg(None, _seconds)


_CHECKS: dict[type, dict[str, Check]] = {}


# -- requests -------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """Base of every command message."""

    cmd: ClassVar[str]
    payload_frames: ClassVar[tuple[int, int]] = (0, 0)  # (min, max) binary frames after the header
    idempotent: ClassVar[bool] = True  # the client may resend it after a timeout

    @classmethod
    def decode(cls, args: dict[str, Any], payload: Sequence[Any]) -> Request:
        """Build from untrusted ``args`` and payload frames; ``RequestError`` if they do not fit."""
        lo, hi = cls.payload_frames
        if not lo <= len(payload) <= hi:
            want = f"{lo}" if lo == hi else f"{lo} to {hi}"
            raise RequestError(ErrorCode.BAD_REQUEST, f"{cls.cmd} takes {want} payload frame(s), got {len(payload)}")
        checks = cls._checks()
        if not args and not payload:
            return cls._build({}, ())
        unknown = sorted(set(args) - set(checks))
        if unknown:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"{cls.cmd} has no argument(s) {unknown[:5]}; it takes {sorted(checks) or 'none'}")
        values = {name: check(name, args[name]) for name, check in checks.items() if name in args}
        return cls._build(values, tuple(payload))

    @classmethod
    def _checks(cls) -> dict[str, Check]:
        """``{argument: checker}``, computed once per class."""
        checks = _CHECKS.get(cls)
        if checks is None:
            checks = _CHECKS[cls] = {f.name: f.metadata["check"] for f in dataclasses.fields(cls)
                                     if "check" in f.metadata}
        return checks

    @classmethod
    def _build(cls, values: dict[str, Any], payload: tuple) -> Request:
        return cls(**values)

    def encode(self) -> tuple[dict[str, Any], list[Any]]:
        """``(args, payload frames)`` for the wire."""
        args = {}
        for name in self._checks():
            value = getattr(self, name)
            args[name] = list(value) if isinstance(value, tuple) else value
        return args, []

    @property
    def wait_s(self) -> float | None:
        """How long the daemon may wait for workers, as asked (None: its ack_timeout_s)."""
        return getattr(self, "timeout_s", None)


@dataclass(frozen=True)
class Ping(Request):
    cmd: ClassVar[str] = "ping"


@dataclass(frozen=True)
class GetStatus(Request):
    cmd: ClassVar[str] = "status"


@dataclass(frozen=True)
class GetConfig(Request):
    cmd: ClassVar[str] = "config"


@dataclass(frozen=True)
class Pause(Request):
    cmd: ClassVar[str] = "pause"
    timeout_s: float | None = _timeout()


@dataclass(frozen=True)
class Resume(Request):
    cmd: ClassVar[str] = "resume"
    timeout_s: float | None = _timeout()


@dataclass(frozen=True)
class Restart(Request):
    cmd: ClassVar[str] = "restart"
    idempotent: ClassVar[bool] = False
    workers: tuple[int, ...] | None = arg(None, _workers)
    wait: bool = arg(True, _bool)
    timeout_s: float | None = _timeout()


@dataclass(frozen=True)
class Scale(Request):
    cmd: ClassVar[str] = "scale"
    count: int = arg(None, _int(0, MAX_WORKERS))
    wait: bool = arg(True, _bool)
    timeout_s: float | None = _timeout()

    @classmethod
    def _build(cls, values: dict[str, Any], payload: tuple) -> Request:
        if "count" not in values:
            raise RequestError(ErrorCode.BAD_REQUEST, "scale needs argument 'count' (the number of workers)")
        return cls(**values)


@dataclass(frozen=True)
class PushWeights(Request):
    """Payload: the weights wire format (``ingestd.weights.encode``): manifest JSON + lz4 frame."""

    cmd: ClassVar[str] = "push_weights"
    payload_frames: ClassVar[tuple[int, int]] = (2, 2)
    idempotent: ClassVar[bool] = False
    wait: bool = arg(True, _bool)
    timeout_s: float | None = _timeout()
    frames: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def _build(cls, values: dict[str, Any], payload: tuple) -> Request:
        return cls(**values, frames=payload)

    def encode(self) -> tuple[dict[str, Any], list[Any]]:
        args, _ = super().encode()
        return args, list(self.frames)


@dataclass(frozen=True)
class Reload(Request):
    cmd: ClassVar[str] = "reload"


MAX_PROFILE_S = profiling.MAX_SECONDS


def _profile_seconds(name: str, value: Any) -> float:
    number = _finite(value)
    if number is None or not 0 < number <= MAX_PROFILE_S:
        raise _fail(name, f"a number of seconds in (0, {MAX_PROFILE_S:g}]", value)
    return number


@dataclass(frozen=True)
class Profile(Request):
    """Record a torch profiler trace of one worker's loop for ``seconds`` (it keeps collecting)."""

    cmd: ClassVar[str] = "profile"
    idempotent: ClassVar[bool] = False
    worker: int = arg(None, _int(0, MAX_WORKERS - 1))
    seconds: float = arg(profiling.DEFAULT_SECONDS, _profile_seconds)

    @classmethod
    def _build(cls, values: dict[str, Any], payload: tuple) -> Request:
        if "worker" not in values:
            raise RequestError(ErrorCode.BAD_REQUEST, "profile needs argument 'worker' (a worker index)")
        return cls(**values)

    @property
    def wait_s(self) -> float:
        return self.seconds + profiling.write_allowance(self.seconds)  # the worker's lease for the write


def _optional(check: Check) -> Check:
    return lambda name, value: None if value is None else check(name, value)


def _number(name: str, value: Any) -> float:
    number = _finite(value)
    if number is None:
        raise _fail(name, "a finite number", value)
    return number


@dataclass(frozen=True)
class SetLimiter(Request):
    """Read the rate limiter, or change it live (only the arguments given; checked as a whole).
    ``timeout_s``: how long a change may retry a ``limiter.bin`` a trainer holds before the
    reply says ``busy`` (the daemon's ``ack_timeout_s`` if None); a client sends its own, so
    it waits as long as the daemon may."""

    cmd: ClassVar[str] = "limiter"
    timeout_s: float | None = _timeout()
    enabled: bool | None = arg(None, _optional(_bool))
    min_size: int | None = arg(None, _optional(_int(0, 2**62)))
    samples_per_insert: float | None = arg(None, _optional(_number))
    min_diff: float | None = arg(None, _optional(_number))
    max_diff: float | None = arg(None, _optional(_number))


MAX_SNAPSHOT_NAME = 100  # ingestd.replay.snapshot.check_name (kept import-free, as MAX_WORKERS)
SNAPSHOT_WAIT_S = 300.0  # how long clients wait for a snapshot's reply by default (the daemon sets no deadline)


def _snapshot_name(name: str, value: Any) -> str | None:
    """Type and length only: the daemon checks the characters (``check_name``) before it writes."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_SNAPSHOT_NAME:
        raise _fail(name, f"null (a name from the time) or a file name of 1..{MAX_SNAPSHOT_NAME} characters", value)
    return value


@dataclass(frozen=True)
class Snapshot(Request):
    """Copy the replay's committed rows into ``<data_dir>/snapshots/<name>`` (lz4) while workers collect."""

    cmd: ClassVar[str] = "snapshot"
    idempotent: ClassVar[bool] = False  # a resend would write a second snapshot, or find the first one
    name: str | None = arg(None, _snapshot_name)


COMMANDS: dict[str, type[Request]] = {
    cls.cmd: cls for cls in (Ping, GetStatus, GetConfig, Pause, Resume, Restart, Scale, PushWeights, Reload,
                             Profile, SetLimiter, Snapshot)
}


# -- results ----------------------------------------------------------------------
class Result:
    """Typed results: ``to_json`` on the daemon, ``from_json`` (lenient about extra keys) on the client."""

    _names: ClassVar[dict[type, tuple[str, ...]]] = {}
    _optional: ClassVar[dict[type, frozenset[str]]] = {}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        names = Result._names.get(cls)
        if names is None:
            fields = dataclasses.fields(cls)  # type: ignore[arg-type]
            names = Result._names[cls] = tuple(f.name for f in fields)
            # fields added to the protocol later have a default: a reply from an older daemon lacks them
            Result._optional[cls] = frozenset(f.name for f in fields if f.default is not dataclasses.MISSING
                                              or f.default_factory is not dataclasses.MISSING)
        return names

    @classmethod
    def required_names(cls) -> frozenset[str]:
        """The fields a reply must have (the others were added later, with defaults)."""
        return frozenset(cls.field_names()) - Result._optional[cls]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dicts (shallow: a copy of the fields, which a dataclass keeps in order)."""
        return dict(vars(self))

    @classmethod
    def from_json(cls, obj: Any):
        if not isinstance(obj, dict):
            raise BadReply(f"{cls.__name__}: expected a JSON object, got {type(obj).__name__}")
        names = cls.field_names()
        try:
            return cls(**{name: obj[name] for name in names})
        except KeyError:
            missing = sorted(cls.required_names() - obj.keys())
            if missing:
                raise BadReply(f"{cls.__name__} reply lacks {missing}; is the daemon a different version?") from None
            return cls(**{name: obj[name] for name in names if name in obj})


@dataclass(frozen=True)
class Pong(Result):
    """``ping``: the daemon is there, and where its other endpoints are."""

    pong: bool
    pid: int
    version: str  # ingestd's
    protocol: int
    events_address: str  # as bound (a wildcard tcp bind: connect to the control host, events_address())
    time: float
    metrics_url: str | None = ""  # the /metrics page as bound (also with metrics.port = 0); None: metrics are off
    # (or not serving yet); "": not reported, by a daemon older than this field
    max_message_bytes: int | str = ""  # control.max_message_bytes: the largest request taken ("": not reported)
    events_local: str | None = None  # the local ipc event socket beside a tcp:// events_address (no CURVE)
    host: str = ""  # host_identity() of the daemon's host: its ipc sockets are not another host's ("": not reported)


@dataclass(frozen=True)
class WorkerStatus(Result):
    index: int
    state: str
    pid: int
    incarnation: int
    frames: int
    frames_per_s: float
    episodes: int
    last_return: float | None
    restarts: int
    weights_version: int
    heartbeat_age_s: float | None
    error: str
    pause_reason: str = ""  # while paused: "requested" (pause command) or "budget" (workers.total_frames)
    recent_returns: list[float] = field(default_factory=list)  # last finished episodes, oldest first (<= 32)
    error_age_s: float | None = None  # seconds since ``error`` was set (None: no error, or an older daemon)


@dataclass(frozen=True)
class ReplayStatus(Result):
    path: str
    rows: int
    capacity: int
    write_count: int


@dataclass(frozen=True)
class Status(Result):
    pid: int
    uptime_s: float
    desired: str
    count: int  # workers wanted (scale)
    weights_version: int
    replay: ReplayStatus
    workers: list[WorkerStatus]
    config: dict[str, Any]  # the daemon passes it pre-encoded (protocol.Preencoded); clients get a dict
    metrics_url: str | None = ""  # as in Pong ("": not reported, by a daemon older than this field)
    weights_path: str | None = ""  # the weight store trainers follow (None: no policy weights; "": older daemon)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["replay"] = self.replay.to_json()
        out["workers"] = [w.to_json() for w in self.workers]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Status:
        if not isinstance(obj, dict) or not obj.keys() >= cls.required_names():
            return Result.from_json.__func__(cls, obj)  # type: ignore[attr-defined]  # BadReply: says what is wrong
        if not isinstance(obj["workers"], list):
            raise BadReply("status 'workers' must be a list")
        nested = {"replay": ReplayStatus.from_json(obj.get("replay")),
                  "workers": [WorkerStatus.from_json(w) for w in obj["workers"]]}
        return Result.from_json.__func__(cls, {**obj, **nested})  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Acked(Result):
    """pause / resume / restart / scale: which workers acknowledged, and how long it took."""

    workers: list[int]
    seconds: float


@dataclass(frozen=True)
class Pushed(Result):
    version: int
    applied: list[int]  # live workers that applied it before the reply (wait=true)
    deferred: list[int]  # paused workers: they apply it before their next chunk
    seconds: float
    # (wait=true) workers that were collecting but died, failed or stopped before applying it;
    # a worker that restarts loads the current version before it collects
    dropped: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Profiled(Result):
    worker: int
    path: str  # the Chrome trace (chrome://tracing, Perfetto) the worker wrote
    seconds: float


@dataclass(frozen=True)
class Snapshotted(Result):
    """A snapshot written (``ingestd.replay.snapshot.SnapshotInfo``)."""

    path: str  # the snapshot directory, on the daemon's host
    capacity: int
    write_count: int  # the storage's write count, read after the copy
    rows: int  # committed rows copied
    skipped: int  # rows left out because a worker was writing them
    bytes: int  # size of the snapshot on disk
    seconds: float


@dataclass(frozen=True)
class Reloaded(Result):
    applied: list[str]
    not_applied: list[str]  # changed keys that need a restart of the daemon
    config_file: str | None = ""  # the file re-read; None: the embedded default config; "": not reported (older daemon)
    authorized_keys: int | None = None  # CURVE client keys authorised after the reload; None: no CURVE
    authorized_keys_error: str | None = None  # why the keys directory could not be re-read (the old keys stay)


@dataclass(frozen=True)
class LimiterState(Result):
    """The rate limiter's parameters and state (``error = inserts * spi - samples``, re-anchored on change)."""

    enabled: bool
    min_size: int
    samples_per_insert: float
    min_diff: float
    max_diff: float
    inserts: int
    samples: int
    error: float | None  # None while disabled: no error is kept then (the metric is NaN)
    reader_blocked_s: float  # total time readers waited on the limiter
    reader_waits: int
    workers_blocked: list[int]  # workers held back right now
    workers_blocked_s: float  # total time workers were held back
    sampled_policy_lag: list[float] | None  # [min, mean, max] of the latest sample a reader took
    reader_refusals: int | str = ""  # samples without a timeout refused at once ("": not reported, older daemon)
