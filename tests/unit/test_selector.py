"""The online selector: regime lookup, ranked fallback over eligibility (reasons kept), the
(request, regime) cache, bucket/key misses, rejected tables (warned once, then the cost model),
and the Runtime path with a table on the CPU."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import torch

from tessera_diffusers import LogicalMask, Runtime, build_mask_state, reference
from tessera_diffusers.catalog import all_kernels, plans_for, portable_kernels, reference_kernel
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.plan_table import STAT_NAMES, TABLE_ENV, PlanTable, body_digest
from tessera_diffusers.plans import KvLayout, PhysicalPlan, Request, TaskOrganization
from tessera_diffusers.profile.compile import CompileOptions, compile_table
from tessera_diffusers.profile.synthetic import cost_model_latency, synthetic_profile
from tessera_diffusers.selector import Selector, rank
from tessera_diffusers.testing import banded_mask, random_mask, random_qkv

SEQ = 4096  # bucket s1-4096: requests down to a handful of tokens share it
REQUEST = Request(1, 24, SEQ, SEQ, 128, "bf16", 64, 64, "sm90")
ELIGIBLE = [p for p in plans_for(64, 64, portable_kernels()) if rejection(p, REQUEST) is None]
SPLIT4 = next(p for p in ELIGIBLE if p.tasks.num_splits == 4)
DIRECT = next(p for p in ELIGIBLE if p.tasks.num_splits == 1 and p.tile_kv == 64 and p.tile_q == 64)
WIDE = next(p for p in ELIGIBLE if p.tasks.num_splits == 1 and p.tile_kv == 128)
PLANS = [SPLIT4, DIRECT, WIDE]


def latency(plan, request, stats, rng):
    """Sparse masks: split4 best, then direct. Denser: the wide tile. Direct is the base plan."""
    noise = 1.0 + 0.005 * rng.gauss(0.0, 1.0)
    sparse = stats["density"] < 0.1
    return noise * {SPLIT4.name: 1.0 if sparse else 1.4, DIRECT.name: 1.05,
                    WIDE.name: 1.3 if sparse else 1.0}[plan.name]


@pytest.fixture(scope="module")
def table():
    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST], latency, 200, groups=4)
    table, _ = compile_table(profile, CompileOptions(min_leaf=32))
    assert table.keys[REQUEST.key].base_plan == DIRECT.name
    return table


def state_with_density(density: float, seed: int = 0, seq: int = SEQ):
    return build_mask_state(random_mask(1, 2, seq, seq, 64, 64, density=density, empty_rows=False, seed=seed))


def test_regime_lookup_then_cache_per_regime(table):
    selector = Selector(table=table, kernels=portable_kernels())
    sparse, dense = state_with_density(0.05), state_with_density(0.4)
    assert sparse.stat(0) < 0.1 < dense.stat(0)
    assert selector.select(REQUEST, sparse) == SPLIT4
    assert selector.select(REQUEST, dense) == WIDE
    assert selector.scans == 2 and selector.regime_hits == 0
    assert selector.select(REQUEST, state_with_density(0.06, seed=5)) == SPLIT4  # new mask, same regime
    assert selector.scans == 2 and selector.regime_hits == 1
    selection = selector.selection(REQUEST, sparse)
    assert selection.source == "plan table" and selection.regime is not None and "density <=" in selection.regime.rule


def test_reuse_regime_reads_no_statistics_until_forgotten(table):
    selector = Selector(table=table, kernels=portable_kernels(), reuse_regime=True)
    sparse, dense = state_with_density(0.05), state_with_density(0.4)
    assert selector.select(REQUEST, sparse) == SPLIT4  # the first mask of the request is read
    assert "host_stat_values" in sparse.__dict__
    assert selector.select(REQUEST, dense) == SPLIT4  # the caller allowed reuse: no sync, same regime
    assert "host_stat_values" not in dense.__dict__ and selector.regime_reuses == 1
    selector.forget_regimes()
    assert selector.select(REQUEST, dense) == WIDE and "host_stat_values" in dense.__dict__
    plain = Selector(table=table, kernels=portable_kernels())
    assert plain.select(REQUEST, sparse) == SPLIT4 and plain.select(REQUEST, state_with_density(0.4, seed=2)) == WIDE


def test_reuse_regime_keeps_the_cost_model_choice():
    selector = Selector(table=None, kernels=portable_kernels(), reuse_regime=True)
    first, second = state_with_density(0.05), state_with_density(0.4)
    chosen = selector.select(REQUEST, first)
    assert chosen is not None and "host_stat_values" in first.__dict__
    assert selector.select(REQUEST, second) == chosen and "host_stat_values" not in second.__dict__
    assert selector.regime_reuses == 1


def test_ranked_fallback_keeps_the_reasons(table):
    short = Request(1, 24, SEQ, 100, 128, "bf16", 64, 64, "sm90")  # same bucket, two KV blocks: no 4-way split
    selector = Selector(table=table, kernels=portable_kernels())
    blocks = torch.zeros(1, 2, SEQ // 64, 2, dtype=torch.bool)
    blocks[:, :, ::20, 1] = True  # sparse: the split-K regime
    state = build_mask_state(LogicalMask(blocks, 64, 64, SEQ, 100))
    assert selector.select(short, state) == DIRECT
    full = selector.rank(short, state)
    assert full.rejected[0][0] == SPLIT4.name and "splits_are_useful" in full.rejected[0][1]
    text = full.explain()
    for part in ("regime", "ranking", "rejected (1)", SPLIT4.name, f"chosen   {DIRECT.name}"):
        assert part in text


def test_bucket_miss_gives_the_base_plan_and_key_miss_the_cost_model(table):
    selector = Selector(table=table, kernels=portable_kernels())
    big = Request(1, 24, 75600, 75600, 128, "bf16", 64, 64, "sm90")
    selection = selector.selection(big, state_with_density(0.05))
    assert selection.chosen == DIRECT and selection.source == "plan table"
    assert "not profiled" in " ".join(selection.notes)
    other_key = Request(1, 24, SEQ, SEQ, 128, "bf16", 128, 128, "sm90")
    mask = random_mask(1, 2, SEQ, SEQ, 128, 128, density=0.2, empty_rows=False)
    selection = selector.selection(other_key, build_mask_state(mask))
    assert selection.source == "cost model" and selection.chosen is not None
    assert "not profiled" in " ".join(selection.notes)


def test_selector_without_table_ranks_with_the_cost_model():
    state = state_with_density(0.1)
    with_model = Selector(table=None, kernels=all_kernels()).selection(REQUEST, state)
    assert with_model.source == "cost model" and with_model.regime is None
    assert with_model.chosen.name == with_model.ranking[0][0]
    assert rank(REQUEST, state, assume_native=True, table=None).chosen == with_model.chosen


def test_mismatched_catalog_warns_once_and_uses_the_cost_model(table):
    messages: list[str] = []
    selector = Selector(table=table, kernels=portable_kernels()[:-1])
    for seed in range(3):
        plan = selector.select(REQUEST, state_with_density(0.05, seed=seed), warn=messages.append)
        assert plan is not None
    assert len(messages) == 1 and "PlanTableError" in messages[0] and "catalog" in messages[0]
    selection = selector.selection(REQUEST, state_with_density(0.05))
    assert selection.source == "cost model" and "rejected" in selection.notes[0]


@pytest.mark.parametrize(
    ("profiled", "library", "stale"),
    [
        (["aaaa"], "bbbb", True),  # profiled on other kernel sources
        (["aaaa", "bbbb"], "bbbb", True),  # partly
        (["bbbb"], "bbbb", False),
        (["aaaa"], None, False),  # a library built before the hash: unknown
        (None, "bbbb", False),  # a table compiled before the hash: unknown
    ],
)
def test_table_profiled_on_other_kernel_sources_warns_once_and_is_still_used(table, monkeypatch, profiled, library,
                                                                            stale):
    """The catalog hash names tile shapes, not code: a table profiled on kernels built from other
    sources passes it. The selector then warns (once) and still ranks with the table."""
    import dataclasses
    from types import MappingProxyType

    import tessera_diffusers.selector as selector_module

    provenance = {k: v for k, v in table.provenance.items() if k != "kernel_sources"}
    if profiled is not None:
        provenance["kernel_sources"] = profiled
    stamped = dataclasses.replace(table, provenance=MappingProxyType(provenance))
    monkeypatch.setattr(selector_module, "library_kernels", portable_kernels)  # as if loaded from a library
    monkeypatch.setattr(selector_module, "library_kernel_sources",
                        lambda cuda=True, part="kernel_sources": library if part == "kernel_sources" else None)
    messages: list[str] = []
    selector = Selector(table=stamped)
    for seed in range(3):
        assert selector.select(REQUEST, state_with_density(0.05, seed=seed), warn=messages.append) == SPLIT4
    selection = selector.selection(REQUEST, state_with_density(0.05))
    assert selection.source == "plan table"
    if stale:
        assert len(messages) == 1 and "re-profile" in messages[0] and library in messages[0]
        assert any("possibly stale" in note for note in selection.notes)
    else:
        assert messages == [] and not any("stale" in note for note in selection.notes)


def test_corrupt_table_from_the_environment_warns_and_falls_back(table, tmp_path, monkeypatch):
    data = table.to_dict()
    data["table"]["keys"][REQUEST.key]["base_plan"] = SPLIT4.name  # edited by hand: checksum fails
    path = tmp_path / "plan_table_sm90.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv(TABLE_ENV, str(path))
    with pytest.warns(UserWarning, match="checksum mismatch") as caught:
        selection = Selector(kernels=portable_kernels()).selection(REQUEST, state_with_density(0.05))
    assert len([w for w in caught if "PlanTableError" in str(w.message)]) == 1
    assert selection.source == "cost model"
    # The same table, valid, is used through the environment variable.
    path.write_text(json.dumps(table.to_dict()))
    data = table.to_dict()
    assert data["sha256"] == body_digest(data["table"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Selector(kernels=portable_kernels()).select(REQUEST, state_with_density(0.05)) == SPLIT4


def cpu_table():
    """A CPU table over two executor plans (the slower-looking one ranked first, so the choice is
    visibly the table's)."""
    request = Request(1, 2, 1000, 1000, 64, "fp32", 64, 64, "cpu")
    kernel = reference_kernel(64, "fp32", 64, 128)
    split = PhysicalPlan(64, 64, KvLayout.CONTIGUOUS, TaskOrganization(num_splits=2), kernel)
    plain = PhysicalPlan(64, 64, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(64, "fp32", 64, 64))

    def lat(plan, req, stats, rng):
        return 1.0 if plan == split else 2.0

    profile = synthetic_profile("cpu", (), [split, plain], [request], lat, 8)
    table, _ = compile_table(profile, CompileOptions(min_leaf=32))
    return table, split


def test_runtime_runs_the_table_choice_on_cpu_and_explains():
    table, split = cpu_table()
    runtime = Runtime(selector=Selector(table=table))
    mask = random_mask(1, 2, 1000, 1000, 64, 64, density=0.3)
    q, k, v = random_qkv(1, 1000, 1000, 2, 64, torch.float32, "cpu")
    out = runtime.attention(q, k, v, mask)
    assert runtime._cache[next(iter(runtime._cache))].prepared.plan == split
    torch.testing.assert_close(out, reference.attention(q, k, v, mask), atol=2e-5, rtol=1e-5)
    buffer = io.StringIO()
    selection = runtime.explain(q, k, v, mask, file=buffer)
    assert selection.chosen == split and f"chosen   {split.name}" in buffer.getvalue()
    assert "regime   cpu/Q64K64/d64/fp32/bshd" in buffer.getvalue()
    # Without a table the CPU keeps the reference oracle.
    assert Runtime().explain(q, k, v, mask, file=io.StringIO()).chosen is None


def test_every_ranked_plan_rejected_falls_back_to_the_cost_model(table):
    # A Q64K64 sm90 table asked about a request its plans cannot serve on sm86 (shared memory).
    sm86 = Request(1, 24, SEQ, SEQ, 128, "bf16", 64, 64, "sm86")
    profile = synthetic_profile("sm86", portable_kernels(), PLANS, [sm86], latency, 8)
    small_table, _ = compile_table(profile, CompileOptions(min_leaf=32))
    big = [p for p in plans_for(64, 64, portable_kernels()) if p.kernel.smem_bytes > 110_000 and p.kernel.head_dim == 128
           and p.kernel.dtype == "bf16"][:2]
    profile = synthetic_profile("sm86", portable_kernels(), big, [sm86], lambda p, r, s, g: 1.0, 8)
    only_big, _ = compile_table(profile, CompileOptions(min_leaf=32))
    selector = Selector(table=only_big, kernels=portable_kernels())
    selection = selector.selection(sm86, state_with_density(0.05))
    assert selection.source == "cost model" and selection.chosen is not None
    assert rejection(selection.chosen, sm86) is None
    assert "every plan of the regime's ranking was rejected" in selection.notes[-1]
    assert Selector(table=small_table, kernels=portable_kernels()).selection(sm86, state_with_density(0.05)).source \
        .startswith("plan table")


def test_rank_on_cpu_without_table_is_the_oracle():
    mask = LogicalMask.dense(256, 256, 64, 64)
    selection = rank(Request(1, 2, 256, 256, 64, "bf16", 64, 64, "cpu"), build_mask_state(mask))
    assert selection.chosen is None and "reference oracle" in selection.explain()


def test_a_plan_rule_picks_the_plan_of_a_regime_by_a_statistic():
    """Too few cases to split (40: one regime) whose first plan loses 40% on half of them, and one
    statistic (density) decides which tile wins: cross-validation gives the regime a plan rule,
    which reads each mask's statistics; ``reuse_regime`` keeps the previous decision without reading
    the next mask's. A regime whose cases agree keeps its first plan without reading any statistic."""
    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST], latency, 40, groups=4)
    ruled, report = compile_table(profile, CompileOptions(min_leaf=32))
    (bucket,) = ruled.keys[REQUEST.key].buckets.values()
    (regime,) = bucket.regimes
    assert regime.fit_regret > 1.02 and regime.choice == "plan_rule"
    rule = regime.plan_rule
    assert STAT_NAMES[rule.stat] == "density" and (rule.below, rule.above) == (SPLIT4.name, WIDE.name)
    assert "plan rule (" in report.to_markdown()
    selector = Selector(table=ruled, kernels=portable_kernels())
    for density, expected in ((0.05, SPLIT4), (0.4, WIDE)):
        state = state_with_density(density)
        selection = selector.selection(REQUEST, state)
        assert selection.source == "plan table + plan rule" and selection.chosen == expected
        assert any(n.startswith("plan rule: density") for n in selection.notes)
        assert "host_stat_values" in state.__dict__  # it read this mask's statistics
        text = selection.explain()
        assert f"choice   plan rule: {SPLIT4.name} if density <=" in text
        assert "ranking (geometric-mean ms over the regime's cases)" in text
    reuse = Selector(table=ruled, kernels=portable_kernels(), reuse_regime=True)
    first = reuse.selection(REQUEST, state_with_density(0.05))
    later = state_with_density(0.4)
    assert reuse.selection(REQUEST, later) is first and "host_stat_values" not in later.__dict__

    agreed = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST],
                               lambda p, r, s, g: {SPLIT4.name: 1.0, DIRECT.name: 1.05, WIDE.name: 1.3}[p.name], 40)
    table, _ = compile_table(agreed, CompileOptions(min_leaf=32))
    state = state_with_density(0.05)
    selection = Selector(table=table, kernels=portable_kernels()).selection(REQUEST, state)
    assert selection.source == "plan table" and selection.chosen == SPLIT4
    assert "host_stat_values" not in state.__dict__


def test_a_regime_can_hand_its_choice_to_the_cost_model():
    """Latencies that follow the cost model (1% noise) over a 64-row and a 128-row tile, where what
    decides between them is the union of the KV sets of neighbouring query rows: the cost model
    reads it (the row-union ratios), no statistic of the schema shows it, so no plan rule or
    ranking does as well and cross-validation hands the regime's choice to the cost model."""
    request = Request(1, 24, SEQ, SEQ, 128, "bf16", 64, 64, "sm90")
    hopper = [p for p in plans_for(64, 64, all_kernels()) if "hopper" in p.name and p.tasks.num_splits == 1
              and rejection(p, request) is None]
    small = next(p for p in hopper if (p.tile_q, p.tile_kv) == (64, 64))
    tall = next(p for p in hopper if (p.tile_q, p.tile_kv) == (128, 128) and p.kv_layout is KvLayout.PACKED)

    def unions(rng):  # the 128-row tile's waste; the two tiles cost the same near 1.07
        return {2: rng.uniform(1.0, 1.2)}

    profile = synthetic_profile("sm90", all_kernels(), [small, tall], [request], cost_model_latency(0.01), 48,
                                groups=4, row_unions=unions)
    table, report = compile_table(profile, CompileOptions(min_leaf=32))
    (bucket,) = table.keys[request.key].buckets.values()
    (regime,) = bucket.regimes
    assert regime.choice == "cost_model" and set(regime.contenders) == {small.name, tall.name}
    assert "cost model —" in report.to_markdown()
    selector = Selector(table=table, kernels=all_kernels())
    selection = selector.selection(request, state_with_density(0.1))
    assert selection.source == "plan table + cost model" and selection.chosen.name in regime.contenders
    assert any("the cost model's" in n for n in selection.notes)
    text = selection.explain()
    assert "choice   the cost model among the regime's 2 contenders" in text and "ranking (predicted ms)" in text


def calibrated_profile(cases: int = 48):
    """Latencies that follow the cost model (1% noise) over three Hopper tiles of Q64K64, except
    that the 64 x 64 tile runs 20% slower than the model's global rate says and a KV-coarsened
    128 x 128 tile (its area estimated from run lengths) is slow, at 1.5x its estimate. The row
    unions (which no schema statistic shows) decide between the other two."""
    request = Request(1, 24, SEQ, SEQ, 128, "bf16", 64, 64, "sm90")
    hopper = [p for p in plans_for(64, 64, all_kernels()) if "hopper" in p.name and p.tasks.num_splits == 1
              and not p.tasks.persistent and p.kernel.stages == 2 and rejection(p, request) is None]
    small = next(p for p in hopper if (p.tile_q, p.tile_kv) == (64, 64))
    tall = next(p for p in hopper if (p.tile_q, p.tile_kv) == (128, 128) and p.kv_layout is KvLayout.PACKED)
    coarse = next(p for p in hopper if (p.tile_q, p.tile_kv) == (128, 128) and p.kv_layout is not KvLayout.PACKED)
    model = cost_model_latency(0.01)

    def latency(plan, request, stats, rng):
        ms = model(plan, request, stats, rng)
        if plan == small:
            return 1.2 * ms
        return 1.5 * ms if plan == coarse else ms

    def unions(rng):  # the 128-row tiles' waste: within the 20% either way
        return {2: rng.uniform(1.0, 1.4)}

    profile = synthetic_profile("sm90", all_kernels(), [small, tall, coarse], [request], latency, cases,
                                groups=4, row_unions=unions)
    return request, small, tall, coarse, profile


def test_a_regime_can_choose_by_the_calibrated_cost_model():
    """Where the cost model's rates are off for one tile (the 64 x 64 one 20% slower than assumed),
    the cost model picks it too often; the calibrated cost model scales each plan's estimate by its
    measured / estimated latency on the profiled cases and picks right, so cross-validation makes it
    the regime's choice. Only plans whose area the model measures are calibrated (not the
    KV-coarsened tile: one scale cannot fix an estimate that is off by 2x on some masks only). The
    artifact keeps the scales; the selector multiplies them in and explains them."""
    from tessera_diffusers.cost_model import estimate_ms
    from tessera_diffusers.profile.compile import bucket_data, fit_calibration

    request, small, tall, coarse, profile = calibrated_profile()
    options = CompileOptions(min_leaf=32)
    table, report = compile_table(profile, options)
    (bucket,) = table.keys[request.key].buckets.values()
    (regime,) = bucket.regimes
    assert regime.choice == "calibrated" and "calibrated (2 plans, scales x" in report.to_markdown()
    scales = dict(regime.calibration)
    assert set(scales) == {small.name, tall.name}
    assert abs(scales[small.name] / scales[tall.name] - 1.2) < 0.02
    data = bucket_data(profile.cases, [STAT_NAMES.index(s) for s in options.features.stats], None, options)
    rows = np.arange(len(profile.cases))
    named = (small.name, tall.name, coarse.name)
    fitted = dict(fit_calibration(data, rows, named, profile.plans, {}))  # the coarsened tile is never calibrated
    assert set(fitted) == {small.name, tall.name} and abs(fitted[small.name] / scales[small.name] - 1) < 1e-6
    data = json.loads(json.dumps(table.to_dict()))
    assert PlanTable.from_dict(data).keys[request.key].buckets[bucket.bucket].regimes[0] == regime

    selector = Selector(table=table, kernels=all_kernels())
    masks = [random_mask(1, 2, SEQ, SEQ, 64, 64, density=0.1, empty_rows=False, seed=2),
             banded_mask(2, SEQ, 64, 64, density=0.1), banded_mask(2, SEQ, 64, 64, density=0.2)]
    chosen = []
    for mask in masks:  # row unions about 1.9, 1.14 and 1.07
        state = build_mask_state(mask)
        selection = selector.selection(request, state)
        stats = state.host_stats() | {"row_union_2": state.row_union_ratios((2,))[2]}
        expected = min((small, tall), key=lambda p: estimate_ms(p, request, stats) * scales[p.name])
        assert selection.source == "plan table + calibrated cost model" and selection.chosen == expected
        assert [name for name, _ in selection.ranking] == sorted(
            scales, key=lambda n: estimate_ms(table.plans[n], request, stats) * scales[n])
        chosen.append((expected, min((small, tall), key=lambda p: estimate_ms(p, request, stats))))
    assert chosen[0] == (small, small) and chosen[1] == (tall, small)  # the scales moved the banded mask
    text = selection.explain()
    low, high = sorted(scales.values())
    assert "choice   the calibrated cost model among 2 plans" in text and f"x{low:.3f} to x{high:.3f})" in text
    assert any("calibrated cost model's" in n for n in selection.notes)


def test_a_schedule_rule_picks_the_task_organization_by_a_statistic():
    """SPLIT4 and DIRECT are one tile in two task organizations; split-K wins on sparse masks only.
    With 40 cases the regime does not split, but its schedule rule moves a sparse mask to SPLIT4 and
    a denser one to DIRECT whenever the regime's choice is of that tile; ``reuse_regime`` keeps the
    previous decision without reading the next mask's statistics."""

    def split_when_sparse(plan, request, stats, rng):
        noise = 1.0 + 0.005 * rng.gauss(0.0, 1.0)
        sparse = stats["density"] < 0.1
        return noise * {SPLIT4.name: 0.95 if sparse else 1.05, DIRECT.name: 1.0, WIDE.name: 1.3}[plan.name]

    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST], split_when_sparse, 40, groups=4)
    table, _ = compile_table(profile, CompileOptions(min_leaf=32))
    (bucket,) = table.keys[REQUEST.key].buckets.values()
    (regime,) = bucket.regimes
    (rule,) = regime.schedules
    assert (rule.below, rule.above) == (SPLIT4.name, DIRECT.name) and regime.fit_regret <= 1.02
    selector = Selector(table=table, kernels=portable_kernels())
    sparse, dense = state_with_density(0.05), state_with_density(0.4)
    assert selector.select(REQUEST, sparse) == SPLIT4 and selector.select(REQUEST, dense) == DIRECT
    explained = selector.rank(REQUEST, dense).explain()
    assert "schedule rule: density" in explained and f"> {rule.threshold:.4g}" in explained
    reuse = Selector(table=table, kernels=portable_kernels(), reuse_regime=True)
    assert reuse.select(REQUEST, sparse) == SPLIT4
    later = state_with_density(0.4, seed=3)
    assert reuse.select(REQUEST, later) == SPLIT4 and "host_stat_values" not in later.__dict__
    reuse.forget_regimes()
    assert reuse.select(REQUEST, later) == DIRECT


def test_explain_cli_names_the_regime_and_its_choice(capsys):
    """``tessera explain`` on a random and on a banded mask (long runs, neighbouring rows alike):
    both name the regime, how it picks its plan, and the plan; the two masks differ in the
    statistics the shipped Q64K64 regimes are told apart by."""
    from tessera_diffusers import cli

    for kind in ("random", "banded"):
        assert cli.main(["explain", "--geometry", "Q64K64", "--seq", "4096", "--heads", "2", "--mask", kind]) == 0
        text = capsys.readouterr().out
        assert "request  sm90/Q64K64" in text and "\nchosen   " in text
        assert "\nchoice   " in text or "source   cost model" in text
    banded = build_mask_state(banded_mask(2, 4096, 64, 64, 0.1)).host_stats()
    scattered = build_mask_state(random_mask(1, 2, 4096, 4096, 64, 64, density=0.1, empty_rows=False)).host_stats()
    assert banded["mean_run_length"] > 3 * scattered["mean_run_length"]
    assert banded["row_overlap"] > scattered["row_overlap"] and abs(banded["density"] - 0.1) < 0.03
