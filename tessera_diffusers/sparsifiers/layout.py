"""TileLayout: the order of video tokens in 3-D tiles, and the map from tile masks to block masks.

Video tokens arrive in raster order ``(frame, height, width)``. A tile layout cuts the grid into
tiles of ``tf x th x tw`` tokens and orders the tokens tile by tile (raster order inside a tile).
Tiles at the far border of an axis that does not divide by the tile are *partial*. The order is:

    every full tile (raster order over the tile grid), then every partial tile (same order)

so the full tiles sit at positions ``[i * V, (i + 1) * V)`` (``V = tf * th * tw``) and map one to one
onto logical blocks of ``V`` tokens when ``V`` is a valid block size (a multiple of 16 in
[16, 512]). The partial tiles are packed after them; a block there covers parts of several small
tiles, and is active for a (query, key) tile pair when any tile it overlaps is — a superset of the
tile mask that never drops an interaction the tile mask keeps.

Example: HunyuanVideo-1.5 at 720p, grid 31 x 45 x 80, tiles 6 x 8 x 8: 360 tiles, 250 full ones
(96,000 tokens) map exactly onto 384-token blocks; the 15,600 border tokens fill the last 41 blocks.

Everything here is a pure function of ``(grid, tile, block)``; the index tensors are built on the
host once and cached per device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import InvalidArgumentError
from ..mask import BLOCK_ALIGNMENT, MAX_BLOCK, MIN_BLOCK, LogicalMask
from ..validation import check_positive_int
from .grid import LatentGrid, check_triple

# Index tensors of this many distinct (layout, device) pairs are kept.
LAYOUT_CACHE_SIZE = 64


def valid_block_size(tokens: int) -> int:
    """The logical block size closest to ``tokens`` (a multiple of 16 in [16, 512], rounded up)."""
    block = -(-tokens // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT
    return min(max(block, MIN_BLOCK), MAX_BLOCK)


@dataclass(frozen=True)
class LayoutTensors:
    """Index tensors of one layout on one device (S tokens, nT tiles, nB blocks)."""

    order: torch.Tensor  # [S] int64: raster index of the token at each layout position
    inverse: torch.Tensor  # [S] int64: layout position of each raster token
    token_tile: torch.Tensor  # [S] int64: tile of the token at each layout position
    tile_sizes: torch.Tensor  # [nT] int64: tokens per tile
    tile_coords: torch.Tensor  # [nT, 3] int64: (t, h, w) coordinates of each tile on the tile grid
    block_tiles: torch.Tensor  # [nB, w] int64: tiles each block overlaps (last one repeated)
    is_identity: bool  # the layout is raster order


@dataclass(frozen=True)
class TileLayout:
    """Tile order of a latent grid (see the module docstring).

    Attributes:
        grid: the latent grid.
        tile: ``(tf, th, tw)`` tokens per tile, each clamped to the grid.
        block: logical block size (tokens) of masks over this order.
    """

    grid: LatentGrid
    tile: tuple[int, int, int]
    block: int

    @property
    def num_tokens(self) -> int:
        return self.grid.num_tokens

    @property
    def tile_volume(self) -> int:
        return self.tile[0] * self.tile[1] * self.tile[2]

    @property
    def tiles_per_axis(self) -> tuple[int, int, int]:
        return tuple(math.ceil(n / t) for n, t in zip(self.grid.as_tuple(), self.tile))  # type: ignore[return-value]

    @property
    def full_tiles_per_axis(self) -> tuple[int, int, int]:
        return tuple(n // t for n, t in zip(self.grid.as_tuple(), self.tile))  # type: ignore[return-value]

    @property
    def num_tiles(self) -> int:
        return math.prod(self.tiles_per_axis)

    @property
    def num_full_tiles(self) -> int:
        return math.prod(self.full_tiles_per_axis)

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.num_tokens / self.block)

    @property
    def aligned(self) -> bool:
        """Whether every tile is exactly one block (the tile mask maps to the block mask 1:1)."""
        return self.num_full_tiles == self.num_tiles and self.tile_volume == self.block

    @property
    def name(self) -> str:
        return f"tiles{self.tile[0]}x{self.tile[1]}x{self.tile[2]}_B{self.block}_grid{self.grid}"

    def tensors(self, device: torch.device | str) -> LayoutTensors:
        """The index tensors on ``device`` (built once per layout and device)."""
        return layout_tensors(self, str(torch.device(device)))

    def is_identity(self) -> bool:
        return self.tensors("cpu").is_identity

    # ------------------------------------------------------------------ token order
    def to_layout(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Reorder raster-ordered tokens (along ``dim``) into layout order."""
        t = self.tensors(x.device)
        return x if t.is_identity else x.index_select(dim, t.order)

    def to_raster(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Reorder layout-ordered tokens (along ``dim``) back into raster order."""
        t = self.tensors(x.device)
        return x if t.is_identity else x.index_select(dim, t.inverse)

    # ------------------------------------------------------------------ tiles
    def pool_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of each tile: ``x [B, S, H, D]`` in layout order -> ``[B, H, nT, D]`` fp32."""
        t = self.tensors(x.device)
        batch, _seq, heads, dim = x.shape
        n_full, volume = self.num_full_tiles, self.tile_volume
        parts = []
        if n_full:
            full = x[:, : n_full * volume].unflatten(1, (n_full, volume))
            parts.append(full.sum(2, dtype=torch.float32))  # [B, nF, H, D]
        if n_full < self.num_tiles:
            rest = x[:, n_full * volume :]
            sums = torch.zeros(batch, self.num_tiles - n_full, heads, dim, dtype=torch.float32, device=x.device)
            sums.index_add_(1, t.token_tile[n_full * volume :] - n_full, rest.to(torch.float32))
            parts.append(sums)
        pooled = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        pooled = pooled / t.tile_sizes.to(torch.float32).view(1, -1, 1, 1)
        return pooled.transpose(1, 2)

    def window_mask(self, window: tuple[int, int, int], device: torch.device | str) -> torch.Tensor:
        """Tile pairs within a ``window`` of tiles, clamped at the borders: the window of a tile is
        shifted to stay inside the tile grid, so every row holds ``prod(min(window, tiles))`` tiles.
        ``[nT, nT]`` bool."""
        return window_mask(self, check_triple("window", window), str(torch.device(device)))

    def tiles_to_mask(self, tile_mask: torch.Tensor) -> LogicalMask:
        """Block mask of a tile mask ``[B|1, H|1, nT, nT]`` bool -> ``LogicalMask`` over (S, S) with
        blocks of ``self.block`` tokens (exact where tiles align with blocks, a superset elsewhere)."""
        n_t = self.num_tiles
        if tile_mask.dim() != 4 or tuple(tile_mask.shape[2:]) != (n_t, n_t) or tile_mask.dtype != torch.bool:
            raise InvalidArgumentError(
                "tile_mask", f"a bool [B|1, H|1, {n_t}, {n_t}] tensor", f"{tile_mask.dtype} {tuple(tile_mask.shape)}"
            )
        if self.aligned:
            blocks = tile_mask
        else:
            idx = self.tensors(tile_mask.device).block_tiles  # [nB, w]
            n_b, width = idx.shape
            rows = tile_mask.index_select(2, idx.flatten()).unflatten(2, (n_b, width)).any(3)  # [B, H, nB, nT]
            blocks = rows.index_select(3, idx.flatten()).unflatten(3, (n_b, width)).any(4)  # [B, H, nB, nB]
        return LogicalMask(blocks.contiguous(), self.block, self.block, self.num_tokens, self.num_tokens)


def tile_layout(
    grid: LatentGrid | tuple[int, int, int], tile: tuple[int, int, int] | None, block: int | None = None
) -> TileLayout:
    """The layout of ``grid`` in tiles of ``tile`` tokens (clamped to the grid); ``None`` means raster
    order. ``block`` defaults to the tile volume rounded up to a valid block size."""
    grid = LatentGrid.of(grid)
    if tile is None:
        tile = (1, 1, grid.width)
    tile = tuple(min(t, n) for t, n in zip(check_triple("tile", tile), grid.as_tuple()))
    if block is None:
        block = valid_block_size(math.prod(tile))
    check_positive_int("block", block)
    if block != valid_block_size(block):
        raise InvalidArgumentError("block", f"a multiple of {BLOCK_ALIGNMENT} in [{MIN_BLOCK}, {MAX_BLOCK}]", block)
    return TileLayout(grid, tile, block)  # type: ignore[arg-type]


@lru_cache(maxsize=LAYOUT_CACHE_SIZE)
def layout_tensors(layout: TileLayout, device: str) -> LayoutTensors:
    # Cached across calls: never inference tensors, so later autograd-enabled calls can use them.
    with torch.inference_mode(False):
        return build_layout_tensors(layout, device)


def build_layout_tensors(layout: TileLayout, device: str) -> LayoutTensors:
    if device != "cpu":
        host = layout_tensors(layout, "cpu")
        moved = {
            name: getattr(host, name).to(device)
            for name in ("order", "inverse", "token_tile", "tile_sizes", "tile_coords", "block_tiles")
        }
        return LayoutTensors(**moved, is_identity=host.is_identity)

    frames, height, width = layout.grid.as_tuple()
    tf, th, tw = layout.tile
    nt, nh, nw = layout.tiles_per_axis
    ft, fh, fw = layout.full_tiles_per_axis
    seq = layout.num_tokens

    # Tile rank: full tiles in raster order first, then the partial ones.
    a, b, c = torch.meshgrid(torch.arange(nt), torch.arange(nh), torch.arange(nw), indexing="ij")
    coords = torch.stack([a, b, c], -1).reshape(-1, 3)  # [nT, 3] in tile-grid raster order
    full = (coords[:, 0] < ft) & (coords[:, 1] < fh) & (coords[:, 2] < fw)
    by_rank = torch.argsort((~full).to(torch.int64) * coords.shape[0] + torch.arange(coords.shape[0]))
    rank_of = torch.empty_like(by_rank)
    rank_of[by_rank] = torch.arange(by_rank.numel())
    tile_coords = coords[by_rank]

    f, h, w = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    tile_raster = ((f // tf) * nh + (h // th)) * nw + (w // tw)
    token_rank = rank_of[tile_raster.reshape(-1)]  # [S] tile rank of each raster token
    order = torch.argsort(token_rank * seq + torch.arange(seq))  # stable: raster order inside a tile
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq)
    token_tile = token_rank[order]
    tile_sizes = torch.bincount(token_tile, minlength=coords.shape[0])

    block = layout.block
    starts = torch.arange(0, seq, block)
    ends = torch.clamp(starts + block, max=seq) - 1
    first, last = token_tile[starts], token_tile[ends]
    span = int((last - first).max()) + 1
    block_tiles = torch.minimum(first[:, None] + torch.arange(span), last[:, None])
    return LayoutTensors(
        order=order,
        inverse=inverse,
        token_tile=token_tile,
        tile_sizes=tile_sizes,
        tile_coords=tile_coords,
        block_tiles=block_tiles,
        is_identity=bool(torch.equal(order, torch.arange(seq))),
    )


@lru_cache(maxsize=LAYOUT_CACHE_SIZE)
def window_mask(layout: TileLayout, window: tuple[int, int, int], device: str) -> torch.Tensor:
    with torch.inference_mode(False):
        return build_window_mask(layout, window, device)


def build_window_mask(layout: TileLayout, window: tuple[int, int, int], device: str) -> torch.Tensor:
    coords = layout.tensors("cpu").tile_coords  # [nT, 3]
    keep = torch.ones(coords.shape[0], coords.shape[0], dtype=torch.bool)
    for axis, (n, w) in enumerate(zip(layout.tiles_per_axis, window)):
        w = min(w, n)
        lo = torch.clamp(coords[:, axis] - w // 2, min=0, max=n - w)  # window start of each query tile
        col = coords[:, axis]
        keep &= (col[None, :] >= lo[:, None]) & (col[None, :] < lo[:, None] + w)
    return keep.to(device)
