"""Latent grids and token layouts: where every token of a video self-attention sequence sits.

A *latent grid* is the ``(frames, height, width)`` shape of a video model's patchified latent plus
the text tokens a joint-attention model appends after the video (HunyuanVideo-1.5). A *token
layout* says in which order the sequence visits the grid:

- frame-major (Wan2.1, HunyuanVideo-1.5 without a sparsifier): raster order over
  ``(frame, row, column)``;
- tiled (HunyuanVideo-1.5's own sparse scheme, SSTA): the canvas is zero-padded to a multiple of a
  3-D tile (6 x 8 x 8 = 384 tokens) and the sequence visits tile after tile, each tile in raster
  order, so a 384-token block is exactly one tile.

Text tokens always follow the video tokens. Blocks are summarized by the bounding box of their
video tokens, which is what the window sources measure distances between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError

# HunyuanVideo-1.5's SSTA tile: frames x height x width tokens.
SSTA_TILE: tuple[int, int, int] = (6, 8, 8)
# Coordinates larger than any grid extent; marks "no video token" in a block's bounding box.
NO_COORD = 1 << 30


@dataclass(frozen=True)
class LatentGrid:
    """A patchified video latent ``(frames, height, width)`` plus appended text tokens.

    ``heads`` is the attention-head count of the model that runs at this grid; a case uses it unless
    told otherwise."""

    name: str
    frames: int
    height: int
    width: int
    text_tokens: int = 0
    heads: int = 24

    def __post_init__(self) -> None:
        for field_name in ("frames", "height", "width", "heads"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"LatentGrid.{field_name}", "a positive int", repr(value))
        if isinstance(self.text_tokens, bool) or not isinstance(self.text_tokens, int) or self.text_tokens < 0:
            raise InvalidArgumentError("LatentGrid.text_tokens", "a non-negative int", repr(self.text_tokens))

    @property
    def video_tokens(self) -> int:
        return self.frames * self.height * self.width

    @property
    def seq_len(self) -> int:
        """Tokens of the frame-major sequence (video then text)."""
        return self.video_tokens + self.text_tokens

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "frames": self.frames,
            "height": self.height,
            "width": self.width,
            "text_tokens": self.text_tokens,
            "heads": self.heads,
        }

    @classmethod
    def from_dict(cls, data: dict) -> LatentGrid:
        return cls(
            str(data["name"]),
            int(data["frames"]),
            int(data["height"]),
            int(data["width"]),
            int(data.get("text_tokens", 0)),
            int(data.get("heads", 24)),
        )


# Real latent grids of the two target models (see MODELS.md) and a power-of-two benchmark grid.
WAN_720P = LatentGrid("wan720p", 21, 45, 80, 0, 40)  # Wan2.1 14B, 1280x720, 81 frames: 75,600 tokens
WAN_480P = LatentGrid("wan480p", 21, 30, 52, 0, 12)  # Wan2.1 1.3B, 832x480, 81 frames: 32,760 tokens
HV_720P = LatentGrid("hv720p", 31, 45, 80, 1985, 16)  # HunyuanVideo-1.5, 121 frames: 111,600 + 1,985 text
HV_480P = LatentGrid("hv480p", 31, 30, 53, 1985, 16)  # HunyuanVideo-1.5, 848x480: 49,290 + 1,985 text
BENCH_32K = LatentGrid("bench32k", 16, 32, 64, 0, 24)  # 32,768 tokens: the benchmark protocol's N

GRIDS: tuple[LatentGrid, ...] = (WAN_720P, WAN_480P, HV_720P, HV_480P, BENCH_32K)
# HunyuanVideo-1.5's sparse call as the processor makes it: video tokens only (text stays dense
# beside it). Not in GRIDS: only the defaults' families (families.DEFAULTS_FAMILIES) use them.
HV_720P_VIDEO = LatentGrid("hv720p-video", 31, 45, 80, 0, 16)  # 111,600 tokens
HV_480P_VIDEO = LatentGrid("hv480p-video", 31, 30, 53, 0, 16)  # 49,290 tokens
VIDEO_ONLY_GRIDS: tuple[LatentGrid, ...] = (HV_720P_VIDEO, HV_480P_VIDEO)


def grid_named(name: str) -> LatentGrid:
    """One of ``GRIDS`` or ``VIDEO_ONLY_GRIDS`` by name."""
    for grid in GRIDS + VIDEO_ONLY_GRIDS:
        if grid.name == name:
            return grid
    raise InvalidArgumentError("grid", f"one of {[g.name for g in GRIDS + VIDEO_ONLY_GRIDS]}", repr(name))


@dataclass(frozen=True)
class TokenLayout:
    """Token order of one sequence over a latent grid (frame-major, or SSTA tiles over a padded canvas)."""

    grid: LatentGrid
    tiled: bool = False
    tile: tuple[int, int, int] = SSTA_TILE

    @property
    def tile_counts(self) -> tuple[int, int, int]:
        """Tiles along (frames, height, width) of the padded canvas."""
        return (
            math.ceil(self.grid.frames / self.tile[0]),
            math.ceil(self.grid.height / self.tile[1]),
            math.ceil(self.grid.width / self.tile[2]),
        )

    @property
    def tile_tokens(self) -> int:
        return self.tile[0] * self.tile[1] * self.tile[2]

    @property
    def video_len(self) -> int:
        """Video positions of the sequence (the padded canvas when tiled)."""
        if not self.tiled:
            return self.grid.video_tokens
        return math.prod(self.tile_counts) * self.tile_tokens

    @property
    def seq_len(self) -> int:
        return self.video_len + self.grid.text_tokens

    @property
    def extents(self) -> tuple[int, int, int]:
        """Coordinate extents (frames, height, width) of the positions the sequence visits."""
        if not self.tiled:
            return (self.grid.frames, self.grid.height, self.grid.width)
        counts = self.tile_counts
        return (counts[0] * self.tile[0], counts[1] * self.tile[1], counts[2] * self.tile[2])

    def coords(self, device: torch.device | str) -> torch.Tensor:
        """Grid coordinates ``(t, y, x)`` of every video position, in sequence order. ``[video_len, 3]`` int64."""
        pos = torch.arange(self.video_len, device=device, dtype=torch.int64)
        if not self.tiled:
            hw = self.grid.height * self.grid.width
            return torch.stack([pos // hw, (pos // self.grid.width) % self.grid.height, pos % self.grid.width], -1)
        _, ny, nx = self.tile_counts
        ft, fy, fx = self.tile
        tile, within = pos // self.tile_tokens, pos % self.tile_tokens
        it, iy, ix = tile // (ny * nx), (tile // nx) % ny, tile % nx
        dt, dy, dx = within // (fy * fx), (within // fx) % fy, within % fx
        return torch.stack([it * ft + dt, iy * fy + dy, ix * fx + dx], -1)

    def real(self, device: torch.device | str) -> torch.Tensor:
        """Whether each video position is a real latent token (False on canvas padding). ``[video_len]`` bool."""
        c = self.coords(device)
        g = self.grid
        return (c[:, 0] < g.frames) & (c[:, 1] < g.height) & (c[:, 2] < g.width)

    def name(self) -> str:
        return f"{self.grid.name}/{'tiled' if self.tiled else 'frame-major'}"


@dataclass(frozen=True, eq=False)
class BlockBoxes:
    """Bounding boxes of the video tokens of every block along one sequence axis.

    ``lo``/``hi`` are inclusive per-axis coordinate bounds ``[nB, 3]`` int64 (``lo = NO_COORD``,
    ``hi = -1`` for a block without video tokens); ``text`` marks blocks holding any text token."""

    lo: torch.Tensor  # [nB, 3] int64
    hi: torch.Tensor  # [nB, 3] int64
    text: torch.Tensor  # [nB] bool

    @property
    def count(self) -> int:
        return self.text.shape[0]


def block_boxes(layout: TokenLayout, block: int, device: torch.device | str) -> BlockBoxes:
    """Per-block bounding boxes of a layout cut into blocks of ``block`` tokens (last one partial)."""
    seq = layout.seq_len
    n_blocks = math.ceil(seq / block)
    coords = layout.coords(device)  # [V, 3]
    padded = torch.full((n_blocks * block, 3), -1, dtype=torch.int64, device=device)
    padded[: layout.video_len] = coords
    padded = padded.view(n_blocks, block, 3)
    is_video = padded[..., 0] >= 0  # [nB, block]
    lo = torch.where(is_video.unsqueeze(-1), padded, torch.full_like(padded, NO_COORD)).amin(1)
    hi = padded.amax(1)  # -1 where no video token
    first_text_block = layout.video_len // block
    text = torch.arange(n_blocks, device=device) >= first_text_block
    if layout.grid.text_tokens == 0:
        text = torch.zeros_like(text)
    return BlockBoxes(lo, hi, text)


def box_distances(q: BlockBoxes, kv: BlockBoxes) -> torch.Tensor:
    """Per-axis gap between every query box and key box (0 where the boxes overlap along that axis).

    Returns ``[3, nQ, nKV]`` float32 (small integers, exact). Text blocks get arbitrary values; the
    sources force them dense anyway."""
    out = torch.empty(3, q.count, kv.count, dtype=torch.float32, device=q.lo.device)
    for axis in range(3):  # one axis at a time keeps the int64 temporaries small
        lo_q, hi_q = q.lo[:, axis].unsqueeze(1), q.hi[:, axis].unsqueeze(1)  # [nQ, 1]
        lo_k, hi_k = kv.lo[:, axis].unsqueeze(0), kv.hi[:, axis].unsqueeze(0)  # [1, nKV]
        gap = torch.maximum(lo_k - hi_q, lo_q - hi_k).clamp_(0, 1 << 20)
        out[axis] = gap
    return out
