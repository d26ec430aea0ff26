"""The grouping's window and segment against kernel time, on the evaluation corpus (GPU).

Per case (the first ``--cases`` evaluation cases of each family, one per source): the plan the
selector names for a mask that comes back (``Selector.reused_plan``, the plan table's ``/reused``
key), in the grouped query layout, prepared once per grouping setting ``window:segment`` of
``--settings`` (``regroup.group_query_blocks`` with those arguments); every output checked against
the fp32 oracle, the prepared plans timed interleaved (kernel latency), and each setting's grouping
kernel and grouped preparation timed on their own.

    python benchmarks/grouping_window.py --out DIR [--families Q16K16,Q32K16,Q32K32] [--cases 5] \\
        [--settings 64:128,256:256]

Writes ``grouping_window.md`` / ``.json`` after every case. The first setting is the reference of
the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

import torch
from grouped_layout import add_study_arguments, cuda_ms, run_study  # benchmarks/ is on the path of a script

from tessera_diffusers import build_mask_state, prepare, regroup
from tessera_diffusers.plans import QLayout


@contextlib.contextmanager
def grouping_setting(window: int, segment: int):
    """``prepare`` of grouped plans groups with ``window`` and ``segment`` (it reads
    ``regroup.group_query_blocks`` at each call)."""
    original = regroup.group_query_blocks

    def grouped(blocks, group, *args, **kwargs):
        return original(blocks, group, window, segment=segment)

    regroup.group_query_blocks = grouped
    try:
        yield
    finally:
        regroup.group_query_blocks = original


def one_case(spec, args: argparse.Namespace, settings: list[tuple[int, int]], device: torch.device) -> dict:
    from tessera_diffusers.bench.problem import OracleCheck, Problem, make_inputs
    from tessera_diffusers.bench.tessera_backends import request_of
    from tessera_diffusers.bench.timing import time_interleaved
    from tessera_diffusers.runtime import execute
    from tessera_diffusers.selector import Selector

    mask = spec.build().to(device)
    problem = Problem(spec.name, args.grid, spec.family, spec.source, mask, 1, mask.heads, 128, torch.bfloat16, spec)
    state = build_mask_state(mask)
    request = request_of(problem)
    selector = Selector()
    base = selector.select(request, state)
    plan = None if base is None else selector.reused_plan(base, request, state)
    out = {"case": spec.name, "plan": None if plan is None else plan.name, "settings": {}}
    if plan is None or plan.q_layout is not QLayout.GROUPED:
        return out
    inputs = make_inputs(problem, 3, seed=1)
    check = OracleCheck(problem, inputs[0], [0, mask.heads - 1])
    entries = []
    for window, segment in settings:
        name = f"{window}:{segment}"
        with grouping_setting(window, segment):
            prepared = prepare(plan, state)
            verdict = check.compare(execute(prepared, *inputs[0], problem.scale, False))
            out["settings"][name] = {
                "ok": verdict.ok,
                "grouping_ms": cuda_ms(lambda w=window, s=segment: regroup.query_grouping(
                    mask.blocks, plan.q_units_per_tile, w, segment=s), args.prep_reps, device),
                "prepare_ms": cuda_ms(lambda: prepare(plan, state), args.prep_reps, device),
            }
        if verdict.ok:
            entries.append((name, prepared))
        else:
            print(f"{spec.name} {name}: FAILED the oracle check ({verdict.to_dict()})", flush=True)
    runs = [lambda i, p=p: execute(p, *inputs[i], problem.scale, False) for _, p in entries]
    for (name, _), timing in zip(entries, time_interleaved(runs, len(inputs), args.warmup, args.reps, device)):
        out["settings"][name]["kernel_ms"] = timing.median_ms
    return out


def write_report(args: argparse.Namespace, settings: list[tuple[int, int]], results: dict) -> str:
    names = [f"{w}:{s}" for w, s in settings]
    ref = names[0]
    lines = [f"# The grouping's window and segment against kernel time ({args.grid}, {results['device']})", "",
             (f"`python benchmarks/grouping_window.py --families {args.families} --cases {args.cases} "
              f"--settings {args.settings}` (window:segment; the plan of a mask that comes back, "
              f"`Selector.reused_plan`; kernel latency = median of {args.reps} interleaved CUDA-event timings "
              "over 3 input sets, every output checked against the fp32 oracle first)"), "",
             "| case | plan | " + " | ".join(f"kernel ms {n}" for n in names) + " | "
             + " | ".join(f"{n} / {ref}" for n in names[1:]) + " | "
             + " | ".join(f"grouping ms {n}" for n in names) + " | "
             + " | ".join(f"prepare ms {n}" for n in names) + " |",
             "|---|---|" + "---|" * (4 * len(names) - 1)]
    ratios: dict[str, dict[str, list[float]]] = {}
    for r in results["cases"]:
        s = r["settings"]
        if not s or any("kernel_ms" not in s.get(n, {}) for n in names):
            lines.append(f"| {r['case']} | {r['plan']} |" + " - |" * (4 * len(names) - 1))
            continue
        family = r["case"].split("/")[0]
        for n in names[1:]:
            ratios.setdefault(family, {}).setdefault(n, []).append(s[n]["kernel_ms"] / s[ref]["kernel_ms"])
        lines.append(f"| {r['case']} | {r['plan']} | " + " | ".join(f"{s[n]['kernel_ms']:.3f}" for n in names) + " | "
                     + " | ".join(f"{s[n]['kernel_ms'] / s[ref]['kernel_ms']:.3f}" for n in names[1:]) + " | "
                     + " | ".join(f"{s[n]['grouping_ms']:.3f}" for n in names) + " | "
                     + " | ".join(f"{s[n]['prepare_ms']:.3f}" for n in names) + " |")
    lines += ["", "Geometric mean of the kernel-time ratios per family:", "",
              "| family | " + " | ".join(f"{n} / {ref}" for n in names[1:]) + " |", "|---|" + "---|" * (len(names) - 1)]
    for family, per in ratios.items():
        lines.append(f"| {family} | " + " | ".join(
            f"{math.exp(sum(map(math.log, per[n])) / len(per[n])):.3f}" for n in names[1:]) + " |")
    text = "\n".join(lines) + "\n"
    (args.out / "grouping_window.md").write_text(text)
    (args.out / "grouping_window.json").write_text(json.dumps(results, indent=1))
    return text


def parse_settings(text: str) -> list[tuple[int, int]]:
    settings = []
    for item in text.split(","):
        window, _, segment = item.partition(":")
        settings.append((int(window), int(segment)))
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser)
    parser.add_argument("--settings", default="64:128,256:256", help="window:segment pairs, the first the reference")
    parser.add_argument("--prep-reps", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        settings = parse_settings(args.settings)
    except ValueError:
        parser.error(f"--settings: expected window:segment pairs such as 64:128,256:256, got {args.settings!r}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device and the native kernel library")
    return run_study(args, lambda spec, device: one_case(spec, args, settings, device),
                     lambda results: write_report(args, settings, results))

if __name__ == "__main__":
    sys.exit(main())
