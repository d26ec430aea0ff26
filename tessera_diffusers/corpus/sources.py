"""Mask sources: imitations of real video sparsifiers, each producing one head at a time.

Every source turns a ``SourceContext`` (layout, block boxes, per-head block budgets, seeded CPU
generators) into a ``[H, nQ, nKV]`` bool block tensor. It scores block pairs, marks forced blocks
(text rows and columns of a joint-attention model, sinks, a fixed window) and lets
``select_blocks`` take exactly the head's budget, so the density is hit by construction.

Sources:
    sliding_tile        3-D box window over (frame, row, column), per-head aspect (STA-like, clamped:
                        every query row gets the same count)
    temporal_heads      spatial heads (own frame neighbourhood) and temporal heads (same place in
                        every frame), a global budget so border rows get fewer blocks
    importance_topk     top-k / threshold over pooled Q.K of smooth synthetic inputs with a
                        locality prior; some rows skipped (empty)
    clustered_permuted  k-means of Q and K tokens, tokens permuted by cluster, blocks kept by
                        cluster attention mass (SVG2-like)
    text_sink           local window plus sink / register columns (and dense text blocks)
    ssta                HunyuanVideo-1.5's native scheme on 6x8x8 tiles: clamped 3x3x3 tile window
                        OR per-head top-k tiles by pooled-Q/K importance, text dense
    tessera_default     the product's default sparsifiers themselves (``ssta_tuned`` on Wan2.1 grids,
                        ``ssta_384``'s window on HunyuanVideo-1.5's) on smooth synthetic Q/K, top-k
                        set from the case's density
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..sparsifiers import SSTASparsifier
from ..sparsifiers.base import LatentGrid as TokenGrid
from ..sparsifiers.ssta import window_size
from .families import MaskFamily
from .fields import cosine, draw_field, draw_projections, kmeans, pool_blocks, token_features
from .grids import BlockBoxes, TokenLayout, box_distances
from .selection import hash_jitter, select_blocks

# Tie-break weights: far below the gaps between distinct distance shells, far above SCORE_QUANTUM.
L1_WEIGHT = 1e-4
JITTER_WEIGHT = 1e-7
# SVG2 cluster sizes at Wan 720p (tokens per query / key cluster), and the Lloyd iterations.
TOKENS_PER_Q_CLUSTER = 252
TOKENS_PER_K_CLUSTER = 76
KMEANS_ITERS = 4
# SVG2 keeps at least a share of the key clusters for every query cluster: here, every query block
# keeps at least this share of the mean row's blocks.
MIN_ROW_SHARE = 0.3
# SSTA: importance = lambda * cos(q_tile, k_tile) - (1 - lambda) * mean K-K redundancy.
SSTA_LAMBDA = 0.7
# Half extents (frames, rows, columns) of the tile windows tried, largest first (3x3x3 is SSTA's).
SSTA_WINDOWS: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (0, 1, 1), (0, 0, 1), (0, 0, 0))
# The window plus text may use at most this share of the smallest head budget; top-k fills the rest.
SSTA_WINDOW_SHARE = 0.75


@dataclass(frozen=True, eq=False)
class SourceContext:
    """What a source needs to build one case's mask."""

    family: MaskFamily
    layout: TokenLayout
    heads: int
    budgets: tuple[int, ...]  # active blocks per head
    q_boxes: BlockBoxes
    kv_boxes: BlockBoxes
    scene: torch.Generator  # CPU; draws shared by every family of one (source, seed, grid, heads)
    rng: torch.Generator  # CPU; draws of this very case
    salt: int  # for hash jitter
    device: torch.device

    @property
    def n_q(self) -> int:
        return self.q_boxes.count

    @property
    def n_kv(self) -> int:
        return self.kv_boxes.count

    @property
    def text_forced(self) -> torch.Tensor:
        """Text rows and text columns. ``[nQ, nKV]`` bool."""
        return self.q_boxes.text.unsqueeze(1) | self.kv_boxes.text.unsqueeze(0)

    def extents(self) -> torch.Tensor:
        """Grid extents (frames, height, width) as float64 ``[3]`` (CPU)."""
        return torch.tensor(self.layout.extents, dtype=torch.float64)

    def uniform(self, *shape: int, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=self.rng, dtype=torch.float64)

    def row_priority(self) -> torch.Tensor:
        return torch.randperm(self.n_q, generator=self.rng).to(self.device)

    def jitter(self, head: int) -> torch.Tensor:
        return hash_jitter(self.n_q, self.n_kv, self.salt + 7919 * head, self.device)


SourceFn = Callable[[SourceContext], torch.Tensor]


def window_score(dist: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """Score of a box window with per-axis half extents ``half [3]``: minus the normalized
    Chebyshev distance, L1 as the first tie-break. ``dist [3, nQ, nKV]`` -> ``[nQ, nKV]`` float64."""
    scaled = [dist[a].to(torch.float64) / float(half[a]) for a in range(3)]
    cheb = torch.maximum(torch.maximum(scaled[0], scaled[1]), scaled[2])
    return -(cheb + L1_WEIGHT * (scaled[0] + scaled[1] + scaled[2]))


def stack_heads(ctx: SourceContext, one_head: Callable[[int], torch.Tensor]) -> torch.Tensor:
    blocks = torch.empty(ctx.heads, ctx.n_q, ctx.n_kv, dtype=torch.bool, device=ctx.device)
    for h in range(ctx.heads):
        blocks[h] = one_head(h)
    return blocks


def sliding_tile(ctx: SourceContext) -> torch.Tensor:
    """3-D box window, a different aspect per head, the same count for every query row."""
    dist = box_distances(ctx.q_boxes, ctx.kv_boxes)
    aspects = ctx.extents() * torch.exp(ctx.uniform(ctx.heads, 3, low=-0.6, high=0.6))
    forced = ctx.text_forced

    def head(h: int) -> torch.Tensor:
        score = window_score(dist, aspects[h]) + JITTER_WEIGHT * ctx.jitter(h)
        return select_blocks(score, ctx.budgets[h], "row", forced=forced, priority=ctx.row_priority())

    return stack_heads(ctx, head)


def temporal_heads(ctx: SourceContext) -> torch.Tensor:
    """Half spatial heads (thin in time), half temporal heads (same place, every frame)."""
    dist = box_distances(ctx.q_boxes, ctx.kv_boxes)
    ext = ctx.extents()
    temporal = ctx.uniform(ctx.heads) < 0.5
    spatial_half = ext[1:] * ctx.uniform(ctx.heads, 2, low=0.6, high=1.4)
    thin_time = ext[0] * ctx.uniform(ctx.heads, low=0.05, high=0.2)
    time_penalty = ctx.uniform(ctx.heads, low=0.02, high=0.2)
    forced = ctx.text_forced

    def head(h: int) -> torch.Tensor:
        if bool(temporal[h]):
            dy = dist[1].to(torch.float64) / float(spatial_half[h, 0])
            dx = dist[2].to(torch.float64) / float(spatial_half[h, 1])
            dt = dist[0].to(torch.float64) / float(ext[0])
            score = -(torch.maximum(dy, dx) + float(time_penalty[h]) * dt + L1_WEIGHT * (dy + dx))
        else:
            half = torch.stack([thin_time[h], spatial_half[h, 0], spatial_half[h, 1]])
            score = window_score(dist, half)
        score = score + JITTER_WEIGHT * ctx.jitter(h)
        return select_blocks(score, ctx.budgets[h], "global", forced=forced)

    return stack_heads(ctx, head)


def pooled_video_features(ctx: SourceContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The scene's smooth field pooled over every query block and key block. ``[nQ, C]``, ``[nKV, C]``."""
    field = draw_field(ctx.scene)
    feats = token_features(ctx.layout, field, ctx.device)
    weights = ctx.layout.real(ctx.device).to(torch.float64)
    seq = ctx.layout.seq_len
    return (
        pool_blocks(feats, weights, ctx.family.block_q, seq),
        pool_blocks(feats, weights, ctx.family.block_kv, seq),
    )


def importance_topk(ctx: SourceContext) -> torch.Tensor:
    """Top-k per row (or a head-wide threshold) over cos(pooled Q, pooled K) minus a locality
    prior; in some cases a few query rows are skipped entirely (empty rows)."""
    fq, fk = pooled_video_features(ctx)
    wq, wk = draw_projections(ctx.scene, ctx.heads)
    dist = box_distances(ctx.q_boxes, ctx.kv_boxes)
    ext = ctx.extents()
    locality = ctx.uniform(ctx.heads, low=0.0, high=1.5)
    mode = "row" if float(ctx.uniform(1)) < 0.5 else "global"
    empty_fraction = (0.0, 0.01, 0.03)[int(torch.randint(3, (1,), generator=ctx.rng))]
    video_rows = torch.nonzero(~ctx.q_boxes.text.cpu()).flatten()
    forced = ctx.text_forced
    prior = window_score(dist, ext)  # minus the grid-normalized Chebyshev distance
    del dist

    def head(h: int) -> torch.Tensor:
        q_bar = fq @ wq[h].to(ctx.device)
        k_bar = fk @ wk[h].to(ctx.device)
        score = cosine(q_bar, k_bar) + float(locality[h]) * prior + JITTER_WEIGHT * ctx.jitter(h)
        empty = torch.zeros(ctx.n_q, dtype=torch.bool, device=ctx.device)
        if empty_fraction > 0 and float(ctx.uniform(1)) < 0.6:
            count = max(1, round(empty_fraction * video_rows.numel()))
            pick = video_rows[torch.randperm(video_rows.numel(), generator=ctx.rng)[:count]]
            empty[pick.to(ctx.device)] = True
        return select_blocks(score, ctx.budgets[h], mode, forced=forced, empty_rows=empty, priority=ctx.row_priority())

    return stack_heads(ctx, head)


def cluster_block_fractions(labels: torch.Tensor, clusters: int, block: int, seq_len: int) -> torch.Tensor:
    """Tokens sorted by cluster label, cut into blocks: how many tokens of each cluster every block
    holds. ``labels [V]`` -> ``[ceil(seq_len / block), clusters]`` float64 (text positions hold none)."""
    n_blocks = math.ceil(seq_len / block)
    order = torch.sort(labels, stable=True).values  # cluster of each permuted position
    position_block = torch.arange(order.numel(), device=labels.device) // block
    flat = torch.bincount(position_block * clusters + order, minlength=n_blocks * clusters)
    return flat.view(n_blocks, clusters).to(torch.float64)


def clustered_permuted(ctx: SourceContext) -> torch.Tensor:
    """SVG2-like: k-means of Q and K tokens per head, tokens permuted by cluster, block pairs scored
    by the centroid attention mass they carry; a head-wide budget (top-p-like)."""
    layout = ctx.layout
    field = draw_field(ctx.scene)
    feats = token_features(layout, field, ctx.device)  # [V, C] (text is not clustered)
    wq, wk = draw_projections(ctx.scene, ctx.heads)
    n_video = feats.shape[0]
    n_qc = min(512, max(4, round(n_video / TOKENS_PER_Q_CLUSTER)))
    n_kc = min(1024, max(8, round(n_video / TOKENS_PER_K_CLUSTER)))
    sharpness = ctx.uniform(ctx.heads, low=1.0, high=3.0)
    seq = layout.seq_len
    forced = ctx.text_forced

    def head(h: int) -> torch.Tensor:
        q_tok = feats @ wq[h].to(ctx.device)
        k_tok = feats @ wk[h].to(ctx.device)
        q_init = torch.randperm(n_video, generator=ctx.rng)[:n_qc].to(ctx.device)
        k_init = torch.randperm(n_video, generator=ctx.rng)[:n_kc].to(ctx.device)
        q_labels, q_cent = kmeans(q_tok, q_init, KMEANS_ITERS)
        k_labels, k_cent = kmeans(k_tok, k_init, KMEANS_ITERS)
        k_sizes = torch.bincount(k_labels, minlength=n_kc).to(torch.float64)
        logits = (q_cent @ k_cent.T) / math.sqrt(q_cent.shape[1]) * float(sharpness[h])
        logits = logits + torch.log(k_sizes.clamp_min(1.0))
        logits = torch.where(k_sizes.unsqueeze(0) > 0, logits, torch.full_like(logits, -torch.inf))
        mass = torch.softmax(logits, dim=1)  # [Cq, Ck]: attention mass of each key cluster
        q_frac = cluster_block_fractions(q_labels, n_qc, ctx.family.block_q, seq)
        q_frac = q_frac / q_frac.sum(1, keepdim=True).clamp_min(1.0)
        k_share = cluster_block_fractions(k_labels, n_kc, ctx.family.block_kv, seq) / k_sizes.clamp_min(1.0)
        score = q_frac @ mass @ k_share.T  # expected attention mass of each block pair
        score = score / score.max().clamp_min(1e-300) + JITTER_WEIGHT * ctx.jitter(h)
        row_min = max(1, round(MIN_ROW_SHARE * ctx.budgets[h] / ctx.n_q))
        return select_blocks(score, ctx.budgets[h], "global", forced=forced, row_min=row_min)

    return stack_heads(ctx, head)


def text_sink(ctx: SourceContext) -> torch.Tensor:
    """Local window plus always-on columns: the first KV blocks (a first-frame sink) or a few
    scattered register blocks, a different share per head; text blocks dense."""
    dist = box_distances(ctx.q_boxes, ctx.kv_boxes)
    half = ctx.extents() * ctx.uniform(ctx.heads, 3, low=0.8, high=1.25)
    sink_share = ctx.uniform(ctx.heads, low=0.1, high=0.35)
    first_frame = ctx.uniform(ctx.heads) < 0.5
    video_cols = torch.nonzero(~ctx.kv_boxes.text.cpu()).flatten()

    def head(h: int) -> torch.Tensor:
        per_row = ctx.budgets[h] / ctx.n_q
        n_sink = max(1, min(video_cols.numel(), round(float(sink_share[h]) * per_row)))
        if bool(first_frame[h]):
            cols = video_cols[:n_sink]
        else:
            cols = video_cols[torch.randperm(video_cols.numel(), generator=ctx.rng)[:n_sink]]
        sink = torch.zeros(ctx.n_kv, dtype=torch.bool, device=ctx.device)
        sink[cols.to(ctx.device)] = True
        forced = ctx.text_forced | sink.unsqueeze(0)
        score = window_score(dist, half[h]) + JITTER_WEIGHT * ctx.jitter(h)
        return select_blocks(score, ctx.budgets[h], "row", forced=forced, priority=ctx.row_priority())

    return stack_heads(ctx, head)


def tile_window(
    tiles_q: torch.Tensor, tiles_kv: torch.Tensor, counts: tuple[int, int, int], half: tuple[int, int, int]
) -> torch.Tensor:
    """SSTA's clamped window: the window around each query tile is shifted to stay inside the tile
    grid, so every query tile sees the same number of tiles. ``tiles_* [n, 3]`` -> ``[nQ, nKV]`` bool."""
    inside = torch.ones(tiles_q.shape[0], tiles_kv.shape[0], dtype=torch.bool, device=tiles_q.device)
    for axis in range(3):
        n, e = counts[axis], half[axis]
        if n <= 2 * e + 1:
            continue  # the window spans the whole axis
        center = tiles_q[:, axis].clamp(e, n - 1 - e).unsqueeze(1)
        inside &= (tiles_kv[:, axis].unsqueeze(0) - center).abs() <= e
    return inside


def ssta(ctx: SourceContext) -> torch.Tensor:
    """HunyuanVideo-1.5's sparse scheme on the tiled layout (block == 6x8x8 tile): clamped tile
    window OR per-head top-k tiles by pooled-Q/K importance, text rows and columns dense."""
    layout = ctx.layout
    tile = torch.tensor(layout.tile, device=ctx.device)
    video_q, video_kv = ~ctx.q_boxes.text, ~ctx.kv_boxes.text
    tiles_q = torch.where(video_q.unsqueeze(1), ctx.q_boxes.lo // tile, torch.zeros_like(ctx.q_boxes.lo))
    tiles_kv = torch.where(video_kv.unsqueeze(1), ctx.kv_boxes.lo // tile, torch.zeros_like(ctx.kv_boxes.lo))
    text = ctx.text_forced
    video_pairs = video_q.unsqueeze(1) & video_kv.unsqueeze(0)
    window = None
    for half in SSTA_WINDOWS:  # the largest window that leaves room for top-k in every head
        window = tile_window(tiles_q, tiles_kv, layout.tile_counts, half) & video_pairs
        if int((text | window).sum()) <= SSTA_WINDOW_SHARE * min(ctx.budgets):
            break
    forced = text | window
    fq, fk = pooled_video_features(ctx)
    wq, wk = draw_projections(ctx.scene, ctx.heads)

    def head(h: int) -> torch.Tensor:
        q_bar, k_bar = fq @ wq[h].to(ctx.device), fk @ wk[h].to(ctx.device)
        kk = cosine(k_bar, k_bar)
        redundancy = (kk * video_kv.unsqueeze(0)).sum(1) / video_kv.sum().clamp_min(1)
        score = SSTA_LAMBDA * cosine(q_bar, k_bar) - (1 - SSTA_LAMBDA) * redundancy.unsqueeze(0)
        score = score + JITTER_WEIGHT * ctx.jitter(h)
        return select_blocks(score, ctx.budgets[h], "row", forced=forced, priority=ctx.row_priority())

    return stack_heads(ctx, head)


# Tile windows of the defaults per family: Wan2.1's tuned setting, HunyuanVideo-1.5's native one.
DEFAULT_WINDOWS = {"Q384K384-W": (1, 3, 3), "Q384K384-H": (3, 3, 3)}
DEFAULT_TILE = (6, 8, 8)


def tessera_default(ctx: SourceContext) -> torch.Tensor:
    """The default sparsifier of the family's model (tile window OR top-k tiles by pooled Q/K, the
    product's own code) on Q/K drawn as per-head projections of the scene's smooth field. Top-k is
    the same for every head, as in the product, and is searched for the case's block density."""
    grid = ctx.layout.grid
    if ctx.layout.tiled or grid.text_tokens or ctx.family.name not in DEFAULT_WINDOWS:
        raise ValueError(f"tessera_default builds {sorted(DEFAULT_WINDOWS)} on text-free frame-major "
                         f"layouts, not {ctx.family.name} on {ctx.layout.name}")
    window = DEFAULT_WINDOWS[ctx.family.name]
    token_grid = TokenGrid(grid.frames, grid.height, grid.width)
    feats = token_features(ctx.layout, draw_field(ctx.scene), ctx.device)  # [S, C], raster order
    wq, wk = draw_projections(ctx.scene, ctx.heads)
    q = torch.einsum("sc,hcd->shd", feats, wq.to(ctx.device)).float().unsqueeze(0)
    k = torch.einsum("sc,hcd->shd", feats, wk.to(ctx.device)).float().unsqueeze(0)

    def blocks_at(top_k: int) -> torch.Tensor:
        sparsifier = SSTASparsifier(tile=DEFAULT_TILE, window=window, top_k=top_k, halve_top_k_at_frames=0)
        layout = sparsifier.layout(token_grid)
        return sparsifier(layout.to_layout(q), layout.to_layout(k), layer=0, step=0, grid=token_grid).blocks[0]

    target = sum(ctx.budgets) / (ctx.heads * ctx.n_q * ctx.n_kv)
    layout = SSTASparsifier(tile=DEFAULT_TILE, window=window).layout(token_grid)
    lo, hi = 0, layout.num_tiles - window_size(layout, window)
    while lo < hi:  # the smallest top-k whose block density reaches the target
        mid = (lo + hi) // 2
        if float(blocks_at(mid).float().mean()) < target:
            lo = mid + 1
        else:
            hi = mid
    blocks = blocks_at(lo)
    if blocks.shape != (ctx.heads, ctx.n_q, ctx.n_kv):
        raise ValueError(f"the sparsifier made {tuple(blocks.shape)} blocks, the family expects "
                         f"{(ctx.heads, ctx.n_q, ctx.n_kv)}")
    return blocks


SOURCES: Mapping[str, SourceFn] = MappingProxyType({
    "sliding_tile": sliding_tile,
    "temporal_heads": temporal_heads,
    "importance_topk": importance_topk,
    "clustered_permuted": clustered_permuted,
    "text_sink": text_sink,
    "ssta": ssta,
    "tessera_default": tessera_default,
})
