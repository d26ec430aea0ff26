"""The only place that decides which plan runs a request.

    selector = Selector()                         # one per Runtime; its caches are its own
    plan = selector.select(request, state)        # a PhysicalPlan, or None for the reference oracle
    print(selector.rank(request, state).explain())

Order of decision:

1. The plan table of the request's architecture (the shipped one, ``$TESSERA_PLAN_TABLE``, or one
   given to the Selector): key -> bucket -> regime, a tree over mask statistics that reads them to
   the host once (``MaskState.host_stat_values``), and only when it has splits -> the regime's
   ranking, scanned with eligibility; the first eligible plan wins. A bucket the table lacks gives
   the key's base plan. A regime's ``choice`` (made by the compiler's cross-validation) may instead
   hand the plan to its *plan rule* (one statistic picks one of two plans, of any tile) or to the
   cost model among its contenders (plans within 3% of the best on one of its cases), or to the
   *calibrated* cost model (each estimate times its plan's measured / estimated latency on the
   regime's cases), on this mask's statistics (one read; kept per regime with ``reuse_regime``). A
   regime's *schedule rule* for the chosen plan's tile group then picks its task organization
   (persistent grid or one CTA per task, split-K, traversal, pipeline depth) by one statistic (the
   same read), when the rule's plan is eligible.
2. Otherwise (no table, key not profiled, table rejected, every ranked plan ineligible) the analytic
   roofline cost model ranks every eligible catalog plan.
3. No eligible native plan: None, the reference oracle (warned once on CUDA).

The chosen plan runs a mask's first request in the natural query layout. For a mask that comes back
(``Runtime``), ``Selector.reused_plan`` names the plan to re-prepare it with once, possibly in the
grouped query layout (each head's query blocks regrouped by key set, ``regroup.py``: a preparation
0.2-0.3 ms longer at 32k tokens, paid back by the requests after it): the table's plan for the
request's ``/reused`` key where it was profiled (``tessera profile --reused-masks``: natural and
grouped plans timed side by side), else the rule of ``reused_mask_plan`` (the same plan grouped, on
Hopper, for query blocks of at most ``GROUPED_MAX_BLOCK_Q`` rows; for an 8-bit request, of any size).
``$TESSERA_GROUP_QUERIES`` = ``0`` never regroups, ``1`` regroups every plan that can.

A table that is corrupt or built against another catalog is never used: the Selector warns once
with the ``PlanTableError`` message and ranks with the cost model.

Caches: per request, its table lookup and its eligible catalog plans; per (request, regime), the
Selection — so a new mask in a regime already seen skips the ranking scan. Exact repeats (the same
mask object) never reach the Selector: ``Runtime`` reuses their prepared plan. The loaded library's
kernel list, each request's eligible catalog plans, each (plan, request)'s eligibility and each mixed
regime's eligible contenders with their cost model are pure functions, cached per process; a table
keeps its catalog check for the last kernel tuple. So a fresh Selector (a cold ``Runtime``) pays
for none of them again.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache

from . import config, library
from .catalog import all_kernels, plans_for, quantized_kernel
from .cost_model import PlanEstimator
from .eligibility import rejection
from .errors import CatalogError, PlanTableError
from .kernel_table import DEFAULT_PV
from .mask_state import MaskState
from .plan_table import STAT_NAMES, PlanTable, RankedPlan, Regime, RegimeTree, ScheduleRule, default_table, tile_group
from .plans import INPUT_PRECISION, Family, KernelSpec, PhysicalPlan, QLayout, Request

AUTO = "auto"  # Selector.table: the shipped table of each request's architecture
Warn = Callable[[str], None]
EVERY_PLAN_REJECTED = object()  # cached for a regime whose whole ranking is ineligible for a request


@dataclass(frozen=True)
class Selection:
    """What the selector decided and why (for ``explain``)."""

    request: Request
    ranking: tuple[tuple[str, float | None], ...]  # (plan name, ms), best first
    rejected: tuple[tuple[str, str], ...]  # (plan name, reason)
    chosen: PhysicalPlan | None
    source: str = "cost model"  # "plan table" | "cost model"
    regime: Regime | None = None
    notes: tuple[str, ...] = ()

    def explain(self, limit: int = 12) -> str:
        lines = [f"request  {self.request.name}", f"source   {self.source}"]
        if self.request.precision != INPUT_PRECISION:
            lines.append(f"precision {self.request.precision}: the quantization pass, then the chosen plan's "
                         f"8-bit kernel (Q K^T on the 8-bit tensor cores, P V {PV_WHERE[DEFAULT_PV]})")
        if self.regime is not None:
            lines.append(f"regime   {self.regime.name}: {self.regime.rule} ({self.regime.cases} profiled cases)")
            lines.append(f"choice   {describe_choice(self.regime)}")
        lines += [f"note     {note}" for note in self.notes]
        unit = "predicted ms" if self.source.endswith("cost model") else "geometric-mean ms over the regime's cases"
        if self.request.precision == "int8":
            unit += " of the 16-bit request; one CTA per task first"
        lines.append(f"ranking ({unit}):")
        for name, ms in self.ranking[:limit]:
            lines.append(f"  {'      -  ' if ms is None else f'{ms:9.3f}'}  {name}")
        if len(self.ranking) > limit:
            lines.append(f"  ... {len(self.ranking) - limit} more")
        if self.rejected:
            lines.append(f"rejected ({len(self.rejected)}):")
            lines += [f"  {name}: {why}" for name, why in self.rejected[:limit]]
            if len(self.rejected) > limit:
                lines.append(f"  ... {len(self.rejected) - limit} more")
        chosen = self.chosen.name if self.chosen else "reference oracle"
        if self.chosen is not None and self.request.precision == "int8":
            chosen += f" (8-bit kernel {quantized_kernel(self.chosen.kernel).name})"
        lines.append(f"chosen   {chosen}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ArchContext:
    """What a Selector resolved once per architecture: the runnable catalog and the usable table."""

    kernels: tuple[KernelSpec, ...]
    kernels_note: str | None  # why there are no native kernels
    table: PlanTable | None
    table_note: str | None  # why a table exists but is not used
    stale_note: str | None = None  # the table is used, but was profiled on kernels of other sources


@dataclass
class RequestEntry:
    """Per-request cache: the regimes its table bucket offers and the Selections made so far."""

    regimes: tuple[Regime, ...]  # empty: the cost model ranks
    tree: RegimeTree | None  # None: one regime, no statistic needed
    stats_needed: bool
    plans: Mapping  # plan name -> PhysicalPlan (the table's)
    notes: tuple[str, ...]
    by_regime: dict = field(default_factory=dict)  # regime index -> Selection (or EVERY_PLAN_REJECTED)
    last_regime: int | None = None  # the regime the previous request of this entry fell in
    cost_model_choice: Selection | None = None  # the previous cost-model decision (for reuse_regime)
    quantized_choice: Selection | None = None  # the previous 8-bit decision of this request (for reuse_regime)
    arbitrated: dict = field(default_factory=dict)  # regime index -> the last decision of its cost model or plan rule
    scheduled: dict = field(default_factory=dict)  # (regime index, id of the plan before the rule) -> the last rule decision
    rules: dict = field(default_factory=dict)  # (regime index, id of the plan before the rule) -> its schedule rule or None
    contenders: dict = field(default_factory=dict)  # regime index -> regime_estimator(...)
    eligible: tuple[PhysicalPlan, ...] | None = None  # catalog plans for the cost model (lazy)
    eligible_names: tuple[str, ...] = ()
    estimator: PlanEstimator | None = None  # the cost model over ``eligible``
    rejected: tuple[tuple[str, str], ...] = ()


def discover_kernels(arch: str) -> tuple[tuple[KernelSpec, ...], str | None]:
    """The native kernels a request of ``arch`` can run, or none and why."""
    if arch == "cpu":
        return (), "CPU tensors run on the reference path"
    try:
        return library_kernels(), None
    except CatalogError as err:
        return (), f"native kernels unavailable ({err})"


@cache
def library_kernels() -> tuple[KernelSpec, ...]:
    """``library.available_kernels()`` once per process, like the library load it reads (a failure
    is not kept: the next call tries again). A fresh ``Selector`` — one per cold ``Runtime`` — then
    costs no catalog rebuild, and the table's catalog check hashes the same tuple object."""
    return library.available_kernels()


def library_kernel_sources(cuda: bool = True, part: str = "kernel_sources") -> str | None:
    """A source hash of the native library (``library.kernel_sources``; ``part`` "grouping_sources"
    for the grouping kernel's): None off CUDA (``cuda`` False), without a library, or for a library
    built before that hash existed."""
    if not cuda:
        return None
    return library.kernel_sources(part)


@lru_cache(maxsize=256)
def catalog_plans(request: Request, kernels: tuple[KernelSpec, ...]) -> tuple[
        tuple[PhysicalPlan, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The cost model's candidates for ``request``: eligible catalog plans, their names, and the
    rejected ones with reasons. A pure function of its arguments, cached across Selectors, so a cold
    ``Runtime`` does not re-run eligibility over the whole catalog (hundreds of plans)."""
    eligible, rejected = [], []
    for plan in plans_for(request.block_q, request.block_kv, kernels) if kernels else ():
        reason = rejection(plan, request)
        if reason is None:
            eligible.append(plan)
        else:
            rejected.append((plan.name, reason))
    return tuple(eligible), tuple(p.name for p in eligible), tuple(rejected)


@lru_cache(maxsize=8192)
def cached_rejection(plan: PhysicalPlan, request: Request) -> str | None:
    """``eligibility.rejection`` (a pure function of its arguments), cached across Selectors: a fresh
    Selector scanning a ranking it has not seen yet does not re-run the predicates."""
    return rejection(plan, request)


@lru_cache(maxsize=1024)
def eligible_contenders(plans: tuple[tuple[str, PhysicalPlan], ...], request: Request) -> tuple[
        tuple[PhysicalPlan, ...], tuple[str, ...], PlanEstimator]:
    """A cost-model regime's contenders ``(name, plan)`` that can serve ``request``, their names, and the
    cost model over them (built once per process: a fresh Selector pays for neither again)."""
    kept = [(name, plan) for name, plan in plans if cached_rejection(plan, request) is None]
    eligible = tuple(plan for _, plan in kept)
    return eligible, tuple(name for name, _ in kept), PlanEstimator(eligible, request)


def regime_estimator(regime: Regime, plans: Mapping[str, PhysicalPlan], request: Request) -> tuple[
        tuple[PhysicalPlan, ...], tuple[str, ...], PlanEstimator, tuple[float, ...] | None]:
    """The plans a cost-model or calibrated regime chooses among that can serve ``request``, their
    names, the cost model over them and, for a calibrated regime, each one's scale (else None)."""
    if regime.choice == "calibrated":
        named = tuple((name, plans[name]) for name, _ in regime.calibration)
    else:
        named = tuple((name, plans[name]) for name in regime.contenders)
    eligible, names, estimator = eligible_contenders(named, request)
    if regime.choice != "calibrated":
        return eligible, names, estimator, None
    scale = dict(regime.calibration)
    return eligible, names, estimator, tuple(scale[name] for name in names)


@dataclass
class Selector:
    """Plan selection with explicit caches (one per ``Runtime``).

    Args:
        table: ``"auto"`` (the shipped table of each request's architecture, or ``$TESSERA_PLAN_TABLE``),
            a ``PlanTable`` (used for requests of its architecture), or None (cost model only).
        kernels: the native catalog to rank; None discovers the loaded library's kernels (none on CPU).
        max_requests: distinct requests kept in the cache (oldest dropped first).
        reuse_regime: the caller allows a new mask to take the regime of the previous mask of the
            same request (or, without a table, the previous cost-model choice) without reading its
            statistics: no host sync and no ranking. For loops whose consecutive masks of one
            request are alike (the steps of a diffusion loop); ``forget_regimes()`` re-reads.
    """

    table: PlanTable | str | None = AUTO
    kernels: tuple[KernelSpec, ...] | None = None
    max_requests: int = 1024
    reuse_regime: bool = False
    _arch: dict = field(default_factory=dict, repr=False)
    _requests: dict = field(default_factory=dict, repr=False)
    regime_hits: int = 0  # selections answered from the (request, regime) cache
    scans: int = 0  # ranking scans done
    regime_reuses: int = 0  # selections that reused the previous regime without reading statistics

    # -- the online path -------------------------------------------------------------------------

    def select(self, request: Request, state: MaskState, warn: Warn | None = None) -> PhysicalPlan | None:
        """The plan to run ``request`` with, or None for the reference oracle (warned on CUDA)."""
        selection = self.selection(request, state, warn)
        if selection.chosen is None and request.arch != "cpu" and warn is not None:
            reasons = "; ".join(selection.notes[-1:] + tuple(f"{n}: {r}" for n, r in selection.rejected[:3]))
            warn(f"tessera: no native plan for {request.key}, using the reference path ({reasons})")
        return selection.chosen

    def selection(self, request: Request, state: MaskState, warn: Warn | None = None) -> Selection:
        """The cached fast path: regime lookup, then the first eligible plan of its ranking."""
        entry = self._requests.get(request)
        if entry is None:
            entry = self._entry(request, warn)
        if entry.regimes:
            if not entry.stats_needed:
                index = 0
            elif self.reuse_regime and entry.last_regime is not None:
                index = entry.last_regime
                self.regime_reuses += 1
            else:
                index = entry.tree.regime_of(state.host_stat_values)
            entry.last_regime = index
            cached = entry.by_regime.get(index)
            if cached is None:
                cached = self._scan(entry, index, request, full=False) or EVERY_PLAN_REJECTED
                entry.by_regime[index] = cached
            else:
                self.regime_hits += 1
            if cached is not EVERY_PLAN_REJECTED:
                return self._schedule(entry, index, request, state, self._arbitrate(entry, index, request, state, cached))
        if self.reuse_regime and entry.cost_model_choice is not None:
            self.regime_reuses += 1
            return entry.cost_model_choice
        entry.cost_model_choice = self._cost_model(entry, request, state)
        return entry.cost_model_choice

    def reused_plan(self, plan: PhysicalPlan, request: Request, state: MaskState,
                    warn: Warn | None = None) -> PhysicalPlan:
        """The plan to re-prepare a mask with when it comes back after running ``plan``: the plan
        table's choice under the request's ``/reused`` key (natural and grouped plans, ranked on
        the mask's statistics like any request) where the table has that key, else (and for every
        8-bit request, whose grouped layout runs in the same 8-bit kernel) the rule of
        ``reused_mask_plan``. ``plan`` itself where the answer is the same plan;
        ``$TESSERA_GROUP_QUERIES`` (``0`` / ``1``) overrides the table."""
        reused = self.reused_request(plan, request, warn)
        if reused is None:
            return reused_mask_plan(plan, request)
        chosen = self.selection(reused, state, warn).chosen
        return plan if chosen is None or chosen == plan else chosen

    def reused_request(self, plan: PhysicalPlan, request: Request, warn: Warn | None = None) -> Request | None:
        """The ``/reused`` request whose table choice ``reused_plan`` takes for a mask that ran
        ``plan``, or None where the rule of ``reused_mask_plan`` decides: ``plan`` already grouped,
        ``$TESSERA_GROUP_QUERIES`` set, an 8-bit request (the table ranks 16-bit plans), or no such
        key in the table."""
        if config.get("group_queries") is not None or plan.q_layout is QLayout.GROUPED:
            return None
        if request.precision != INPUT_PRECISION:
            return None
        reused = dataclasses.replace(request, reused_mask=True)
        table = self.context(request.arch, warn).table
        return None if table is None or reused.key not in table.keys else reused

    def rank(self, request: Request, state: MaskState, warn: Warn | None = None) -> Selection:
        """The full decision for ``explain``: every ranked plan checked, every rejection kept (for an
        8-bit request, ``quantized``'s decision without reuse)."""
        if request.precision != INPUT_PRECISION:
            return self._quantized_selection(request, *self._base_entry(request, warn), state, warn)
        entry = self._requests.get(request) or self._entry(request, warn)
        if entry.regimes:
            index = entry.tree.regime_of(state.host_stat_values) if entry.stats_needed else 0
            selection = self._scan(entry, index, request, full=True)
            if selection is not None:
                arbitrated = self._arbitrate(entry, index, request, state, selection, reuse=False)
                return self._schedule(entry, index, request, state, arbitrated, reuse=False)
        return self._cost_model(entry, request, state)

    def quantized(self, request: Request, state: MaskState, warn: Warn | None = None) -> Selection:
        """The decision for an 8-bit request (``request.precision == "int8"``). The 8-bit kernels
        run the plans of the 16-bit request, so that request is ranked (plan table or cost model)
        and its best-ranked eligible plan whose kernel has an 8-bit variant is chosen, one CTA per
        task before a persistent grid (``QUANTIZED_GRID``); plans the ranking does not name follow
        in the cost model's order. ``chosen`` None: no such plan. With ``reuse_regime``, the
        request's previous 8-bit decision serves again (no statistics read)."""
        base, entry = self._base_entry(request, warn)
        if self.reuse_regime and entry.quantized_choice is not None:
            self.regime_reuses += 1
            return entry.quantized_choice
        entry.quantized_choice = self._quantized_selection(request, base, entry, state, warn)
        return entry.quantized_choice

    def _base_entry(self, request: Request, warn: Warn | None) -> tuple[Request, RequestEntry]:
        """The 16-bit request an 8-bit ``request`` ranks, and its entry."""
        base = dataclasses.replace(request, precision=INPUT_PRECISION)
        return base, self._requests.get(base) or self._entry(base, warn)

    def _quantized_selection(self, request: Request, base: Request, entry: RequestEntry, state: MaskState,
                             warn: Warn | None) -> Selection:
        """The 8-bit decision from the 16-bit request ``base`` and its ``entry``."""
        ranked = self.rank(base, state, warn)
        estimated = self._cost_model(entry, base, state)
        plans = {p.name: p for p in entry.eligible or ()}
        position = {name: i for i, (name, _) in enumerate(ranked.ranking)}
        estimates = dict(estimated.ranking)
        names = sorted((n for n, p in plans.items() if has_quantized_variant(p)),
                       key=lambda n: (plans[n].tasks.persistent, position.get(n, len(position)),
                                      estimates.get(n, math.inf)))
        rejected = tuple((n, "its kernel has no 8-bit variant") for n in plans if n not in names)
        note = (f"precision int8: the best-ranked plan of {base.key} that an 8-bit kernel runs, "
                f"one CTA per task first ({QUANTIZED_GRID})")
        notes = (*ranked.notes, note)
        return Selection(request, tuple((n, estimates.get(n)) for n in names), rejected + ranked.rejected,
                         plans[names[0]] if names else None, ranked.source, ranked.regime, notes)

    def clear(self) -> None:
        self._requests.clear()
        self._arch.clear()

    def forget_regimes(self) -> None:
        """With ``reuse_regime``: the next request of every key reads its mask's statistics again."""
        for entry in self._requests.values():
            entry.last_regime = None
            entry.cost_model_choice = None
            entry.quantized_choice = None
            entry.arbitrated.clear()
            entry.scheduled.clear()

    # -- resolution (once per architecture / request) ----------------------------------------------

    def context(self, arch: str, warn: Warn | None = None) -> ArchContext:
        """Kernels and table of ``arch`` (resolved once; a rejected table is warned about once)."""
        ctx = self._arch.get(arch)
        if ctx is not None:
            return ctx
        if arch == "cpu":
            kernels, kernels_note = (), "CPU tensors run on the reference path"
        elif self.kernels is not None:
            kernels, kernels_note = self.kernels, None
        else:
            kernels, kernels_note = discover_kernels(arch)
        table, table_note = self._table_for(arch, kernels, kernels_note)
        if table_note is not None:
            (warn or warn_user)(f"tessera: {table_note}")
        stale_note = None
        if table is not None and self.kernels is None:  # kernels of the loaded library
            stale_note = table.sources_mismatch(library_kernel_sources(arch != "cpu"),
                                                library_kernel_sources(arch != "cpu", "grouping_sources"))
            if stale_note is not None:
                (warn or warn_user)(f"tessera: {stale_note}")
        ctx = ArchContext(kernels, kernels_note, table, table_note, stale_note)
        self._arch[arch] = ctx
        return ctx

    def _table_for(self, arch: str, kernels: tuple[KernelSpec, ...],
                   kernels_note: str | None) -> tuple[PlanTable | None, str | None]:
        if self.table is None:
            return None, None
        if isinstance(self.table, PlanTable):
            table = self.table if self.table.arch == arch else None
        elif self.table == AUTO:
            found = default_table(arch)
            if found.error is not None:
                return None, f"{PlanTableError.__name__}: {found.error}; ranking with the cost model instead"
            table = found.table
        else:
            raise PlanTableError(f"Selector.table: expected a PlanTable, {AUTO!r} or None, got {self.table!r}")
        if table is None:
            return None, None
        if not kernels and arch != "cpu":
            return None, None  # no native kernels at all: nothing to rank, and kernels_note says why
        mismatch = table.catalog_mismatch(kernels)
        if mismatch is not None:
            return None, f"{PlanTableError.__name__}: {mismatch}; ranking with the cost model instead"
        return table, None

    def _entry(self, request: Request, warn: Warn | None) -> RequestEntry:
        ctx = self.context(request.arch, warn)
        notes: list[str] = []
        if ctx.table_note:
            notes.append("plan table rejected (see the warning): cost model")
        if ctx.stale_note:
            notes.append(f"plan table possibly stale: {ctx.stale_note}")
        regimes: tuple[Regime, ...] = ()
        tree = None
        plans: Mapping = {}
        if ctx.table is not None:
            found = ctx.table.lookup(request)
            notes.append(f"{ctx.table.name}: {found.note}")
            plans = ctx.table.plans
            if found.bucket is not None:
                regimes = found.bucket.regimes
                tree = found.bucket.tree if len(found.bucket.tree.nodes) > 1 else None
            elif found.key_table is not None and found.key_table.base_plan is not None:
                base = found.key_table.base_plan
                label = ctx.table.features.buckets.label(ctx.table.features.buckets.of(request))
                regimes = (Regime(request.key, label, 0, "bucket not profiled: the key's base plan", 0,
                                  (RankedPlan(base, None),)),)
        elif ctx.kernels_note:
            notes.append(ctx.kernels_note)
        entry = RequestEntry(regimes, tree, tree is not None and bool(tree.stats_used), plans, tuple(notes))
        if len(self._requests) >= self.max_requests:
            self._requests.pop(next(iter(self._requests)))
        self._requests[request] = entry
        return entry

    # -- the two rankings ------------------------------------------------------------------------

    def _scan(self, entry: RequestEntry, index: int, request: Request, full: bool) -> Selection | None:
        """First eligible plan of regime ``index`` (None when every ranked plan is rejected)."""
        self.scans += 1
        regime = entry.regimes[index]
        rejected, chosen = [], None
        for ranked in regime.ranking:
            plan = entry.plans[ranked.plan]
            reason = cached_rejection(plan, request)
            if reason is not None:
                rejected.append((ranked.plan, reason))
            elif chosen is None:
                chosen = plan
                if not full:
                    break
        if chosen is None:
            return None
        ranking = tuple((r.plan, r.gm_ms) for r in regime.ranking)
        return Selection(request, ranking, tuple(rejected), chosen, "plan table", regime, entry.notes)

    def _arbitrate(self, entry: RequestEntry, index: int, request: Request, state: MaskState,
                   selection: Selection, reuse: bool = True) -> Selection:
        """The plan of the regime's ``choice``: ``selection`` (its ranking's first eligible plan),
        or, on this mask's statistics (one read), its plan rule's plan when eligible, or the cost
        model's pick among its eligible contenders (calibrated: among its calibrated plans, each
        estimate times the plan's scale). With ``reuse_regime`` a later mask of the
        request keeps that choice."""
        regime = entry.regimes[index]
        if regime.choice == "ranking" or (regime.choice == "cost_model" and len(regime.contenders) < 2):
            return selection
        if reuse and self.reuse_regime and index in entry.arbitrated:
            self.regime_reuses += 1
            return entry.arbitrated[index]
        if regime.choice == "plan_rule":
            chosen = ruled(selection, "plan rule", regime.plan_rule, entry.plans, state, "plan table + plan rule")
            entry.arbitrated[index] = chosen
            return chosen
        cached = entry.contenders.get(index)
        if cached is None:  # once per (request, regime)
            cached = entry.contenders[index] = regime_estimator(regime, entry.plans, request)
        eligible, names, estimator, scales = cached
        if not eligible:
            return selection
        estimates = estimate_with(estimator, state)
        if scales is not None:
            estimates = [ms * scale for ms, scale in zip(estimates, scales)]
        order = sorted(range(len(eligible)), key=estimates.__getitem__)
        if scales is None:
            note = (f"the regime's choice is the cost model's (first plan's GM regret {regime.fit_regret:.3f} on its "
                    f"cases): it chose among its {len(eligible)} eligible contenders")
        else:
            note = (f"the regime's choice is the calibrated cost model's: it chose among its {len(eligible)} eligible "
                    "calibrated plans, each estimate times the plan's measured / estimated latency on the regime's cases")
        source = "plan table + cost model" if scales is None else "plan table + calibrated cost model"
        chosen = Selection(request, tuple((names[i], estimates[i]) for i in order), selection.rejected,
                           eligible[order[0]], source, regime, selection.notes + (note,))
        entry.arbitrated[index] = chosen
        return chosen

    def _schedule(self, entry: RequestEntry, index: int, request: Request, state: MaskState,
                  selection: Selection, reuse: bool = True) -> Selection:
        """``selection`` with the task organization the regime's schedule rule gives its chosen
        plan's tile group on this mask's statistics (one read, shared with the tree and the cost
        model), when the regime has such a rule and the rule's plan is eligible. With
        ``reuse_regime`` a later mask of the request keeps the previous decision."""
        regime = entry.regimes[index]
        if not regime.schedules or selection.chosen is None:
            return selection
        memo = (index, id(selection.chosen))  # the table's own plan objects, alive with the entry
        if memo not in entry.rules:  # the rule of this (regime, plan), looked up once
            group = tile_group(selection.chosen)
            entry.rules[memo] = next((r for r in regime.schedules if tile_group(entry.plans[r.below]) == group), None)
        rule = entry.rules[memo]
        if rule is None:
            return selection
        if reuse and self.reuse_regime and memo in entry.scheduled:
            self.regime_reuses += 1
            return entry.scheduled[memo]
        selection = ruled(selection, "schedule rule", rule, entry.plans, state, selection.source)
        entry.scheduled[memo] = selection
        return selection

    def _cost_model(self, entry: RequestEntry, request: Request, state: MaskState) -> Selection:
        """Every eligible catalog plan ranked by predicted latency (stats read from the device)."""
        notes = entry.notes
        if entry.regimes:
            notes = notes + ("every plan of the regime's ranking was rejected: cost model",)
        if entry.eligible is None:
            catalog = catalog_plans(request, self.context(request.arch).kernels)
            entry.eligible, entry.eligible_names, entry.rejected = catalog
            entry.estimator = PlanEstimator(entry.eligible, request)
        if not entry.eligible:
            rejected = entry.rejected or (("native", notes[-1] if notes else "no plans"),)
            return Selection(request, (), rejected, None, "cost model", None, notes)
        estimates = estimate_with(entry.estimator, state)
        order = sorted(range(len(estimates)), key=estimates.__getitem__)  # stable: ties keep catalog order
        ranking = tuple((entry.eligible_names[i], estimates[i]) for i in order)
        return Selection(request, ranking, entry.rejected, entry.eligible[order[0]], "cost model", None, notes)


def describe_choice(regime: Regime) -> str:
    """How ``regime`` picks its plan (``Regime.choice``), in words."""
    if regime.choice == "plan_rule":
        rule = regime.plan_rule
        return (f"plan rule: {rule.below} if {STAT_NAMES[rule.stat]} <= {rule.threshold:.4g}, else {rule.above}")
    if regime.choice == "cost_model":
        return f"the cost model among the regime's {len(regime.contenders)} contenders"
    if regime.choice == "calibrated":
        scales = [scale for _, scale in regime.calibration]
        return (f"the calibrated cost model among {len(scales)} plans (each estimate times the plan's measured / "
                f"estimated latency on the regime's cases, x{min(scales):.3f} to x{max(scales):.3f})")
    return "the ranking's first eligible plan"


def ruled(selection: Selection, kind: str, rule: ScheduleRule, plans: Mapping[str, PhysicalPlan], state: MaskState,
          source: str) -> Selection:
    """``selection`` with the plan ``rule`` gives this mask's statistics (one read, kept by the
    state), when that plan is eligible for the request; the decision noted either way."""
    stats = state.host_stat_values
    plan = plans[rule.choose(stats)]
    note = f"{kind}: {rule.describe(stats)}"
    chosen = selection.chosen
    if plan != chosen:
        reason = cached_rejection(plan, selection.request)
        if reason is None:
            chosen = plan
        else:
            note = f"{note} rejected ({reason}); kept {chosen.name}"
    return Selection(selection.request, selection.ranking, selection.rejected, chosen, source, selection.regime,
                     selection.notes + (note,))


def estimate_with(estimator: PlanEstimator, state: MaskState) -> list[float]:
    """The estimator's predictions on the statistics of ``state`` (one host read, kept by the state;
    the row-union ratios the estimator's tiles need come with it)."""
    values = state.host_stat_values
    return estimator(values, state.row_union_ratios(estimator.union_rows) if estimator.union_rows else {})


# Query blocks of at most this many rows are regrouped by key set (the grouped query layout) when
# the chosen plan is a Hopper one whose query tile covers several of them: there grouping saved
# 4-15% of kernel time on the H200, on 64-row blocks next to nothing (docs/results.md, "Design
# decisions"). The rule serves tables without a ``/reused`` key (Selector.reused_plan).
GROUPED_MAX_BLOCK_Q = 32
GROUP_QUERIES_ENV = config.GROUP_QUERIES_ENV  # "0": never, "1": every plan that can, unset: the table or the rule


def reused_mask_plan(plan: PhysicalPlan, request: Request) -> PhysicalPlan:
    """The rule for a mask that comes back after running ``plan`` where the plan table has no
    ``/reused`` key for it (``Selector.reused_plan``): its grouped query layout on Hopper for query
    blocks of at most ``GROUPED_MAX_BLOCK_Q`` rows (of any size for an 8-bit request), else ``plan``
    itself."""
    if plan.q_layout is QLayout.GROUPED or not plan.can_group_queries:
        return plan
    setting = config.get("group_queries")
    if setting is False:
        return plan
    # An 8-bit request (no table keys of its own) regroups every Hopper plan that can: on the H200 at
    # 32k tokens its kernel ran 0.995-1.40x (GM 1.13x) as fast grouped as natural, blocks of 16-64
    # rows (docs/results.md, "8-bit attention").
    limited = request.precision == INPUT_PRECISION and request.block_q > GROUPED_MAX_BLOCK_Q
    if setting is None and (plan.kernel.family is not Family.HOPPER or limited):
        return plan
    return plan.grouped()


def warn_user(message: str) -> None:
    warnings.warn(message, stacklevel=4)


# Where the 8-bit kernels of each P V format (kernel_table.QUANTIZED_FAMILIES) run P V, for explain.
PV_WHERE = {"bf16": "in the inputs' 16-bit type", "int8": "on the 8-bit tensor cores"}

# Why an 8-bit choice takes a plan with one CTA per task before a persistent one.
QUANTIZED_GRID = ("the 8-bit kernels stride a persistent grid statically, where the hardware hands "
                  "one-CTA-per-task grids out as SMs free up")


def has_quantized_variant(plan: PhysicalPlan) -> bool:
    """Whether an 8-bit kernel runs ``plan`` (``catalog.quantized_kernel``)."""
    return quantized_kernel(plan.kernel) is not None


def native_candidates(request: Request, assume_native: bool = False) -> tuple[list[PhysicalPlan], str | None]:
    """Plans the loaded native library can run for ``request``, or the reason there are none.
    ``assume_native`` ranks the whole kernel table instead (to explain plans on another machine)."""
    if request.arch == "cpu":
        return [], "CPU tensors run on the reference path"
    if assume_native:
        return plans_for(request.block_q, request.block_kv, all_kernels()), None
    kernels, why_none = discover_kernels(request.arch)
    if not kernels:
        return [], why_none
    return plans_for(request.block_q, request.block_kv, kernels), None


def rank(request: Request, state: MaskState, assume_native: bool = False,
         table: PlanTable | str | None = AUTO) -> Selection:
    """The full decision for one request with a fresh Selector (``assume_native``: rank the whole
    kernel table — a full build — to explain plans on a machine without the native library)."""
    return Selector(table=table, kernels=all_kernels() if assume_native else None).rank(request, state)


def select(request: Request, state: MaskState, warn: Warn | None = None) -> PhysicalPlan | None:
    """The plan for one request with a fresh Selector (a ``Runtime`` keeps one instead)."""
    return Selector().select(request, state, warn)
