"""Persistent grid against one CTA per task, from profiling records: for every plan timed with the
longest-first order both ways (``..._lpt`` and ``..._lpt-persistent``) on the same case, the ratio
persistent / lpt, summarized per (family, mapping, tile, stages) as a geometric mean with its range,
beside the median KV tiles per query tile row (density x Skv / tile_kv). No GPU needed.

    python benchmarks/schedule_ratios.py benchmarks/results/h200_profile_dyn2/profile.jsonl.gz [MORE ...] --md FILE
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
from collections import defaultdict

from tessera_diffusers.profile.records import read_records

PLAN = re.compile(r"(?P<mapping>[a-z-]+)_q(?P<tq>\d+)k(?P<tk>\d+)_from_q\d+k\d+_d\d+_\w+?_sm\w+_(?P<family>hopper|portable)"
                  r"_s(?P<stages>\d)w\d_lpt$")
PERSISTENT = "-persistent"


def ratios(records: list[dict]) -> dict[tuple, list[tuple[float, float]]]:
    """(family, mapping, tile, stages, kernel family) -> [(KV tiles per row, persistent / lpt)]."""
    cases, times = {}, defaultdict(dict)
    for r in records:
        if r.get("type") == "case":
            cases[r["case"]] = r
        elif r.get("type") == "plan" and r.get("status") == "ok":
            times[r["case"]][r["plan"]] = r["latency_ms"]
    out = defaultdict(list)
    for case, plans in times.items():
        info = cases.get(case)
        if info is None:
            continue
        for name, lpt in plans.items():
            m = PLAN.match(name)
            persistent = plans.get(name + PERSISTENT)
            if not m or persistent is None:
                continue
            tiles = info["stats"]["density"] * info["request"]["seq_len_kv"] / int(m["tk"])
            key = (info["family"], m["mapping"], f"{m['tq']}x{m['tk']}", int(m["stages"]), m["family"])
            out[key].append((tiles, persistent / lpt))
    return out


def markdown(groups: dict[tuple, list[tuple[float, float]]], sources: list[str]) -> str:
    lines = ["# Persistent grid / one CTA per task (same plan, longest-first order)", "",
             "From " + ", ".join(f"`{s}`" for s in sources) + ". Below 1: the persistent grid is faster.", "",
             "| family | mapping | tile | stages | kernels | cases | KV tiles per row (median) | GM | min | max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (family, mapping, tile, stages, kernels), v in sorted(groups.items()):
        gm = math.exp(sum(math.log(x) for _, x in v) / len(v))
        lines.append(f"| {family} | {mapping} | {tile} | {stages} | {kernels} | {len(v)} | "
                     f"{statistics.median(t for t, _ in v):.1f} | {gm:.3f} | {min(x for _, x in v):.3f} | "
                     f"{max(x for _, x in v):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", help="profile.jsonl[.gz] files of `tessera profile`")
    parser.add_argument("--md", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    groups: dict[tuple, list] = defaultdict(list)
    for path in args.records:
        if not os.path.isfile(path):
            parser.error(f"records: no file {path}")
        for key, values in ratios(list(read_records([path]))).items():
            groups[key].extend(values)
    if not groups:
        print("schedule_ratios: no plan timed both as lpt and lpt-persistent on one case", file=sys.stderr)
        return 1
    table = markdown(groups, args.records)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
