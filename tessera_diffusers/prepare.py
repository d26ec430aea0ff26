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

No kernel reads the three run tensors (a launch passes the other four), so ``PreparedPlan``
(``prepared.py``) computes them on first access.

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

import torch

from . import library, native_prepare, regroup
from .errors import InvalidArgumentError
from .mask import LogicalMask
from .mask_state import MaskState, group_activity, set_flag_positions
from .plans import KvLayout, PhysicalPlan, QLayout, Traversal
from .prepared import PreparedPlan, check_plan, regrouped_state, unit_activity

# The native path skips the compacting sync when the worst-case metadata is at most this large:
# writing it costs the GPU microseconds, while a host read stalls the request until every kernel
# queued before it has finished, and the GPU waits for the host's work after it (Q128K128 at 32k
# tokens x 24 heads: 19 MB; Q16K16 there: 63 MB; Q64K64: 75 MB; Wan2.1 720p, 40 heads, Q64K64:
# 670 MB, which compacts). Above DEFERRED_COMPACTION_BYTES such a plan trims itself to the compact
# size at its first reuse after the longest count has reached the host (``PreparedPlan.compacted``),
# so a kept plan holds the worst case only until then.
SYNC_FREE_METADATA_BYTES = 128 << 20
DEFERRED_COMPACTION_BYTES = 8 << 20


def prepare(plan: PhysicalPlan, state: MaskState, compact: bool | None = None) -> PreparedPlan:
    """Build the metadata of ``plan`` for the mask of ``state`` (see the module docstring).

    ``compact=True`` trims ``cap`` to the longest tile list of any query tile, which costs one host
    sync (a scalar) and shrinks the metadata by the inverse density; ``compact=False`` keeps the
    worst-case capacity and never syncs (for capture in a CUDA graph). ``None`` (the default)
    compacts unless the native path can write the worst case within ``SYNC_FREE_METADATA_BYTES``;
    a worst case above ``DEFERRED_COMPACTION_BYTES`` is then trimmed at a later reuse (``PreparedPlan.compacted``).

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
        prepared.launch_state.compact_after_first_launch = True
    return prepared


def native_path(device: torch.device):
    """The ``native_prepare`` module where tensors on ``device`` are prepared natively (CUDA, the
    library with the preparation functions, ``TESSERA_NATIVE_PREPARE`` not "0"), else None; off
    CUDA without asking the library."""
    if device.type != "cuda":
        return None
    return native_prepare if library.native_path_enabled(device) else None


def prepare_grouped(plan: PhysicalPlan, state: MaskState, compact: bool | None = None) -> PreparedPlan:
    """``prepare`` for the grouped query layout: each head's query blocks in the order of
    ``regroup.group_query_blocks`` (on the mask's device, native on CUDA), then the natural-layout
    metadata of the mask with its block rows in that order (see the module docstring)."""
    check_plan(plan, state.mask)
    if not plan.can_group_queries:
        raise InvalidArgumentError("plan", "a plan whose query tile covers several whole blocks for the grouped layout",
                                   f"{plan.name}")
    q_units = regroup.group_query_blocks(state.mask.blocks, plan.q_units_per_tile)
    natural = dataclasses.replace(plan, q_layout=QLayout.NATURAL)
    # The regrouped mask (a copy of the block tensor) lives only while its metadata is built.
    inner = prepare(natural, regrouped_state(plan, state, q_units), compact)
    return dataclasses.replace(inner, plan=plan, state=state, q_units=q_units)


def worst_case_metadata_bytes(plan: PhysicalPlan, mask: LogicalMask) -> int:
    """Bytes of ``tile_slots`` + ``tile_member`` at the uncompacted capacity ``ceil(nUk / S)``."""
    bm, hm = mask.blocks.shape[:2]
    n_qt = math.ceil(mask.seq_len_q / plan.tile_q)
    cap = math.ceil(math.ceil(mask.seq_len_kv / plan.kv_unit) / plan.slots_per_tile)
    return bm * hm * n_qt * cap * (8 + 4 * plan.slots_per_tile)


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


