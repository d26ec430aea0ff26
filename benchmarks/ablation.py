"""Issue 6's ablation: A0 Direct only / A1 exhaustive online search / A2 Tessera, for cold unique
requests, warm exact repeats and the four-pass amortized case, on evaluation cases (never profiled).

    A0  Direct only: one fixed, mask-oblivious plan per geometry — the direct mapping (tile = block,
        contiguous KV, LPT order, no split), through the Runtime with ``plan=`` forced. Geometries
        the catalog has no direct tile for are reported as n/a.
    A1  Exhaustive online search: for each new mask, prepare and run every eligible plan once
        (host clock, synchronized), keep the fastest, run it; exact repeats reuse its prepared plan.
    A2  Tessera: ``Runtime.attention`` — mask state, selection (plan table regime lookup, else the
        cost model), preparation of the chosen plan only, execution; exact repeats hit the
        prepared-plan cache. One Runtime for the whole run, as in a diffusion loop.

Scenarios (complete-request latency, host monotonic clock, synchronized at both ends):

    first    the very first request of the case (validated; A2's selector has seen earlier cases)
    cold     a new mask object per request (median over ``--cold-reps`` masks)
    warm     the same mask object again (median over ``--reps``)
    4-pass   one new mask used for four consecutive requests, total / 4 (median over ``--cold-reps``)

Also the kernel latency of each system's plan (CUDA events on a GPU, median of 5 after 3 warm-ups,
rotated inputs). Every system's output is checked against the fp32 oracle before its times count.

    python benchmarks/ablation.py --out DIR                          # H200: n32k, every family, 2 cases each
    python benchmarks/ablation.py --out DIR --table DIR2/plan_table_sm90.json
    python benchmarks/ablation.py --out /tmp/abl --smoke             # CPU: executor plans, seconds

Writes ``ablation.json`` and ``ablation.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tessera_diffusers import LogicalMask, Runtime, build_mask_state
from tessera_diffusers.bench.config import ALL_FAMILIES, SIZE_PROFILES, BenchConfig
from tessera_diffusers.bench.harness import problem_for
from tessera_diffusers.bench.problem import OracleCheck, Problem, check_heads, make_inputs
from tessera_diffusers.bench.report import environment
from tessera_diffusers.bench.tessera_backends import request_of
from tessera_diffusers.bench.timing import synchronize, time_kernel, time_request
from tessera_diffusers.plan_table import load_plan_table
from tessera_diffusers.plans import AxisMapping, KvLayout, PhysicalPlan, Traversal, arch_number
from tessera_diffusers.prepare import prepare
from tessera_diffusers.profile.runner import case_plans, profiling_kernels
from tessera_diffusers.runtime import execute
from tessera_diffusers.selector import Selector

SYSTEMS = ("A0 direct", "A1 search", "A2 tessera")
SCENARIOS = ("cold", "warm", "4-pass")
SMOKE_FAMILIES = ("Q32K16", "Q64K64")


def direct_plan(plans: list[PhysicalPlan]) -> PhysicalPlan | None:
    """A0's fixed plan: direct on both axes, contiguous, LPT, no split, not persistent; of the
    newest kernel family the device runs (Hopper on sm90), the smallest pipeline / warp count
    (None when the catalog has no direct tile)."""
    direct = [p for p in plans if p.q_mapping is AxisMapping.DIRECT and p.kv_mapping is AxisMapping.DIRECT
              and p.kv_layout is KvLayout.CONTIGUOUS and p.tasks.num_splits == 1 and not p.tasks.persistent
              and p.tasks.traversal is Traversal.LONGEST_FIRST]
    def order(p: PhysicalPlan) -> tuple:
        newest_first = -arch_number(p.kernel.arch) if p.kernel.arch != "any" else 0
        return newest_first, p.kernel.stages, p.kernel.warps, p.name

    return min(direct, key=order) if direct else None


def fresh(mask: LogicalMask) -> LogicalMask:
    """Same blocks, a new mask object: a unique request to every cache keyed by the mask."""
    return LogicalMask(mask.blocks.clone(), mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv)


class ExhaustiveSearch:
    """A1: time every candidate once per new mask, keep the fastest prepared plan per mask object."""

    def __init__(self, plans: list[PhysicalPlan], device: torch.device):
        self.plans = plans
        self.device = device
        self.cache: dict[int, tuple[LogicalMask, object]] = {}
        self.chosen: PhysicalPlan | None = None

    def attention(self, q, k, v, mask: LogicalMask, scale: float) -> torch.Tensor:
        hit = self.cache.get(id(mask))
        if hit is not None and hit[0] is mask:
            return execute(hit[1], q, k, v, scale, False)
        state = build_mask_state(mask)
        best, best_s = None, math.inf
        for plan in self.plans:
            synchronize(self.device)
            start = time.perf_counter()
            prepared = prepare(plan, state)
            execute(prepared, q, k, v, scale, False)
            synchronize(self.device)
            elapsed = time.perf_counter() - start
            if elapsed < best_s:
                best, best_s = prepared, elapsed
        self.cache = {id(mask): (mask, best)}
        self.chosen = best.plan
        return execute(best, q, k, v, scale, False)


def measure_system(run: Callable[[LogicalMask], torch.Tensor], mask: LogicalMask, problem: Problem,
                   oracle: OracleCheck, cold_reps: int, reps: int) -> dict:
    """Validate, then time the three scenarios of one system on one case."""
    device = problem.device
    first = fresh(mask)
    synchronize(device)
    start = time.perf_counter()
    out = run(first)
    synchronize(device)
    first_ms = (time.perf_counter() - start) * 1e3
    check = oracle.compare(out)
    del out
    if not check.ok:
        return {"status": "invalid", "reason": f"max error {check.error:.3g} > {check.tolerance:.3g}"}
    cold_masks = [fresh(mask) for _ in range(cold_reps)]
    cold = time_request(lambda i: run(cold_masks[i]), cold_reps, 0, cold_reps, device)
    warm = time_request(lambda i: run(first), 1, 1, reps, device)
    pass_masks = [fresh(mask) for _ in range(cold_reps)]

    def four_passes(i: int) -> None:
        for _ in range(4):
            run(pass_masks[i])

    four = time_request(four_passes, cold_reps, 0, cold_reps, device)
    return {"status": "ok", "cold_ms": cold.median_ms, "warm_ms": warm.median_ms, "4-pass_ms": four.median_ms / 4,
            "first_ms": first_ms, "check": check.to_dict()}


def kernel_ms(plan: PhysicalPlan | None, mask: LogicalMask, problem: Problem, inputs: list) -> float | None:
    if plan is None:
        return None
    prepared = prepare(plan, build_mask_state(mask))
    timing = time_kernel(lambda i: execute(prepared, *inputs[i % len(inputs)], problem.scale, False), len(inputs), 3,
                         5, problem.device)
    return timing.median_ms


def run_case(problem: Problem, runtime: Runtime, args: argparse.Namespace) -> dict:
    device = problem.device
    request = request_of(problem)
    kernels = profiling_kernels(device)
    plans, _ = case_plans(request, kernels, None)
    inputs = make_inputs(problem, 2, args.seed)
    q, k, v = inputs[0]
    oracle = OracleCheck(problem, inputs[0], check_heads(problem.heads, 2))
    mask, scale = problem.mask, problem.scale
    row = {"case": problem.name, "family": problem.family, "source": problem.source, "geometry": problem.geometry,
           "seq_len": problem.seq_q, "heads": problem.heads, "density": problem.info.get("density"),
           "candidates": len(plans), "systems": {}}

    fixed = direct_plan(plans)
    if fixed is None:
        row["systems"]["A0 direct"] = {"status": "n/a", "reason": "the catalog has no direct tile for this geometry"}
    else:
        a0 = Runtime(selector=Selector(table=None))
        result = measure_system(lambda m: a0.attention(q, k, v, m, scale=scale, plan=fixed), mask, problem, oracle,
                                args.cold_reps, args.reps)
        row["systems"]["A0 direct"] = {**result, "plan": fixed.name, "kernel_ms": kernel_ms(fixed, mask, problem, inputs)}

    search = ExhaustiveSearch(plans, device)
    result = measure_system(lambda m: search.attention(q, k, v, m, scale), mask, problem, oracle, args.cold_reps,
                            args.reps)
    row["systems"]["A1 search"] = {**result, "plan": search.chosen.name if search.chosen else None,
                                   "kernel_ms": kernel_ms(search.chosen, mask, problem, inputs)}

    result = measure_system(lambda m: runtime.attention(q, k, v, m, scale=scale), mask, problem, oracle,
                            args.cold_reps, args.reps)
    selection = runtime.selector.selection(request, build_mask_state(mask))  # what the runs above used
    chosen = selection.chosen
    row["systems"]["A2 tessera"] = {**result, "plan": chosen.name if chosen else "reference oracle",
                                    "source": selection.source, "regime": selection.regime.name if selection.regime
                                    else None, "kernel_ms": kernel_ms(chosen, mask, problem, inputs)}
    return row


def geometric_mean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def summarize(rows: list[dict]) -> dict:
    """GM per system and scenario over the cases where every system that ran is ok."""
    out = {}
    for scenario in SCENARIOS + ("kernel",):
        field = "kernel_ms" if scenario == "kernel" else f"{scenario}_ms"
        for system in SYSTEMS:
            values = [r["systems"][system][field] for r in rows
                      if r["systems"].get(system, {}).get("status") == "ok" and r["systems"][system].get(field)]
            out[f"{system}|{scenario}"] = {"gm_ms": geometric_mean(values), "cases": len(values)}
        paired = [r for r in rows if all(r["systems"].get(s, {}).get("status") == "ok" for s in SYSTEMS)]
        for system in SYSTEMS:
            values = [r["systems"][system][field] for r in paired if r["systems"][system].get(field)]
            out[f"{system}|{scenario}|paired"] = {"gm_ms": geometric_mean(values), "cases": len(values)}
    return out


def markdown(rows: list[dict], summary: dict, meta: dict) -> str:
    lines = [f"# Ablation A0 / A1 / A2 ({meta['size']}, {meta['device']})", "",
             (f"torch {meta['environment'].get('torch')}, table: {meta['table']}. Complete-request ms (host clock): "
              "cold = new mask object per request, warm = exact repeat, 4-pass = one new mask for four requests "
              "(per request). Kernel = the plan's execution alone (CUDA events on a GPU), median of 5."), "",
             "## Geometric means", "",
             "| system | cases | cold | warm | 4-pass | kernel | paired cases | cold | warm | 4-pass | kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    for system in SYSTEMS:
        all_cases = [summary[f"{system}|{s}"] for s in SCENARIOS + ("kernel",)]
        paired = [summary[f"{system}|{s}|paired"] for s in SCENARIOS + ("kernel",)]
        lines.append(f"| {system} | {all_cases[0]['cases']} | " + " | ".join(fmt(c["gm_ms"]) for c in all_cases)
                     + f" | {paired[0]['cases']} | " + " | ".join(fmt(c["gm_ms"]) for c in paired) + " |")
    lines += ["", "## Per case", "", "| case | system | first | cold | warm | 4-pass | kernel | plan |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for system in SYSTEMS:
            s = r["systems"].get(system, {})
            if s.get("status") != "ok":
                lines.append(f"| {r['case']} | {system} | {s.get('status')} | | | | | {s.get('reason', '')} |")
                continue
            extra = f" ({s['source']})" if "source" in s else ""
            lines.append(f"| {r['case']} | {system} | {fmt(s['first_ms'])} | {fmt(s['cold_ms'])} | {fmt(s['warm_ms'])} | "
                         f"{fmt(s['4-pass_ms'])} | {fmt(s.get('kernel_ms'))} | {s.get('plan')}{extra} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU configuration (executor plans)")
    parser.add_argument("--size", default=None, help=f"from {sorted(SIZE_PROFILES)} (default n32k)")
    parser.add_argument("--families", default=None, help=f"comma list from {list(ALL_FAMILIES)}")
    parser.add_argument("--cases-per-family", type=int, default=2)
    parser.add_argument("--table", type=Path, default=None,
                        help="plan table for A2 (default: the shipped one / $TESSERA_PLAN_TABLE, else the cost model)")
    parser.add_argument("--cold-reps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--minutes", type=float, default=None, help="stop starting new cases after this long")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    size = args.size or ("smoke" if args.smoke else "n32k")
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    families = tuple(f.strip() for f in args.families.split(",")) if args.families else (
        SMOKE_FAMILIES if args.smoke else ALL_FAMILIES)
    config = BenchConfig(out_dir=args.out, sizes=(size,), families=families, cases_per_family=args.cases_per_family,
                         head_dim=64 if args.smoke else 128, device=str(device), progress=False)
    table = load_plan_table(args.table) if args.table else None
    runtime = Runtime(selector=Selector(table=table) if table else Selector())
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
    rows = []
    for index, (size_name, case) in enumerate(config.cases()):
        if deadline is not None and time.monotonic() > deadline:
            print(f"time budget reached after {index} cases", file=sys.stderr)
            break
        problem = problem_for(size_name, case, config, device)
        row = run_case(problem, runtime, args)
        rows.append(row)
        status = ", ".join(f"{s.split()[0]} {v.get('cold_ms', float('nan')):.2f}/{v.get('warm_ms', float('nan')):.2f}"
                           if v.get("status") == "ok" else f"{s.split()[0]} {v.get('status')}"
                           for s, v in row["systems"].items())
        print(f"[{index + 1}] {case.name}: cold/warm ms {status}", file=sys.stderr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = summarize(rows)
    meta = {"size": size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "table": str(args.table) if args.table else "default (shipped / $TESSERA_PLAN_TABLE / cost model)",
            "environment": environment(device), "cold_reps": args.cold_reps, "reps": args.reps}
    (args.out / "ablation.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    text = markdown(rows, summary, meta)
    (args.out / "ablation.md").write_text(text)
    print(text)
    invalid = [r for r in rows for s in r["systems"].values() if s.get("status") == "invalid"]
    return 1 if invalid else 0


if __name__ == "__main__":
    raise SystemExit(main())
