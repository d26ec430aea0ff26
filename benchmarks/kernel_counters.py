"""Launch chosen catalog plans on chosen corpus cases, for hardware counters (``ncu``) and plain
CUDA-event timings of the same launches: where a plan's time goes (tensor pipes, L2, stalls)
rather than how long it takes. The plans are the catalog's and their grouped query layout (the plans
of a mask that comes back; a grouped plan's preparation, the grouping included, is not timed).

Each (case, plan) pair is prepared once, checked against the fp32 oracle on two heads, launched
``--warmup`` times, then ``--launches`` times inside an NVTX range named after the pair (what
``ncu --nvtx --nvtx-include`` filters on), then timed with CUDA events over ``--reps`` launches.
``--dense`` adds the all-active mask of each case's geometry (the kernel's dense rate, beside
cuDNN SDPA timed in the same process).

    python benchmarks/kernel_counters.py --case Q64K64/temporal_heads --plan 'direct_q64k64.*s2w4_lpt$'
    ncu --clock-control none --kernel-name regex:attention_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python benchmarks/kernel_counters.py --case ... --plan ... --launches 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Callable
from functools import partial

import torch

from tessera_diffusers import LogicalMask, build_mask_state, ops, prepare
from tessera_diffusers.catalog import plans_for
from tessera_diffusers.corpus import BENCH_32K, enumerate_cases
from tessera_diffusers.mask_state import MaskState
from tessera_diffusers.plans import PhysicalPlan, with_grouped_layouts
from tessera_diffusers.prepare import PreparedPlan
from tessera_diffusers.testing import check_against_reference


def case_mask(spec: str, heads: int, device: torch.device) -> LogicalMask:
    """``FAMILY/source`` (evaluation split, first seed) at N = 32,768."""
    family, source = spec.split("/")
    grid = dataclasses.replace(BENCH_32K, heads=heads)
    case = next(enumerate_cases("evaluation", families=[family], sources=[source], grids=[grid], heads=heads,
                                seeds_per_combo=1))
    return case.build(device)


def timed_ms(fn: Callable[[], object], reps: int) -> float:
    """Median CUDA-event time of ``fn`` over ``reps`` calls, each from an idle stream (a sync after
    every call, so a call's host launch work is inside its time, alike for every plan compared)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", required=True, help="FAMILY/source, e.g. Q64K64/temporal_heads")
    parser.add_argument("--plan", action="append", required=True, help="regex over plan names (repeatable)")
    parser.add_argument("--dense", action="store_true", help="also the all-active mask of each case's geometry")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--static", action="store_true",
                        help="also time persistent plans through the custom op (static task striding)")
    args = parser.parse_args(argv)

    device = torch.device("cuda")
    kernels = ops.available_kernels()
    gen = torch.Generator(device=device).manual_seed(0)
    failures = 0
    masks = []
    for spec in args.case:
        mask = case_mask(spec, args.heads, device)
        masks.append((spec, mask))
        if args.dense:
            dense = LogicalMask.from_blocks(torch.ones_like(mask.blocks), mask.block_q, mask.block_kv,
                                            mask.seq_len_q, mask.seq_len_kv)
            masks.append((spec.split("/")[0] + "/dense", dense))
    print(f"{'case':<32} {'density':>7} {'plan':<72} {'ms':>7} {'TF/s':>6}")
    for spec, mask in masks:
        n, d = mask.seq_len_q, 128
        q, k, v = (torch.randn(1, n, args.heads, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3))
        scale = 1.0 / math.sqrt(d)
        state = build_mask_state(mask)
        density = float(mask.blocks.float().mean())
        flops = 4.0 * d * density * n * n * args.heads
        candidates = [p for p in with_grouped_layouts(plans_for(mask.block_q, mask.block_kv, kernels))
                      if p.kernel.head_dim == d and p.kernel.dtype == "bf16"]
        chosen = [p for p in candidates if any(re.search(r, p.name) for r in args.plan)]
        for plan in chosen:
            prepared, ok = checked_launch(plan, state, mask, q, k, v, scale)
            failures += not ok
            run = partial(ops.run_native, prepared, q, k, v, scale, False)
            for _ in range(args.warmup):
                run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{spec}:{plan.name}")
            for _ in range(args.launches):
                run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            ms = timed_ms(run, args.reps) if args.reps > 0 else math.nan
            print(f"{spec:<32} {density:7.3f} {plan.name:<72} {ms:7.3f} {flops / ms / 1e9:6.0f}"
                  f"{'' if ok else '  ORACLE MISMATCH'}", flush=True)
            if args.static and plan.tasks.persistent and args.reps > 0:
                static = partial(
                    torch.ops.tessera.sparse_attention_fwd, q, k, v, prepared.tile_counts, prepared.tile_slots,
                    prepared.tile_member, prepared.q_order, plan.kernel.name, prepared.launch_config(), scale,
                    prepared.q_units)
                static()
                ms = timed_ms(static, args.reps)
                print(f"{spec:<32} {density:7.3f} {plan.name + ' (static)':<72} {ms:7.3f} {flops / ms / 1e9:6.0f}",
                      flush=True)
        if spec.endswith("/dense"):
            sdpa = partial(torch.nn.functional.scaled_dot_product_attention,
                           q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                sdpa()
                ms = timed_ms(sdpa, args.reps) if args.reps > 0 else math.nan
            print(f"{spec:<32} {1.0:7.3f} {'dense cuDNN SDPA':<72} {ms:7.3f} {4.0 * d * n * n * args.heads / ms / 1e9:6.0f}")
    return 1 if failures else 0


def checked_launch(plan: PhysicalPlan, state: MaskState, mask: LogicalMask, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, scale: float) -> tuple[PreparedPlan, bool]:
    """``plan`` prepared for ``state`` (the metadata of ``mask``) and launched once on ``q, k, v
    [1, N, H, D]``; whether its output and log-sum-exp match the fp32 oracle on the first two heads."""
    prepared = prepare(plan, state)
    out, lse = ops.run_native(prepared, q, k, v, scale, True)
    acc = check_against_reference(out[:, :, :2], lse[:, :2], q[:, :, :2], k[:, :, :2], v[:, :, :2],
                                  head_slice(mask, 2))
    return prepared, acc.ok()


def head_slice(mask: LogicalMask, heads: int) -> LogicalMask:
    """The first ``heads`` heads of ``mask`` (a mask shared by all heads stays as it is)."""
    if mask.blocks.shape[1] == 1:
        return mask
    return LogicalMask.from_blocks(mask.blocks[:, :heads].contiguous(), mask.block_q, mask.block_kv,
                                   mask.seq_len_q, mask.seq_len_kv)


if __name__ == "__main__":
    sys.exit(main())
