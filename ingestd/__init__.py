"""ingestd: an experience-ingestion daemon for reinforcement learning.

The public API for trainers and operators. Names are imported lazily so that
``ingestctl`` and config tools start without importing torch.
"""
from __future__ import annotations

import importlib

from ingestd.errors import (
    BadReply, BadWeights, ClosedError, CommandFailed, ConfigError, CorruptStorage, DaemonUnavailable,
    EmptyReplay, EnvFault, IngestdError, SampleTimeout, SchemaMismatch, StorageNotFound, StorageReplaced,
    WeightsRejected,
)

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


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ingestd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
