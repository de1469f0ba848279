"""The config schema: frozen dataclasses whose fields carry their own docs and rules.

Every setting is declared once, with :func:`setting`, which puts in the field's
metadata:

- ``doc``: one or two sentences (the README reference and the commented
  default file are generated from it);
- ``rule``: a :class:`Rule` that checks a raw TOML value and returns the typed
  value, raising :class:`~ingestd.errors.ConfigError` naming the key and the
  accepted values;
- ``live``: whether a change can be applied on SIGHUP without a restart.

This module only declares; :mod:`ingestd.service.config` parses, loads, writes
and diffs. Cross-field rules live there too, so all checking is in one place.
"""
from __future__ import annotations

import abc
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ingestd.errors import ConfigError
from ingestd.service.config_toml import (  # noqa: F401  (re-exported for ingestd.service.config)
    TOML_SCALARS, FrozenTable, describe, freeze, suggest, thaw, toml_key, toml_string, toml_value,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
START_WEIGHTS = ("resume", "initial")  # service.start_weights
ENV_ALIASES = ("CartPole", "Pixels", "Checksum", "Gym")
POLICY_ALIASES = ("Random", "MLP")
MAX_WORKERS = 256  # the stats block has one record per worker (ingestd.collect.stats.MAX_WORKERS)
IPC_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
MiB = 1 << 20


# -- rules ----------------------------------------------------------------------
class Rule(abc.ABC):
    """Checks one raw value; ``accepted`` says what is allowed, in every error."""

    accepted = "a value"

    @abc.abstractmethod
    def check(self, key: str, value: Any) -> Any:
        """The typed value, or raise :class:`ConfigError` naming ``key``."""

    def fail(self, key: str, value: Any, hint: str = "") -> ConfigError:
        return ConfigError(key, f"expected {self.accepted}, got {describe(value)}{hint}")

    def _text(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self.fail(key, value)
        return value


@dataclass(frozen=True)
class Int(Rule):
    lo: int
    hi: int

    @property
    def accepted(self) -> str:
        """For the reference (docs/config.md): a 19-digit bound no setting reaches is left out there."""
        return f"an integer >= {self.lo}" if self.hi >= 2**62 else f"an integer in {self.lo}..{self.hi}"

    def fail(self, key: str, value: Any, hint: str = "") -> ConfigError:
        # an error names the real bounds: "an integer >= 0" cannot explain why 2**63 - 1 is refused
        return ConfigError(key, f"expected an integer in {self.lo}..{self.hi}, got {describe(value)}{hint}")

    def check(self, key: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            raise self.fail(key, value, f"; write it without a decimal point: {int(value)}")
        if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d[\d_]*\s*", value):
            raise self.fail(key, value, "; write the number without quotes")
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            raise self.fail(key, value)
        return value


@dataclass(frozen=True)
class Float(Rule):
    """A finite number above ``gt`` (or equal to it, ``or_equal``; integers are accepted and
    converted)."""

    gt: float
    unit: str = "seconds"
    or_equal: bool = False

    @property
    def accepted(self) -> str:
        return f"a finite number {'>=' if self.or_equal else '>'} {self.gt:g} ({self.unit})"

    def check(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, value, "; write the number without quotes" if isinstance(value, str) else "")
        if not math.isfinite(value) or not (value > self.gt or self.or_equal and value == self.gt):
            raise self.fail(key, value)
        return float(value)


@dataclass(frozen=True)
class UnitInterval(Rule):
    """A number in (0, 1] (a discount factor)."""

    accepted = "a number in (0, 1]"

    def check(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise self.fail(key, value)
        return float(value)


@dataclass(frozen=True)
class Number(Rule):
    """Any finite number (integers are accepted and converted)."""

    accepted = "a finite number"

    def check(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, value, "; write the number without quotes" if isinstance(value, str) else "")
        return float(value)


@dataclass(frozen=True)
class Bool(Rule):
    accepted = "true or false"

    def check(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            quoted = isinstance(value, str) and value.lower() in ("true", "false")
            raise self.fail(key, value, "; write it without quotes" if quoted else "")
        return value


@dataclass(frozen=True)
class Choice(Rule):
    """One of ``choices``, matched case-insensitively and returned in its canonical spelling."""

    choices: tuple[str, ...]

    @property
    def accepted(self) -> str:
        return "one of " + ", ".join(self.choices)

    def check(self, key: str, value: Any) -> str:
        text = self._text(key, value)
        for choice in self.choices:
            if text.lower() == choice.lower():
                return choice
        raise self.fail(key, value, suggest(text, self.choices))


@dataclass(frozen=True)
class Pattern(Rule):
    """A string matching ``regex`` in full (``empty_ok``: ``""`` also passes)."""

    regex: str
    what: str
    empty_ok: bool = False

    @property
    def accepted(self) -> str:
        return self.what

    def check(self, key: str, value: Any) -> str:
        text = self._text(key, value)
        if (text or not self.empty_ok) and not re.fullmatch(self.regex, text):
            raise self.fail(key, value)
        return text


_IMPORT_PATH = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"


@dataclass(frozen=True)
class Factory(Rule):
    """A built-in name or an import path ``package.module:factory``.

    With ``aliases`` the name must be one of them (case-insensitive, returned
    canonical); without, any identifier is accepted and resolved by the
    worker when it starts.
    """

    aliases: tuple[str, ...] = ()

    @property
    def accepted(self) -> str:
        names = ("one of " + ", ".join(self.aliases)) if self.aliases else "a built-in name (e.g. MLP)"
        return f"{names}, or an import path 'package.module:factory'"

    def check(self, key: str, value: Any) -> str:
        text = self._text(key, value)
        if ":" in text:
            if not re.fullmatch(_IMPORT_PATH, text):
                raise self.fail(key, value, "; an import path looks like 'mypkg.envs:make_env'")
            return text
        if "." in text:
            module, _, last = text.rpartition(".")
            guess = f"'{module}:{last}'" if last[:1].isupper() else f"'{module}:{last}' or '{text}:make'"
            raise self.fail(key, value, f"; an import path names the factory after a colon: {guess}")
        if not self.aliases:
            if not text.isidentifier():
                raise self.fail(key, value)
            return text
        for alias in self.aliases:
            if text.lower() == alias.lower():
                return alias
        raise self.fail(key, value, suggest(text, self.aliases))


@dataclass(frozen=True)
class PathSetting(Rule):
    """An absolute path (``~`` = the home directory) or ``""`` for ``empty``."""

    empty: str

    @property
    def accepted(self) -> str:
        return f'an absolute path (may start with ~/), or "" for {self.empty}'

    def check(self, key: str, value: Any) -> str:
        text = self._text(key, value)
        if "\0" in text:
            raise self.fail(key, value, "; the path contains a NUL character")
        if text and not (text.startswith("/") or text == "~" or text.startswith("~/")):
            raise self.fail(key, value, "; relative paths are ambiguous under systemd, write it in full")
        return text


_TCP = re.compile(r"tcp://(?P<host>[^\s/]+):(?P<port>\d+|\*)")  # "*" parsed to be refused by name


@dataclass(frozen=True)
class Address(Rule):
    """A ZeroMQ endpoint to bind: ``ipc:///abs/path``, ``ipc://@abstract`` or ``tcp://host:port``."""

    empty: str

    @property
    def accepted(self) -> str:
        return f'ipc:///absolute/path, ipc://@name, tcp://host:port, or "" for {self.empty}'

    def check(self, key: str, value: Any) -> str:
        text = self._text(key, value).strip()
        if not text:
            return text
        if text.startswith("ipc://"):
            path = text[len("ipc://"):]
            if not (path.startswith("/") or (path.startswith("@") and len(path) > 1)):
                raise self.fail(key, value)
            check_ipc_length(key, text)
            return text
        match = _TCP.fullmatch(text)
        if match is not None and match["port"] == "*":
            raise ConfigError(key, f"{text!r}: port * (any free port) is not supported, as clients could not "
                                   "find the port it gets; choose a port")
        if match is None or not 1 <= int(match["port"]) <= 65535:
            raise self.fail(key, value)
        return text


def check_ipc_length(key: str, address: str) -> None:
    """Raise if an ``ipc://`` socket path is longer than the kernel allows."""
    path = address[len("ipc://"):]
    if address.startswith("ipc://") and len(path.encode()) > IPC_PATH_MAX:
        raise ConfigError(key, f"the ipc socket path {path!r} is {len(path.encode())} bytes, longer than the "
                               f"{IPC_PATH_MAX} the OS allows; use a shorter path (e.g. a shorter "
                               "service.runtime_dir)")


@dataclass(frozen=True)
class Table(Rule):
    """A TOML table, frozen; every value must be writable back as TOML."""

    accepted = "a table (inline: { key = value, ... }, or a [section.key] table)"

    def check(self, key: str, value: Any) -> FrozenTable:
        if not isinstance(value, Mapping):
            raise self.fail(key, value)
        self._check_values(key, value)
        return FrozenTable(value)

    def _check_values(self, key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(key, f"table keys must be strings, got {k!r}")
                self._check_values(f"{key}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._check_values(f"{key}[{i}]", v)
        elif not isinstance(value, TOML_SCALARS):
            raise ConfigError(key, f"got {describe(value)}; use a string, number, boolean, date/time, "
                                   "array or table")


# -- the schema -----------------------------------------------------------------
def setting(default: Any, doc: str, rule: Rule, *, live: bool = False) -> Any:
    """A config field: its default, its one-place doc, its rule and whether it reloads live."""
    return field(default=default, metadata={"doc": doc, "rule": rule, "live": live})


_HOST = r"[A-Za-z0-9_.:%-]+"  # a name, an IPv4 address or a bare IPv6 address (::1)


@dataclass(frozen=True)
class ServiceConfig:
    """The daemon process: where it keeps its files, logging, shutdown, seeding."""

    data_dir: str = setting(
        "", "Directory for persistent state (the replay storage by default). Empty: $STATE_DIRECTORY "
            "(set by systemd's StateDirectory=), else $XDG_STATE_HOME/ingestd, else ~/.local/state/ingestd.",
        PathSetting("the default"))
    runtime_dir: str = setting(
        "", "Directory for sockets, the weight store and the worker stats block. Empty: "
            "$RUNTIME_DIRECTORY (systemd's RuntimeDirectory=), else $XDG_RUNTIME_DIR/ingestd, "
            "else /tmp/ingestd-<uid>.",
        PathSetting("the default"))
    log_level: str = setting("info", "Log verbosity of the daemon.", Choice(LOG_LEVELS), live=True)
    stop_timeout_s: float = setting(
        10.0, "One deadline for shutdown: workers get this long to stop (join, then terminate, then kill).",
        Float(0.0), live=True)
    seed: int = setting(0, "Base random seed; each worker incarnation derives a distinct, reproducible seed.",
                        Int(0, 2**63 - 1))
    start_weights: str = setting(
        "resume", "The weights the daemon starts with when the previous daemon's weight store is still in "
                  "runtime_dir (a restart, or another `ingestd run` on the same runtime_dir): \"resume\" keeps "
                  "its last version current, so a trainer's pushes survive; \"initial\" publishes the policy's "
                  "initial weights. With no store there (a new runtime_dir; under systemd `systemctl stop` "
                  "removes /run/ingestd, `systemctl restart` keeps it) the initial weights are published either "
                  "way. New weights are numbered past the old store's version and every policy_version in the "
                  "replay, so versions never go backwards.", Choice(START_WEIGHTS))


@dataclass(frozen=True)
class ReplayConfig:
    """The shared replay storage every worker writes into and trainers sample from."""

    path: str = setting("", "Directory of the replay storage. Empty: <data_dir>/replay.",
                        PathSetting("<data_dir>/replay"))
    capacity: int = setting(
        1_000_000, "Rows (transitions) the ring holds. Must be at least 2 * max(workers.count, 1) * "
                   "workers.num_envs * workers.chunk_steps.", Int(1, 2**40))


@dataclass(frozen=True)
class WorkersConfig:
    """The collector worker processes: what they run and how the supervisor restarts them."""

    count: int = setting(2, "Number of collector worker processes (0 = collect nothing).",
                         Int(0, MAX_WORKERS), live=True)
    env: str = setting("CartPole", "Environment factory: a built-in (Gym takes env_kwargs = { id = ..., "
                                   "wrappers = [...] }: docs/envs.md) or an import path.", Factory(ENV_ALIASES))
    env_kwargs: FrozenTable = setting(FrozenTable(), "Keyword arguments for the env factory.", Table())
    num_envs: int = setting(64, "Sub-environments batched in each worker.", Int(1, 1 << 24))
    chunk_steps: int = setting(64, "Steps rolled out per chunk; one chunk = num_envs * chunk_steps rows. Larger "
                               "chunks spread each chunk's fixed work (assembling, checking and storing its rows; "
                               "the env stepping slower after it) over more frames; smaller ones apply pauses and "
                               "new weights sooner (both happen between chunks).", Int(1, 1 << 20))
    policy: str = setting("MLP", "Policy factory: a built-in name or an import path.", Factory(POLICY_ALIASES))
    policy_kwargs: FrozenTable = setting(FrozenTable(), "Keyword arguments for the policy factory.", Table())
    threads: int = setting(1, "Intra-op threads per worker (TorchRL's num_sub_threads default, 1); 0 = the CPU "
                              "cores shared out among the workers, again at each scale.", Int(0, 1024))
    device: str = setting("cpu", "Torch device the workers run env and policy on.",
                          Pattern(r"[a-z]+(:\d+)?", "a torch device such as cpu, cuda or cuda:1"))
    heartbeat_timeout_s: float = setting(
        5.0, "A running worker whose heartbeat is older than this is considered hung and restarted. Workers "
        "beat after every env step, so this bounds one step (the policy's action and the env's step), "
        "not a whole chunk.",
        Float(0.0), live=True)
    start_timeout_s: float = setting(
        60.0, "How long building the env and policy and their first reset, action and step may take: in "
              "the start-up probe (`ingestd run`, `ingestd config check`; past it the start fails naming the "
              "part still running, exit 78) and in each worker (past it the worker stops beating and is "
              "restarted as hung). 0 = no limit.", Float(0.0, or_equal=True))
    restart_backoff_s: float = setting(0.1, "First delay before restarting a dead worker; doubles per failure.",
                                       Float(0.0), live=True)
    restart_backoff_max_s: float = setting(2.0, "Upper bound of the restart delay (>= restart_backoff_s).",
                                           Float(0.0), live=True)
    restart_budget: int = setting(
        5, "Consecutive failures before a worker is marked failed: deaths before its first chunk, and deaths "
           "of its own (an error it exited with, a crash such as SIGSEGV, a hang) before collecting for "
           "restart_reset_s.", Int(1, 1_000_000), live=True)
    restart_reset_s: float = setting(
        10.0, "A worker that dies after collecting (writing chunks) for this long starts a fresh restart count "
              "and the first backoff; dying sooner doubles the backoff, and counts against restart_budget if it "
              "failed on its own (a SIGKILL or SIGTERM the daemon did not send, after a chunk, does not). 0 = "
              "its first chunk is enough.", Float(0.0, or_equal=True), live=True)
    action_bounds: str = setting(
        "refuse", "Actions outside the env's bounds (a Box's low/high, a discrete env's action count): refuse "
                  "(the chunk is not stored and the worker fails naming the first bad row), clip (clamped "
                  "before the env steps, and stored clamped) or off (stored as they come). Non-finite actions "
                  "are always refused.", Choice(("refuse", "clip", "off")))
    check_finite: bool = setting(
        True, "Refuse a chunk holding NaN or infinity in an observation or any other float leaf under 64 KiB "
              "per row (larger ones, float image stacks such as 4x84x84 float32, are not scanned: a pass over "
              "every byte); false stores them (envs that use inf on purpose). Rewards and actions are always "
              "checked.", Bool())
    failed_retry_s: float = setting(
        0.0, "A worker marked failed is started again, with a fresh restart budget, after this long (a "
             "simulator down for minutes, a flaky cluster); 0 = never (it stays failed until `ingestctl "
             "restart`).", Float(0.0, or_equal=True), live=True)
    # -- collector features (docs/collector-features.md; TorchRL names in docs/from-torchrl.md) --
    init_random_frames: int = setting(
        0, "Warm-up: until the replay's write_count reaches this, workers act with a uniform random policy "
           "and stamp policy_version = -1 (TorchRL init_random_frames). 0 = no warm-up.", Int(0, 2**62))
    max_episode_steps: int = setting(
        0, "Truncate episodes at this many steps (truncated, not terminated; TorchRL max_frames_per_traj). "
           "0 = no limit.", Int(0, 2**62))
    total_frames: int = setting(
        0, "Budget: once the replay's write_count reaches this, workers pause (reason budget) and the daemon "
           "keeps serving (TorchRL total_frames). 0 = collect forever.", Int(0, 2**62))
    n_step: int = setting(
        1, "Store n-step transitions (TorchRL MultiStep): discounted n-step return in (next, reward), the "
           "n-step-ahead next entries and steps_to_next_obs. 1 = plain transitions.", Int(1, 1024))
    gamma: float = setting(0.99, "Discount of the n-step return (used when n_step > 1).", UnitInterval())
    compile_policy: bool = setting(
        False, "torch.compile the policy in each worker (TorchRL compile_policy); see the benchmark in "
               "docs/collector-features.md before turning it on.", Bool())
    enable_profile: bool = setting(
        True, "Allow `ingestctl profile WORKER --seconds S` (a torch profiler trace of a worker's loop); "
              "false refuses the command.", Bool())


@dataclass(frozen=True)
class ControlConfig:
    """The ZeroMQ control socket and event publisher."""

    address: str = setting("", "Where the control ROUTER socket binds. tcp:// requires both CURVE keys.",
                           Address("ipc://<runtime_dir>/control.sock"))
    events_address: str = setting("", "Where the event PUB socket binds. tcp:// requires both CURVE keys.",
                                  Address("ipc://<runtime_dir>/events.sock"))
    curve_secret_key: str = setting("", "The daemon's CURVE secret key file (from `ingestctl keygen NAME "
                                        "[--dir D]`).", PathSetting("none"))
    curve_authorized_keys: str = setting("", "Directory of client CURVE public keys allowed to connect.",
                                         PathSetting("none"))
    max_message_bytes: int = setting(256 * MiB, "Largest message accepted (ZMQ_MAXMSGSIZE); bounds weight "
                                                "pushes.", Int(1024, 2**40))
    max_frames: int = setting(8, "Most frames in one request (JSON header + binary payloads).", Int(2, 1024))
    ack_timeout_s: float = setting(
        10.0, "How long a command waits for workers to acknowledge (pause, resume, restart, scale, weights "
        "applied) and for the main loop to take it (reload, limiter) when the request names no wait itself: "
        "ControlClient and ingestctl always name one (their ack_timeout / --wait, default 10 s), so this "
        "applies to raw protocol clients and to reload.",
        Float(0.0), live=True)


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus exporter."""

    enabled: bool = setting(True, "Serve Prometheus metrics over HTTP.", Bool())
    address: str = setting("127.0.0.1", "Interface the metrics HTTP server binds (0.0.0.0 = all).",
                           Pattern(_HOST, "a host name or IP address"))
    port: int = setting(9464, "TCP port of the metrics server; 0 = an ephemeral port.", Int(0, 65535))


@dataclass(frozen=True)
class LimiterConfig:
    """The replay rate limiter (Reverb semantics, docs/sampling.md): it keeps
    error = inserts * samples_per_insert - samples within [min_diff, max_diff]."""

    enabled: bool = setting(False, "Hold workers back when they are too far ahead of the trainers, and "
                                   "trainers when they are too far ahead of the workers.", Bool(), live=True)
    min_size: int = setting(1000, "Trainers wait until the replay holds this many rows; workers are never "
                                  "held back before it.", Int(0, 2**62), live=True)
    samples_per_insert: float = setting(1.0, "Target ratio of rows sampled to rows inserted.",
                                        Float(0.0, "samples per insert"), live=True)
    min_diff: float = setting(-100000.0, "Trainers wait while the error is below this.", Number(), live=True)
    max_diff: float = setting(100000.0, "Workers wait (at chunk boundaries) while the error is above this; "
                                        "max_diff - min_diff must be at least 2 * max(1, samples_per_insert).",
                              Number(), live=True)


@dataclass(frozen=True)
class Config:
    """The whole effective configuration: one frozen section per TOML table."""

    service: ServiceConfig = field(default_factory=ServiceConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    limiter: LimiterConfig = field(default_factory=LimiterConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dicts/lists, shaped like the TOML document (``config_from_dict`` reads it back)."""
        return {name: {key: thaw(getattr(getattr(self, name), key)) for key in section_keys(cls)}
                for name, cls in SECTIONS.items()}


SECTIONS: dict[str, type] = {
    "service": ServiceConfig, "replay": ReplayConfig, "workers": WorkersConfig,
    "control": ControlConfig, "metrics": MetricsConfig, "limiter": LimiterConfig,
}


def section_keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))
