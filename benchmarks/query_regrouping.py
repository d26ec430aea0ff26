"""Regrouping query blocks before coarsening: a study for the small-block families.

A coarsened query tile of ``g = tile_q / block_q`` query blocks computes the union of their key
blocks. The kernels group consecutive query blocks; this groups each head's blocks greedily by
their key sets instead (a seed block, then the ``g - 1`` free blocks within ``window`` blocks
after it that add the fewest key blocks to the group's union, one at a time), keeping the natural
order for a head where that schedules fewer key blocks. The grouped order is a permutation of the
query blocks, so the existing plans run it unchanged on the permuted mask with the query rows
gathered in that order and the output scattered back (outside the kernel here; a kernel could
gather Q by TMA boxes of one block and store O rows in place).

On the GPU, per case: the permutation, then every eligible Hopper coarsened plan (``--plan-filter``)
on the original mask and on the permuted one, each output checked against the fp32 oracle on the
original mask (after scattering back), all timed interleaved; the gather of Q and the scatter of O
timed on their own. ``--cpu`` prints only the computed key blocks per tile shape (no kernels).

    python benchmarks/query_regrouping.py --out DIR [--families Q16K16,Q32K16,Q32K32] [--cases 1]
    python benchmarks/query_regrouping.py --cpu --families Q16K16 --cases 5 [--windows 16,64,256 --heads 8]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from tessera_diffusers import LogicalMask, build_mask_state, prepare
from tessera_diffusers.corpus import enumerate_cases
from tessera_diffusers.corpus.grids import grid_named
from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.mask_state import group_activity
from tessera_diffusers.regroup import group_query_blocks_torch


def group_query_blocks(blocks: torch.Tensor, group: int, window: int = 64) -> torch.Tensor:
    """A permutation ``perm [G, nQ]`` (int64) of the query blocks of ``blocks [G, nQ, nKV]`` (bool)
    whose consecutive runs of ``group`` entries share few key blocks beyond their own: the library's
    grouping (``tessera_diffusers.regroup``, the torch code; the greedy of the module docstring,
    each head keeping whichever of it and the natural order schedules fewer key blocks), without
    its padding positions."""
    q_units = group_query_blocks_torch(blocks[None], group, window).q_units
    return q_units[0, :, :blocks.shape[1]].long()


def natural_order(blocks: torch.Tensor) -> torch.Tensor:
    """The identity permutation ``[G, nQ]`` of the query blocks of ``blocks [G, nQ, nKV]``."""
    return torch.arange(blocks.shape[1], device=blocks.device).expand(blocks.shape[0], -1)


def group_unions(blocks: torch.Tensor, perm: torch.Tensor, group: int) -> torch.Tensor:
    """``[G, ceil(nQ / group)]``: key blocks in the union of each run of ``group`` blocks of ``perm``."""
    ordered = blocks.gather(1, perm[..., None].expand_as(blocks))
    return group_activity(ordered, group, dim=-2).sum(-1)


def scheduled_key_blocks(blocks: torch.Tensor, perm: torch.Tensor, group: int) -> torch.Tensor:
    """Per head, the key blocks of every group's union summed over the groups of ``perm``."""
    return group_unions(blocks, perm, group).sum(-1)


def permuted_mask(mask: LogicalMask, perm: torch.Tensor) -> LogicalMask:
    """``mask`` with query-block row ``i`` of head ``h`` taken from row ``perm[h, i]`` (batch 1 masks)."""
    if mask.blocks.shape[0] != 1 or mask.seq_len_q % mask.block_q:
        raise InvalidArgumentError("mask", "a batch-1 mask whose query length is a multiple of block_q",
                                   f"batch {mask.blocks.shape[0]}, seq_len_q {mask.seq_len_q}, block_q {mask.block_q}")
    blocks = mask.blocks[0]
    index = perm[..., None].expand(-1, -1, blocks.shape[-1])
    return LogicalMask(blocks.gather(1, index)[None], mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv)


def gather_rows(x: torch.Tensor, perm: torch.Tensor, block: int) -> torch.Tensor:
    """``x [B, S, H, D]`` with block ``i`` of head ``h`` (``block`` rows) taken from block ``perm[h, i]``."""
    b, s, h, d = x.shape
    blocked = x.view(b, s // block, block, h, d).permute(0, 3, 1, 2, 4)  # [B, H, nQ, block, D]
    index = perm[None, :, :, None, None].expand(b, -1, -1, block, d)
    return blocked.gather(2, index).permute(0, 2, 3, 1, 4).reshape(b, s, h, d)


def evaluation_cases(family: str, grid: str, cases: int) -> list:
    """The first ``cases`` evaluation-split corpus cases of ``family`` on ``grid`` (one per source)."""
    return list(enumerate_cases("evaluation", families=[family], grids=[grid_named(grid)], seeds_per_combo=1))[:cases]


def waste_table(families: list[str], cases: int, windows: list[int], grid: str, heads: int | None) -> list[dict]:
    """Computed over active token pairs for 64 x 64 and 128 x 128 tiles, natural and regrouped with
    each window, on the first ``heads`` heads of each case (all when None)."""
    rows = []
    for family in families:
        for case in evaluation_cases(family, grid, cases):
            mask = case.build()
            blocks = mask.blocks[0, :heads]
            active = int(blocks.sum())
            row = {"case": case.name}
            natural = natural_order(blocks)
            for tile in (64, 128):
                group_q, group_kv = tile // mask.block_q, tile // mask.block_kv
                if group_q < 2:
                    continue
                orders = [("natural", natural)] + [
                    (f"grouped w{w}", group_query_blocks(blocks, group_q, w)) for w in windows]
                for name, order in orders:
                    tiles = int(((group_unions(blocks, order, group_q) + group_kv - 1) // group_kv).sum())
                    row[f"{tile}x{tile} {name}"] = round(tiles * group_q * group_kv / active, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def regroup_case(spec, args: argparse.Namespace, device: torch.device) -> dict:
    """Every matching plan on one case's original and regrouped masks, checked and timed interleaved."""
    from tessera_diffusers.bench.problem import OracleCheck, Problem, make_inputs
    from tessera_diffusers.bench.tessera_backends import candidate_plans, request_of
    from tessera_diffusers.bench.timing import time_interleaved
    from tessera_diffusers.runtime import execute
    from tessera_diffusers.selector import Selector

    mask = spec.build().to(device)
    problem = Problem(spec.name, args.grid, spec.family, spec.source, mask, 1, mask.heads, 128, torch.bfloat16, spec)
    plans = [p for p in candidate_plans(problem, allow_executor=False)[0] if re.search(args.plan_filter, p.name)]
    selected = Selector().select(request_of(problem), build_mask_state(mask))  # the plan table's choice
    if selected is not None and selected.tile_q > mask.block_q and selected not in plans:
        plans.append(selected)
    inputs = make_inputs(problem, 3, seed=1)
    check = OracleCheck(problem, inputs[0], [0, mask.heads - 1])
    bq, blocks = mask.block_q, mask.blocks[0]
    entries = []  # (label, plan, prepared, the query sets it reads)
    perms, gathered, grouping_s = {}, {}, {}
    for plan in plans:
        group = max(1, plan.tile_q // bq)
        if group not in perms:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            perms[group] = group_query_blocks(blocks, group, args.window)
            torch.cuda.synchronize(device)
            grouping_s[group] = time.perf_counter() - start
            gathered[group] = [gather_rows(x[0], perms[group], bq) for x in inputs]
        for label, m, perm in (("original", mask, None), ("regrouped", permuted_mask(mask, perms[group]), perms[group])):
            prepared = prepare(plan, build_mask_state(m))
            qs = [x[0] for x in inputs] if perm is None else gathered[group]
            out = execute(prepared, qs[0], inputs[0][1], inputs[0][2], problem.scale, False)
            if perm is not None:
                out = gather_rows(out, torch.argsort(perm, dim=1), bq)
            verdict = check.compare(out)
            if not verdict.ok:
                print(f"{spec.name} {plan.name} {label}: FAILED the oracle check ({verdict.to_dict()})", flush=True)
                continue
            entries.append((label, plan, prepared, qs))
    runs = [lambda i, e=e: execute(e[2], e[3][i], inputs[i][1], inputs[i][2], problem.scale, False) for e in entries]
    perm = next(iter(perms.values()))
    inverse = torch.argsort(perm, dim=1)
    runs.append(lambda i: gather_rows(gather_rows(inputs[i][0], perm, bq), inverse, bq))  # gather Q + scatter O
    ms = [t.median_ms for t in time_interleaved(runs, len(inputs), args.warmup, args.reps, device)]
    by_plan: dict[str, dict[str, float]] = {}
    for (label, plan, _, _), t in zip(entries, ms[:-1]):
        by_plan.setdefault(plan.name, {})[label] = t
    best = {label: min((p[label], n) for n, p in by_plan.items() if label in p) for label in ("original", "regrouped")}
    group = max(1, next(plan.tile_q for _, plan, _, _ in entries if plan.name == best["regrouped"][1]) // bq)
    natural = natural_order(blocks)
    active = int(blocks.sum())
    waste = {label: float(scheduled_key_blocks(blocks, order, group).sum()) * group / active
             for label, order in (("original", natural), ("regrouped", perms[group]))}
    return {"case": spec.name, "plans": by_plan, "gather_scatter_ms": ms[-1], "union_blocks_over_active": waste,
            "selected": selected.name if selected is not None else None,
            "grouping_s": {str(g): t for g, t in grouping_s.items()},
            "best": {k: {"ms": v[0], "plan": v[1]} for k, v in best.items()}}


def write_report(args: argparse.Namespace, results: dict, summary: list[str], lines: list[str]) -> str:
    text = (f"# Regrouped query blocks: kernel latency on the permuted masks ({args.grid})\n\n"
            "Key blocks scheduled per query tile over active ones, at the best regrouped plan's tile height.\n\n"
            + "\n".join(summary) + "\n\n" + "\n".join(lines) + "\n")
    (args.out / "query_regrouping.md").write_text(text)
    (args.out / "query_regrouping.json").write_text(json.dumps(results, indent=1))
    return text


def run_gpu(args: argparse.Namespace) -> int:
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "window": args.window,
               "grid": args.grid, "cases": []}
    lines = ["| case | plan | original ms | regrouped ms | ratio |", "|---|---|---|---|---|"]
    header = ("| case | key blocks over active, original | regrouped | best original plan ms | best regrouped plan ms "
              "| gather Q + scatter O ms | regrouped with both / best original | grouping (Python greedy) s |")
    summary = [header, "|---|---|---|---|---|---|---|---|"]
    text = ""
    for family in args.families.split(","):
        for spec in evaluation_cases(family, args.grid, args.cases):
            r = regroup_case(spec, args, device)
            results["cases"].append(r)
            for name, pair in r["plans"].items():
                if len(pair) == 2:
                    lines.append(f"| {r['case']} | {name} | {pair['original']:.3f} | {pair['regrouped']:.3f} | "
                                 f"{pair['regrouped'] / pair['original']:.3f} |")
            best, waste, moved = r["best"], r["union_blocks_over_active"], r["gather_scatter_ms"]
            summary.append(f"| {r['case']} | {waste['original']:.2f} | {waste['regrouped']:.2f} | "
                           f"{best['original']['ms']:.3f} | {best['regrouped']['ms']:.3f} | {moved:.3f} | "
                           f"{(best['regrouped']['ms'] + moved) / best['original']['ms']:.3f} | "
                           f"{max(r['grouping_s'].values()):.2f} |")
            print(summary[-1], flush=True)
            text = write_report(args, results, summary, lines)  # after every case: a time limit keeps what ran
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--families", default="Q16K16,Q32K16,Q32K32")
    parser.add_argument("--cases", type=int, default=1, help="evaluation cases per family (one per source)")
    parser.add_argument("--window", type=int, default=64, help="query blocks after the seed a group may take")
    parser.add_argument("--grid", default="bench32k", help="corpus latent grid (bench32k: N = 32,768; wan720p: 75,600)")
    parser.add_argument("--plan-filter", default=r"hopper_s2w[48]_lpt-persistent$")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="only the computed key blocks per tile shape")
    parser.add_argument("--windows", default=None, help="--cpu: comma-separated windows to compare (default: --window)")
    parser.add_argument("--heads", type=int, default=None, help="--cpu: the first HEADS heads of each case (default all)")
    args = parser.parse_args(argv)
    if args.cpu:
        windows = [int(w) for w in args.windows.split(",")] if args.windows else [args.window]
        waste_table(args.families.split(","), args.cases, windows, args.grid, args.heads)
        return 0
    if args.out is None:
        parser.error("--out is required unless --cpu")
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
