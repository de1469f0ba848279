"""A reader's view of the daemon's weights version: the weight store at a path, followed
across daemon restarts (the policy-lag filter compares rows' ``policy_version`` with it)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ingestd.errors import IngestdError
from ingestd.replay.inputs import file_identity

log = logging.getLogger("ingestd.replay")


class FollowedStore:
    """The daemon's weight store at a path, followed across daemon restarts: a new daemon that
    cannot reopen the old store (another policy shape, a damaged file, a new runtime dir after
    ``systemctl stop``) makes a new file there, and the versions read here must come from it,
    not from the old mapping frozen at its last version. The path is looked at every
    ``CHECK_S`` seconds; while no store is there (the daemon stopped), the last one counts."""

    CHECK_S = 1.0

    def __init__(self, path: str | os.PathLike):
        from ingestd.weights.store import WeightStore

        self.path = Path(path).expanduser().absolute()
        self._attach = WeightStore.attach
        self._identity = file_identity(self.path)
        self._store = self._attach(self.path)
        self._next_check = time.monotonic() + self.CHECK_S

    def version(self) -> int:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.CHECK_S
            self._follow()
        return int(self._store.version)

    def _follow(self) -> None:
        try:
            identity = file_identity(self.path)
            if identity is None or identity == self._identity:
                return
            store = self._attach(self.path)
        except (IngestdError, OSError):  # half made, or not readable: look again next time
            return
        self._store.close()
        self._store, self._identity = store, identity
        log.info("the weight store at %s was replaced (a new daemon); following the new one", self.path)

    def close(self) -> None:
        self._store.close()
