"""MaskState mu(M): the block-CSR form of a logical mask plus the statistics the selector reads.

Built with tensor ops on the mask's own device and no host round trip. Each part is computed on
first use and kept: a request whose plan-table regime needs no statistic and whose plan reads the
block tensor directly (every native plan) pays for none of it. The CSR uses a fixed row stride
(FlexAttention's ``kv_num_blocks / kv_indices`` vocabulary) so that no host needs to know the number
of active blocks before the index tensor can be allocated:

    rows r = (b, h, i) of the block grid, flattened row-major over [B|1, H|1, nQ]
    kv_num_blocks[r]          active KV blocks of row r
    kv_indices[r, :kv_num_blocks[r]]   their indices, ascending; the rest of the row is -1
    row_offsets[r]            exclusive prefix sum of kv_num_blocks (offsets into a compact CSR)

``compact_indices()`` gives the classic compact CSR column array (one host sync for its size).

On CUDA the statistics' counts, ``kv_num_blocks`` and the row-union sums come from one native launch
(``mask_counts.launch_mask_counts``, the same integers as the torch code below, which stays the
CPU path and the oracle) and reach the host in one read.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

import torch

from . import library, mask_counts
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
    """Block-CSR of a logical mask and its statistics, all on the mask's device, each computed on
    first access (no host sync) and cached on the object."""

    mask: LogicalMask

    @cached_property
    def kv_num_blocks(self) -> torch.Tensor:
        """Active KV blocks per query-block row. ``[B|1, H|1, nQ]`` int32."""
        return self.mask.blocks.sum(-1, dtype=torch.int32)

    @cached_property
    def kv_indices(self) -> torch.Tensor:
        """Active KV block indices of each row, ascending, then -1. ``[B|1, H|1, nQ, nKV]`` int32."""
        blocks = self.mask.blocks
        n_kv = blocks.shape[-1]
        index = set_flag_positions(blocks.cumsum(-1, dtype=torch.int32), n_kv, out_int32=True)
        return torch.where(index < n_kv, index, -1)

    @cached_property
    def row_offsets(self) -> torch.Tensor:
        """Exclusive prefix sum of ``kv_num_blocks`` over the flattened rows. ``[rows + 1]`` int64."""
        return torch.nn.functional.pad(self.kv_num_blocks.reshape(-1).cumsum(0), (1, 0))

    @cached_property
    def stat_counts(self) -> torch.Tensor:
        """The exact integer counts the statistics are ratios of (``count_blocks``). ``[6]`` int64."""
        native = self.native_counts()
        if native is not None:
            return native.counts
        return count_blocks(self.mask.blocks, self.kv_num_blocks)

    @cached_property
    def stats(self) -> torch.Tensor:
        """The ``Stat`` vector. ``[NUM_STATS]`` float32."""
        return stats_from_counts(self.stat_counts, self.kv_num_blocks.numel(), self.mask.blocks.numel())

    @property
    def statistics_read(self) -> bool:
        """Whether the statistics were read to the host (``host_stat_values``: one sync)."""
        return "host_stat_values" in self.__dict__

    @cached_property
    def host_stat_values(self) -> tuple[float, ...]:
        """The ``Stat`` vector on the host, equal to ``stats`` (one sync, kept). Reads the six counts
        and takes the ratios on the host, so the device runs no scalar arithmetic for a reader that
        only wants host values (the selector)."""
        if "stats" in self.__dict__:
            return tuple(self.stats.tolist())
        native = self.native_counts(read=True)
        if native is not None:
            blocks = self.mask.blocks
            rows = blocks.shape[0] * blocks.shape[1] * blocks.shape[2]
            return host_stats_from_counts(native.host_counts(), rows, blocks.numel())
        counts = self.stat_counts.cpu()
        return tuple(stats_from_counts(counts, self.kv_num_blocks.numel(), self.mask.blocks.numel()).tolist())

    def row_union_ratios(self, rows: tuple[int, ...]) -> dict[int, float]:
        """For each group size ``r``: the (query block, KV block) pairs a query tile of ``r`` consecutive
        block rows computes — each of its rows runs over the union of their KV blocks — summed and
        divided by the active blocks: the math of a coarsened query axis per active block (1 for an
        empty mask, and for r = 1). One host sync for all sizes; kept per size."""
        cache = self.__dict__.setdefault("_row_union_ratios", {})
        missing = sorted({int(r) for r in rows if int(r) > 1 and int(r) not in cache})
        if not missing:
            return {int(r): (cache[int(r)] if int(r) > 1 else 1.0) for r in rows}
        native = self.native_counts(tuple(missing), read=True)
        if native is not None:
            module = native_path(self.mask.blocks.device)
            unions = native.unions_for(self.mask.blocks, tuple(missing), module.launch_mask_counts)
            values = [native.host_counts()[0]] + [unions[r] for r in missing]
        else:
            blocks = self.mask.blocks
            sums = [blocks.sum(dtype=torch.int64)]
            for r in missing:
                sums.append(group_activity(blocks, r, dim=-2).sum(dtype=torch.int64))
            values = torch.stack(sums).tolist()
        for r, union in zip(missing, values[1:]):
            cache[r] = r * union / values[0] if values[0] else 1.0
        return {int(r): (cache[int(r)] if int(r) > 1 else 1.0) for r in rows}

    def native_counts(self, groups: tuple[int, ...] = (), read: bool = False):
        """The native statistics launch of this mask (``mask_counts.NativeMaskCounts``), made on
        the first call, or None off the native path (not CUDA, no library, TESSERA_NATIVE_PREPARE=0).

        The launch computes the union sums of ``groups`` and of the query-tile heights the cost model
        asks for next (four at most), writes ``kv_num_blocks`` as well, and with ``read`` copies the
        counts to the host in the same call. Later calls return the same launch."""
        native = self.__dict__.get("_native_counts")
        if native is not None:
            return native
        blocks = self.mask.blocks
        module = native_path(blocks.device)
        if module is None:
            return None
        wanted = tuple(dict.fromkeys((*groups, *module.union_rows_to_prefetch(self.mask.block_q))))
        native = module.launch_mask_counts(blocks, wanted[:module.MAX_UNION_GROUPS], read)
        self.__dict__["_native_counts"] = native
        self.__dict__.setdefault("kv_num_blocks", native.row_counts)
        return native

    def stat(self, which: Stat) -> float:
        """One statistic on the host (a sync: the caller's explicit choice)."""
        return self.host_stat_values[which]

    def host_stats(self) -> dict[str, float]:
        """All statistics on the host, by name (one sync)."""
        values = self.host_stat_values
        return {s.name.lower(): values[s] for s in Stat}

    def compact_indices(self) -> torch.Tensor:
        """Classic compact CSR column indices ``[nnz]`` int32 (one host sync for nnz)."""
        flat = self.kv_indices.reshape(-1, self.kv_indices.shape[-1])
        return flat[flat >= 0].to(torch.int32)


def build_mask_state(mask: LogicalMask) -> MaskState:
    """mu(M): block-CSR plus statistics of ``mask``, computed on ``mask.device`` without a host
    sync when first read."""
    return MaskState(mask)


def native_path(device: torch.device):
    """The ``mask_counts`` module where tensors on ``device`` take the native path (CUDA, the
    library with the statistics function, ``TESSERA_NATIVE_PREPARE`` not "0"), else None; off
    CUDA without asking the library."""
    if device.type != "cuda":
        return None
    return mask_counts if library.native_path_enabled(device) else None


def group_activity(flags: torch.Tensor, group: int, dim: int = -1) -> torch.Tensor:
    """Whether each aligned group of ``group`` consecutive entries along ``dim`` holds a True (the
    last group padded with False). ``[..., n, ...]`` -> ``[..., ceil(n / group), ...]`` bool; the
    input itself when ``group == 1``. Groups KV units into tiles (``prepare``) and query-block rows
    into query tiles (``MaskState.row_union_ratios``)."""
    if group == 1:
        return flags
    dim = dim % flags.dim()
    n = flags.shape[dim]
    n_groups = math.ceil(n / group)
    if n_groups * group > n:
        flags = torch.nn.functional.pad(flags, (0, 0) * (flags.dim() - 1 - dim) + (0, n_groups * group - n))
    return flags.unflatten(dim, (n_groups, group)).any(dim + 1)


def set_flag_positions(cumulative: torch.Tensor, width: int, out_int32: bool = False) -> torch.Tensor:
    """Stream compaction along the last dim from the inclusive prefix count of a flag tensor.

    ``cumulative [..., n]`` (``flags.cumsum(-1)``, int32) -> the indices of the set flags in
    ascending order, ``[..., width]`` (int64, or int32 with ``out_int32``); positions past the last
    set flag hold ``n``. No host sync, no scatter and nothing of size ``n x width``: position p is
    the first index whose count reaches p + 1 (a binary search per output)."""
    lead = cumulative.shape[:-1]
    wanted = torch.arange(1, width + 1, dtype=cumulative.dtype, device=cumulative.device)
    wanted = wanted.expand(*lead, width).contiguous()  # searchsorted copies a non-contiguous input anyway
    return torch.searchsorted(cumulative, wanted, out_int32=out_int32)


def compute_stats(blocks: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The ``Stat`` vector of a ``[B, H, nQ, nKV]`` bool block tensor with row counts ``counts
    [B, H, nQ]``, on its device. ``[NUM_STATS]`` fp32."""
    return stats_from_counts(count_blocks(blocks, counts), counts.numel(), blocks.numel())


def count_blocks(blocks: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The integer counts behind the statistics, on the block tensor's device: ``[6]`` int64 =
    active blocks, runs of length 1, runs, blocks also active in the previous row, the longest row,
    empty rows. Every reduction counts in int64 (exact at any size) over bool maps: no float copy
    of the block tensor is made."""
    padded = torch.nn.functional.pad(blocks, (1, 1))  # [..., nKV + 2] bool, inactive borders
    inner = padded[..., 1:-1]
    starts = inner > padded[..., :-2]  # active, left neighbour not: a run begins
    return torch.stack([
        counts.sum(dtype=torch.int64),  # active blocks
        (starts > padded[..., 2:]).sum(),  # runs of length 1: a run begins, right neighbour inactive
        starts.sum(),  # runs
        (blocks[..., 1:, :] & blocks[..., :-1, :]).sum(),  # active in the previous row too
        counts.max().to(torch.int64),  # longest row
        (counts == 0).sum(),  # empty rows
    ])


def host_stats_from_counts(counts: Sequence[int], rows: int, total: int) -> tuple[float, ...]:
    """``stats_from_counts(...).tolist()`` in plain Python from the six counts on the host: the same
    fp64 ratios in the same order, rounded to fp32, so the same values without a tensor op."""
    active, singles, runs, overlap, max_row, empty = (float(c) for c in counts[:6])
    safe_active = max(active, 1.0)
    ratios = (
        active / total,
        (active - singles) / safe_active,
        max_row,
        active / rows,
        active / max(runs, 1.0),
        empty / rows,
        max_row * rows / safe_active,
        overlap / safe_active,
    )
    return tuple(struct.unpack("f", struct.pack("f", r))[0] for r in ratios)


def stats_from_counts(counts: torch.Tensor, rows: int, total: int) -> torch.Tensor:
    """The ``Stat`` vector from ``count_blocks``'s counts (on any device: fp64 ratios, the same
    bits on the host and the GPU), for ``rows`` block rows and ``total`` blocks. ``[NUM_STATS]`` fp32."""
    active, singles, runs, overlap, max_row, empty = counts.to(torch.float64).unbind()
    safe_active = active.clamp_min(1.0)  # every ratio over active blocks is 0 for an empty mask
    stats = torch.stack([
        active / total,
        (active - singles) / safe_active,
        max_row,
        active / rows,
        active / runs.clamp_min(1.0),  # no runs means no active block: 0
        empty / rows,
        max_row * rows / safe_active,
        overlap / safe_active,
    ])
    return stats.to(torch.float32)
