"""HunyuanVideo-1.5's native sparse scheme (SSTA-style): 3-D tiles, a local tile window OR a per-head
top-k of tiles by pooled Q/K importance.

For every (batch, head) and query tile ``i``:

    window(i)  = tiles within a ``3 x 3 x 3`` tile window around i (clamped at the borders)
    score(i,j) = lam * cos(mean q of tile i, mean k of tile j) - (1 - lam) * redundancy(j)
    redundancy(j) = mean over the other tiles j' of cos(mean k of j, mean k of j')
    topk(i)    = the ``k`` best-scoring tiles outside window(i)
    active(i, j) = j in window(i) or j in topk(i)

``k = 64``, halved to 32 when the video has at most 31 latent frames; ``lam = 0.7``. The top-k is
taken outside the window so a row holds exactly ``window + k`` tiles (the predictable density a
budget needs). With ``block_density`` set, ``k`` is instead chosen per latent grid so that the block
masks keep about that fraction of block pairs (``top_k_for_block_density``, once per grid). Text
tokens are not part of this mask; the processor keeps them dense.

Tiles of 6 x 8 x 8 = 384 tokens give 384-token blocks (``ssta_384``); the 4 x 4 x 4 = 64-token
variant (``ssta_64``) keeps the same token budget with ``k = 384`` tiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch

from ..errors import InvalidArgumentError
from ..mask import LogicalMask
from ..validation import check_positive_int
from .base import check_qk
from .grid import LatentGrid, check_triple
from .layout import TileLayout, tile_layout


@dataclass(frozen=True)
class SSTASparsifier:
    """Tile window OR per-head top-k tiles by pooled Q/K importance (see the module docstring).

    Attributes:
        tile: ``(tf, th, tw)`` tokens per tile (clamped to the grid).
        window: ``(wt, wh, ww)`` tiles of the local window.
        top_k: tiles chosen by importance per query tile (0: window only).
        lam: weight of the query-key similarity against key redundancy.
        halve_top_k_at_frames: ``top_k`` is halved when the grid has at most this many frames
            (0 disables the rule).
        block_density: when set, ``top_k`` is chosen per grid for about this block density (and the
            ``top_k`` field is not used).
    """

    tile: tuple[int, int, int] = (6, 8, 8)
    window: tuple[int, int, int] = (3, 3, 3)
    top_k: int = 64
    lam: float = 0.7
    halve_top_k_at_frames: int = 31
    block_density: float | None = None
    head_separable: ClassVar[bool] = True  # pooling, scores and top-k are per (batch, head)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile", check_triple("tile", self.tile))
        object.__setattr__(self, "window", check_triple("window", self.window))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError("top_k", "an int >= 0", repr(self.top_k))
        if not isinstance(self.lam, (int, float)) or not 0.0 <= float(self.lam) <= 1.0:
            raise InvalidArgumentError("lam", "a float in [0, 1]", repr(self.lam))
        if isinstance(self.halve_top_k_at_frames, bool) or not isinstance(self.halve_top_k_at_frames, int):
            raise InvalidArgumentError("halve_top_k_at_frames", "an int", repr(self.halve_top_k_at_frames))
        if self.block_density is not None and (
            not isinstance(self.block_density, (int, float)) or not 0.0 < float(self.block_density) <= 1.0
        ):
            raise InvalidArgumentError("block_density", "None or a float in (0, 1]", repr(self.block_density))

    def layout(self, grid: LatentGrid) -> TileLayout:
        return tile_layout(grid, self.tile)

    def effective_top_k(self, grid: LatentGrid) -> int:
        """``top_k`` for this grid (tuned to ``block_density`` if set; halved for short videos)."""
        top_k = self.top_k
        if self.block_density is not None:
            top_k = tuned_top_k(dataclasses.replace(self, block_density=None), grid, float(self.block_density))
        if self.halve_top_k_at_frames and grid.frames <= self.halve_top_k_at_frames:
            return top_k // 2
        return top_k

    def expected_density(self, grid: LatentGrid) -> float:
        """Fraction of tile pairs a mask for ``grid`` activates (exact on the tile grid)."""
        layout = self.layout(grid)
        n_t = layout.num_tiles
        in_window = window_size(layout, self.window)
        return (in_window + min(self.effective_top_k(grid), n_t - in_window)) / n_t

    def tile_mask(self, q: torch.Tensor, k: torch.Tensor, grid: LatentGrid) -> torch.Tensor:
        """The tile-level mask ``[B, H, nT, nT]`` bool of ``q, k [B, S, H, D]`` in layout order."""
        check_qk(q, k, grid)
        layout = self.layout(grid)
        window = layout.window_mask(self.window, q.device)  # [nT, nT]
        q_tiles = layout.pool_tiles(q)  # [B, H, nT, D] fp32
        k_tiles = layout.pool_tiles(k)
        n_t = layout.num_tiles
        top_k = min(self.effective_top_k(grid), n_t - window_size(layout, self.window))
        active = window.expand(q_tiles.shape[0], q_tiles.shape[1], n_t, n_t)
        if top_k <= 0:
            return active.contiguous()
        score = importance(q_tiles, k_tiles, float(self.lam))
        score = score.masked_fill(window, float("-inf"))
        chosen = torch.topk(score, top_k, dim=-1).indices  # [B, H, nT, k]
        picked = torch.zeros(active.shape, dtype=torch.bool, device=q.device).scatter_(-1, chosen, True)
        return picked | active

    def __call__(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, step: int, grid: LatentGrid) -> LogicalMask:
        """``q, k [B, S, H, D]`` in layout order -> mask over (S, S), blocks of one tile."""
        return self.layout(grid).tiles_to_mask(self.tile_mask(q, k, grid))


def importance(q_tiles: torch.Tensor, k_tiles: torch.Tensor, lam: float) -> torch.Tensor:
    """``lam * cos(q_i, k_j) - (1 - lam) * redundancy(k_j)`` for pooled tiles ``[B, H, nT, D]``.

    Returns ``[B, H, nT, nT]`` fp32."""
    qn = torch.nn.functional.normalize(q_tiles, dim=-1)
    kn = torch.nn.functional.normalize(k_tiles, dim=-1)
    similarity = qn @ kn.transpose(-1, -2)
    n_t = k_tiles.shape[-2]
    if n_t > 1:
        kk = kn @ kn.transpose(-1, -2)
        self_sim = kk.diagonal(dim1=-2, dim2=-1)
        redundancy = (kk.sum(-1) - self_sim) / (n_t - 1)  # [B, H, nT]
    else:
        redundancy = torch.zeros_like(similarity[..., 0])
    return lam * similarity - (1.0 - lam) * redundancy.unsqueeze(-2)


def window_size(layout: TileLayout, window: tuple[int, int, int]) -> int:
    """Tiles in every (clamped) window."""
    size = 1
    for n, w in zip(layout.tiles_per_axis, window):
        size *= min(n, w)
    return size


def ssta_384(**overrides) -> SSTASparsifier:
    """HunyuanVideo-1.5's configuration: 6 x 8 x 8 = 384-token tiles, 3 x 3 x 3 window, top-k 64."""
    return SSTASparsifier(**{"tile": (6, 8, 8), "window": (3, 3, 3), "top_k": 64, **overrides})


def ssta_tuned(block_density: float = 0.10, **overrides) -> SSTASparsifier:
    """6 x 8 x 8 tiles, a 1 x 3 x 3 tile window, and top-k chosen per grid for about
    ``block_density`` of the block pairs (the SSTA-style setting for grids the native scheme was
    not made for, such as Wan2.1's 21 x 45 x 80)."""
    settings = {"tile": (6, 8, 8), "window": (1, 3, 3), "top_k": 0, "block_density": block_density}
    return SSTASparsifier(**{**settings, **overrides})


def ssta_64(**overrides) -> SSTASparsifier:
    """The 4 x 4 x 4 = 64-token variant: 3 x 3 x 3 window, top-k 384 tiles (the token budget of
    ``ssta_384``'s 64 tiles of 384)."""
    return SSTASparsifier(**{"tile": (4, 4, 4), "window": (3, 3, 3), "top_k": 384, **overrides})


def top_k_for_density(sparsifier: SSTASparsifier, grid: LatentGrid, density: float) -> int:
    """The ``top_k`` (before the short-video halving) that makes ``sparsifier`` activate about
    ``density`` of the tile pairs on ``grid`` (at least the window)."""
    check_positive_int("grid tokens", grid.num_tokens)
    layout = sparsifier.layout(grid)
    extra = max(0, round(density * layout.num_tiles) - window_size(layout, sparsifier.window))
    halved = sparsifier.halve_top_k_at_frames and grid.frames <= sparsifier.halve_top_k_at_frames
    return 2 * extra if halved else extra


@lru_cache(maxsize=64)
def tuned_top_k(sparsifier: SSTASparsifier, grid: LatentGrid, density: float) -> int:
    """``top_k_for_block_density`` on the CPU, once per (sparsifier, grid, density)."""
    return top_k_for_block_density(sparsifier, grid, density)


def top_k_for_block_density(
    sparsifier: SSTASparsifier,
    grid: LatentGrid,
    density: float,
    heads: int = 4,
    head_dim: int = 32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> int:
    """The ``top_k`` (before the short-video halving) whose *block-level* density is closest to
    ``density`` on random probe ``q, k``.

    Where tiles do not divide the grid, blocks over the border tiles are unions of several tiles, so
    a block mask is denser than its tile mask; this searches ``top_k`` for the density the kernels
    actually see. Real activations choose other tiles, so the density of a run is close to, not
    exactly, the target (the processor reports it)."""
    if not 0.0 < density <= 1.0:
        raise InvalidArgumentError("density", "a float in (0, 1]", density)
    layout = sparsifier.layout(grid)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, grid.num_tokens, heads, head_dim, generator=gen).to(device)
    k = torch.randn(1, grid.num_tokens, heads, head_dim, generator=gen).to(device)
    halved = bool(sparsifier.halve_top_k_at_frames) and grid.frames <= sparsifier.halve_top_k_at_frames
    scale = 2 if halved else 1
    limit = layout.num_tiles - window_size(layout, sparsifier.window)

    def block_density(extra: int) -> float:
        probe = SSTASparsifier(
            sparsifier.tile, sparsifier.window, extra * scale, sparsifier.lam, sparsifier.halve_top_k_at_frames
        )
        return float(probe(q, k, layer=0, step=0, grid=grid).blocks.float().mean())

    lo, hi = 0, max(limit, 0)
    while lo < hi:  # smallest extra whose block density reaches the target
        mid = (lo + hi) // 2
        if block_density(mid) < density:
            lo = mid + 1
        else:
            hi = mid
    best = lo
    if lo > 0 and abs(block_density(lo - 1) - density) < abs(block_density(lo) - density):
        best = lo - 1
    return best * scale
