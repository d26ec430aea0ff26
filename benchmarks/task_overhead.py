"""What a task costs beyond its KV tiles: catalog plans timed on masks whose every query block
attends exactly ``k`` key blocks (random, distinct, per head), for a range of ``k``, and a straight
line fitted to time against ``k``.

With every task holding the same number of tiles, a plan's time is ``c0 + c1 * k``: ``c1`` is the
time of one more tile in every task, ``c0`` what does not grow with the tiles (each task's start
and end: Q load, pipeline fill, first Q K^T without its overlap, epilogue; plus the launch and the
last wave's tail). ``c0 / c1`` is that fixed cost in tiles per task. The line is fitted over
``k <= --fit-max-k`` only: long launches run at a lower clock (the per-tile rate of the same kernel
drops by ~10% past ~8 ms on the H200), which bends the line at large ``k``. Per point, ``lost``
reads the same cost without a fit: ``k * (best rate / rate - 1)``, the tiles per task the point
lost against the plan's best rate over all ``k``. Dense cuDNN SDPA is timed in the same process
(before and after the plans, after warm-up), so each point also reads as a share of the dense rate
(effective TFLOP/s: 4 D |active pairs| / time).

    python benchmarks/task_overhead.py --out DIR                       # three direct Hopper plans
    python benchmarks/task_overhead.py --out DIR --ks 4,8,16,32 \\
        --config 'Q128K128=^direct_q128k128_from_q128k128_d128_bf16_sm90a_hopper_s2w8_lpt-persistent$'

Writes ``DIR/task_overhead.json``, ``DIR/task_overhead.md`` and ``DIR/task_overhead.png`` (with
matplotlib). Every plan's output is checked against the fp32 oracle on two heads before it is
timed; a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
from kernel_counters import checked_launch, timed_ms

from tessera_diffusers import LogicalMask, build_mask_state, ops
from tessera_diffusers.catalog import plans_for
from tessera_diffusers.plans import with_grouped_layouts

HOPPER = "d128_bf16_sm90a_hopper"
DEFAULT_CONFIGS = (
    f"Q128K128=^direct_q128k128_from_q128k128_{HOPPER}_s2w8_lpt-persistent$",
    f"Q128K128=^direct_q128k128_from_q128k128_{HOPPER}_s2w8_lpt$",
    f"Q64K64=^direct_q64k64_from_q64k64_{HOPPER}_s2w4_lpt-persistent$",
)  # direct plans only: on rows of random blocks a packed tile's union is about twice a row's blocks
DEFAULT_KS = "4,8,13,16,26,32,52,64,104,128"


@dataclass(frozen=True)
class Point:
    geometry: str
    plan: str
    k: int  # active key blocks per query block
    density: float
    ms: float
    tflops: float
    lost: float = math.nan  # k * (the plan's best rate / this rate - 1)


@dataclass(frozen=True)
class LineFit:
    """``ms = c0 + c1 * k`` by least squares; ``tiles`` = c0 / c1."""

    c0: float
    c1: float
    tiles: float
    max_residual: float  # largest |measured / fitted - 1| over the points


def parse_geometry(text: str) -> tuple[int, int]:
    """``Q64K64`` -> (64, 64)."""
    match = re.fullmatch(r"Q(\d+)K(\d+)", text)
    if match is None:
        raise ValueError(f"geometry: expected QnKm (e.g. Q64K64), got {text!r}")
    return int(match.group(1)), int(match.group(2))


def parse_config(text: str) -> tuple[str, str]:
    """``GEOMETRY=REGEX`` -> (geometry, regex), the geometry checked."""
    geometry, sep, regex = text.partition("=")
    if not sep or not regex:
        raise ValueError(f"--config: expected GEOMETRY=REGEX, got {text!r}")
    parse_geometry(geometry)
    return geometry, regex


def rows_of_k(heads: int, n_q: int, n_kv: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Bool ``[1, heads, n_q, n_kv]``: every row exactly ``k`` distinct random key blocks."""
    if not 1 <= k <= n_kv:
        raise ValueError(f"k: expected 1..{n_kv}, got {k}")
    scores = torch.rand(1, heads, n_q, n_kv, generator=generator, device=generator.device)
    chosen = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)


def fit_line(ks: list[int], ms: list[float]) -> LineFit:
    """Least-squares ``ms = c0 + c1 * k`` over at least two distinct ``k``."""
    if len(set(ks)) < 2 or len(ks) != len(ms):
        raise ValueError("fit_line: needs at least two distinct k, one time each")
    n = len(ks)
    mean_k, mean_ms = sum(ks) / n, sum(ms) / n
    c1 = sum((k - mean_k) * (m - mean_ms) for k, m in zip(ks, ms)) / sum((k - mean_k) ** 2 for k in ks)
    c0 = mean_ms - c1 * mean_k
    residual = max(abs(m / (c0 + c1 * k) - 1.0) for k, m in zip(ks, ms))
    return LineFit(c0=c0, c1=c1, tiles=c0 / c1, max_residual=residual)


def with_lost_tiles(points: list[Point]) -> list[Point]:
    """Each point with ``lost`` = k (best rate of its plan / its rate - 1)."""
    best: dict[str, float] = {}
    for p in points:
        best[p.plan] = max(best.get(p.plan, 0.0), p.tflops)
    return [replace(p, lost=p.k * (best[p.plan] / p.tflops - 1.0)) for p in points]


def markdown(points: list[Point], fits: dict[str, LineFit], fit_max_k: int, dense_tflops: float, env: str) -> str:
    lines = ["# Fixed cost per task (`benchmarks/task_overhead.py`)", "", f"- {env}",
             f"- dense cuDNN SDPA in the same process: {dense_tflops:.1f} TFLOP/s (the faster of its two timings)",
             "", f"Line fitted over k <= {fit_max_k}:", "",
             "| plan | c0 (ms) | c1 (ms per key block per row) | c0 / c1 (tiles per task) | max residual |",
             "|---|---|---|---|---|"]
    for plan, fit in fits.items():
        lines.append(f"| `{plan}` | {fit.c0:.4f} | {fit.c1:.5f} | {fit.tiles:.2f} | {fit.max_residual:.3f} |")
    lines += ["", "| plan | k | density % | ms | TFLOP/s | % of dense cuDNN | tiles lost per task |",
              "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| `{p.plan}` | {p.k} | {100 * p.density:.2f} | {p.ms:.3f} | {p.tflops:.1f} | "
                     f"{100 * p.tflops / dense_tflops:.1f} | {p.lost:.2f} |")
    return "\n".join(lines) + "\n"


def plot(points: list[Point], fits: dict[str, LineFit], dense_tflops: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for plan, fit in fits.items():
        mine = [p for p in points if p.plan == plan]
        ks = [p.k for p in mine]
        label = plan.replace(f"_{HOPPER}", "")
        left.plot(ks, [p.ms for p in mine], "o", label=f"{label} (c0/c1 = {fit.tiles:.1f})")
        left.plot([0, max(ks)], [fit.c0, fit.c0 + fit.c1 * max(ks)], "-", alpha=0.5)
        right.plot(ks, [100 * p.tflops / dense_tflops for p in mine], "o-", label=label)
    left.set(xlabel="key blocks per query block (k)", ylabel="kernel ms", title="time and its straight-line fit")
    right.set(xlabel="key blocks per query block (k)", ylabel="% of dense cuDNN TFLOP/s", xscale="log",
              title="efficiency")
    right.axhline(85, color="grey", linestyle=":")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", action="append", type=parse_config,
                        help="GEOMETRY=REGEX over plan names (repeatable; default: three direct Hopper plans)")
    parser.add_argument("--ks", default=DEFAULT_KS, help="comma-separated key blocks per query block")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--fit-max-k", type=int, default=32, help="fit the line over k up to this")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    configs = args.config or [parse_config(c) for c in DEFAULT_CONFIGS]
    ks = sorted({int(k) for k in args.ks.split(",")})

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    n, d = args.seq_len, 128
    q, k_, v = (torch.randn(1, n, args.heads, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q.transpose(1, 2), k_.transpose(1, 2),
                   v.transpose(1, 2))

    def time_dense() -> float:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            for _ in range(10):  # the clocks ramp up from idle
                sdpa()
            ms = timed_ms(sdpa, args.reps)
        print(f"dense cuDNN SDPA: {ms:.3f} ms, {4.0 * d * n * n * args.heads / ms / 1e9:.1f} TFLOP/s", flush=True)
        return ms

    dense_runs = [time_dense()]

    kernels = ops.available_kernels()
    points: list[Point] = []
    failures = 0
    for geometry, regex in configs:
        block_q, block_kv = parse_geometry(geometry)
        n_q, n_kv = -(-n // block_q), -(-n // block_kv)
        plans = [p for p in with_grouped_layouts(plans_for(block_q, block_kv, kernels)) if re.search(regex, p.name)]
        if not plans:
            print(f"{geometry}: no plan matches {regex!r} in this library", flush=True)
            failures += 1
            continue
        for k in ks:
            if k > n_kv:
                continue
            mask = LogicalMask.from_blocks(rows_of_k(args.heads, n_q, n_kv, k, gen), block_q, block_kv, n, n)
            state = build_mask_state(mask)
            density = float(mask.blocks.float().mean())
            flops = 4.0 * d * density * n * n * args.heads
            for plan in plans:
                prepared, ok = checked_launch(plan, state, mask, q, k_, v, scale)
                if not ok:
                    print(f"{plan.name} k={k}: ORACLE MISMATCH", flush=True)
                    failures += 1
                    continue
                run = partial(ops.run_native, prepared, q, k_, v, scale, False)
                for _ in range(args.warmup):
                    run()
                ms = timed_ms(run, args.reps)
                points.append(Point(geometry, plan.name, k, density, ms, flops / ms / 1e9))
                print(f"{plan.name:<72} k={k:<4} {ms:8.3f} ms {points[-1].tflops:6.1f} TF/s", flush=True)

    dense_runs.append(time_dense())
    dense_ms = min(dense_runs)
    dense_tflops = 4.0 * d * n * n * args.heads / dense_ms / 1e9
    points = with_lost_tiles(points)
    fits = {}
    for plan in dict.fromkeys(p.plan for p in points):
        mine = [p for p in points if p.plan == plan and p.k <= args.fit_max_k]
        if len({p.k for p in mine}) >= 2:
            fits[plan] = fit_line([p.k for p in mine], [p.ms for p in mine])
    env = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, N = {n}, H = {args.heads}, D = {d}, bf16; "
           f"median of {args.reps} CUDA-event timings after {args.warmup} warm-up launches")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "task_overhead.json").write_text(json.dumps(
        {"env": env, "dense_ms": dense_ms, "dense_runs_ms": dense_runs, "dense_tflops": dense_tflops,
         "fit_max_k": args.fit_max_k, "points": [asdict(p) for p in points],
         "fits": {plan: asdict(fit) for plan, fit in fits.items()}}, indent=1))
    text = markdown(points, fits, args.fit_max_k, dense_tflops, env)
    (args.out / "task_overhead.md").write_text(text)
    plot(points, fits, dense_tflops, args.out / "task_overhead.png")
    print(text, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
