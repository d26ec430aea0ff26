"""What cutting each head into segments costs the query-block grouping: per corpus case and tile
height, the key blocks the grouped layout schedules (per head the fewer of the natural order's and
the greedy's, summed over the heads) with each segment size, over those of one segment per head.

Measured with the torch code (``regroup.group_query_blocks_torch``, the CUDA kernel's oracle: the
same numbers on a GPU) on the evaluation cases at size n32k; ``g`` = tile rows / block rows for the
64- and 128-row query tiles. Writes a markdown table to ``--out`` and prints the smallest segment
whose loss stays within ``--tolerance`` on every (family, source, g). With ``--device cuda`` the
native kernel groups (the same key blocks, ``tests/test_regroup_gpu.py``) and the table also has
its median time per segment size (CUDA events around the launches, ``--reps`` after one warm-up).

    python benchmarks/grouping_segments.py --out benchmarks/results/segment_sweep_cpu.md \
        [--families Q16K16,Q32K16,Q32K32] [--cases 1] [--segments 0,128,256,512] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from grouped_layout import cuda_ms  # benchmarks/ is on the path of a script

from tessera_diffusers.bench.config import SIZE_PROFILES
from tessera_diffusers.corpus import enumerate_cases, family_named
from tessera_diffusers.regroup import DEFAULT_WINDOW, QueryGrouping, group_query_blocks_torch, query_grouping

SIZE = "n32k"
TILE_ROWS = (64, 128)  # the query tiles of the plans that group (plans.PhysicalPlan.can_group_queries)


def progress(total: int):
    """A tqdm bar when tqdm is installed, else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="grouping")


def grouping(blocks: torch.Tensor, group: int, window: int, segment: int, reps: int) -> tuple[QueryGrouping, float]:
    """The grouping of ``blocks`` and, on CUDA (the native kernel), its median milliseconds (NaN on the CPU)."""
    if blocks.device.type != "cuda":
        return group_query_blocks_torch(blocks, group, window, segment=segment), float("nan")
    def run() -> QueryGrouping:
        return query_grouping(blocks, group, window, segment=segment, native=True)

    return run(), cuda_ms(run, reps, blocks.device)


def sweep(families: list[str], cases: int, segments: list[int], window: int, device: torch.device,
          reps: int = 5) -> list[dict]:
    """One row per (family, source, g): the key blocks at each segment size, summed over ``cases``
    cases of the source, and the natural order's (and on CUDA the grouping's milliseconds, summed)."""
    specs = []
    for name in families:
        grid, heads = SIZE_PROFILES[SIZE].grid_for(name)
        specs += list(enumerate_cases("evaluation", families=[name], grids=[grid], seeds_per_combo=cases, heads=heads))
    groups = {name: [tile // family_named(name).block_q for tile in TILE_ROWS if tile > family_named(name).block_q]
              for name in families}
    bar = progress(sum(len(groups[spec.family]) * len(segments) for spec in specs))
    rows: dict[tuple[str, str, int], dict] = {}
    for spec in specs:
        blocks = spec.build(device).blocks
        for group in groups[spec.family]:
            row = rows.setdefault((spec.family, spec.source, group), {
                "family": spec.family, "source": spec.source, "g": group, "nQ": blocks.shape[2], "cases": 0,
                "natural": 0, "key_blocks": dict.fromkeys(segments, 0), "ms": dict.fromkeys(segments, 0.0)})
            row["cases"] += 1
            for segment in segments:
                result, ms = grouping(blocks, group, window, segment, reps)
                row["ms"][segment] += ms
                key_blocks = result.key_blocks.cpu()  # [Bm, Hm, 2]
                row["key_blocks"][segment] += int(key_blocks.min(-1).values.sum())  # per head the fewer
                if segment == 0:
                    row["natural"] += int(key_blocks[..., 0].sum())
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return list(rows.values())


def smallest_within(rows: list[dict], segments: list[int], tolerance: float) -> int | None:
    """The smallest positive segment whose key blocks stay within ``1 + tolerance`` of one segment's
    on every row, or None."""
    for segment in sorted(s for s in segments if s > 0):
        if all(r["key_blocks"][segment] <= (1 + tolerance) * r["key_blocks"][0] for r in rows):
            return segment
    return None


def report(rows: list[dict], segments: list[int], command: str, tolerance: float, window: int,
           device: str = "CPU") -> str:
    others = [s for s in segments if s != 0]
    timed = all(r["ms"][s] == r["ms"][s] for r in rows for s in segments)  # NaN on the CPU
    source = (f"Measured with the native kernel on the {device} (its key blocks equal the torch code's: "
              "`tests/test_regroup_gpu.py`); ms: the grouping's median time, summed over the row's cases."
              if timed else "Measured on the CPU with the torch code (`regroup.group_query_blocks_torch`, the CUDA "
              "kernel's bit-for-bit oracle, so a GPU gives the same numbers).")
    lines = [
        f"# Segmented query-block grouping: key blocks against one segment per head ({SIZE}, {device})",
        "",
        source,
        "Key blocks = per head the fewer of the natural order's and the greedy's, summed over the heads",
        "(and the cases of the row). Columns: natural and each segment size (query blocks) over segment 0",
        f"(one segment per head); window {window}. Below 1: the segments scheduled fewer (the greedy is a",
        "heuristic; a boundary can also help it).",
        "",
        f"    {command}",
        "",
        "| family | source | g | nQ | cases | key blocks, segment 0 | natural / seg 0 | "
        + " | ".join(f"seg {s} / seg 0" for s in others) + " |"
        + ("".join(f" ms seg {s} |" for s in segments) if timed else ""),
        "|---|---|---|---|---|---|---|" + "---|" * len(others) + ("---|" * len(segments) if timed else ""),
    ]
    for r in rows:
        base = r["key_blocks"][0]
        ratios = " | ".join(f"{r['key_blocks'][s] / base:.4f}" for s in others)
        times = "".join(f" {r['ms'][s]:.3f} |" for s in segments) if timed else ""
        lines.append(f"| {r['family']} | {r['source']} | {r['g']} | {r['nQ']} | {r['cases']} | {base} | "
                     f"{r['natural'] / base:.3f} | {ratios} |{times}")
    worst = " | ".join(f"{max(r['key_blocks'][s] / r['key_blocks'][0] for r in rows):.4f}" for s in others)
    lines.append(f"| **worst** | | | | | | | {worst} |" + " |" * (len(segments) if timed else 0))
    chosen = smallest_within(rows, segments, tolerance)
    lines += ["", f"Smallest segment within {tolerance:.0%} on every row: "
              + (f"**{chosen}**." if chosen is not None else "none of those measured.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--families", default="Q16K16,Q32K16,Q32K32")
    parser.add_argument("--cases", type=int, default=1, help="evaluation cases per (family, source)")
    parser.add_argument("--segments", default="0,128,256,512", help="comma list of segment sizes (0 included)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest loss the chosen segment may have")
    parser.add_argument("--device", default="cpu", help="cpu (the torch code) or cuda (the native kernel, timed)")
    parser.add_argument("--reps", type=int, default=5, help="timed groupings per case and segment on CUDA")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error(f"--cases: expected a positive count, got {args.cases}")
    segments = sorted({0, *(int(s) for s in args.segments.split(","))})
    device = torch.device(args.device)
    rows = sweep(args.families.split(","), args.cases, segments, args.window, device, args.reps)
    command = (f"python benchmarks/grouping_segments.py --out {args.out} --families {args.families} "
               f"--cases {args.cases} --segments {','.join(map(str, segments))} --window {args.window}"
               + (f" --device {args.device}" if device.type != "cpu" else ""))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    text = report(rows, segments, command, args.tolerance, args.window, where)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
