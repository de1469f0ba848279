"""Package attributes imported on first use: ``ingestctl``, the config tools and ``ingestd
run``'s start-up checks must not pay for torch's import (seconds) before they need it."""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_attributes(package: str, sources: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from ``sources[name]``."""
    def __getattr__(name: str):
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
