"""How far does one profiled timing carry? The same plans of the same cases, timed in several rounds
of one process, each round on fresh buffers.

The held-out regret has a floor: re-timing 101 evaluation cases in a later call moved single
(case, plan) times by -3.7% / +3.0% at P5 / P95, so one run's fastest plan was 1.008x the other
run's fastest on geometric mean (``selection_regret.py RUN1 RUN2``). This script separates where
such changes come from. Per case, in each of ``--rounds`` rounds:

1. a padding tensor of random size is allocated, then fresh ``(q, k, v)`` sets (the same values as
   every round: only their addresses change) and a freshly prepared plan per plan (its metadata at
   new addresses too);
2. every plan is timed as the profiler times it (``--warmup`` runs, median of ``--reps`` CUDA-event
   samples over the rotated input sets), the plans in a shuffled order;
3. every plan is timed once more on the same buffers, in another shuffled order.

Reported per (case, plan): the spread of the round medians across rounds (new buffers) beside the
change between the two timings of one round (same buffers, a few ms later). Per case: how often the
rounds disagree on the fastest plan, and the regret of each round's fastest plan judged by the
median over all rounds (the repeat floor within one process). Every plan's output is checked against
the fp32 oracle once before it is timed.

    python benchmarks/timing_spread.py --out DIR --families Q64K32,Q64K64-DD --split evaluation \\
        --cases 4 --plan-filter 'hopper.*(lpt|persistent)$' --rounds 6
    python benchmarks/timing_spread.py --out DIR --smoke        # CPU, PyTorch executor plans
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch

from tessera_diffusers.bench.problem import OracleCheck, check_heads, make_inputs
from tessera_diffusers.bench.tessera_backends import request_of
from tessera_diffusers.bench.timing import time_kernel
from tessera_diffusers.cost_model import estimate_ms
from tessera_diffusers.mask_state import build_mask_state
from tessera_diffusers.prepare import prepare
from tessera_diffusers.profile.config import ProfileConfig, add_case_arguments, require_positive, study_config
from tessera_diffusers.profile.runner import build_problem, case_plans, profiling_kernels
from tessera_diffusers.runtime import execute

INPUT_SETS = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory of timing_spread.json and .md")
    add_case_arguments(parser, families="Q64K32,Q64K64-DD,Q128K128", cases=3)
    parser.add_argument("--plans-per-case", type=int, default=6, help="the fastest predicted eligible plans")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    require_positive(parser, args, "cases", "plans_per_case", "rounds", "reps")
    return args


def time_case(size: str, case, config: ProfileConfig, args: argparse.Namespace, rng: random.Random) -> dict:
    device = torch.device(config.device)
    problem = build_problem(size, case, config, device)
    request = request_of(problem)
    plans, _ = case_plans(request, profiling_kernels(device), config.plan_filter)
    state = build_mask_state(problem.mask)
    stats = state.host_stats()
    plans = sorted(plans, key=lambda p: estimate_ms(p, request, stats))[: args.plans_per_case]
    first = make_inputs(problem, INPUT_SETS, config.seed)
    oracle = OracleCheck(problem, first[0], check_heads(problem.heads, config.validate_heads), config.atol)
    valid = []
    for plan in plans:  # the oracle check, once per plan
        out = execute(prepare(plan, state), *first[0], problem.scale, False)
        if oracle.compare(out).ok:
            valid.append(plan)
        else:
            print(f"  {plan.name}: output differs from the oracle; not timed", file=sys.stderr)
    del first
    rounds: dict[str, list[tuple[float, float]]] = {p.name: [] for p in valid}
    for _ in range(args.rounds):
        pad = torch.empty(rng.randrange(1, 64) << 20, dtype=torch.uint8, device=device)  # shifts the next buffers
        inputs = make_inputs(problem, INPUT_SETS, config.seed)
        prepared = {p.name: prepare(p, state) for p in valid}
        medians: dict[str, list[float]] = {p.name: [] for p in valid}
        for _pass in range(2):
            for name in rng.sample(list(prepared), len(prepared)):
                def run(i: int, plan=prepared[name], sets=inputs) -> object:
                    return execute(plan, *sets[i % len(sets)], problem.scale, False)

                medians[name].append(time_kernel(run, INPUT_SETS, args.warmup, args.reps, device).median_ms)
        for name, (a, b) in medians.items():
            rounds[name].append((a, b))
        del pad, inputs, prepared
        gc.collect()
    return {"case": problem.name, "plans": rounds}


def case_summary(entry: dict) -> dict:
    """Spread across rounds, same-buffer change, and the within-process repeat floor of one case."""
    plans = entry["plans"]
    per_plan = {}
    for name, pairs in plans.items():
        firsts = [a for a, _ in pairs]
        per_plan[name] = {"median_ms": statistics.median(firsts), "round_spread": max(firsts) / min(firsts),
                          "same_buffers_max_change": max(abs(math.log(b / a)) for a, b in pairs)}
    reference = {name: row["median_ms"] for name, row in per_plan.items()}
    best = min(reference.values())
    n_rounds = min(len(pairs) for pairs in plans.values())
    winners = [min(plans, key=lambda n, r=r: plans[n][r][0]) for r in range(n_rounds)]
    floor = [reference[w] / best for w in winners]
    return {"case": entry["case"], "plans": per_plan, "winners": winners,
            "distinct_winners": len(set(winners)), "round_winner_regret_gm": statistics.geometric_mean(floor), "worst": max(floor)}


def markdown(summaries: list[dict], args: argparse.Namespace) -> str:
    title = (f"# Timing spread: {args.rounds} rounds of fresh buffers per case, warmup {args.warmup}, "
             f"median of {args.reps}")
    lines = [title, "",
             "| case | plan | median ms | max / min over rounds | same buffers, max change |",
             "|---|---|---|---|---|"]
    for s in summaries:
        for name, row in sorted(s["plans"].items(), key=lambda kv: kv[1]["median_ms"]):
            lines.append(f"| {s['case']} | {name} | {row['median_ms']:.3f} | {row['round_spread']:.3f} | "
                         f"{math.exp(row['same_buffers_max_change']) - 1:.2%} |")
    lines += ["", "| case | distinct fastest plans over the rounds | GM regret of a round's fastest plan | worst |",
              "|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['case']} | {s['distinct_winners']} | {s['round_winner_regret_gm']:.4f} | {s['worst']:.3f} |")
    spreads = [row["round_spread"] for s in summaries for row in s["plans"].values()]
    same = [math.exp(row["same_buffers_max_change"]) for s in summaries for row in s["plans"].values()]
    if spreads:
        lines += ["", f"- over rounds (new buffers): max / min GM {statistics.geometric_mean(spreads):.4f}, worst {max(spreads):.3f}",
                  f"- within a round (same buffers): max change GM {statistics.geometric_mean(same) - 1:.2%}, worst {max(same) - 1:.2%}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = study_config(args, warmup=args.warmup, reps=args.reps)
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    summaries, raw = [], []
    for size, case in config.cases():
        print(f"{case.name}: timing", flush=True)
        entry = time_case(size, case, config, args, rng)
        if entry["plans"]:
            raw.append(entry)
            summaries.append(case_summary(entry))
    (args.out / "timing_spread.json").write_text(json.dumps({"rounds": raw, "summaries": summaries}, indent=1))
    text = markdown(summaries, args)
    (args.out / "timing_spread.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
