"""Launch preparation in the native library (``csrc/include/tessera/prepare.cuh``).

On a cold request (a new mask) the torch version of ``prepare()`` dispatches about twenty small
ops, each a kernel launch costing ~45 us of host time on a GPU. Here it is one or two allocations
and ctypes calls running a few kernels:

    prepare_native(compact=True)    2 allocations + 5 views, 2 ctypes calls (one host read inside)
    prepare_native(compact=False)   1 allocation + 5 views, 1 ctypes call, no sync

The results are bit for bit those of the torch code, which stays the CPU path and the oracle
(``tests/gpu/test_native_prepare_gpu.py``). ``prepare()`` takes this path when the mask is on CUDA, the
loaded library exports these functions (``library.native_library``) and the environment variable
``TESSERA_NATIVE_PREPARE`` is not ``"0"``; a native failure raises ``NativeKernelError``. The mask
statistics' native launch is ``mask_counts.py``.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

# native_library, launch_mask_counts and union_rows_to_prefetch are importable from here too.
from .library import (  # noqa: F401
    NativeLibrary,
    TesseraPrepareParams,
    mask_struct,
    native_library,
    on_device,
    require_library,
    stream_handle,
)
from .mask import LogicalMask
from .mask_counts import contiguous_strides, launch_mask_counts, union_rows_to_prefetch  # noqa: F401
from .plans import KvLayout, PhysicalPlan, Traversal
from .prepared import PreparedPlan, check_plan


@dataclass(frozen=True)
class MetadataLayout:
    """Where the four metadata tensors lie in one preparation's allocations: each as
    ``(shape, strides, offset)`` of a contiguous view, in elements of the buffer it views."""

    body_words: int  # int64 words of the body allocation
    tile_member: tuple  # of the int64 body
    tile_slots: tuple  # of the body as int32
    tile_counts: tuple  # of the body as int32, or of the int32 head (compact)
    q_order: tuple

    @staticmethod
    @lru_cache(maxsize=256)
    def of(row_shape: tuple[int, int, int], capacity: int, slots: int, compact: bool) -> MetadataLayout:
        """One int64 body: tile_member ``[rows * cap]``, then as int32 tile_slots ``[rows * cap * S]``,
        then (not compact) tile_counts and q_order; compact keeps those two in the head allocation
        of the count launch (counts, then q_order, then the longest count's scratch word)."""
        rows = math.prod(row_shape)

        def view(shape: tuple[int, ...], offset: int) -> tuple:
            return shape, contiguous_strides(shape), offset

        slot_end = 2 * rows * capacity + rows * capacity * slots  # int32 words
        ints_after_slots = 0 if compact else 2 * rows
        counts_at, order_at = (0, rows) if compact else (slot_end, slot_end + rows)
        return MetadataLayout(
            body_words=rows * capacity + (rows * capacity * slots + ints_after_slots + 1) // 2,
            tile_member=view((*row_shape, capacity), 0),
            tile_slots=view((*row_shape, capacity, slots), 2 * rows * capacity),
            tile_counts=view(row_shape, counts_at),
            q_order=view(row_shape, order_at),
        )


@lru_cache(maxsize=256)
def params_template(plan: PhysicalPlan, geometry: tuple) -> TesseraPrepareParams:
    """The launch parameters of ``plan`` over masks of ``geometry`` = (block_q, block_kv, Sq, Skv,
    block-tensor shape, block-tensor strides), every pointer and ``capacity`` left 0: built once
    and copied per preparation."""
    block_q, block_kv, seq_q, seq_kv, shape, strides = geometry
    p = TesseraPrepareParams()
    p.mask = mask_struct(shape, strides)
    p.block_q, p.block_kv, p.seq_q, p.seq_kv = block_q, block_kv, seq_q, seq_kv
    p.tile_q, p.tile_kv, p.q_unit, p.kv_unit = plan.tile_q, plan.tile_kv, plan.q_unit, plan.kv_unit
    p.packed = int(plan.kv_layout is KvLayout.PACKED)
    p.longest_first = int(plan.tasks.traversal is Traversal.LONGEST_FIRST)
    p.num_q_tiles = math.ceil(seq_q / plan.tile_q)
    return p


def prepare_native(
    plan: PhysicalPlan, state, compact: bool = True, library: NativeLibrary | None = None
) -> PreparedPlan:
    """``prepare.prepare`` in the native library: the same metadata bit for bit (see prepare.py).

    ``compact`` reads the longest tile count back (one sync, inside the first ctypes call) and
    sizes the slot and membership tensors by it; ``compact=False`` never syncs. The four tensors
    are views of one or two allocations. What depends only on the plan and the mask's shape (the
    parameter block, the views' layout) is built once per such pair: a new mask of a known
    request costs one allocation, four views and one or two ctypes calls."""
    mask: LogicalMask = state.mask
    check_plan(plan, mask)
    blocks = mask.blocks  # [Bm, Hm, nQ, nKV] bool, any strides
    device = blocks.device
    lib = require_library(device, library)
    template = params_template(plan, (mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv,
                                      tuple(blocks.shape), blocks.stride()))
    p = TesseraPrepareParams.from_buffer_copy(template)
    p.mask.blocks = blocks.data_ptr()
    n_qt = p.num_q_tiles
    row_shape = (p.mask.batch, p.mask.heads, n_qt)
    slots = plan.slots_per_tile
    with on_device(device):
        stream = stream_handle(device)
        head = None
        if compact:
            # Counts, q_order and the longest count's scratch first; the rest once cap is known.
            rows = math.prod(row_shape)
            head = torch.empty(2 * rows + 1, dtype=torch.int32, device=device)
            p.tile_counts, p.q_order = head.data_ptr(), head.data_ptr() + 4 * rows
            p.max_count = head.data_ptr() + 8 * rows
            longest = ctypes.c_int32(-1)
            lib.check(lib.handle.tessera_prepare_counts(ctypes.byref(p), ctypes.byref(longest), stream),
                      "native prepare (tile counts)")
            cap = max(1, longest.value)
        else:
            cap = math.ceil(math.ceil(mask.seq_len_kv / p.kv_unit) / slots)
        layout = MetadataLayout.of(row_shape, cap, slots, compact)
        body = torch.empty(layout.body_words, dtype=torch.int64, device=device)
        ints = body.view(torch.int32)
        tile_member = body.as_strided(*layout.tile_member)
        tile_slots = ints.as_strided(*layout.tile_slots)
        small = head if compact else ints
        tile_counts = small.as_strided(*layout.tile_counts)
        q_order = small.as_strided(*layout.q_order)
        p.capacity = cap
        p.tile_counts, p.q_order = tile_counts.data_ptr(), q_order.data_ptr()
        p.tile_slots, p.tile_member = tile_slots.data_ptr(), tile_member.data_ptr()
        lib.check(lib.handle.tessera_prepare_fill(ctypes.byref(p), stream), "native prepare (metadata)")
    return PreparedPlan(
        plan=plan,
        state=state,
        num_q_tiles=n_qt,
        capacity=cap,
        tile_counts=tile_counts,
        tile_slots=tile_slots,
        tile_member=tile_member,
        q_order=q_order,
    )
