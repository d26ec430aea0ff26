"""Mask statistics in the native library (``tessera_mask_counts``): the counts behind
``MaskState``'s statistics, its per-row block counts and the row-union sums in one launch.

The torch code of ``mask_state.py`` dispatches about fifteen small ops for these on a cold request
(a new mask), each a kernel launch costing ~45 us of host time on a GPU; here it is one allocation,
three views and one ctypes call, which with ``read=True`` also copies the counts to the host (one
sync). The results are the same integers as the torch code, which stays the CPU path and the oracle
(``tests/gpu/test_native_prepare_gpu.py``). ``MaskState`` takes this path where
``library.native_path_enabled``; a native failure raises ``NativeKernelError``.
"""

from __future__ import annotations

import ctypes

import torch

from .errors import InvalidArgumentError
from .kernel_table import HOPPER_TILES, PORTABLE_TILES
from .library import (
    MAX_UNION_GROUPS,
    NativeLibrary,
    TesseraMaskCountsParams,
    block_mask_struct,
    on_device,
    require_library,
    stream_handle,
)

NUM_MASK_COUNTS = 6  # the counts of mask_state.count_blocks, first in the counts buffer
MASK_COUNT_SLOTS = NUM_MASK_COUNTS + MAX_UNION_GROUPS  # TESSERA_MASK_COUNT_SLOTS


def union_rows_to_prefetch(block_q: int) -> tuple[int, ...]:
    """Query-tile heights (in block rows, > 1) of the kernel table's tiles for ``block_q``: the
    group sizes the cost model asks ``MaskState.row_union_ratios`` for next, computed in the same
    launch as the statistics' counts so that a cold request reads the mask once."""
    heights = {tile.tile_q // block_q for tile in PORTABLE_TILES + HOPPER_TILES}
    return tuple(sorted(h for h in heights if h > 1))[:MAX_UNION_GROUPS]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def typed_view(buffer: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A contiguous ``shape`` view of ``buffer``'s storage from element ``offset`` (one view op)."""
    return buffer.as_strided(shape, contiguous_strides(shape), offset)


class NativeMaskCounts:
    """One statistics launch over a mask: the counts on the device, read to the host at most once.

    ``counts`` ``[6]`` int64 = ``mask_state.count_blocks``; ``row_counts`` ``[Bm, Hm, nQ]`` int32 =
    ``MaskState.kv_num_blocks``; ``unions[r]`` = ``group_activity(blocks, r, dim=-2).sum()`` for each
    group size ``r`` of ``groups``."""

    def __init__(self, buffer: torch.Tensor, counts: torch.Tensor, row_counts: torch.Tensor,
                 groups: tuple[int, ...], host: tuple[int, ...] | None):
        self.buffer = buffer  # [MASK_COUNT_SLOTS + ceil(rows / 2)] int64
        self.counts = counts  # [6] int64 view
        self.row_counts = row_counts  # [Bm, Hm, nQ] int32 view
        self.groups = groups
        self._host = host  # the MASK_COUNT_SLOTS counts, once read

    def host_counts(self) -> tuple[int, ...]:
        """All counts on the host (the first call reads them: one sync)."""
        if self._host is None:
            self._host = tuple(self.buffer[:MASK_COUNT_SLOTS].tolist())
        return self._host

    @property
    def unions(self) -> dict[int, int]:
        host = self.host_counts()
        return {r: host[NUM_MASK_COUNTS + k] for k, r in enumerate(self.groups)}

    def unions_for(self, blocks: torch.Tensor, rows: tuple[int, ...], launch=None) -> dict[int, int]:
        """Union sums for every size of ``rows``: this launch's, and one more ``launch`` (default
        ``launch_mask_counts``) and read per four sizes it lacks. ``blocks`` is the block tensor
        this launch counted."""
        launch = launch or launch_mask_counts
        unions = dict(self.unions)
        left = [r for r in dict.fromkeys(int(r) for r in rows) if r not in unions]
        for start in range(0, len(left), MAX_UNION_GROUPS):
            unions |= launch(blocks, tuple(left[start:start + MAX_UNION_GROUPS])).unions
        return unions


def launch_mask_counts(
    blocks: torch.Tensor, groups: tuple[int, ...] = (), read: bool = True, library: NativeLibrary | None = None
) -> NativeMaskCounts:
    """The statistics' counts of a ``[Bm, Hm, nQ, nKV]`` bool block tensor in one launch, and the
    union sums for up to four group sizes; ``read`` also copies the counts to the host inside the
    same ctypes call (one sync)."""
    if len(groups) > MAX_UNION_GROUPS or any(int(r) < 1 for r in groups):
        raise InvalidArgumentError("groups", f"at most {MAX_UNION_GROUPS} group sizes >= 1", groups)
    device = blocks.device
    lib = require_library(device, library)
    bm, hm, n_q = blocks.shape[:3]
    rows = bm * hm * n_q
    p = TesseraMaskCountsParams()
    p.mask = block_mask_struct(blocks)
    p.num_groups = len(groups)
    for k, r in enumerate(groups):
        p.group_rows[k] = int(r)
    host = (ctypes.c_int64 * MASK_COUNT_SLOTS)() if read else None
    with on_device(device):
        buffer = torch.empty(MASK_COUNT_SLOTS + (rows + 1) // 2, dtype=torch.int64, device=device)
        counts = buffer[:NUM_MASK_COUNTS]
        row_counts = typed_view(buffer.view(torch.int32), (bm, hm, n_q), 2 * MASK_COUNT_SLOTS)
        p.counts, p.row_counts = buffer.data_ptr(), row_counts.data_ptr()
        lib.check(lib.handle.tessera_mask_counts(ctypes.byref(p), host, stream_handle(device)), "native mask counts")
    return NativeMaskCounts(buffer, counts, row_counts, tuple(int(r) for r in groups),
                            tuple(host) if host is not None else None)


def mask_counts_native(blocks: torch.Tensor, rows: tuple[int, ...] = ()) -> tuple[tuple[int, ...], dict[int, int]]:
    """``(count_blocks's six counts, {r: union sum})`` of ``blocks`` on the host: one launch and one
    read per four group sizes."""
    groups = tuple(dict.fromkeys(int(r) for r in rows))
    first = launch_mask_counts(blocks, groups[:MAX_UNION_GROUPS])
    return first.host_counts()[:NUM_MASK_COUNTS], first.unions_for(blocks, groups)
