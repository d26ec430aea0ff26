"""Launch preparation: the metadata one plan's kernel reads, built from a MaskState.

Tensor code on the mask's device, or on CUDA the native library's preparation kernels
(``native_prepare.py``, the same metadata bit for bit); never launches attention, and syncs with
the host only for the one scalar of ``compact`` (``prepare(..., compact=False)`` never does).

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

No kernel reads the three run tensors (a launch passes the other four), so ``PreparedPlan`` computes
them on first access.

Grouped query layout (``QLayout.GROUPED``, a coarsened query axis: ``q_unit = block_q``, ``kq``
blocks per tile). Each head's query blocks are first put in the order of ``regroup.py`` and the
tensors above are those of the regrouped mask (block row ``i`` of head ``(mb, mh)`` is row
``q_units[mb, mh, i]`` of the mask), plus

    q_units      int32 [Bm, Hm, nQT * kq]       query unit at position a of query tile t: q_units[.., t * kq + a];
                                                -1 where the position holds none (the last tile of a head)

A kernel loads the query rows of a tile from, and stores its output rows to, those units' tokens.

``cap`` is at most ``ceil(ceil(Skv / kv_unit) / S)`` (trimmed to the longest list by default), ``capR = ceil(ceil(Skv / kv_unit) / 2)``. Tiles of a row are
in ascending token order. Tokens at or past ``Skv`` are masked by the kernel (partial last block);
query rows at or past ``Sq`` are never stored. A query unit past ``Sq`` has no membership bits.

Split-K: a task ``(b, h, rank, split)`` handles tiles ``[split * per, min(count, (split + 1) * per))``
of its query tile, ``per = ceil(count / num_splits)``, and writes its normalized partial output and
log-sum-exp to the workspace ``o_partial [num_splits, B, H, Sq, D] fp32``,
``lse_partial [num_splits, B, H, Sq] fp32`` (an empty part writes 0 and -inf); the merge rescales
the parts to a common maximum. Tasks are numbered head-major: ``task = ((b * H + h) * nQT + rank)
* num_splits + split``, so the CTAs resident at one time share one head's K/V in L2, longest rows
first within the head.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .errors import InvalidArgumentError
from .mask import LogicalMask
from .mask_state import MaskState, group_activity, native_path, set_flag_positions
from .plans import MEMBERSHIP_BITS, KvLayout, PhysicalPlan, QLayout, Traversal


@dataclass(frozen=True)
class WorkspaceLayout:
    """Split-K scratch a prepared plan needs for a given (B, H, Sq, D); empty when num_splits == 1."""

    num_splits: int
    o_partial_shape: tuple[int, ...]  # [num_splits, B, H, Sq, D] fp32
    lse_partial_shape: tuple[int, ...]  # [num_splits, B, H, Sq] fp32

    @classmethod
    def of(cls, num_splits: int, batch: int, seq_q: int, heads: int, head_dim: int) -> WorkspaceLayout:
        """The scratch of ``num_splits`` splits for outputs ``[B, Sq, H, D]``."""
        return cls(num_splits, (num_splits, batch, heads, seq_q, head_dim), (num_splits, batch, heads, seq_q))

    @property
    def nbytes(self) -> int:
        if self.num_splits <= 1:
            return 0
        return 4 * (math.prod(self.o_partial_shape) + math.prod(self.lse_partial_shape))

    def allocate(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        o = torch.empty(self.o_partial_shape, dtype=torch.float32, device=device)
        lse = torch.empty(self.lse_partial_shape, dtype=torch.float32, device=device)
        return o, lse


@dataclass
class DeferredCompaction:
    """Where a worst-case plan's trim to the compact size stands (``PreparedPlan.settle``)."""

    at_first_launch: bool = False  # the longest count's read is to be queued behind the first launch
    pending: tuple | None = None  # (longest count: pinned host tensor or CPU tensor, event, stream)
    pinned: bool = False  # a CUDA graph or a compiled graph holds the tensors: never moved


@dataclass(frozen=True, eq=False)
class PreparedPlan:
    """A plan bound to one mask: everything the kernel reads besides q, k, v.

    The run tensors (``run_counts``, ``run_starts``, ``run_lengths``) are not passed to any kernel;
    they are computed from the mask on first access and kept."""

    plan: PhysicalPlan
    state: MaskState
    num_q_tiles: int  # nQT
    capacity: int  # cap: most KV tiles a query tile can have
    tile_counts: torch.Tensor  # [Bm, Hm, nQT] int32
    tile_slots: torch.Tensor  # [Bm, Hm, nQT, cap, S] int32
    tile_member: torch.Tensor  # [Bm, Hm, nQT, cap] int64
    q_order: torch.Tensor  # [Bm, Hm, nQT] int32
    q_units: torch.Tensor | None = None  # [Bm, Hm, nQT * kq] int32: the grouped query layout, else None
    # Mutable state behind the frozen fields: the deferred compaction, and the launch templates the
    # native launcher built for these tensors (``ops.run_direct``; dropped when ``settle`` moves them).
    compaction: DeferredCompaction = field(default_factory=DeferredCompaction, repr=False)
    launch_templates: dict = field(default_factory=dict, repr=False)

    @property
    def mask(self):
        return self.state.mask

    @cached_property
    def runs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(run_counts, run_starts, run_lengths)`` of every query tile (see the module docstring)."""
        state = self.state if self.q_units is None else regrouped_state(self.plan, self.state, self.q_units)
        tile_any = unit_activity(self.plan, state).any(3)
        return unit_runs(tile_any, self.plan.kv_unit, self.mask.seq_len_kv)

    @property
    def run_counts(self) -> torch.Tensor:  # [Bm, Hm, nQT] int32
        return self.runs[0]

    @property
    def run_starts(self) -> torch.Tensor:  # [Bm, Hm, nQT, capR] int32
        return self.runs[1]

    @property
    def run_lengths(self) -> torch.Tensor:  # [Bm, Hm, nQT, capR] int32
        return self.runs[2]

    @property
    def metadata(self) -> tuple[torch.Tensor, ...]:
        """What a kernel launch reads: ``(tile_counts, tile_slots, tile_member, q_order, q_units)``
        (``q_units`` None in the natural query layout)."""
        return self.tile_counts, self.tile_slots, self.tile_member, self.q_order, self.q_units

    def check_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Refuse q ``[B, Sq, H, D]``, k, v ``[B, Skv, H, D]`` that this plan's mask does not cover:
        other sequence lengths, or a batch or head count the mask does not broadcast to."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise InvalidArgumentError(name, "a 4-D tensor [B, S, H, D]", type(t).__name__ if not
                                           isinstance(t, torch.Tensor) else f"shape {tuple(t.shape)}")
        if k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
            raise InvalidArgumentError("k, v", f"[B, Skv, H, D] with B, H, D of q {tuple(q.shape)}",
                                       f"{tuple(k.shape)} and {tuple(v.shape)}")
        mask = self.mask
        if (q.shape[1], k.shape[1]) != (mask.seq_len_q, mask.seq_len_kv):
            raise InvalidArgumentError("q, k", f"sequence lengths ({mask.seq_len_q}, {mask.seq_len_kv}) of the mask "
                                       "this plan was prepared for", f"({q.shape[1]}, {k.shape[1]})")
        mask.check_broadcast(q.shape[0], q.shape[2])

    def workspace(self, batch: int, heads: int, head_dim: int) -> WorkspaceLayout:
        return WorkspaceLayout.of(self.plan.tasks.num_splits, batch, self.mask.seq_len_q, heads, head_dim)

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

    # ------------------------------------------------------------------ deferred compaction
    def defer_compaction(self) -> None:
        """Queue a read of the longest tile list behind the metadata's writes (device -> pinned
        host memory, an event after it) so that ``settle`` can trim ``cap`` later without a sync."""
        self.compaction.at_first_launch = False
        longest = self.tile_counts.amax() if self.tile_counts.numel() else self.tile_counts.new_zeros(())
        if longest.device.type != "cuda":
            self.compaction.pending = (longest, None, None)
            return
        host = torch.empty((), dtype=longest.dtype, pin_memory=True)
        host.copy_(longest, non_blocking=True)
        stream = torch.cuda.current_stream(longest.device)
        event = torch.cuda.Event()
        event.record(stream)
        self.compaction.pending = (host, event, stream)

    def settle(self) -> bool:
        """Trim the metadata to ``cap`` = the longest tile list once its deferred read has landed:
        the same tensors ``compact=True`` gives, bit for bit (what lies past a tile list is
        padding). Never blocks: False while the read is in flight, on another stream than the one
        the metadata was written on, during CUDA-graph capture, or for a plan that was launched
        under capture or ``torch.compile`` (``pin``: its pointers must stay valid)."""
        pending = self.compaction.pending
        if pending is None or self.compaction.pinned:
            return False
        longest, event, stream = pending
        if event is not None and (
            torch.cuda.is_current_stream_capturing()
            or torch.cuda.current_stream(stream.device) != stream
            or not event.query()
        ):
            return False
        self.compaction.pending = None
        cap = max(1, int(longest))
        if cap >= self.capacity:
            return True
        # New allocations (the old metadata is one buffer that the views below would keep alive);
        # freed buffers return to the caching allocator in stream order, after the kernels that read them.
        object.__setattr__(self, "tile_slots", self.tile_slots[..., :cap, :].contiguous())
        object.__setattr__(self, "tile_member", self.tile_member[..., :cap].contiguous())
        object.__setattr__(self, "tile_counts", self.tile_counts.clone())
        object.__setattr__(self, "q_order", self.q_order.clone())
        object.__setattr__(self, "capacity", cap)
        self.launch_templates.clear()
        return True

    def pin(self) -> None:
        """Keep the metadata tensors as they are for good (``settle`` does nothing): a CUDA graph or
        a compiled graph has their pointers."""
        self.compaction.pinned = True
        self.compaction.at_first_launch = False

    def after_launch(self) -> None:
        """Called by a launcher after the plan's kernel is queued: a compaction ``prepare`` deferred
        starts here (its host ops overlap the kernel instead of delaying its launch)."""
        if self.compaction.at_first_launch:
            self.defer_compaction()

    @property
    def compaction_pending(self) -> bool:
        c = self.compaction
        return (c.pending is not None or c.at_first_launch) and not c.pinned

    def computed_fraction(self) -> torch.Tensor:
        """Scheduled tile area over the full (Sq x Skv) grid, per mask (b, h): the work the plan
        pays for, including masked-out entries inside coarsened / packed tiles. ``[Bm, Hm]``."""
        area = self.tile_counts.to(torch.float64).sum(-1) * self.plan.tile_q * self.plan.tile_kv
        return area / (self.mask.seq_len_q * self.mask.seq_len_kv)


# The native path skips the compacting sync when the worst-case metadata is at most this large:
# writing it costs the GPU microseconds, while a host read stalls the request until every kernel
# queued before it has finished, and the GPU waits for the host's work after it (Q128K128 at 32k
# tokens x 24 heads: 19 MB; Q16K16 there: 63 MB; Q64K64: 75 MB; Wan2.1 720p, 40 heads, Q64K64:
# 670 MB, which compacts). Above DEFERRED_COMPACTION_BYTES such a plan trims itself to the compact
# size at its first reuse after the longest count has reached the host (``PreparedPlan.settle``),
# so a kept plan holds the worst case only until then.
SYNC_FREE_METADATA_BYTES = 128 << 20
DEFERRED_COMPACTION_BYTES = 8 << 20


def prepare(plan: PhysicalPlan, state: MaskState, compact: bool | None = None) -> PreparedPlan:
    """Build the metadata of ``plan`` for the mask of ``state`` (see the module docstring).

    ``compact=True`` trims ``cap`` to the longest tile list of any query tile, which costs one host
    sync (a scalar) and shrinks the metadata by the inverse density; ``compact=False`` keeps the
    worst-case capacity and never syncs (for capture in a CUDA graph). ``None`` (the default)
    compacts unless the native path can write the worst case within ``SYNC_FREE_METADATA_BYTES``;
    a worst case above ``DEFERRED_COMPACTION_BYTES`` is then trimmed at a later reuse (``settle``).

    On CUDA, the native library builds the same metadata in a few launches from one or two ctypes
    calls (``native_prepare.prepare_native``; ``TESSERA_NATIVE_PREPARE=0`` turns it off). The torch
    code below is the CPU path and the oracle: about twenty small tensor ops, the tile counts first
    so that the one sync of ``compact`` waits on little work, everything after it sized by the
    trimmed capacity."""
    if plan.q_layout is QLayout.GROUPED:
        return prepare_grouped(plan, state, compact)
    native = native_path(state.mask.blocks.device)
    defer = False
    if compact is None:
        worst = worst_case_metadata_bytes(plan, state.mask)
        compact = native is None or worst > SYNC_FREE_METADATA_BYTES
        defer = not compact and worst > DEFERRED_COMPACTION_BYTES
    prepared = native.prepare_native(plan, state, compact) if native is not None else prepare_torch(plan, state, compact)
    if defer:  # queued by the first launch, after it (its host ops stay off the request's path)
        prepared.compaction.at_first_launch = True
    return prepared


def prepare_grouped(plan: PhysicalPlan, state: MaskState, compact: bool | None = None) -> PreparedPlan:
    """``prepare`` for the grouped query layout: each head's query blocks in the order of
    ``regroup.group_query_blocks`` (on the mask's device, native on CUDA), then the natural-layout
    metadata of the mask with its block rows in that order (see the module docstring)."""
    from .regroup import group_query_blocks  # regroup reaches prepare through native_prepare

    check_plan(plan, state.mask)
    if not plan.can_group_queries:
        raise InvalidArgumentError("plan", "a plan whose query tile covers several whole blocks for the grouped layout",
                                   f"{plan.name}")
    q_units = group_query_blocks(state.mask.blocks, plan.q_units_per_tile)
    natural = dataclasses.replace(plan, q_layout=QLayout.NATURAL)
    # The regrouped mask (a copy of the block tensor) lives only while its metadata is built.
    inner = prepare(natural, regrouped_state(plan, state, q_units), compact)
    return dataclasses.replace(inner, plan=plan, state=state, q_units=q_units, compaction=inner.compaction,
                               launch_templates={})


def regrouped_state(plan: PhysicalPlan, state: MaskState, q_units: torch.Tensor) -> MaskState:
    """The mask of ``state`` with each head's block rows in the order of ``q_units``: ``nQT * kq``
    rows, the last tile's padding positions empty (the mask the grouped layout's tile tensors describe)."""
    from .regroup import permuted_blocks

    mask = state.mask
    n_qt = q_units.shape[-1] // plan.q_units_per_tile
    return MaskState(LogicalMask(permuted_blocks(mask.blocks, q_units), mask.block_q, mask.block_kv,
                                 n_qt * plan.tile_q, mask.seq_len_kv))


def query_rows(q_units: torch.Tensor, q_unit: int, seq_len_q: int) -> torch.Tensor:
    """Token row of every row of every query tile of the grouped layout, ``[..., nQT * tile_q]``
    int64 from ``q_units [..., nQT * kq]``: -1 where the row holds no query (no unit, or past Sq)."""
    offsets = torch.arange(q_unit, device=q_units.device)
    rows = q_units.long()[..., None] * q_unit + offsets
    rows = torch.where((q_units[..., None] >= 0) & (rows < seq_len_q), rows, -1)
    return rows.flatten(-2)


def worst_case_metadata_bytes(plan: PhysicalPlan, mask: LogicalMask) -> int:
    """Bytes of ``tile_slots`` + ``tile_member`` at the uncompacted capacity ``ceil(nUk / S)``."""
    bm, hm = mask.blocks.shape[:2]
    n_qt = math.ceil(mask.seq_len_q / plan.tile_q)
    cap = math.ceil(math.ceil(mask.seq_len_kv / plan.kv_unit) / plan.slots_per_tile)
    return bm * hm * n_qt * cap * (8 + 4 * plan.slots_per_tile)


def check_plan(plan: PhysicalPlan, mask: LogicalMask) -> None:
    """Raise ``InvalidArgumentError`` unless ``plan`` is for ``mask``'s geometry and its membership
    words fit 64 bits."""
    if (plan.block_q, plan.block_kv) != (mask.block_q, mask.block_kv):
        raise InvalidArgumentError(
            "plan", f"a plan for geometry Q{mask.block_q}K{mask.block_kv}", f"{plan.name}"
        )
    kq, slots = plan.q_units_per_tile, plan.slots_per_tile
    if kq * slots > MEMBERSHIP_BITS:
        raise InvalidArgumentError(
            "plan", f"q units x slots <= {MEMBERSHIP_BITS}", f"{kq} x {slots} for {plan.name}"
        )


def prepare_torch(plan: PhysicalPlan, state: MaskState, compact: bool = True) -> PreparedPlan:
    """``prepare`` in tensor ops on any device (the CPU path, and the native path's oracle)."""
    mask = state.mask
    check_plan(plan, mask)
    kq, slots = plan.q_units_per_tile, plan.slots_per_tile
    act = unit_activity(plan, state)  # [Bm, Hm, nQT, kq, nUk] bool
    tile_any = act.any(3) if kq > 1 else act.squeeze(3)  # [Bm, Hm, nQT, nUk]
    n_uk = tile_any.shape[-1]
    packed = plan.kv_layout is KvLayout.PACKED
    if packed:
        # Active units in order, ``slots`` per tile.
        cumulative = tile_any.cumsum(-1, dtype=torch.int32)  # [Bm, Hm, nQT, nUk]
        counts = (cumulative[..., -1] + (slots - 1)) // slots
    else:
        # Aligned groups of ``slots`` consecutive units that hold an active unit, in order.
        cumulative = group_activity(tile_any, slots).cumsum(-1, dtype=torch.int32)  # [Bm, Hm, nQT, nG]
        counts = cumulative[..., -1].contiguous()
    cap = max(1, int(counts.max())) if compact else math.ceil(n_uk / slots)
    if packed:
        unit = set_flag_positions(cumulative, cap * slots).view(*counts.shape, cap, slots)
    else:
        group = set_flag_positions(cumulative, cap)  # [Bm, Hm, nQT, cap]; nG past the last group
        unit = group.unsqueeze(-1) * slots + torch.arange(slots, device=group.device) if slots > 1 \
            else group.unsqueeze(-1)
    live = unit < n_uk  # [Bm, Hm, nQT, cap, S]: a unit past the end is an empty slot
    tile_slots = torch.where(live, unit * plan.kv_unit, -1).to(torch.int32)
    tile_member = membership_words(act, unit.clamp(max=n_uk - 1), live)
    if plan.tasks.traversal is Traversal.LONGEST_FIRST:
        q_order = torch.argsort(counts, dim=-1, descending=True, stable=True).to(torch.int32)
    else:
        q_order = torch.arange(counts.shape[-1], dtype=torch.int32, device=counts.device).expand_as(counts)
        q_order = q_order.contiguous()
    return PreparedPlan(
        plan=plan,
        state=state,
        num_q_tiles=counts.shape[-1],
        capacity=cap,
        tile_counts=counts,
        tile_slots=tile_slots,
        tile_member=tile_member,
        q_order=q_order,
    )


def unit_activity(plan: PhysicalPlan, state: MaskState) -> torch.Tensor:
    """Activity of every (query unit of each query tile, KV unit). ``[Bm, Hm, nQT, kq, nUk]`` bool.

    A unit never straddles a block (``q_unit`` divides ``block_q``), so each block becomes
    ``block / unit`` units per axis: a view of the block tensor when units are blocks (direct,
    coarsened and packed mappings), one copy when a block is refined. Query units at or past
    ``Sq`` are inactive."""
    mask = state.mask
    q_unit, kv_unit, kq = plan.q_unit, plan.kv_unit, plan.q_units_per_tile
    n_qt = math.ceil(mask.seq_len_q / plan.tile_q)
    n_uq = math.ceil(mask.seq_len_q / q_unit)  # query units holding a row
    n_uk = math.ceil(mask.seq_len_kv / kv_unit)
    blocks = mask.blocks  # [Bm, Hm, nQ, nKV]
    bm, hm, n_q, n_kv = blocks.shape
    rq, rk = mask.block_q // q_unit, mask.block_kv // kv_unit
    act = blocks
    if rq > 1 or rk > 1:
        act = blocks[:, :, :, None, :, None].expand(bm, hm, n_q, rq, n_kv, rk).reshape(bm, hm, n_q * rq, n_kv * rk)
    act = act[:, :, :n_uq, :n_uk]
    if n_qt * kq > n_uq:
        act = torch.nn.functional.pad(act, (0, 0, 0, n_qt * kq - n_uq))  # padding query units: inactive
    return act.reshape(bm, hm, n_qt, kq, n_uk)


def membership_words(act: torch.Tensor, unit: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Pack bit (a * S + s) = act[a, unit of slot s] for every tile (0 where the slot is empty).

    ``act [Bm, Hm, nQT, kq, nUk]`` bool, ``unit`` (clamped into range) and ``live`` ``[Bm, Hm, nQT,
    cap, S]``. Returns ``[Bm, Hm, nQT, cap]`` int64."""
    bm, hm, n_qt, kq, _ = act.shape
    cap, slots = unit.shape[-2:]
    # Gather each slot's activity column for every query unit: [Bm, Hm, nQT, kq, cap * S].
    index = unit.view(bm, hm, n_qt, 1, cap * slots).expand(bm, hm, n_qt, kq, cap * slots)
    bits = torch.gather(act, 4, index) & live.view(bm, hm, n_qt, 1, cap * slots)
    bits = bits.view(bm, hm, n_qt, kq, cap, slots)
    if kq * slots <= 8:
        # The word fits one byte (every plan of the larger block families): shift each bit into
        # place and add over (a, s) in uint8, with no reordering copy.
        shifts = torch.arange(kq * slots, dtype=torch.uint8, device=act.device).view(kq, 1, slots)
        return (bits.view(torch.uint8) << shifts).sum((3, 5), dtype=torch.uint8).to(torch.int64)
    return pack_bits(bits.transpose(3, 4).reshape(bm, hm, n_qt, cap, kq * slots))


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[..., nbits]`` bool (nbits <= 64) -> ``[...]`` int64 with bit i = ``bits[..., i]``.

    Bytes of the little-endian word in uint8, then the 8 bytes viewed as one int64: a handful of
    launches at any width, nothing wider than a byte per bit, no int64 overflow at bit 63."""
    nbits = bits.shape[-1]
    nbytes = -(-nbits // 8)
    as_bytes = bits.contiguous().view(torch.uint8)  # 0 / 1 per bit
    if nbytes * 8 > nbits:
        as_bytes = torch.nn.functional.pad(as_bytes, (0, nbytes * 8 - nbits))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    word_bytes = (as_bytes.view(*bits.shape[:-1], nbytes, 8) << shifts).sum(-1, dtype=torch.uint8)
    if nbytes < 8:
        word_bytes = torch.nn.functional.pad(word_bytes, (0, 8 - nbytes))
    return word_bytes.view(torch.int64).view(bits.shape[:-1])


def unit_runs(tile_any: torch.Tensor, kv_unit: int, seq_len_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of consecutive active KV units per query tile, as token ranges (for run grouping and
    box loads). Returns counts ``[...]``, starts and lengths ``[..., capR]`` int32."""
    n_uk = tile_any.shape[-1]
    cap_r = max(1, math.ceil(n_uk / 2))
    padded = torch.nn.functional.pad(tile_any, (1, 1))
    inner = padded[..., 1:-1]
    starts_so_far = (inner > padded[..., :-2]).cumsum(-1, dtype=torch.int32)
    ends_so_far = (inner > padded[..., 2:]).cumsum(-1, dtype=torch.int32)
    first = set_flag_positions(starts_so_far, cap_r)  # n_uk past the last run
    last = set_flag_positions(ends_so_far, cap_r)
    live = first < n_uk
    starts = torch.where(live, first * kv_unit, -1)
    ends = torch.clamp((last + 1) * kv_unit, max=seq_len_kv)
    lengths = torch.where(live, ends - starts, 0)
    return starts_so_far[..., -1].contiguous(), starts.to(torch.int32), lengths.to(torch.int32)
