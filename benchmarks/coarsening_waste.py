"""How much math a tile mapping computes beyond |E(M)| on corpus masks (CPU; no GPU needed).

For packed KV layouts the computed area of a query tile is the union of the key blocks of the query
blocks it covers, rounded up to whole KV tiles; everything beyond the active blocks is masked math.
This prints computed / active for several (tile_q, tile_kv) shapes with query blocks grouped as the
kernels group them (consecutive blocks), and with two reorderings of the query blocks of each head
(by the centroid of their key blocks; by their first key block) that a Q-side packing could use.

Dividing a family's effective TFLOP/s target by this ratio gives the rate the kernel would need on
the computed area: it bounds what any coarsened tile mapping can reach on these masks.

    python benchmarks/coarsening_waste.py --families Q16K16,Q32K16,Q32K32,Q64K64 --cases 5 --md OUT.md
"""

from __future__ import annotations

import torch

from tessera_diffusers.corpus import BENCH_32K, study_cases, study_parser
from tessera_diffusers.mask_state import group_activity

TILES = ((128, 128), (64, 128), (128, 64), (64, 64))


def computed_area(blocks: torch.Tensor, tile_q: int, tile_kv: int, block_q: int, block_kv: int) -> int:
    """Token pairs computed by a coarsened-Q, packed-KV mapping: ``blocks [H, nQ, nKV]`` bool."""
    group_q, group_kv = max(1, tile_q // block_q), max(1, tile_kv // block_kv)
    union = group_activity(blocks, group_q, dim=-2)  # [H, nQT, nKV]: the KV blocks of each query tile
    tiles = (union.sum(-1) + group_kv - 1) // group_kv
    return int(tiles.sum()) * tile_q * tile_kv


def reorder(blocks: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(key, dim=-1, stable=True)
    return torch.gather(blocks, 1, order.unsqueeze(-1).expand_as(blocks))


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "Q16K16,Q32K16,Q32K32,Q64K64", heads=False)
    args = parser.parse_args(argv)
    header = ("| case | density | " + " | ".join(f"{q}x{k}" for q, k in TILES)
              + " | 128x128, centroid order | 128x128, first-block order |")
    lines = [header, "|---|---|" + "---|" * (len(TILES) + 2)]
    for case in study_cases(args.families.split(","), args.cases, BENCH_32K):
        mask = case.build()
        blocks = mask.blocks[0]
        bq, bkv = mask.block_q, mask.block_kv
        active = int(blocks.sum()) * bq * bkv
        ratios = [computed_area(blocks, q, k, bq, bkv) / active for q, k in TILES]
        index = torch.arange(blocks.shape[-1], dtype=torch.float32)
        count = blocks.sum(-1).clamp(min=1)
        centroid = (blocks.float() * index).sum(-1) / count
        first = torch.where(blocks.any(-1), blocks.float().argmax(-1), blocks.shape[-1]).float()
        extra = [computed_area(reorder(blocks, key), 128, 128, bq, bkv) / active
                 for key in (centroid, first * 4096 + count)]
        row = f"| {case.name} | {mask.density():.3f} | " + " | ".join(f"{r:.2f}" for r in ratios + extra) + " |"
        lines.append(row)
        print(row, flush=True)
    if args.md is not None:
        args.md.write_text("# Computed / active token pairs of coarsened-Q, packed-KV tiles (corpus, N = 32,768, "
                           "H = 24)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
