"""Dense warm-up: full attention for the first denoising steps and/or the first layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..mask import LogicalMask
from .base import Sparsifier
from .grid import LatentGrid
from .layout import TileLayout


@dataclass(frozen=True)
class DenseWarmup:
    """Wraps a sparsifier: ``None`` (full attention) while ``step < steps`` or ``layer < layers``,
    the inner sparsifier's mask afterwards. The token order is the inner one's."""

    inner: Sparsifier
    steps: int = 0
    layers: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(name, "an int >= 0", repr(value))
        if not callable(self.inner) or not hasattr(self.inner, "layout"):
            raise InvalidArgumentError("inner", "a sparsifier (layout() and __call__)", type(self.inner).__name__)

    @property
    def head_separable(self) -> bool:
        """The inner sparsifier's (the dense steps decide the same way for every head)."""
        return bool(getattr(self.inner, "head_separable", False))

    def is_dense(self, layer: int, step: int) -> bool:
        return step < self.steps or layer < self.layers

    def layout(self, grid: LatentGrid) -> TileLayout:
        return self.inner.layout(grid)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, *, layer: int, step: int, grid: LatentGrid
    ) -> LogicalMask | None:
        if self.is_dense(layer, step):
            return None
        return self.inner(q, k, layer=layer, step=step, grid=grid)
