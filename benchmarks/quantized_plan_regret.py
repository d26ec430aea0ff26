"""How far the 8-bit selection's plan is from the fastest 8-bit plan, per case (a study: whether a
profiled 8-bit plan table would choose better than ranking the 16-bit request).

For each bench case: every plan of the case that an 8-bit kernel runs (``Selector.quantized``'s
ranking) and, where it can group, its grouped layout, each prepared and run by
``quantized_ops.run_quantized`` on inputs quantized beforehand, all timed interleaved in one busy
stretch (``bench.timing.time_interleaved``); each plan's output is checked on one head against the
fp32 oracle (relative L2 within the 0.03 budget) before it is timed. Reported per case: the first
call's choice over the fastest natural plan, and the plan a mask that comes back runs
(``reused_mask_plan`` of that choice) over the fastest plan of either layout.

    python benchmarks/quantized_plan_regret.py --sizes n32k --cases-per-family 2 --out regret.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from tessera_diffusers import quantized, reference
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.harness import problems
from tessera_diffusers.bench.problem import make_inputs
from tessera_diffusers.bench.tessera_backends import request_of
from tessera_diffusers.bench.timing import time_interleaved
from tessera_diffusers.mask_state import build_mask_state
from tessera_diffusers.prepare import prepare
from tessera_diffusers.quantized_ops import quantize, run_quantized
from tessera_diffusers.selector import Selector, reused_mask_plan

BUDGET = 0.03


def candidates(selector: Selector, request, state):
    """The 8-bit selection's choice and every plan it ranks, with their grouped layouts."""
    selection = selector.quantized(request, state)
    base = dataclasses.replace(request, precision="input")
    by_name = {p.name: p for p in selector._base_entry(base, None)[1].eligible or ()}  # noqa: SLF001 (study)
    natural = [by_name[name] for name, _ in selection.ranking]
    grouped = [p.grouped() for p in natural if p.groups_in_kernel]
    return selection.chosen, natural, grouped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="n32k")
    parser.add_argument("--families", default=None)
    parser.add_argument("--cases-per-family", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    families = tuple(args.families.split(",")) if args.families else None
    config = BenchConfig(out_dir=args.out.parent, sizes=tuple(args.sizes.split(",")),
                         cases_per_family=args.cases_per_family,
                         **({"families": families} if families else {}))
    device = torch.device("cuda")
    with args.out.open("a") as out:
        for _, build in problems(config, device):
            started = time.perf_counter()
            problem = build()
            inputs = make_inputs(problem, 3, 0)
            state = build_mask_state(problem.mask)
            request = dataclasses.replace(request_of(problem), precision="int8")
            chosen, natural, grouped = candidates(Selector(), request, state)
            reused = reused_mask_plan(chosen, request)
            xs = [quantize(q, k, v, problem.scale, "bf16") for q, k, v in inputs]
            q, k, v = inputs[0]
            heads = slice(0, 1)
            mask = problem.mask
            if mask.blocks.shape[1] == problem.heads:
                mask = dataclasses.replace(mask, blocks=mask.blocks[:, heads])
            oracle = reference.attention(q[:, :, heads].float(), k[:, :, heads].float(), v[:, :, heads].float(),
                                         mask, problem.scale)
            plans, errors, rejected = [], {}, {}
            for plan in natural + grouped:
                try:
                    prepared = prepare(plan, state)
                    o = run_quantized(prepared, q, k, v, problem.scale, False, quantized=xs[0])
                except Exception as exc:  # a plan the case cannot run is reported, not timed
                    rejected[plan.name] = f"{type(exc).__name__}: {exc}"[:200]
                    continue
                errors[plan.name] = quantized.agreement(o[:, :, heads], oracle).relative_l2
                if errors[plan.name] <= BUDGET:
                    plans.append((plan, prepared))
                else:
                    rejected[plan.name] = f"relative L2 {errors[plan.name]:.4f} > {BUDGET}"
            runs = [(lambda i, pr=pr: run_quantized(pr, *inputs[i], problem.scale, False, quantized=xs[i]))
                    for _, pr in plans]
            timings = time_interleaved(runs, len(inputs), 3, args.reps, device)
            ms = {plan.name: t.median_ms for (plan, _), t in zip(plans, timings)}
            natural_names = {p.name for p in natural}
            best_natural = min((n for n in ms if n in natural_names), key=ms.get)
            best_any = min(ms, key=ms.get)
            record = {
                "case": problem.name, "family": problem.family, "effective_gflop": problem.effective_flops() / 1e9,
                "chosen": chosen.name, "reused": reused.name, "best_natural": best_natural, "best": best_any,
                "ranking": [p.name for p in natural], "ms": ms, "relative_l2": errors, "rejected": rejected,
                "first_call_regret": ms[chosen.name] / ms[best_natural] if chosen.name in ms else math.nan,
                "reused_regret": ms[reused.name] / ms[best_any] if reused.name in ms else math.nan,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"{problem.family:9s} {problem.name[7:34]:27s} plans {len(ms):2d} (rejected {len(rejected)}) "
                  f"first call {record['first_call_regret']:.3f}  reused {record['reused_regret']:.3f}  "
                  f"best {best_any[:58]}  [{time.perf_counter() - started:.0f} s]", flush=True)
            del runs, plans, xs, inputs


if __name__ == "__main__":
    main()
