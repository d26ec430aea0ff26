"""SPADE-style input-adaptive sparsifier: block geometry and per-head density from pooled scores.

Tokens are put in a 3-D tile order (default 4 x 8 x 8 = 256-token tiles), so every candidate block
of 64, 128 or 256 consecutive tokens is a compact 3-D piece of the video. Per call:

1. Mean-pool Q and K over blocks of the finest candidate size ``b0`` and estimate the block-level
   attention ``P0 = softmax(q_pool k_pool^T * scale + log(tokens per key block))`` per head.
2. For every candidate block size ``g = m * b0``, aggregate ``P0`` to ``g`` (sum over key groups,
   mean over query groups) and find, per (batch, head), the fraction of key blocks a row needs to
   cover ``mass`` of its attention (mean over rows), clamped to ``[min_density, max_density]``.
3. Choose the geometry with the lowest ``mean density * block_cost[g]`` (``block_cost`` prices the
   lower efficiency of small blocks) — one host sync for the choice.
4. Keep, per (batch, head), the ``ceil(density * nB)`` best key blocks of every query row, plus the
   row's own block (no row is ever empty).

With a ``density`` budget the heads share it instead: each head's density is the budget scaled by
its needed density over the mean of all heads' (sharp heads get less, diffuse heads more), clamped
to ``[min_density, max_density]``, so a layer keeps about ``density`` of its block pairs whatever the
attention mass. ``spade_64()`` is that setting at 64 x 64 blocks over 4 x 4 x 4 token cubes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from ..mask import LogicalMask
from .base import check_qk
from .grid import LatentGrid, check_triple
from .layout import TileLayout, tile_layout, valid_block_size


@dataclass(frozen=True)
class AdaptiveDecision:
    """What the adaptive sparsifier chose for one call."""

    block: int  # chosen block size (tokens)
    density: torch.Tensor  # [B, H] fp32: fraction of key blocks kept per query row
    costs: dict[int, float]  # estimated relative cost of every candidate block size


@dataclass(frozen=True)
class AdaptiveSparsifier:
    """Input-adaptive block geometry and per-head density (see the module docstring).

    Attributes:
        tile: token order (3-D tiles of this shape).
        block_sizes: candidate block sizes, multiples of the smallest one.
        block_costs: relative cost per computed token pair of each candidate (same length).
        mass: attention mass (from pooled scores) each query row must keep.
        min_density, max_density: bounds of the per-head fraction of key blocks kept.
        density: a block-density budget shared by the heads (see the module docstring), or None.
        head_chunk: heads scored at a time when building the mask (bounds its temporary memory).
    """

    tile: tuple[int, int, int] = (4, 8, 8)
    block_sizes: tuple[int, ...] = (64, 128, 256)
    block_costs: tuple[float, ...] = (1.6, 1.2, 1.0)
    mass: float = 0.9
    min_density: float = 0.05
    max_density: float = 0.5
    density: float | None = None
    head_chunk: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile", check_triple("tile", self.tile))
        sizes = tuple(self.block_sizes)
        if not sizes or any(valid_block_size(b) != b for b in sizes):
            raise InvalidArgumentError("block_sizes", "block sizes that are multiples of 16 in [16, 512]", sizes)
        if any(b % min(sizes) for b in sizes):
            raise InvalidArgumentError("block_sizes", f"multiples of the smallest one ({min(sizes)})", sizes)
        if len(self.block_costs) != len(sizes) or any(c <= 0 for c in self.block_costs):
            raise InvalidArgumentError("block_costs", f"{len(sizes)} positive floats", self.block_costs)
        if not 0.0 < self.mass <= 1.0:
            raise InvalidArgumentError("mass", "a float in (0, 1]", self.mass)
        if not 0.0 < self.min_density <= self.max_density <= 1.0:
            raise InvalidArgumentError(
                "min_density/max_density", "0 < min_density <= max_density <= 1", (self.min_density, self.max_density)
            )
        if self.density is not None and not 0.0 < self.density <= 1.0:
            raise InvalidArgumentError("density", "None or a float in (0, 1]", self.density)
        if isinstance(self.head_chunk, bool) or not isinstance(self.head_chunk, int) or self.head_chunk < 1:
            raise InvalidArgumentError("head_chunk", "an int >= 1", repr(self.head_chunk))
        object.__setattr__(self, "block_sizes", sizes)
        object.__setattr__(self, "block_costs", tuple(float(c) for c in self.block_costs))

    def layout(self, grid: LatentGrid) -> TileLayout:
        return tile_layout(grid, self.tile, min(self.block_sizes))

    def decide(self, q: torch.Tensor, k: torch.Tensor, grid: LatentGrid) -> tuple[AdaptiveDecision, torch.Tensor]:
        """Choose the geometry and densities; also returns the block scores ``[B, H, nB, nB]`` fp32
        at the chosen geometry."""
        check_qk(q, k, grid)
        base = min(self.block_sizes)
        q_pool, _ = pool_blocks(q, base)  # [B, H, n0, D]
        k_pool, k_count = pool_blocks(k, base)
        scale = 1.0 / math.sqrt(q.shape[-1])
        logits = (q_pool @ k_pool.transpose(-1, -2)) * scale + torch.log(k_count.to(torch.float32))
        probs = logits.softmax(-1)  # [B, H, n0, n0]

        candidates = []
        for size, cost in zip(self.block_sizes, self.block_costs):
            grouped = group_probs(probs, size // base)
            density = self.head_densities(needed_density(grouped, self.mass))  # [B, H]
            candidates.append((density.mean() * cost, size, density, grouped))
        if len(candidates) == 1:  # one geometry: no choice to make, no host sync
            _, size, density, grouped = candidates[0]
            return AdaptiveDecision(size, density, {size: math.nan}), grouped
        costs = torch.stack([c[0] for c in candidates])
        best = int(torch.argmin(costs))  # the one host sync: the geometry is a Python-level choice
        _, size, density, grouped = candidates[best]
        cost_values = dict(zip(self.block_sizes, costs.tolist()))
        return AdaptiveDecision(size, density, cost_values), grouped

    def head_densities(self, needed: torch.Tensor) -> torch.Tensor:
        """Per-head fraction of key blocks to keep from each head's needed density ``[B, H]``."""
        if self.density is not None:
            needed = needed * (self.density / needed.mean(-1, keepdim=True).clamp_min(1e-6))
        return needed.clamp(self.min_density, self.max_density)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, step: int, grid: LatentGrid) -> LogicalMask:
        """``q, k [B, S, H, D]`` in layout order -> mask over (S, S) at the chosen geometry."""
        decision, scores = self.decide(q, k, grid)
        _, heads, n_b, _ = scores.shape
        keep = torch.ceil(decision.density * n_b).clamp(1, n_b)  # [B, H]
        widest = min(n_b, math.ceil(self.max_density * n_b))  # no row keeps more: a static top-k width
        active = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
        ranks = torch.arange(widest, device=q.device)
        for h in range(0, heads, self.head_chunk):  # the top-k of a few heads at a time
            part = slice(h, h + self.head_chunk)
            chosen = torch.topk(scores[:, part], widest, dim=-1).indices  # [B, h, nB, widest]
            wanted = (ranks < keep[:, part, None, None]).expand_as(chosen)
            active[:, part].scatter_(-1, chosen, wanted)
        active |= torch.eye(n_b, dtype=torch.bool, device=q.device)
        seq = grid.num_tokens
        return LogicalMask(active, decision.block, decision.block, seq, seq)


def spade_64(density: float = 0.10, **overrides) -> AdaptiveSparsifier:
    """SPADE-style masks at 64 x 64 blocks over 4 x 4 x 4 token cubes, heads sharing a ``density``
    budget (per-head densities between a third and three times it)."""
    settings = {
        "tile": (4, 4, 4),
        "block_sizes": (64,),
        "block_costs": (1.0,),
        "density": density,
        "min_density": density / 3,
        "max_density": min(1.0, 3 * density),
    }
    return AdaptiveSparsifier(**{**settings, **overrides})


def pool_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over blocks of ``block`` consecutive tokens (last one partial).

    ``x [B, S, H, D]`` -> pooled ``[B, H, n, D]`` fp32 and tokens per block ``[n]`` int64."""
    seq = x.shape[1]
    n_full, rest = divmod(seq, block)
    parts = []
    if n_full:
        parts.append(x[:, : n_full * block].unflatten(1, (n_full, block)).sum(2, dtype=torch.float32))
    if rest:
        parts.append(x[:, n_full * block :].sum(1, keepdim=True, dtype=torch.float32))
    sums = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # [B, n, H, D]
    counts = torch.full((sums.shape[1],), block, dtype=torch.int64, device=x.device)
    counts[-1] = seq - (sums.shape[1] - 1) * block
    pooled = sums / counts.to(torch.float32).view(1, -1, 1, 1)
    return pooled.transpose(1, 2), counts


def group_probs(probs: torch.Tensor, factor: int) -> torch.Tensor:
    """Block probabilities at a ``factor`` times coarser geometry: keys summed, queries averaged.
    ``[B, H, n, n]`` -> ``[B, H, ceil(n/f), ceil(n/f)]``."""
    if factor == 1:
        return probs
    n = probs.shape[-1]
    m = math.ceil(n / factor)
    pad = m * factor - n
    padded = torch.nn.functional.pad(probs, (0, pad, 0, pad))
    summed = padded.unflatten(-1, (m, factor)).sum(-1)  # [B, H, n+pad, m]
    rows = summed.unflatten(-2, (m, factor)).sum(-2)  # [B, H, m, m]
    counts = torch.full((m,), factor, dtype=probs.dtype, device=probs.device)
    counts[-1] = n - (m - 1) * factor
    return rows / counts.view(-1, 1)


def needed_density(probs: torch.Tensor, mass: float, max_rows: int = 256) -> torch.Tensor:
    """Mean over query rows of the fraction of key blocks needed to cover ``mass``. ``[B, H]``.

    Over at most ``max_rows`` evenly spaced rows (the mean of a head's rows, not each row, is used)."""
    n = probs.shape[-1]
    if probs.shape[-2] > max_rows:
        probs = probs[..., :: math.ceil(probs.shape[-2] / max_rows), :]
    cumulative = probs.sort(-1, descending=True).values.cumsum(-1)
    needed = (cumulative < mass).sum(-1).add(1).clamp(max=n)  # [B, H, n]
    return needed.to(torch.float32).mean(-1) / n
