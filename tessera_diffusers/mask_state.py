"""MaskState mu(M): the block-CSR form of a logical mask plus the statistics the selector reads.

Built with tensor ops on the mask's own device and no host round trip. The CSR uses a fixed row
stride (FlexAttention's ``kv_num_blocks / kv_indices`` vocabulary) so that no host needs to know the
number of active blocks before the index tensor can be allocated:

    rows r = (b, h, i) of the block grid, flattened row-major over [B|1, H|1, nQ]
    kv_num_blocks[r]          active KV blocks of row r
    kv_indices[r, :kv_num_blocks[r]]   their indices, ascending; the rest of the row is -1
    row_offsets[r]            exclusive prefix sum of kv_num_blocks (offsets into a compact CSR)

``compact_indices()`` gives the classic compact CSR column array (one host sync for its size).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from .mask import LogicalMask


class Stat(IntEnum):
    """Index of each scalar statistic in ``MaskState.stats`` (mirrored by the plan-table schema)."""

    DENSITY = 0  # active blocks / all blocks
    RUN_COVERAGE = 1  # fraction of active blocks inside runs of length >= 2 (0 for an empty mask)
    MAX_ROW_BLOCKS = 2  # most active blocks in one query-block row
    MEAN_ROW_BLOCKS = 3  # mean active blocks per row
    MEAN_RUN_LENGTH = 4  # active blocks / runs (0 for an empty mask)
    EMPTY_ROW_FRACTION = 5  # rows with no active block / rows
    ROW_IMBALANCE = 6  # max / mean active blocks per row (1 for a uniform mask, 0 when empty)
    ROW_OVERLAP = 7  # fraction of active blocks also active in the previous query-block row


NUM_STATS = len(Stat)


@dataclass(frozen=True, eq=False)
class MaskState:
    """Block-CSR of a logical mask and its statistics, all on the mask's device."""

    mask: LogicalMask
    kv_num_blocks: torch.Tensor  # [B|1, H|1, nQ] int32
    kv_indices: torch.Tensor  # [B|1, H|1, nQ, nKV] int32, active first ascending, then -1
    row_offsets: torch.Tensor  # [B|1 * H|1 * nQ + 1] int64, exclusive prefix sum of kv_num_blocks
    stats: torch.Tensor  # [NUM_STATS] float32, indexed by Stat

    def stat(self, which: Stat) -> float:
        """One statistic on the host (a sync: the caller's explicit choice)."""
        return float(self.stats[which])

    def host_stats(self) -> dict[str, float]:
        """All statistics on the host, by name (one sync)."""
        values = self.stats.tolist()
        return {s.name.lower(): values[s] for s in Stat}

    def compact_indices(self) -> torch.Tensor:
        """Classic compact CSR column indices ``[nnz]`` int32 (one host sync for nnz)."""
        flat = self.kv_indices.reshape(-1, self.kv_indices.shape[-1])
        return flat[flat >= 0].to(torch.int32)


def build_mask_state(mask: LogicalMask) -> MaskState:
    """mu(M): block-CSR plus statistics, computed on ``mask.device`` without a host sync."""
    blocks = mask.blocks  # [B, H, nQ, nKV] bool
    n_kv = blocks.shape[-1]
    counts = blocks.sum(-1, dtype=torch.int32)  # [B, H, nQ]

    # Scatter each active column to its rank inside the row: no sort, no nonzero().
    rank = blocks.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1
    cols = torch.arange(n_kv, device=blocks.device, dtype=torch.int32).expand_as(rank)
    indices = torch.full(blocks.shape[:-1] + (n_kv + 1,), -1, dtype=torch.int32, device=blocks.device)
    target = torch.where(blocks, rank, torch.full_like(rank, n_kv)).to(torch.int64)
    indices.scatter_(-1, target, cols)
    indices = indices[..., :n_kv].contiguous()

    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=blocks.device)
    offsets[1:] = counts.reshape(-1).to(torch.int64).cumsum(0)
    return MaskState(mask, counts, indices, offsets, compute_stats(blocks, counts))


def compute_stats(blocks: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The ``Stat`` vector of a ``[B, H, nQ, nKV]`` bool block tensor, on its device. ``[NUM_STATS]`` fp32."""
    f = blocks.to(torch.float32)
    total = torch.tensor(float(blocks.numel()), device=blocks.device)
    active = f.sum()
    safe_active = active.clamp_min(1.0)

    left = torch.nn.functional.pad(f[..., :-1], (1, 0))  # neighbour j-1 active
    right = torch.nn.functional.pad(f[..., 1:], (0, 1))  # neighbour j+1 active
    in_long_run = f * ((left + right) > 0).to(torch.float32)
    run_starts = (f * (1.0 - left)).sum()

    row_counts = counts.to(torch.float32)
    mean_row = row_counts.mean()
    max_row = row_counts.max()
    above = torch.nn.functional.pad(f[..., :-1, :], (0, 0, 1, 0))  # same column, previous q row

    stats = torch.stack(
        [
            active / total,
            in_long_run.sum() / safe_active,
            max_row,
            mean_row,
            torch.where(run_starts > 0, active / run_starts.clamp_min(1.0), torch.zeros_like(active)),
            (row_counts == 0).to(torch.float32).mean(),
            torch.where(mean_row > 0, max_row / mean_row.clamp_min(1e-12), torch.zeros_like(mean_row)),
            (f * above).sum() / safe_active,
        ]
    )
    return stats.to(torch.float32)
