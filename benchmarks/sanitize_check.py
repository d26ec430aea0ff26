"""A small run of representative native plans for compute-sanitizer (memcheck / racecheck /
synccheck): contiguous, packed, refined, split-K and persistent, partial blocks and empty rows; six
Hopper cases on sm90 (two for the 64 x 64 tile, which runs two CTAs per SM).

``--every-kernel`` runs every Hopper kernel of the library twice instead, once per task schedule:
a direct plan on the static schedule (longest-first, row-major and split-K in turn) and a
persistent plan on the dynamic one (coarsened-packed and refined in turn), and a 128-row kernel a
plan of two query blocks per tile on the static one, so each compiled kernel (tile x head
dim x dtype x stages x schedule) is exercised under the sanitizer, coarsened and (``--grouped``)
grouped query tiles on both schedules; ``--only``
narrows it to the kernels whose name matches a regex. ``--grouped``
adds each case's grouped query layout where its query tile covers several blocks.

``--quantized`` runs every 8-bit kernel of the library instead (``--only`` narrows them), each on
five plans of its 16-bit kernel: 128 x 128 blocks (direct on a 128 x 128 tile, refined on 64 x 64),
packed on a persistent grid with 3 splits, grouped-packed with 3 splits, refined, grouped-packed on
a persistent grid; checked against the fp32 oracle within the 8-bit budget."""

from __future__ import annotations

import argparse
import math
import re
import sys

import torch

from tessera_diffusers import (
    KvLayout,
    PhysicalPlan,
    TaskOrganization,
    Traversal,
    build_mask_state,
    library,
    ops,
    prepare,
    quantized,
    quantized_ops,
    reference,
)
from tessera_diffusers.catalog import all_kernels, base_kernel
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.kernel_table import pv_format, quantized_rows
from tessera_diffusers.testing import check_against_reference, device_request, random_mask, random_qkv

# (geometry, family, (tile_q, tile_kv, head_dim, dtype, stages, warps), layout, task organization)
PORTABLE_CASES = [
    ((16, 16), "portable", (64, 64, 128, "bf16", 2, 4), KvLayout.PACKED, TaskOrganization()),
    ((64, 64), "portable", (128, 128, 128, "fp16", 3, 8), KvLayout.CONTIGUOUS, TaskOrganization(Traversal.LONGEST_FIRST, 3)),
    ((384, 384), "portable", (128, 64, 64, "bf16", 2, 4), KvLayout.CONTIGUOUS, TaskOrganization(persistent=True)),
    ((32, 16), "portable", (64, 128, 64, "fp16", 3, 4), KvLayout.PACKED, TaskOrganization(Traversal.ROW_MAJOR, 2)),
    # two m16 tiles per warp, each on its own 16-row query unit of a coarsened 128 x 64 tile, split-K
    ((16, 16), "portable", (128, 64, 128, "bf16", 2, 4), KvLayout.CONTIGUOUS, TaskOrganization(Traversal.LONGEST_FIRST, 2)),
]
HOPPER_CASES = [
    ((128, 128), "hopper", (128, 128, 128, "bf16", 2, 8), KvLayout.CONTIGUOUS, TaskOrganization(Traversal.LONGEST_FIRST, 3)),
    ((16, 16), "hopper", (64, 128, 128, "fp16", 2, 4), KvLayout.PACKED, TaskOrganization()),
    ((384, 384), "hopper", (128, 64, 64, "bf16", 2, 8), KvLayout.CONTIGUOUS, TaskOrganization(persistent=True)),
    ((64, 64), "hopper", (128, 128, 128, "bf16", 2, 8), KvLayout.PACKED, TaskOrganization(persistent=True)),
    # The 64 x 64 tile runs two CTAs per SM: direct and persistent, and packed with split-K.
    ((64, 64), "hopper", (64, 64, 128, "bf16", 2, 4), KvLayout.CONTIGUOUS, TaskOrganization(persistent=True)),
    ((32, 16), "hopper", (64, 64, 64, "fp16", 2, 4), KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 2)),
]


# The 8-bit kernels' plans: (geometry, layout, task organization, grouped query layout)
QUANTIZED_CASES = [
    ((128, 128), KvLayout.CONTIGUOUS, TaskOrganization(), False),
    ((32, 16), KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 3, persistent=True), False),
    ((32, 32), KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 3), True),
    ((384, 384), KvLayout.CONTIGUOUS, TaskOrganization(Traversal.ROW_MAJOR), False),
    ((32, 32), KvLayout.PACKED, TaskOrganization(persistent=True), True),
]

STATIC_ORGS = (TaskOrganization(), TaskOrganization(Traversal.ROW_MAJOR),
               TaskOrganization(Traversal.LONGEST_FIRST, 2))


def case_sizes(block_q: int, block_kv: int) -> tuple[int, int]:
    """Query and key lengths of a case: partial last blocks, rows of several tiles."""
    return max(3 * block_q, 512) + 19, max(4 * block_kv, 1024) - 3


def every_hopper_kernel(kernels) -> list[tuple]:
    """Two cases per Hopper kernel: a direct plan on the static schedule and a persistent plan on
    the dynamic one, each in the shape of ``HOPPER_CASES``; a 128-row kernel also runs a plan of two
    query blocks per tile on the static schedule."""
    cases = []
    for i, k in enumerate(sorted((k for k in kernels if k.family.value == "hopper"), key=lambda k: k.name)):
        key = (k.tile_q, k.tile_kv, k.head_dim, k.dtype, k.stages, k.warps)
        cases.append(((k.tile_q, k.tile_kv), "hopper", key, KvLayout.CONTIGUOUS, STATIC_ORGS[i % 3]))
        if i % 2:  # refined: logical blocks twice the tile
            cases.append(((2 * k.tile_q, 2 * k.tile_kv), "hopper", key, KvLayout.CONTIGUOUS,
                          TaskOrganization(persistent=True)))
        else:  # coarsened query blocks, KV blocks packed into the tile
            cases.append(((k.tile_q // 2, 16), "hopper", key, KvLayout.PACKED, TaskOrganization(persistent=True)))
        if k.tile_q == 128:  # two query blocks per tile on the static schedule too (O through TMA)
            cases.append(((64, 32), "hopper", key, KvLayout.PACKED, TaskOrganization()))
    return cases


def run_quantized(only: str | None, device: torch.device) -> int:
    """Every 8-bit kernel of the library (names matching ``only``) on ``QUANTIZED_CASES``; the
    number of plans outside the budget or with a non-finite output."""
    qlib = library.quantized_library()
    rows = [r for r in quantized_rows()
            if qlib is not None and r.name in qlib.kernel_ids and (only is None or re.search(only, r.name))]
    if not rows:
        raise SystemExit("no 8-bit kernel to run: --quantized needs an sm90 GPU and a library with 8-bit kernels")
    failures = 0
    for row in rows:
        base = base_kernel(row)
        pv = pv_format(row)
        for (bq, bkv), layout, org, grouped in QUANTIZED_CASES:
            seq_q, seq_kv = case_sizes(bq, bkv)
            mask = random_mask(1, 2, seq_q, seq_kv, bq, bkv, density=0.4, seed=bq, device=device)
            q, k, v = random_qkv(1, seq_q, seq_kv, 2, base.head_dim, base.torch_dtype, device, seed=bq)
            plan = PhysicalPlan(bq, bkv, layout, org, base)
            plan = plan.grouped() if grouped else plan
            why = rejection(plan, device_request(q, k, mask, plan))
            if why is not None:
                raise SystemExit(f"{row.name}: {plan.name} cannot run: {why}")
            scale = 1 / math.sqrt(base.head_dim)
            x = quantized_ops.quantize(q, k, v, scale, pv)
            out = quantized_ops.run_quantized(prepare(plan, build_mask_state(mask)), q, k, v, scale, False,
                                              quantized=x, pv=pv)
            fit = quantized.agreement(out, reference.attention(q.float(), k.float(), v.float(), mask, scale))
            ok = fit.within_budget() and bool(torch.isfinite(out).all())
            print(f"{row.name} {plan.name}: cos {fit.cosine:.5f} rel {fit.relative_l2:.4f} {'ok' if ok else 'FAIL'}")
            failures += not ok
    torch.cuda.synchronize()
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", choices=("portable", "hopper"), default=None, help="only this kernel family")
    parser.add_argument("--every-kernel", action="store_true",
                        help="every Hopper kernel of the library, once per task schedule (replaces the fixed cases)")
    parser.add_argument("--grouped", action="store_true",
                        help="also run each case whose query tile covers several blocks in the grouped query layout")
    parser.add_argument("--quantized", action="store_true",
                        help="every 8-bit kernel of the library on four plans (replaces the fixed cases)")
    parser.add_argument("--only", default=None, metavar="REGEX",
                        help="with --every-kernel or --quantized: only the kernels whose name matches "
                             "(e.g. 'hopper_t(64x64|128x64)_')")
    parser.add_argument("--start", type=int, default=0,
                        help="skip the first START cases (to finish a sanitizer run that hit its time limit)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if args.quantized:
        return 1 if run_quantized(args.only, device) else 0
    built = ops.load_library().kernel_ids
    library = [k for k in all_kernels() if k.name in built]
    kernels = {(k.family.value, (k.tile_q, k.tile_kv, k.head_dim, k.dtype, k.stages, k.warps)): k for k in library}
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if args.every_kernel:
        chosen = [k for k in library if args.only is None or re.search(args.only, k.name)]
        cases = every_hopper_kernel(chosen) if hopper else []
    else:
        cases = PORTABLE_CASES + (HOPPER_CASES if hopper else [])
        cases = [c for c in cases if args.family in (None, c[1])]
    cases = cases[args.start:]
    if not cases:
        parser.error("no case to run: --every-kernel needs an sm90 GPU and a library with Hopper kernels")
    failures = 0
    for (bq, bkv), family, key, layout, org in cases:
        kernel = kernels[(family, key)]
        seq_q, seq_kv = case_sizes(bq, bkv)
        mask = random_mask(1, 2, seq_q, seq_kv, bq, bkv, density=0.4, seed=bq, device=device)
        q, k, v = random_qkv(1, seq_q, seq_kv, 2, kernel.head_dim, kernel.torch_dtype, device, seed=bq)
        plan = PhysicalPlan(bq, bkv, layout, org, kernel)
        state = build_mask_state(mask)
        for each in [plan] + ([plan.grouped()] if args.grouped and plan.can_group_queries else []):
            out, lse = ops.run_native(prepare(each, state), q, k, v, 1 / math.sqrt(kernel.head_dim), True)
            acc = check_against_reference(out, lse, q, k, v, mask)
            print(f"{each.name}: {acc} {'ok' if acc.ok() else 'FAIL'}")
            failures += not acc.ok()
    torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
