"""Synthetic, structured Q/K inputs for the importance-based sources.

Real video Q/K are smooth over space and time (neighbouring latents look alike) and repeat content
far away (the same object in another frame or place). A sum of low-frequency 3-D cosines over the
latent grid has both properties. Per-head projections turn the shared field into each head's Q and
K, with K correlated to Q so that similar content attends to itself.

Everything random here is drawn on the CPU from a seeded generator and is small; the token-level
evaluation runs in float64 on the target device, so a case builds the same mask on any device up
to float64 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .grids import TokenLayout

FIELD_CHANNELS = 16
FIELD_COMPONENTS = 24
MAX_FREQUENCY = 3.0  # cycles over the grid extent: smooth at block scale, varied across the video
KMEANS_CHUNK = 16384  # rows of the distance matrix computed at once


@dataclass(frozen=True, eq=False)
class SmoothField:
    """``f(t, y, x) = sum_r amps[r] * cos(2 pi <freqs[r], (t/T, y/H, x/W)> + phases[r])``."""

    freqs: torch.Tensor  # [R, 3] float64
    phases: torch.Tensor  # [R] float64
    amps: torch.Tensor  # [R, C] float64


def draw_field(gen: torch.Generator, components: int = FIELD_COMPONENTS, channels: int = FIELD_CHANNELS) -> SmoothField:
    """A random smooth field; low frequencies get most of the energy."""
    freqs = (torch.rand(components, 3, generator=gen, dtype=torch.float64) * 2 - 1) * MAX_FREQUENCY
    phases = torch.rand(components, generator=gen, dtype=torch.float64) * 2 * math.pi
    decay = (1.0 + freqs.norm(dim=1, keepdim=True)) ** -1.5
    amps = torch.randn(components, channels, generator=gen, dtype=torch.float64) * decay
    return SmoothField(freqs, phases, amps)


def token_features(layout: TokenLayout, field: SmoothField, device: torch.device | str) -> torch.Tensor:
    """The field at every video position of ``layout`` (zero on canvas padding). ``[video_len, C]`` float64."""
    coords = layout.coords(device).to(torch.float64)
    grid = layout.grid
    extents = torch.tensor([grid.frames, grid.height, grid.width], dtype=torch.float64, device=device)
    arg = 2 * math.pi * (coords / extents) @ field.freqs.to(device).T + field.phases.to(device)  # [V, R]
    feats = torch.cos(arg) @ field.amps.to(device)
    if layout.tiled:
        feats = feats * layout.real(device).unsqueeze(-1).to(torch.float64)
    return feats


def draw_projections(
    gen: torch.Generator, heads: int, channels: int = FIELD_CHANNELS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Q and K projections ``[H, C, C]`` float64 with K = rho * Q + noise (rho in [0.5, 0.95])."""
    wq = torch.randn(heads, channels, channels, generator=gen, dtype=torch.float64) / math.sqrt(channels)
    noise = torch.randn(heads, channels, channels, generator=gen, dtype=torch.float64) / math.sqrt(channels)
    rho = (0.5 + 0.45 * torch.rand(heads, 1, 1, generator=gen, dtype=torch.float64))
    wk = rho * wq + torch.sqrt(1 - rho**2) * noise
    return wq, wk


def pool_blocks(values: torch.Tensor, weights: torch.Tensor, block: int, seq_len: int) -> torch.Tensor:
    """Weighted mean of ``values [N, C]`` over each block of ``block`` positions of a ``seq_len``
    sequence (positions past ``N`` hold nothing). ``weights [N]``. Returns ``[ceil(seq_len/block), C]``;
    a block with zero weight gets 0."""
    n_blocks = math.ceil(seq_len / block)
    channels = values.shape[-1]
    padded = torch.zeros(n_blocks * block, channels, dtype=values.dtype, device=values.device)
    w = torch.zeros(n_blocks * block, dtype=values.dtype, device=values.device)
    padded[: values.shape[0]] = values * weights.unsqueeze(-1)
    w[: values.shape[0]] = weights
    total = padded.view(n_blocks, block, channels).sum(1)
    count = w.view(n_blocks, block).sum(1, keepdim=True)
    return torch.where(count > 0, total / count.clamp_min(1e-30), torch.zeros_like(total))


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every row of ``a [n, C]`` with every row of ``b [m, C]``. ``[n, m]``."""
    an = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    bn = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return an @ bn.T


def kmeans(x: torch.Tensor, init: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means on ``x [N, C]`` from the rows ``init [K]`` of x.

    Returns labels ``[N]`` int64 and centroids ``[K, C]``; an empty cluster keeps its centroid."""
    centroids = x[init].clone()
    for _ in range(iters):
        labels = nearest_centroid(x, centroids)
        sums = cluster_sums(x, labels, centroids.shape[0])
        counts = torch.bincount(labels, minlength=centroids.shape[0]).to(x.dtype).unsqueeze(-1)
        centroids = torch.where(counts > 0, sums / counts.clamp_min(1), centroids)
    return nearest_centroid(x, centroids), centroids


def cluster_sums(x: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Sum of the rows of ``x [N, C]`` per label, ``[k, C]``, by one-hot matmuls over row chunks
    (``index_add_`` on CUDA adds floats atomically, in no fixed order, which would make the
    clustering, and so the mask, differ from run to run)."""
    sums = torch.zeros(k, x.shape[1], dtype=x.dtype, device=x.device)
    clusters = torch.arange(k, device=x.device)
    for start in range(0, x.shape[0], KMEANS_CHUNK):
        one_hot = (labels[start : start + KMEANS_CHUNK].unsqueeze(0) == clusters.unsqueeze(1)).to(x.dtype)
        sums += one_hot @ x[start : start + KMEANS_CHUNK]
    return sums


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid of every row of ``x [N, C]``, in row chunks. ``[N]`` int64."""
    labels = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    c_sq = (centroids * centroids).sum(-1)
    for start in range(0, x.shape[0], KMEANS_CHUNK):
        rows = x[start : start + KMEANS_CHUNK]
        dist = c_sq.unsqueeze(0) - 2 * rows @ centroids.T  # |x|^2 is the same for every centroid
        labels[start : start + rows.shape[0]] = dist.argmin(-1)
    return labels
