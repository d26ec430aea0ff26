"""Persistent grid against one CTA per task, from profiling records: for every plan timed with the
longest-first order both ways (``..._lpt`` and ``..._lpt-persistent``) on the same case, the ratio
persistent / lpt, summarized per (family, mapping, tile, stages) as a geometric mean with its range,
beside the median KV tiles per query tile row (density x Skv / tile_kv). No GPU needed.

    python benchmarks/schedule_ratios.py benchmarks/results/h200_profile_dyn2/profile.jsonl.gz [MORE ...] --md FILE

``--plot FILE`` draws the ratio of every case against its KV tiles per row, one series per plan
group whose label (``family mapping tile sN``) matches ``--select`` (a regular expression): where a
persistent grid starts to lose shows as the points crossing 1 (the plan table's schedule rules
are such thresholds, fitted per tile group).
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


def label(key: tuple) -> str:
    family, mapping, tile, stages, kernels = key
    return f"{family} {mapping} {tile} s{stages}" + ("" if kernels == "hopper" else f" ({kernels})")


def plot(groups: dict[tuple, list[tuple[float, float]]], path: str, select: str) -> int:
    """Scatter of persistent / lpt against KV tiles per row for the groups whose label matches
    ``select``; returns the number of series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = {label(k): v for k, v in sorted(groups.items()) if re.search(select, label(k))}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, values in chosen.items():
        ax.scatter([t for t, _ in values], [x for _, x in values], s=18, label=f"{name} ({len(values)})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("KV tiles per query-tile row (density x Skv / tile_kv)")
    ax.set_ylabel("persistent / one CTA per task (below 1: persistent faster)")
    ax.set_title("Persistent grid against one CTA per task, same plan, per profiled case")
    if chosen:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return len(chosen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", help="profile.jsonl[.gz] files of `tessera profile`")
    parser.add_argument("--md", default=None, help="also write the table here")
    parser.add_argument("--plot", default=None, help="write a scatter plot (png) of the selected groups here")
    parser.add_argument("--select", default="direct 64x64",
                        help="regular expression on the group label 'family mapping tile sN' for --plot")
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
    if args.plot and not plot(groups, args.plot, args.select):
        print(f"schedule_ratios: no plan group matches --select {args.select!r}", file=sys.stderr)
        return 1
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
