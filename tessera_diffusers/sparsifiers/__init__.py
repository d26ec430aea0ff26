"""Sparsifiers: ``(q, k, layer, step, latent grid) -> LogicalMask`` for video self-attention.

SSTASparsifier / ssta_384 / ssta_64   HunyuanVideo-1.5's tile window OR top-k scheme
ssta_tuned                            the same at a block-density budget (top-k chosen per grid)
AdaptiveSparsifier / spade_64         SPADE-style: geometry and per-head density from pooled scores
StaticSparsifier / all_active         a fixed or per-grid user mask
DenseWarmup                           full attention for the first steps / layers
"""

from .adaptive import AdaptiveDecision, AdaptiveSparsifier, spade_64
from .base import Sparsifier
from .grid import LatentGrid
from .layout import TileLayout, tile_layout
from .ssta import SSTASparsifier, ssta_64, ssta_384, ssta_tuned, top_k_for_block_density, top_k_for_density
from .static import StaticSparsifier, all_active
from .warmup import DenseWarmup

__all__ = [
    "AdaptiveDecision",
    "AdaptiveSparsifier",
    "DenseWarmup",
    "LatentGrid",
    "SSTASparsifier",
    "Sparsifier",
    "StaticSparsifier",
    "TileLayout",
    "all_active",
    "spade_64",
    "ssta_64",
    "ssta_384",
    "ssta_tuned",
    "tile_layout",
    "top_k_for_block_density",
    "top_k_for_density",
]
