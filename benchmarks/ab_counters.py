"""A/B of builds of the native kernel library on the same (case, plan) pairs, in one device call.

Each run is one ``benchmarks/kernel_counters.py`` process with ``TESSERA_NATIVE_LIB`` set to one
library (every output checked against the fp32 oracle, then timed with CUDA events); the runs
alternate between the libraries in the order given, and the summary pools each library's runs (GM
per pair) and compares every other library with the first, per pair and per tile width of the
plan (a change that touches only some kernels leaves the others as the same call's drift control).

    python benchmarks/ab_counters.py --out DIR --lib base=/tmp/a/libtessera_kernels.so \\
        --lib new=/tmp/b/libtessera_kernels.so --order new,base,new,base \\
        --case Q16K16/sliding_tile --case Q64K64/sliding_tile --plan 'hopper_s2w4_lpt$' --reps 12

Writes ``DIR/ab_<library>_<n>.log`` (the runs) and ``DIR/ab.md`` (the summary), and prints the
summary. ``--pythonpath NAME=DIR`` runs one library's side with another tree's Python package
(a build whose preparation differs, e.g. its packing). ``--summarize DIR`` rebuilds the summary
from such logs alone (no GPU), the libraries ordered as in ``--order``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
from collections import defaultdict

from tessera_diffusers.bench.metrics import geometric_mean
from tessera_diffusers.testing import with_pythonpath_first

HERE = os.path.dirname(os.path.abspath(__file__))
TILE = re.compile(r"_q(\d+)k(\d+)_from_")
LOG = re.compile(r"ab_(.+)_(\d+)\.log$")


def read_run(path: str) -> dict[tuple[str, str], float]:
    """(case, plan) -> ms from one kernel_counters.py log."""
    times = {}
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and "_from_" in fields[2]:
                times[(fields[0], fields[2])] = float(fields[3])
    return times


def summary(runs: dict[str, list[dict]], names: list[str]) -> str:
    """Markdown: each library's pooled time per pair over the first library's, per pair and per
    tile width (the plan's KV tile columns)."""
    pooled = {}
    for name in names:
        common = set.intersection(*(set(r) for r in runs[name])) if runs[name] else set()
        pooled[name] = {k: geometric_mean(r[k] for r in runs[name]) for k in common}
    base = names[0]
    lines = []
    for name in names[1:]:
        pairs = sorted(set(pooled[name]) & set(pooled[base]))
        lines += [f"## {name} / {base} ({len(runs[name])} / {len(runs[base])} runs)", "",
                  f"| case | plan | {base} ms | {name} ms | ratio |", "|---|---|---|---|---|"]
        groups = defaultdict(list)
        for key in pairs:
            ratio = pooled[name][key] / pooled[base][key]
            m = TILE.search(key[1])
            groups[f"{m.group(2)}-column tiles" if m else "other"].append(ratio)
            lines.append(f"| {key[0]} | {key[1]} | {pooled[base][key]:.3f} | {pooled[name][key]:.3f} | {ratio:.3f} |")
        lines += ["", "| plans | n | GM ratio | min | max |", "|---|---|---|---|---|"]
        for group, ratios in sorted(groups.items()):
            lines.append(f"| {group} | {len(ratios)} | {geometric_mean(ratios):.4f} | {min(ratios):.3f} | {max(ratios):.3f} |")
        lines.append("")
    return "\n".join(lines)


def runs_from_logs(directory: str) -> dict[str, list[dict]]:
    """The runs of ``ab_<library>_<n>.log`` files in ``directory``, by library, in run order."""
    found = defaultdict(list)
    for path in glob.glob(os.path.join(directory, "ab_*.log")):
        m = LOG.search(os.path.basename(path))
        if m:
            found[m.group(1)].append((int(m.group(2)), read_run(path)))
    return {name: [times for _, times in sorted(logs, key=lambda x: x[0])] for name, logs in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory of the run logs and ab.md")
    parser.add_argument("--lib", action="append", default=[], metavar="NAME=PATH",
                        help="a library to time (repeatable); the first is the one the others are compared with")
    parser.add_argument("--pythonpath", action="append", default=[], metavar="NAME=DIR",
                        help="run library NAME's kernel_counters with DIR first on PYTHONPATH (a tree whose "
                             "tessera_diffusers holds the Python side of that build, e.g. its packing)")
    parser.add_argument("--order", required=True,
                        help="comma-separated library names, one kernel_counters run each (with --summarize: "
                             "the libraries, the first compared with the others)")
    parser.add_argument("--case", action="append", default=[])
    parser.add_argument("--plan", action="append", default=[])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    parser.add_argument("--summarize", metavar="DIR", help="only summarize the ab_<library>_<n>.log files in DIR")
    args = parser.parse_args(argv)
    if args.summarize:
        runs = runs_from_logs(args.summarize)
        names = list(dict.fromkeys(args.order.split(",")))
        missing = [n for n in names if not runs.get(n)]
        if missing:
            parser.error(f"no ab_<library>_<n>.log in {args.summarize} for {missing} (found: {sorted(runs)})")
        text = summary(runs, names)
        with open(os.path.join(args.summarize, "ab.md"), "w") as f:
            f.write(text + "\n")
        print(text)
        return 0
    if not (args.out and args.lib and args.case and args.plan):
        parser.error("a run needs --out, --lib, --case and --plan (or --summarize DIR)")
    def named(specs: list[str], flag: str, expects: str, known: dict | None = None) -> dict[str, str]:
        """``NAME=VALUE`` options as a dict (NAME one of ``known`` where given), else a usage error."""
        bad = [spec for spec in specs if "=" not in spec or (known is not None and spec.split("=", 1)[0] not in known)]
        if bad:
            parser.error(f"{flag} expects {expects}, got {bad}")
        return dict(spec.split("=", 1) for spec in specs)

    libs = named(args.lib, "--lib", "NAME=PATH")
    names = list(libs)
    trees = named(args.pythonpath, "--pythonpath", "NAME=DIR with NAME given by --lib", libs)
    order = args.order.split(",")
    unknown = sorted(set(order) - set(libs))
    if unknown:
        parser.error(f"--order names {unknown}, not given by --lib (known: {names})")
    os.makedirs(args.out, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    command = [sys.executable, os.path.join(HERE, "kernel_counters.py"), "--reps", str(args.reps)]
    for case in args.case:
        command += ["--case", case]
    for plan in args.plan:
        command += ["--plan", plan]
    for i, name in enumerate(order):
        log = os.path.join(args.out, f"ab_{name}_{sum(n == name for n in order[:i]) + 1}.log")
        env = {**os.environ, "TESSERA_NATIVE_LIB": libs[name]}
        if name in trees:
            env = with_pythonpath_first(env, os.path.abspath(trees[name]))
        with open(log, "w") as f:
            rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False,
                                env=env).returncode
        times = read_run(log)
        with open(log) as f:
            mismatches = f.read().count("ORACLE")
        print(f"{name}: rc={rc}, {len(times)} pairs, {mismatches} oracle mismatches ({log})", flush=True)
        if rc == 0 and mismatches == 0:
            runs[name].append(times)
    text = summary(runs, names)
    with open(os.path.join(args.out, "ab.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
