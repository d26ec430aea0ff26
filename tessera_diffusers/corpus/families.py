"""The ten mask families: a block geometry, a density range, the sources and grids that feed it.

Nine families over seven geometries (DESIGN section 7) plus HunyuanVideo-1.5's native Q384K384.
Every mask of a family lands inside the family's density range by construction: the sources
select an exact block budget drawn from the inner part of the range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from .grids import (
    BENCH_32K,
    GRIDS,
    HV_480P,
    HV_480P_VIDEO,
    HV_720P,
    HV_720P_VIDEO,
    WAN_480P,
    WAN_720P,
    LatentGrid,
    TokenLayout,
)

# Sources that imitate frame-major video sparsifiers (every family but Q384K384).
VIDEO_SOURCES: tuple[str, ...] = (
    "sliding_tile",
    "temporal_heads",
    "importance_topk",
    "clustered_permuted",
    "text_sink",
)
# HunyuanVideo-1.5's own scheme (SSTA): tiled token order, 3x3x3 tile window OR per-head top-k.
SSTA_SOURCE = "ssta"
# The product's own default sparsifiers (SSTA-style 6x8x8 tiles) on synthetic activations.
DEFAULTS_SOURCE = "tessera_default"
ALL_SOURCES: tuple[str, ...] = VIDEO_SOURCES + (SSTA_SOURCE, DEFAULTS_SOURCE)

# Blocks that are dense whatever the budget (text rows and columns) may take at most this share of a
# family's lowest density; grids where they would take more are not fed to that family.
MAX_FORCED_SHARE = 0.6
# Per-case target densities are drawn from the range shrunk by this fraction of its width at each end.
RANGE_MARGIN = 0.15
# Fewest query-block rows a family mask may have (coarse grids make meaningless masks).
MIN_BLOCK_ROWS = 16


@dataclass(frozen=True)
class MaskFamily:
    """One corpus family: logical geometry ``Q{block_q}K{block_kv}`` and a density range."""

    name: str
    block_q: int
    block_kv: int
    density_lo: float
    density_hi: float
    sources: tuple[str, ...] = VIDEO_SOURCES
    grids: tuple[LatentGrid, ...] = GRIDS
    tiled: bool = False  # tokens in SSTA tile order (block == tile)

    @property
    def geometry(self) -> str:
        return f"Q{self.block_q}K{self.block_kv}"

    @property
    def is_native_hunyuan(self) -> bool:
        return self.tiled

    def target_range(self) -> tuple[float, float]:
        """Where per-case target densities are drawn from (the range minus a margin at each end)."""
        width = self.density_hi - self.density_lo
        return self.density_lo + RANGE_MARGIN * width, self.density_hi - RANGE_MARGIN * width

    def contains(self, density: float) -> bool:
        return self.density_lo <= density <= self.density_hi

    def layout(self, grid: LatentGrid) -> TokenLayout:
        return TokenLayout(grid, tiled=self.tiled)

    def block_grid(self, grid: LatentGrid) -> tuple[int, int, int]:
        """``(seq_len, nQ, nKV)`` of this family's masks on ``grid``."""
        seq = self.layout(grid).seq_len
        return seq, math.ceil(seq / self.block_q), math.ceil(seq / self.block_kv)

    def forced_density(self, grid: LatentGrid) -> float:
        """Density of the blocks that are dense whatever the budget (text rows and text columns)."""
        layout = self.layout(grid)
        _, n_q, n_kv = self.block_grid(grid)
        if grid.text_tokens == 0:
            return 0.0
        text_rows = n_q - layout.video_len // self.block_q
        text_cols = n_kv - layout.video_len // self.block_kv
        return (text_rows * n_kv + (n_q - text_rows) * text_cols) / (n_q * n_kv)

    def infeasibility(self, grid: LatentGrid) -> str | None:
        """Why this family cannot be built on ``grid``, or None."""
        _, n_q, _ = self.block_grid(grid)
        if n_q < MIN_BLOCK_ROWS:
            return f"{n_q} query-block rows on {grid.name}, at least {MIN_BLOCK_ROWS} needed"
        forced = self.forced_density(grid)
        if forced > MAX_FORCED_SHARE * self.density_lo:
            return (
                f"text blocks alone are {forced:.1%} dense on {grid.name}, more than "
                f"{MAX_FORCED_SHARE:.0%} of the family's lowest density {self.density_lo:.0%}"
            )
        return None

    def feasible(self, grid: LatentGrid) -> bool:
        return self.infeasibility(grid) is None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "block_q": self.block_q,
            "block_kv": self.block_kv,
            "density_lo": self.density_lo,
            "density_hi": self.density_hi,
            "tiled": self.tiled,
        }


DEFAULT_LO, DEFAULT_HI = 0.09, 0.12

FAMILIES: tuple[MaskFamily, ...] = (
    MaskFamily("Q16K16", 16, 16, DEFAULT_LO, DEFAULT_HI),
    MaskFamily("Q32K16", 32, 16, DEFAULT_LO, DEFAULT_HI),
    MaskFamily("Q32K32", 32, 32, DEFAULT_LO, DEFAULT_HI),
    MaskFamily("Q64K32", 64, 32, DEFAULT_LO, DEFAULT_HI),
    MaskFamily("Q64K64-HD", 64, 64, 0.04, 0.06),
    MaskFamily("Q64K64", 64, 64, DEFAULT_LO, DEFAULT_HI),
    MaskFamily("Q64K64-DD", 64, 64, 0.18, 0.22),
    MaskFamily("Q128K64", 128, 64, DEFAULT_LO, DEFAULT_HI),
    MaskFamily("Q128K128", 128, 128, DEFAULT_LO, DEFAULT_HI),
    # HunyuanVideo-1.5 native: SSTA's 3x3x3 tile window + top-k tiles + dense text lands near 19% at
    # 720p; smaller canvases shrink the window so the family keeps one range.
    MaskFamily("Q384K384", 384, 384, 0.12, 0.22, (SSTA_SOURCE,), (HV_720P, HV_480P, BENCH_32K), tiled=True),
)
NINE_FAMILIES: tuple[str, ...] = tuple(f.name for f in FAMILIES if not f.tiled)

# The masks the one-liner's defaults make, as the runtime receives them: Q384K384 blocks over the
# video tokens in the sparsifier's tile order (frame-major here: the block grid is what counts).
# Wan2.1's tuned 1x3x3 window near 10%; HunyuanVideo-1.5's 3x3x3 window, 20% at 720p and about 45%
# at 480p. Kept out of FAMILIES (the default enumeration and the ten-family bench); the plan-table
# profile of the model sizes names them.
DEFAULTS_FAMILIES: tuple[MaskFamily, ...] = (
    MaskFamily("Q384K384-W", 384, 384, 0.06, 0.16, (DEFAULTS_SOURCE,), (WAN_720P, WAN_480P)),
    MaskFamily("Q384K384-H", 384, 384, 0.12, 0.50, (DEFAULTS_SOURCE,), (HV_720P_VIDEO, HV_480P_VIDEO)),
)


def family_named(name: str) -> MaskFamily:
    """A family of ``FAMILIES`` or ``DEFAULTS_FAMILIES`` by name (e.g. ``"Q64K64-HD"``)."""
    for family in FAMILIES + DEFAULTS_FAMILIES:
        if family.name == name:
            return family
    raise InvalidArgumentError("family", f"one of {[f.name for f in FAMILIES + DEFAULTS_FAMILIES]}", repr(name))
