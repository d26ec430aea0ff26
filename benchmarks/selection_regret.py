"""Offline regret of plan selection, from measured kernel-study records (no GPU needed).

For every case of a kernel study (``benchmarks/kernel_study.py`` records: one latency per timed plan), the
case's mask is rebuilt from its corpus seed, and the plan each selector would choose for that
request is looked up in the records:

    table        the shipped plan table (regime lookup, ranking scan with eligibility)
    cost model   the analytic roofline model (no table), on the mask's statistics

regret = latency of the chosen plan / latency of the fastest plan measured on the case. Only the
plans the study timed count (a study with ``--plan-filter '_lpt$'`` times one task organization per
kernel and layout); a chosen plan that was not timed is reported as such, never guessed.

    python benchmarks/selection_regret.py benchmarks/results/plan_table/evaluation.jsonl.xz
    python benchmarks/selection_regret.py RECORDS --table PATH --md OUT.md
    python benchmarks/selection_regret.py RECORDS --table A.json --table B.json   # tables side by side
    python benchmarks/selection_regret.py RUN1 RUN2 --table PATH   # repeated runs of the same cases
    python benchmarks/selection_regret.py REUSED_PROFILE --first-call   # natural keys, on a reused-mask profile

With several records files (repeated profiling runs of the same cases) each (case, plan) latency is
the geometric mean over the runs that timed it in all of them, and the report adds the repeat floor:
the fastest plan of one run judged in another. No selector can be told apart from the oracle by less
than that floor, since the oracle itself scores it against a repeat of its own measurements. With
one profile records file (per-plan samples kept) the report gives the *sample floor* instead: the
same question asked of two halves of each case's samples (``sample_floor``).

Rebuilding the corpus masks is most of the time (about 5 s per 32k-token case on 2 CPU cores);
``--mask-cache DIR`` keeps each built mask (bit-packed, keyed by the case name) for the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import random
import re
import statistics
from pathlib import Path

import torch

from tessera_diffusers import LogicalMask, build_mask_state
from tessera_diffusers.catalog import all_kernels
from tessera_diffusers.corpus import CaseSpec
from tessera_diffusers.corpus.grids import grid_named
from tessera_diffusers.mask_state import MaskState
from tessera_diffusers.plan_table import load_plan_table
from tessera_diffusers.plans import DTYPE_NAMES, PhysicalPlan, QLayout, Request
from tessera_diffusers.profile.records import read_records, request_from_dict, timing_method
from tessera_diffusers.selector import AUTO, Selector

# The records were timed on the native catalog: judge the choices among its plans on any machine.
NATIVE = all_kernels()


def load_cases(path: Path) -> dict[str, dict]:
    """case name -> {"record": first record of the case, "plans": {plan name: kernel ms}}: a kernel
    study's records, or a ``tessera profile`` run's (``--split evaluation`` for held-out cases;
    records files may be compressed: ``.gz``, ``.xz``)."""
    records = list(read_records([path]))
    if records and "type" in records[0]:
        return profile_cases(records)
    cases: dict[str, dict] = {}
    for rec in records:
        entry = cases.setdefault(rec["case"], {"record": rec, "plans": {}, "abandoned": set()})
        if rec.get("kernel_ms") and rec.get("plan"):
            entry["plans"][rec["plan"]] = rec["kernel_ms"]
    return {name: c for name, c in cases.items() if c["plans"]}


def profile_cases(records: list[dict]) -> dict[str, dict]:
    """``load_cases`` of profile records: complete cases (those with a case record) and their
    validated plan latencies; the case record carries the corpus spec and the request. Plans the
    profiler abandoned after one timed sample (slower than its ``abandon_factor`` x the case's best
    so far) are listed under "abandoned": their latency is that one sample."""
    latencies: dict[str, dict[str, float]] = {}
    abandoned: dict[str, set[str]] = {}
    methods: dict[str, set[str]] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    for rec in records:
        if rec.get("type") == "plan" and rec.get("status") == "ok":
            latencies.setdefault(rec["case"], {})[rec["plan"]] = float(rec["latency_ms"])
            if len(rec.get("samples_ms") or ()) >= 2:
                samples.setdefault(rec["case"], {})[rec["plan"]] = [float(x) for x in rec["samples_ms"]]
            methods.setdefault(rec["case"], set()).add(timing_method(rec))
            if rec.get("abandoned"):
                abandoned.setdefault(rec["case"], set()).add(rec["plan"])
    return {rec["case"]: {"record": rec, "plans": latencies.get(rec["case"], {}),
                          "abandoned": abandoned.get(rec["case"], set()), "methods": methods.get(rec["case"], set()),
                          "samples": samples.get(rec["case"], {})}
            for rec in records if rec.get("type") == "case" and latencies.get(rec["case"])}


def first_call_view(run: dict[str, dict]) -> dict[str, dict]:
    """A reused-mask profile's cases as a mask's first call sees them: the plans in the grouped query
    layout dropped (a first call never re-prepares the mask), the natural plans' latencies kept (a
    kernel's time does not depend on whether its mask comes back)."""
    def natural(plan: str) -> bool:
        return not plan.split("_", 1)[0].startswith(QLayout.GROUPED.value)

    out = {}
    for name, case in run.items():
        plans = {p: ms for p, ms in case["plans"].items() if natural(p)}
        if plans:
            out[name] = {**case, "plans": plans, "abandoned": case["abandoned"] & plans.keys(),
                         "samples": {p: s for p, s in case.get("samples", {}).items() if natural(p)}}
    return out


def timing_methods(run: dict[str, dict]) -> set[str]:
    """The timing methods of a run's cases (``records.timing_method``; none for a kernel study)."""
    return set().union(*(case.get("methods", set()) for case in run.values()))


def merge_runs(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Cases of every run, with the geometric mean latency of each plan every run timed."""
    if len(runs) == 1:
        return runs[0]
    merged = {}
    for name in sorted(set.intersection(*(set(run) for run in runs))):
        plans = set.intersection(*(set(run[name]["plans"]) for run in runs))
        if plans:
            merged[name] = {"record": runs[0][name]["record"],
                            "plans": {p: math.exp(sum(math.log(run[name]["plans"][p]) for run in runs) / len(runs))
                                      for p in plans},
                            "abandoned": set().union(*(run[name]["abandoned"] for run in runs)) & plans}
    return merged


def repeat_floor(runs: list[dict[str, dict]], labels: list[str]) -> list[str]:
    """For each ordered pair of runs: the regret, in the second, of the plan fastest in the first."""
    lines = []
    for a, run_a in enumerate(runs):
        for b, run_b in enumerate(runs):
            if a == b:
                continue
            values = []
            for name in set(run_a) & set(run_b):
                plans = set(run_a[name]["plans"]) & set(run_b[name]["plans"])
                if plans:
                    pick = min(plans, key=run_a[name]["plans"].get)
                    values.append(run_b[name]["plans"][pick] / min(run_b[name]["plans"][p] for p in plans))
            if values:
                lines.append(f"- repeat floor: the fastest plan of `{labels[a]}` judged in `{labels[b]}`: "
                             f"{summary_text(values)}")
    return lines


def sample_floor(run: dict[str, dict], splits: int = 20, seed: int = 0) -> str | None:
    """How precise a run is as a judge, from its own samples: per case, the plans' timed samples
    split at random into two halves (the same split for every plan: samples of one round belong
    together), the fastest plan by the medians of one half judged by the medians of the other;
    ``splits`` splits pooled. A selector that always picked the truly fastest plan would score about
    this (pessimistic: each half has fewer samples than the judge). None without per-plan samples."""
    rng = random.Random(seed)
    values = []
    for name in sorted(run):
        timed = run[name].get("samples") or {}
        if len(timed) < 2:
            continue
        n = min(len(v) for v in timed.values())
        for _ in range(splits):
            order = rng.sample(range(n), n)
            first, second = order[: n // 2], order[n // 2:]
            a = {p: statistics.median(v[i] for i in first) for p, v in timed.items()}
            b = {p: statistics.median(v[i] for i in second) for p, v in timed.items()}
            values.append(b[min(a, key=a.get)] / min(b.values()))
    if not values:
        return None
    return (f"- sample floor of the judge: each case's fastest plan by the medians of half its samples, judged by "
            f"the medians of the other half ({splits} random splits): {summary_text(values, unit='case splits')}")


def summary_text(values: list[float], aside: str = "", unit: str = "cases") -> str:
    """GM, P99, worst and the share within 3% of ``values`` (regrets); ``aside`` goes in the parentheses."""
    within = sum(v <= 1.03 for v in values)
    p99 = sorted(values)[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
    return (f"GM regret {gm_of(values):.4f}, P99 {p99:.3f}, worst {max(values):.3f}, within 3% on "
            f"{within}/{len(values)} {unit} ({100 * within / len(values):.0f}%{aside})")


def case_spec(name: str, rec: dict) -> CaseSpec:
    _family, source, grid, heads, seed = name.split("/")
    return CaseSpec(rec["geometry"], source, grid_named(grid), int(heads.lstrip("h")), int(seed.lstrip("s")))


def cached_mask(cache: Path | None, name: str, build) -> LogicalMask:
    """``build()``, or the mask a previous run built for case ``name`` and kept in ``cache``
    (one file per case: the block matrix bit-packed, and the geometry)."""
    if cache is None:
        return build()
    path = cache / f"{hashlib.sha1(name.encode()).hexdigest()[:20]}.pt"
    if path.is_file():
        kept = torch.load(path)
        if kept["case"] == name:
            shape, count = tuple(kept["shape"]), math.prod(kept["shape"])
            bits = (kept["packed"].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
            blocks = bits.reshape(-1)[:count].to(torch.bool).reshape(shape)
            return LogicalMask.from_blocks(blocks, *kept["geometry"])
    mask = build()
    flat = mask.blocks.reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)]).reshape(-1, 8)
    packed = (flat << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"case": name, "shape": list(mask.blocks.shape), "packed": packed,
                "geometry": [mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv]}, path)
    return mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", type=Path, nargs="+",
                        help="records.jsonl of a kernel study or a profile run; several: repeated runs of the "
                             "same cases (latencies averaged, repeat floor reported)")
    parser.add_argument("--table", action="append", default=None,
                        help="plan table file (default: the shipped one); repeat to compare tables on the "
                             "same masks (one column each, named by the file)")
    parser.add_argument("--arch", default="sm90")
    parser.add_argument("--md", type=Path, default=None, help="also write the table as markdown here")
    parser.add_argument("--same-cases-as", type=Path, default=None,
                        help="judge only the cases that this other records file also has")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw the regret of every selector here (PNG: per-case CDF, per-family GM)")
    parser.add_argument("--first-call", action="store_true",
                        help="judge a reused-mask profile (--reused-masks) as the masks' first calls: the "
                             "natural keys' choice among the natural plans (grouped-layout plans dropped)")
    parser.add_argument("--mask-cache", type=Path, default=None,
                        help="keep built masks here and reuse them on the next run")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.records if not path.is_file()]
    if missing:
        parser.error(f"records: no file {missing[0]}")

    if args.table is None or args.table == [AUTO]:
        selectors = {"table": Selector(table=AUTO, kernels=NATIVE)}
    elif len(args.table) == 1:
        selectors = {"table": Selector(table=load_plan_table(Path(args.table[0])), kernels=NATIVE)}
    else:
        selectors = {f"table {Path(t).name}": Selector(table=load_plan_table(Path(t)), kernels=NATIVE)
                     for t in args.table}
        if len(selectors) < len(args.table):
            parser.error("give tables with different file names")
    selectors["cost model"] = Selector(table=None, kernels=NATIVE)
    rows, regrets = [], {name: [] for name in selectors}
    splits: dict[str, list[tuple[float, float]]] = {name: [] for name in selectors}
    runs = [load_cases(path) for path in args.records]
    if args.first_call:
        runs = [first_call_view(run) for run in runs]
    if args.same_cases_as is not None:
        keep = set(load_cases(args.same_cases_as))
        runs = [{name: case for name, case in run.items() if name in keep} for run in runs]
    for name, case in sorted(merge_runs(runs).items()):
        rec = case["record"]
        if rec.get("type") == "case":  # a profile record: the spec and the request are stored
            mask = cached_mask(args.mask_cache, name, CaseSpec.from_dict(rec["spec"]).build)
            request = request_from_dict(rec["request"])
            if args.first_call:
                request = dataclasses.replace(request, reused_mask=False)
        else:
            mask = cached_mask(args.mask_cache, name, case_spec(name, rec).build)
            request = Request(rec["batch"], rec["heads"], mask.seq_len_q, mask.seq_len_kv, rec["head_dim"],
                              DTYPE_NAMES[getattr(torch, rec["dtype"])], mask.block_q, mask.block_kv, args.arch,
                              False)
        state = build_mask_state(mask)
        best_plan, best_ms = min(case["plans"].items(), key=lambda kv: kv[1])
        row = {"case": name, "best": best_plan, "best_ms": best_ms}
        for sel_name, selector in selectors.items():
            chosen = deployed_choice(selector, request, state)
            ms = case["plans"].get(chosen.name) if chosen is not None else None
            row[sel_name] = (chosen.name if chosen is not None else None, ms,
                             chosen is not None and chosen.name in case["abandoned"])
            if ms is not None:
                regrets[sel_name].append(ms / best_ms)
                row[f"{sel_name} split"] = regret_split(case["plans"], chosen.name, best_ms)
                splits[sel_name].append(row[f"{sel_name} split"])
        rows.append(row)

    lines = ["| case | fastest timed plan | ms | " + " | ".join(f"{s} choice | {s} regret" for s in selectors) + " |",
             "|---|---|---|" + "---|---|" * len(selectors)]
    for row in rows:
        cells = []
        for sel_name in selectors:
            plan, ms, one_sample = row[sel_name]
            cells += [plan or "reference", f"{ms / row['best_ms']:.3f}{'*' if one_sample else ''}" if ms else "not timed"]
        lines.append(f"| {row['case']} | {row['best']} | {row['best_ms']:.3f} | " + " | ".join(cells) + " |")
    lines.append("")
    for sel_name, values in regrets.items():
        if values:
            aside = (f"; {len(rows) - len(values)} choices not timed, "
                     f"{sum(row[sel_name][2] for row in rows)} timed by one abandoned sample")
            lines.append(f"- {sel_name}: {summary_text(values, aside)}; "
                         f"of it, the task organization within the chosen tile GM {gm_of(o for o, _ in splits[sel_name]):.4f}, "
                         f"the tile GM {gm_of(t for _, t in splits[sel_name]):.4f}")
    methods = [timing_methods(run) for run in runs]
    if len(set().union(*methods)) > 1:
        lines.append(f"- note: the records mix timing methods ({', '.join('/'.join(sorted(m)) or '-' for m in methods)}): "
                     "sequential and interleaved times are not comparable")
    if len(runs) > 1:
        lines += [f"- latencies: geometric mean of {len(runs)} runs of the same cases, plans timed in all of them",
                  *repeat_floor(runs, [str(path) for path in args.records])]
    else:
        judged = {row["case"] for row in rows}
        floor = sample_floor({name: case for name, case in runs[0].items() if name in judged})
        if floor is not None:
            lines.append(floor)
    lines.append("")
    lines.append("`*`: the profiler abandoned that plan after one timed sample slower than its abandon factor x "
                 "the case's best so far; the regret uses that one sample.")
    lines.append("")
    lines += family_lines(rows, list(selectors))
    text = "\n".join(lines)
    print(text)
    if args.md is not None:
        sources = ", ".join(f"`{path}`" for path in args.records)
        args.md.write_text(f"# Selection regret on {sources}\n\n{text}\n")
    if args.plot is not None:
        plot_regret(args.plot, rows, regrets, ", ".join(path.parent.name for path in args.records))
    return 0


def plot_regret(path: Path, rows: list[dict], regrets: dict[str, list[float]], title: str) -> None:
    """Left: each selector's per-case regret as a CDF, with the issue's 3% line. Right: the GM
    regret per family, one bar per selector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    selectors = [s for s, values in regrets.items() if values]
    families = sorted({family_of(row["case"]) for row in rows})
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [1, 1.6]})
    for sel_name in selectors:
        values = sorted(regrets[sel_name])
        cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                 label=f"{sel_name} (GM {gm_of(values):.4f})")
    cdf.axvline(1.03, color="grey", lw=0.8, ls="--")
    cdf.set_xlabel("regret (chosen plan ms / fastest timed plan ms)")
    cdf.set_ylabel("fraction of cases")
    cdf.legend(fontsize=7, loc="lower right")
    width = 0.8 / max(1, len(selectors))
    by_family = family_regrets(rows, selectors)
    for i, sel_name in enumerate(selectors):
        ys = [gm_of(mine) - 1.0 if (mine := by_family.get(family, {}).get(sel_name)) else 0.0 for family in families]
        bars.bar([x + i * width for x in range(len(families))], [100 * y for y in ys], width, label=sel_name)
    bars.set_xticks([x + 0.4 - width / 2 for x in range(len(families))], families, rotation=30)
    bars.set_ylabel("GM regret per family (% over the fastest)")
    bars.legend(fontsize=7)
    fig.suptitle(f"Selection regret, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def deployed_choice(selector: Selector, request: Request, state: MaskState) -> PhysicalPlan | None:
    """The plan the runtime runs for ``request``: its selection; for a mask that comes back
    (``request.reused_mask``, a ``--reused-masks`` profile) the plan the runtime re-prepares it in
    after that first selection (``Selector.reused_plan``: the table's ``/reused`` key where it has
    one, else the rule), so a table without the key is judged by what it would really do."""
    if not request.reused_mask:
        return selector.select(request, state)
    natural = dataclasses.replace(request, reused_mask=False)
    first = selector.select(natural, state)
    return None if first is None else selector.reused_plan(first, natural, state)


def regret_split(plans: dict[str, float], chosen: str, best_ms: float) -> tuple[float, float]:
    """The chosen plan's regret as (task organization, tile): its time over the fastest timed plan
    of its own tile group (``plan_table.tile_group``: the same name but for the pipeline depth and the
    task organization, ``_s<stages>w<warps>_<organization>``), and that plan's time over the fastest
    of all. The product is the regret."""
    group = tile_of(chosen)
    group_best = min(ms for name, ms in plans.items() if tile_of(name) == group)
    return plans[chosen] / group_best, group_best / best_ms


def tile_of(plan: str) -> str:
    return re.sub(r"_s\d+w(\d+)_[^_]+$", r"_w\1", plan)


def gm_of(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def family_regrets(rows: list[dict], selectors: list[str]) -> dict[str, dict[str, list[float]]]:
    """family (the case name's first part) -> selector -> the regrets of its timed choices."""
    families: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        family = family_of(row["case"])
        for sel_name in selectors:
            ms = row[sel_name][1]
            if ms:
                families.setdefault(family, {}).setdefault(sel_name, []).append(ms / row["best_ms"])
    return families


def family_lines(rows: list[dict], selectors: list[str]) -> list[str]:
    """GM regret per geometry family (the case name's first part) and selector."""
    families = family_regrets(rows, selectors)
    out = ["| family | cases | " + " | ".join(f"{s} GM regret" for s in selectors) + " |",
           "|---|---|" + "---|" * len(selectors)]
    for family, by_sel in sorted(families.items()):
        n = max(len(v) for v in by_sel.values())
        cells = [f"{gm_of(v):.4f}" if (v := by_sel.get(s)) else "-" for s in selectors]
        out.append(f"| {family} | {n} | " + " | ".join(cells) + " |")
    out += ["", "GM regret split per family: the task organization within the chosen tile x the tile", "",
            "| family | " + " | ".join(selectors) + " |", "|---|" + "---|" * len(selectors)]
    for family in sorted(families):
        cells = []
        for sel_name in selectors:
            parts = [row[f"{sel_name} split"] for row in rows
                     if f"{sel_name} split" in row and family_of(row["case"]) == family]
            cells.append(f"{gm_of(o for o, _ in parts):.4f} x {gm_of(t for _, t in parts):.4f}" if parts else "-")
        out.append(f"| {family} | " + " | ".join(cells) + " |")
    return out


def family_of(case: str) -> str:
    """The geometry family of a case name (``n32k:Q64K64-HD/source/...:bf16:d128:b1[:reused]`` or
    ``Q64K64/source/...``): the first part of its corpus case, the ``:``-field with slashes."""
    return next((part for part in case.split(":") if "/" in part), case).split("/")[0]


if __name__ == "__main__":
    raise SystemExit(main())
