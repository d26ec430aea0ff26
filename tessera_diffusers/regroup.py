"""Query-block grouping for the grouped query layout: per mask head, an order of the query blocks in
which each run of ``group`` consecutive entries (one query tile of ``group`` blocks) shares few key
blocks beyond its own.

A query tile schedules the union of its rows' key blocks. In the natural order a tile holds blocks
``t * g .. t * g + g - 1``; where neighbouring rows differ (temporal heads, strided windows) that
union is much larger than any one row. Gathering alike rows into a tile shrinks it.

The algorithm (``csrc/include/tessera/regroup.cuh`` implements exactly this, bit for bit): per mask
head ``(mb, mh)``, row ``i < nQ`` has the key set ``{j : blocks[mb, mh, i, j]}``; ``g = group``,
``W = window``. The head's rows are cut into *segments* of ``S`` consecutive rows, ``S = segment``
rounded up to a multiple of ``g`` (``segment = 0``, or ``S >= nQ``: one segment of all ``nQ`` rows;
only the last segment may be shorter), and the greedy runs in each segment ``[lo, hi)`` on its own.
Every group lies within one segment, and since ``S`` is a multiple of ``g`` segment ``[lo, hi)``
fills exactly positions ``lo .. hi - 1`` of the order; the segments are independent chains of picks,
which the kernel runs side by side.

    greedy = 0
    for each segment [lo, hi):
        free[i] = true for lo <= i < hi; written = lo; seed = lo
        while written < hi:
            seed = first free i >= seed        (from the previous seed on: the scan only moves forward)
            take seed: q_units[written] = seed; union = row[seed]
            n = min(g, hi - written)
            for k in 1 .. n - 1:
                candidates = free c with seed < c <= seed + W and c < hi
                if any: pick = the candidate whose key set differs least from union
                               (popcount(row[c] ^ union)); ties: the lowest c
                else:   pick = the first free c > seed       (one exists: written + k < hi)
                take pick: q_units[written + k] = pick; union |= row[pick]
            greedy += popcount(union); written += n
    q_units[nQ .. num_slots) = -1                (num_slots = ceil(nQ / g) * g)
    natural = sum over the groups {t * g .. t * g + g - 1} (clipped at nQ) of popcount(their union)
    if natural <= greedy: q_units[i] = i for i < nQ (the natural order wins ties; per head: greedy
                                                     sums every segment's groups)
    key_blocks = (natural, greedy)

The pick weighs both sides of the difference: the blocks a candidate would add to the union and
the union's blocks it lacks. Counting only the first favoured rows with few key blocks over rows
like the seed's, which then had to join worse groups. The torch code takes ``lack_weight`` w
(``LACK_WEIGHT``, 1, is the kernel's): the pick's count is popcount(row[c] & ~union) + w *
popcount(union & ~row[c]); w = 0 counts only the added blocks (compared in docs/results.md,
"Design decisions").

Segments cost little, since a group takes rows near its seed: ``DEFAULT_SEGMENT`` is the smallest
of 128, 256 and 512 blocks that scheduled at most 1% more key blocks than one segment per head on
every (family, source, g) of the corpus at N = 32k (Q16K16, Q32K16 and Q32K32, g = 2 .. 8;
docs/results.md, "Design decisions").

``g = 1`` gives the natural order. ``group_query_blocks`` runs the CUDA kernel for a CUDA tensor
when the loaded library has it and ``TESSERA_NATIVE_PREPARE`` is not ``"0"``; otherwise (and for a
window of rows too large for the kernel's shared memory) the torch code, which is the CPU path and
the oracle (``tests/gpu/test_regroup_gpu.py``).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from . import library
from .errors import CatalogError, InvalidArgumentError, describe_tensor
from .library import TesseraGroupParams, block_mask_struct, on_device, stream_handle
from .mask_state import group_activity

DEFAULT_WINDOW = 64  # query blocks after a group's seed it may take
DEFAULT_SEGMENT = 128  # query blocks per segment (module docstring)
LACK_WEIGHT = 1  # the pick counts the blocks in which a candidate and the union differ, as the kernel does
# On the CPU the torch code groups its runs (segments) in batches whose candidate rows take at most
# this many bytes: larger temporaries ran several times slower (24 heads of Q16K16 at N = 32k in
# 192 segments of 256 rows, 2 cores: 17-22 s in one batch of 25 MB, 1.5-3 s in batches of 2-3 MB).
CPU_BATCH_BYTES = 1 << 21
CUDA_ERROR_INVALID_CONFIGURATION = 9  # the kernel's window of packed rows does not fit in shared memory


@dataclass(frozen=True)
class QueryGrouping:
    """The order of the query blocks of each mask head and what it schedules."""

    q_units: torch.Tensor  # [Bm, Hm, num_slots] int32: query block per position, -1 past the last
    key_blocks: torch.Tensor  # [Bm, Hm, 2] int64: key blocks summed over the groups, (natural, greedy)


def check_arguments(blocks: torch.Tensor, group: int, window: int, segment: int) -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool or blocks.dim() != 4 or blocks.numel() == 0:
        raise InvalidArgumentError("blocks", "a non-empty [Bm, Hm, nQ, nKV] bool tensor", describe_tensor(blocks))
    for name, value in (("group", group), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(name, "a positive number of query blocks", repr(value))
    if isinstance(segment, bool) or not isinstance(segment, int) or segment < 0:
        raise InvalidArgumentError("segment", "0 (one segment per head) or a positive number of query blocks "
                                   "(rounded up to a multiple of group)", repr(segment))


def num_slots(rows: int, group: int) -> int:
    """Entries per head of ``q_units``: whole groups of ``group``."""
    return math.ceil(rows / group) * group


def segment_rows(rows: int, group: int, segment: int) -> int:
    """Query blocks per segment of a head of ``rows`` blocks: ``segment`` rounded up to a multiple of
    ``group``, or ``rows`` (one segment) for 0 or from ``rows`` on."""
    length = math.ceil(segment / group) * group
    return rows if length == 0 or length >= rows else length


def natural_units(rows: int, slots: int, device: torch.device) -> torch.Tensor:
    """``[slots]`` int64: ``0 .. rows - 1``, then -1."""
    units = torch.arange(slots, device=device)
    return torch.where(units < rows, units, -1)


def greedy_orders(rows: torch.Tensor, group: int, window: int,
                  lack_weight: int = LACK_WEIGHT) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy of the module docstring on ``rows`` ``[G, n, nKV]`` bool, each of its ``G`` runs
    of ``n`` rows on its own: ``(order, greedy)``, the order ``[G, ceil(n / group) * group]`` int64
    (-1 past the last row) and its key blocks ``[G]`` int64. The runs go side by side, on the CPU in
    batches of at most ``CPU_BATCH_BYTES`` of candidate rows."""
    runs, n, n_kv = rows.shape
    per_batch = runs if rows.device.type != "cpu" else max(1, CPU_BATCH_BYTES // (max(1, min(window, n - 1)) * n_kv))
    if per_batch >= runs:
        return greedy_batch(rows, group, window, lack_weight)
    batches = [greedy_batch(rows[i:i + per_batch], group, window, lack_weight) for i in range(0, runs, per_batch)]
    return torch.cat([order for order, _ in batches]), torch.cat([greedy for _, greedy in batches])


def greedy_batch(rows: torch.Tensor, group: int, window: int,
                 lack_weight: int = LACK_WEIGHT) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_orders`` of every run at once, one pick at a time. Each candidate's count of key
    blocks outside the union is kept and lowered by the blocks each pick adds (exact integers, so
    the same picks as recounting). The union's blocks a candidate lacks are ``popcount(union) -
    (popcount(row[c]) - outside)``, and ``popcount(union)`` is the same for every candidate of a
    pick: the argmin reads ``(1 + w) * outside - w * popcount(row[c])``."""
    runs, n, n_kv = rows.shape
    device = rows.device
    run = torch.arange(runs, device=device)
    positions = torch.arange(n, device=device)
    ahead = torch.arange(1, min(window, n - 1) + 1, device=device)  # [W'] candidate offsets from the seed
    order = torch.full((runs, num_slots(n, group)), -1, dtype=torch.int64, device=device)
    free = torch.ones(runs, n, dtype=torch.bool, device=device)
    seed = torch.zeros(runs, dtype=torch.int64, device=device)
    greedy = torch.zeros(runs, dtype=torch.int64, device=device)
    for start in range(0, n, group):
        size = min(group, n - start)
        seed = (free & (positions >= seed[:, None])).int().argmax(1)  # argmax: the first free one
        free[run, seed] = False
        order[:, start] = seed
        union = rows[run, seed]  # [G, nKV]
        if size > 1:
            candidates = seed[:, None] + ahead  # [G, W']
            in_range = candidates < n
            candidates = candidates.clamp(max=n - 1)
            candidate_rows = rows[run[:, None], candidates]  # [G, W', nKV]
            outside = (candidate_rows & ~union[:, None]).sum(-1)  # [G, W'] key blocks outside the union
            own = candidate_rows.sum(-1) if lack_weight else None  # [G, W'] key blocks of each candidate
            for k in range(1, size):
                open_ = free.gather(1, candidates) & in_range
                count = (1 + lack_weight) * outside - lack_weight * own if lack_weight else outside  # [G, W']
                # argmin: the lowest c of a tie
                best = torch.where(open_, count, (1 + lack_weight) * n_kv + 1).argmin(1)
                first_after = (free & (positions > seed[:, None])).int().argmax(1)
                pick = torch.where(open_.any(1), candidates[run, best], first_after)
                free[run, pick] = False
                order[:, start + k] = pick
                added = rows[run, pick] & ~union
                union = union | added
                outside -= (candidate_rows & added[:, None]).sum(-1)
        greedy += union.sum(-1)
    return order, greedy


def group_query_blocks_torch(
    blocks: torch.Tensor, group: int, window: int = DEFAULT_WINDOW, *, segment: int = DEFAULT_SEGMENT,
    lack_weight: int = LACK_WEIGHT,
) -> QueryGrouping:
    """The grouping of ``blocks`` ``[Bm, Hm, nQ, nKV]`` (bool, any strides) in torch, in segments of
    ``segment`` query blocks (module docstring): the segments of every head side by side
    (``greedy_orders``), those of ``S`` rows together, then the heads' last, shorter ones.
    ``lack_weight``: the pick's weight of the union's blocks a candidate lacks (module docstring;
    only ``LACK_WEIGHT`` matches the CUDA kernel)."""
    check_arguments(blocks, group, window, segment)
    if isinstance(lack_weight, bool) or not isinstance(lack_weight, int) or lack_weight < 0:
        raise InvalidArgumentError("lack_weight", "a non-negative int", repr(lack_weight))
    bm, hm, n_q, n_kv = blocks.shape
    device = blocks.device
    rows = blocks.reshape(bm * hm, n_q, n_kv)  # [G, nQ, nKV]
    heads = rows.shape[0]
    length = segment_rows(n_q, group, segment)
    # Segments of `length` rows whose orders hold no padding (all when length is a multiple of g),
    # then the rest: a head's last, shorter segment, or its one segment of nQ rows.
    whole = n_q // length if length % group == 0 else 0
    rest = n_q - whole * length
    orders, greedy = [], torch.zeros(heads, dtype=torch.int64, device=device)
    if whole:
        order, counts = greedy_orders(rows[:, :whole * length].reshape(heads * whole, length, n_kv), group, window,
                                      lack_weight)
        first = torch.arange(whole, device=device)[:, None] * length  # [whole, 1] each segment's first row
        orders.append((order.view(heads, whole, length) + first).view(heads, whole * length))
        greedy += counts.view(heads, whole).sum(1)
    if rest:
        order, counts = greedy_orders(rows[:, whole * length:], group, window, lack_weight)
        orders.append(torch.where(order >= 0, order + whole * length, -1))
        greedy += counts
    order = torch.cat(orders, 1)  # [G, num_slots]
    natural = group_activity(rows, group, dim=-2).sum((-2, -1))
    slots = num_slots(n_q, group)
    order = torch.where((natural <= greedy)[:, None], natural_units(n_q, slots, device), order)
    return QueryGrouping(
        q_units=order.to(torch.int32).view(bm, hm, slots),
        key_blocks=torch.stack([natural, greedy], -1).view(bm, hm, 2),
    )


def native_grouping_enabled(device: torch.device) -> bool:
    """Whether masks on ``device`` are grouped by the CUDA kernel (see ``library.native_path_enabled``)."""
    return library.native_path_enabled(device) and library.grouping_library() is not None


def group_query_blocks_native(
    blocks: torch.Tensor, group: int, window: int = DEFAULT_WINDOW, *, segment: int = DEFAULT_SEGMENT
) -> QueryGrouping:
    """``group_query_blocks_torch`` in the native library: one allocation (the outputs and the
    segments' key blocks) and two launches, no sync. A window of packed rows too large for the
    kernel's shared memory takes the torch code."""
    check_arguments(blocks, group, window, segment)
    device = blocks.device
    if device.type != "cuda":
        raise InvalidArgumentError("blocks", "a CUDA tensor for the native path", f"device {device}")
    lib = library.grouping_library()
    if lib is None:
        raise CatalogError("the native library has no tessera_group_query_blocks: rebuild it with "
                           "`python csrc/build_native.py`, or set TESSERA_NATIVE_PREPARE=0")
    bm, hm, n_q, _ = blocks.shape
    heads, slots = bm * hm, num_slots(n_q, group)
    length = segment_rows(n_q, group, segment)
    segments = math.ceil(n_q / length)
    p = TesseraGroupParams()
    p.mask = block_mask_struct(blocks)
    # Past nQ - 1 a wider window changes nothing: the clamp keeps any Python int within int32.
    p.group, p.window, p.num_slots = group, min(window, n_q), slots
    p.segment = 0 if segments == 1 else length
    with on_device(device):
        counts = 2 * heads * (1 + segments)  # key_blocks, then segment_key_blocks
        buffer = torch.empty(counts + (heads * slots + 1) // 2, dtype=torch.int64, device=device)
        key_blocks = buffer[:2 * heads].view(bm, hm, 2)
        segment_key_blocks = buffer[2 * heads:counts]  # [Bm, Hm, segments, 2] scratch
        q_units = buffer.view(torch.int32)[2 * counts:2 * counts + heads * slots].view(bm, hm, slots)
        p.q_units, p.key_blocks = q_units.data_ptr(), key_blocks.data_ptr()
        p.segment_key_blocks = segment_key_blocks.data_ptr()
        code = lib.handle.tessera_group_query_blocks(ctypes.byref(p), stream_handle(device))
    if code == CUDA_ERROR_INVALID_CONFIGURATION:
        return group_query_blocks_torch(blocks, group, window, segment=segment)
    lib.check(code, "native query grouping")
    return QueryGrouping(q_units=q_units, key_blocks=key_blocks)


def query_grouping(
    blocks: torch.Tensor,
    group: int,
    window: int = DEFAULT_WINDOW,
    *,
    segment: int = DEFAULT_SEGMENT,
    native: bool | None = None,
) -> QueryGrouping:
    """The grouping of ``blocks`` ``[Bm, Hm, nQ, nKV]`` bool in segments of ``segment`` query blocks
    (module docstring): ``native`` True / False forces the CUDA kernel / the torch code; None picks
    the kernel where ``native_grouping_enabled``."""
    check_arguments(blocks, group, window, segment)
    if native is None:
        native = native_grouping_enabled(blocks.device)
    grouping = group_query_blocks_native if native else group_query_blocks_torch
    return grouping(blocks, group, window, segment=segment)


def group_query_blocks(
    blocks: torch.Tensor,
    group: int,
    window: int = DEFAULT_WINDOW,
    *,
    segment: int = DEFAULT_SEGMENT,
    native: bool | None = None,
) -> torch.Tensor:
    """``q_units`` ``[Bm, Hm, ceil(nQ / group) * group]`` int32 on ``blocks``' device: per mask head,
    the query block at each position of the grouped layout (module docstring), -1 past the last."""
    return query_grouping(blocks, group, window, segment=segment, native=native).q_units


def permuted_blocks(blocks: torch.Tensor, q_units: torch.Tensor) -> torch.Tensor:
    """``[Bm, Hm, num_slots, nKV]`` bool: row ``i`` of each head is ``blocks``' row ``q_units[.., i]``,
    empty where that is -1. ``blocks`` may be expanded (stride 0)."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool or blocks.dim() != 4:
        raise InvalidArgumentError("blocks", "a [Bm, Hm, nQ, nKV] bool tensor", describe_tensor(blocks))
    bm, hm, _, n_kv = blocks.shape
    if (not isinstance(q_units, torch.Tensor) or q_units.dim() != 3 or tuple(q_units.shape[:2]) != (bm, hm)
            or q_units.dtype not in (torch.int32, torch.int64) or q_units.device != blocks.device):
        raise InvalidArgumentError("q_units", f"a [{bm}, {hm}, num_slots] integer tensor on {blocks.device}",
                                   describe_tensor(q_units))
    index = q_units.long()
    rows = blocks.gather(2, index.clamp(min=0)[..., None].expand(-1, -1, -1, n_kv))
    return rows & (index >= 0)[..., None]
