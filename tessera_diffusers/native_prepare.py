"""Launch preparation and mask statistics in the native library (``csrc/include/tessera/prepare.cuh``).

On a cold request (a new mask) the torch versions of ``prepare()`` and of the ``MaskState``
statistics dispatch about twenty and fifteen small ops, each a kernel launch costing ~45 us of host
time on a GPU. Here each step is one allocation and one ctypes call running a few kernels:

    prepare_native(compact=True)    2 allocations + 5 views, 2 ctypes calls (one host read inside)
    prepare_native(compact=False)   1 allocation + 5 views, 1 ctypes call, no sync
    launch_mask_counts(read=True)   1 allocation + 3 views, 1 ctypes call (one host read inside)

The results are bit for bit those of the torch code, which stays the CPU path and the oracle
(``tests/test_native_prepare_gpu.py``). ``prepare()`` and ``MaskState`` take this path when the mask
is on CUDA, the loaded library exports these functions (``native_library``) and the environment
variable ``TESSERA_NATIVE_PREPARE`` is not ``"0"``; a native failure raises ``NativeKernelError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from . import ops
from .errors import CatalogError, InvalidArgumentError
from .kernel_table import HOPPER_TILES, PORTABLE_TILES
from .mask import LogicalMask
from .plans import KvLayout, PhysicalPlan, Traversal
from .prepare import PreparedPlan, check_plan

NATIVE_PREPARE_ENV = "TESSERA_NATIVE_PREPARE"  # "0": always the torch code
MAX_UNION_GROUPS = 4  # TESSERA_MAX_UNION_GROUPS
NUM_MASK_COUNTS = 6  # the counts of mask_state.count_blocks, first in the counts buffer
MASK_COUNT_SLOTS = NUM_MASK_COUNTS + MAX_UNION_GROUPS  # TESSERA_MASK_COUNT_SLOTS


class TesseraBlockMask(ctypes.Structure):
    """Mirror of ``TesseraBlockMask`` in params.h."""

    _fields_ = [
        ("blocks", ctypes.c_void_p),
        ("stride", ctypes.c_int64 * 4),
        ("batch", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
    ]


class TesseraPrepareParams(ctypes.Structure):
    """Mirror of ``TesseraPrepareParams`` in params.h, field for field."""

    _fields_ = [
        ("mask", TesseraBlockMask),
        ("block_q", ctypes.c_int32),
        ("block_kv", ctypes.c_int32),
        ("seq_q", ctypes.c_int32),
        ("seq_kv", ctypes.c_int32),
        ("tile_q", ctypes.c_int32),
        ("tile_kv", ctypes.c_int32),
        ("q_unit", ctypes.c_int32),
        ("kv_unit", ctypes.c_int32),
        ("packed", ctypes.c_int32),
        ("longest_first", ctypes.c_int32),
        ("num_q_tiles", ctypes.c_int32),
        ("capacity", ctypes.c_int32),
        ("tile_counts", ctypes.c_void_p),
        ("tile_slots", ctypes.c_void_p),
        ("tile_member", ctypes.c_void_p),
        ("q_order", ctypes.c_void_p),
        ("max_count", ctypes.c_void_p),
    ]


class TesseraMaskCountsParams(ctypes.Structure):
    """Mirror of ``TesseraMaskCountsParams`` in params.h."""

    _fields_ = [
        ("mask", TesseraBlockMask),
        ("num_groups", ctypes.c_int32),
        ("group_rows", ctypes.c_int32 * MAX_UNION_GROUPS),
        ("counts", ctypes.c_void_p),
        ("row_counts", ctypes.c_void_p),
    ]


# TesseraStruct values of params.h: each mirror's size is checked against the library's.
STRUCT_IDS = {TesseraBlockMask: 2, TesseraPrepareParams: 3, TesseraMaskCountsParams: 4}


@cache
def native_library() -> ops.NativeLibrary | None:
    """The kernel library with the preparation functions typed, or None where there is none (no
    build, or one of another ABI). Raises ``CatalogError`` if a mirror's size differs from the
    library's (a stale build must not fill metadata through a wrong layout)."""
    try:
        lib = ops.load_library()
    except CatalogError:
        return None
    handle = lib.handle
    try:
        handle.tessera_struct_bytes.argtypes = [ctypes.c_int]
        handle.tessera_prepare_counts.argtypes = [
            ctypes.POINTER(TesseraPrepareParams), ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p]
        handle.tessera_prepare_fill.argtypes = [ctypes.POINTER(TesseraPrepareParams), ctypes.c_void_p]
        handle.tessera_mask_counts.argtypes = [
            ctypes.POINTER(TesseraMaskCountsParams), ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p]
    except AttributeError:
        return None
    for struct, which in STRUCT_IDS.items():
        native_bytes = handle.tessera_struct_bytes(which)
        if native_bytes != ctypes.sizeof(struct):
            raise CatalogError(f"{lib.path}: {struct.__name__} has {native_bytes} bytes, its mirror in "
                               f"native_prepare.py {ctypes.sizeof(struct)}; rebuild the library")
    return lib


def native_path_enabled(device: torch.device) -> bool:
    """Whether tensors on ``device`` are prepared natively: CUDA, a library with these functions,
    and ``TESSERA_NATIVE_PREPARE`` not ``"0"``."""
    return device.type == "cuda" and os.environ.get(NATIVE_PREPARE_ENV, "1") != "0" and native_library() is not None


def union_rows_to_prefetch(block_q: int) -> tuple[int, ...]:
    """Query-tile heights (in block rows, > 1) of the kernel table's tiles for ``block_q``: the
    group sizes the cost model asks ``MaskState.row_union_ratios`` for next, computed in the same
    launch as the statistics' counts so that a cold request reads the mask once."""
    heights = {tile.tile_q // block_q for tile in PORTABLE_TILES + HOPPER_TILES}
    return tuple(sorted(h for h in heights if h > 1))[:MAX_UNION_GROUPS]


def block_mask_struct(blocks: torch.Tensor) -> TesseraBlockMask:
    """The struct of a ``[Bm, Hm, nQ, nKV]`` bool block tensor."""
    return mask_struct(tuple(blocks.shape), blocks.stride(), blocks.data_ptr())


def mask_struct(shape: tuple[int, ...], strides: tuple[int, ...], pointer: int = 0) -> TesseraBlockMask:
    """The struct of a block tensor of ``shape`` ``[Bm, Hm, nQ, nKV]`` and element ``strides`` at
    ``pointer`` (0: filled in later, as ``params_template`` leaves it)."""
    m = TesseraBlockMask()
    m.blocks = pointer
    for d, stride in enumerate(strides):
        m.stride[d] = stride
    m.batch, m.heads, m.rows, m.cols = shape
    return m


def stream_handle(device: torch.device) -> int:
    """The current stream of ``device`` (0, the legacy stream, off CUDA: only an emulated library
    sees it)."""
    return ops.current_stream_handle(device) if device.type == "cuda" else 0


def on_device(device: torch.device):
    """Make ``device`` current for the launches (the library launches on the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def require_library(device: torch.device, library: ops.NativeLibrary | None) -> ops.NativeLibrary:
    """``library`` if given (an emulation in the CPU tests), else the native one for a CUDA ``device``."""
    if library is not None:
        return library
    if device.type != "cuda":
        raise InvalidArgumentError("mask.blocks", "a CUDA tensor for the native path", f"device {device}")
    lib = native_library()
    if lib is None:
        raise CatalogError("the native library with tessera_prepare_* is not loaded: build it with "
                           "`python csrc/build_native.py`, or set TESSERA_NATIVE_PREPARE=0")
    return lib


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def typed_view(buffer: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A contiguous ``shape`` view of ``buffer``'s storage from element ``offset`` (one view op)."""
    return buffer.as_strided(shape, contiguous_strides(shape), offset)


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
    plan: PhysicalPlan, state, compact: bool = True, library: ops.NativeLibrary | None = None
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
    blocks: torch.Tensor, groups: tuple[int, ...] = (), read: bool = True, library: ops.NativeLibrary | None = None
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
