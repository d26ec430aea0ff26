"""Launch preparation and the PyTorch plan executor: every mapping on every test geometry, with
1 and several splits, against the fp32 oracle; metadata invariants checked directly."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tessera_diffusers import (
    InvalidArgumentError,
    KvLayout,
    PhysicalPlan,
    TaskOrganization,
    Traversal,
    build_mask_state,
    prepare,
    reference,
)
from tessera_diffusers.catalog import reference_kernel
from tessera_diffusers.executor import merge_splits, run_prepared
from tessera_diffusers.plans import AxisMapping
from tessera_diffusers.testing import TEST_GEOMETRIES, random_mask

TILES = ((64, 64), (64, 128), (128, 64), (128, 128))


def plans_for_geometry(bq, bkv, head_dim=16):
    for (tq, tk), layout, splits in itertools.product(TILES, KvLayout, (1, 3)):
        plan = PhysicalPlan(bq, bkv, layout, TaskOrganization(Traversal.LONGEST_FIRST, splits),
                            reference_kernel(head_dim, "fp32", tq, tk))
        if layout is KvLayout.PACKED and plan.slots_per_tile < 2:
            continue
        if plan.q_units_per_tile * plan.slots_per_tile > 64:
            continue
        yield plan


def expand_membership(prepared):
    """Token-level [Bm, Hm, Sq, Skv] coverage count implied by the metadata (for invariants)."""
    plan, mask = prepared.plan, prepared.mask
    cover = torch.zeros(mask.batch, mask.heads, mask.seq_len_q, mask.seq_len_kv, dtype=torch.int32)
    for b, h, t in itertools.product(range(mask.batch), range(mask.heads), range(prepared.num_q_tiles)):
        for pos in range(int(prepared.tile_counts[b, h, t])):
            member = int(prepared.tile_member[b, h, t, pos])
            for a, s in itertools.product(range(plan.q_units_per_tile), range(plan.slots_per_tile)):
                if not (member >> (a * plan.slots_per_tile + s)) & 1:
                    continue
                start = int(prepared.tile_slots[b, h, t, pos, s])
                r0 = t * plan.tile_q + a * plan.q_unit
                cover[b, h, r0 : r0 + plan.q_unit, start : start + plan.kv_unit] += 1
    return cover


@pytest.mark.parametrize("bq,bkv", [(16, 16), (48, 80), (128, 64), (384, 384)])
def test_metadata_covers_exactly_the_effective_set(bq, bkv):
    mask = random_mask(1, 2, 3 * bq + 7, 4 * bkv + 5, bq, bkv, density=0.4, seed=bq)
    state = build_mask_state(mask)
    truth = torch.stack([torch.stack([mask.to_dense(0, h) for h in range(2)])]).to(torch.int32)
    for plan in plans_for_geometry(bq, bkv):
        prepared = prepare(plan, state)
        assert torch.equal(expand_membership(prepared), truth), plan.name


def test_packed_never_schedules_more_tiles_than_contiguous():
    mask = random_mask(2, 2, 1000, 1000, 16, 16, density=0.2, seed=9)
    state = build_mask_state(mask)
    for tq, tk in TILES:
        contiguous = prepare(PhysicalPlan(16, 16, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(16, "fp32", tq, tk)), state)
        packed = prepare(PhysicalPlan(16, 16, KvLayout.PACKED, TaskOrganization(), reference_kernel(16, "fp32", tq, tk)), state)
        assert bool((packed.tile_counts <= contiguous.tile_counts).all())
        assert packed.computed_fraction().sum() <= contiguous.computed_fraction().sum()


def test_traversal_orders_longest_rows_first_and_runs_are_exact():
    mask = random_mask(1, 1, 640, 640, 64, 16, density=0.3, seed=5)
    state = build_mask_state(mask)
    plan = PhysicalPlan(64, 16, KvLayout.PACKED, TaskOrganization(), reference_kernel(16, "fp32", 64, 64))
    prepared = prepare(plan, state)
    counts = prepared.tile_counts[0, 0][prepared.q_order[0, 0].long()]
    assert bool((counts[:-1] >= counts[1:]).all())
    for t in range(prepared.num_q_tiles):
        row = mask.blocks[0, 0, t].tolist()
        runs, j = [], 0
        while j < len(row):
            if row[j]:
                k = j
                while k + 1 < len(row) and row[k + 1]:
                    k += 1
                runs.append((j * 16, min((k + 1) * 16, 640) - j * 16))
                j = k + 1
            else:
                j += 1
        n = int(prepared.run_counts[0, 0, t])
        got = list(zip(prepared.run_starts[0, 0, t, :n].tolist(), prepared.run_lengths[0, 0, t, :n].tolist()))
        assert got == runs


@pytest.mark.parametrize("bq,bkv", TEST_GEOMETRIES, ids=lambda g: str(g))
def test_executor_matches_oracle_on_every_mapping(bq, bkv):
    seq_q, seq_kv = 2 * bq + bq // 2 + 3, 3 * bkv - 5
    mask = random_mask(2, 2, seq_q, seq_kv, bq, bkv, density=0.4, seed=bq * 7 + bkv)
    q, k, v = (torch.randn(2, s, 2, 16) for s in (seq_q, seq_kv, seq_kv))
    ref, ref_lse = reference.attention(q, k, v, mask, 0.25, True)
    state = build_mask_state(mask)
    mappings = set()
    for plan in plans_for_geometry(bq, bkv):
        out, lse = run_prepared(prepare(plan, state), q, k, v, 0.25, True)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=plan.name)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), plan.name
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
        mappings.add((plan.q_mapping, plan.kv_mapping))
    assert mappings


def test_all_four_mappings_are_exercised():
    seen = set()
    for bq, bkv in TEST_GEOMETRIES:
        for plan in plans_for_geometry(bq, bkv):
            seen |= {plan.q_mapping, plan.kv_mapping}
    assert {AxisMapping.DIRECT, AxisMapping.COARSENED, AxisMapping.REFINED, AxisMapping.PACKED} <= seen


def test_merge_of_split_states():
    o = torch.randn(3, 5, 8)
    lse = torch.tensor([[0.5, -math.inf, 1.0, -math.inf, 2.0], [1.5, -math.inf, -math.inf, -math.inf, 0.0],
                        [0.1, -math.inf, 0.2, -math.inf, -math.inf]])
    out, merged = merge_splits(o, lse)
    w = torch.softmax(lse.nan_to_num(neginf=-1e30), 0)
    expected = (w.unsqueeze(-1) * o).sum(0)
    torch.testing.assert_close(out[[0, 2, 4]], expected[[0, 2, 4]])
    assert bool((out[[1, 3]] == 0).all()) and bool((merged[[1, 3]] == -math.inf).all())
    torch.testing.assert_close(merged[[0, 2, 4]], torch.logsumexp(lse, 0)[[0, 2, 4]])


def test_prepare_rejects_foreign_plans():
    mask = random_mask(1, 1, 64, 64, 16, 16)
    plan = PhysicalPlan(32, 16, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(16, "fp32"))
    with pytest.raises(InvalidArgumentError, match="geometry Q16K16"):
        prepare(plan, build_mask_state(mask))
