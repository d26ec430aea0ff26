"""Static / user masks: the same pattern at every step (plans are prepared once and reused)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import InvalidArgumentError, MaskError
from ..mask import LogicalMask
from .grid import LatentGrid
from .layout import TileLayout, tile_layout

MaskFactory = Callable[[LatentGrid], LogicalMask]


class StaticSparsifier:
    """A user mask, fixed or built once per latent grid.

    Args:
        mask: a ``LogicalMask`` over ``(S, S)`` video tokens in the layout order, or a function
            ``grid -> LogicalMask`` (called once per grid; the result is kept).
        tile: the token order the mask refers to: 3-D tiles of this shape, or raster order (None).

    The same mask object is returned for every call on a grid (and device), so the processor's
    plan cache prepares it once.
    """

    def __init__(self, mask: LogicalMask | MaskFactory, tile: tuple[int, int, int] | None = None):
        if not isinstance(mask, LogicalMask) and not callable(mask):
            raise InvalidArgumentError("mask", "a LogicalMask or a function grid -> LogicalMask", type(mask).__name__)
        self.mask = mask
        self.tile = tile
        self._built: dict[tuple[LatentGrid, str], LogicalMask] = {}

    def layout(self, grid: LatentGrid) -> TileLayout:
        return tile_layout(grid, self.tile)

    def mask_for(self, grid: LatentGrid, device: torch.device | str) -> LogicalMask:
        """The mask for ``grid`` on ``device`` (one object per grid and device)."""
        key = (grid, str(torch.device(device)))
        mask = self._built.get(key)
        if mask is None:
            mask = self.mask if isinstance(self.mask, LogicalMask) else self.mask(grid)
            if not isinstance(mask, LogicalMask):
                raise InvalidArgumentError("mask factory result", "a LogicalMask", type(mask).__name__)
            seq = grid.num_tokens
            if (mask.seq_len_q, mask.seq_len_kv) != (seq, seq):
                raise MaskError(
                    "mask",
                    f"sequence lengths ({seq}, {seq}) of latent grid {grid}",
                    (mask.seq_len_q, mask.seq_len_kv),
                )
            if mask.device != torch.device(device):
                mask = mask.to(device)
            self._built[key] = mask
        return mask

    def __call__(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, step: int, grid: LatentGrid) -> LogicalMask:
        return self.mask_for(grid, q.device)

    def __repr__(self) -> str:
        kind = "fixed" if isinstance(self.mask, LogicalMask) else "factory"
        return f"StaticSparsifier(tile={self.tile}, mask={kind})"


def all_active(tile: tuple[int, int, int] | None = None, block: int | None = None) -> StaticSparsifier:
    """A static sparsifier whose mask activates every block (full attention through Tessera)."""

    def factory(grid: LatentGrid) -> LogicalMask:
        layout = tile_layout(grid, tile, block)
        return LogicalMask.dense(grid.num_tokens, grid.num_tokens, layout.block, layout.block)

    return StaticSparsifier(factory, tile)
