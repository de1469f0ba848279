"""Shared replay storage: the ring every worker writes into and every trainer samples from."""
from ingestd.lazy import lazy_attributes

_SOURCES = {"ReplayReader": "ingestd.replay.reader", "ReplayStorage": "ingestd.replay.storage",
            "schema_of": "ingestd.replay.schema"}
__all__ = list(_SOURCES)
__getattr__ = lazy_attributes(__name__, _SOURCES)
