"""Launch preparation: the metadata one plan's kernel reads, built from a MaskState.

Pure tensor code on the mask's device; never launches attention, never syncs with the host.

Metadata format (read as is by the PyTorch executor and the CUDA kernels)
=======================================================================

Units. Each axis is cut into *units*: ``q_unit = gcd(block_q, tile_q)`` rows and
``kv_unit = gcd(block_kv, tile_kv)`` columns. A unit never straddles a logical block, so the
activity of a (query unit, KV unit) pair is exactly the activity of its logical block pair. A query
tile holds ``kq = tile_q / q_unit`` query units; a KV tile holds ``S = tile_kv / kv_unit`` *slots*,
each one KV unit of ``kv_unit`` consecutive tokens. Every mapping is a choice of units and slots:

    Direct      tile == block on both axes: kq = S = 1, every bit set.
    Coarsened   tile = k * block: a tile covers k aligned blocks; membership bits mask the inactive ones.
    Refined     block = r * tile: a block becomes r tiles; kq = S = 1.
    Packed      (KV) the active KV units of a query tile, in ascending order, gathered S per tile.

Tensors (mask dims ``Bm, Hm`` are 1 where the mask broadcasts):

    tile_counts  int32 [Bm, Hm, nQT]            number of KV tiles of query tile t (nQT = ceil(Sq / tile_q))
    tile_slots   int32 [Bm, Hm, nQT, cap, S]    first token of each slot of each KV tile; -1 = empty slot
    tile_member  int64 [Bm, Hm, nQT, cap]       bit (a * S + s): query unit a of the tile may see slot s
    q_order      int32 [Bm, Hm, nQT]            traversal: the query tile handled at rank r
    run_counts   int32 [Bm, Hm, nQT]            runs of consecutive active KV units of the query tile
    run_starts   int32 [Bm, Hm, nQT, capR]      first token of each run
    run_lengths  int32 [Bm, Hm, nQT, capR]      tokens in each run (clipped at Skv)

``cap`` is at most ``ceil(ceil(Skv / kv_unit) / S)`` (trimmed to the longest list by default), ``capR = ceil(ceil(Skv / kv_unit) / 2)``. Tiles of a row are
in ascending token order. Tokens at or past ``Skv`` are masked by the kernel (partial last block);
query rows at or past ``Sq`` are never stored. A query unit past ``Sq`` has no membership bits.

Split-K: a task ``(b, h, rank, split)`` handles tiles ``[split * per, min(count, (split + 1) * per))``
of its query tile, ``per = ceil(count / num_splits)``, and writes its normalized partial output and
log-sum-exp to the workspace ``o_partial [num_splits, B, H, Sq, D] fp32``,
``lse_partial [num_splits, B, H, Sq] fp32`` (an empty part writes 0 and -inf); the merge rescales
the parts to a common maximum. Tasks are numbered rank-major: ``task = (rank * B * H + b * H + h)
* num_splits + split``, so the longest rows of every head start first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError
from .mask_state import MaskState
from .plans import MEMBERSHIP_BITS, KvLayout, PhysicalPlan, Traversal


@dataclass(frozen=True)
class WorkspaceLayout:
    """Split-K scratch a prepared plan needs for a given (B, H, Sq, D); empty when num_splits == 1."""

    num_splits: int
    o_partial_shape: tuple[int, ...]  # [num_splits, B, H, Sq, D] fp32
    lse_partial_shape: tuple[int, ...]  # [num_splits, B, H, Sq] fp32

    @property
    def nbytes(self) -> int:
        if self.num_splits <= 1:
            return 0
        return 4 * (math.prod(self.o_partial_shape) + math.prod(self.lse_partial_shape))

    def allocate(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty(self.o_partial_shape, dtype=torch.float32, device=device)
        lse = torch.empty(self.lse_partial_shape, dtype=torch.float32, device=device)
        return o, lse


@dataclass(frozen=True, eq=False)
class PreparedPlan:
    """A plan bound to one mask: everything the kernel reads besides q, k, v."""

    plan: PhysicalPlan
    state: MaskState
    num_q_tiles: int  # nQT
    capacity: int  # cap: most KV tiles a query tile can have
    tile_counts: torch.Tensor  # [Bm, Hm, nQT] int32
    tile_slots: torch.Tensor  # [Bm, Hm, nQT, cap, S] int32
    tile_member: torch.Tensor  # [Bm, Hm, nQT, cap] int64
    q_order: torch.Tensor  # [Bm, Hm, nQT] int32
    run_counts: torch.Tensor  # [Bm, Hm, nQT] int32
    run_starts: torch.Tensor  # [Bm, Hm, nQT, capR] int32
    run_lengths: torch.Tensor  # [Bm, Hm, nQT, capR] int32

    @property
    def mask(self):
        return self.state.mask

    def workspace(self, batch: int, heads: int, head_dim: int) -> WorkspaceLayout:
        ns = self.plan.tasks.num_splits
        sq = self.mask.seq_len_q
        return WorkspaceLayout(ns, (ns, batch, heads, sq, head_dim), (ns, batch, heads, sq))

    def num_tasks(self, batch: int, heads: int) -> int:
        return self.num_q_tiles * batch * heads * self.plan.tasks.num_splits

    def launch_config(self) -> list[int]:
        """The integers a native launch needs besides the tensors (``ops.sparse_attention_fwd``)."""
        plan = self.plan
        return [
            self.num_q_tiles,
            self.capacity,
            plan.slots_per_tile,
            plan.q_unit.bit_length() - 1,
            plan.kv_unit.bit_length() - 1,
            plan.tasks.num_splits,
            int(plan.tasks.persistent),
        ]

    def computed_fraction(self) -> torch.Tensor:
        """Scheduled tile area over the full (Sq x Skv) grid, per mask (b, h): the work the plan
        pays for, including masked-out entries inside coarsened / packed tiles. ``[Bm, Hm]``."""
        area = self.tile_counts.to(torch.float64).sum(-1) * self.plan.tile_q * self.plan.tile_kv
        return area / (self.mask.seq_len_q * self.mask.seq_len_kv)


def prepare(plan: PhysicalPlan, state: MaskState, compact: bool = True) -> PreparedPlan:
    """Build the metadata of ``plan`` for the mask of ``state`` (see the module docstring).

    ``compact`` trims ``cap`` to the longest tile list of any query tile, which costs one host sync
    (a scalar) and shrinks the metadata by the inverse density; ``compact=False`` keeps the
    worst-case capacity and never syncs (for capture in a CUDA graph)."""
    mask = state.mask
    if (plan.block_q, plan.block_kv) != (mask.block_q, mask.block_kv):
        raise InvalidArgumentError(
            "plan", f"a plan for geometry Q{mask.block_q}K{mask.block_kv}", f"{plan.name}"
        )
    kq, slots = plan.q_units_per_tile, plan.slots_per_tile
    if kq * slots > MEMBERSHIP_BITS:
        raise InvalidArgumentError(
            "plan", f"q units x slots <= {MEMBERSHIP_BITS}", f"{kq} x {slots} for {plan.name}"
        )
    act = unit_activity(plan, state)  # [Bm, Hm, nQT, kq, nUk] bool
    tile_any = act.any(3)  # [Bm, Hm, nQT, nUk]
    n_uk = tile_any.shape[-1]
    cap = math.ceil(n_uk / slots)
    if plan.kv_layout is KvLayout.PACKED:
        counts, slot_units = packed_tiles(tile_any, slots, cap)
    else:
        counts, slot_units = contiguous_tiles(tile_any, slots, cap)
    if compact:
        cap = max(1, int(counts.max()))
        slot_units = slot_units[..., :cap, :]
    kv_unit = plan.kv_unit
    tile_slots = torch.where(slot_units >= 0, slot_units * kv_unit, slot_units).to(torch.int32)
    tile_member = membership_words(act, slot_units, kq, slots)
    if plan.tasks.traversal is Traversal.LONGEST_FIRST:
        q_order = torch.argsort(-counts, dim=-1, stable=True).to(torch.int32)
    else:
        q_order = torch.arange(counts.shape[-1], dtype=torch.int32, device=counts.device).expand_as(counts)
        q_order = q_order.contiguous()
    run_counts, run_starts, run_lengths = unit_runs(tile_any, kv_unit, mask.seq_len_kv)
    return PreparedPlan(
        plan=plan,
        state=state,
        num_q_tiles=counts.shape[-1],
        capacity=cap,
        tile_counts=counts,
        tile_slots=tile_slots.contiguous(),
        tile_member=tile_member.contiguous(),
        q_order=q_order,
        run_counts=run_counts,
        run_starts=run_starts,
        run_lengths=run_lengths,
    )


def unit_activity(plan: PhysicalPlan, state: MaskState) -> torch.Tensor:
    """Activity of every (query unit of each query tile, KV unit). ``[Bm, Hm, nQT, kq, nUk]`` bool."""
    mask = state.mask
    device = mask.device
    q_unit, kv_unit, kq = plan.q_unit, plan.kv_unit, plan.q_units_per_tile
    n_qt = math.ceil(mask.seq_len_q / plan.tile_q)
    n_uk = math.ceil(mask.seq_len_kv / kv_unit)
    q_rows = torch.arange(n_qt * kq, device=device) * q_unit  # first row of each query unit
    q_valid = q_rows < mask.seq_len_q
    q_block = torch.clamp(q_rows // mask.block_q, max=mask.num_blocks_q - 1)
    kv_block = torch.arange(n_uk, device=device) * kv_unit // mask.block_kv
    act = mask.blocks.index_select(2, q_block).index_select(3, kv_block)  # [Bm, Hm, nQT*kq, nUk]
    act = act & q_valid.view(1, 1, -1, 1)
    return act.view(mask.batch, mask.heads, n_qt, kq, n_uk)


def contiguous_tiles(tile_any: torch.Tensor, slots: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned groups of ``slots`` consecutive units that hold an active unit, in order.

    Returns counts ``[..., nQT]`` int32 and the unit of each slot ``[..., nQT, cap, S]`` (-1 empty)."""
    n_uk = tile_any.shape[-1]
    padded = torch.nn.functional.pad(tile_any, (0, cap * slots - n_uk))
    group_any = padded.view(*tile_any.shape[:-1], cap, slots).any(-1)  # [..., cap]
    counts, order = compact_flags(group_any, cap)  # order: group index at each tile position
    unit = order.unsqueeze(-1) * slots + torch.arange(slots, device=tile_any.device)
    unit = torch.where((order.unsqueeze(-1) >= 0) & (unit < n_uk), unit, torch.full_like(unit, -1))
    return counts, unit


def packed_tiles(tile_any: torch.Tensor, slots: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The active units of each query tile, ascending, ``slots`` per tile."""
    active_units = tile_any.sum(-1, dtype=torch.int32)
    _, order = compact_flags(tile_any, cap * slots)  # unit at each packed position
    counts = (active_units + slots - 1) // slots
    return counts.to(torch.int32), order.view(*tile_any.shape[:-1], cap, slots)


def compact_flags(flags: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream compaction along the last dim without a host sync.

    Returns the number of set flags ``[...]`` int32 and, padded to ``width`` with -1, the indices of
    the set flags in ascending order ``[..., width]`` int64."""
    n = flags.shape[-1]
    rank = flags.to(torch.int32).cumsum(-1) - 1
    target = torch.where(flags, rank.to(torch.int64), torch.full_like(rank, width, dtype=torch.int64))
    index = torch.arange(n, device=flags.device).expand(flags.shape)
    out = torch.full((*flags.shape[:-1], width + 1), -1, dtype=torch.int64, device=flags.device)
    out.scatter_(-1, target, index)
    return flags.sum(-1, dtype=torch.int32), out[..., :width]


def membership_words(act: torch.Tensor, slot_units: torch.Tensor, kq: int, slots: int) -> torch.Tensor:
    """Pack bit (a * S + s) = act[a, unit of slot s] for every tile. ``[Bm, Hm, nQT, cap]`` int64."""
    bm, hm, n_qt, _, n_uk = act.shape
    cap = slot_units.shape[-2]
    # Gather each slot's activity column for every query unit: [Bm, Hm, nQT, kq, cap * S].
    idx = slot_units.clamp_min(0).view(bm, hm, n_qt, 1, cap * slots).expand(bm, hm, n_qt, kq, cap * slots)
    bits = torch.gather(act, 4, idx) & (slot_units >= 0).view(bm, hm, n_qt, 1, cap * slots)
    bits = bits.view(bm, hm, n_qt, kq, cap, slots).permute(0, 1, 2, 4, 3, 5).reshape(bm, hm, n_qt, cap, kq * slots)
    # Bytes of the little-endian word, then the 8 bytes viewed as one int64: a handful of launches
    # instead of one per bit, and no int64 overflow at bit 63.
    bits = torch.nn.functional.pad(bits.to(torch.uint8), (0, MEMBERSHIP_BITS - kq * slots))
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=act.device)
    word_bytes = (bits.view(bm, hm, n_qt, cap, 8, 8) * weights).sum(-1, dtype=torch.uint8)
    return word_bytes.contiguous().view(torch.int64).view(bm, hm, n_qt, cap)


def unit_runs(tile_any: torch.Tensor, kv_unit: int, seq_len_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of consecutive active KV units per query tile, as token ranges (for run grouping and
    box loads). Returns counts ``[...]``, starts and lengths ``[..., capR]`` int32."""
    n_uk = tile_any.shape[-1]
    cap_r = max(1, math.ceil(n_uk / 2))
    prev = torch.nn.functional.pad(tile_any[..., :-1], (1, 0))
    nxt = torch.nn.functional.pad(tile_any[..., 1:], (0, 1))
    counts, first = compact_flags(tile_any & ~prev, cap_r)
    _, last = compact_flags(tile_any & ~nxt, cap_r)
    starts = torch.where(first >= 0, first * kv_unit, first)
    ends = torch.clamp((last + 1) * kv_unit, max=seq_len_kv)
    lengths = torch.where(first >= 0, ends - starts, torch.zeros_like(starts))
    return counts, starts.to(torch.int32).contiguous(), lengths.to(torch.int32).contiguous()
