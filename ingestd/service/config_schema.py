"""The config schema: frozen dataclasses whose fields carry their own docs and rules.

Every setting is declared once, with :func:`setting`, which puts in the field's
metadata:

- ``doc``: one or two sentences (the README reference and the commented
  default file are generated from it);
- ``rule``: a :class:`Rule` that checks a raw TOML value and returns the typed
  value, raising :class:`~ingestd.errors.ConfigError` naming the key and the
  accepted values;
- ``live``: whether a change can be applied on SIGHUP without a restart.

This module only declares (the rules are :mod:`ingestd.service.config_rules`);
:mod:`ingestd.service.config` parses, loads, writes
and diffs. Cross-field rules live there too, so all checking is in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ingestd.service.config_rules import (  # noqa: F401  (Address, check_ipc_length, IPC_PATH_MAX: re-exported)
    IPC_PATH_MAX, Address, Ascending, Bool, Choice, Factory, Float, Int, Number, PathSetting, Pattern, Rule, Table, UnitInterval,
    check_ipc_length,
)
from ingestd.service.config_toml import (  # noqa: F401  (re-exported for ingestd.service.config)
    TOML_SCALARS, FrozenTable, describe, freeze, suggest, thaw, toml_key, toml_string, toml_value,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
START_WEIGHTS = ("resume", "initial")  # service.start_weights
ENV_ALIASES = ("CartPole", "Pixels", "Checksum", "Gym")
POLICY_ALIASES = ("Random", "MLP")
MAX_WORKERS = 256  # the stats block has one record per worker (ingestd.collect.stats.MAX_WORKERS)
MiB = 1 << 20


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
    inference_mode: bool = setting(
        True, "Run the workers' env and policy under torch.inference_mode() (faster small torch steps: "
              "docs/collector-features.md); false = torch.no_grad(), for a policy that turns autograd on "
              "inside a step (a gradient-based planner).", Bool())
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
    episode_return_buckets: tuple = setting(
        (), "Upper bounds of the ingestd_episode_return histogram's buckets, for your task's scale of returns "
            "(histogram_quantile() interpolates inside a bucket: the narrower they are where the returns are, the "
            "truer the quantiles). Empty: the built-in ones, 10 per decade (1, 1.25, 1.6, 2, 2.5, 3.15, 4, 5, 6.3, 8, "
            "10, ...) from 1 to 100000, the same below 0, and 0.", Ascending(200))


@dataclass(frozen=True)
class LimiterConfig:
    """The replay rate limiter (Reverb semantics, docs/sampling.md): it keeps
    error = inserts * samples_per_insert - samples within [min_diff, max_diff]."""

    enabled: bool = setting(False, "Hold workers back when they are too far ahead of the trainers, and "
                                   "trainers when they are too far ahead of the workers.", Bool(), live=True)
    min_size: int = setting(1000, "Trainers wait until the replay holds this many rows; workers are never "
                                  "held back before it. Enabled, it must not exceed a workers.total_frames budget "
                                  "(the rows would never come).", Int(0, 2**62), live=True)
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
