"""How full the coarsened, packed KV tiles of the small-block families are, at the granularity a
portable (mma.sync) warp could skip: per (query unit, KV slot) pair of each scheduled tile, and per
(warp, tile) (a warp owns ``warp_rows`` query rows). CPU only; corpus masks at N = 32,768, H = 24.

``fill`` is active (unit, slot) pairs over scheduled pairs: the share of the tile's MMAs a
per-pair skip would keep. ``warp idle`` is the share of (warp, tile) pairs whose rows see no slot
of the tile: what a whole-tile skip per warp would save.

    python benchmarks/tile_fill.py --families Q16K16,Q32K16,Q32K32 --cases 5 --heads 4 --md OUT.md
"""

from __future__ import annotations

import sys

import torch

from tessera_diffusers.corpus import BENCH_32K, study_cases, study_parser

# (tile_q, tile_kv, query rows per warp): the portable 128 x 64 tile with 4 and 8 warps, 64 x 64 with 4
SHAPES = ((128, 64, 32), (128, 64, 16), (64, 64, 16))


def tile_fill(blocks: torch.Tensor, block_q: int, block_kv: int, tile_q: int, tile_kv: int,
              warp_rows: int) -> tuple[float, float]:
    """(fill, warp idle) of a coarsened-Q, packed-KV mapping of ``blocks [H, nQ, nKV]`` (bool)."""
    group_q, group_kv = tile_q // block_q, tile_kv // block_kv
    units_per_warp = max(1, warp_rows // block_q)
    heads, n_q, _ = blocks.shape
    n_tiles_q = -(-n_q // group_q)
    rows = torch.nn.functional.pad(blocks, (0, 0, 0, n_tiles_q * group_q - n_q)).view(heads, n_tiles_q, group_q, -1)
    union = rows.any(2)
    scheduled = active = warp_tiles = warp_idle = 0
    for h in range(heads):
        for t in range(n_tiles_q):
            cols = union[h, t].nonzero().flatten()
            if cols.numel() == 0:
                continue
            n_tiles_kv = -(-cols.numel() // group_kv)
            sub = torch.nn.functional.pad(rows[h, t][:, cols], (0, n_tiles_kv * group_kv - cols.numel()))
            sub = sub.view(group_q, n_tiles_kv, group_kv)
            scheduled += sub.numel()
            active += int(sub.sum())
            per_warp = sub.view(group_q // units_per_warp, units_per_warp, n_tiles_kv, group_kv).any(-1).any(1)
            warp_tiles += per_warp.numel()
            warp_idle += int((~per_warp).sum())
    return active / scheduled, warp_idle / warp_tiles


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "Q16K16,Q32K16,Q32K32")
    args = parser.parse_args(argv)
    lines = ["| case | " + " | ".join(f"{q}x{k}, {w} rows/warp: fill / warp idle" for q, k, w in SHAPES) + " |",
             "|---|" + "---|" * len(SHAPES)]
    for case in study_cases(args.families.split(","), args.cases, BENCH_32K):
        mask = case.build()
        blocks = mask.blocks[0, : args.heads]
        cells = [tile_fill(blocks, mask.block_q, mask.block_kv, q, k, w) for q, k, w in SHAPES]
        lines.append(f"| {case.name} | " + " | ".join(f"{f:.2f} / {i:.2f}" for f, i in cells) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.md:
        args.md.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
