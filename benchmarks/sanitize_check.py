"""A small run of representative native plans for compute-sanitizer (memcheck / racecheck):
contiguous, packed, refined, split-K and persistent, with partial blocks and empty rows."""

from __future__ import annotations

import math
import sys

import torch

from tessera_diffusers import KvLayout, PhysicalPlan, TaskOrganization, Traversal, build_mask_state, ops, prepare
from tessera_diffusers.catalog import portable_kernels
from tessera_diffusers.testing import check_against_reference, random_mask, random_qkv


def main() -> int:
    device = torch.device("cuda")
    cases = [
        ((16, 16), (64, 64, 128, "bf16", 2, 4), KvLayout.PACKED, TaskOrganization()),
        ((64, 64), (128, 128, 128, "fp16", 3, 8), KvLayout.CONTIGUOUS, TaskOrganization(Traversal.LONGEST_FIRST, 3)),
        ((384, 384), (128, 64, 64, "bf16", 2, 4), KvLayout.CONTIGUOUS, TaskOrganization(persistent=True)),
        ((32, 16), (64, 128, 64, "fp16", 3, 4), KvLayout.PACKED, TaskOrganization(Traversal.ROW_MAJOR, 2)),
    ]
    kernels = {(k.tile_q, k.tile_kv, k.head_dim, k.dtype, k.stages, k.warps): k for k in portable_kernels()}
    failures = 0
    for (bq, bkv), key, layout, org in cases:
        kernel = kernels[key]
        seq_q, seq_kv = 3 * bq + 19, 4 * bkv - 3
        mask = random_mask(1, 2, seq_q, seq_kv, bq, bkv, density=0.4, seed=bq, device=device)
        q, k, v = random_qkv(1, seq_q, seq_kv, 2, kernel.head_dim, kernel.torch_dtype, device, seed=bq)
        plan = PhysicalPlan(bq, bkv, layout, org, kernel)
        out, lse = ops.run_native(prepare(plan, build_mask_state(mask)), q, k, v, 1 / math.sqrt(kernel.head_dim), True)
        acc = check_against_reference(out, lse, q, k, v, mask)
        print(f"{plan.name}: {acc} {'ok' if acc.ok() else 'FAIL'}")
        failures += not acc.ok()
    torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
