"""ingestd: an experience-ingestion daemon for reinforcement learning."""
from ingestd.errors import (
    BadReply, BadWeights, ClosedError, CommandFailed, ConfigError, CorruptStorage, DaemonUnavailable,
    EmptyReplay, IngestdError, SampleTimeout, SchemaMismatch, StorageNotFound,
)
from ingestd.replay import ReplayReader, ReplayStorage

__version__ = "0.1.0"

__all__ = [
    "ReplayReader", "ReplayStorage",
    "IngestdError", "StorageNotFound", "CorruptStorage", "SchemaMismatch", "EmptyReplay", "SampleTimeout",
    "ClosedError", "ConfigError", "BadWeights", "DaemonUnavailable", "CommandFailed", "BadReply",
]
