"""Accuracy of 8-bit attention (``tessera_diffusers.quantized``) against the fp32 oracle on the
corpus's masks: per case and P V format, the cosine similarity and relative L2 error of the output
over the whole request, with standard-normal q, k, v as the benchmarks draw them (the hardest
inputs for a relative error: no shared direction, every output a cancelling average). The masks
are the corpus's (``--split evaluation``: never profiled); ``--heads`` keeps the CPU run short.

    python benchmarks/quantized_accuracy.py --out DIR [--sizes n32k] [--families Q64K64,...]
        [--split evaluation] [--cases-per-combo 1] [--heads 2] [--device cpu]

Writes ``quantized_accuracy.json``, ``.md`` (distribution per family and format, the budget of
``quantized.MIN_COSINE`` / ``MAX_RELATIVE_L2``) and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from tessera_diffusers import quantized, reference
from tessera_diffusers.bench.config import ALL_FAMILIES
from tessera_diffusers.bench.problem import Problem, make_inputs
from tessera_diffusers.profile.config import ProfileConfig

FORMATS = quantized.PV_FORMATS


def evaluate(config: ProfileConfig, device: torch.device, log=print) -> list[dict]:
    records = []
    cases = config.cases()
    for index, (size, case) in enumerate(cases, 1):
        start = time.time()
        mask = case.build(device)
        problem = Problem(case.name, size, case.family, case.source, mask, 1, case.heads, config.head_dim,
                          torch.bfloat16, case, {})
        q, k, v = make_inputs(problem, 1, case.seed)[0]
        oracle = reference.attention(q, k, v, mask, out_dtype=torch.float32)
        record = {"case": f"{size}:{case.name}", "family": case.family, "source": case.source,
                  "density": mask.density(), "heads": case.heads, "seq": mask.seq_len_q,
                  "bf16_rounding": vars(quantized.agreement(oracle.to(torch.bfloat16), oracle))}
        for pv in FORMATS:
            record[pv] = vars(quantized.agreement(quantized.attention(q, k, v, mask, pv=pv), oracle))
        records.append(record)
        log(f"[{index}/{len(cases)}] {record['case']}: " + ", ".join(
            f"{pv} cos {record[pv]['cosine']:.5f} rel {record[pv]['relative_l2']:.4f}" for pv in FORMATS)
            + f" ({time.time() - start:.0f} s)")
    return records


def markdown(records: list[dict]) -> list[str]:
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_family[r["family"]].append(r)
    lines = [f"Budget: cosine >= {quantized.MIN_COSINE}, relative L2 <= {quantized.MAX_RELATIVE_L2} (per case).", "",
             "| family | cases | " + " | ".join(f"{pv}: min cosine | {pv}: median / max rel. L2 | {pv}: within budget"
                                                 for pv in FORMATS) + " | bf16 rounding: max rel. L2 |",
             "|---|---|" + "---|---|---|" * len(FORMATS) + "---|"]
    for family in sorted(by_family) + ["all"]:
        rows = records if family == "all" else by_family[family]
        cells = [family, str(len(rows))]
        for pv in FORMATS:
            cos = [r[pv]["cosine"] for r in rows]
            rel = [r[pv]["relative_l2"] for r in rows]
            ok = sum(c >= quantized.MIN_COSINE and e <= quantized.MAX_RELATIVE_L2 for c, e in zip(cos, rel))
            cells += [f"{min(cos):.5f}", f"{statistics.median(rel):.4f} / {max(rel):.4f}", f"{ok}/{len(rows)}"]
        cells.append(f"{max(r['bf16_rounding']['relative_l2'] for r in rows):.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    families = sorted({r["family"] for r in records})
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(families)), 4))
    for offset, pv, colour in ((-0.2, "int8", "tab:blue"), (0.0, "fp8", "tab:orange"), (0.2, "bf16", "tab:green")):
        for i, family in enumerate(families):
            values = [r[pv]["relative_l2"] for r in records if r["family"] == family]
            ax.scatter([i + offset] * len(values), values, s=14, color=colour, label=pv if i == 0 else None)
    ax.axhline(quantized.MAX_RELATIVE_L2, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xticks(range(len(families)), families, rotation=30)
    ax.set_ylabel("relative L2 error vs fp32")
    ax.set_title("P V formats after INT8 Q K^T on the corpus's masks (standard-normal q, k, v)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="n32k")
    parser.add_argument("--families", default=",".join(f for f in ALL_FAMILIES if f not in ("Q384K384-W", "Q384K384-H")))
    parser.add_argument("--sources", default=None)
    parser.add_argument("--split", choices=("profiling", "evaluation"), default="evaluation")
    parser.add_argument("--cases-per-combo", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2, help="heads per case (the size's own count: 0)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    config = ProfileConfig(out_dir=args.out, sizes=tuple(args.sizes.split(",")), families=tuple(args.families.split(",")),
                           sources=tuple(args.sources.split(",")) if args.sources else None, split=args.split,
                           cases_per_combo=args.cases_per_combo, heads=args.heads or None)
    args.out.mkdir(parents=True, exist_ok=True)
    records = evaluate(config, torch.device(args.device))
    (args.out / "quantized_accuracy.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "torch": torch.__version__, "device": args.device, "cases": records}, indent=1))
    lines = markdown(records)
    (args.out / "quantized_accuracy.md").write_text("\n".join(["# 8-bit attention against the fp32 oracle", ""] + lines) + "\n")
    plot(records, args.out / "quantized_accuracy.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
