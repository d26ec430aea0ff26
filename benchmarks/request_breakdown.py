"""Where the time of one cold Tessera request goes, stage by stage (issue 6: complete request <= 1.10x
the kernel on Q64K64 and larger block families).

A cold complete request is ``Runtime().attention(q, k, v, mask)`` for a mask object never seen before
(what the benchmark's complete-request column times). Its stages, each run here on its own:

    build     state = build_mask_state(mask)       (its parts are computed on first use)
    stats     state.host_stat_values               (in the request only when the regime tree
                                                    tests a statistic or the cost model ranks)
    select    Selector().select(request, state)    (a fresh Selector, as a fresh Runtime has)
    prepare   prepare(plan, state)                 (the chosen plan's metadata)
    launch    execute(prepared, q, k, v, scale)    (launch and kernel)

Every stage sits between two ``torch.cuda.synchronize()`` calls and gets three times: ``enqueue``
(host clock until the call returns), ``host`` (host clock to the closing sync) and ``event`` (CUDA
events recorded at the two ends of the bracket), plus the torch ops it dispatches and how many of
them read a value back to the host (``syncs``). Then the complete request (host clock synchronized at
both ends, and CUDA events) and the kernel alone (the prepared plan re-launched, CUDA events over
rotated input sets, after warm-ups). Medians over ``--reps`` fresh mask objects; the complete
request's output is compared with the re-launch's.

    python benchmarks/request_breakdown.py --out /tmp/request_breakdown.json       # H200, < 90 s
    python benchmarks/request_breakdown.py --table none --out /tmp/rb_cost_model.json  # cost model path
    python benchmarks/request_breakdown.py --device cpu --n 4096 --heads 2 --out /tmp/rb_cpu.json

On a CPU there is no native kernel: selection ranks for an sm90 request with the shipped sm90 table
(the table's catalog stands in for the library), the launch runs the PyTorch executor on the chosen
plan's metadata, the complete request is those same steps in one go, and the event column is empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera_diffusers import LogicalMask, Runtime, build_mask_state
from tessera_diffusers.catalog import all_kernels
from tessera_diffusers.corpus import BENCH_32K, LatentGrid, enumerate_cases
from tessera_diffusers.executor import run_prepared
from tessera_diffusers.plan_table import PlanTable, default_table, load_plan_table
from tessera_diffusers.plans import PhysicalPlan, Request
from tessera_diffusers.prepare import PreparedPlan, prepare
from tessera_diffusers.runtime import execute, make_request
from tessera_diffusers.selector import AUTO, Selector

FAMILIES = ("Q64K64", "Q128K64", "Q128K128", "Q32K32")
STAGES = ("build", "stats", "select", "prepare", "launch")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TARGET_RATIO = 1.10
# Read-backs to the host: a scalar (.item(), int(), float()) or a copy off the device (.tolist(), .cpu()).
SCALAR_READ = "aten._local_scalar_dense"


class OpCounter(TorchDispatchMode):
    """Torch ops dispatched inside the mode: all, those that are not views, and host read-backs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.device_ops = 0  # ops on a GPU tensor: one kernel launch each (host ops run on the CPU)
        self.views = 0
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            self.views += 1
            return out
        self.ops[str(func.overloadpacket.__name__)] += 1
        outs = out if isinstance(out, (tuple, list)) else [out]
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in (*args, *outs)):
            self.device_ops += 1
        if str(func).startswith(SCALAR_READ) or crosses_devices(args, out):
            self.syncs += 1
        return out

    def summary(self) -> dict:
        return {"ops": sum(self.ops.values()), "device_ops": self.device_ops, "views": self.views,
                "syncs": self.syncs, "by_op": dict(self.ops.most_common())}


def crosses_devices(args: tuple, out: object) -> bool:
    """A copy from a CUDA tensor to a CPU one (``.tolist()``, ``.cpu()``): a host sync."""
    ins = [a for a in args if isinstance(a, torch.Tensor)]
    outs = out if isinstance(out, (tuple, list)) else [out]
    return any(a.is_cuda for a in ins) and any(isinstance(o, torch.Tensor) and not o.is_cuda for o in outs)


class Bracket:
    """Times one call between two device syncs: host clock to return, host clock to the sync, and
    (on CUDA) events at both ends."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> tuple[object, dict]:
        self.sync()
        start = end = None
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter_ns()
        out = fn()
        t1 = time.perf_counter_ns()
        if self.cuda:
            end.record()
        self.sync()
        t2 = time.perf_counter_ns()
        return out, {"enqueue_ms": (t1 - t0) / 1e6, "host_ms": (t2 - t0) / 1e6,
                     "event_ms": float(start.elapsed_time(end)) if self.cuda else None}


def median_of(samples: list[dict]) -> dict:
    keys = samples[0].keys()
    return {k: (statistics.median(s[k] for s in samples) if samples[0][k] is not None else None) for k in keys}


def grid_for(n: int, heads: int) -> LatentGrid:
    """The benchmark's 32,768-token grid, or ``n / 2048`` frames of the same 32 x 64 latent."""
    if n == BENCH_32K.seq_len:
        return dataclasses.replace(BENCH_32K, heads=heads)
    if n % 2048:
        raise SystemExit(f"--n {n}: expected 32768 or a multiple of 2048 (frames of a 32 x 64 latent)")
    return LatentGrid(f"n{n}", n // 2048, 32, 64, 0, heads)


@dataclasses.dataclass
class Setup:
    """How this run selects plans and launches them (native on CUDA, emulated on a CPU)."""

    device: torch.device
    table: PlanTable | str | None
    native: bool

    def selector(self, reuse_regime: bool = False) -> Selector:
        """A fresh Selector, as ``Runtime()`` makes one."""
        if self.native:
            return Selector(table=self.table, reuse_regime=reuse_regime)
        if self.table is None:  # the cost model over the whole kernel table
            return Selector(table=None, kernels=all_kernels(), reuse_regime=reuse_regime)
        table = self.table if isinstance(self.table, PlanTable) else default_table("sm90").table
        if table is None:
            raise SystemExit("no sm90 plan table to select with on the CPU")
        return Selector(table=table, kernels=table.kernels, reuse_regime=reuse_regime)

    def request(self, q: torch.Tensor, k: torch.Tensor, mask: LogicalMask) -> Request:
        request = make_request(q, k, mask, False)
        return request if self.native else dataclasses.replace(request, arch="sm90")

    def stats_in_request(self, mask: LogicalMask, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether selection reads the statistics (a regime tree that tests one, or the cost model):
        select once for a fresh state and see whether it computed them."""
        m = fresh_mask(mask.blocks, mask)
        state = build_mask_state(m)
        self.selector().select(self.request(q, k, m), state)
        return "host_stat_values" in state.__dict__ or "stats" in state.__dict__

    def launch(self, prepared: PreparedPlan, q, k, v, scale: float) -> torch.Tensor:
        if self.native:
            return execute(prepared, q, k, v, scale, False)
        return run_prepared(prepared, q, k, v, scale)

    def complete(self, mask: LogicalMask, q, k, v, scale: float, selector: Selector | None = None) -> torch.Tensor:
        """One complete request for a new mask: a cold one (a fresh Runtime), or with ``selector``
        the next mask of a kept one (a diffusion loop's next step)."""
        selector = selector or self.selector()
        if self.native:
            return Runtime(selector=selector).attention(q, k, v, mask, scale=scale)
        state = build_mask_state(mask)
        plan = selector.select(self.request(q, k, mask), state)
        return run_prepared(prepare(plan, state), q, k, v, scale)


def read_stats(state) -> tuple[float, ...]:
    """The statistics on the host as the selector reads them (computed on first read, one sync)."""
    return state.host_stat_values


def fresh_mask(blocks: torch.Tensor, like: LogicalMask) -> LogicalMask:
    """A new mask object over the same block tensor (nothing cached anywhere can answer for it)."""
    return LogicalMask(blocks, like.block_q, like.block_kv, like.seq_len_q, like.seq_len_kv)


def count_stages(setup: Setup, mask: LogicalMask, q, k, v, scale: float) -> dict:
    """Ops dispatched by each stage and by the complete request, in one untimed pass."""
    counts = {}

    def stage(name: str, fn: Callable[[], object]) -> object:
        counter = OpCounter()
        with counter:
            out = fn()
        counts[name] = counter.summary()
        return out

    m = fresh_mask(mask.blocks, mask)
    state = stage("build", partial(build_mask_state, m))
    stage("stats", partial(read_stats, state))
    plan = stage("select", partial(setup.selector().select, setup.request(q, k, m), state))
    prepared = stage("prepare", partial(prepare, plan, state))
    stage("launch", partial(setup.launch, prepared, q, k, v, scale))
    stage("complete", partial(setup.complete, fresh_mask(mask.blocks, mask), q, k, v, scale))
    return counts


def count_ops(setup: Setup, mask: LogicalMask, q, k, v, scale: float) -> dict:
    """``count_stages``, or why it could not count (the timings never depend on it)."""
    try:
        return count_stages(setup, mask, q, k, v, scale)
    except Exception as err:  # noqa: BLE001 - a dispatch mode the custom op cannot run under
        return {"error": f"{type(err).__name__}: {err}"}


def run_family(setup: Setup, family: str, grid: LatentGrid, heads: int, head_dim: int, dtype: torch.dtype,
               reps: int, kernel_reps: int, warmup: int, input_sets: int, profile_dir: Path | None = None) -> dict:
    device = setup.device
    case = next(enumerate_cases("evaluation", families=[family], grids=[grid], heads=heads, seeds_per_combo=1))
    mask = case.build(device)
    n = mask.seq_len_q
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [tuple(torch.randn(1, n, heads, head_dim, generator=gen, device=device).to(dtype) for _ in range(3))
              for _ in range(input_sets)]
    q, k, v = inputs[0]
    scale = 1.0 / math.sqrt(head_dim)
    bracket = Bracket(device)

    # Warm-up outside the timings: library load, lazy CUDA modules of every op the path uses.
    for _ in range(2):
        setup.complete(fresh_mask(mask.blocks, mask), q, k, v, scale)
        read_stats(build_mask_state(fresh_mask(mask.blocks, mask)))
    bracket.sync()

    stats_in_request = setup.stats_in_request(mask, q, k)
    samples: dict[str, list[dict]] = {s: [] for s in STAGES}
    plan: PhysicalPlan | None = None
    prepared: PreparedPlan | None = None
    source = ""
    for _ in range(reps):
        m = fresh_mask(mask.blocks, mask)
        request = setup.request(q, k, m)
        state, t = bracket(partial(build_mask_state, m))
        samples["build"].append(t)
        _, t = bracket(partial(read_stats, state))
        samples["stats"].append(t)
        selector = setup.selector()
        plan, t = bracket(partial(selector.select, request, state))
        samples["select"].append(t)
        if plan is None:
            return {"case": case.name, "skipped": "the selector chose no native plan (reference path)"}
        source = selector.selection(request, state).source  # cached: what select() just decided
        prepared, t = bracket(partial(prepare, plan, state))
        samples["prepare"].append(t)
        _, t = bracket(partial(setup.launch, prepared, q, k, v, scale))
        samples["launch"].append(t)

    complete = []
    outputs = None
    for _ in range(reps):
        m = fresh_mask(mask.blocks, mask)
        outputs, t = bracket(partial(setup.complete, m, q, k, v, scale))
        complete.append(t)

    # The same request with a kept selector that may reuse the previous mask's regime
    # (Selector(reuse_regime=True)): each rep is still a new mask object, so preparation runs.
    kept_selector = setup.selector(reuse_regime=True)
    setup.complete(fresh_mask(mask.blocks, mask), q, k, v, scale, kept_selector)
    kept = [bracket(partial(setup.complete, fresh_mask(mask.blocks, mask), q, k, v, scale, kept_selector))[1]
            for _ in range(reps)]

    if profile_dir is not None:
        profile_kept_requests(setup, mask, q, k, v, scale, kept_selector, profile_dir / family)

    kernel = time_kernel(setup, prepared, inputs, scale, kernel_reps, warmup)
    after_prepare = time_after_prepare(setup, mask, plan, q, k, v, scale, reps)
    relaunch = setup.launch(prepared, q, k, v, scale)
    stages = {s: median_of(samples[s]) for s in STAGES}
    used = [s for s in STAGES if s != "stats" or stats_in_request]
    timer = "event_ms" if setup.device.type == "cuda" else "host_ms"
    complete_med = median_of(complete)
    result = {
        "case": case.name,
        "geometry": mask.geometry_name,
        "blocks": list(mask.blocks.shape),
        "density": float(mask.blocks.float().mean()),
        "plan": plan.name,
        "selected_by": source,
        "capacity": prepared.capacity,
        "stats_in_request": stats_in_request,
        "stages": stages,
        "stage_sum_host_ms": sum(stages[s]["host_ms"] for s in used),
        "complete": complete_med,
        "kernel_ms": kernel,
        # the kernel alone (events around its launch only) right behind a fresh preparation of a
        # new mask (no sync between), and behind a sync: the same plan in a complete request's place
        "kernel_after_prepare_ms": after_prepare,
        "kernel_timer": timer,
        "ratio_host": complete_med["host_ms"] / kernel,
        "ratio_event": complete_med["event_ms"] / kernel if complete_med["event_ms"] is not None else None,
        "overhead_host_ms": complete_med["host_ms"] - kernel,
        "complete_kept_selector": median_of(kept),
        "ratio_host_kept_selector": median_of(kept)["host_ms"] / kernel,
        "complete_matches_relaunch": bool(torch.equal(outputs, relaunch)),
        "ops": count_ops(setup, mask, q, k, v, scale),
        "samples": {**samples, "complete": complete, "complete_kept_selector": kept},
    }
    return result


def profile_kept_requests(setup: Setup, mask: LogicalMask, q, k, v, scale: float, selector: Selector,
                          out: Path, requests: int = 40) -> None:
    """Where the host time of a kept selector's complete request goes (cProfile over ``requests``
    new masks) and what runs on the device (torch.profiler over 10): ``out``_host.txt / _device.txt."""
    import cProfile
    import io
    import pstats

    out.parent.mkdir(parents=True, exist_ok=True)
    masks = [fresh_mask(mask.blocks, mask) for _ in range(requests)]
    profiler = cProfile.Profile()
    Bracket(setup.device).sync()
    profiler.enable()
    for m in masks:
        setup.complete(m, q, k, v, scale, selector)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"{requests} complete requests of new masks, kept selector; times are totals over them\n")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    out.with_name(out.name + "_host.txt").write_text(text.getvalue())
    if setup.device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    masks = [fresh_mask(mask.blocks, mask) for _ in range(10)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for m in masks:
            setup.complete(m, q, k, v, scale, selector)
        torch.cuda.synchronize(setup.device)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    out.with_name(out.name + "_device.txt").write_text("10 complete requests, kept selector\n" + table)


def time_after_prepare(setup: Setup, mask: LogicalMask, plan: PhysicalPlan, q, k, v, scale: float,
                       reps: int) -> dict | None:
    """Median CUDA-event time of the launch alone, (a) queued right behind ``prepare`` of a new mask
    (its kernels run just before it) and (b) behind a sync after that preparation."""
    if setup.device.type != "cuda":
        return None
    behind, synced = [], []
    for _ in range(reps):
        for samples, sync_first in ((behind, False), (synced, True)):
            torch.cuda.synchronize(setup.device)
            prepared = prepare(plan, build_mask_state(fresh_mask(mask.blocks, mask)))
            if sync_first:
                torch.cuda.synchronize(setup.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            setup.launch(prepared, q, k, v, scale)
            end.record()
            end.synchronize()
            samples.append(float(start.elapsed_time(end)))
    return {"behind_prepare": statistics.median(behind), "after_sync": statistics.median(synced)}


def time_kernel(setup: Setup, prepared: PreparedPlan, inputs: list, scale: float, reps: int, warmup: int) -> float:
    """Median latency of the prepared plan re-launched (CUDA events on rotated inputs; host clock on a CPU)."""
    n_sets = len(inputs)
    for i in range(warmup):
        setup.launch(prepared, *inputs[i % n_sets], scale)
    if setup.device.type != "cuda":
        samples = []
        for i in range(reps):
            t0 = time.perf_counter_ns()
            setup.launch(prepared, *inputs[(warmup + i) % n_sets], scale)
            samples.append((time.perf_counter_ns() - t0) / 1e6)
        return statistics.median(samples)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize(setup.device)
    for i in range(reps):
        starts[i].record()
        setup.launch(prepared, *inputs[(warmup + i) % n_sets], scale)
        ends[i].record()
    torch.cuda.synchronize(setup.device)
    return statistics.median(float(s.elapsed_time(e)) for s, e in zip(starts, ends))


def print_table(results: dict, cuda: bool) -> None:
    print(f"\n{'family':<9} {'time':<7} " + " ".join(f"{s:>8}" for s in STAGES)
          + f" {'sum':>8} {'complete':>9} {'kernel':>8} {'ratio':>6}  plan")
    for family, r in results.items():
        if "skipped" in r:
            print(f"{family:<9} skipped: {r['skipped']}")
            continue
        rows = (("host", "host_ms"), ("event", "event_ms")) if cuda else (("host", "host_ms"),)
        for label, key in rows:
            cells = []
            for s in STAGES:
                value = r["stages"][s][key]
                mark = "*" if s == "stats" and not r["stats_in_request"] else " "
                cells.append(f"{value:7.3f}{mark}")
            used = [s for s in STAGES if s != "stats" or r["stats_in_request"]]
            total = sum(r["stages"][s][key] for s in used)
            ratio = r["complete"][key] / r["kernel_ms"]
            plan = r["plan"] if label == "host" else \
                f"({r['selected_by']}, cap {r['capacity']}, density {r['density']:.3f})"
            print(f"{family:<9} {label:<7} " + " ".join(cells)
                  + f" {total:8.3f} {r['complete'][key]:9.3f} {r['kernel_ms']:8.3f} {ratio:6.3f}  {plan}")
        kept = r["complete_kept_selector"]["host_ms"]
        print(f"{'':<9} {'kept':<7} complete request of a new mask with a kept Selector(reuse_regime=True): "
              f"{kept:.3f} ms host, ratio {kept / r['kernel_ms']:.3f}")
        after = r.get("kernel_after_prepare_ms")
        if after:
            print(f"{'':<9} {'kernel':<7} launch alone right behind a new mask's preparation {after['behind_prepare']:.3f} ms, "
                  f"after a sync {after['after_sync']:.3f} ms (back to back: {r['kernel_ms']:.3f})")
        ops = r["ops"]
        if "error" in ops:
            print(f"{'':<9} {'ops':<7} not counted ({ops['error']})")
            continue
        key = "device_ops" if cuda else "ops"
        print(f"{'':<9} {'ops':<7} " + " ".join(f"{ops[s][key]:>7}{'s' if ops[s]['syncs'] else ' '}" for s in STAGES)
              + f" {'':>8} {ops['complete'][key]:>9}")
    print("\nms, medians; * = not part of this request (no statistic read); ops = torch ops dispatched "
          f"({'on GPU tensors: kernel launches' if cuda else 'views excluded'}; s: reads a value back to the host); "
          f"ratio = complete / kernel. Target: ratio <= {TARGET_RATIO} on Q64K64 and larger blocks.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n", type=int, default=32768, help="sequence length (32768, or a multiple of 2048)")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--reps", type=int, default=9, help="fresh masks per stage and complete-request timing")
    parser.add_argument("--kernel-reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--table", default=None,
                        help="a plan table file, or 'none' for the cost model (default: the shipped table)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    parser.add_argument("--profile", type=Path, default=None,
                        help="directory for cProfile / torch.profiler tables of kept-selector requests")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    table = AUTO if args.table is None else None if args.table == "none" else load_plan_table(args.table)
    setup = Setup(device, table, native=cuda)
    grid = grid_for(args.n, args.heads)
    reps = args.reps
    kernel_reps = args.kernel_reps if cuda else max(1, min(args.kernel_reps, 3))
    started = time.perf_counter()
    results = {}
    for family in [f for f in args.families.split(",") if f]:
        t0 = time.perf_counter()
        results[family] = run_family(setup, family, grid, args.heads, args.head_dim, DTYPES[args.dtype], reps,
                                     kernel_reps, args.warmup if cuda else 1, 3 if cuda else 1, args.profile)
        print(f"{family}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print_table(results, cuda)
    env = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "n": grid.seq_len, "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
        "reps": reps, "kernel_reps": kernel_reps, "table": str(args.table) if args.table else "shipped",
        "emulated": not cuda,
        "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "families": results}, indent=1) + "\n")
    print(f"wrote {args.out} ({env['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
