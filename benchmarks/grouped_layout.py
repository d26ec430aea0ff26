"""The grouped query layout against the natural one, on the evaluation corpus (GPU).

Per case (the first ``--cases`` evaluation cases of each family, one per source): every eligible
Hopper plan matching ``--plan-filter`` whose query tile covers several blocks, and the plan table's
choice, each in the natural and in the grouped query layout (``QLayout``); every output checked
against the fp32 oracle, all timed interleaved (kernel latency, ``runtime.execute``). Also timed:
the preparation of the selected plan in each layout (the grouped one includes the grouping kernel,
``regroup.py``, and the regrouped mask), and the grouping kernel alone.

    python benchmarks/grouped_layout.py --out DIR [--families Q16K16,Q32K16,Q32K32] [--cases 5] [--grid wan720p]

Writes ``grouped_layout.md`` / ``.json`` after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tessera_diffusers import build_mask_state, prepare
from tessera_diffusers.corpus import enumerate_cases
from tessera_diffusers.corpus.grids import grid_named
from tessera_diffusers.plans import QLayout
from tessera_diffusers.regroup import query_grouping


def cuda_ms(fn, reps: int, device: torch.device) -> float:
    """Median CUDA-event time of ``fn`` (after one warm-up call), including what it queues."""
    from tessera_diffusers.bench.timing import elapsed_ms

    fn()
    times = sorted(elapsed_ms(fn, device) for _ in range(reps))
    return times[len(times) // 2]


def one_case(spec, args: argparse.Namespace, device: torch.device) -> dict:
    from tessera_diffusers.bench.problem import OracleCheck, Problem, make_inputs
    from tessera_diffusers.bench.tessera_backends import candidate_plans, request_of
    from tessera_diffusers.bench.timing import time_interleaved
    from tessera_diffusers.runtime import execute
    from tessera_diffusers.selector import Selector

    mask = spec.build().to(device)
    problem = Problem(spec.name, args.grid, spec.family, spec.source, mask, 1, mask.heads, 128, torch.bfloat16, spec)
    state = build_mask_state(mask)
    natural = [p for p in candidate_plans(problem, allow_executor=False)[0]
               if p.q_layout is QLayout.NATURAL and p.can_group_queries and re.search(args.plan_filter, p.name)]
    request = request_of(problem)
    selector = Selector()
    base = selector.select(request, state)  # the plan table's choice for a mask's first request
    reused = None if base is None else selector.reused_plan(base, request, state)  # for a mask that comes back
    twin = None if reused is None else dataclasses.replace(reused, q_layout=QLayout.NATURAL)
    for plan in (base, twin):
        if plan is not None and plan.can_group_queries and plan not in natural:
            natural.append(plan)
    inputs = make_inputs(problem, 3, seed=1)
    check = OracleCheck(problem, inputs[0], [0, mask.heads - 1])
    entries, failures = [], []
    for plan in natural:
        for each in (plan, plan.grouped()):
            prepared = prepare(each, state)
            verdict = check.compare(execute(prepared, *inputs[0], problem.scale, False))
            if verdict.ok:
                entries.append((each, prepared))
            else:
                failures.append(each.name)
                print(f"{spec.name} {each.name}: FAILED the oracle check ({verdict.to_dict()})", flush=True)
    runs = [lambda i, e=e: execute(e[1], *inputs[i], problem.scale, False) for e in entries]
    ms = [t.median_ms for t in time_interleaved(runs, len(inputs), args.warmup, args.reps, device)]
    plans: dict[str, dict[str, float]] = {}
    for (plan, _), t in zip(entries, ms):
        key = plan.name.replace("grouped", "coarsened", 1) if plan.q_layout is QLayout.GROUPED else plan.name
        plans.setdefault(key, {})[plan.q_layout.value] = t
    best = {layout: min((p[layout], n) for n, p in plans.items() if layout in p) for layout in ("natural", "grouped")}
    out = {"case": spec.name, "plans": plans, "failures": failures, "best": best}
    if base is not None and base.name in plans:
        group = base.tile_q // mask.block_q
        grouping = query_grouping(mask.blocks, group)
        key_blocks = grouping.key_blocks.view(-1, 2).sum(0).tolist()
        chosen = grouping.key_blocks[..., 1] < grouping.key_blocks[..., 0]
        greedy_sum = int(torch.where(chosen, grouping.key_blocks[..., 1], grouping.key_blocks[..., 0]).sum())
        out["selected"] = {
            "plan": base.name, **plans[base.name], "reused_plan": reused.name,
            "reused_ms": plans.get(twin.name, {}).get(reused.q_layout.value),
            "grouping_ms": cuda_ms(lambda: query_grouping(mask.blocks, group), args.prep_reps, device),
            "prepare_natural_ms": cuda_ms(lambda: prepare(base, state), args.prep_reps, device),
            "prepare_grouped_ms": cuda_ms(lambda: prepare(base.grouped(), state), args.prep_reps, device),
            "key_blocks_natural": key_blocks[0], "key_blocks_grouped": greedy_sum,
            "heads_regrouped": f"{int(chosen.sum())}/{chosen.numel()}",
        }
    return out


def write_report(args: argparse.Namespace, results: dict) -> str:
    lines = [f"# The grouped query layout against the natural one ({args.grid}, {results['device']})", "",
             (f"`python benchmarks/grouped_layout.py --families {args.families} --cases {args.cases} --grid {args.grid}`"
              f" (plans matching `{args.plan_filter}` and the plan table's choice; kernel latency = median of "
              f"{args.reps} interleaved CUDA-event timings over 3 input sets, every output checked against the fp32 "
              "oracle first)"), "",
             ("| case | best natural ms | best grouped ms | ratio | selected plan | natural ms | grouped ms | ratio "
              "| key blocks grouped / natural | heads regrouped | grouping ms | prepare natural / grouped ms "
              "| plan of a reused mask (Selector.reused_plan) | its ms / selected natural |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["cases"]:
        b = r["best"]
        row = (f"| {r['case']} | {b['natural'][0]:.3f} | {b['grouped'][0]:.3f} | {b['grouped'][0] / b['natural'][0]:.3f} |")
        s = r.get("selected")
        if s is not None and "grouped" in s and "natural" in s:
            row += (f" {s['plan']} | {s['natural']:.3f} | {s['grouped']:.3f} | {s['grouped'] / s['natural']:.3f} | "
                    f"{s['key_blocks_grouped'] / max(1, s['key_blocks_natural']):.3f} | {s['heads_regrouped']} | "
                    f"{s['grouping_ms']:.3f} | {s['prepare_natural_ms']:.3f} / {s['prepare_grouped_ms']:.3f} | "
                    f"{s['reused_plan']} | "
                    + ("- |" if s.get("reused_ms") is None else f"{s['reused_ms'] / s['natural']:.3f} |"))
        else:
            row += " - | - | - | - | - | - | - | - | - | - |"
        lines.append(row)
    lines += ["", "Per plan (ms, natural / grouped):", "", "| case | plan | natural | grouped | ratio |", "|---|---|---|---|---|"]
    for r in results["cases"]:
        for name, pair in r["plans"].items():
            if len(pair) == 2:
                lines.append(f"| {r['case']} | {name} | {pair['natural']:.3f} | {pair['grouped']:.3f} | "
                             f"{pair['grouped'] / pair['natural']:.3f} |")
    text = "\n".join(lines) + "\n"
    (args.out / "grouped_layout.md").write_text(text)
    (args.out / "grouped_layout.json").write_text(json.dumps(results, indent=1))
    return text


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out``, ``--families``, ``--cases``, ``--grid``, ``--warmup`` and ``--reps``: what the studies
    over evaluation cases of the small-block families share (this one, ``grouping_window.py``)."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", default="Q16K16,Q32K16,Q32K32")
    parser.add_argument("--cases", type=int, default=5, help="evaluation cases per family (one per source)")
    parser.add_argument("--grid", default="bench32k", help="corpus latent grid (bench32k: N = 32,768; wan720p: 75,600)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)


def run_study(args: argparse.Namespace, measure: Callable[..., dict], report: Callable[[dict], str]) -> int:
    """``measure(spec, device)`` on the first ``args.cases`` evaluation cases of each family, the
    report written after every case (a time limit keeps what ran) and printed at the end."""
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "grid": args.grid, "cases": []}
    text = ""
    for family in args.families.split(","):
        cases = list(enumerate_cases("evaluation", families=[family], grids=[grid_named(args.grid)],
                                     seeds_per_combo=1))[:args.cases]
        for spec in cases:
            results["cases"].append(measure(spec, device))
            text = report(results)
            print(text.splitlines()[5 + len(results["cases"])], flush=True)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser)
    parser.add_argument("--plan-filter", default=r"hopper_s2w[48]_lpt-persistent$")
    parser.add_argument("--prep-reps", type=int, default=5)
    args = parser.parse_args(argv)
    return run_study(args, lambda spec, device: one_case(spec, args, device),
                     lambda results: write_report(args, results))

if __name__ == "__main__":
    sys.exit(main())
