"""The table compiler: measured latencies ``L[case, plan]`` -> a ``PlanTable`` (DESIGN section 6).

Per request key (arch, geometry, head dim, dtype, layout):

1. The *base plan*: of the plans valid (validated and timed) on every profiled case of the key, the
   one with the lowest geometric-mean latency. It ends every ranking of the key.
2. Per bucket of request dims (batch x heads, sequence length): a regression tree over the mask
   statistics (scikit-learn ``DecisionTreeRegressor``, ``min_samples_leaf`` cases per leaf) whose
   targets are each contending plan's log regret on the case (latency over the case's fastest,
   clipped), so that leaves group cases on which the same plans win. Its depth (0 = one regime) is
   chosen by cross-validation with ``GroupKFold`` over the cases' groups (the corpus source: masks
   of one source never sit on both sides of a fold), scoring the held-out regret of the plan the
   candidate table would choose. Sibling leaves that rank the same plans are merged.
3. Each leaf (a regime) ranks the plans valid on all its cases by geometric-mean latency, at most
   ``ranking_length`` of them, and ends with the base plan.
4. Schedule rules: for each tile group the regime may choose (its first plan and its contenders),
   the task organizations of that group valid on all the regime's cases compete. One threshold on
   one statistic, with at least ``schedule_min_side`` cases on each side, picks the organization of
   least regret on each side; the rule is kept only when leave-groups-out cross-validation puts its
   held-out regret below that of the best single organization by more than ``schedule_margin``.
   Whether a persistent grid beats one CTA per task depends on how long the tasks are (the Hopper
   64 x 64 tile on Q64K64: persistent below about 7% density, one CTA per task above), a binary
   choice within one tile that a whole-ranking tree with 32 cases per leaf cannot see. When no rule
   over all the regime's cases generalizes, the rule is fitted again on the cases where the group
   contends (its best organization within ``CONTENDER_REGRET`` of the case's best): in a mixed
   regime those are the cases on which the cost model hands the group the request, and a 64 x 64
   tile's organization need not be learned from the dense masks a 128 x 128 tile serves.
5. The regime's *choice* of the plan those rules start from: its ranking's first plan, the cost
   model's pick among its contenders (it reads what no schema statistic shows, such as the row-union
   ratios), the *calibrated* cost model's (each contender whose computed area the model measures,
   ``cost_model.area_is_measured``, with its estimate times a per-plan scale: the geometric mean of
   measured over estimated latency on the training cases; the roofline's tile rates are global
   constants, and how fast a tile shape really runs on one geometry is what the profile knows), or a
   *plan rule* (the same form as a schedule rule, between any two plans: another tile too).
   Leave-groups-out cross-validation over the regime's cases rebuilds each way on the training cases
   and judges it, schedule rules applied, on the held-out ones; the ranking stays unless another way
   lowers the held-out regret by more than ``choice_margin``. Before this step (2026-11-30) the
   selector handed a regime to the cost model whenever its first plan lost more than 2% (GM) on its
   cases; on the interleaved H200 profile that was right for Q32K32 and Q64K32 and wrong for Q32K16.

The tree is exported as plain thresholds (``plan_table.TreeNode``); nothing is pickled.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType

import numpy as np

from ..catalog import catalog_hash
from ..cost_model import PlanEstimator, area_is_measured
from ..errors import PlanTableError
from ..mask_state import NUM_STATS
from ..plan_table import (
    CONTENDER_REGRET,
    STAT_NAMES,
    Buckets,
    BucketTable,
    FeatureSchema,
    KeyTable,
    PlanTable,
    RankedPlan,
    Regime,
    RegimeTree,
    ScheduleRule,
    TreeNode,
    kernel_from_dict,
    plan_from_dict,
    tile_group,
)
from ..plans import REUSED_KEY_SUFFIX, KernelSpec, PhysicalPlan, QLayout, Request
from ..validation import check_positive_int
from .records import read_records, request_from_dict, timing_method

# Regret charged in cross-validation when no ranked plan is valid on a held-out case.
MISSING_REGRET = 2.0


@dataclass(frozen=True)
class ProfiledCase:
    """One profiled mask: its request, statistics, CV group and the latency of every valid plan."""

    name: str
    request: Request
    stats: tuple[float, ...]  # [NUM_STATS], indexed by Stat
    group: str  # cross-validation group (the corpus source)
    latencies: Mapping[str, float]  # plan name -> median kernel ms, valid plans only
    # MaskState.row_union_ratios the profiler kept ({block rows: ratio}), what the cost model reads
    # online; empty for records without them (the cost model then estimates them from row_overlap).
    row_unions: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Profile:
    """Complete profiled cases of one architecture and one catalog, with the plans they name."""

    arch: str
    catalog_hash: str
    kernels: tuple[KernelSpec, ...]
    cases: tuple[ProfiledCase, ...]
    plans: Mapping[str, PhysicalPlan]
    notes: tuple[str, ...] = ()
    kernel_sources: tuple[str, ...] = ()  # the profiled libraries' source hashes (older records: none)
    grouping_sources: tuple[str, ...] = ()  # their grouping kernels', of the files whose cases timed grouped plans


def catalog_sources(record: Mapping) -> tuple[str | None, str | None]:
    """The (attention kernels, grouping kernel) source hashes of a catalog record; None where the
    record has none."""
    return (record.get("kernel_sources") or None, record.get("grouping_sources") or None)


@dataclass(frozen=True)
class CompileOptions:
    features: FeatureSchema = field(default_factory=FeatureSchema)
    min_leaf: int = 32  # cases per leaf (regime) at least
    # The same for the ``/reused`` keys (masks that come back), whose profiles hold fewer cases per
    # key: at 32 a key of fewer than 64 cases cannot split at all (docs/results.md, "Design
    # decisions"). None: ``min_leaf``; never above it.
    min_leaf_reused: int | None = 20
    max_depth: int = 4
    folds: int = 5
    ranking_length: int = 8  # plans per regime before the base plan
    contender_regret: float = 1.10  # tree targets: plans within this of the best on some case
    target_clip: float = 1.5  # tree targets: regrets clipped here (2x and 3x slower are equally out)
    tie_tolerance: float = 0.001  # a deeper tree must lower the CV log-GM regret by more than this
    schedule_min_side: int = 8  # schedule rules: profiled cases on each side of the threshold at least
    schedule_margin: float = 0.005  # a schedule rule must lower the held-out GM regret by more than this
    # A regime's choice other than its ranking (cost model, plan rule) must lower the held-out GM
    # regret by more than this.
    choice_margin: float = 0.002
    choice_min_cases: int = 16  # fewer profiled cases in a regime: its ranking, nothing else is judged

    def __post_init__(self) -> None:
        check_positive_int("min_leaf", self.min_leaf)
        if self.min_leaf_reused is not None:
            check_positive_int("min_leaf_reused", self.min_leaf_reused)

    def for_key(self, key: str) -> CompileOptions:
        """The options of one request key: for a ``/reused`` key, ``min_leaf`` lowered to
        ``min_leaf_reused`` (never raised: a smaller ``min_leaf`` holds for every key)."""
        if self.min_leaf_reused is None or not key.endswith(REUSED_KEY_SUFFIX) or self.min_leaf_reused >= self.min_leaf:
            return self
        return replace(self, min_leaf=self.min_leaf_reused)


@dataclass(frozen=True)
class BucketReport:
    key: str
    bucket: str
    cases: int
    groups: int
    depth: int
    regimes: int
    cv: tuple[tuple[int, float], ...]  # (depth, GM regret of the held-out cases)
    fit_regret: float  # GM regret of the final table on its own cases
    note: str = ""
    schedules: tuple[str, ...] = ()  # the schedule rules kept, described
    choices: tuple[str, ...] = ()  # each regime's choice and the held-out regret of every candidate


@dataclass(frozen=True)
class CompileReport:
    arch: str
    catalog_hash: str
    cases: int
    buckets: tuple[BucketReport, ...]
    warnings: tuple[str, ...] = ()

    def to_markdown(self) -> str:
        catalog = self.catalog_hash
        if catalog == catalog_hash(()):  # a CPU profile: the hash of no kernels would read like a catalog's
            catalog += ": no native kernels, the PyTorch executor's plans"
        lines = [f"# Plan table {self.arch} (catalog {catalog}), {self.cases} profiled cases", "",
                 "| key | bucket | cases | groups | depth | regimes | CV GM regret by depth | fit GM regret | note |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for b in self.buckets:
            cv = ", ".join(f"{d}: {r:.4f}" for d, r in b.cv) or "-"
            lines.append(f"| {b.key} | {b.bucket} | {b.cases} | {b.groups} | {b.depth} | {b.regimes} | {cv} | "
                         f"{b.fit_regret:.4f} | {b.note} |")
        choices = [f"- {b.key} {b.bucket}: {choice}" for b in self.buckets for choice in b.choices]
        if choices:
            title = ("How each regime picks its plan (held-out GM regret of each way, one corpus source per fold, "
                     "schedule rules included):")
            lines += ["", title, ""] + choices
        rules = [f"- {b.key} {b.bucket}: {rule}" for b in self.buckets for rule in b.schedules]
        if rules:
            lines += ["", "Schedule rules (task organization of one tile group by one statistic):", ""] + rules
        if self.warnings:
            lines += ["", "Warnings:", ""] + [f"- {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"


# -- loading the profiler's records --------------------------------------------------------------

def load_profile(paths: Iterable[str | Path], arch: str | None = None) -> Profile:
    """Complete cases of the records files (``records.py``) for one architecture. Raises
    ``PlanTableError`` when there is nothing to compile or the architecture is ambiguous.

    A request key whose cases of one size bucket appear in several files takes them from the last
    of those files only: a re-profile supersedes the earlier profile of that key and bucket, whole.
    Times of different runs (another session's clocks, another library's kernels) do not compare,
    so one bucket's ranking is never learned from a mix of them; buckets a later file does not
    profile keep their earlier cases.
    Within one file (a run and its resumptions) a case's last record wins."""
    paths = list(paths)
    skipped: list = []
    held_out = 0
    catalogs: dict[str, tuple[KernelSpec, ...]] = {}
    # kernel_sources / grouping_sources hashes per (file, catalog hash): only files that keep a case count
    sources: dict[tuple[int, str], set[str]] = defaultdict(set)
    grouping: dict[tuple[int, str], set[str]] = defaultdict(set)
    case_records: dict[tuple[int, str], dict] = {}
    latencies: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    case_methods: dict[tuple[int, str], Counter] = defaultdict(Counter)  # timing methods of a case's plans
    specs: dict[str, dict] = {}
    for index, path in enumerate(paths):
        for record in read_records([path], skipped):
            kind = record.get("type")
            if kind == "catalog":
                catalogs[record["catalog_hash"]] = tuple(kernel_from_dict(k) for k in record["kernels"])
                attention, grouping_kernel = catalog_sources(record)
                if attention:
                    sources[index, record["catalog_hash"]].add(attention)
                if grouping_kernel:
                    grouping[index, record["catalog_hash"]].add(grouping_kernel)
            elif kind == "case":
                if record.get("split", "profiling") != "profiling":
                    held_out += 1  # evaluation-split cases judge tables; they never train one
                    continue
                case_records[index, record["case"]] = record
            elif kind == "plan":
                if "spec" in record:
                    specs.setdefault(record["plan"], record["spec"])
                if record.get("status") == "ok":
                    latencies[index, record["case"]][record["plan"]] = float(record["latency_ms"])
                    case_methods[index, record["case"]][timing_method(record)] += 1
    case_records, superseded = latest_profile_per_key(case_records, [Path(p) for p in paths])
    methods: Counter = sum((case_methods[at] for at in case_records), Counter())
    if not case_records:
        why = f" ({held_out} evaluation-split cases are never compiled)" if held_out else ""
        raise PlanTableError(f"no complete profiled case in the records (run `tessera profile` first){why}")
    archs = Counter(r["arch"] for r in case_records.values())
    if arch is None:
        if len(archs) > 1:
            raise PlanTableError(f"records hold several architectures {dict(archs)}: choose one (--arch)")
        arch = next(iter(archs))
    mine = {at: r for at, r in case_records.items() if r["arch"] == arch}
    if not mine:
        raise PlanTableError(f"no profiled case of architecture {arch} (records have {dict(archs)})")
    hashes = Counter(r["catalog_hash"] for r in mine.values())
    chosen_hash, _ = hashes.most_common(1)[0]
    notes = list(superseded)
    if len(hashes) > 1:
        notes.append(f"ignored {len(mine) - hashes[chosen_hash]} cases profiled against other catalogs "
                     f"({sorted(set(hashes) - {chosen_hash})})")
    if chosen_hash not in catalogs:
        raise PlanTableError(f"records lack the catalog record of hash {chosen_hash}")
    cases = []
    profiled_sources: set[str] = set()  # of the files whose cases are kept
    grouped_files: set[int] = set()  # of those, the files whose kept cases timed a grouped plan
    grouped_plans = {name for name, spec in specs.items() if spec.get("q_layout") == QLayout.GROUPED.value}
    for at, record in mine.items():
        if record["catalog_hash"] != chosen_hash:
            continue
        stats = record["stats"]
        missing = [s for s in STAT_NAMES if s not in stats]
        if missing:
            notes.append(f"case {record['case']} lacks statistics {missing}; skipped")
            continue
        unions = {int(rows): float(ratio) for rows, ratio in (record.get("row_unions") or {}).items()}
        cases.append(ProfiledCase(record["case"], request_from_dict(record["request"]),
                                  tuple(float(stats[s]) for s in STAT_NAMES), str(record["group"]),
                                  MappingProxyType(dict(latencies.get(at, {}))), MappingProxyType(unions)))
        profiled_sources |= sources.get((at[0], chosen_hash), set())
        if grouped_plans.intersection(latencies.get(at, ())):
            grouped_files.add(at[0])
    if skipped:
        notes.append(f"skipped {len(skipped)} unreadable record line(s)")
    if len(methods) > 1:
        notes.append(f"the records mix timing methods ({dict(methods)} timed plans): their times are not comparable "
                     "(records.timing_method), so rankings across them are not either; compile records of one method")
    if held_out:
        notes.append(f"left out {held_out} evaluation-split cases")
    named = {name for c in cases for name in c.latencies}
    unknown = sorted(named - set(specs))
    if unknown:
        raise PlanTableError(f"records lack the spec of plans {unknown[:3]} (a records file cut at its start?)")
    plans = {name: plan_from_dict(specs[name]) for name in sorted(named)}
    if len(profiled_sources) > 1:
        notes.append(f"the records were profiled on kernels built from {len(profiled_sources)} different "
                     f"sources ({', '.join(sorted(profiled_sources))}): their times may not compare")
    grouping_sources = set().union(*(grouping.get((index, chosen_hash), set()) for index in grouped_files))
    return Profile(arch, chosen_hash, catalogs[chosen_hash], tuple(cases), MappingProxyType(plans), tuple(notes),
                   tuple(sorted(profiled_sources)), tuple(sorted(grouping_sources)))


def latest_profile_per_key(case_records: Mapping[tuple[int, str], dict], paths: Sequence[Path],
                           buckets: Buckets | None = None) -> tuple[dict[tuple[int, str], dict], list[str]]:
    """Of the case records by (file index, case name), those from each (request key, size bucket)'s
    last file, and a note per key and bucket whose cases in earlier files were set aside
    (``load_profile``). ``buckets``: the tables' size buckets (default ``Buckets()``)."""
    buckets = buckets or Buckets()
    keys = {}
    for at, record in case_records.items():
        request = request_from_dict(record["request"])
        keys[at] = (request.key, buckets.label(buckets.of(request)))
    last: dict[tuple[str, str], int] = {}
    for (index, _), key in keys.items():
        last[key] = max(index, last.get(key, -1))
    kept = {at: record for at, record in case_records.items() if at[0] == last[keys[at]]}
    dropped: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for at, key in keys.items():
        if at not in kept:
            dropped[key][at[0]] += 1

    def named(index: int) -> str:
        return "/".join(paths[index].parts[-2:])

    notes = []
    for key, files in sorted(dropped.items()):
        later = sum(1 for at in kept if keys[at] == key)
        earlier = ", ".join(f"{n} cases of {named(i)}" for i, n in sorted(files.items()))
        notes.append(f"{key[0]} {key[1]}: its {later} cases of {named(last[key])} supersede the earlier profile "
                     f"({earlier})")
    return kept, notes


# -- the compiler --------------------------------------------------------------------------------

def compile_table(profile: Profile, options: CompileOptions = CompileOptions(),
                  provenance: Mapping | None = None) -> tuple[PlanTable, CompileReport]:
    """Build the plan table of ``profile`` (see the module docstring)."""
    schema = options.features
    columns = [STAT_NAMES.index(s) for s in schema.stats]
    warnings: list[str] = list(profile.notes)
    by_key: dict[str, list[ProfiledCase]] = defaultdict(list)
    for case in profile.cases:
        if not case.request.key.startswith(f"{profile.arch}/"):
            raise PlanTableError(f"case {case.name} has key {case.request.key}, not of architecture {profile.arch}")
        by_key[case.request.key].append(case)
    keys: dict[str, KeyTable] = {}
    reports: list[BucketReport] = []
    used: set[str] = set()
    for key, key_cases in sorted(by_key.items()):
        base = base_plan(key_cases)
        if base is None:
            warnings.append(f"{key}: no plan is valid on all {len(key_cases)} cases; the key gets no base plan")
        by_bucket: dict[tuple[int, int], list[ProfiledCase]] = defaultdict(list)
        for case in key_cases:
            by_bucket[schema.buckets.of(case.request)].append(case)
        buckets = {}
        for bucket, cases in sorted(by_bucket.items()):
            label = schema.buckets.label(bucket)
            fitted = fit_bucket(key, bucket, label, cases, columns, base, options.for_key(key), profile.plans)
            if isinstance(fitted, str):
                warnings.append(f"{key} {label}: {fitted}")
                continue
            table, report = fitted
            buckets[bucket] = table
            reports.append(report)
            used.update(rp.plan for regime in table.regimes for rp in regime.ranking)
            used.update(name for regime in table.regimes for name in regime.contenders)
            used.update(name for regime in table.regimes for rule in regime.schedules
                        for name in (rule.below, rule.above))
        if base is not None:
            used.add(base)
        keys[key] = KeyTable(key, base, len(key_cases), MappingProxyType(buckets))
    info = {
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cases": len(profile.cases),
        "min_leaf": options.min_leaf,
        **({"min_leaf_reused": options.min_leaf_reused} if options.min_leaf_reused is not None else {}),
        "max_depth": options.max_depth,
        "folds": options.folds,
        **({"kernel_sources": list(profile.kernel_sources)} if profile.kernel_sources else {}),
        **({"grouping_sources": list(profile.grouping_sources)} if profile.grouping_sources else {}),
        **(provenance or {}),
    }
    table = PlanTable(profile.arch, profile.catalog_hash, profile.kernels, schema,
                      MappingProxyType({name: profile.plans[name] for name in sorted(used)}),
                      MappingProxyType(keys), MappingProxyType(info))
    return table, CompileReport(profile.arch, profile.catalog_hash, len(profile.cases), tuple(reports),
                                tuple(warnings))


def base_plan(cases: Sequence[ProfiledCase]) -> str | None:
    """The plan valid on every case with the lowest geometric-mean latency (ties: by name)."""
    common = set(cases[0].latencies)
    for case in cases[1:]:
        common &= set(case.latencies)
    if not common:
        return None
    return min(sorted(common), key=lambda p: sum(math.log(c.latencies[p]) for c in cases))


@dataclass
class BucketData:
    """The arrays of one bucket: statistics, latencies and the tree's regression targets."""

    x: np.ndarray  # [n, F] float64, the schema's statistics
    lat: np.ndarray  # [n, P] float64 ms, nan where the plan is not valid on the case
    names: list[str]  # P plan names
    target: np.ndarray  # [n, C] log regret of the contending plans, clipped
    groups: np.ndarray  # [n] group labels
    base: str | None
    options: CompileOptions
    cases: Sequence[ProfiledCase] = ()  # row order: their full statistics, row unions and requests
    rankings: dict = field(default_factory=dict)  # bytes of the sorted rows -> ranking (memo)
    column: dict = field(default_factory=dict)  # plan name -> column of lat

    def __post_init__(self) -> None:
        self.column = {name: c for c, name in enumerate(self.names)}

    def ranking(self, rows: np.ndarray) -> tuple[RankedPlan, ...]:
        """Plans valid on all ``rows`` by geometric-mean latency, ending with the base plan."""
        memo_key = rows.tobytes()
        if memo_key in self.rankings:
            return self.rankings[memo_key]
        sub = self.lat[rows]
        valid = ~np.isnan(sub).any(axis=0)
        gms = np.full(len(self.names), np.inf)
        gms[valid] = np.exp(np.log(sub[:, valid]).mean(axis=0))
        order = sorted(np.flatnonzero(valid), key=lambda c: (gms[c], self.names[c]))
        ranking = []
        for c in order:
            ranking.append(RankedPlan(self.names[c], float(gms[c])))
            if self.names[c] == self.base or len(ranking) >= self.options.ranking_length:
                break
        if self.base is not None and (not ranking or ranking[-1].plan != self.base):
            c = self.column[self.base]
            ranking.append(RankedPlan(self.base, float(gms[c]) if valid[c] else None))
        self.rankings[memo_key] = tuple(ranking)
        return self.rankings[memo_key]

    def contenders(self, rows: np.ndarray) -> tuple[str, ...]:
        """Plans within ``CONTENDER_REGRET`` of the best on one of ``rows``, valid on all of them,
        by geometric-mean latency over ``rows``."""
        sub = self.lat[rows]
        valid = ~np.isnan(sub).any(axis=0)
        close = (sub <= CONTENDER_REGRET * np.nanmin(sub, axis=1, keepdims=True)).any(axis=0) & valid
        gms = np.exp(np.log(np.where(valid, sub, 1.0)).mean(axis=0))
        return tuple(self.names[c] for c in sorted(np.flatnonzero(close), key=lambda c: (gms[c], self.names[c])))

    def regret(self, row: int, ranking: Sequence[RankedPlan]) -> float:
        """Regret on case ``row`` of the first ranked plan valid on it."""
        return self.regret_of(row, self.first_valid(row, [r.plan for r in ranking]))

    def first_valid(self, row: int, names: Sequence[str]) -> str | None:
        """The first of ``names`` timed on case ``row``."""
        return next((n for n in names if not np.isnan(self.lat[row, self.column[n]])), None)

    def regret_of(self, row: int, name: str | None) -> float:
        """Latency of plan ``name`` on case ``row`` over the case's fastest; MISSING_REGRET untimed."""
        ms = np.nan if name is None else self.lat[row, self.column[name]]
        return MISSING_REGRET if np.isnan(ms) else float(ms / np.nanmin(self.lat[row]))


def bucket_data(cases: Sequence[ProfiledCase], columns: list[int], base: str | None,
                options: CompileOptions) -> BucketData:
    names = sorted({p for c in cases for p in c.latencies})
    lat = np.full((len(cases), len(names)), np.nan)
    index = {n: i for i, n in enumerate(names)}
    for r, case in enumerate(cases):
        for plan, ms in case.latencies.items():
            lat[r, index[plan]] = ms
    x = np.array([[c.stats[i] for i in columns] for c in cases], dtype=np.float64).reshape(len(cases), len(columns))
    best = np.nanmin(np.where(np.isnan(lat), np.inf, lat), axis=1, keepdims=True)
    regret = lat / best
    contenders = np.flatnonzero((regret <= options.contender_regret).any(axis=0))
    clipped = np.where(np.isnan(regret[:, contenders]), options.target_clip,
                       np.minimum(regret[:, contenders], options.target_clip))
    groups = np.array([c.group for c in cases])
    return BucketData(x, lat, names, np.log(clipped), groups, base, options, cases)


def fit_bucket(key: str, bucket: tuple[int, int], label: str, cases: Sequence[ProfiledCase], columns: list[int],
               base: str | None, options: CompileOptions,
               plans: Mapping[str, PhysicalPlan]) -> tuple[BucketTable, BucketReport] | str:
    """The tree and regimes of one bucket, or why the bucket gets none."""
    cases = [c for c in cases if c.latencies]
    if not cases:
        return "no case has a valid plan"
    data = bucket_data(cases, columns, base, options)
    all_rows = np.arange(len(cases))
    if not data.ranking(all_rows):
        return "no plan is valid on every case and there is no base plan"
    cv, note = cross_validate(data, options)
    depth = 0
    if cv:
        best = min(score for _, score in cv)
        depth = min(d for d, score in cv if score <= best + options.tie_tolerance)
    model = fit_tree(data.x, data.target, depth, options.min_leaf)
    nodes, leaves = export_tree(model, data, columns)
    regimes, fit, described, choices = [], [], [], []
    for index, (rows, rule) in enumerate(leaves):
        ranking = data.ranking(rows)
        regrets = [data.regret(r, ranking) for r in rows]
        fit += regrets
        contenders = data.contenders(rows)
        plan_rule = fit_plan_rule(data, rows, columns, options)
        choosable = dict.fromkeys([ranking[0].plan, *contenders, *((plan_rule.below, plan_rule.above)
                                                                    if plan_rule else ())])
        schedules = fit_schedule_rules(data, rows, choosable, plans, columns, options)
        choice, held_out = fit_choice(data, rows, plans, columns, options, plan_rule is not None)
        calibration = fit_calibration(data, rows, contenders, plans, {}) if choice == "calibrated" else ()
        if choice == "calibrated" and not calibration:  # the whole regime's contenders hold fewer than two
            choice = "ranking"
        described += [f"regime {index} ({rule}): {describe_rule(r, plans)}" for r in schedules]
        scores = ", ".join(f"{way.replace('_', ' ')} {math.exp(score):.4f}" for way, score in held_out.items())
        choices.append(f"regime {index} ({rule}): {choice.replace('_', ' ')}"
                       + (f" ({describe_rule(plan_rule, plans, organization=False)})" if choice == "plan_rule" else "")
                       + (f" ({len(calibration)} plans, scales x{min(x for _, x in calibration):.3f} to "
                          f"x{max(x for _, x in calibration):.3f})" if calibration else "")
                       + (f" — {scores}" if scores else
                          f" — one CV group or fewer than {options.choice_min_cases} cases: the ranking"))
        regimes.append(Regime(key, label, index, rule, len(rows), ranking, round(geometric_mean(regrets), 6),
                              contenders, schedules, choice, plan_rule if choice == "plan_rule" else None,
                              calibration))
    report = BucketReport(key, label, len(cases), len(set(data.groups)), depth, len(regimes),
                          tuple((d, math.exp(s)) for d, s in cv), geometric_mean(fit), note, tuple(described),
                          tuple(choices))
    return BucketTable(key, bucket, label, len(cases), depth, RegimeTree(tuple(nodes)), tuple(regimes)), report


# -- schedule rules ------------------------------------------------------------------------------

def fit_schedule_rules(data: BucketData, rows: np.ndarray, choosable: Iterable[str],
                       plans: Mapping[str, PhysicalPlan], columns: list[int],
                       options: CompileOptions) -> tuple[ScheduleRule, ...]:
    """The schedule rules of one regime (``rows``): one per tile group of ``choosable`` whose task
    organizations are best chosen by a statistic (see the module docstring, step 4)."""
    valid = ~np.isnan(data.lat[rows]).any(axis=0)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for c in np.flatnonzero(valid):
        name = data.names[c]
        if name in plans:
            groups[tile_group(plans[name])].append(int(c))
    case_best = np.nanmin(data.lat[rows], axis=1)
    rules = []
    for group in dict.fromkeys(tile_group(plans[name]) for name in choosable if name in plans):
        variants = groups.get(group, [])
        if len(variants) < 2:
            continue
        group_best = data.lat[np.ix_(rows, variants)].min(axis=1)
        contending = rows[group_best <= CONTENDER_REGRET * case_best]
        fit_sets = [rows]  # all the regime's cases first, then those where the group contends
        if 2 * options.schedule_min_side <= len(contending) < len(rows):
            fit_sets.append(contending)
        for fit_rows in fit_sets:
            lat = data.lat[np.ix_(fit_rows, variants)]
            log_regret = np.log(lat / lat.min(axis=1, keepdims=True))  # against the group's best variant
            split = best_split(data.x[fit_rows], log_regret, options.schedule_min_side)
            if split is not None and split_generalizes(data.x[fit_rows], log_regret, data.groups[fit_rows], options):
                feature, threshold, below, above, n_below = split
                rules.append(ScheduleRule(columns[feature], threshold, data.names[variants[below]],
                                          data.names[variants[above]], (n_below, len(fit_rows) - n_below)))
                break
    return tuple(rules)


def fit_plan_rule(data: BucketData, rows: np.ndarray, columns: list[int],
                  options: CompileOptions) -> ScheduleRule | None:
    """A regime's plan rule: one threshold on one statistic choosing between any two plans valid on
    all of ``rows`` (another tile too, e.g. 64 x 64 tiles on clustered masks and 128 x 128 ones on
    banded masks of one geometry), when it beats the best single plan and leave-groups-out
    cross-validation says it generalizes (as schedule rules must)."""
    sub = data.lat[rows]
    variants = np.flatnonzero(~np.isnan(sub).any(axis=0))
    if len(variants) < 2:
        return None
    lat = sub[:, variants]
    log_regret = np.log(lat / lat.min(axis=1, keepdims=True))
    split = best_split(data.x[rows], log_regret, options.schedule_min_side)
    if split is None or not split_generalizes(data.x[rows], log_regret, data.groups[rows], options):
        return None
    feature, threshold, below, above, n_below = split
    return ScheduleRule(columns[feature], threshold, data.names[variants[below]], data.names[variants[above]],
                        (n_below, len(rows) - n_below))


def fit_choice(data: BucketData, rows: np.ndarray, plans: Mapping[str, PhysicalPlan], columns: list[int],
               options: CompileOptions, has_rule: bool) -> tuple[str, dict[str, float]]:
    """How the regime ``rows`` picks its plan (``Regime.choice``) and the held-out mean log regret
    of each way: leave-groups-out cross-validation over the regime's cases, each way rebuilt on the
    training cases (ranking, contenders, plan rule, schedule rules) and judged on the held-out ones
    with the schedule rules applied, as the selector does. The ranking stays unless another way
    lowers the held-out GM regret by more than ``choice_margin``; a plan rule only when one fits
    all the regime's cases (``has_rule``). A regime of fewer than ``choice_min_cases`` cases or one
    CV group keeps its ranking."""
    splits = cv_folds(data.groups[rows], options.folds) if len(rows) >= options.choice_min_cases else []
    if not splits:
        return "ranking", {}
    logs: dict[str, list[float]] = {"ranking": [], "cost_model": [], "calibrated": [], "plan_rule": []}
    estimators: dict = {}
    for train, test in splits:
        train_rows = np.sort(rows[train])
        head = [r.plan for r in data.ranking(train_rows)]
        contenders = data.contenders(train_rows)
        calibration = fit_calibration(data, train_rows, contenders, plans, estimators)
        rule = fit_plan_rule(data, train_rows, columns, options) if has_rule else None
        choosable = dict.fromkeys([head[0], *contenders, *((rule.below, rule.above) if rule else ())])
        schedules = fit_schedule_rules(data, train_rows, choosable, plans, columns, options)
        for row in rows[test]:
            ranked = data.first_valid(row, head)
            picks = {"ranking": ranked, "cost_model": ranked, "calibrated": ranked, "plan_rule": ranked}
            if len(contenders) >= 2:
                # the cost model's order, among the contenders timed on this case (all, but for
                # the rare plan a contenders-after profiling run did not time on it)
                picks["cost_model"] = data.first_valid(row, by_estimate(data, row, contenders, plans, estimators))
            if len(calibration) >= 2:
                picks["calibrated"] = data.first_valid(row, by_estimate(data, row, tuple(n for n, _ in calibration),
                                                                        plans, estimators, dict(calibration)))
            case = data.cases[row]
            if rule is not None and not np.isnan(data.lat[row, data.column[rule.choose(case.stats)]]):
                picks["plan_rule"] = rule.choose(case.stats)
            for way, pick in picks.items():
                final = scheduled(pick, schedules, plans, case.stats, data, row)
                logs[way].append(math.log(data.regret_of(row, final)))
    scores = {way: float(np.mean(v)) for way, v in logs.items() if way != "plan_rule" or has_rule}
    choice = min(scores, key=scores.get)
    if scores[choice] >= scores["ranking"] + math.log(1.0 - options.choice_margin):
        choice = "ranking"
    return choice, scores


def estimates_of(data: BucketData, row: int, names: tuple[str, ...], plans: Mapping[str, PhysicalPlan],
                 estimators: dict) -> dict[str, float]:
    """The cost model's milliseconds for ``names`` on case ``row`` (an estimator per request and plans)."""
    case = data.cases[row]
    memo = (case.request, names)
    if memo not in estimators:
        estimators[memo] = PlanEstimator([plans[n] for n in names], case.request)
    return dict(zip(names, estimators[memo](case.stats, dict(case.row_unions))))


def by_estimate(data: BucketData, row: int, names: tuple[str, ...], plans: Mapping[str, PhysicalPlan],
                estimators: dict, scales: Mapping[str, float] | None = None) -> list[str]:
    """``names`` by the cost model's estimate on case ``row`` (times ``scales``: calibrated), fastest first."""
    estimates = estimates_of(data, row, names, plans, estimators)
    return sorted(names, key=lambda n: estimates[n] * (scales[n] if scales else 1.0))


def fit_calibration(data: BucketData, rows: np.ndarray, contenders: Sequence[str],
                    plans: Mapping[str, PhysicalPlan], estimators: dict) -> tuple[tuple[str, float], ...]:
    """``Regime.calibration`` fitted on ``rows``: each contender whose area the cost model measures
    (``area_is_measured``), with the geometric mean over the rows it was timed on of its measured
    over estimated latency. Empty with fewer than two such plans (nothing to choose between)."""
    names = tuple(n for n in contenders if area_is_measured(plans[n]))
    if len(names) < 2:
        return ()
    logs: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        estimates = estimates_of(data, row, names, plans, estimators)
        for name in names:
            ms = data.lat[row, data.column[name]]
            if not np.isnan(ms):
                logs[name].append(math.log(ms / estimates[name]))
    return tuple((name, round(math.exp(float(np.mean(logs[name]))), 6)) for name in names if logs[name])


def scheduled(name: str | None, schedules: Sequence[ScheduleRule], plans: Mapping[str, PhysicalPlan],
              stats: Sequence[float], data: BucketData, row: int) -> str | None:
    """Plan ``name`` after the schedule rule of its tile group (when the ruled plan was timed on
    case ``row``: online an untimed plan would run all the same, offline its time is unknown)."""
    if name is None:
        return None
    group = tile_group(plans[name])
    rule = next((r for r in schedules if tile_group(plans[r.below]) == group), None)
    if rule is None:
        return name
    ruled = rule.choose(stats)
    return ruled if not np.isnan(data.lat[row, data.column[ruled]]) else name


def best_split(x: np.ndarray, log_regret: np.ndarray, min_side: int) -> tuple[int, float, int, int, int] | None:
    """(feature, threshold, best variant below, best variant above, cases below) of the threshold
    with the least total regret that puts ``min_side`` cases on each side and changes the variant;
    None when no threshold beats the best single variant."""
    n = len(x)
    best_cost = log_regret.sum(axis=0).min() - 1e-12
    best = None
    for f in range(x.shape[1]):
        order = np.argsort(x[:, f], kind="stable")
        values = x[order, f]
        below = np.cumsum(log_regret[order], axis=0)  # [n, V]: row i = the first i + 1 cases
        total = below[-1]
        for i in range(min_side - 1, n - min_side):
            if values[i] == values[i + 1]:
                continue  # no threshold separates equal values
            left, right = below[i], total - below[i]
            vl, vr = int(left.argmin()), int(right.argmin())
            cost = left[vl] + right[vr]
            if vl != vr and cost < best_cost:
                best_cost = cost
                best = (f, float((values[i] + values[i + 1]) / 2), vl, vr, i + 1)
    return best


def split_generalizes(x: np.ndarray, log_regret: np.ndarray, groups: np.ndarray, options: CompileOptions) -> bool:
    """Whether a split fitted without each CV group beats the best single variant on that group."""
    splits = cv_folds(groups, options.folds)
    if not splits:
        return False
    split_logs, flat_logs = [], []
    for train, test in splits:
        flat = int(log_regret[train].sum(axis=0).argmin())
        flat_logs += log_regret[test, flat].tolist()
        fitted = best_split(x[train], log_regret[train], options.schedule_min_side)
        if fitted is None:
            split_logs += log_regret[test, flat].tolist()
            continue
        f, threshold, below, above, _ = fitted
        chosen = np.where(x[test, f] <= threshold, below, above)
        split_logs += log_regret[test, chosen].tolist()
    return float(np.mean(split_logs)) < float(np.mean(flat_logs)) + math.log(1.0 - options.schedule_margin)


def describe_rule(rule: ScheduleRule, plans: Mapping[str, PhysicalPlan], organization: bool = True) -> str:
    """A schedule rule as "<tile> (<warps> warps): <organization> if ..."; with ``organization``
    False (a plan rule, whose plans may differ in their tile) as "<plan> if ..., else <plan>"."""
    if not organization:
        return (f"{rule.below} if {STAT_NAMES[rule.stat]} <= {rule.threshold:.4g} ({rule.cases[0]} cases), "
                f"else {rule.above} ({rule.cases[1]} cases)")
    below, above = plans[rule.below], plans[rule.above]
    tile = rule.below.rsplit("_", 2)[0]  # the name without "_s<stages>w<warps>_<organization>"

    def organization(plan: PhysicalPlan) -> str:
        return f"{plan.tasks.name} {plan.kernel.stages}-stage"

    return (f"{tile} ({below.kernel.warps} warps): {organization(below)} if {STAT_NAMES[rule.stat]} <= "
            f"{rule.threshold:.4g} ({rule.cases[0]} cases), else {organization(above)} ({rule.cases[1]} cases)")


def fit_tree(x: np.ndarray, target: np.ndarray, depth: int, min_leaf: int):
    """A fitted ``DecisionTreeRegressor``, or None for depth 0 (one regime)."""
    if depth == 0 or len(x) < 2 * min_leaf or target.shape[1] == 0:
        return None
    from sklearn.tree import DecisionTreeRegressor  # the profile extra; never needed online

    return DecisionTreeRegressor(max_depth=depth, min_samples_leaf=min_leaf, random_state=0).fit(x, target)


def leaves_of(model, x: np.ndarray) -> np.ndarray:
    return np.zeros(len(x), dtype=np.int64) if model is None else model.apply(x)


def cv_folds(groups: np.ndarray, folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``GroupKFold`` splits: every group entirely in train or in test. Empty with < 2 groups."""
    n_groups = len(set(groups.tolist()))
    if n_groups < 2:
        return []
    from sklearn.model_selection import GroupKFold

    splitter = GroupKFold(n_splits=min(folds, n_groups))
    return list(splitter.split(np.zeros(len(groups)), groups=groups))


def cross_validate(data: BucketData, options: CompileOptions) -> tuple[list[tuple[int, float]], str]:
    """Mean held-out log regret per depth (depth 0 always; deeper while trees can still grow)."""
    n = len(data.groups)
    if n < 2 * options.min_leaf:
        return [], f"{n} cases < 2 x {options.min_leaf}: one regime"
    splits = cv_folds(data.groups, options.folds)
    if not splits:
        return [], "one CV group only: one regime"
    scores = []
    for depth in range(options.max_depth + 1):
        logs, grew = [], False
        for train, test in splits:
            model = fit_tree(data.x[train], data.target[train], depth, options.min_leaf)
            train_leaves = leaves_of(model, data.x[train])
            test_leaves = leaves_of(model, data.x[test])
            grew |= model is not None and model.get_depth() >= depth
            for leaf in np.unique(test_leaves):
                rows = train[train_leaves == leaf]
                ranking = data.ranking(np.sort(rows))
                logs += [math.log(data.regret(r, ranking)) for r in test[test_leaves == leaf]]
        scores.append((depth, float(np.mean(logs))))
        if depth > 0 and not grew:
            break  # no fold's tree reached this depth: deeper ones are the same trees
    return scores, ""


def export_tree(model, data: BucketData, columns: list[int]) -> tuple[list[TreeNode], list[tuple[np.ndarray, str]]]:
    """Plain-threshold nodes (preorder, root 0) and each regime's rows and rule. Sibling leaves
    with the same ranked plans are merged."""
    leaf_ids = leaves_of(model, data.x)
    all_rows = np.arange(len(data.x))
    if model is None:
        return [TreeNode(regime=0)], [(all_rows, "all masks")]
    tree = model.tree_

    def rows_under(node: int) -> np.ndarray:
        if tree.children_left[node] < 0:
            return all_rows[leaf_ids == node]
        return np.sort(np.concatenate([rows_under(tree.children_left[node]), rows_under(tree.children_right[node])]))

    def visit(node: int, path: tuple[str, ...]):
        if tree.children_left[node] < 0:
            return ("leaf", rows_under(node), path)
        stat = columns[int(tree.feature[node])]
        threshold = float(tree.threshold[node])
        name = STAT_NAMES[stat]
        left = visit(tree.children_left[node], path + (f"{name} <= {threshold:.4g}",))
        right = visit(tree.children_right[node], path + (f"{name} > {threshold:.4g}",))
        if left[0] == "leaf" and right[0] == "leaf":
            same = [r.plan for r in data.ranking(left[1])] == [r.plan for r in data.ranking(right[1])]
            if same:
                return ("leaf", np.sort(np.concatenate([left[1], right[1]])), path)
        return ("split", stat, threshold, left, right)

    nodes: list[TreeNode] = []
    leaves: list[tuple[np.ndarray, str]] = []

    def flatten(sub) -> int:
        index = len(nodes)
        if sub[0] == "leaf":
            nodes.append(TreeNode(regime=len(leaves)))
            leaves.append((sub[1], " and ".join(sub[2]) or "all masks"))
            return index
        nodes.append(TreeNode())  # placeholder until the children have their indices
        left, right = flatten(sub[3]), flatten(sub[4])
        nodes[index] = TreeNode(sub[1], sub[2], left, right)
        return index

    flatten(visit(0, ()))
    return nodes, leaves


def geometric_mean(values: Sequence[float]) -> float:
    """``statistics.geometric_mean`` of positive values; NaN for none."""
    return statistics.geometric_mean(values) if len(values) else float("nan")


def stats_vector(stats: Mapping[str, float]) -> tuple[float, ...]:
    """A ``{stat name: value}`` dict (``MaskState.host_stats``) as a tuple in ``Stat`` order."""
    if len(STAT_NAMES) != NUM_STATS:  # pragma: no cover  (mirrors mask_state by construction)
        raise PlanTableError("plan_table.STAT_NAMES is out of step with mask_state.Stat")
    return tuple(float(stats[s]) for s in STAT_NAMES)
