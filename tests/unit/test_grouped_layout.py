"""The grouped query layout (``QLayout.GROUPED``): plans, metadata and the PyTorch executor against
the fp32 oracle on the CPU; the native kernels on a GPU (marked ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers import (
    KvLayout,
    LogicalMask,
    PhysicalPlan,
    QLayout,
    TaskOrganization,
    Traversal,
    build_mask_state,
    prepare,
)
from tessera_diffusers.catalog import reference_kernel
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.executor import run_prepared
from tessera_diffusers.plans import AxisMapping, Request
from tessera_diffusers.prepare import prepare_torch
from tessera_diffusers.prepared import query_rows
from tessera_diffusers.regroup import permuted_blocks
from tessera_diffusers.testing import check_against_reference, interleaved_mask, random_mask, random_qkv


def reference_plan(block_q, block_kv, tile_q=64, tile_kv=64, layout=KvLayout.PACKED, splits=1, head_dim=32):
    kernel = reference_kernel(head_dim, "bf16", tile_q, tile_kv)
    return PhysicalPlan(block_q, block_kv, layout, TaskOrganization(Traversal.LONGEST_FIRST, splits), kernel).grouped()


def test_plan_name_and_mapping():
    plan = reference_plan(16, 16)
    assert plan.q_layout is QLayout.GROUPED and plan.q_mapping is AxisMapping.GROUPED
    assert plan.name.startswith("grouped-packed_q64k64_from_q16k16")
    natural = PhysicalPlan(16, 16, KvLayout.PACKED, plan.tasks, plan.kernel)
    assert natural.q_layout is QLayout.NATURAL and natural.name.startswith("coarsened-packed_")
    assert natural.grouped() == plan and hash(natural) != hash(plan)


def test_eligibility_needs_whole_blocks_per_tile():
    plan = reference_plan(64, 64, layout=KvLayout.CONTIGUOUS)  # tile == block: nothing to group
    request = Request(1, 2, 640, 640, 32, "bf16", 64, 64, "cpu")
    assert "grouping_applies" in rejection(plan, request)
    assert rejection(reference_plan(16, 16), Request(1, 2, 640, 640, 32, "bf16", 16, 16, "cpu")) is None
    with pytest.raises(InvalidArgumentError, match="plan"):
        prepare(plan, build_mask_state(random_mask(1, 2, 640, 640, 64, 64)))


@pytest.mark.parametrize("block_q, block_kv, tile_q, tile_kv, layout", [
    (16, 16, 64, 64, KvLayout.PACKED),
    (16, 16, 64, 64, KvLayout.CONTIGUOUS),
    (32, 16, 128, 64, KvLayout.PACKED),
    (16, 32, 128, 128, KvLayout.PACKED),
    (32, 32, 64, 32, KvLayout.CONTIGUOUS),
])
def test_metadata_is_the_natural_metadata_of_the_regrouped_mask(block_q, block_kv, tile_q, tile_kv, layout):
    mask = interleaved_mask(1, 3, 29 * block_q + 5, 23 * block_kv - 3, block_q, block_kv, seed=block_q + tile_q)
    plan = reference_plan(block_q, block_kv, tile_q, tile_kv, layout)
    prepared = prepare(plan, build_mask_state(mask))
    kq = tile_q // block_q
    units = prepared.q_units
    assert units.dtype == torch.int32 and units.shape == (1, 3, prepared.num_q_tiles * kq)
    for head in units.reshape(3, -1):  # every block once, -1 only at the tail
        live = head[head >= 0]
        assert sorted(live.tolist()) == list(range(mask.num_blocks_q))
        assert bool((head[len(live):] == -1).all())
    assert not bool((units[..., :mask.num_blocks_q] == torch.arange(mask.num_blocks_q)).all()), "nothing regrouped"
    layout_mask = LogicalMask(permuted_blocks(mask.blocks, units), block_q, block_kv,
                              prepared.num_q_tiles * tile_q, mask.seq_len_kv)
    natural = PhysicalPlan(block_q, block_kv, layout, plan.tasks, plan.kernel)
    want = prepare_torch(natural, build_mask_state(layout_mask), compact=True)
    assert prepared.capacity == want.capacity
    for name in ("tile_counts", "tile_slots", "tile_member", "q_order", "run_counts", "run_starts", "run_lengths"):
        assert torch.equal(getattr(prepared, name), getattr(want, name)), name
    # The regrouping exists to schedule fewer tiles than the natural order.
    natural_tiles = int(prepare(natural, build_mask_state(mask)).tile_counts.sum())
    assert int(prepared.tile_counts.sum()) < natural_tiles


def test_query_rows_maps_units_to_tokens():
    units = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32).view(1, 1, 4)
    rows = query_rows(units, 4, 10)  # units of 4 rows, 10 tokens: unit 2 holds tokens 8, 9
    assert rows.tolist() == [[[8, 9, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1, -1]]]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_q, block_kv, tile_q, tile_kv, layout", [
    (16, 16, 64, 64, KvLayout.PACKED),
    (32, 16, 64, 64, KvLayout.CONTIGUOUS),
    (16, 32, 128, 64, KvLayout.PACKED),
])
def test_executor_matches_the_oracle(block_q, block_kv, tile_q, tile_kv, layout, splits):
    seq_q, seq_kv = 21 * block_q + 7, 17 * block_kv + 3
    mask = interleaved_mask(2, 2, seq_q, seq_kv, block_q, block_kv, seed=splits)
    q, k, v = random_qkv(2, seq_q, seq_kv, 2, 32, torch.float32, "cpu", seed=splits)
    plan = reference_plan(block_q, block_kv, tile_q, tile_kv, layout, splits)
    out, lse = run_prepared(prepare(plan, build_mask_state(mask)), q, k, v, 0.2, True)
    acc = check_against_reference(out, lse, q, k, v, mask, 0.2)
    assert acc.ok(), str(acc)


def test_broadcast_mask_and_random_masks():
    """A mask shared by every (b, h) and random masks (where many heads keep the natural order)."""
    q, k, v = random_qkv(2, 300, 280, 3, 32, torch.float32, "cpu", seed=3)
    for mask in (interleaved_mask(1, 1, 300, 280, 16, 16, seed=4), random_mask(2, 3, 300, 280, 16, 16, seed=5)):
        prepared = prepare(reference_plan(16, 16), build_mask_state(mask))
        out, lse = run_prepared(prepared, q, k, v, 0.3, True)
        acc = check_against_reference(out, lse, q, k, v, mask, 0.3)
        assert acc.ok(), str(acc)


# ---------------------------------------------------------------------------------- native kernels
def native_kernels(family: str):
    from tessera_diffusers import ops
    from tessera_diffusers.catalog import all_kernels

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if family == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper family needs sm90")
    try:
        ids = ops.load_library().kernel_ids
    except Exception as err:  # noqa: BLE001 - any load failure skips
        pytest.skip(f"native library not loadable: {err}")
    return [k for k in all_kernels() if k.family.value == family and k.name in ids and k.head_dim == 128]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["hopper", "portable"])
def test_native_grouped_plans_match_the_oracle(family):
    """Every 128-dim kernel of the family, on interleaved masks with partial blocks and an empty
    row, each layout, 1 and 3 splits and a persistent grid; the output poisoned with NaN first, so a
    row the kernel forgets to store fails."""
    from tessera_diffusers import ops

    device = torch.device("cuda")
    failures, checked = [], 0
    for kernel in native_kernels(family):
        for block_q, block_kv in ((16, 16), (32, 16), (16, 64)):
            if kernel.tile_q <= block_q:
                continue
            seq_q, seq_kv = 19 * block_q + 5, 23 * block_kv - 7
            mask = interleaved_mask(2, 3, seq_q, seq_kv, block_q, block_kv, seed=kernel.tile_q + block_q, device=device)
            q, k, v = random_qkv(2, seq_q, seq_kv, 3, 128, kernel.torch_dtype, device, seed=block_kv)
            state = build_mask_state(mask)
            layouts = [KvLayout.CONTIGUOUS] + ([KvLayout.PACKED] if kernel.tile_kv > block_kv else [])
            for layout in layouts:
                for org in (TaskOrganization(), TaskOrganization(Traversal.LONGEST_FIRST, 3),
                            TaskOrganization(Traversal.LONGEST_FIRST, 3, persistent=True)):
                    plan = PhysicalPlan(block_q, block_kv, layout, org, kernel).grouped()
                    prepared = prepare(plan, state)
                    out = torch.full_like(q, float("nan"))
                    lse = torch.full((2, 3, seq_q), float("nan"), device=device)
                    workspace = prepared.workspace(2, 3, 128).allocate(device) if org.num_splits > 1 else None
                    ops.launch(q, k, v, *prepared.metadata[:4], kernel.name, prepared.launch_config(), 0.09,
                               out, lse, workspace, prepared.q_units)
                    acc = check_against_reference(out, lse, q, k, v, mask, 0.09)
                    checked += 1
                    if not acc.ok():
                        failures.append(f"{plan.name}: {acc}")
    if checked == 0:
        pytest.skip(f"no {family} kernel in this build")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
def test_native_grouped_prepare_matches_torch():
    """The native grouping and preparation give the CPU path's metadata bit for bit."""
    native_kernels("portable")
    device = torch.device("cuda")
    mask = interleaved_mask(1, 4, 2000, 1900, 16, 16, seed=11, device=device)
    plan = PhysicalPlan(16, 16, KvLayout.PACKED, TaskOrganization(), reference_kernel(128, "bf16", 128, 64)).grouped()
    got = prepare(plan, build_mask_state(mask), compact=True)
    cpu_mask = LogicalMask(mask.blocks.cpu(), 16, 16, 2000, 1900)
    want = prepare(plan, build_mask_state(cpu_mask), compact=True)
    assert torch.equal(got.q_units.cpu(), want.q_units)
    for name in ("tile_counts", "tile_slots", "tile_member", "q_order"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


def test_reused_mask_rule_groups_small_blocks_on_hopper(monkeypatch):
    from tessera_diffusers.catalog import hopper_kernels
    from tessera_diffusers.selector import GROUP_QUERIES_ENV, GROUPED_MAX_BLOCK_Q, reused_mask_plan

    kernel = next(k for k in hopper_kernels() if (k.tile_q, k.tile_kv, k.head_dim) == (128, 128, 128))
    monkeypatch.delenv(GROUP_QUERIES_ENV, raising=False)

    def layout(block_q, block_kv, kernel=kernel):
        plan = PhysicalPlan(block_q, block_kv, KvLayout.PACKED, TaskOrganization(), kernel)
        return reused_mask_plan(plan, Request(1, 24, 32768, 32768, 128, "bf16", block_q, block_kv, "sm90")).q_layout

    assert layout(16, 16) is QLayout.GROUPED
    assert layout(GROUPED_MAX_BLOCK_Q, 16) is QLayout.GROUPED
    assert layout(64, 64) is QLayout.NATURAL  # above the rule's block size
    assert layout(128, 64) is QLayout.NATURAL  # one block per tile: nothing to group
    portable = reference_kernel(128, "bf16", 128, 128)
    assert layout(16, 16, portable) is QLayout.NATURAL  # the rule is measured on Hopper only
    monkeypatch.setenv(GROUP_QUERIES_ENV, "0")
    assert layout(16, 16) is QLayout.NATURAL
    monkeypatch.setenv(GROUP_QUERIES_ENV, "1")
    assert layout(64, 64) is QLayout.GROUPED and layout(16, 16, portable) is QLayout.GROUPED


def test_runtime_regroups_a_mask_that_comes_back(monkeypatch):
    """First request natural, the second re-prepared once in the grouped layout (here forced for the
    executor's plans with TESSERA_GROUP_QUERIES=1), both equal to the oracle; a new mask starts over."""
    from tessera_diffusers import Runtime
    from tessera_diffusers.selector import GROUP_QUERIES_ENV

    monkeypatch.setenv(GROUP_QUERIES_ENV, "1")
    q, k, v = random_qkv(1, 400, 400, 2, 32, torch.float32, "cpu", seed=8)
    mask = interleaved_mask(1, 2, 400, 400, 16, 16, seed=8)
    plan = PhysicalPlan(16, 16, KvLayout.PACKED, TaskOrganization(), reference_kernel(32, "fp32", 64, 64))
    runtime = Runtime()
    request = Request(1, 2, 400, 400, 32, "fp32", 16, 16, "cpu")
    runtime.selector.select = lambda *args, **kwargs: plan  # the executor's plan as the selector's choice
    layouts = []
    for _ in range(3):
        prepared = runtime.prepared_for(mask, request, None)
        layouts.append(prepared.plan.q_layout)
        out = run_prepared(prepared, q, k, v, 0.2)
        assert check_against_reference(out, None, q, k, v, mask, 0.2).ok()
    assert layouts == [QLayout.NATURAL, QLayout.GROUPED, QLayout.GROUPED] and runtime.regroupings == 1
    assert runtime.prepared_for(interleaved_mask(1, 2, 400, 400, 16, 16), request, None).plan.q_layout is QLayout.NATURAL
    monkeypatch.setenv(GROUP_QUERIES_ENV, "0")
    other = interleaved_mask(1, 2, 400, 400, 16, 16, seed=9)
    for _ in range(2):
        assert runtime.prepared_for(other, request, None).plan.q_layout is QLayout.NATURAL

