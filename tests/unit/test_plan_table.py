"""The table compiler on synthetic latency matrices with a known structure, and the artifact:
JSON round trip, plain-threshold trees, and a loud refusal of anything corrupt or mismatched."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random

import numpy as np
import pytest

from tessera_diffusers.catalog import plans_for, portable_kernels
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.errors import InvalidArgumentError, PlanTableError
from tessera_diffusers.plan_table import (
    STAT_NAMES,
    Buckets,
    PlanTable,
    body_digest,
    load_plan_table,
    plan_to_dict,
    tile_group,
)
from tessera_diffusers.plans import Request
from tessera_diffusers.profile.compile import CompileOptions, base_plan, compile_table, cv_folds
from tessera_diffusers.profile.synthetic import synthetic_profile

REQUEST = Request(1, 24, 32768, 32768, 128, "bf16", 64, 64, "sm90")
ELIGIBLE = [p for p in plans_for(64, 64, portable_kernels()) if rejection(p, REQUEST) is None]
PLANS = ELIGIBLE[:6]
A, B, C, D = PLANS[0], PLANS[1], PLANS[2], PLANS[3]  # D: a slower plan valid everywhere
THRESHOLD = 0.1


def two_regime_latency(plan, request, stats, rng):
    """A wins below density 0.1, B above; C is near-best but not valid on a fifth of the masks;
    D is valid everywhere and best by geometric mean (the base plan); the rest are slow."""
    noise = 1.0 + 0.01 * rng.gauss(0.0, 1.0)
    low = stats["density"] < THRESHOLD
    if plan == A:
        return (1.0 if low else 1.6) * noise
    if plan == B:
        return (1.6 if low else 1.0) * noise
    if plan == C:
        return None if rng.random() < 0.2 else 1.02 * noise
    if plan == D:
        return 1.10 * noise
    return 2.5 * noise


@pytest.fixture(scope="module")
def two_regimes():
    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST], two_regime_latency, 240, groups=4)
    table, report = compile_table(profile, CompileOptions(min_leaf=32))
    return profile, table, report


def bucket_of(table: PlanTable, request: Request = REQUEST):
    found = table.lookup(request)
    assert found.bucket is not None, found.note
    return found.bucket


def test_compiler_learns_the_density_boundary_and_rankings(two_regimes):
    profile, table, report = two_regimes
    key = table.keys[REQUEST.key]
    assert key.base_plan == D.name == base_plan(profile.cases)
    bucket = bucket_of(table)
    assert bucket.depth >= 1 and len(bucket.regimes) == 2
    root = bucket.tree.nodes[0]
    assert STAT_NAMES[root.stat] == "density" and abs(root.threshold - THRESHOLD) < 0.01
    assert bucket.tree.stats_used == (STAT_NAMES.index("density"),)  # the noise statistics are not used
    stats = [0.0] * len(STAT_NAMES)
    stats[root.stat] = 0.05
    low = bucket.regimes[bucket.tree.regime_of(stats)]
    stats[root.stat] = 0.2
    high = bucket.regimes[bucket.tree.regime_of(stats)]
    assert low.ranking[0].plan == A.name and high.ranking[0].plan == B.name
    for regime in bucket.regimes:
        assert regime.cases >= 32
        assert regime.ranking[-1].plan == D.name  # every ranking ends with the key's base plan
        assert C.name not in [r.plan for r in regime.ranking]  # not valid on all of the regime's cases
        gms = [r.gm_ms for r in regime.ranking]
        assert gms == sorted(gms)
    assert "density" in low.rule and "<=" in low.rule
    (bucket_report,) = report.buckets
    cv = dict(bucket_report.cv)
    assert cv[1] < cv[0] and bucket_report.fit_regret < 1.05


def test_compiler_keeps_one_regime_without_structure():
    def flat(plan, request, stats, rng):
        return (1.0 + 0.1 * PLANS.index(plan)) * (1.0 + 0.01 * rng.gauss(0.0, 1.0))

    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST], flat, 200, groups=5)
    table, _ = compile_table(profile, CompileOptions(min_leaf=32))
    bucket = bucket_of(table)
    assert bucket.depth == 0 and len(bucket.regimes) == 1 and bucket.tree.stats_used == ()
    assert bucket.regimes[0].ranking[0].plan == PLANS[0].name
    assert [r.plan for r in bucket.regimes[0].ranking] == [PLANS[0].name]  # the best is also the base plan


def test_too_few_cases_or_one_group_give_one_regime():
    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST], two_regime_latency, 60, groups=4)
    table, report = compile_table(profile, CompileOptions(min_leaf=32))
    assert len(bucket_of(table).regimes) == 1 and "one regime" in report.buckets[0].note
    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST], two_regime_latency, 200, groups=1)
    table, report = compile_table(profile, CompileOptions(min_leaf=32))
    assert len(bucket_of(table).regimes) == 1 and "one CV group" in report.buckets[0].note


def test_reused_keys_have_their_own_leaf_size():
    """60 cases per key: too few for two leaves of 32, enough for two of 20. Only the /reused key
    (a mask that comes back) uses ``min_leaf_reused``; the natural key keeps one regime."""
    reused = dataclasses.replace(REQUEST, reused_mask=True)
    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST, reused], two_regime_latency, 60, groups=4)
    table, report = compile_table(profile, CompileOptions(min_leaf=32, min_leaf_reused=20))
    assert len(bucket_of(table).regimes) == 1
    split = bucket_of(table, reused)
    assert len(split.regimes) == 2 and STAT_NAMES[split.tree.nodes[0].stat] == "density"
    assert all(regime.cases >= 20 for regime in split.regimes)
    assert table.provenance["min_leaf"] == 32 and table.provenance["min_leaf_reused"] == 20
    notes = {b.key: b.note for b in report.buckets}
    assert "< 2 x 32" in notes[REQUEST.key] and reused.key not in {k for k, n in notes.items() if "one regime" in n}
    table, _ = compile_table(profile, CompileOptions(min_leaf=32, min_leaf_reused=None))
    assert len(bucket_of(table, reused).regimes) == 1 and "min_leaf_reused" not in table.provenance
    # A smaller min_leaf holds for the /reused keys too: min_leaf_reused only ever lowers it.
    assert CompileOptions(min_leaf=8).for_key(reused.key).min_leaf == 8
    assert CompileOptions(min_leaf=32).for_key(reused.key).min_leaf == 20
    assert CompileOptions(min_leaf=32).for_key(REQUEST.key).min_leaf == 32


@pytest.mark.parametrize("options", [{"min_leaf": 0}, {"min_leaf_reused": 0}, {"min_leaf": 2.5}, {"min_leaf_reused": True}])
def test_compile_options_refuse_leaf_sizes_below_one(options):
    with pytest.raises(InvalidArgumentError, match=next(iter(options))):
        CompileOptions(**options)


def test_cv_folds_never_split_a_group():
    groups = np.array([f"s{i % 7}" for i in range(70)])
    folds = cv_folds(groups, 5)
    assert len(folds) == 5
    for train, test in folds:
        assert not set(groups[train]) & set(groups[test])
    assert cv_folds(np.array(["only"] * 10), 5) == []


def test_buckets_split_request_dims():
    buckets = Buckets((8, 32), (4096,))
    assert buckets.of(Request(1, 8, 4096, 4096, 128, "bf16", 64, 64, "sm90")) == (0, 0)
    assert buckets.of(Request(2, 8, 4097, 100, 128, "bf16", 64, 64, "sm90")) == (1, 1)
    assert buckets.of(Request(1, 40, 100, 100, 128, "bf16", 64, 64, "sm90")) == (2, 0)
    assert buckets.label((1, 1)) == "bh9-32/s4097+"


def test_requests_and_buckets_become_separate_tables(two_regimes):
    other = Request(1, 40, 75600, 75600, 128, "bf16", 64, 64, "sm90")
    profile = synthetic_profile("sm90", portable_kernels(), PLANS, [REQUEST, other], two_regime_latency, 80)
    table, report = compile_table(profile, CompileOptions(min_leaf=32))
    key = table.keys[REQUEST.key]
    assert len(key.buckets) == 2 and key.cases == 160
    assert {b.bucket for b in report.buckets} == {"bh17-32/s16385-40960", "bh33-64/s40961-81920"}
    assert table.lookup(Request(1, 4, 1024, 1024, 128, "bf16", 64, 64, "sm90")).bucket is None
    assert table.lookup(Request(1, 24, 32768, 32768, 128, "bf16", 32, 32, "sm90")).key_table is None


def test_artifact_round_trips_as_plain_json(two_regimes, tmp_path):
    _, table, _ = two_regimes
    path = table.save(tmp_path / "plan_table_sm90.json")
    text = path.read_text()
    data = json.loads(text)  # plain JSON: thresholds, names, numbers
    assert data["schema_version"] == 2 and data["table"]["arch"] == "sm90"
    assert "pickle" not in text and "sklearn" not in text
    tree = data["table"]["keys"][REQUEST.key]["buckets"]["2,2"]["tree"]
    assert tree[0]["stat"] == "density" and isinstance(tree[0]["le"], float)
    loaded = load_plan_table(path)
    assert loaded == table
    rng = random.Random(1)
    for _ in range(50):
        stats = [rng.uniform(0, 0.3) for _ in STAT_NAMES]
        assert bucket_of(loaded).tree.regime_of(stats) == bucket_of(table).tree.regime_of(stats)


def resigned(data: dict) -> dict:
    """``data`` with a valid checksum again (to reach the checks behind the checksum)."""
    data["sha256"] = body_digest(data["table"])
    return data


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d: d.update(schema_version=99), "schema version 99"),
        (lambda d: d.update(format="other"), "not a Tessera plan table"),
        (lambda d: d["table"]["keys"][REQUEST.key]["buckets"]["2,2"]["tree"][0].update(le=0.5), "checksum mismatch"),
        (lambda d: resigned(d) if d["table"]["features"].update(stats=["density", "entropy"]) is None else d,
         "does not compute"),
        (lambda d: resigned(d) if d["table"]["keys"][REQUEST.key]["buckets"]["2,2"]["tree"][0].update(left=0) is None
         else d, "must come after"),
        (lambda d: resigned(d) if d["table"]["keys"][REQUEST.key]["buckets"]["2,2"]["regimes"][0]["ranking"].pop()
         else d, "base plan"),
        (lambda d: resigned(d) if d["table"]["catalog"].update(hash="0" * 16) is None else d,
         "does not match its own kernel list"),
        (lambda d: resigned(d) if d["table"]["plans"][A.name]["kernel"].update(stages=7) is None else d,
         "plan naming changed"),
    ],
    ids=["version", "format", "edited", "stat", "cycle", "no-base", "catalog", "plan-name"],
)
def test_loader_refuses_corrupt_artifacts(two_regimes, tmp_path, corrupt, message):
    _, table, _ = two_regimes
    data = copy.deepcopy(table.to_dict())
    corrupt(data)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanTableError, match=message):
        load_plan_table(path)


def test_loader_refuses_non_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"format": "tessera-plan-table", ')
    with pytest.raises(PlanTableError, match="not JSON"):
        load_plan_table(path)


def test_catalog_mismatch_is_explained(two_regimes):
    _, table, _ = two_regimes
    assert table.catalog_mismatch(portable_kernels()) is None
    why = table.catalog_mismatch(portable_kernels()[:-1])
    assert why is not None and "re-profile" in why and str(len(portable_kernels()) - 1) in why


def test_geometric_mean_ranks_valid_plans_only(two_regimes):
    profile, table, _ = two_regimes
    regime = bucket_of(table).regimes[0]
    names = [r.plan for r in regime.ranking]
    cases = [c for c in profile.cases
             if bucket_of(table).tree.regime_of(c.stats) == 0]
    for name, ranked in zip(names, regime.ranking):
        gm = math.exp(sum(math.log(c.latencies[name]) for c in cases) / len(cases))
        assert ranked.gm_ms == pytest.approx(gm)


# -- schedule rules ------------------------------------------------------------------------------

LPT = next(p for p in PLANS if p.tasks.name == "lpt")
PERSISTENT = next(p for p in PLANS if p.tasks.name == "lpt-persistent" and tile_group(p) == tile_group(LPT))
OTHER_TILE = next(p for p in ELIGIBLE if tile_group(p) != tile_group(LPT))
DEEPER = next(p for p in ELIGIBLE if p.tasks == LPT.tasks and p.kernel.stages != LPT.kernel.stages
              and tile_group(p) == tile_group(LPT))


def test_pipeline_depth_is_part_of_the_task_organization():
    """DESIGN section 4: the pipeline depth belongs to the task organization, so the 2- and 3-stage
    builds of one tile are one tile group; another tile shape (or mapping) is another group."""
    assert DEEPER.kernel != LPT.kernel and tile_group(DEEPER) == tile_group(LPT)
    other, mine = OTHER_TILE, LPT
    assert (other.kernel.tile_q, other.kernel.tile_kv, other.kv_layout) != (mine.kernel.tile_q, mine.kernel.tile_kv,
                                                                             mine.kv_layout)


def persistent_when_sparse(gain: float):
    """One tile in two task organizations: the persistent grid ``gain`` faster below density 0.1 and
    as much slower above; another tile 30% slower everywhere (so one regime ranks LPT first)."""

    def latency(plan, request, stats, rng):
        noise = 1.0 + 0.005 * rng.gauss(0.0, 1.0)
        if plan == PERSISTENT:
            return (1.0 - gain if stats["density"] < THRESHOLD else 1.0 + gain) * noise
        return (1.0 if plan == LPT else 1.3) * noise

    return latency


def schedule_table(gain: float, cases: int = 48):
    plans = [LPT, PERSISTENT, OTHER_TILE]
    profile = synthetic_profile("sm90", portable_kernels(), plans, [REQUEST], persistent_when_sparse(gain), cases,
                                groups=4)
    return compile_table(profile, CompileOptions(min_leaf=32))


def test_compiler_learns_a_schedule_rule_within_a_tile_group():
    """Too few cases for a second regime, but the persistent grid wins on sparse masks only: the
    regime keeps one ranking and gains a rule that picks the organization by density."""
    table, report = schedule_table(0.06)
    (regime,) = bucket_of(table).regimes
    (rule,) = regime.schedules
    assert STAT_NAMES[rule.stat] == "density" and abs(rule.threshold - THRESHOLD) < 0.02
    assert (rule.below, rule.above) == (PERSISTENT.name, LPT.name) and sum(rule.cases) == 48
    stats = [0.0] * len(STAT_NAMES)
    stats[rule.stat] = 0.05
    assert rule.choose(stats) == PERSISTENT.name and "<=" in rule.describe(stats)
    stats[rule.stat] = 0.2
    assert rule.choose(stats) == LPT.name
    assert "lpt-persistent 2-stage if density <=" in report.to_markdown()
    # The artifact round-trips the rule; a table without rules keeps its old format (no field).
    loaded = PlanTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert bucket_of(loaded).regimes[0].schedules == regime.schedules


def test_compiler_learns_the_pipeline_depth_by_a_statistic():
    """The 3-stage build of the tile wins on long runs only: the rule picks the stages."""

    def deeper_on_long_runs(plan, request, stats, rng):
        noise = 1.0 + 0.005 * rng.gauss(0.0, 1.0)
        if plan == DEEPER:
            return (0.94 if stats["mean_run_length"] > 4.5 else 1.06) * noise
        return (1.0 if plan == LPT else 1.3) * noise

    profile = synthetic_profile("sm90", portable_kernels(), [LPT, DEEPER, OTHER_TILE], [REQUEST],
                                deeper_on_long_runs, 48, groups=4)
    table, report = compile_table(profile, CompileOptions(min_leaf=32))
    (rule,) = bucket_of(table).regimes[0].schedules
    assert STAT_NAMES[rule.stat] == "mean_run_length" and abs(rule.threshold - 4.5) < 0.5
    assert (rule.below, rule.above) == (LPT.name, DEEPER.name)
    assert f"lpt {LPT.kernel.stages}-stage if mean_run_length <=" in report.to_markdown()
    assert bucket_of(PlanTable.from_dict(json.loads(json.dumps(table.to_dict())))).regimes[0].schedules == (rule,)


def other_tile_on_overlapping_rows(plan, request, stats, rng):
    """Another tile 10% faster where neighbouring rows overlap (row_overlap > 0.5), 20% slower
    elsewhere: which tile wins depends on one statistic."""
    noise = 1.0 + 0.005 * rng.gauss(0.0, 1.0)
    if plan == OTHER_TILE:
        return (0.9 if stats["row_overlap"] > 0.5 else 1.2) * noise
    return (1.0 if plan == LPT else 1.3) * noise


@pytest.fixture(scope="module")
def plan_rule_table():
    profile = synthetic_profile("sm90", portable_kernels(), [LPT, PERSISTENT, OTHER_TILE], [REQUEST],
                                other_tile_on_overlapping_rows, 48, groups=4)
    return compile_table(profile, CompileOptions(min_leaf=32))


def test_compiler_gives_a_regime_a_plan_rule_between_tiles(plan_rule_table):
    """48 cases (one regime) whose best tile depends on row_overlap: the ranking's first plan loses
    on half of them, a plan rule between the two tiles does not, so cross-validation makes it the
    regime's choice. The artifact keeps it; a table without the field is refused."""
    table, report = plan_rule_table
    (regime,) = bucket_of(table).regimes
    assert regime.choice == "plan_rule" and regime.fit_regret > 1.02
    rule = regime.plan_rule
    assert STAT_NAMES[rule.stat] == "row_overlap" and abs(rule.threshold - 0.5) < 0.05
    assert (rule.below, rule.above) == (LPT.name, OTHER_TILE.name) and tile_group(LPT) != tile_group(OTHER_TILE)
    assert f"plan rule ({LPT.name} if row_overlap <=" in report.to_markdown()
    data = json.loads(json.dumps(table.to_dict()))
    assert bucket_of(PlanTable.from_dict(data)).regimes[0] == regime
    (bucket,) = data["table"]["keys"][REQUEST.key]["buckets"].values()
    del bucket["regimes"][0]["choice"], bucket["regimes"][0]["plan_rule"]
    with pytest.raises(PlanTableError, match="choice"):  # every field is required: nothing is derived
        PlanTable.from_dict(resigned(data))


def test_a_regime_keeps_its_ranking_when_its_cases_agree():
    (regime,) = bucket_of(schedule_table(0.06)[0]).regimes
    assert regime.choice == "ranking" and regime.plan_rule is None and regime.ranking[0].plan == LPT.name


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda regime: regime.update(choice="fastest"), "choice 'fastest' is not one of"),
        (lambda regime: regime.pop("plan_rule"), "goes with choice 'plan_rule' and only with it"),
        (lambda regime: regime.update(choice="ranking"), "goes with choice 'plan_rule' and only with it"),
        (lambda regime: regime["plan_rule"].update(above="direct_nothing"), "plan rule: names unknown plan"),
        (lambda regime: regime["plan_rule"].update(le="inf"), "plan rule: has threshold inf"),
    ],
    ids=["choice", "no-rule", "rule-unchosen", "unknown", "threshold"],
)
def test_loader_refuses_bad_choices(plan_rule_table, edit, message):
    data = copy.deepcopy(plan_rule_table[0].to_dict())
    (bucket,) = data["table"]["keys"][REQUEST.key]["buckets"].values()
    edit(bucket["regimes"][0])
    with pytest.raises(PlanTableError, match=message):
        PlanTable.from_dict(resigned(data))


def as_calibrated(regime: dict) -> None:
    """The plan-rule regime turned into a calibrated one (valid as it stands)."""
    del regime["plan_rule"]
    regime.update(choice="calibrated", calibration=[[LPT.name, 1.0], [OTHER_TILE.name, 1.1]])


def test_a_calibrated_regime_loads(plan_rule_table):
    data = copy.deepcopy(plan_rule_table[0].to_dict())
    (bucket,) = data["table"]["keys"][REQUEST.key]["buckets"].values()
    as_calibrated(bucket["regimes"][0])
    (regime,) = bucket_of(PlanTable.from_dict(resigned(data))).regimes
    assert regime.choice == "calibrated" and regime.calibration == ((LPT.name, 1.0), (OTHER_TILE.name, 1.1))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda regime: regime.update(choice="ranking"), "a calibration goes with choice 'calibrated' and only with it"),
        (lambda regime: regime.update(calibration=[]), "a calibration goes with choice 'calibrated' and only with it"),
        (lambda regime: regime["calibration"][1].__setitem__(0, "direct_nothing"),
         "calibration names unknown plan 'direct_nothing'"),
        (lambda regime: regime["calibration"][1].__setitem__(1, 0.0), "scale 0.0 of .* is not a positive number"),
        (lambda regime: regime["calibration"][1].__setitem__(1, "nan"), "scale 'nan' of .* is not a positive number"),
        (lambda regime: regime["calibration"][1].__setitem__(1, True), "scale True of .* is not a positive number"),
        (lambda regime: regime["calibration"][1].__setitem__(0, LPT.name), f"calibration names {LPT.name} twice"),
        (lambda regime: regime["calibration"].append([LPT.name]), r"is not a \[plan, scale\] pair"),
        (lambda regime: regime.update(calibration={LPT.name: 1.0}), "is not a list of"),
        (lambda regime: regime["calibration"][1].__setitem__(0, [LPT.name]), "calibration names unknown plan"),
    ],
    ids=["unchosen", "empty", "unknown", "zero", "nan", "bool", "twice", "pair", "not-list", "unhashable"],
)
def test_loader_refuses_bad_calibrations(plan_rule_table, edit, message):
    data = copy.deepcopy(plan_rule_table[0].to_dict())
    (bucket,) = data["table"]["keys"][REQUEST.key]["buckets"].values()
    as_calibrated(bucket["regimes"][0])
    edit(bucket["regimes"][0])
    with pytest.raises(PlanTableError, match=message):
        PlanTable.from_dict(resigned(data))


def test_schedule_rule_is_fitted_where_its_tile_contends():
    """A regime whose cases disagree on the tile: the other tile is 30% faster where row_overlap >
    0.5. Where this tile contends the persistent grid wins on short runs, elsewhere on long ones (an
    XOR of two statistics): over all 160 cases (one regime: 100 a leaf) no one threshold
    generalizes; over the cases where the tile contends one does."""

    def latency(plan, request, stats, rng):
        noise = 1.0 + 0.005 * rng.gauss(0.0, 1.0)
        contends = stats["row_overlap"] <= 0.5
        if plan == OTHER_TILE:
            return (1.3 if contends else 0.7) * noise
        if plan == PERSISTENT:
            short = stats["mean_run_length"] <= 4.5
            return (0.94 if short == contends else 1.06) * noise
        return noise

    profile = synthetic_profile("sm90", portable_kernels(), [LPT, PERSISTENT, OTHER_TILE], [REQUEST], latency,
                                160, groups=4)
    table, _ = compile_table(profile, CompileOptions(min_leaf=100))
    (regime,) = bucket_of(table).regimes
    assert regime.fit_regret > 1.02 and LPT.name in regime.contenders
    (rule,) = regime.schedules
    contending = sum(1 for c in profile.cases if c.stats[STAT_NAMES.index("row_overlap")] <= 0.5)
    assert STAT_NAMES[rule.stat] == "mean_run_length" and abs(rule.threshold - 4.5) < 0.5
    assert (rule.below, rule.above) == (PERSISTENT.name, LPT.name) and sum(rule.cases) == contending < 160


def test_no_schedule_rule_without_a_statistic_that_decides():
    """A 0.1% density effect inside 0.5% noise, or a persistent grid 1% slower everywhere: no rule."""
    inside_noise, _ = schedule_table(0.001)

    def always_slower(plan, request, stats, rng):
        return {PERSISTENT: 1.01, LPT: 1.0}.get(plan, 1.3) * (1.0 + 0.005 * rng.gauss(0.0, 1.0))

    profile = synthetic_profile("sm90", portable_kernels(), [LPT, PERSISTENT, OTHER_TILE], [REQUEST], always_slower,
                                48, groups=4)
    uniform, _ = compile_table(profile, CompileOptions(min_leaf=32))
    for table in (inside_noise, uniform):
        (regime,) = bucket_of(table).regimes
        assert regime.schedules == () and '"schedules": []' in json.dumps(table.to_dict())


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda rule: rule.update(above=OTHER_TILE.name), "not one tile group"),
        (lambda rule: rule.update(above=rule["below"]), "on both sides"),
        (lambda rule: rule.update(below="direct_nothing"), "unknown plan"),
        (lambda rule: rule.update(stat="entropy"), "not in the feature schema"),
        (lambda rule: rule.update(cases=[0, 48]), "two positive counts"),
    ],
    ids=["tile-group", "same", "unknown", "stat", "cases"],
)
def test_loader_refuses_bad_schedule_rules(edit, message):
    table, _ = schedule_table(0.06)
    data = copy.deepcopy(table.to_dict())
    data["table"]["plans"][OTHER_TILE.name] = data["table"]["plans"].get(OTHER_TILE.name) or plan_to_dict(OTHER_TILE)
    (bucket,) = data["table"]["keys"][REQUEST.key]["buckets"].values()
    edit(bucket["regimes"][0]["schedules"][0])
    with pytest.raises(PlanTableError, match=message):
        PlanTable.from_dict(resigned(data))
