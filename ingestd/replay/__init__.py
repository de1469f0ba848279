"""Shared replay storage: the ring every worker writes into and every trainer samples from."""
from ingestd.replay.reader import ReplayReader
from ingestd.replay.storage import ReplayStorage, schema_of

__all__ = ["ReplayReader", "ReplayStorage", "schema_of"]
