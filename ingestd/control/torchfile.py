"""Loading a state dict from a ``torch.save`` file (``ingestctl push-weights``), and saying in one
line why a file that ``torch.load(weights_only=True)`` refused is not one.

torch's own messages are long, carry ANSI escapes, and advise loading with
``weights_only=False``, which would run whatever code the file pickled; and
for a file that is no torch file at all they are a stray ``IndexError``.
This looks at the file's bytes and, for a pickle, at its opcodes
(``pickletools``: nothing is unpickled, no code runs) to say what it holds.
"""
from __future__ import annotations

import pickletools
import re
import warnings
import zipfile

SAVE = 'torch.save(model.state_dict(), "{path}")'
_PEEK = 16  # bytes shown of a file that is not a torch file
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of torch's legacy (non-zip) format
_MAX_PICKLES = 4  # the legacy (non-zip) torch format is a few pickles in a row; the object is the 4th
_MAX_NAMES = 3  # pickled class names shown
_MAX_READ = 16 << 20  # bytes of pickle looked at, at most (a zip member's are decompressed as read)
# what every pickled nn.Module carries: its attribute dict's keys
_MODULE_KEYS = frozenset({"_parameters", "_buffers", "_modules"})
_TENSOR_MACHINERY = ("torch.", "collections.OrderedDict")  # what a pickled state dict names
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


EX_DATAERR, EX_NOINPUT = 65, 66  # sysexits: the file is not a state dict; it cannot be read


class InputError(Exception):
    """A local input file cannot be used; ``exit_code`` says how (``EX_DATAERR`` or ``EX_NOINPUT``)."""

    def __init__(self, code: str, message: str, exit_code: int):
        super().__init__(message)
        self.code, self.exit_code = code, exit_code


def load_state_dict(path: str, key: str | None = None) -> dict:
    """A ``{name: tensor}`` mapping from a ``torch.save`` file (its entry ``key`` for a checkpoint
    of several), loaded with ``weights_only=True`` (no pickled code runs); ``InputError`` if the
    file is unreadable (66) or not a state dict (65)."""
    import torch

    try:
        with warnings.catch_warnings():  # torch's "Detected pickle protocol 4 ... file an issue" on a plain pickle
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise InputError("no_input", f"cannot read {path}: {exc.strerror}", EX_NOINPUT) from None
    except Exception as exc:  # weights_only refuses pickled objects; torch raises various types
        raise InputError("bad_input", explain(path, exc), EX_DATAERR) from None
    loaded = obj
    if key is not None:
        if not isinstance(obj, dict) or key not in obj:
            raise InputError("bad_input", f"{path} has no entry {key!r}{_found(loaded)}", EX_DATAERR)
        obj = obj[key]
    elif isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]  # a {"state_dict": ..., "step": ...} checkpoint: its state dict
    if not isinstance(obj, dict) or not obj or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        what = f"{path}'s entry {key!r}" if key is not None else path
        hint = "pass --key NAME for the entry that is one" if key is None and _state_dict_entries(loaded) \
            else "save one with torch.save(model.state_dict(), FILE)"
        raise InputError("bad_input", f"{what} does not hold a state dict (a non-empty dict of name -> tensor)"
                                      f"{_found(obj if key is not None else loaded)}; {hint}", EX_DATAERR)
    return obj


def _found(obj) -> str:
    """What a file that is no state dict holds, for the error: a checkpoint's keys, and which
    of them hold state dicts (a ``{"model": ..., "optim": ...}`` checkpoint)."""
    if not isinstance(obj, dict):
        name = type(obj).__name__
        return f": it holds {'an' if name[:1] in 'aeiou' else 'a'} {name}"
    if not obj:
        return ": it holds an empty dict"
    keys = ", ".join(repr(k) for k in list(obj)[:8]) + (f" and {len(obj) - 8} more" if len(obj) > 8 else "")
    nested = _state_dict_entries(obj)
    verb = "is a state dict" if len(nested) == 1 else "are state dicts"
    inside = f", of which {', '.join(repr(k) for k in nested[:4])} {verb}" if nested else ""
    return f": it holds a dict of {keys}{inside}"


def _state_dict_entries(obj) -> list:
    """The keys of a checkpoint dict whose values are state dicts (none for anything else)."""
    import torch

    if not isinstance(obj, dict):
        return []
    return [k for k, v in obj.items() if isinstance(v, dict) and v
            and all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in v.items())]


def explain(path: str, error: BaseException) -> str:
    """``path`` and what is wrong with it, for a file ``torch.load`` could not load as weights."""
    try:
        return _explain(path, error)
    except Exception as exc:  # noqa: BLE001 - an odd file (an encrypted zip member, ...) must not crash the CLI
        return f"{path} cannot be loaded as weights ({_first_line(exc) or type(exc).__name__}): " \
               f"save them with {SAVE.format(path=path)}"


def _explain(path: str, error: BaseException) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(_PEEK)
            if not head:
                return f"{path} is empty: save the weights with {SAVE.format(path=path)}"
            f.seek(0)
            if zipfile.is_zipfile(f):
                try:
                    return _explain_zip(path, f, error)
                except (zipfile.BadZipFile, NotImplementedError, ValueError, EOFError) as exc:
                    return f"{path} is a damaged torch file: {_first_line(exc)}"
            f.seek(0)
            if head.startswith(b"\x93NUMPY"):
                return f"{path} is a NumPy .npy file, not a torch file: save the weights with {SAVE.format(path=path)}"
            if head.startswith(b"PK"):
                return f"{path} is a damaged torch file (a truncated or corrupt zip archive): save it again"
            if head.startswith(b"\x80"):  # a pickle: torch's legacy format, or a plain pickle
                legacy = _starts_with_magic(f)
                f.seek(0)
                return _explain_pickle(path, _pickled_names(f, _MAX_PICKLES), error, legacy)
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    return (f"{path} is not a torch file (it starts with {head!r}; torch.save writes a zip archive): "
            f"save the weights with {SAVE.format(path=path)}")


def _explain_zip(path: str, f, error: BaseException) -> str:
    with zipfile.ZipFile(f) as archive:
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        if not pickles:
            return (f"{path} is not a torch file (a zip archive without the data.pkl that torch.save writes; "
                    f"a NumPy .npz?): save the weights with {SAVE.format(path=path)}")
        with archive.open(pickles[0]) as pickled:
            names = _pickled_names(pickled, 1)
    return _explain_pickle(path, names, error)


def _starts_with_magic(f) -> bool:
    """Whether the first pickle of ``f`` is torch's legacy-format magic number (else the file is a
    plain ``pickle.dump``, which ``torch.load`` reads as a damaged legacy file)."""
    try:
        return any(arg == _LEGACY_MAGIC for _, arg, _ in pickletools.genops(_Capped(f, _PEEK * 4)))
    except Exception:  # noqa: BLE001 (not a pickle we can walk: not torch's either)
        return False


def _explain_pickle(path: str, names: tuple[set[str], list[str]] | None, error: BaseException,
                    legacy: bool = True) -> str:
    if not legacy:  # whatever it holds, torch.load cannot read it
        return (f"{path} is a plain pickle (pickle.dump), not a torch file: save the weights with "
                f"{SAVE.format(path=path)}")
    if names is not None:
        strings, classes = names
        if _MODULE_KEYS <= strings:
            return f"{path} holds a pickled nn.Module, not a state dict: save it with {SAVE.format(path=path)}"
        if classes:
            shown = ", ".join(classes[:_MAX_NAMES]) + (", ..." if len(classes) > _MAX_NAMES else "")
            return (f"{path} holds pickled Python objects besides tensors ({shown}), which ingestctl does not "
                    f"unpickle (that could run code): save only tensors, with {SAVE.format(path=path)}")
    return f"{path} is a damaged torch file: {_first_line(error)}"


def _pickled_names(f, pickles: int) -> tuple[set[str], list[str]] | None:
    """``(strings, classes)`` named in the first ``pickles`` pickles of ``f`` (classes other
    than the tensor machinery a state dict pickles), looking at no more than ``_MAX_READ``
    bytes; None if ``f`` does not start with a pickle."""
    strings: set[str] = set()
    classes: list[str] = []
    capped = _Capped(f, _MAX_READ)
    for n in range(pickles):
        stack: list[str | None] = []  # what the last opcodes pushed, as far as names go
        memo: dict[int, str | None] = {}
        try:
            for opcode, arg, _ in pickletools.genops(capped):
                name = opcode.name
                if name == "GLOBAL":
                    _add_class(classes, arg.replace(" ", "."))
                    stack.append(None)
                elif name == "STACK_GLOBAL":
                    module, qualname = stack[-2:] if len(stack) == 2 else (None, None)
                    if module is not None and qualname is not None:
                        _add_class(classes, f"{module}.{qualname}")
                    del stack[-2:]
                    stack.append(None)
                elif name == "MEMOIZE":
                    memo[len(memo)] = stack[-1] if stack else None
                elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[int(arg)] = stack[-1] if stack else None
                elif name in ("GET", "BINGET", "LONG_BINGET"):
                    stack.append(memo.get(int(arg)))
                elif isinstance(arg, str):
                    strings.add(arg)
                    stack.append(arg)
                else:
                    stack.append(None)
                del stack[:-2]  # only a STACK_GLOBAL's two operands matter
        except Exception:  # not a pickle, the end of the file, or past _MAX_READ: what was found so far
            if n == 0 and not strings and not classes:
                return None
            break
    return strings, classes


class _Capped:
    """The ``read``/``readline`` of a binary file, failing past ``limit`` bytes in all: a
    huge pickle (a mistaken 20 GB file) is looked at, never read whole."""

    def __init__(self, f, limit: int):
        self._f, self._left = f, limit

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self._left:
            raise EOFError(f"more than {_MAX_READ} bytes")
        data = self._f.read(n)
        self._left -= len(data)
        return data

    def readline(self) -> bytes:
        line = self._f.readline(self._left + 1)
        if len(line) > self._left:
            raise EOFError(f"more than {_MAX_READ} bytes")
        self._left -= len(line)
        return line


def _add_class(classes: list[str], name: str) -> None:
    if not name.startswith(_TENSOR_MACHINERY) and name not in classes:
        classes.append(name)


def _first_line(error: BaseException) -> str:
    """torch's message, shortened to its first line, without ANSI escapes or loading advice."""
    text = _ANSI.sub("", str(error)).strip()
    line = (text.splitlines() or [type(error).__name__])[0]
    return line.split(". ")[0][:200] if "weights_only" not in line else "it cannot be loaded as weights"
