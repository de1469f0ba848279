"""The rules config settings are checked by: each takes a raw TOML value and returns the typed
value, or raises :class:`~ingestd.errors.ConfigError` naming the key and what it accepts
(:mod:`ingestd.service.config_schema` declares the settings with them)."""
from __future__ import annotations

import abc
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ingestd.errors import ConfigError
from ingestd.service.config_toml import TOML_SCALARS, FrozenTable, describe, suggest

IPC_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


def finite(value: int | float) -> bool:
    """Whether a TOML number is a finite float: an integer past float's range (``1e400`` written
    out in digits, which tomllib reads as an int) is not, and ``math.isfinite`` raises on it."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


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


MAX_SECONDS = 1e6  # ~11.6 days: a longer timeout overflowed poll()'s int milliseconds at shutdown (exit 1)


@dataclass(frozen=True)
class Float(Rule):
    """A finite number above ``gt`` (or equal to it, ``or_equal``; integers are accepted and
    converted), and for seconds at most :data:`MAX_SECONDS`: a timeout of 1e10 s passed every
    check, then crashed the shutdown (``OverflowError`` in a join) and every reload over the
    socket (a lock's timeout past ``threading.TIMEOUT_MAX``)."""

    gt: float
    unit: str = "seconds"
    or_equal: bool = False

    @property
    def _most(self) -> float:
        return MAX_SECONDS if self.unit == "seconds" else math.inf

    @property
    def accepted(self) -> str:
        most = f" and <= {self._most:g}" if math.isfinite(self._most) else ""
        return f"a finite number {'>=' if self.or_equal else '>'} {self.gt:g}{most} ({self.unit})"

    def check(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, value, "; write the number without quotes" if isinstance(value, str) else "")
        if not finite(value) or not (value > self.gt or self.or_equal and value == self.gt) \
                or value > self._most:
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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):
            raise self.fail(key, value, "; write the number without quotes" if isinstance(value, str) else "")
        return float(value)


@dataclass(frozen=True)
class Ascending(Rule):
    """An array of at most ``most`` finite numbers, each above the one before (bucket bounds)."""

    most: int

    @property
    def accepted(self) -> str:
        return f"an array of at most {self.most} finite numbers in increasing order, no two equal"

    def check(self, key: str, value: Any) -> tuple[float, ...]:
        if not isinstance(value, (list, tuple)) or len(value) > self.most:
            raise self.fail(key, value)
        bounds = tuple(Number().check(f"{key}[{i}]", item) for i, item in enumerate(value))
        for i in range(1, len(bounds)):  # as floats: integers past 2**53 can become equal ones
            if not bounds[i] > bounds[i - 1]:
                raise ConfigError(key, f"{value[i]!r} at [{i}] is not above {value[i - 1]!r} before it (as "
                                       "floats): the numbers must increase")
        return bounds


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
