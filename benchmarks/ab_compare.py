"""Per-plan ratios of two ``benchmarks/kernels.py`` runs of the same cases (an A/B of two builds of
the kernel library, e.g. the ``kernels_base`` and ``kernels_ab`` directories of
``benchmarks/ab_library.sh``), as markdown: the geometric mean per family and overall, every plan's
base and study latency, and the dense cuDNN latency of both runs as the drift check.

    python benchmarks/ab_compare.py BASE_DIR STUDY_DIR [--filter REGEX] [--md OUT.md] [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from tessera_diffusers.bench.metrics import geometric_mean, ok


def kernel_times(run_dir: Path) -> dict[tuple[str, str], float]:
    """(family, plan or backend) -> kernel ms of every record that ran and passed its check."""
    with open(run_dir / "records.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {(r["family"], r.get("plan") or r["backend"]): r["kernel_ms"] for r in ok(records)}


def report(base: dict, study: dict, pattern: str | None, title: str) -> str:
    families: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for (family, name), ms in base.items():
        if (family, name) not in study or name.startswith("sdpa") or name == "flex":
            continue
        if pattern is None or re.search(pattern, name):
            families[family].append((name, ms, study[(family, name)]))
    if not families:
        raise SystemExit("no plan was timed in both runs (check the directories and --filter)")
    ratios = [s / b for rows in families.values() for _, b, s in rows]
    summary = (f"Study over base, kernel latency: GM **{geometric_mean(ratios):.3f}** over {len(ratios)} plans "
               "(below 1: the study build is faster).")
    lines = [f"# {title}", "", summary, "",
             "| family | plans | GM | best base plan ms | its study ms | cuDNN base / study ms |",
             "|---|---|---|---|---|---|"]
    for family, rows in families.items():
        best = min(rows, key=lambda r: r[1])
        cudnn = (base.get((family, "sdpa-cudnn")), study.get((family, "sdpa-cudnn")))
        dense = " / ".join(f"{c:.3f}" if c else "-" for c in cudnn)
        lines.append(f"| {family} | {len(rows)} | {geometric_mean([s / b for _, b, s in rows]):.3f} | {best[1]:.3f} | "
                     f"{best[2]:.3f} | {dense} |")
    lines += ["", "| family | plan | base ms | study ms | ratio |", "|---|---|---|---|---|"]
    for family, rows in families.items():
        for name, b, s in sorted(rows, key=lambda r: r[1]):
            lines.append(f"| {family} | {name} | {b:.3f} | {s:.3f} | {s / b:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path)
    parser.add_argument("study", type=Path)
    parser.add_argument("--filter", default=None, help="regular expression over plan names")
    parser.add_argument("--md", type=Path, default=None)
    parser.add_argument("--title", default="A/B of two kernel library builds")
    args = parser.parse_args(argv)
    text = report(kernel_times(args.base), kernel_times(args.study), args.filter, args.title)
    if args.md:
        args.md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
