"""Shared fixtures (keep small and generic)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def shm_dir():
    """A fresh directory under /dev/shm (tmpfs), removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="ingestd-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir():
    """A fresh directory on a real disk (not tmpfs), removed after the test."""
    base = Path(tempfile.gettempdir())
    if base.resolve().is_relative_to("/dev/shm"):
        base = Path("/var/tmp")
    path = Path(tempfile.mkdtemp(prefix="ingestd-test-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
