"""TOML values for the config: immutable tables, a small TOML writer, and how
error messages show a value. Kept apart from the schema so it only declares."""
from __future__ import annotations

import datetime as _dt
import difflib
import math
import re
from typing import Any, Iterator, Mapping


# -- immutable TOML tables ----------------------------------------------------
class FrozenTable(Mapping[str, Any]):
    """An immutable, hashable, picklable TOML table (``env_kwargs``, ``policy_kwargs``).

    Nested tables are ``FrozenTable`` too and arrays are tuples; it can be
    splatted (``factory(**table)``) and ``thaw(table)`` gives plain dicts/lists.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None):
        self._data = {str(k): freeze(v) for k, v in (data or {}).items()}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenTable({self._data!r})"

    def __reduce__(self):
        return (FrozenTable, (self._data,))


def freeze(value: Any) -> Any:
    """Tables become :class:`FrozenTable`, arrays tuples; scalars are returned as they are."""
    if isinstance(value, Mapping):
        return value if isinstance(value, FrozenTable) else FrozenTable(value)
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of :func:`freeze`: plain dicts and lists, as ``tomllib`` returns them."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


# -- TOML values ----------------------------------------------------------------
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
TOML_SCALARS = (str, bool, int, float, _dt.datetime, _dt.date, _dt.time)


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string, escaping quotes, backslashes and control characters."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    """One TOML value on one line (tables are written inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, Mapping):
        items = ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"{type(value).__name__} cannot be written as TOML")


def describe(value: Any) -> str:
    """How an error message shows a value the user gave: ``"4" (a string)``."""
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
             (Mapping, "a table"), ((list, tuple), "an array"))
    for kind, name in kinds:
        if isinstance(value, kind):
            shown = toml_value(value)
            return f"{shown[:60]}{'...' if len(shown) > 60 else ''} ({name})"
    return f"{value!r} (a Python {type(value).__name__}, which TOML cannot express)"


def closest(word: str, choices: Any) -> str | None:
    """The choice closest to ``word`` if one is close enough to be what was meant, else None."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: str, choices: Any) -> str:
    """``; did you mean 'x'?`` for the closest choice, or ``""``."""
    guess = closest(word, choices)
    return f"; did you mean {guess!r}?" if guess is not None else ""
