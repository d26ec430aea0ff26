"""Where the host time of one complete request goes, function by function, on this machine.

``request_breakdown.py`` times whole stages between syncs; cProfile (its ``--profile``) adds a
few microseconds to every call it sees, which is the size of what is measured here. This script
wraps the functions of a complete request (``Runtime.attention`` for a new mask object) with
``perf_counter_ns`` and reports the mean inclusive time of each per request, for a kept
``Selector(reuse_regime=True)`` (a diffusion loop's next step) and for a fresh ``Runtime`` (a cold
request), together with:

    to_launch   host time from the request's start to the return of the attention launch
    request     host time of the whole call (it returns once the kernel is queued)
    complete    host clock around the call and a sync after it (GPU idle before), median
    kernel      CUDA events around the bare launch of the same prepared plan: back to back, and
                alone after a sync (is a lone kernel slower, or is it the host work around it?)

    python benchmarks/host_path.py --out /tmp/host_path.json          # H200, ~20 s
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from request_breakdown import fresh_mask

from tessera_diffusers import LogicalMask, Runtime, build_mask_state, mask_counts, native_prepare, ops, runtime
from tessera_diffusers import selector as selector_module
from tessera_diffusers.corpus import BENCH_32K, enumerate_cases
from tessera_diffusers.cost_model import PlanEstimator
from tessera_diffusers.mask_state import MaskState
from tessera_diffusers.prepare import PreparedPlan
from tessera_diffusers.selector import Selector

FAMILIES = ("Q64K64", "Q128K64", "Q128K128", "Q32K32")


class HostClock:
    """Inclusive wall time per wrapped function, summed over the requests of one measurement, and
    the time of each request's launch return relative to its start."""

    def __init__(self) -> None:
        self.total_ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.request_start = 0
        self.launch_returned: list[int] = []

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter_ns()
                self.total_ns[label] += t1 - t0
                self.calls[label] += 1
                if label.endswith("launch_filled"):
                    self.launch_returned.append(t1 - self.request_start)

        return timed


# (owner, attribute, label): module globals are looked up at call time, so patching them is seen.
def targets(lib: ops.NativeLibrary) -> list[tuple[object, str, str]]:
    return [
        (runtime, "check_inputs", "check_inputs"),
        (runtime, "make_request", "make_request"),
        (runtime, "build_mask_state", "build_mask_state"),
        (Selector, "select", "select"),
        (Selector, "context", "select/context"),
        (Selector, "_entry", "select/_entry"),
        (Selector, "_scan", "select/_scan"),
        (Selector, "_arbitrate", "select/_arbitrate"),
        (selector_module, "estimate_with", "select/_arbitrate/estimate_with"),
        (mask_counts, "launch_mask_counts", "select/_arbitrate/estimate_with/launch_mask_counts"),
        (lib.handle, "tessera_mask_counts", "select/_arbitrate/estimate_with/launch_mask_counts/ctypes"),
        (MaskState, "row_union_ratios", "select/_arbitrate/estimate_with/row_union_ratios"),
        (PlanEstimator, "__call__", "select/_arbitrate/estimate_with/estimator"),
        (runtime, "prepare", "prepare"),
        (native_prepare, "prepare_native", "prepare/prepare_native"),
        (lib.handle, "tessera_prepare_fill", "prepare/prepare_native/ctypes fill"),
        (torch, "empty", "torch.empty (anywhere)"),
        (runtime, "execute", "execute"),
        (ops, "run_direct", "execute/run_direct"),
        (ops, "output_buffers", "execute/run_direct/output_buffers"),
        (ops, "launch_template", "execute/run_direct/launch_template"),
        (ops, "launch_filled", "execute/run_direct/launch_filled"),
        (PreparedPlan, "after_launch", "execute/run_direct/after_launch"),
    ]


@contextmanager
def wrapped(clock: HostClock, lib: ops.NativeLibrary):
    saved = []
    for owner, name, label in targets(lib):
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, clock.wrap(label, original))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def measure(mask: LogicalMask, q, k, v, scale: float, make_runtime: Callable[[], Runtime], requests: int,
            clocked: bool) -> dict:
    """``requests`` complete requests of new mask objects; per-function means when ``clocked``."""
    lib = ops.load_library()
    clock = HostClock()
    rt = make_runtime()
    for _ in range(3):  # warm-up: the selector's per-request cache, lazy modules
        r = rt if rt.selector.reuse_regime else make_runtime()
        r.attention(q, k, v, fresh_mask(mask.blocks, mask), scale=scale)
    torch.cuda.synchronize()
    complete, request = [], []
    with wrapped(clock, lib) if clocked else nullcontext():
        for _ in range(requests):
            m = fresh_mask(mask.blocks, mask)
            r = rt if rt.selector.reuse_regime else make_runtime()
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            clock.request_start = t0
            r.attention(q, k, v, m, scale=scale)
            t1 = time.perf_counter_ns()
            torch.cuda.synchronize()
            t2 = time.perf_counter_ns()
            request.append((t1 - t0) / 1e3)
            complete.append((t2 - t0) / 1e6)
    out = {"request_us": statistics.median(request), "complete_ms": statistics.median(complete)}
    if clocked:
        out["to_launch_us"] = statistics.median(clock.launch_returned) / 1e3
        out["functions_us"] = {label: clock.total_ns[label] / requests / 1e3 for label in clock.total_ns}
        out["calls_per_request"] = {label: clock.calls[label] / requests for label in clock.calls}
    return out


def kernel_alone(prepared: PreparedPlan, q, k, v, scale: float, reps: int) -> dict:
    """CUDA-event time of the bare launch (template built, output allocated beforehand): back to
    back, and each after a sync and an idle host pause of 1 ms."""
    out, lse, workspace, _ = ops.output_buffers(q, prepared.plan.tasks.num_splits, False)
    template = ops.launch_template(q, k, prepared.metadata, prepared.plan.kernel.name, prepared.launch_config(), scale,
                                   (q.stride(), k.stride(), v.stride(), out.stride()))
    p, m = template.fill(q, k, v, out, lse, workspace)

    def launch():
        ops.launch_filled(template, p, m, q.device)

    for _ in range(5):
        launch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for s, e in events:
        s.record()
        launch()
        e.record()
    torch.cuda.synchronize()
    back_to_back = statistics.median(s.elapsed_time(e) for s, e in events)
    alone = []
    for s, e in events:
        torch.cuda.synchronize()
        time.sleep(1e-3)
        s.record()
        launch()
        e.record()
        e.synchronize()
        alone.append(s.elapsed_time(e))
    return {"back_to_back_ms": back_to_back, "alone_after_sync_ms": statistics.median(alone)}


def gpu_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median CUDA-event time of ``fn``'s device work, back to back (host far ahead of the GPU: a
    long kernel is queued first)."""
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    torch.cuda._sleep(5_000_000)  # keeps the GPU busy while the host queues the measured calls
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in events)


def preparation_gpu(mask: LogicalMask, plan) -> dict:
    """Device time of the statistics launch (what a regime with a rule or the cost model reads on a cold request) and of the
    uncompacted preparation (each request's)."""
    groups = mask_counts.union_rows_to_prefetch(mask.block_q)
    return {
        "mask_counts_us": gpu_time_us(lambda: mask_counts.launch_mask_counts(mask.blocks, groups, read=False)),
        "prepare_us": gpu_time_us(lambda: native_prepare.prepare_native(plan, build_mask_state(mask), False)),
    }


def run_family(family: str, heads: int, requests: int) -> dict:
    device = torch.device("cuda")
    grid = dataclasses.replace(BENCH_32K, heads=heads)
    case = next(enumerate_cases("evaluation", families=[family], grids=[grid], heads=heads, seeds_per_combo=1))
    mask = case.build(device)
    n = mask.seq_len_q
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, n, heads, 128, generator=gen, device=device).to(torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(128)
    kept_rt = Runtime(selector=Selector(reuse_regime=True))
    result = {"case": case.name}
    for name, factory in (("kept", lambda: kept_rt), ("fresh", Runtime)):
        result[name] = measure(mask, q, k, v, scale, factory, requests, clocked=True)
        result[name]["unclocked"] = measure(mask, q, k, v, scale, factory, requests, clocked=False)
        gc.disable()
        result[name]["unclocked_no_gc"] = measure(mask, q, k, v, scale, factory, requests, clocked=False)
        gc.enable()
    state = build_mask_state(fresh_mask(mask.blocks, mask))
    plan = kept_rt.selector.select(runtime.make_request(q, k, mask, False), state)
    result["plan"] = plan.name
    result["kernel"] = kernel_alone(runtime.prepare(plan, state), q, k, v, scale, 20)
    result["preparation_gpu"] = preparation_gpu(mask, plan)
    return result


def print_report(results: dict) -> None:
    for family, r in results.items():
        kern = r["kernel"]
        print(f"\n{family}  {r['plan']}")
        print(f"  kernel: back to back {kern['back_to_back_ms']:.3f} ms, alone after a sync "
              f"{kern['alone_after_sync_ms']:.3f} ms")
        if "preparation_gpu" in r:
            gpu = r["preparation_gpu"]
            print(f"  device time: statistics launch {gpu['mask_counts_us']:.1f} us, preparation "
                  f"{gpu['prepare_us']:.1f} us")
        for name in ("kept", "fresh"):
            x = r[name]
            u = x["unclocked"]
            print(f"  {name:<5} complete {u['complete_ms']:.3f} ms (ratio {u['complete_ms'] / kern['back_to_back_ms']:.3f}),"
                  f" call {u['request_us']:.0f} us unclocked / {x['request_us']:.0f} us clocked,"
                  f" launch returns at {x['to_launch_us']:.0f} us;"
                  f" without GC: complete {x['unclocked_no_gc']['complete_ms']:.3f} ms,"
                  f" call {x['unclocked_no_gc']['request_us']:.0f} us")
            for label, us in sorted(x["functions_us"].items(), key=lambda kv: kv[0]):
                depth = label.count("/")
                print(f"      {'  ' * depth}{label.split('/')[-1]:<34} {us:8.1f} us  "
                      f"({x['calls_per_request'][label]:.1f} calls)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("host_path.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_path.py measures the native path: it needs a CUDA device")
    results = {family: run_family(family, args.heads, args.requests) for family in args.families}
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": ".".join(map(str, __import__("sys").version_info[:3]))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "families": results}, indent=1))
    print_report(results)


if __name__ == "__main__":
    main()
