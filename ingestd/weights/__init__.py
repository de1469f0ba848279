"""Policy weights: the wire format (manifest + lz4, never pickle) and the shared store.

The trainer ``encode``s a state dict; the daemon ``decode``s it against the policy's
``Manifest`` and ``publish``es it into the ``WeightStore``; workers poll ``version``
and ``load_into`` their policy between chunks.
"""
from ingestd.weights.store import NoWeightsYet, WeightStore
from ingestd.weights.wire import (
    DEFAULT_MAX_RAW_BYTES, Entry, Manifest, check_finite, decode, encode, manifest_of,
)

__all__ = [
    "Entry", "Manifest", "manifest_of", "encode", "decode", "check_finite", "DEFAULT_MAX_RAW_BYTES",
    "WeightStore", "NoWeightsYet",
]
