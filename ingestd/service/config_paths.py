"""Where a daemon's files and sockets go: the "" (default) settings of a :class:`Config`
filled in from an ``environ`` mapping (systemd's ``*_DIRECTORY``, then XDG, then a
fallback), never from the process environment itself (the daemon passes ``os.environ``).
"""
from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ingestd.errors import ConfigError
from ingestd.service.config_schema import Address, Config, check_ipc_length


@dataclass(frozen=True)
class ResolvedPaths:
    """Concrete locations once the "" defaults are filled in (see :func:`resolve_paths`)."""

    data_dir: Path
    runtime_dir: Path
    replay: Path  # replay storage directory
    weights: Path  # shared weight store
    stats: Path  # per-worker stats block
    control: str  # ZeroMQ endpoint of the control socket
    events: str  # ZeroMQ endpoint of the event publisher
    curve_secret_key: Path | None
    curve_authorized_keys: Path | None


def _home(environ: Mapping[str, str], uid: int, key: str) -> Path:
    home = environ.get("HOME", "")
    if home.startswith("/"):
        return Path(home)
    try:
        return Path(pwd.getpwuid(uid).pw_dir)
    except KeyError:
        raise ConfigError(key, f"no home directory for uid {uid} and no $HOME; set {key} explicitly") from None


def _expand(value: str, environ: Mapping[str, str], uid: int, key: str) -> Path | None:
    """A configured path with ``~`` expanded, or ``None`` for "" (use the default)."""
    if not value:
        return None
    if value == "~" or value.startswith("~/"):
        return _home(environ, uid, key) / value[2:]
    return Path(value)


def _env_dir(environ: Mapping[str, str], name: str) -> Path | None:
    """An absolute directory from ``$name`` (the first, for systemd's colon-separated lists)."""
    value = environ.get(name, "").split(":")[0]
    return Path(value) if value.startswith("/") else None


def _default_dir(environ: Mapping[str, str], systemd: str, xdg: str, fallback: Callable[[], Path]) -> Path:
    """``$systemd`` (set by systemd's *Directory=), else ``$xdg/ingestd``, else ``fallback()``."""
    if (own := _env_dir(environ, systemd)) is not None:
        return own
    if (base := _env_dir(environ, xdg)) is not None:
        return base / "ingestd"
    return fallback()


def default_data_dir(environ: Mapping[str, str], uid: int | None = None) -> Path:
    """$STATE_DIRECTORY, else $XDG_STATE_HOME/ingestd, else ~/.local/state/ingestd."""
    uid = os.getuid() if uid is None else uid
    return _default_dir(environ, "STATE_DIRECTORY", "XDG_STATE_HOME",
                        lambda: _home(environ, uid, "service.data_dir") / ".local" / "state" / "ingestd")


def default_runtime_dir(environ: Mapping[str, str], uid: int | None = None) -> Path:
    """$RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/ingestd, else /tmp/ingestd-<uid>."""
    uid = os.getuid() if uid is None else uid
    return _default_dir(environ, "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR", lambda: Path(f"/tmp/ingestd-{uid}"))


def default_control_address(environ: Mapping[str, str], uid: int | None = None) -> str:
    """Where a client connects: $INGESTD_CONTROL if set, else the daemon's default ipc socket."""
    explicit = environ.get("INGESTD_CONTROL", "").strip()
    if explicit:
        try:
            return Address("a daemon address").check("INGESTD_CONTROL", explicit)
        except ConfigError as exc:  # an environment variable, not a config key (walkthrough review)
            exc.args = (f"environment variable INGESTD_CONTROL: {exc.message}",)
            raise
    return f"ipc://{default_runtime_dir(environ, uid)}/control.sock"


def resolve_paths(config: Config, environ: Mapping[str, str], uid: int | None = None) -> ResolvedPaths:
    """Fill in every "" default of ``config`` from ``environ`` (the daemon passes ``os.environ``)."""
    uid = os.getuid() if uid is None else uid
    s, c = config.service, config.control
    data_dir = _expand(s.data_dir, environ, uid, "service.data_dir") or default_data_dir(environ, uid)
    runtime_dir = _expand(s.runtime_dir, environ, uid, "service.runtime_dir") or default_runtime_dir(environ, uid)
    control = c.address or f"ipc://{runtime_dir}/control.sock"
    events = c.events_address or f"ipc://{runtime_dir}/events.sock"
    check_ipc_length("control.address", control)
    check_ipc_length("control.events_address", events)
    if control == events:
        raise ConfigError("control.events_address", f"must differ from control.address (both are {control})")
    return ResolvedPaths(
        data_dir=data_dir, runtime_dir=runtime_dir,
        replay=_expand(config.replay.path, environ, uid, "replay.path") or data_dir / "replay",
        weights=runtime_dir / "weights", stats=runtime_dir / "workers.stats", control=control, events=events,
        curve_secret_key=_expand(c.curve_secret_key, environ, uid, "control.curve_secret_key"),
        curve_authorized_keys=_expand(c.curve_authorized_keys, environ, uid, "control.curve_authorized_keys"))
