"""ingestd's configuration: TOML in, frozen dataclasses out, checked in one place.

- :func:`load_config` reads a file (or the embedded :data:`DEFAULT_TOML`),
  applies ``section.key=value`` overrides, and hands the raw tables to
  :func:`config_from_dict`, the one place where values are checked. Every
  error is a :class:`~ingestd.errors.ConfigError` naming the key
  (``section.key``) and what it accepts.
- :func:`config_to_toml` writes the effective config back (commented); it
  loads to an equal :class:`Config`.
- :func:`reference` lists every key with its default and doc (README).
- :func:`reloadable_diff` splits a SIGHUP's changes into live and restart.
- :func:`resolve_paths` / :func:`default_control_address` turn empty
  ("default") settings into concrete paths; they take ``environ`` as an
  argument and read nothing from the process environment themselves
  (:mod:`ingestd.service.config_paths`, re-exported here).

The schema (sections, keys, defaults, docs, rules) is declared in
:mod:`ingestd.service.config_schema`.
"""
from __future__ import annotations

import os
import re
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ingestd.errors import ConfigError, ConfigFileError
from ingestd.service.config_schema import (
    ENV_ALIASES, LOG_LEVELS, MAX_WORKERS, SECTIONS, Config, ControlConfig, FrozenTable, MetricsConfig,
    ReplayConfig, ServiceConfig, WorkersConfig, section_keys, suggest, toml_key, toml_value,
)
from ingestd.service.config_paths import (  # re-exported: the paths of a config
    ResolvedPaths, default_control_address, default_data_dir, default_runtime_dir, resolve_paths,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "Config", "ServiceConfig", "ReplayConfig", "WorkersConfig", "ControlConfig", "MetricsConfig",
    "FrozenTable", "ResolvedPaths", "DEFAULT_TOML", "LIVE_KEYS", "ENV_ALIASES", "LOG_LEVELS", "MAX_WORKERS",
    "ConfigFileError", "load_config", "check_file", "config_from_dict", "config_to_toml", "with_overrides",
    "split_override", "reference",
    "reloadable_diff", "min_replay_capacity", "resolve_paths", "default_data_dir", "default_runtime_dir",
    "default_control_address",
]

BUILTIN = "<built-in default>"


def _settings(config: Config | None = None) -> Iterator[tuple[str, Any, Any]]:
    """``(section.key, field, value)`` for every setting, in schema order (value from ``config``)."""
    for name, cls in SECTIONS.items():
        section = getattr(config, name) if config is not None else None
        for f in fields(cls):
            yield f"{name}.{f.name}", f, getattr(section, f.name) if section is not None else f.default


LIVE_KEYS: frozenset[str] = frozenset(key for key, f, _ in _settings() if f.metadata["live"])


# -- checking: the one place ----------------------------------------------------
def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Check raw TOML tables (``{"workers": {"count": 4}, ...}``) and build the frozen :class:`Config`.

    Missing sections and keys take their defaults. Raises :class:`ConfigError` for every problem
    at once (``ConfigError.errors``), not just the first; the checks across keys run only once
    each key is right on its own (else they would judge defaults standing in for bad values).
    """
    if not isinstance(data, Mapping):
        raise ConfigError("<config>", f"expected a table of sections, got {type(data).__name__}")
    errors: list[ConfigError] = []
    sections: dict[str, Any] = {}
    for name, raw in data.items():
        if name not in SECTIONS:
            errors.append(_unknown_section(name, raw))
        else:
            sections[name] = _section_from_dict(name, SECTIONS[name], raw, errors)
    if errors:
        raise ConfigError.every(errors)
    config = Config(**sections)
    for check, part in ((_check_workers, config), (_check_control, config.control), (_check_binds, config),
                        (_check_limiter, config)):
        try:
            check(part)
        except ConfigError as exc:
            errors.append(exc)
    if errors:
        raise ConfigError.every(errors)
    return config


def _check_limiter(config: Config) -> None:
    from ingestd.replay.limiter_params import check_window, params_of

    c = config.limiter
    try:
        check_window(params_of(c))
    except ValueError as exc:
        raise ConfigError("limiter.max_diff", str(exc)) from None
    if not c.enabled:
        return
    # a min_size never written would hold every trainer for ever, each sample timing out (a ring
    # smaller than min_size is fine: readers then wait for min_size rows written, docs/sampling.md)
    budget = config.workers.total_frames
    if 0 < budget < c.min_size:
        raise ConfigError("limiter.min_size", f"must be at most workers.total_frames ({budget}): the workers stop "
                                              "at that frame budget before the replay holds min_size rows, so "
                                              f"trainers would wait for ever; got {c.min_size}. Lower "
                                              "limiter.min_size or raise workers.total_frames")


def _section_from_dict(name: str, cls: type, raw: Any, errors: list[ConfigError]) -> Any:
    """The section's dataclass from its table; each bad key adds its error to ``errors`` (and
    keeps its default here)."""
    if not isinstance(raw, Mapping):
        errors.append(ConfigError(name, f"[{name}] must be a table of keys (e.g. {name}.{section_keys(cls)[0]} = "
                                        f"...), got {toml_value(raw) if _is_toml(raw) else type(raw).__name__}"))
        return cls()
    by_name = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in raw.items():
        f = by_name.get(key)
        try:
            if f is None:
                raise _unknown_key(name, key)
            values[key] = f.metadata["rule"].check(f"{name}.{key}", value)
        except ConfigError as exc:
            errors.append(exc)
    return cls(**values)


def _is_toml(value: Any) -> bool:
    try:
        toml_value(value)
    except TypeError:
        return False
    return True


def _owner_of(key: str) -> str | None:
    """The section holding a key of that name, if any."""
    return next((name for name, cls in SECTIONS.items() if key in section_keys(cls)), None)


def _unknown_section(name: str, raw: Any) -> ConfigError:
    owner = _owner_of(name)
    if not isinstance(raw, Mapping) and owner:
        return ConfigError(name, f"keys belong inside a section: write it as {owner}.{name} (under [{owner}])")
    return ConfigError(name, f"unknown section [{name}]; sections are {', '.join(SECTIONS)}"
                             f"{suggest(name, SECTIONS)}")


def _unknown_key(section: str, key: str) -> ConfigError:
    valid = section_keys(SECTIONS[section])
    owner = _owner_of(key)
    if owner:
        hint = f"; {key!r} belongs in [{owner}]: {owner}.{key}"
    else:
        close = suggest(key, valid)
        hint = close.replace("mean '", f"mean '{section}.") if close else ""
    return ConfigError(f"{section}.{key}", f"unknown key in [{section}]{hint} (valid keys: {', '.join(valid)})")


def min_replay_capacity(count: int, num_envs: int, chunk_steps: int) -> int:
    """Smallest ``replay.capacity`` for which writers can never lap each other mid-write."""
    return 2 * max(count, 1) * num_envs * chunk_steps


def _check_workers(config: Config) -> None:
    w = config.workers
    if w.restart_backoff_max_s < w.restart_backoff_s:
        raise ConfigError("workers.restart_backoff_max_s",
                          f"must be >= workers.restart_backoff_s ({w.restart_backoff_s:g}), "
                          f"got {w.restart_backoff_max_s:g}")
    need = min_replay_capacity(w.count, w.num_envs, w.chunk_steps)
    if config.replay.capacity < need:
        raise ConfigError("replay.capacity",
                          f"must be at least {need} = 2 * max(workers.count, 1) * workers.num_envs * "
                          f"workers.chunk_steps = 2 * {max(w.count, 1)} * {w.num_envs} * {w.chunk_steps}, "
                          f"else writers could lap each other mid-write; got {config.replay.capacity}. "
                          "Raise replay.capacity or lower those")


def _check_control(c: ControlConfig) -> None:
    keys = {"control.curve_secret_key": c.curve_secret_key, "control.curve_authorized_keys": c.curve_authorized_keys}
    for key, address in (("control.address", c.address), ("control.events_address", c.events_address)):
        if address.startswith("tcp://") and not all(keys.values()):
            raise ConfigError(key, f"{address} would listen on the network, which requires CURVE "
                                   "authentication: run `ingestctl keygen NAME [--dir D]` and set "
                                   "control.curve_secret_key and control.curve_authorized_keys (or use ipc://, "
                                   "or \"\" for the local default)")
    if any(keys.values()) and not all(keys.values()):
        missing = next(key for key, value in keys.items() if not value)
        raise ConfigError(missing, "must be set too: CURVE needs both control.curve_secret_key and "
                                   "control.curve_authorized_keys (or neither)")
    if c.address and c.address == c.events_address:
        raise ConfigError("control.events_address", f"must differ from control.address (both are {c.address})")


_ANY_HOST = frozenset(("*", "0.0.0.0", "[::]", "::", ""))  # a bind on every interface
_LOOPBACK = frozenset(("127.0.0.1", "localhost"))


def _bound(address: str) -> tuple | None:
    """What binding ``address`` takes: ``("ipc", path)`` (normalized: ``/d//c.sock`` is
    ``/d/c.sock``), ``("tcp", host, port)``, or None (``""``: the default socket)."""
    if address.startswith("ipc://"):
        name = address[len("ipc://"):]
        return ("ipc", name if name.startswith("@") else os.path.normpath(name))
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        return ("tcp", host, int(port)) if port.isdigit() else None
    return None


def _hosts_overlap(a: str, b: str) -> bool:
    return a == b or a in _ANY_HOST or b in _ANY_HOST or {a, b} <= _LOOPBACK


def _check_binds(config: Config) -> None:
    """Two of the daemon's own listeners on one socket pass each check alone, and the second bind
    failed only after the replay was made, blaming "another process" (ops review): the control and
    event sockets (spelled two ways), or a tcp one and the metrics port."""
    c, m = config.control, config.metrics
    control, events = _bound(c.address), _bound(c.events_address)
    if control is not None and events is not None and control[0] == events[0] and (
            control == events if control[0] == "ipc" else
            control[2] == events[2] and _hosts_overlap(control[1], events[1])):
        raise ConfigError("control.events_address", f"{c.events_address} binds the socket control.address "
                                                    f"({c.address}) binds: give the events their own")
    for key, bound in (("control.address", control), ("control.events_address", events)):
        if (m.enabled and m.port and bound is not None and bound[0] == "tcp" and bound[2] == m.port
                and _hosts_overlap(bound[1], m.address)):
            raise ConfigError("metrics.port", f"{m.port} is the port of {key} ({getattr(c, key.split('.')[1])}) "
                                              "too: choose another metrics.port (0: an ephemeral one)")


# -- loading --------------------------------------------------------------------
def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (``None``: the embedded default), apply ``section.key=value`` overrides, check.

    An override's value is parsed as a TOML value, or taken as a bare string
    if it does not parse (``workers.env=Checksum``). A deeper key sets one
    entry of a table (``workers.env_kwargs.max_steps=10``).
    """
    if isinstance(overrides, (str, bytes)):
        raise TypeError("overrides is a sequence of 'section.key=value' strings, not one string")
    raw = _read_toml(path)
    for text in overrides:
        _apply_override(raw, text)
    return config_from_dict(raw)


def check_file(path: str | os.PathLike[str]) -> Config:
    """``ingestd config check FILE``: load and check ``path``; raises :class:`ConfigError`."""
    return load_config(path)


def with_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """``config`` with overrides applied, checked again (e.g. ``["workers.count=8"]`` for a scale)."""
    if isinstance(overrides, (str, bytes)):
        raise TypeError("overrides is a sequence of 'section.key=value' strings, not one string")
    raw = config.to_dict()
    for text in overrides:
        _apply_override(raw, text)
    return config_from_dict(raw)


def _read_toml(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    if path is None:
        text, where = DEFAULT_TOML, BUILTIN
    else:
        where = os.fspath(path)
        try:
            text = Path(where).read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is dropped
        except FileNotFoundError:
            raise ConfigFileError(where, "config file not found; write one with `ingestd config default > FILE`, "
                                         "or give no file to use the built-in default") from None
        except OSError as exc:
            raise ConfigFileError(where, f"cannot read the config file: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigFileError(where, f"the config file is not UTF-8 text (byte {exc.start})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(where, _syntax_error(text, str(exc))) from None
    except (ValueError, RecursionError) as exc:  # past what Python parses (chaos review: a traceback, exit 1)
        raise ConfigFileError(where, _unparsable(exc)) from None
    return _readable(doc)


MAX_NESTING = 32  # levels of tables and arrays in a config: no setting needs more than a few
_INT64 = range(-2**63, 2**63)  # TOML's integers (its spec: 64-bit signed)
_TOO_DEEP = f"arrays or inline tables nested more than {MAX_NESTING} levels deep; no setting needs more than a few"
_TOO_LONG = "an integer outside TOML's 64-bit range (-2**63 to 2**63 - 1)"


def _readable(value: Any, depth: int = 0, key: str = "") -> Any:
    """``value`` (parsed TOML at ``key``, ``depth`` tables down), if every integer in it is one
    TOML allows and it nests at most :data:`MAX_NESTING` levels; else a ``ConfigError`` naming
    the key (an array item by its index). Python's parser reads 64 KB hex integers and ~400
    levels of arrays, which the checks and messages after it cannot (``str()`` of such an int
    raises, and so does recursing that deep: diff review)."""
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        raise ConfigError(key, _TOO_LONG)
    if isinstance(value, (list, dict)):
        if depth > MAX_NESTING:
            raise ConfigError(key, _TOO_DEEP)
        if isinstance(value, dict):
            items = ((f"{key}.{name}" if key else str(name), item) for name, item in value.items())
        else:
            items = ((f"{key}[{i}]", item) for i, item in enumerate(value))
        for where, item in items:
            _readable(item, depth + 1, where)
    return value


def _unparsable(exc: ValueError | RecursionError) -> str:
    """Why valid-looking TOML could not be read: an integer past Python's 4,300 digits or
    TOML's 64 bits, or arrays or inline tables nested past what Python or a config reads."""
    if isinstance(exc, RecursionError):
        return _TOO_DEEP
    if "digits" in str(exc):  # (Python's own message advises raising its limit)
        return _TOO_LONG
    return f"a value Python cannot read: {exc}"


_AT = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)$")


def _syntax_error(text: str, message: str) -> str:
    """tomllib's ``Invalid value (at line 2, column 9)`` as ``TOML syntax error at line 2, column 9:
    Invalid value``, with the line quoted and the column marked."""
    match = _AT.search(message)
    if match is None:
        return f"TOML syntax error: {message}"
    what = message[:match.start()]
    if match[1] is None:
        return f"TOML syntax error at the end of the file: {what}"
    line, column = int(match[1]), int(match[2])
    lines = text.split("\n")  # as tomllib counts lines (splitlines also breaks at U+2028, ...)
    quoted = ""
    if 1 <= line <= len(lines):
        gutter = " " * len(str(line))
        quoted = f"\n  {line} | {lines[line - 1]}\n  {gutter} | {' ' * (column - 1)}^"
    return f"TOML syntax error at line {line}, column {column}: {what}{quoted}"


def split_override(text: str) -> tuple[list[str], str]:
    """``"workers.env_kwargs.id=x"`` -> ``(["workers", "env_kwargs", "id"], "x")``; a
    :class:`ValueError` saying what an override looks like if ``text`` is not ``section.key=value``
    (no ``=``, an empty or a one-part key). ``ingestd`` takes that as a usage error (exit 64)."""
    name, sep, value = text.partition("=")
    parts = name.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        owner = _owner_of(parts[0]) if len(parts) == 1 and parts[0] else None
        hint = f"; did you mean {owner}.{text.strip()}?" if owner and sep else ""
        raise ValueError(f"an override is section.key=value (e.g. workers.count=4), got {text!r}{hint}")
    return parts, value


def _apply_override(raw: dict[str, Any], text: str) -> None:
    try:
        parts, value = split_override(text)
    except ValueError as exc:
        raise ConfigError(text.partition("=")[0].strip() or text, str(exc)) from None
    name = ".".join(parts)
    node = raw
    for depth, part in enumerate(parts[:-1], start=1):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[:depth]), f"is not a table, so {name} cannot be set inside it")
        node = child
    try:
        parsed = _override_value(value)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(name, _unparsable(exc)) from None
    node[parts[-1]] = _readable(parsed, len(parts), name)  # as deep as in a file


def _override_value(text: str) -> Any:
    """A TOML value (``4``, ``true``, ``{a = 1}``, ``"x"``), else the bare string; the
    ``ValueError`` or ``RecursionError`` of a value past what Python reads (:func:`_unparsable`)."""
    text = text.strip()
    try:
        doc = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    return doc["v"] if list(doc) == ["v"] else text


# -- writing --------------------------------------------------------------------
_HEADER = """\
# ingestd configuration (TOML). Every key is listed with its documentation;
# empty strings mean "the default" described next to the key.
# Keys marked "reloadable" are applied live on SIGHUP (systemctl reload ingestd);
# changing any other key needs a restart."""


def _key_doc(f: Any) -> str:
    rule = f.metadata["rule"]
    live = " Reloadable." if f.metadata["live"] else ""
    return f"{f.metadata['doc']} Accepts {rule.accepted}.{live}"


def _comment(text: str, width: int = 88) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent="# ", subsequent_indent="# ",
                         break_long_words=False, break_on_hyphens=False)


def config_to_toml(config: Config) -> str:
    """The config as a commented TOML document that loads back to an equal :class:`Config`.

    Keys whose value differs from the default say what the default is.
    """
    out = [_HEADER]
    for name, cls in SECTIONS.items():
        out += ["", *_comment((cls.__doc__ or "").strip()), f"[{name}]"]
        section = getattr(config, name)
        for f in fields(cls):
            value = getattr(section, f.name)
            out += _comment(_key_doc(f))
            if value != f.default:
                out.append(f"# (default: {toml_value(f.default)})")
            out.append(f"{toml_key(f.name)} = {toml_value(value)}")
    return "\n".join(out) + "\n"


DEFAULT_TOML: str = config_to_toml(Config())


def reference() -> list[tuple[str, str, str]]:
    """``(section.key, default as TOML, doc)`` for every setting, in file order (README reference)."""
    return [(key, toml_value(f.default), _key_doc(f)) for key, f, _ in _settings()]


def reloadable_diff(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """Keys that changed: ``(applied live, need a restart)``. Live keys are :data:`LIVE_KEYS`:

    workers.count (scale), service.log_level, and plain numbers the daemon's
    own loops read (stop/ack timeouts, heartbeat timeout, restart backoff and
    budget). Everything else rebuilds processes, sockets or storage.
    """
    live, restart = [], []
    for (key, f, before), (_, _, after) in zip(_settings(old), _settings(new)):
        if before != after:
            (live if f.metadata["live"] else restart).append(key)
    return live, restart
