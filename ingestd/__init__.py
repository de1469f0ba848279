"""ingestd: an experience-ingestion daemon for reinforcement learning.

The public API for trainers and operators. Names are imported lazily so that
``ingestctl`` and config tools start without importing torch.
"""
from __future__ import annotations

from ingestd.errors import (
    BadReply, BadWeights, ClosedError, CommandFailed, ConfigError, CorruptStorage, DaemonUnavailable,
    EmptyReplay, EnvFault, IngestdError, SampleTimeout, SchemaMismatch, StorageNotFound, StorageReplaced,
    WeightsRejected,
)
from ingestd.lazy import lazy_attributes

__version__ = "0.1.0"

_LAZY = {
    "ReplayReader": "ingestd.replay.reader",
    "ReplayStorage": "ingestd.replay.storage",
    "ControlClient": "ingestd.control.client",
    "RateLimited": "ingestd.replay.limiter",
}

__all__ = [
    *_LAZY,
    "IngestdError", "StorageNotFound", "StorageReplaced", "CorruptStorage", "SchemaMismatch", "EmptyReplay",
    "SampleTimeout", "ClosedError", "ConfigError", "BadWeights", "EnvFault", "DaemonUnavailable", "CommandFailed",
    "WeightsRejected", "BadReply",
]
__getattr__ = lazy_attributes(__name__, _LAZY)

