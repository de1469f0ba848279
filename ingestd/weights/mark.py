"""The newest weights version the daemons of one replay have published, kept beside the replay
(``<replay>.weights-version``, next to ``<replay>.lock``).

The weight store lives in the runtime dir, which ``systemctl stop`` removes (``/run/ingestd``),
and pushes that left no rows (to paused workers, or just before a stop) are not in the replay's
``policy_version`` stamps either: a new store numbered past those alone gave their versions
again to other weights (weights review: v4-v6 pushed to paused workers, a stop, and v4 named
the policy's initial weights). Past this mark too, a version never goes backwards.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("ingestd.daemon")


class VersionMark:
    """A file holding one integer, the highest version saved so far; replaced whole on a save."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._saved = self._read()
        self._warned = False

    @property
    def saved(self) -> int:
        """The highest version saved (read once, when made)."""
        return self._saved

    def _read(self) -> int:
        """The saved version, 0 if there is none (or it cannot be read: said once)."""
        try:
            text = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeError) as exc:
            log.warning("cannot read the weights version mark %s (%s): versions are numbered past the weight "
                        "store and the replay only", self.path, exc)
            return 0
        if not text.isdigit():
            log.warning("the weights version mark %s holds %r, not a version: it is ignored and rewritten",
                        self.path, text[:40])
            return 0
        return int(text)

    def save(self, version: int) -> None:
        """Keep ``version`` if it is the highest yet. A failure (a full or read-only disk) is
        logged, not raised: the weights it follows were published all the same."""
        if version <= self._saved:
            return
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_text(f"{version}\n", encoding="ascii")
            os.replace(temporary, self.path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            if not self._warned:
                log.warning("cannot save the weights version mark %s (%s): after a stop that removes the runtime "
                            "dir, versions since the last rows stored may be given out again", self.path, exc)
                self._warned = True
            return
        self._saved = version


def mark_of(replay: str | os.PathLike) -> VersionMark:
    """The version mark of the replay at ``replay``."""
    replay = Path(replay)
    return VersionMark(replay.with_name(replay.name + ".weights-version"))
