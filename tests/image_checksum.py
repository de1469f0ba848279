"""``image_checksum:make``: the Checksum env with its observation tiled to ``[64, 4]`` int64
(2 KB a row, so the storage keeps it in a column of its own, as it does images), for tests of
the image paths (``tests/`` on PYTHONPATH). Every tile row is Checksum's ``(w, i, e, s)``."""
from __future__ import annotations

import dataclasses

import torch

from ingestd.collect.envs.checksum import SPEC, Checksum
from ingestd.collect.interfaces import EnvContext

WIDTH = 64


class ImageChecksum(Checksum):
    def __init__(self, ctx: EnvContext):
        super().__init__(ctx)
        self.spec = dataclasses.replace(SPEC, observation_shape=(WIDTH, 4))

    def _tuple(self, step: torch.Tensor) -> torch.Tensor:
        return super()._tuple(step).unsqueeze(1).expand(-1, WIDTH, -1).contiguous()


def make(ctx: EnvContext) -> ImageChecksum:
    return ImageChecksum(ctx)
