"""Fit one Hopper tile rate of the cost model where the cost model decides: the one-regime keys of a
plan table whose regime's choice is the cost model's (``selector._arbitrate``), on profiled cases
(CPU; no GPU needed).

For every case of such a regime the mask is rebuilt from its corpus seed, its statistics are read
once, and for each candidate rate the cost model picks among the regime's contenders; regret = the
picked plan's measured latency / the fastest measured plan of the case. Fit on the profiling split's
records, then read the held-out split's line for the chosen rate:

    python benchmarks/fit_tile_rate.py benchmarks/results/h200_profile_tile64/profile.jsonl.gz \\
        --eval benchmarks/results/h200_eval_regret/profile_eval.jsonl.gz --tile 64,64,4 \\
        --rates 460,480,490,495,500,505,510,520
    python benchmarks/fit_tile_rate.py RECORDS --tile 64,64,4 --rates 490,500,510 --tile 128,128,8 --rates 540,576

``--masked TILE --slowdowns ...`` fits a tile shape's masking slowdown the same way (alone or in the
grid with rates):

    python benchmarks/fit_tile_rate.py RECORDS --masked 64,64,4 --slowdowns 1.07,1.08,1.085,1.09,1.1
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from selection_regret import load_cases

from tessera_diffusers import build_mask_state, cost_model
from tessera_diffusers.corpus import CaseSpec
from tessera_diffusers.plan_table import PlanTable, load_plan_table
from tessera_diffusers.plans import Family
from tessera_diffusers.profile.records import request_from_dict


def mixed_cases(path: Path, table: PlanTable) -> list[tuple]:
    """(request, contender plans, statistics, latencies) of every case whose regime lets the cost model choose."""
    out = []
    for case in load_cases(path).values():
        request = request_from_dict(case["record"]["request"])
        key = table.keys.get(request.key)
        if key is None:
            continue
        for bucket in key.buckets.values():
            regime = bucket.regimes[0]
            if len(bucket.regimes) > 1 or regime.choice != "cost_model" or len(regime.contenders) < 2:
                continue
            plans = [table.plans[name] for name in regime.contenders]
            state = build_mask_state(CaseSpec.from_dict(case["record"]["spec"]).build())
            stats = state.host_stats() | cost_model.row_union_stats(plans, request.block_q, state)
            out.append((request, plans, stats, case["plans"]))
    return out


def regret(cases: list[tuple]) -> tuple[float, int]:
    """GM regret of the cost model's picks and the cases within 3%."""
    values = []
    for request, plans, stats, latencies in cases:
        estimates = cost_model.estimate_many(plans, request, stats)
        chosen = plans[min(range(len(plans)), key=estimates.__getitem__)]
        values.append(latencies[chosen.name] / min(latencies.values()))
    return math.exp(sum(map(math.log, values)) / len(values)), sum(v <= 1.03 for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", type=Path, help="profiling-split records (the fit)")
    parser.add_argument("--eval", type=Path, default=None, help="evaluation-split records (reported only)")
    parser.add_argument("--table", type=Path, default=Path("tessera_diffusers/data/plan_table_sm90.json"))
    parser.add_argument("--tile", action="append", default=None,
                        help="tile_q,tile_kv,warps of a Hopper rate to fit (repeat with --rates for a grid)")
    parser.add_argument("--rates", action="append", default=None,
                        help="TFLOP/s to try for the matching --tile (default: 64,64,4 at 460,...,520)")
    parser.add_argument("--masked", action="append", default=[],
                        help="tile_q,tile_kv,warps of a Hopper masking slowdown to fit (repeat with --slowdowns)")
    parser.add_argument("--slowdowns", action="append", default=[],
                        help="slowdowns to try for the matching --masked")
    args = parser.parse_args(argv)
    if args.tile is None and args.rates is None and not args.masked:  # the default: the 64 x 64 rate
        args.tile, args.rates = ["64,64,4"], ["460,480,490,495,500,505,510,520"]
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tile or []]
    rate_lists = [[float(r) for r in rates.split(",")] for rates in args.rates or []]
    if len(tiles) != len(rate_lists):
        parser.error("give one --rates per --tile")
    if len(args.masked) != len(args.slowdowns):
        parser.error("give one --slowdowns per --masked")
    # (what is set, tile, values): a rate or a masking slowdown of one Hopper tile shape
    grid = [("rate", tile, values) for tile, values in zip(tiles, rate_lists)]
    grid += [("masked", tuple(int(x) for x in t.split(",")), [float(v) for v in values.split(",")])
             for t, values in zip(args.masked, args.slowdowns)]
    table = load_plan_table(args.table)
    fit = mixed_cases(args.records, table)
    held = mixed_cases(args.eval, table) if args.eval else []
    print(f"{len(fit)} cost-model-regime profiling cases, {len(held)} evaluation cases")
    shaped = cost_model.MASKED_TILE_SLOWDOWN_BY_SHAPE.setdefault(Family.HOPPER, {})
    for combo in itertools.product(*(values for _, _, values in grid)):  # the cases are built once
        for (what, tile, _), value in zip(grid, combo):
            if what == "rate":
                cost_model.TILE_TFLOPS[Family.HOPPER][tile] = value
            else:
                shaped[tile] = value
        gm, within = regret(fit)
        label = " ".join(f"{t[0]}x{t[1]}w{t[2]} {'masked ' if w == 'masked' else ''}{v:6.3f}"
                         for (w, t, _), v in zip(grid, combo))
        line = f"{label}  fit GM {gm:.4f} ({within}/{len(fit)} within 3%)"
        if held:
            gm, within = regret(held)
            line += f"  eval GM {gm:.4f} ({within}/{len(held)} within 3%)"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
