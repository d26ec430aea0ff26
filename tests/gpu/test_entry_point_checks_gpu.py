"""The C entry points refuse, before any launch, parameters their kernels would read or write out of
bounds through: a launch that is valid but for one field returns cudaErrorInvalidValue and leaves
its poisoned outputs as they were. The valid launch itself is accepted (so each refusal is the
field's). Skipped without CUDA and the native library.

    python -m pytest -q -m gpu tests/gpu/test_entry_point_checks_gpu.py
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tessera_diffusers import KvLayout, PhysicalPlan, TaskOrganization, Traversal, build_mask_state, library, prepare
from tessera_diffusers.catalog import all_kernels
from tessera_diffusers.native_prepare import params_template
from tessera_diffusers.plans import KernelSpec
from tessera_diffusers.testing import random_mask, random_qkv

pytestmark = pytest.mark.gpu

CUDA_SUCCESS, CUDA_INVALID_VALUE = 0, 1
SENTINEL = 7.0  # what every output holds before a call; exact in bf16 and fp32
SCALE = 1 / math.sqrt(128)
BATCH, HEADS, SEQ_Q, SEQ_KV = 1, 2, 300, 260
TILES = {"portable": (128, 64), "hopper": (128, 128)}


def loaded_kernel(family: str) -> KernelSpec:
    """The loaded library's 2-stage bf16 D = 128 kernel of ``family``'s tile in ``TILES``."""
    tile_q, tile_kv = TILES[family]
    loaded = library.load_library().kernel_ids
    kernel = next((k for k in all_kernels() if k.family.value == family and (k.tile_q, k.tile_kv, k.head_dim, k.dtype,
                   k.stages) == (tile_q, tile_kv, 128, "bf16", 2) and k.name in loaded), None)
    if kernel is None:
        pytest.skip(f"no {family} {tile_q} x {tile_kv} kernel in this build of the library")
    return kernel


def poisoned(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(SENTINEL)


def untouched(buffers) -> bool:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return all(bool((t == SENTINEL).all()) for t in buffers)


@dataclass
class AttentionLaunch:
    """An attention launch (and its split-K merge) that is valid as built: the params and the
    tensors their pointers name, kept alive here, and the outputs, poisoned with ``SENTINEL``."""

    kernel: KernelSpec
    kernel_id: int
    params: library.TesseraAttnParams
    merge: library.TesseraMergeParams | None
    outputs: tuple[torch.Tensor, ...]  # out, lse and the split-K workspace
    tensors: tuple  # q, k, v and the prepared plan

    def forward(self, change: Callable | None = None, kernel_id: int | None = None) -> int:
        p = library.TesseraAttnParams.from_buffer_copy(self.params)
        if change is not None:
            change(p, self.kernel)
        handle = library.load_library().handle
        return handle.tessera_attention_forward(self.kernel_id if kernel_id is None else kernel_id,
                                                ctypes.byref(p), stream_of(self.outputs[0]))

    def split_merge(self, change: Callable | None = None) -> int:
        m = library.TesseraMergeParams.from_buffer_copy(self.merge)
        if change is not None:
            change(m)
        return library.load_library().handle.tessera_split_merge(ctypes.byref(m), stream_of(self.outputs[0]))


def stream_of(t: torch.Tensor) -> int:
    return library.stream_handle(t.device)


def attention_launch(family: str, splits: int, device: torch.device | str = "cuda") -> AttentionLaunch:
    """A packed Q32K16 plan of ``family``'s kernel with ``splits`` split-K parts over a mask with
    partial last blocks and empty rows."""
    from tessera_diffusers import ops

    kernel = loaded_kernel(family)
    mask = random_mask(BATCH, HEADS, SEQ_Q, SEQ_KV, 32, 16, density=0.4, seed=3, device=device)
    q, k, v = random_qkv(BATCH, SEQ_Q, SEQ_KV, HEADS, 128, torch.bfloat16, device, seed=3)
    plan = PhysicalPlan(32, 16, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, splits), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    out = poisoned(torch.empty_like(q))
    lse = poisoned(torch.empty(BATCH, HEADS, SEQ_Q, device=device))
    workspace = None
    if splits > 1:
        workspace = tuple(poisoned(t) for t in prepared.workspace(BATCH, HEADS, 128).allocate(torch.device(device)))
    template = ops.launch_template(q, k, prepared.metadata, kernel.name, prepared.launch_config(), SCALE,
                                   (q.stride(), k.stride(), v.stride(), out.stride()))
    params, merge = template.fill(q, k, v, out, lse, workspace)
    outputs = (out, lse) + (workspace or ())
    return AttentionLaunch(kernel, template.kernel_id, params, merge, outputs, (q, k, v, prepared))


def setter(**fields) -> Callable:
    def change(p, *_):
        for name, value in fields.items():
            setattr(p, name, value)
    return change


def shifted(name: str, delta: int) -> Callable:
    def change(p, *_):
        setattr(p, name, getattr(p, name) + delta)
    return change


def stride_plus_one(name: str, dim: int) -> Callable:
    def change(p, *_):
        getattr(p, name)[dim] += 1
    return change


def log2(n: int) -> int:
    return n.bit_length() - 1


# Each changes one field of a valid attention launch (p, kernel) so that the kernel would misread.
ATTENTION_CASES: dict[str, Callable] = {
    **{f"{name} NULL": setter(**{name: None})
       for name in ("q", "k", "v", "o", "tile_counts", "tile_slots", "tile_member", "q_order")},
    "batch 0": setter(batch=0),
    "heads 0": setter(heads=0),
    "seq_q 0": setter(seq_q=0),
    "seq_kv 0": setter(seq_kv=0),
    "mask_batch neither 1 nor batch": setter(mask_batch=BATCH + 1),
    "mask_heads neither 1 nor heads": setter(mask_heads=HEADS + 1),
    "num_q_tiles not ceil(Sq / tile_q)": shifted("num_q_tiles", 1),
    "capacity < 0": setter(capacity=-1),
    "slots x kv_unit != tile_kv": shifted("slots", 1),
    "slots past the kernel's slot arrays": lambda p, kernel: setattr(p, "slots", 2 * kernel.tile_kv // 16),
    "kv_unit below 16 tokens": lambda p, kernel: (setattr(p, "kv_unit_log2", 3), setattr(p, "slots", kernel.tile_kv // 8)),
    "kv_unit_log2 past 15": setter(kv_unit_log2=16),
    "q_unit below 16 rows": setter(q_unit_log2=3),
    "q_unit past the query tile": lambda p, kernel: setattr(p, "q_unit_log2", log2(kernel.tile_q) + 1),
    "q_unit_log2 31": setter(q_unit_log2=31),
    "num_splits 0": setter(num_splits=0),
    "grid_size < 0": setter(grid_size=-1),
    "tasks past 2^31 - 1": setter(heads=2**30, mask_heads=1),
    "q not 16-byte aligned": shifted("q", 2),
    "k not 16-byte aligned": shifted("k", 8),
    "v not 16-byte aligned": shifted("v", 2),
    "q sequence stride not 16 bytes": stride_plus_one("q_stride", 1),
    "k head stride not 16 bytes": stride_plus_one("k_stride", 2),
    "v batch stride not 16 bytes": stride_plus_one("v_stride", 0),
    "lse not 4-byte aligned": shifted("lse", 2),
    "tile_member not 8-byte aligned": shifted("tile_member", 4),
    "tile_slots not 4-byte aligned": shifted("tile_slots", 2),
}
SPLIT_CASES: dict[str, Callable] = {
    "o_partial NULL": setter(o_partial=None),
    "lse_partial NULL": setter(lse_partial=None),
    "o_partial not 8-byte aligned": shifted("o_partial", 4),
}
# The portable epilogue stores O two elements at a time; the Hopper one adapts to the output.
PORTABLE_CASES: dict[str, Callable] = {
    "o not 4-byte aligned": shifted("o", 2),
    "o head stride odd": stride_plus_one("o_stride", 2),
}
MERGE_CASES: dict[str, Callable] = {
    **{f"{name} NULL": setter(**{name: None}) for name in ("o_partial", "lse_partial", "o")},
    "batch 0": setter(batch=0),
    "heads 0": setter(heads=0),
    "seq_q 0": setter(seq_q=0),
    "head_dim 0": setter(head_dim=0),
    "head_dim 257": setter(head_dim=257),
    "num_splits 0": setter(num_splits=0),
    "dtype neither bf16 nor fp16": setter(dtype=2),
    "rows past the grid": setter(batch=2**20, heads=2**20),
    "o_partial not 4-byte aligned": shifted("o_partial", 2),
}


@pytest.mark.parametrize("family", TILES)
@pytest.mark.parametrize("splits", [1, 2])
def test_a_valid_launch_is_accepted(family, splits):
    if family == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper family needs sm90")
    launch = attention_launch(family, splits)
    assert launch.forward() == CUDA_SUCCESS
    if splits > 1:
        assert launch.split_merge() == CUDA_SUCCESS
    assert not untouched(launch.outputs[:2])


@pytest.mark.parametrize("family", TILES)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_an_invalid_attention_field_is_refused(family, case):
    launch = attention_launch(family, 1)
    assert launch.forward(ATTENTION_CASES[case]) == CUDA_INVALID_VALUE
    assert untouched(launch.outputs)


@pytest.mark.parametrize("family", TILES)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_an_invalid_split_k_workspace_is_refused(family, case):
    launch = attention_launch(family, 2)
    assert launch.forward(SPLIT_CASES[case]) == CUDA_INVALID_VALUE
    assert untouched(launch.outputs)


@pytest.mark.parametrize("case", PORTABLE_CASES, ids=str)
def test_an_output_the_portable_epilogue_cannot_pair_is_refused(case):
    launch = attention_launch("portable", 1)
    assert launch.forward(PORTABLE_CASES[case]) == CUDA_INVALID_VALUE
    assert untouched(launch.outputs)


@pytest.mark.parametrize("kernel_id", ["-1", "past the last"])
def test_an_unknown_kernel_or_no_params_is_refused(kernel_id):
    launch = attention_launch("portable", 1)
    handle = library.load_library().handle
    kid = -1 if kernel_id == "-1" else handle.tessera_num_kernels()
    assert launch.forward(kernel_id=kid) == CUDA_INVALID_VALUE
    assert handle.tessera_attention_forward(launch.kernel_id, None, stream_of(launch.outputs[0])) == CUDA_INVALID_VALUE
    assert handle.tessera_split_merge(None, stream_of(launch.outputs[0])) == CUDA_INVALID_VALUE
    assert untouched(launch.outputs)


@pytest.mark.parametrize("case", MERGE_CASES, ids=str)
def test_an_invalid_merge_field_is_refused(case):
    launch = attention_launch("portable", 2)
    assert launch.split_merge(MERGE_CASES[case]) == CUDA_INVALID_VALUE
    assert untouched(launch.outputs)


# ------------------------------------------------------------------ preparation and statistics

@dataclass
class PrepareLaunch:
    """``tessera_prepare_counts`` / ``_fill`` params of a valid plan over a mask, the outputs
    poisoned with ``SENTINEL``."""

    params: library.TesseraPrepareParams
    outputs: tuple[torch.Tensor, ...]  # tile_counts, tile_slots, tile_member, q_order, max_count
    blocks: torch.Tensor

    def call(self, which: str, change: Callable | None = None) -> int:
        p = library.TesseraPrepareParams.from_buffer_copy(self.params)
        if change is not None:
            change(p)
        handle = library.native_library().handle
        stream = stream_of(self.blocks)
        if which == "counts":
            return handle.tessera_prepare_counts(ctypes.byref(p), None, stream)
        return handle.tessera_prepare_fill(ctypes.byref(p), stream)


def prepare_launch(device: torch.device | str = "cuda") -> PrepareLaunch:
    kernel = next(k for k in all_kernels() if (k.family.value, k.tile_q, k.tile_kv) == ("portable", 128, 64))
    mask = random_mask(1, 2, SEQ_Q, SEQ_KV, 32, 16, density=0.4, seed=4, device=device)
    plan = PhysicalPlan(32, 16, KvLayout.PACKED, TaskOrganization(), kernel)
    p = library.TesseraPrepareParams.from_buffer_copy(params_template(plan, (
        32, 16, SEQ_Q, SEQ_KV, tuple(mask.blocks.shape), mask.blocks.stride())))
    p.mask.blocks = mask.blocks.data_ptr()
    rows = (1, 2, p.num_q_tiles)
    cap = math.ceil(math.ceil(SEQ_KV / plan.kv_unit) / plan.slots_per_tile)
    counts, order, longest = (poisoned(torch.empty(rows, dtype=torch.int32, device=device)) for _ in range(3))
    slots = poisoned(torch.empty(*rows, cap, plan.slots_per_tile, dtype=torch.int32, device=device))
    member = poisoned(torch.empty(*rows, cap, dtype=torch.int64, device=device))
    p.capacity = cap
    p.tile_counts, p.tile_slots, p.tile_member = counts.data_ptr(), slots.data_ptr(), member.data_ptr()
    p.q_order, p.max_count = order.data_ptr(), longest.data_ptr()
    return PrepareLaunch(p, (counts, slots, member, order, longest), mask.blocks)


def mask_field(name: str, value) -> Callable:
    def change(p):
        setattr(p.mask, name, value)
    return change


PREPARE_CASES: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "blocks NULL": (mask_field("blocks", None), ("counts", "fill")),
    "mask batch 0": (mask_field("batch", 0), ("counts", "fill")),
    "mask rows not ceil(Sq / block_q)": (mask_field("rows", 3), ("counts", "fill")),
    "negative mask stride": (lambda p: p.mask.stride.__setitem__(3, -1), ("counts", "fill")),
    "block_q 0": (setter(block_q=0), ("counts", "fill")),
    "seq_kv 0": (setter(seq_kv=0), ("counts", "fill")),
    "q_unit not dividing the block": (setter(q_unit=64), ("counts", "fill")),
    "kq x S past 64 bits": (setter(tile_q=32 * 32, num_q_tiles=1), ("counts", "fill")),
    "num_q_tiles not ceil(Sq / tile_q)": (shifted("num_q_tiles", 1), ("counts", "fill")),
    "tile_counts NULL": (setter(tile_counts=None), ("counts", "fill")),
    "max_count NULL": (setter(max_count=None), ("counts",)),
    "capacity 0": (setter(capacity=0), ("fill",)),
    "tile_slots NULL": (setter(tile_slots=None), ("fill",)),
    "tile_member NULL": (setter(tile_member=None), ("fill",)),
    "q_order NULL": (setter(q_order=None), ("fill",)),
}


def test_valid_preparation_is_accepted():
    if library.native_library() is None:
        pytest.skip("the loaded library has no tessera_prepare_* functions")
    launch = prepare_launch()
    assert launch.call("counts") == CUDA_SUCCESS
    assert launch.call("fill") == CUDA_SUCCESS
    assert not untouched(launch.outputs[:1])


@pytest.mark.parametrize("case", PREPARE_CASES, ids=str)
def test_an_invalid_preparation_field_is_refused(case):
    if library.native_library() is None:
        pytest.skip("the loaded library has no tessera_prepare_* functions")
    change, calls = PREPARE_CASES[case]
    launch = prepare_launch()
    for which in calls:
        assert launch.call(which, change) == CUDA_INVALID_VALUE, which
    assert untouched(launch.outputs)


MASK_COUNT_CASES: dict[str, Callable] = {
    "blocks NULL": mask_field("blocks", None),
    "mask cols 0": mask_field("cols", 0),
    "counts NULL": setter(counts=None),
    "num_groups past TESSERA_MAX_UNION_GROUPS": setter(num_groups=library.MAX_UNION_GROUPS + 1),
    "num_groups < 0": setter(num_groups=-1),
    "group_rows 0": lambda p: p.group_rows.__setitem__(0, 0),
}


def mask_counts_params(device: torch.device | str = "cuda"):
    """``tessera_mask_counts`` params of a valid call with two group sizes, and its poisoned outputs."""
    mask = random_mask(1, 2, SEQ_Q, SEQ_KV, 32, 16, density=0.4, seed=5, device=device)
    counts = poisoned(torch.empty(library.MAX_UNION_GROUPS + 6, dtype=torch.int64, device=device))
    row_counts = poisoned(torch.empty(mask.blocks.shape[:3], dtype=torch.int32, device=device))
    p = library.TesseraMaskCountsParams()
    p.mask = library.block_mask_struct(mask.blocks)
    p.num_groups = 2
    p.group_rows[0], p.group_rows[1] = 2, 4
    p.counts, p.row_counts = counts.data_ptr(), row_counts.data_ptr()
    return p, (counts, row_counts), mask.blocks


@pytest.mark.parametrize("case", MASK_COUNT_CASES, ids=str)
def test_an_invalid_mask_counts_field_is_refused(case):
    lib = library.native_library()
    if lib is None:
        pytest.skip("the loaded library has no tessera_mask_counts")
    p, outputs, blocks = mask_counts_params()
    assert lib.handle.tessera_mask_counts(ctypes.byref(p), None, stream_of(blocks)) == CUDA_SUCCESS
    torch.cuda.synchronize()
    p, outputs, blocks = mask_counts_params()
    MASK_COUNT_CASES[case](p)
    assert lib.handle.tessera_mask_counts(ctypes.byref(p), None, stream_of(blocks)) == CUDA_INVALID_VALUE
    assert untouched(outputs)
