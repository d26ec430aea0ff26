"""The query-grouping kernel alone, for compute-sanitizer: random block masks (rows not a multiple of
the group or the segment, one segment per head, a segment smaller than the window), each grouping
compared with the torch code (its bit-for-bit oracle). Prints one line per mask; exits 1 on a
difference.

    compute-sanitizer --tool synccheck python benchmarks/grouping_sanitize.py
"""

from __future__ import annotations

import sys

import torch

from tessera_diffusers.regroup import group_query_blocks_torch, query_grouping

# (query blocks, key blocks, group, segment)
SHAPES = ((300, 300, 4, 128), (257, 500, 8, 0), (129, 64, 2, 16))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device and the native kernel library")
        return 1
    gen = torch.Generator().manual_seed(0)
    same = True
    for n_q, n_kv, group, segment in SHAPES:
        blocks = (torch.rand(1, 3, n_q, n_kv, generator=gen) < 0.2).cuda()
        got = query_grouping(blocks, group, 64, segment=segment, native=True)
        want = group_query_blocks_torch(blocks.cpu(), group, 64, segment=segment)
        equal = (torch.equal(got.q_units.cpu().long(), want.q_units.long())
                 and torch.equal(got.key_blocks.cpu(), want.key_blocks))
        print(f"nQ {n_q} nKV {n_kv} g {group} segment {segment}: {'equal' if equal else 'DIFFERENT'} to the torch code")
        same &= equal
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
