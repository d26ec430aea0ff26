"""Host cost of a cold request's mask-dependent steps (issue 6: complete request <= 1.10x kernel).

Every torch op of the request path is a kernel launch on a GPU and every value read back is a sync,
so these tests bound both, on the CPU, with a dispatch mode that sees every op."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera_diffusers import KvLayout, PhysicalPlan, TaskOrganization, Traversal, build_mask_state, prepare
from tessera_diffusers.catalog import all_kernels, plans_for, reference_kernel
from tessera_diffusers.cost_model import ROW_UNION_KEY, PlanEstimator, estimate_many, estimate_ms
from tessera_diffusers.mask_state import Stat
from tessera_diffusers.plans import Request
from tessera_diffusers.testing import random_mask

# Ops (views excluded) one prepare() may dispatch; about twenty today, ~110 before issue 6's pass.
MAX_PREPARE_OPS = 30


class OpCounter(TorchDispatchMode):
    """Ops dispatched inside the mode (views excluded) and scalar reads back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


PLANS = [
    # (block_q, block_kv, tile_q, tile_kv, layout): direct, coarsened, packed, refined, > 8 membership bits
    (64, 64, 64, 64, KvLayout.CONTIGUOUS),
    (64, 64, 128, 64, KvLayout.CONTIGUOUS),
    (32, 32, 128, 64, KvLayout.PACKED),
    (128, 64, 128, 128, KvLayout.PACKED),
    (128, 128, 64, 64, KvLayout.CONTIGUOUS),
    (16, 16, 128, 64, KvLayout.PACKED),
]


@pytest.mark.parametrize("bq,bkv,tq,tk,layout", PLANS, ids=lambda p: str(p))
def test_prepare_dispatches_few_ops_and_at_most_one_host_read(bq, bkv, tq, tk, layout):
    mask = random_mask(1, 3, 40 * bq + 5, 30 * bkv, bq, bkv, density=0.15, seed=bq + tk)
    state = build_mask_state(mask)
    plan = PhysicalPlan(bq, bkv, layout, TaskOrganization(Traversal.LONGEST_FIRST, 2), reference_kernel(16, "fp32", tq, tk))
    with OpCounter() as compact:
        prepare(plan, state)
    assert compact.ops <= MAX_PREPARE_OPS and compact.host_reads == 1, (compact.ops, compact.host_reads)
    with OpCounter() as capturable:
        prepare(plan, state, compact=False)
    assert capturable.ops <= MAX_PREPARE_OPS and capturable.host_reads == 0, (capturable.ops, capturable.host_reads)


def test_mask_state_parts_are_built_on_first_use_and_kept():
    mask = random_mask(2, 3, 300, 200, 32, 16, density=0.3, seed=4)
    with OpCounter() as build:
        state = build_mask_state(mask)
    assert build.ops == 0
    assert state.stats is state.stats and state.kv_indices is state.kv_indices
    assert state.row_offsets is state.row_offsets
    with OpCounter() as again:
        state.stats, state.kv_indices, state.row_offsets  # noqa: B018 - reading the cached parts
    assert again.ops == 0


def test_host_statistics_equal_the_device_vector():
    for seed in range(4):
        mask = random_mask(2, 3, 300, 200, 32, 16, density=0.1 + 0.2 * seed, seed=seed)
        host_first = build_mask_state(mask)  # ratios taken on the host copy of the six counts
        values = host_first.host_stat_values
        assert values == tuple(build_mask_state(mask).stats.tolist())
        assert host_first.host_stats()["density"] == values[0]


def test_prepared_runs_are_computed_on_first_access():
    mask = random_mask(1, 2, 640, 640, 64, 16, density=0.3, seed=5)
    plan = PhysicalPlan(64, 16, KvLayout.PACKED, TaskOrganization(), reference_kernel(16, "fp32", 64, 64))
    prepared = prepare(plan, build_mask_state(mask))
    assert prepared.run_counts.shape == prepared.tile_counts.shape
    assert prepared.run_starts is prepared.run_starts


def test_plan_estimator_equals_estimate_many_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for bq, bkv in ((16, 16), (32, 16), (64, 64), (128, 64), (384, 384)):
        req = Request(1, 24, 32768, 32768, 128, "bf16", bq, bkv, "sm90")
        plans = plans_for(bq, bkv, all_kernels())
        estimator = PlanEstimator(plans, req)
        assert estimator.union_rows == tuple(sorted({max(1, p.tile_q // bq) for p in plans} - {1}))
        for trial in range(20):
            values = tuple(float(x) for x in torch.rand(len(Stat), generator=gen) * 4)
            unions = {r: 1.0 + float(torch.rand(1, generator=gen)) for r in estimator.union_rows if trial % 3}
            stats = {s.name.lower(): values[s] for s in Stat} | {f"{ROW_UNION_KEY}{r}": u for r, u in unions.items()}
            assert estimator(values, unions) == estimate_many(plans, req, stats), (bq, bkv, trial)


def test_estimate_many_equals_estimate_ms():
    stats = {"density": 0.1, "run_coverage": 0.5, "max_row_blocks": 40.0, "mean_row_blocks": 20.0,
             "mean_run_length": 2.5, "empty_row_fraction": 0.0, "row_imbalance": 2.0, "row_overlap": 0.6}
    for bq, bkv in ((16, 16), (64, 64), (128, 64), (384, 384)):
        req = Request(1, 24, 32768, 32768, 128, "bf16", bq, bkv, "sm90")
        plans = plans_for(bq, bkv, all_kernels())
        assert estimate_many(plans, req, stats) == [estimate_ms(p, req, stats) for p in plans]
