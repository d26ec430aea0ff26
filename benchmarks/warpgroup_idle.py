"""How often a consumer warpgroup of the Hopper 128-row tiles has nothing to do, on the Q64K64
masks (CPU only; corpus masks at N = 32,768, H = 24).

In the grouped-packed 128 x 128 plan of a 64 x 64 mask, each task pairs two query blocks (the
grouped order of ``regroup.group_query_blocks``), and each of its KV tiles packs two 64-token key
blocks of their union. One consumer warpgroup owns each query block's 64 rows. A (warpgroup,
tile) pair is *idle* when neither of the tile's key blocks is in the warpgroup's set: its
scores are all masked, yet it runs both GEMMs and the softmax.

Two orders of a task's key blocks are counted:
- ``now``: the union in ascending order, as ``prepare`` packs it today (checked against the
  metadata ``prepare_grouped`` builds: the same tiles and idle pairs);
- ``sorted``: the blocks both query blocks attend first, then those only the first attends, then
  those only the second attends. Same tiles, more of them one-sided.

The idle share is an upper bound on the consumer work a per-warpgroup skip could save. The
producer's loads and the other warpgroup's work stay.

Three more columns weigh a different design, where each query block of a pair computes only its
own key blocks and the key blocks both attend are loaded once for the two (a pair sharing K / V):
- ``shared``: the key blocks both query blocks attend, as a share of the pair's union;
- ``union / own``: key blocks loaded per pair over the sum of each query block's own, i.e. the
  K / V bytes of that design against a 64-row plan that loads every block for each query block;
- ``128-row work``: the 128-row tile's work over the active work, 2 x union / own (in 64-column
  units, before packing rounds a task's union up to whole tiles), which that design would not do.

    python benchmarks/warpgroup_idle.py --families Q64K64-HD,Q64K64,Q64K64-DD --cases 5 --heads 4 --md OUT.md
"""

from __future__ import annotations

import sys

import torch

from tessera_diffusers.corpus import BENCH_32K, study_cases, study_parser
from tessera_diffusers.regroup import group_query_blocks


def idle_pairs(order: torch.Tensor, sets: list[torch.Tensor]) -> int:
    """Idle (query block, tile) pairs when ``order`` (key block indices) is packed two per tile."""
    n_tiles = -(-order.numel() // 2)
    cols = torch.nn.functional.pad(order, (0, 2 * n_tiles - order.numel()), value=-1).view(n_tiles, 2)
    valid = cols >= 0
    return sum(int((~(s[cols.clamp(min=0)] & valid).any(1)).sum()) for s in sets)


def grouped_order(blocks: torch.Tensor) -> torch.Tensor:
    """The grouped query-block order ``[H, slots]`` of ``blocks [H, nQ, nKV]`` in pairs (-1: none)."""
    return group_query_blocks(blocks[None], 2)[0]


def warpgroup_idle(blocks: torch.Tensor, order: torch.Tensor | None = None) -> tuple[int, float, float]:
    """(tiles, idle share now, idle share sorted) of ``blocks [H, nQ, nKV]`` (bool, 64 x 64 blocks),
    paired by ``order`` (``grouped_order(blocks)`` when not given)."""
    heads, n_q, _ = blocks.shape
    order = grouped_order(blocks) if order is None else order
    tiles = pairs = idle_now = idle_sorted = 0
    for h in range(heads):
        units = [u for u in order[h].tolist() if 0 <= u < n_q]
        for t in range(0, len(units), 2):
            sets = [blocks[h, u] for u in units[t:t + 2]]
            union = torch.stack(sets).any(0)
            cols = union.nonzero().flatten()
            if cols.numel() == 0:
                continue
            n_tiles = -(-cols.numel() // 2)
            tiles += n_tiles
            pairs += n_tiles * len(sets)
            idle_now += idle_pairs(cols, sets)
            if len(sets) == 2:
                a, b = sets
                cols = torch.cat([(a & b).nonzero().flatten(), (a & ~b).nonzero().flatten(),
                                  (b & ~a).nonzero().flatten()])
            idle_sorted += idle_pairs(cols, sets)
    return tiles, idle_now / max(pairs, 1), idle_sorted / max(pairs, 1)


def pair_sharing(blocks: torch.Tensor, order: torch.Tensor | None = None) -> tuple[float, float, float]:
    """(shared share of the union, union / own, 2 x union / own) over the pairs of ``blocks [H, nQ,
    nKV]`` (bool, 64 x 64 blocks) by ``order`` (``grouped_order(blocks)`` when not given); a head's
    unpaired last query block is left out."""
    heads, n_q, n_kv = blocks.shape
    order = grouped_order(blocks) if order is None else order
    shared = union = own = 0
    for h in range(heads):
        units = order[h][(order[h] >= 0) & (order[h] < n_q)]
        units = units[: units.numel() - units.numel() % 2]
        pairs = blocks[h, units].view(-1, 2, n_kv)
        shared += int((pairs[:, 0] & pairs[:, 1]).sum())
        union += int(pairs.any(1).sum())
        own += int(pairs.sum())
    return shared / max(union, 1), union / max(own, 1), 2 * union / max(own, 1)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__, "Q64K64-HD,Q64K64,Q64K64-DD")
    args = parser.parse_args(argv)
    lines = [("| case | density | tiles | idle (warpgroup, tile) pairs now | sorted: shared blocks first "
              "| shared | union / own | 128-row work |"),
             "|---|---|---|---|---|---|---|---|"]
    for case in study_cases(args.families.split(","), args.cases, BENCH_32K):
        mask = case.build()
        if (mask.block_q, mask.block_kv) != (64, 64):
            print(f"{case.name}: blocks {mask.block_q} x {mask.block_kv}, not 64 x 64; skipped", file=sys.stderr)
            continue
        blocks = mask.blocks[0, : args.heads].bool()
        order = grouped_order(blocks)  # the grouping is the costly step: once per case
        tiles, now, ordered = warpgroup_idle(blocks, order)
        shared, loads, work = pair_sharing(blocks, order)
        row = (f"| {case.name} | {float(blocks.float().mean()):.3f} | {tiles} | {now:.3f} | {ordered:.3f} "
               f"| {shared:.3f} | {loads:.3f} | {work:.3f} |")
        lines.append(row)
        print(row, flush=True)
    if args.md is not None:
        title = (f"# Idle (consumer warpgroup, KV tile) pairs of the grouped-packed 128 x 128 plan, and what "
                 f"its pairs share (corpus masks, N = 32,768, first {args.heads} heads; columns: "
                 f"benchmarks/warpgroup_idle.py)")
        args.md.write_text(title + "\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
