"""Analytic roofline cost model: ranks plans on a GPU with no profiled plan table.

time(plan) = max(computed flops / effective rate, bytes / bandwidth) + tiles * per-tile overhead

The computed area (including masked entries inside coarsened / packed tiles) is estimated from the
mask statistics: a run of L active blocks touched by aligned groups of c blocks occupies about
``c * ceil-ish((L + c - 1) / c)`` blocks, and packing wastes only what neighbouring query rows do
not share (``ROW_OVERLAP``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .mask_state import Stat
from .plans import AxisMapping, Family, KvLayout, PhysicalPlan, Request


@dataclass(frozen=True)
class DeviceRates:
    """Effective rates of one GPU (measured dense numbers, not datasheet peaks)."""

    rate_scale: float = 1.0  # this GPU's dense rate over the H200's (the tile tables are H200 numbers)
    bandwidth_gbs: float = 4300.0
    # What K/V tile loads stream at: nearly all of them are re-reads that hit L2. On the H200's
    # profiling split (mixed Q64K64 / Q64K32 regimes) every value from 8,000 to 17,200 makes the
    # same choices and lower ones worse: the measured tile rates already carry the L2 limit of the
    # small tiles (64 x 64 tiles stream ~7.7 TB/s of K/V at Q64K64, 10%).
    l2_bandwidth_gbs: float = 17200.0
    tile_overhead_us: float = 0.02  # per KV tile step of one CTA (latency of a small tile)
    num_sms: int = 132


H200 = DeviceRates()

ROW_UNION_KEY = "row_union_"  # stats[f"row_union_{r}"]: MaskState.row_union_ratios()[r]


def row_union_stats(plans: Sequence[PhysicalPlan], block_q: int, state) -> dict[str, float]:
    """The measured query-axis waste of every query-tile height in ``plans`` (one host sync)."""
    rows = tuple(sorted({max(1, p.tile_q // block_q) for p in plans} - {1}))
    return {f"{ROW_UNION_KEY}{r}": v for r, v in state.row_union_ratios(rows).items()} if rows else {}


# Throughput on the computed (scheduled) area of unmasked tiles by family and (tile_q, tile_kv, warps),
# TFLOP/s, measured on one H200 (bf16, D=128, N=32768, H=24, ~10% corpus masks; docs/results.md).
# A profiled plan table replaces these rankings; other GPUs scale them by their dense rate.
TILE_TFLOPS = {
    Family.PORTABLE: {(128, 64, 4): 310.0, (128, 64, 8): 280.0, (128, 128, 8): 288.0, (64, 64, 4): 245.0,
                      (64, 128, 4): 215.0},
    # The Hopper family from kernel studies of direct and refined plans; the 64x64 tile (two CTAs
    # per SM) fitted on the profiling split, where the cost model arbitrates the mixed Q64K64 /
    # Q64K32 regimes.
    Family.HOPPER: {(128, 128, 8): 576.0, (128, 64, 8): 452.0, (64, 128, 4): 383.0, (64, 64, 4): 500.0},
}
# Slowdown of tiles that need membership masking (coarsened / packed / regridded), same measurements.
MASKED_TILE_SLOWDOWN = {Family.PORTABLE: 1.2, Family.HOPPER: 1.1}
# Tile shapes, (tile_q, tile_kv, warps), that lose a different share to masking than their family.
# The Hopper 64 x 64 tile against the 128 x 128 one decides the mixed Q32K32 / Q64K32 regimes (both
# tiles masked there): on the profiling split's 30 cases of those regimes every value from 1.074 to
# 1.096 gives the least regret (GM 1.0000, against 1.0135 on Q32K32 at the family's 1.1), and 1.085
# is the middle of that range (docs/results.md, "Design decisions").
MASKED_TILE_SLOWDOWN_BY_SHAPE = {Family.HOPPER: {(64, 64, 4): 1.085}}


def tile_rate(family: Family, tile_q: int, tile_kv: int, warps: int) -> float:
    """Measured TFLOP/s of one tile shape; unmeasured shapes scale the family's best by tile area."""
    table = TILE_TFLOPS.get(family, TILE_TFLOPS[Family.PORTABLE])
    measured = table.get((tile_q, tile_kv, warps))
    if measured is not None:
        return measured
    return max(table.values()) * min(1.0, (tile_q * tile_kv / (128 * 128)) ** 0.25)


def masked_tile_slowdown(family: Family, tile_q: int, tile_kv: int, warps: int) -> float:
    """How much slower a tile shape runs where it masks scores by block membership."""
    shaped = MASKED_TILE_SLOWDOWN_BY_SHAPE.get(family, {}).get((tile_q, tile_kv, warps))
    return shaped if shaped is not None else MASKED_TILE_SLOWDOWN.get(family, 1.2)


def coarsening_waste(block: int, tile: int, mean_run: float) -> float:
    """Expected computed / active blocks along one axis when aligned tiles cover ``tile / block``."""
    c = max(1, tile // block)
    if c == 1:
        return 1.0
    run = max(1.0, mean_run)
    return c * ((run + c - 1) / c) / run


def area_is_measured(plan: PhysicalPlan) -> bool:
    """Whether the area the model computes for ``plan`` is measured on the mask rather than estimated
    from run lengths: the query axis by the row unions, the KV axis exact (packed, or tiles no wider
    than a block). Only such plans are calibrated (``plan_table.Regime.calibration``): one scale per
    plan cannot correct an estimate whose error changes with the mask's layout, as the run-length
    estimate of KV-coarsened tiles does (0.5x on banded masks, 1x on clustered ones)."""
    return plan.kv_layout is KvLayout.PACKED or plan.tile_kv <= plan.block_kv


def estimate_ms(plan: PhysicalPlan, req: Request, stats: dict[str, float], rates: DeviceRates = H200) -> float:
    """Predicted kernel milliseconds of ``plan`` on ``req`` with host mask statistics ``stats``."""
    return tile_work_ms(plan, req, stats, rates) + split_merge_ms(plan, req, rates)


def estimate_many(plans: Sequence[PhysicalPlan], req: Request, stats: dict[str, float],
                  rates: DeviceRates = H200) -> list[float]:
    """``estimate_ms`` of every plan, equal to it bit for bit. Plans that differ only in their task
    organization (five per kernel and layout in the catalog) share one evaluation of the tile work."""
    work: dict = {}
    out = []
    for plan in plans:
        key = (plan.block_q, plan.block_kv, plan.kv_layout, plan.kernel)
        ms = work.get(key)
        if ms is None:
            ms = work[key] = tile_work_ms(plan, req, stats, rates)
        out.append(ms + split_merge_ms(plan, req, rates))
    return out


class PlanEstimator:
    """``estimate_many`` of one fixed list of plans for one request, bit for bit, on the selector's
    hot path (a cost-model regime's contenders on every new mask): everything that does not depend on
    the mask (tile rates, geometry, split-K cost) is worked out once, and a call only reads the
    host statistic vector (``MaskState.host_stat_values``) and the row-union ratios of
    ``union_rows`` (``MaskState.row_union_ratios``)."""

    def __init__(self, plans: Sequence[PhysicalPlan], req: Request, rates: DeviceRates = H200):
        self.req, self.rates = req, rates
        groups: dict = {}
        self.groups: list[TileGroup] = []
        self.plans: list[tuple[int, float]] = []  # per plan: (its group's index, split-K ms)
        for plan in plans:
            key = (plan.block_q, plan.block_kv, plan.kv_layout, plan.kernel)
            group = groups.get(key)
            if group is None:
                group = groups[key] = len(self.groups)
                self.groups.append(TileGroup.of(plan, req, rates))
            self.plans.append((group, split_merge_ms(plan, req, rates)))
        self.union_rows = tuple(sorted({g.q_rows for g in self.groups} - {1}))  # the row unions the groups read

    def __call__(self, values: Sequence[float], unions: dict[int, float]) -> list[float]:
        """Predicted milliseconds of every plan, in order, from the ``Stat`` vector ``values`` and
        ``unions[r]`` for ``r`` in ``union_rows`` (what ``tile_work_ms`` reads as ``row_union_r``)."""
        req, rates = self.req, self.rates
        area = values[Stat.DENSITY] * req.seq_len_q * req.seq_len_kv * (req.batch * req.heads)
        mean_run, overlap = values[Stat.MEAN_RUN_LENGTH], values[Stat.ROW_OVERLAP]
        work = [g.work_ms(area, mean_run, overlap, unions.get(g.q_rows), req, rates) for g in self.groups]
        return [work[group] + split for group, split in self.plans]


def tile_work_ms(plan: PhysicalPlan, req: Request, stats: dict[str, float], rates: DeviceRates = H200) -> float:
    """The tiles' part of ``estimate_ms``: roofline time of the computed area plus per-tile overhead
    (depends on the plan's geometry, layout and kernel, not on its task organization)."""
    group = TileGroup.of(plan, req, rates)
    union = stats.get(f"{ROW_UNION_KEY}{group.q_rows}")
    return group.work_ms(
        stats[Stat.DENSITY.name.lower()] * req.seq_len_q * req.seq_len_kv * (req.batch * req.heads),
        stats[Stat.MEAN_RUN_LENGTH.name.lower()], stats[Stat.ROW_OVERLAP.name.lower()], union, req, rates,
    )  # fmt: skip


@dataclass(frozen=True)
class TileGroup:
    """What a plan's tile work depends on besides the mask: plans that differ only in their task
    organization share one (``PlanEstimator`` evaluates it once for all of them)."""

    q_rows: int  # block rows per query tile
    packed: bool
    tile_q: int
    tile_kv: int
    rate: float  # TFLOP/s on the computed area, masking slowdown included

    @classmethod
    def of(cls, plan: PhysicalPlan, req: Request, rates: DeviceRates = H200) -> TileGroup:
        rate = tile_rate(plan.kernel.family, plan.tile_q, plan.tile_kv, plan.kernel.warps) * rates.rate_scale
        masked = {plan.q_mapping, plan.kv_mapping} & {AxisMapping.COARSENED, AxisMapping.PACKED, AxisMapping.REGRIDDED}
        if masked:
            rate /= masked_tile_slowdown(plan.kernel.family, plan.tile_q, plan.tile_kv, plan.kernel.warps)
        return cls(max(1, plan.tile_q // req.block_q), plan.kv_layout is KvLayout.PACKED, plan.tile_q, plan.tile_kv, rate)

    def work_ms(self, area: float, mean_run: float, overlap: float, union: float | None, req: Request,
                rates: DeviceRates) -> float:
        """Milliseconds for ``area`` active token pairs; ``union``: the measured row-union ratio of
        ``q_rows`` rows (``MaskState.row_union_ratios``) or None."""
        # Gathered (packed) tiles are full up to the last one of each row.
        kv_waste = 1.0 if self.packed else coarsening_waste(req.block_kv, self.tile_kv, mean_run)
        # The union of the KV sets of q_rows block rows: measured on the mask where the caller gave it,
        # else estimated from the overlap of neighbouring rows.
        q_waste = union or 1.0 + (self.q_rows - 1) * (1.0 - overlap)
        computed = area * q_waste * kv_waste
        math_ms = 4.0 * req.head_dim * computed / (self.rate * 1e12) * 1e3
        tiles = computed / (self.tile_q * self.tile_kv)
        bytes_moved = tiles * self.tile_kv * req.head_dim * 2 * 2  # K and V per KV tile, bf16
        mem_ms = bytes_moved / (rates.l2_bandwidth_gbs * 1e9) * 1e3
        waves = max(1.0, tiles / rates.num_sms)
        return max(math_ms, mem_ms) + waves * rates.tile_overhead_us * 1e-3


def split_merge_ms(plan: PhysicalPlan, req: Request, rates: DeviceRates = H200) -> float:
    """The split-K part of ``estimate_ms``: writing and merging the partial outputs."""
    if plan.tasks.num_splits <= 1:
        return 0.0
    bh = req.batch * req.heads
    return plan.tasks.num_splits * bh * req.seq_len_q * req.head_dim * 8 / (rates.bandwidth_gbs * 1e9) * 1e3
