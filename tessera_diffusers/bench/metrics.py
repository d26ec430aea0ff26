"""Aggregates of DESIGN section 9 over the records of a run (pure functions of the records).

- efficiency: a record's effective TFLOP/s over the same case's dense cuDNN TFLOP/s;
- family speedup of Tessera over a baseline: ratio of means over paired cases (both valid);
- nine-family GM (the nine frame-major families; Q384K384 reported beside it), paired-case GM;
- win / tie / loss with a 3% tie band on each paired case;
- regret: the selected plan's latency over the fastest valid plan measured on the same case.

Two synthetic baselines are derived, never measured: ``flashinfer-best`` (per size and family, the
FlashInfer variant with the lowest mean latency among those that ran on the most cases) and
``tessera-best-plan`` (per size and family, the single catalog plan with the lowest mean latency
among plans valid on all the family's cases).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable

from ..corpus import NINE_FAMILIES

TIE_BAND = 0.03
DENSE_YARDSTICK = "sdpa-cudnn"
TESSERA = "tessera"
BEST_PLAN = "tessera-best-plan"
FLASHINFER_BEST = "flashinfer-best"
PLAN_PREFIX = "tessera:"


def geometric_mean(values: Iterable[float]) -> float:
    """``statistics.geometric_mean`` of the positive finite values; NaN for none."""
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return statistics.geometric_mean(values) if values else math.nan


def case_key(record: dict) -> tuple[str, str]:
    return record["size"], record["case"]


def ok(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r.get("status") == "ok"]


def index_by_case(records: Iterable[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    table: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in ok(records):
        table[case_key(r)][r["backend"]] = r
    return table


def with_efficiency(records: list[dict]) -> list[dict]:
    """Copies of the valid records with ``efficiency`` = TFLOP/s over the case's dense cuDNN TFLOP/s."""
    cases = index_by_case(records)
    out = []
    for r in ok(records):
        r = dict(r)
        dense = cases[case_key(r)].get(DENSE_YARDSTICK)
        r["efficiency"] = r["tflops"] / dense["tflops"] if dense and dense.get("tflops") else None
        out.append(r)
    return out


def derived_best(records: list[dict], members: Callable[[str], bool], label: str, need_all_cases: bool) -> list[dict]:
    """Per (size, family): the member backend with the lowest mean kernel latency; its records
    relabelled ``label`` (with ``variant`` naming the member)."""
    groups: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    family_cases: dict[tuple[str, str], set] = defaultdict(set)
    for r in ok(records):
        if members(r["backend"]):
            groups[(r["size"], r["family"])][r["backend"]].append(r)
            family_cases[(r["size"], r["family"])].add(r["case"])
    out = []
    for key, by_backend in groups.items():
        most = max(len(v) for v in by_backend.values())
        wanted = len(family_cases[key]) if need_all_cases else most
        eligible = {b: rs for b, rs in by_backend.items() if len(rs) >= wanted}
        if not eligible:
            continue
        best = min(eligible, key=lambda b: statistics.fmean(r["kernel_ms"] for r in eligible[b]))
        for r in eligible[best]:
            out.append({**r, "backend": label, "variant": best})
    return out


def augmented(records: list[dict]) -> list[dict]:
    """Valid records with efficiency plus the derived ``flashinfer-best`` and ``tessera-best-plan``."""
    base = with_efficiency(records)
    fi = derived_best(base, lambda b: b.startswith("flashinfer-"), FLASHINFER_BEST, need_all_cases=False)
    plans = derived_best(base, lambda b: b.startswith(PLAN_PREFIX), BEST_PLAN, need_all_cases=True)
    return base + fi + plans


def family_table(records: list[dict]) -> dict[str, dict[str, dict[str, dict]]]:
    """``[size][family][backend]`` -> cases, mean kernel / request ms, TFLOP/s, efficiency, density."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in records:
        if r["backend"].startswith(PLAN_PREFIX):
            continue  # individual plans are in the kernel study, not in the family table
        groups[(r["size"], r["family"], r["backend"])].append(r)
    table: dict[str, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for (size, family, backend), rs in groups.items():
        eff = [r["efficiency"] for r in rs if r.get("efficiency") is not None]
        requests = [r["request_ms"] for r in rs if r.get("request_ms") is not None]
        table[size][family][backend] = {
            "cases": len(rs),
            "kernel_ms": statistics.fmean(r["kernel_ms"] for r in rs),
            "request_ms": statistics.fmean(requests) if len(requests) == len(rs) else None,
            "tflops": statistics.fmean(r["tflops"] for r in rs),
            "efficiency": statistics.fmean(eff) if eff else None,
            "density": statistics.fmean(r["density"] for r in rs if r.get("density") is not None)
            if any(r.get("density") is not None for r in rs) else None,
            "variants": sorted({r["variant"] for r in rs if "variant" in r}),
        }
    return table


def compare(records: list[dict], target: str, baseline: str, band: float = TIE_BAND) -> dict[str, dict]:
    """Speedup of ``target`` over ``baseline`` per size: family ratios of means over paired cases,
    nine-family GM, paired-case GM, win/tie/loss (target faster by more than ``band`` is a win)."""
    by_case: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in records:
        if r["backend"] in (target, baseline):
            by_case[case_key(r)][r["backend"]] = r
    per_size: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for (size, _), pair in by_case.items():
        if target in pair and baseline in pair:
            per_size[size].append((pair[target]["family"], pair[baseline]["kernel_ms"], pair[target]["kernel_ms"]))
    out = {}
    for size, pairs in per_size.items():
        families: dict[str, dict] = {}
        for family in sorted({p[0] for p in pairs}):
            fam_pairs = [p for p in pairs if p[0] == family]
            base_mean = statistics.fmean(p[1] for p in fam_pairs)
            target_mean = statistics.fmean(p[2] for p in fam_pairs)
            families[family] = {"speedup": base_mean / target_mean, "cases": len(fam_pairs)}
        relative = [t / b - 1.0 for _, b, t in pairs]
        out[size] = {
            "families": families,
            "nine_family_gm": geometric_mean(v["speedup"] for f, v in families.items() if f in NINE_FAMILIES),
            "nine_families_present": sum(1 for f in families if f in NINE_FAMILIES),
            "paired_case_gm": geometric_mean(b / t for _, b, t in pairs),
            "cases": len(pairs),
            "win": sum(1 for x in relative if x < -band),
            "tie": sum(1 for x in relative if -band <= x <= band),
            "loss": sum(1 for x in relative if x > band),
        }
    return out


def regrets(records: list[dict]) -> list[dict]:
    """Per case with the selected plan and at least one forced plan measured: selected / fastest."""
    cases = index_by_case(records)
    out = []
    for (size, case), by_backend in sorted(cases.items()):
        selected = by_backend.get(TESSERA)
        plans = {b[len(PLAN_PREFIX):]: r for b, r in by_backend.items() if b.startswith(PLAN_PREFIX)}
        if selected is None or not plans or "selected_plan" not in selected:
            continue
        best_name = min(plans, key=lambda n: plans[n]["kernel_ms"])
        chosen = plans.get(selected["selected_plan"])
        chosen_ms = chosen["kernel_ms"] if chosen else selected["kernel_ms"]
        out.append({
            "size": size,
            "case": case,
            "family": selected["family"],
            "selected_plan": selected["selected_plan"],
            "selected_ms": chosen_ms,
            "best_plan": best_name,
            "best_ms": plans[best_name]["kernel_ms"],
            "regret": chosen_ms / plans[best_name]["kernel_ms"],
            "plans_measured": len(plans),
        })
    return out


def status_counts(records: list[dict]) -> dict[str, dict]:
    """Per backend: how many records of each status, rows without keys that were not 0, the longest
    first call (compilation / JIT included), and the distinct non-ok reasons."""
    out: dict[str, dict] = defaultdict(
        lambda: {"ok": 0, "skipped": 0, "invalid": 0, "failed": 0, "nonzero_empty_rows": 0, "max_first_call_s": None,
                 "reasons": []})
    for r in records:
        name = PLAN_PREFIX + "*" if r["backend"].startswith(PLAN_PREFIX) else r["backend"]
        entry = out[name]
        entry[r.get("status", "failed")] = entry.get(r.get("status", "failed"), 0) + 1
        first = r.get("first_call_s")
        if first is not None and not r.get("shared_with_shape"):
            entry["max_first_call_s"] = max(first, entry["max_first_call_s"] or 0.0)
        if not (r.get("check") or {}).get("empty_rows_zero", True):
            entry["nonzero_empty_rows"] += 1  # rows without keys should be 0 (DESIGN section 1)
        reason = r.get("reason")
        if reason and reason not in entry["reasons"] and len(entry["reasons"]) < 5:
            entry["reasons"].append(reason)
    return dict(out)


def summarize(records: list[dict], band: float = TIE_BAND) -> dict:
    """Everything the report shows, as plain data."""
    rows = augmented(records)
    backends = sorted({r["backend"] for r in rows if not r["backend"].startswith(PLAN_PREFIX)})
    baselines = [b for b in backends if b not in (TESSERA, BEST_PLAN)]
    speedups = {}
    for target in (TESSERA, BEST_PLAN):
        if target in backends:
            speedups[target] = {b: compare(rows, target, b, band) for b in baselines}
    vs_dense = {b: compare(rows, b, DENSE_YARDSTICK, band) for b in backends if b != DENSE_YARDSTICK}
    regret_rows = regrets(records)
    regret_values = sorted(r["regret"] for r in regret_rows)
    return {
        "families": family_table(rows),
        "speedups": speedups,
        "vs_dense_cudnn": vs_dense,
        "regret": {
            "cases": regret_rows,
            "median": statistics.median(regret_values) if regret_values else None,
            "p90": regret_values[min(len(regret_values) - 1, int(0.9 * len(regret_values)))] if regret_values else None,
            "max": max(regret_values) if regret_values else None,
            "within_5pct": sum(1 for v in regret_values if v <= 1.05) / len(regret_values) if regret_values else None,
        },
        "status": status_counts(records),
        "tie_band": band,
    }
