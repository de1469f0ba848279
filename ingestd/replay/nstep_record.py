"""``<replay>/nstep.json``: the n-step settings of a replay of n-step rows.

The schema does not change with ``n_step`` or ``gamma``, and no row says which made it, so the
daemon records them beside the storage (``ingestd.service.layout``), snapshots carry them, and
trainers read them (``ReplayReader.nstep``) to bootstrap with the same ``gamma``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ingestd.errors import CorruptStorage
from ingestd.replay.files import write_new

FILE = "nstep.json"  # {"n_step": n, "gamma": g} of a replay of n-step rows (their returns' discount)
FORM = '{"n_step": int, "gamma": float}'


def read(path: Path) -> dict | None:
    """The n-step settings recorded with the storage at ``path`` (None: none recorded, which a
    storage of 1-step rows never has)."""
    try:
        recorded = json.loads((Path(path) / FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CorruptStorage(f"{Path(path) / FILE} cannot be read as JSON ({exc}); it records the n-step "
                             "settings of the replay's rows: restore it, or move the replay away") from None
    if not valid(recorded):
        raise CorruptStorage(f"{Path(path) / FILE} does not hold {FORM}, got {recorded!r}")
    return recorded


def valid(obj) -> bool:
    """Whether ``obj`` is a record of n-step settings (``FORM``, nothing else)."""
    return (isinstance(obj, dict) and set(obj) == {"n_step", "gamma"} and type(obj["n_step"]) is int
            and isinstance(obj["gamma"], float))


def write(path: Path, n_step: int, gamma: float) -> None:
    """Record the n-step settings of the rows written into the storage at ``path``."""
    tmp = Path(path) / f"{FILE}.tmp"
    write_new(tmp, json.dumps({"n_step": int(n_step), "gamma": float(gamma)}).encode())
    os.replace(tmp, Path(path) / FILE)
