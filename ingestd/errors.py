"""The small family of exceptions ingestd raises, one per situation.

Each is built on the standard exception that best describes it, so callers
can catch either the precise ingestd type or the builtin one.
"""
from __future__ import annotations


class IngestdError(Exception):
    """Base of every error ingestd raises on purpose."""


# -- replay storage ---------------------------------------------------------
class StorageNotFound(IngestdError, FileNotFoundError):
    """No replay storage at the given path (wrong path, or not created yet)."""


class StorageReplaced(StorageNotFound):
    """The storage a reader attached to was removed from its path, or replaced by another
    (``systemctl stop`` removes the runtime dir): its rows are frozen; open a new reader."""


class CorruptStorage(IngestdError, ValueError):
    """The storage directory exists but its metadata or files are unreadable."""


class SchemaMismatch(IngestdError, ValueError):
    """A batch or a reopen request does not match the storage's schema/capacity."""


class CapacityMismatch(SchemaMismatch):
    """A reopen request's capacity is not the storage's (``replay.capacity`` against an existing replay)."""


class StorageFull(IngestdError, OSError):
    """The file system has no room for a new storage's files (they are allocated up front)."""


class SnapshotExists(IngestdError, FileExistsError):
    """A snapshot (or a storage restored from one) would overwrite an existing path."""


class BadSnapshot(IngestdError, ValueError):
    """A snapshot directory is incomplete, corrupt, or of an unknown format."""


class EmptyReplay(IngestdError, LookupError):
    """Sampling was asked of a storage with no committed rows (non-blocking call)."""


class SampleTimeout(IngestdError, TimeoutError):
    """A blocking sample found no (eligible) data before its timeout."""


class ClosedError(IngestdError, RuntimeError):
    """The object was closed by its owner and cannot be used any more."""


# -- configuration ------------------------------------------------------------
class ConfigError(IngestdError, ValueError):
    """A config value is wrong; ``key`` names it (``section.key``)."""

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        self.errors: tuple[ConfigError, ...] = (self,)  # every problem found: see ``every``
        super().__init__(f"config key {key!r}: {message}")

    @classmethod
    def every(cls, errors: "list[ConfigError]") -> "ConfigError":
        """One error for all of ``errors`` (a config is checked whole, not to its first problem):
        the first's ``key`` and ``message``, ``errors`` holding each, and one line per error."""
        if len(errors) == 1:
            return errors[0]
        combined = cls(errors[0].key, errors[0].message)
        combined.errors = tuple(errors)
        combined.args = ("\n".join(str(e) for e in errors),)
        return combined


class ConfigFileError(ConfigError):
    """The config file itself cannot be used (missing, unreadable, not TOML). ``key`` is its path,
    and the message names the file, not a key: ``/etc/ingestd/ingestd.toml: TOML syntax error ...``."""

    def __init__(self, path: str, message: str):
        super().__init__(path, message)
        self.args = (f"{path}: {message}",)


# -- weights ------------------------------------------------------------------
class BadWeights(IngestdError, ValueError):
    """A weight payload is malformed or does not fit the policy."""


# -- control plane ------------------------------------------------------------
class DaemonUnavailable(IngestdError, ConnectionError):
    """The daemon did not answer within the timeout (not running, wrong address, or no access)."""


class CommandFailed(IngestdError, RuntimeError):
    """The daemon answered with an error reply; ``code`` is the stable error code."""

    def __init__(self, code: str, message: str, details: dict | None = None):
        self.code = code
        self.message = message
        self.details = details or {}  # the error reply's other fields: a timed-out push's ``version``
        super().__init__(f"{code}: {message}")


class WeightsRejected(CommandFailed, BadWeights):
    """The daemon refused a weight push (code ``bad_weights``): it does not fit the policy, or it
    is corrupt or non-finite; nothing was changed. Both a ``CommandFailed`` and a ``BadWeights``,
    so ``except BadWeights`` catches it as it catches a push refused while encoding."""


class BadReply(IngestdError, ValueError):
    """The daemon's reply could not be understood (version skew or corruption)."""


class DaemonAlreadyRunning(IngestdError, RuntimeError):
    """Another daemon holds this runtime directory."""


# -- collection ---------------------------------------------------------------
class EnvFault(IngestdError, RuntimeError):
    """An env or policy produced data that must not be stored (wrong shape, non-finite reward,
    an action outside the env's bounds...). ``key``: the config key of the part at fault
    (``workers.env`` or ``workers.policy``)."""

    def __init__(self, message: str, key: str = "workers.env"):
        super().__init__(message)
        self.key = key


class LockBusy(IngestdError, TimeoutError):
    """A lock file of the replay storage stayed locked by another process past the caller's
    timeout (a trainer stopped inside ``update_priorities`` or a sample, say)."""


# what torch says, lower-cased, when inference mode refuses autograd or an in-place update
_INFERENCE_REFUSALS = ("inference tensor", "does not require grad", "cannot be saved for backward",
                       "inplace update to inference", "inferencemode")


def autograd_hint(exc: BaseException, inference: bool) -> str:
    """What to do about an error of torch that inference mode (``inference``: it was on) explains:
    a policy that turns grad on inside a step ("does not require grad", "Inference tensors cannot
    be saved for backward"), an in-place update to an inference tensor outside the mode (a
    thread of the env's own). ``""`` for any other error."""
    message = str(exc).lower()
    if not inference or not any(refusal in message for refusal in _INFERENCE_REFUSALS):
        return ""
    return (" (torch.inference_mode, which workers run their env and policy under, refused it: set "
            "workers.inference_mode = false to run them under torch.no_grad instead)")


def blame(exc: BaseException, key: str) -> None:
    """Mark ``exc`` as raised by the user's code configured at ``key`` (``workers.env`` or
    ``workers.policy``), for the worker's error message (``part_of``); an inner mark stays."""
    if not hasattr(exc, "ingestd_part"):
        exc.ingestd_part = key  # (every exception instance takes attributes)


def part_of(exc: BaseException) -> str | None:
    """The config key of the part that raised ``exc`` (``blame``), if known."""
    return getattr(exc, "ingestd_part", None)
