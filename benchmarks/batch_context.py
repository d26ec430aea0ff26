"""Does a plan's interleaved time depend on what else shares its batch?

In the interleaved H200 profile (``benchmarks/results/h200_profile_interleaved``) the best 64 x 64
plan over the best 128 x 128 plan of one case came out a median 1.9% (up to 9%) lower in cases timed
with only their ~30 contenders than in cases timed with all ~70 eligible plans, and the held-out
cases (all plans) agreed with the latter. One explanation: a batch of only fast, efficient plans
keeps the GPU at its power limit and its clock lower (1,695-1,980 MHz under load), which slows a
compute-bound tile more than a latency-bound one. This script measures it directly (on the H200,
``benchmarks/results/h200_batch_context``: no, the four contexts agree within the timing noise;
those records compared different cases). Per case:

1. every eligible plan is validated against the fp32 oracle;
2. the *targets* — the fastest-predicted plan of each tile group, at most ``--targets`` — are timed
   interleaved (``bench.timing.time_interleaved``) under each *context*:
       alone       the targets only
       full        the targets among every other valid plan of the case (only the targets reported)
       gemm        the targets only, each launch after a dense bf16 GEMM of ``--gemm`` cubed
                   (a model's projections between two attention calls; outside the timed span)
       full+gemm   both
   the contexts in a shuffled order, ``--repeats`` times each;
3. the SM clock and power are sampled every 50 ms (``nvidia-smi``) and averaged per context.

Reported per case and context: each target's median time over the repeats, the ratio of the best
64-row-tile target to the best 128-row-tile target, and which target is fastest. If the ratio moves
with the context but not within one context, the profiler must time every case in one fixed
context (and the table should be profiled in the one that looks like a model's forward pass).

    python benchmarks/batch_context.py --out DIR --families Q16K16,Q32K32,Q64K32,Q64K64 \\
        --sources sliding_tile,importance_topk --cases 8 --plan-filter hopper
    python benchmarks/batch_context.py --out DIR --smoke         # CPU, PyTorch executor plans

``--from-records PROFILE [EVAL]`` reads the question off profile records instead (no GPU): per
(family, source), the same ratio in cases timed with all their plans against cases timed with
their contenders only (``--contenders-after``), and against a second records file.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from tessera_diffusers.bench.problem import OracleCheck, check_heads, make_inputs
from tessera_diffusers.bench.tessera_backends import request_of
from tessera_diffusers.bench.timing import INTERLEAVED_WARM_LAUNCHES, gemm_context, time_interleaved
from tessera_diffusers.cost_model import estimate_ms
from tessera_diffusers.mask_state import build_mask_state
from tessera_diffusers.plan_table import tile_group
from tessera_diffusers.profile.config import ProfileConfig, add_case_arguments, require_positive, study_config
from tessera_diffusers.profile.records import read_records
from tessera_diffusers.profile.runner import build_problem, case_plans, profiling_kernels, validate_plan

CONTEXTS = ("alone", "full", "gemm", "full+gemm")
INPUT_SETS = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory of batch_context.json and .md")
    add_case_arguments(parser, families="Q16K16,Q32K32,Q64K32,Q64K64", cases=8)
    parser.add_argument("--targets", type=int, default=6, help="tile groups compared per case at most")
    parser.add_argument("--repeats", type=int, default=2, help="timings of each context per case")
    parser.add_argument("--reps", type=int, default=5, help="samples per plan in one timing")
    parser.add_argument("--gemm", type=int, default=8192, help="size of the GEMM context (n x n x n, bf16)")
    parser.add_argument("--from-records", type=Path, nargs="+", default=None, metavar="RECORDS",
                        help="offline: profile records (and held-out records to compare with), no timing")
    args = parser.parse_args(argv)
    require_positive(parser, args, "cases", "targets", "repeats", "reps", "gemm")
    return args


class ClockSampler:
    """``nvidia-smi`` sampling the SM clock and power every 50 ms into a file while a run lasts;
    nothing on a machine without it. ``marks`` are the (context, start, end) wall-clock spans."""

    def __init__(self, path: Path):
        self.path, self.proc, self.file = path, None, None
        self.marks: list[tuple[str, float, float]] = []
        if shutil.which("nvidia-smi") and torch.cuda.is_available():
            self.file = open(path, "w")  # noqa: SIM115  (closed in stop())
            query = "--query-gpu=timestamp,clocks.sm,power.draw"
            self.proc = subprocess.Popen(["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "50"],
                                         stdout=self.file, stderr=subprocess.DEVNULL)

    def stop(self) -> list[tuple[float, float, float]]:
        """The (wall-clock time, MHz, W) samples taken."""
        if self.proc is None:
            return []
        self.proc.terminate()
        self.proc.wait()
        self.file.close()
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                stamp, mhz, watts = (x.strip() for x in line.split(","))
                when = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()  # local time, as time.time()
                rows.append((when, float(mhz), float(watts)))
            except ValueError:
                continue
        return rows


def time_case(size: str, case, config: ProfileConfig, args: argparse.Namespace, rng: random.Random,
              sampler: ClockSampler) -> dict:
    device = torch.device(config.device)
    problem = build_problem(size, case, config, device)
    request = request_of(problem)
    plans, _ = case_plans(request, profiling_kernels(device), config.plan_filter)
    state = build_mask_state(problem.mask)
    stats = state.host_stats()
    plans.sort(key=lambda p: estimate_ms(p, request, stats))
    inputs = make_inputs(problem, INPUT_SETS, config.seed)
    oracle = OracleCheck(problem, inputs[0], check_heads(problem.heads, config.validate_heads), config.atol)
    runs: dict[str, object] = {}
    for plan in plans:
        record, _, run = validate_plan(problem.name, plan, problem, state, inputs, oracle)
        if run is None:
            print(f"  {plan.name}: {record.get('reason')}; not timed", file=sys.stderr)
        else:
            runs[plan.name] = run
    groups: dict[tuple, str] = {}
    for plan in plans:  # the fastest-predicted valid plan of each tile group
        if plan.name in runs:
            groups.setdefault(tile_group(plan), plan.name)
    targets = list(groups.values())[: args.targets]
    others = [name for name in runs if name not in targets]
    gemm = gemm_context(args.gemm if device.type == "cuda" else 64, device)
    times: dict[str, dict[str, list[float]]] = {c: {t: [] for t in targets} for c in CONTEXTS}
    contexts = [c for c in CONTEXTS for _ in range(args.repeats)]
    rng.shuffle(contexts)
    for context in contexts:
        names = targets + (others if context.startswith("full") else [])
        rounds = max(3, math.ceil(INTERLEAVED_WARM_LAUNCHES / len(names)))
        start = time.time()
        timings = time_interleaved([runs[n] for n in names], INPUT_SETS, rounds, config.reps, device,
                                   between=gemm if context.endswith("gemm") else None)
        sampler.marks.append((context, start, time.time()))
        for name, timing in zip(names, timings):
            if name in times[context]:
                times[context][name].append(timing.median_ms)
    del problem, inputs, oracle, runs, state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"case": case.name, "plans": len(plans), "targets": targets, "others": len(others), "times": times}


def tile_rows(name: str) -> int | None:
    """The query-tile height a plan name carries (``..._q128k64_from_...``), or None."""
    head = name.split("_from_")[0]
    part = head.rsplit("_", 1)[-1]
    return int(part[1:part.index("k")]) if part.startswith("q") and "k" in part else None


def summarize(entry: dict) -> dict:
    out = {"case": entry["case"], "contexts": {}}
    for context, by_plan in entry["times"].items():
        medians = {name: statistics.median(v) for name, v in by_plan.items() if v}
        if not medians:
            continue
        best = min(medians, key=medians.get)
        small = [ms for name, ms in medians.items() if tile_rows(name) == 64]
        tall = [ms for name, ms in medians.items() if tile_rows(name) == 128]
        out["contexts"][context] = {
            "fastest": best,
            "fastest_ms": medians[best],
            "q64_over_q128": min(small) / min(tall) if small and tall else None,
            "spread": max(max(v) / min(v) for v in by_plan.values() if v),
        }
    return out


def clock_lines(samples: list[tuple[float, float, float]], marks: list[tuple[str, float, float]]) -> list[str]:
    if not samples:
        return ["(no clock samples: nvidia-smi not available)"]
    lines = ["| context | mean SM clock MHz | mean power W | samples |", "|---|---|---|---|"]
    for context in CONTEXTS:
        picked = [(mhz, w) for t, mhz, w in samples for label, a, b in marks if label == context and a <= t <= b]
        if picked:
            lines.append(f"| {context} | {statistics.mean(m for m, _ in picked):.0f} | "
                         f"{statistics.mean(w for _, w in picked):.0f} | {len(picked)} |")
    return lines


def markdown(summaries: list[dict], clocks: list[str], args: argparse.Namespace) -> str:
    intro = ("Ratio of the best 64-row-tile target to the best 128-row-tile target (median over "
             f"{args.repeats} timings of each context), and the fastest target:")
    lines = ["# Interleaved time by batch context", "",
             f"`python benchmarks/batch_context.py {' '.join(sys.argv[1:])}`", "", intro, "",
             "| case | " + " | ".join(CONTEXTS) + " | fastest per context |", "|---|" + "---|" * (len(CONTEXTS) + 1)]
    for s in summaries:
        cells = []
        for context in CONTEXTS:
            c = s["contexts"].get(context, {})
            ratio = c.get("q64_over_q128")
            cells.append("-" if ratio is None else f"{ratio:.3f}")
        fastest = ", ".join(sorted({c["fastest"].split("_from_")[0] for c in s["contexts"].values()}))
        lines.append(f"| {s['case']} | " + " | ".join(cells) + f" | {fastest} |")
    lines += ["", "Largest max/min of one target's medians across the timings of one context (the noise):", ""]
    for context in CONTEXTS:
        spreads = [s["contexts"][context]["spread"] for s in summaries if context in s["contexts"]]
        if spreads:
            lines.append(f"- {context}: median {statistics.median(spreads):.4f}, max {max(spreads):.4f}")
    lines += ["", *clocks, ""]
    return "\n".join(lines)


def tile_ratio(latencies: dict[str, float]) -> float | None:
    """log(best 64-row-tile ms / best 128-row-tile ms) of one case, or None without both."""
    best: dict[int | None, float] = {}
    for plan, ms in latencies.items():
        rows = tile_rows(plan)
        best[rows] = min(best.get(rows, math.inf), ms)
    return math.log(best[64] / best[128]) if 64 in best and 128 in best else None


def persistent_ratio(latencies: dict[str, float]) -> float | None:
    """Mean log(persistent-grid ms / one-CTA-per-task ms) over the builds of one case timed both ways
    (``..._lpt-persistent`` against ``..._lpt``), or None without such a pair."""
    logs = [math.log(ms / latencies[plan[: -len("-persistent")]]) for plan, ms in latencies.items()
            if plan.endswith("_lpt-persistent") and plan[: -len("-persistent")] in latencies]
    return statistics.mean(logs) if logs else None


MEASURES = {"best 64-row tile over best 128-row tile": tile_ratio,
            "persistent grid over one CTA per task, the same build": persistent_ratio}


def records_ratios(path: Path, measure) -> dict[tuple[str, str, str], list[float]]:
    """``measure(latencies)`` per (family, source, batch) of a records file; batch "all" where the
    case timed every eligible plan, "contenders" where it was pruned (``--contenders-after``)."""
    cases, latencies = {}, {}
    for record in read_records([path]):
        if record.get("type") == "case":
            cases[record["case"]] = record
        elif record.get("type") == "plan" and record.get("status") == "ok":
            latencies.setdefault(record["case"], {})[record["plan"]] = float(record["latency_ms"])
    out: dict[tuple[str, str, str], list[float]] = {}
    for name, record in cases.items():
        value = measure(latencies.get(name, {}))
        if value is not None:
            batch = "contenders" if record.get("pruned") else "all"
            out.setdefault((record["family"], record["source"], batch), []).append(value)
    return out


def from_records(paths: list[Path]) -> str:
    """The offline report of ``--from-records``: per measure, the median over (family, source) of
    its ratio between the batches."""
    one, two = paths[0].parent.name, paths[-1].parent.name
    lines = ["# Relative plan times by the batch a case was timed in", ""]
    for title, measure in MEASURES.items():
        first = records_ratios(paths[0], measure)
        second = records_ratios(paths[1], measure) if len(paths) > 1 else {}
        pairs = [("contenders", first, "all", first, f"contenders only vs all plans, both {one}")]
        if second:
            pairs += [("contenders", first, "all", second, f"{one} contenders only vs {two} all plans"),
                      ("all", first, "all", second, f"{one} all plans vs {two} all plans")]
        lines += [f"## {title}", "", "| cases compared | family/source pairs | median ratio of ratios | range |",
                  "|---|---|---|---|"]
        for batch_a, a, batch_b, b, label in pairs:
            logs = [statistics.mean(a[(f, src, batch_a)]) - statistics.mean(b[(f, src, batch_b)])
                    for f, src, batch in a if batch == batch_a and (f, src, batch_b) in b]
            if logs:
                lines.append(f"| {label} | {len(logs)} | {math.exp(statistics.median(logs)):.3f} | "
                             f"{math.exp(min(logs)):.3f}-{math.exp(max(logs)):.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_records:
        args.out.mkdir(parents=True, exist_ok=True)
        text = from_records(args.from_records)
        (args.out / "batch_context_from_records.md").write_text(text)
        print(text)
        return 0
    config = study_config(args, reps=args.reps)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    sampler = ClockSampler(args.out / "clocks.csv")
    raw = []
    try:
        for size, case in config.cases():
            print(f"{case.name}: timing", flush=True)
            raw.append(time_case(size, case, config, args, rng, sampler))
    finally:
        samples = sampler.stop()
    summaries = [summarize(entry) for entry in raw if entry["targets"]]
    (args.out / "batch_context.json").write_text(json.dumps({"cases": raw, "summaries": summaries,
                                                             "marks": sampler.marks}, indent=1))
    text = markdown(summaries, clock_lines(samples, sampler.marks), args)
    (args.out / "batch_context.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
