"""How each plan's time moved between two profiles of the same cases (CPU; no GPU needed).

Two ``tessera profile`` record sets that timed the same cases on different kernel builds (or
drivers, or days) are paired case by case. For every plan timed on at least ``--min-cases`` shared
cases, the geometric mean of new / old latency is reported, then summarized by what sets plans
apart inside a kernel build: pipeline stages and task schedule (static grid or dynamically
scheduled persistent grid). Runs on different days also differ by drift, so read the groups against
each other rather than against 1. A group that the change did not touch is the drift control.

    python benchmarks/profile_pairs.py --old A/profile.jsonl.gz [B/profile.jsonl.gz ...] \\
        --new C/profile.jsonl.gz --md OUT.md
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path
from statistics import geometric_mean as gm

from tessera_diffusers.profile.records import read_records


def latencies(paths: list[Path]) -> dict[str, dict[str, float]]:
    """case -> plan -> recorded latency (ms, the median of its samples) of the valid measurements in
    ``paths``; where several files timed a (case, plan), the last one's counts."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for r in read_records(paths):
        if r.get("type") == "plan" and r.get("status") == "ok":
            out[r["case"]][r["plan"]] = float(r["latency_ms"])
    return out


STAGES = re.compile(r"_s(\d)w\d_")


def group_of(plan: str) -> str:
    """``<stages> stages, <schedule>`` of a plan name (the parts a kernel change may treat apart)."""
    stages = STAGES.search(plan)
    schedule = "persistent (dynamic)" if plan.endswith("-persistent") else "static grid"
    return f"{stages.group(1) if stages else '?'} stages, {schedule}"


def pair(old: dict, new: dict, min_cases: int) -> dict[str, list[float]]:
    """plan -> new / old latency on every case both timed it in (plans with at least ``min_cases``)."""
    ratios: dict[str, list[float]] = collections.defaultdict(list)
    for case in old.keys() & new.keys():
        for plan in old[case].keys() & new[case].keys():
            ratios[plan].append(new[case][plan] / old[case][plan])
    return {p: v for p, v in ratios.items() if len(v) >= min_cases}


def report(ratios: dict[str, list[float]], shared_cases: int) -> str:
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for plan, values in ratios.items():
        groups[group_of(plan)].append(gm(values))
    lines = [f"{shared_cases} cases in both profiles, {len(ratios)} plans paired.", "",
             "| plans | n | GM of the plans' new / old | range |", "|---|---|---|---|"]
    for name in sorted(groups):
        v = groups[name]
        lines.append(f"| {name} | {len(v)} | {gm(v):.3f} | {min(v):.3f}-{max(v):.3f} |")
    lines += ["", "| plan | cases | new / old (GM) |", "|---|---|---|"]
    for plan in sorted(ratios):
        lines.append(f"| `{plan}` | {len(ratios[plan])} | {gm(ratios[plan]):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, nargs="+", required=True, help="records of the earlier profile(s)")
    ap.add_argument("--new", type=Path, nargs="+", required=True, help="records of the later profile(s)")
    ap.add_argument("--min-cases", type=int, default=8, help="pair only plans timed on this many shared cases")
    ap.add_argument("--md", type=Path, help="write the report here as well")
    args = ap.parse_args(argv)
    old, new = latencies(args.old), latencies(args.new)
    ratios = pair(old, new, args.min_cases)
    if not ratios:
        print("profile_pairs: no plan was timed on enough shared cases", file=sys.stderr)
        return 1
    text = report(ratios, len(old.keys() & new.keys()))
    print(text)
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
