"""Offline regret of plan selection, from measured kernel-study records (no GPU needed).

For every case of a kernel study (``benchmarks/kernels.py`` records: one latency per timed plan), the
case's mask is rebuilt from its corpus seed, and the plan each selector would choose for that
request is looked up in the records:

    table        the shipped plan table (regime lookup, ranking scan with eligibility)
    cost model   the analytic roofline model (no table), on the mask's statistics

regret = latency of the chosen plan / latency of the fastest plan measured on the case. Only the
plans the study timed count (a study with ``--plan-filter '_lpt$'`` times one task organization per
kernel and layout); a chosen plan that was not timed is reported as such, never guessed.

    python benchmarks/selection_regret.py benchmarks/results/h200_kernels_n32k_tma/records.jsonl
    python benchmarks/selection_regret.py RECORDS --table PATH --md OUT.md
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from tessera_diffusers import build_mask_state
from tessera_diffusers.corpus import CaseSpec
from tessera_diffusers.corpus.grids import grid_named
from tessera_diffusers.plan_table import load_plan_table
from tessera_diffusers.plans import DTYPE_NAMES, Request
from tessera_diffusers.selector import AUTO, Selector


def load_cases(path: Path) -> dict[str, dict]:
    """case name -> {"record": first record of the case, "plans": {plan name: kernel ms}}."""
    cases: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        entry = cases.setdefault(rec["case"], {"record": rec, "plans": {}})
        if rec.get("kernel_ms") and rec.get("plan"):
            entry["plans"][rec["plan"]] = rec["kernel_ms"]
    return {name: c for name, c in cases.items() if c["plans"]}


def case_spec(name: str, rec: dict) -> CaseSpec:
    family, source, grid, heads, seed = name.split("/")
    return CaseSpec(rec["geometry"], source, grid_named(grid), int(heads.lstrip("h")), int(seed.lstrip("s")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", type=Path, help="records.jsonl of a kernel study")
    parser.add_argument("--table", default=AUTO, help="plan table file (default: the shipped one)")
    parser.add_argument("--arch", default="sm90")
    parser.add_argument("--md", type=Path, default=None, help="also write the table as markdown here")
    args = parser.parse_args(argv)

    table = AUTO if args.table == AUTO else load_plan_table(Path(args.table))
    selectors = {"table": Selector(table=table), "cost model": Selector(table=None)}
    rows, regrets = [], {name: [] for name in selectors}
    for name, case in sorted(load_cases(args.records).items()):
        rec = case["record"]
        spec = case_spec(name, rec)
        mask = spec.build()
        state = build_mask_state(mask)
        request = Request(rec["batch"], rec["heads"], mask.seq_len_q, mask.seq_len_kv, rec["head_dim"],
                          DTYPE_NAMES[getattr(torch, rec["dtype"])], mask.block_q, mask.block_kv, args.arch, False)
        best_plan, best_ms = min(case["plans"].items(), key=lambda kv: kv[1])
        row = {"case": name, "best": best_plan, "best_ms": best_ms}
        for sel_name, selector in selectors.items():
            chosen = selector.select(request, state)
            ms = case["plans"].get(chosen.name) if chosen is not None else None
            row[sel_name] = (chosen.name if chosen is not None else None, ms)
            if ms is not None:
                regrets[sel_name].append(ms / best_ms)
        rows.append(row)

    lines = ["| case | fastest timed plan | ms | " + " | ".join(f"{s} choice | {s} regret" for s in selectors) + " |",
             "|---|---|---|" + "---|---|" * len(selectors)]
    for row in rows:
        cells = []
        for sel_name in selectors:
            plan, ms = row[sel_name]
            cells += [plan or "reference", f"{ms / row['best_ms']:.3f}" if ms else "not timed"]
        lines.append(f"| {row['case']} | {row['best']} | {row['best_ms']:.3f} | " + " | ".join(cells) + " |")
    lines.append("")
    for sel_name, values in regrets.items():
        if values:
            gm = math.exp(sum(math.log(v) for v in values) / len(values))
            within = sum(v <= 1.03 for v in values)
            lines.append(f"- {sel_name}: GM regret {gm:.4f}, worst {max(values):.3f}, within 3% on {within}/{len(values)} "
                         f"cases ({len(rows) - len(values)} choices not timed)")
    text = "\n".join(lines)
    print(text)
    if args.md is not None:
        args.md.write_text(f"# Selection regret on `{args.records}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
