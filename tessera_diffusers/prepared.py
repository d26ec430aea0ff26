"""``PreparedPlan``: a plan bound to one mask, holding the metadata its kernel reads (the format is
documented in ``prepare.py``); the split-K workspace a launch of it needs; and the torch helpers
over that metadata which both the plan (its run tensors) and ``prepare`` use.

Built by ``prepare.prepare_torch`` and ``native_prepare.prepare_native``, read by the executor and
the native launcher (``ops.py``). Apart from ``prepare.py`` so that the native preparation, which
builds prepared plans, sits below ``prepare()``, which dispatches to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import torch

from .errors import InvalidArgumentError
from .mask import LogicalMask
from .mask_state import MaskState, set_flag_positions
from .plans import MEMBERSHIP_BITS, PhysicalPlan
from .regroup import permuted_blocks


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


class LaunchConfig(NamedTuple):
    """The integers a native launch needs besides the tensors (``ops.sparse_attention_fwd`` takes
    them as a list in this order)."""

    num_q_tiles: int
    capacity: int  # most KV tiles a query tile can have
    slots: int  # KV slots per tile
    q_unit_log2: int
    kv_unit_log2: int
    num_splits: int
    persistent: int  # 0 or 1


@dataclass(eq=False)
class LaunchState:
    """The mutable bookkeeping of a prepared plan's launches (not part of the plan's value): the
    launch templates the native launcher built for its tensors (``ops.run_direct``), and where a
    worst-case plan's trim to the compact size stands (``PreparedPlan.compacted``)."""

    templates: dict = field(default_factory=dict)
    compact_after_first_launch: bool = False  # queue the longest count's read behind the first launch
    pending: tuple | None = None  # (longest count: pinned host tensor or CPU tensor, event, stream)
    pinned: bool = False  # a CUDA graph or a compiled graph holds the tensors: never replaced


@dataclass(frozen=True, eq=False)
class PreparedPlan:
    """A plan bound to one mask: everything the kernel reads besides q, k, v. Immutable: a trimmed
    or re-prepared plan is a new object (``compacted``, ``Runtime.reuse``); only ``launch_state``,
    the launcher's bookkeeping, changes.

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
    launch_state: LaunchState = field(default_factory=LaunchState, repr=False)

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

    def launch_config(self) -> LaunchConfig:
        """The integers a native launch needs besides the tensors."""
        plan = self.plan
        return LaunchConfig(self.num_q_tiles, self.capacity, plan.slots_per_tile, plan.q_unit.bit_length() - 1,
                            plan.kv_unit.bit_length() - 1, plan.tasks.num_splits, int(plan.tasks.persistent))

    # ------------------------------------------------------------------ deferred compaction
    def defer_compaction(self) -> None:
        """Queue a read of the longest tile list behind the metadata's writes (device -> pinned
        host memory, an event after it) so that ``compacted`` can trim ``cap`` later without a sync."""
        launch = self.launch_state
        launch.compact_after_first_launch = False
        longest = self.tile_counts.amax() if self.tile_counts.numel() else self.tile_counts.new_zeros(())
        if longest.device.type != "cuda":
            launch.pending = (longest, None, None)
            return
        host = torch.empty((), dtype=longest.dtype, pin_memory=True)
        host.copy_(longest, non_blocking=True)
        stream = torch.cuda.current_stream(longest.device)
        event = torch.cuda.Event()
        event.record(stream)
        launch.pending = (host, event, stream)

    def compacted(self) -> PreparedPlan | None:
        """This plan with its metadata trimmed to ``cap`` = the longest tile list, once the deferred
        read of that length has landed: the tensors ``compact=True`` gives, bit for bit (what lies
        past a tile list is padding). None where there is nothing to trim, and without blocking
        while the read is in flight, on another stream than the one the metadata was written on,
        during CUDA-graph capture, or for a plan launched under capture or ``torch.compile``
        (``pin``: its pointers must stay valid)."""
        launch = self.launch_state
        if launch.pending is None or launch.pinned:
            return None
        longest, event, stream = launch.pending
        if event is not None and (
            torch.cuda.is_current_stream_capturing()
            or torch.cuda.current_stream(stream.device) != stream
            or not event.query()
        ):
            return None
        launch.pending = None
        cap = max(1, int(longest))
        if cap >= self.capacity:
            return None
        # New allocations (the old metadata is one buffer that views would keep alive); the old
        # buffers return to the caching allocator in stream order, after the kernels that read them.
        return replace(self, capacity=cap, tile_slots=self.tile_slots[..., :cap, :].contiguous(),
                       tile_member=self.tile_member[..., :cap].contiguous(), tile_counts=self.tile_counts.clone(),
                       q_order=self.q_order.clone(), launch_state=LaunchState())

    def pin(self) -> None:
        """Keep this plan's metadata for good (``compacted`` gives nothing): a CUDA graph or a
        compiled graph has their pointers."""
        self.launch_state.pinned = True
        self.launch_state.compact_after_first_launch = False

    def after_launch(self) -> None:
        """Called by a launcher after the plan's kernel is queued: a compaction ``prepare`` deferred
        starts here (its host ops overlap the kernel instead of delaying its launch)."""
        if self.launch_state.compact_after_first_launch:
            self.defer_compaction()

    @property
    def pinned(self) -> bool:
        return self.launch_state.pinned

    @property
    def compaction_pending(self) -> bool:
        launch = self.launch_state
        return (launch.pending is not None or launch.compact_after_first_launch) and not launch.pinned

    def computed_fraction(self) -> torch.Tensor:
        """Scheduled tile area over the full (Sq x Skv) grid, per mask (b, h): the work the plan
        pays for, including masked-out entries inside coarsened / packed tiles. ``[Bm, Hm]``."""
        area = self.tile_counts.to(torch.float64).sum(-1) * self.plan.tile_q * self.plan.tile_kv
        return area / (self.mask.seq_len_q * self.mask.seq_len_kv)


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


def regrouped_state(plan: PhysicalPlan, state: MaskState, q_units: torch.Tensor) -> MaskState:
    """The mask of ``state`` with each head's block rows in the order of ``q_units``: ``nQT * kq``
    rows, the last tile's padding positions empty (the mask the grouped layout's tile tensors describe)."""
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
