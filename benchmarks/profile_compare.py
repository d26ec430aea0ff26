"""Two profiles of the same cases, plan by plan: how the grouped plans moved against the others.

Two profiling runs of the same cases and plans on different days differ by the machine's drift
as well as by what changed in between. When only the grouping kernel changed, the natural plans
measure the drift, and the grouped plans over them measure the change. Per family and per corpus
source, this prints the geometric mean of new over old latency of the grouped plans and of the
others (every (case, plan) timed in both), their ratio, and the same for each case's fastest plan.
When the kernels changed, the rows by kernel (tile, stages, warps) show whether the change moved
some kernels against the others; two runs of the same library give the noise floor.

    python benchmarks/profile_compare.py OLD.jsonl.gz NEW.jsonl.gz [--md FILE]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from tessera_diffusers.bench.metrics import geometric_mean
from tessera_diffusers.plans import QLayout
from tessera_diffusers.profile.records import read_records


def kernel_label(spec: dict) -> str:
    """A plan record's kernel as ``hopper 128x128 s2w8``."""
    k = spec.get("kernel", {})
    return f"{k.get('family')} {k.get('tile_q')}x{k.get('tile_kv')} s{k.get('stages')}w{k.get('warps')}"


def latencies(path: Path) -> tuple[dict[str, dict[str, float]], set[str], dict[str, str]]:
    """``{case: {plan: latency ms}}`` of the ok plan records, the names of the grouped plans and
    each plan's kernel (``kernel_label``)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    grouped: set[str] = set()
    kernels: dict[str, str] = {}
    for record in read_records([path]):
        if record.get("type") != "plan":
            continue
        if "kernel" in record.get("spec", {}):  # the profiler writes a plan's spec on its first record only
            kernels[record["plan"]] = kernel_label(record["spec"])
        if record.get("spec", {}).get("q_layout") == QLayout.GROUPED.value:
            grouped.add(record["plan"])
        if record.get("status") == "ok":
            out[record["case"]][record["plan"]] = float(record["latency_ms"])
    return out, grouped, kernels


def compare(old: Path, new: Path) -> list[str]:
    before, grouped_old, kernels = latencies(old)
    after, grouped_new, kernels_new = latencies(new)
    grouped = grouped_old | grouped_new
    kernels.update(kernels_new)
    rows: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for case in sorted(before.keys() & after.keys()):
        family, source = case.split(":")[1].split("/")[:2]
        common = before[case].keys() & after[case].keys()
        best = min(after[case].values()) / min(before[case].values())
        for plan in common:
            kind = "grouped" if plan in grouped else "other"
            for label in (("family", family), ("source", source), ("kernel", kernels.get(plan, "?"))):
                rows[label][kind].append(after[case][plan] / before[case][plan])
        for label in (("family", family), ("source", source)):
            rows[label]["best"].append(best)
    lines = ["| by | which | grouped plans new / old (n) | other plans new / old (n) | grouped / other | fastest plan new / old (cases) |",
             "|---|---|---|---|---|---|"]
    for (by, name), ratios in sorted(rows.items()):
        g, o, b = (geometric_mean(ratios[k]) if ratios[k] else float("nan") for k in ("grouped", "other", "best"))
        lines.append(f"| {by} | {name} | {g:.3f} ({len(ratios['grouped'])}) | {o:.3f} ({len(ratios['other'])}) | "
                     f"{g / o:.3f} | {b:.3f} ({len(ratios['best'])}) |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    for path in (args.old, args.new):
        if not path.is_file():
            parser.error(f"no records file {path}")
    lines = compare(args.old, args.new)
    print("\n".join(lines))
    if args.md is not None:
        title = f"# {args.new} over {args.old}, per (case, plan) timed in both (`benchmarks/profile_compare.py`)"
        args.md.write_text("\n".join([title, ""] + lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
