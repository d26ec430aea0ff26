"""What the grouping's pick criterion schedules, on corpus masks (CPU only; N = 32,768, H = 24).

The grouped query layout (``tessera_diffusers/regroup.py``) takes, for each group, a seed and then
the window's candidate whose pick count is lowest: the key blocks a candidate would add to the
group's union plus, ``lack_weight`` w times, the union's blocks the candidate lacks. w = 0 counts
the added blocks only (the kernel's pick until 2026-12-02); w = 1, the kernel's now
(``regroup.LACK_WEIGHT``), is the size of the symmetric difference, which prefers a row like the
seed's to a row that merely has few blocks.

Per case and w, the grouped-packed tiles of ``g`` query blocks x ``k`` key blocks the layout
schedules (each group's union of key blocks, packed ``k`` to a tile) over the active work in the
same tile units (``active blocks / (g k)``), natural order included; then the geometric mean per
(family, tile). The tile shapes are those of the grouped plans of the shipped table: 64 x 64 and
128 x 128 tiles over the family's blocks.

    python benchmarks/grouping_criterion.py --families Q16K16,Q32K16,Q32K32,Q64K32,Q64K64-HD,Q64K64,Q64K64-DD \\
        --cases 5 --heads 2 --md benchmarks/results/grouping_criterion_cpu.md
"""

from __future__ import annotations

import sys

import torch

from tessera_diffusers.bench.metrics import geometric_mean
from tessera_diffusers.corpus import BENCH_32K, study_cases, study_parser
from tessera_diffusers.mask_state import group_activity
from tessera_diffusers.regroup import group_query_blocks_torch, natural_units, num_slots, permuted_blocks

TILES = (64, 128)  # query and key rows of the grouped plans' square tiles
WEIGHTS = (0, 1, 2)  # lack weights compared (1: the kernel's, regroup.LACK_WEIGHT)


def scheduled_tiles(blocks: torch.Tensor, q_units: torch.Tensor, group: int, per_tile: int) -> int:
    """Tiles of ``group`` query blocks x ``per_tile`` key blocks that the order ``q_units``
    ``[H, slots]`` schedules on ``blocks`` ``[H, nQ, nKV]`` bool: per group, its union packed."""
    union = group_activity(permuted_blocks(blocks[None], q_units[None])[0], group, dim=-2).sum(-1)  # [H, groups]
    return int(((union + per_tile - 1) // per_tile).sum())


def tile_work(blocks: torch.Tensor, block_q: int, block_kv: int, tile: int,
              weights: tuple[int, ...] = WEIGHTS) -> dict[str, float]:
    """Scheduled tiles over the active work for the natural order and each lack weight, on
    ``blocks`` ``[H, nQ, nKV]`` bool of ``block_q x block_kv`` blocks in ``tile x tile`` tiles."""
    group, per_tile = tile // block_q, tile // block_kv
    heads, n_q, _ = blocks.shape
    active = int(blocks.sum()) / (group * per_tile)
    natural = natural_units(n_q, num_slots(n_q, group), blocks.device).expand(heads, -1)
    work = {"natural": scheduled_tiles(blocks, natural, group, per_tile) / active}
    for w in weights:
        order = group_query_blocks_torch(blocks[None], group, lack_weight=w).q_units[0].long()
        work[f"w={w}"] = scheduled_tiles(blocks, order, group, per_tile) / active
    return work


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "Q16K16,Q32K16,Q32K32,Q64K32,Q64K64-HD,Q64K64,Q64K64-DD")
    args = parser.parse_args(argv)
    names = ["natural"] + [f"w={w}" for w in WEIGHTS]
    lines = ["| case | tile | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    per_family: dict[tuple[str, int], list[dict[str, float]]] = {}
    for case in study_cases(args.families.split(","), args.cases, BENCH_32K):
        mask = case.build()
        blocks = mask.blocks[0, : args.heads].bool()
        for tile in TILES:
            if tile % mask.block_q or tile % mask.block_kv or tile == mask.block_q:
                continue  # not a grouped tile of this geometry (one query block per tile)
            work = tile_work(blocks, mask.block_q, mask.block_kv, tile)
            per_family.setdefault((case.family, tile), []).append(work)
            row = f"| {case.name} | {tile} x {tile} | " + " | ".join(f"{work[n]:.3f}" for n in names) + " |"
            lines.append(row)
            print(row, flush=True)
    lines += ["", "| family | tile | cases | " + " | ".join(f"GM {n}" for n in names) + " |",
              "|---|---|---|" + "---|" * len(names)]
    for (family, tile), works in per_family.items():
        gms = " | ".join(f"{geometric_mean(w[n] for w in works):.4f}" for n in names)
        lines.append(f"| {family} | {tile} x {tile} | {len(works)} | {gms} |")
    print("\n".join(lines[-len(per_family) - 2:]))
    if args.md is not None:
        title = (f"# Tiles the grouped layout schedules over the active work, by the pick's lack weight "
                 f"(corpus masks, N = 32,768, first {args.heads} heads; columns: benchmarks/grouping_criterion.py)")
        args.md.write_text(title + "\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
