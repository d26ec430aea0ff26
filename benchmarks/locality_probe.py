"""Is a Tessera kernel bound by where its K/V tiles come from? The same work twice: a banded mask
(each query block reads the key blocks around it: K/V reuse only between neighbouring query tiles)
and a mask with the same number of active blocks per row, all in the first columns (every query
tile reads the same K/V tiles: they stay in L2). Same |E(M)|, same tiles, same kernel; the time
difference is the cost of the K/V traffic that misses L2.

    python benchmarks/locality_probe.py [--n 32768] [--heads 24] [--plans REGEX]
"""

from __future__ import annotations

import argparse
import math
import re

import torch

from tessera_diffusers import KvLayout, LogicalMask, PhysicalPlan, TaskOrganization, build_mask_state, ops, prepare
from tessera_diffusers.bench.timing import time_kernel
from tessera_diffusers.catalog import all_kernels


def masks(n: int, heads: int, block: int, width: int, device) -> dict[str, LogicalMask]:
    nb = math.ceil(n / block)
    i = torch.arange(nb, device=device)
    band = (i[:, None] - i[None, :]).abs() <= width // 2
    first = i[None, :].expand(nb, nb) < band.sum(1, keepdim=True)
    return {name: LogicalMask(m.expand(1, heads, nb, nb).contiguous(), block, block, n, n)
            for name, m in (("band", band), ("same-columns", first))}


def time_ms(fn) -> float:
    """Median of 5 CUDA-event timings after 2 warm-ups (the harness's timer)."""
    return time_kernel(lambda _: fn(), 1, 2, 5, torch.device("cuda")).median_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--width", type=int, default=29, help="active key blocks per query block (of 256 at 32k)")
    parser.add_argument("--plans", default=r"t128x128_d128_bf16_s2")
    args = parser.parse_args()
    device = torch.device("cuda")
    built = ops.load_library().kernel_ids
    kernels = [k for k in all_kernels() if k.name in built and re.search(args.plans, k.name)]
    q, k, v = (torch.randn(1, args.n, args.heads, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    print(f"{'kernel':44s} {'mask':14s} {'ms':>8s} {'TF/s':>7s}")
    for name, mask in masks(args.n, args.heads, 128, args.width, device).items():
        flops = 4 * 128 * int(mask.interactions().sum())
        for kernel in kernels:
            plan = PhysicalPlan(128, 128, KvLayout.CONTIGUOUS, TaskOrganization(), kernel)
            prepared = prepare(plan, build_mask_state(mask))
            ms = time_ms(lambda: ops.run_native(prepared, q, k, v, 0.088, False))
            print(f"{kernel.name:44s} {name:14s} {ms:8.3f} {flops / ms / 1e9:7.1f}", flush=True)
        dense = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
        print(f"{'sdpa dense (full matrix)':44s} {'-':14s} {dense:8.3f} {4 * 128 * args.n**2 * args.heads / dense / 1e9:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
