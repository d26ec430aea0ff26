"""Native launch preparation and mask statistics on a GPU against the torch code, their oracle:
bit-identical metadata for every catalog plan shape of each geometry (random masks with partial
last blocks, empty rows, broadcast mask dims, Sq != Skv, strided block tensors, both ``compact``
values), long rows and many query tiles (several scan and rank chunks), and the statistics' counts,
union sums and ``MaskState`` values. Skipped without CUDA and the native library.

    python -m pytest -q -m gpu tests/gpu/test_native_prepare_gpu.py
"""

from __future__ import annotations

import ctypes
import itertools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera_diffusers import (
    InvalidArgumentError,
    KvLayout,
    LogicalMask,
    PhysicalPlan,
    TaskOrganization,
    Traversal,
    build_mask_state,
    config,
    library,
    mask_counts,
    native_prepare,
    prepare,
)
from tessera_diffusers.catalog import reference_kernel
from tessera_diffusers.mask_state import count_blocks, group_activity
from tessera_diffusers.prepare import prepare_torch
from tessera_diffusers.testing import metadata_difference, metadata_plans, random_mask

pytestmark = pytest.mark.gpu

GEOMETRIES = ((16, 16), (32, 16), (32, 32), (64, 32), (64, 64), (128, 64), (128, 128), (384, 384), (256, 256))
CUDA_INVALID_VALUE = 1


@pytest.fixture(autouse=True)
def native_library_present():
    if library.native_library() is None:
        pytest.skip("the loaded library has no tessera_prepare_* functions (rebuild it)")
    if not config.get("native_prepare"):
        pytest.skip(f"{library.NATIVE_PREPARE_ENV}=0 turns the native path off")


def masks_for(block_q: int, block_kv: int, device: torch.device) -> list[tuple[str, LogicalMask]]:
    """Masks of one geometry with the awkward cases: partial last blocks and Sq != Skv throughout."""
    seq_q, seq_kv = 9 * block_q + block_q // 2 + 3, 11 * block_kv - 5
    per_head = random_mask(2, 3, seq_q, seq_kv, block_q, block_kv, density=0.3, seed=block_q + block_kv, device=device)
    blocks = per_head.blocks
    wide = torch.zeros(*blocks.shape[:3], blocks.shape[3] + 5, dtype=torch.bool, device=device)
    wide[..., 2:2 + blocks.shape[3]] = blocks
    n_q, n_kv = blocks.shape[2:]
    # Rows of a multiple of 4 bytes, the columns a prefix: the statistics read whole words, then a tail.
    padded = torch.zeros(*blocks.shape[:3], n_kv + 4 - n_kv % 4 + 4, dtype=torch.bool, device=device)
    padded[..., :n_kv] = blocks
    return [
        ("per (b, h)", per_head),
        ("broadcast B and H", random_mask(1, 1, seq_kv, seq_q, block_q, block_kv, density=0.2, seed=3, device=device)),
        ("Hm = 1", random_mask(2, 1, seq_q, seq_kv, block_q, block_kv, density=0.5, seed=4, device=device)),
        ("Bm = 1", random_mask(1, 3, seq_q, seq_kv, block_q, block_kv, density=0.1, seed=5, device=device)),
        ("empty", LogicalMask(torch.zeros(1, 2, n_q, n_kv, dtype=torch.bool, device=device), block_q, block_kv,
                              seq_q, seq_kv)),
        ("dense", LogicalMask.dense(seq_q, seq_kv, block_q, block_kv, device=device)),
        ("expanded (stride 0)", LogicalMask(blocks[:1].expand(2, 3, n_q, n_kv), block_q, block_kv, seq_q, seq_kv)),
        ("column slice", LogicalMask(wide[..., 2:2 + n_kv], block_q, block_kv, seq_q, seq_kv)),
        ("word-aligned rows", LogicalMask(padded[..., :n_kv], block_q, block_kv, seq_q, seq_kv)),
    ]


def check_order_is_a_permutation(prepared) -> None:
    order = prepared.q_order.reshape(-1, prepared.num_q_tiles).long()
    expected = torch.arange(prepared.num_q_tiles, device=order.device).expand_as(order)
    assert torch.equal(order.sort(-1).values, expected)


@pytest.mark.parametrize("bq,bkv", GEOMETRIES, ids=str)
def test_native_metadata_equals_torch(bq, bkv):
    device = torch.device("cuda")
    failures = []
    for (label, mask), plan in itertools.product(masks_for(bq, bkv, device), metadata_plans(bq, bkv)):
        state = build_mask_state(mask)
        for compact in (True, False):
            native = native_prepare.prepare_native(plan, state, compact)
            difference = metadata_difference(native, prepare_torch(plan, state, compact))
            if difference is not None:
                failures.append(f"{plan.name} [{label}] compact={compact}: {difference}")
            check_order_is_a_permutation(native)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("bq,bkv,seq_q,seq_kv,tiles", [
    (16, 16, 20000, 9001, ((64, 64), (128, 128))),  # nQT > 256 (rank chunks), nUk > 256 (scan chunks), 64 bits
    (16, 16, 250, 16384 * 16 + 7, ((64, 64),)),  # nUk = 16385
    (64, 64, 16384 * 64 - 9, 200, ((64, 64), (64, 128))),  # nQT = 16384
    (128, 128, 5000, 70000, ((64, 64), (128, 64))),  # refined: many units per block
], ids=["long-both", "long-kv", "many-q-tiles", "refined"])
def test_native_metadata_on_long_rows_and_many_query_tiles(bq, bkv, seq_q, seq_kv, tiles):
    device = torch.device("cuda")
    mask = random_mask(1, 2, seq_q, seq_kv, bq, bkv, density=0.2, seed=seq_q % 97, device=device)
    state = build_mask_state(mask)
    for (tq, tk), layout, traversal in itertools.product(tiles, KvLayout, Traversal):
        plan = PhysicalPlan(bq, bkv, layout, TaskOrganization(traversal), reference_kernel(128, "bf16", tq, tk))
        if layout is KvLayout.PACKED and plan.slots_per_tile < 2:
            continue
        for compact in (True, False):
            native = native_prepare.prepare_native(plan, state, compact)
            difference = metadata_difference(native, prepare_torch(plan, state, compact))
            assert difference is None, f"{plan.name} compact={compact}: {difference}"
            check_order_is_a_permutation(native)


def test_prepare_takes_the_native_path_on_cuda(monkeypatch):
    device = torch.device("cuda")
    mask = random_mask(2, 3, 3000, 2500, 32, 16, density=0.3, seed=1, device=device)
    state = build_mask_state(mask)
    plan = PhysicalPlan(32, 16, KvLayout.PACKED, TaskOrganization(), reference_kernel(128, "bf16", 128, 64))

    def one_storage(prepared) -> bool:  # the native path's tensors are views of one allocation
        return prepared.tile_slots.untyped_storage().data_ptr() == prepared.tile_member.untyped_storage().data_ptr()

    native = prepare(plan, state, compact=True)
    assert one_storage(native)
    monkeypatch.setenv(library.NATIVE_PREPARE_ENV, "0")
    oracle = prepare(plan, state, compact=True)
    assert not one_storage(oracle)
    assert metadata_difference(native, oracle) is None


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.others: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.others.append(str(func))
        return func(*args, **(kwargs or {}))


def test_native_paths_launch_no_torch_kernels():
    """Only allocations go through torch; the one host read of compact is inside the ctypes call."""
    device = torch.device("cuda")
    mask = random_mask(1, 24, 8192, 8192, 64, 64, density=0.1, seed=2, device=device)
    state = build_mask_state(mask)
    plan = PhysicalPlan(64, 64, KvLayout.PACKED, TaskOrganization(), reference_kernel(128, "bf16", 128, 128))
    with OpCounter() as compact:
        prepare(plan, state, compact=True)
    assert compact.others == ["aten.empty.memory_format"] * 2, compact.others
    with OpCounter() as auto:  # 1.6 MB of worst case: sync-free, nothing deferred
        prepare(plan, state)
    assert auto.others == ["aten.empty.memory_format"], auto.others
    with OpCounter() as capturable:
        prepare(plan, state, compact=False)
    assert capturable.others == ["aten.empty.memory_format"], capturable.others
    with OpCounter() as stats:
        state.host_stat_values  # noqa: B018
        state.row_union_ratios((2,))  # prefetched with the counts for Q64: no second launch or read
    assert stats.others == ["aten.empty.memory_format"], stats.others


def test_capturable_prepare_in_a_cuda_graph():
    device = torch.device("cuda")
    mask = random_mask(2, 2, 2000, 2100, 32, 32, density=0.3, seed=6, device=device)
    state = build_mask_state(mask)
    plan = PhysicalPlan(32, 32, KvLayout.PACKED, TaskOrganization(), reference_kernel(128, "bf16", 64, 128))
    native_prepare.prepare_native(plan, state, compact=False)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = native_prepare.prepare_native(plan, state, compact=False)
    graph.replay()
    torch.cuda.synchronize()
    assert metadata_difference(captured, prepare_torch(plan, state, compact=False)) is None


@pytest.mark.parametrize("bq,bkv", [(16, 16), (32, 16), (64, 64), (128, 128), (384, 384)], ids=str)
def test_native_mask_counts_equal_torch(bq, bkv):
    device = torch.device("cuda")
    for label, mask in masks_for(bq, bkv, device):
        blocks = mask.blocks
        n_q = blocks.shape[2]
        rows = (2, 3, 4, 8, 1, n_q + 3)
        counts, unions = mask_counts.mask_counts_native(blocks, rows)
        row_counts = blocks.sum(-1, dtype=torch.int32)
        assert counts == tuple(count_blocks(blocks, row_counts).tolist()), label
        assert unions == {r: int(group_activity(blocks, r, dim=-2).sum()) for r in rows}, label
        launched = mask_counts.launch_mask_counts(blocks, (2,), read=False)
        assert torch.equal(launched.row_counts, row_counts), label
        assert launched.host_counts()[:6] == counts, label


def test_native_mask_counts_on_a_large_mask():
    """49k rows of 2k columns (Q16K16 at 32k tokens, 24 heads): more rows than the grid's warps."""
    device = torch.device("cuda")
    mask = random_mask(1, 24, 32768, 32768, 16, 16, density=0.05, seed=9, device=device)
    blocks = mask.blocks
    counts, unions = mask_counts.mask_counts_native(blocks, (4, 8))
    assert counts == tuple(count_blocks(blocks, blocks.sum(-1, dtype=torch.int32)).tolist())
    assert unions == {r: int(group_activity(blocks, r, dim=-2).sum()) for r in (4, 8)}


@pytest.mark.parametrize("cols", (4, 7, 64, 1182))
def test_native_mask_counts_on_word_rows(cols):
    """Contiguous rows of a multiple of 4 bytes (the word path) with runs across word edges and a tail
    of columns past the last whole word; dense, empty and alternating rows among random ones."""
    device = torch.device("cuda")
    rows = 37
    gen = torch.Generator(device=device).manual_seed(cols)
    blocks = torch.rand(2, 3, rows, cols + (-cols % 4), generator=gen, device=device) < 0.4
    blocks[:, :, 0] = True
    blocks[:, :, 1] = False
    blocks[:, :, 2, ::2] = True
    blocks[:, :, 2, 1::2] = False
    blocks = blocks[..., :cols]
    for view in (blocks, blocks.contiguous()):  # word rows when cols % 4 == 0, else the byte path
        counts, unions = mask_counts.mask_counts_native(view, (2, 3, 8, rows + 1))
        row_counts = view.sum(-1, dtype=torch.int32)
        assert counts == tuple(count_blocks(view, row_counts).tolist()), view.stride()
        assert unions == {r: int(group_activity(view, r, dim=-2).sum()) for r in (2, 3, 8, rows + 1)}


def test_mask_state_native_statistics_equal_torch(monkeypatch):
    device = torch.device("cuda")
    sizes = (2, 3, 4, 8, 16, 5)
    for bq, bkv in ((16, 16), (64, 32), (384, 384)):
        for label, mask in masks_for(bq, bkv, device):
            native = build_mask_state(mask)
            values, ratios = native.host_stat_values, native.row_union_ratios(sizes)
            assert native.native_counts() is not None
            with monkeypatch.context() as torch_only:
                torch_only.setenv(library.NATIVE_PREPARE_ENV, "0")
                oracle = build_mask_state(mask)
                assert oracle.native_counts() is None
                assert values == oracle.host_stat_values, label
                assert ratios == oracle.row_union_ratios(sizes), label
                assert torch.equal(native.stat_counts, oracle.stat_counts), label
                assert torch.equal(native.kv_num_blocks, oracle.kv_num_blocks), label
                assert torch.equal(native.stats, oracle.stats), label
                assert torch.equal(native.row_offsets, oracle.row_offsets), label


def test_invalid_parameters_are_refused():
    handle = library.native_library().handle
    stream = torch.cuda.current_stream().cuda_stream
    p = library.TesseraPrepareParams()  # all zero: no mask
    assert handle.tessera_prepare_fill(ctypes.byref(p), stream) == CUDA_INVALID_VALUE
    assert handle.tessera_prepare_counts(ctypes.byref(p), None, stream) == CUDA_INVALID_VALUE
    m = library.TesseraMaskCountsParams()
    assert handle.tessera_mask_counts(ctypes.byref(m), None, stream) == CUDA_INVALID_VALUE
    blocks = torch.ones(1, 1, 4, 4, dtype=torch.bool, device="cuda")
    with pytest.raises(InvalidArgumentError, match="group sizes"):
        mask_counts.launch_mask_counts(blocks, (1, 2, 3, 4, 5))
    # Units that do not divide the blocks: the library checks the geometry itself too.
    mask = random_mask(1, 1, 300, 300, 32, 32, seed=0, device="cuda")
    q = library.TesseraPrepareParams()
    q.mask = library.block_mask_struct(mask.blocks)
    q.block_q = q.block_kv = 32
    q.seq_q = q.seq_kv = 300
    q.tile_q = q.tile_kv = q.q_unit = q.kv_unit = 64  # a unit that does not divide the block
    q.num_q_tiles = math.ceil(300 / 64)
    scratch = torch.zeros(16, dtype=torch.int32, device="cuda")
    q.tile_counts = q.max_count = scratch.data_ptr()
    assert handle.tessera_prepare_counts(ctypes.byref(q), None, stream) == CUDA_INVALID_VALUE
    q.q_unit = q.kv_unit = 32  # now valid
    assert handle.tessera_prepare_counts(ctypes.byref(q), None, stream) == 0


def native_plan_like(plan: PhysicalPlan) -> PhysicalPlan:
    """``plan`` with the loaded library's 2-stage bf16 kernel of its tile (skips without one)."""
    from tessera_diffusers.catalog import all_kernels

    loaded = library.load_library().kernel_ids
    tile = (plan.kernel.tile_q, plan.kernel.tile_kv, plan.kernel.head_dim, plan.kernel.dtype)
    kernel = next((k for k in all_kernels() if (k.tile_q, k.tile_kv, k.head_dim, k.dtype) == tile and k.stages == 2
                   and k.name in loaded), None)
    if kernel is None:
        pytest.skip(f"no native {tile} kernel in this build of the library")
    return PhysicalPlan(plan.block_q, plan.block_kv, plan.kv_layout, plan.tasks, kernel)


def test_auto_prepare_defers_compaction_and_compacts_on_reuse(monkeypatch):
    """Between DEFERRED_COMPACTION_BYTES and SYNC_FREE_METADATA_BYTES of worst case, ``prepare``
    writes the worst case without a sync; at a reuse once the count is on the host the Runtime
    keeps the compact copy (bit for bit ``compact=True``) instead, and the output does not change."""
    from tessera_diffusers import Runtime
    from tessera_diffusers.selector import GROUP_QUERIES_ENV

    # The mask comes back in the same plan (the shipped table's /reused key would re-prepare a
    # Q64K64 mask in its own choice: tests/unit/test_reused_table.py covers that).
    monkeypatch.setenv(GROUP_QUERIES_ENV, "0")
    from tessera_diffusers.prepare import DEFERRED_COMPACTION_BYTES, SYNC_FREE_METADATA_BYTES, worst_case_metadata_bytes

    device = torch.device("cuda")
    mask = random_mask(1, 24, 16384, 16384, 64, 64, density=0.1, seed=7, device=device)
    state = build_mask_state(mask)
    plan = PhysicalPlan(64, 64, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(128, "bf16", 64, 64))
    assert DEFERRED_COMPACTION_BYTES < worst_case_metadata_bytes(plan, mask) <= SYNC_FREE_METADATA_BYTES
    prepared = prepare(plan, state)
    assert prepared.compaction_pending and prepared.capacity == 16384 // 64
    torch.cuda.synchronize()
    assert prepared.compacted() is None  # the count's read is queued by the first launch
    prepared.after_launch()
    torch.cuda.synchronize()
    trimmed = prepared.compacted()
    assert trimmed is not None and not prepared.compaction_pending and not trimmed.compaction_pending
    assert metadata_difference(trimmed, prepare(plan, state, compact=True)) is None

    # The Runtime and the processors' backend with a native 64 x 64 plan forced: whichever plan the
    # shipped table picks for this mask, this one's worst case lies in the deferred band.
    native = native_plan_like(plan)
    assert DEFERRED_COMPACTION_BYTES < worst_case_metadata_bytes(native, mask) <= SYNC_FREE_METADATA_BYTES

    class ForcedRuntime(Runtime):
        def plan_request(self, state, request, forced):
            return prepare(forced or native, state)

    runtime = ForcedRuntime()
    q, k, v = (torch.randn(1, 16384, 24, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    first = runtime.attention(q, k, v, mask)
    (entry,) = runtime._cache.values()
    worst = entry.prepared
    torch.cuda.synchronize()
    was_pending = worst.compaction_pending
    second = runtime.attention(q, k, v, mask)  # a hit: the compact copy replaces the worst case
    (entry,) = runtime._cache.values()
    assert was_pending and entry.prepared.capacity < worst.capacity and not entry.prepared.compaction_pending
    assert torch.equal(first, second)

    # The processors' backend keeps its plans in its Runtime; the step cache's byte count follows the trim.
    from tessera_diffusers.processors.backends import TesseraBackend
    from tessera_diffusers.processors.plan_cache import StepCache

    backend, cache = TesseraBackend(ForcedRuntime()), StepCache()
    slot = cache.store_mask("layer", mask, 0, "signature")
    first = backend.attention(q, k, v, mask, slot=slot, cache=cache)
    worst_bytes = slot.plan_bytes
    torch.cuda.synchronize()
    assert torch.equal(backend.attention(q, k, v, mask, slot=slot, cache=cache), first)
    assert 0 < slot.plan_bytes < worst_bytes and cache.stats.plan_reuses == 1

    captured = prepare(plan, state)  # a plan launched under capture is pinned
    captured.pin()
    slots = captured.tile_slots
    torch.cuda.synchronize()
    assert captured.compacted() is None and captured.tile_slots is slots
