"""``tessera bench``: measure Tessera beside its baselines on the mask corpus and write a report.

    python -m tessera_diffusers.bench --out results/           # default subset (one H200: < 8 min)
    python -m tessera_diffusers.bench --out results/ --full    # the whole evaluation split
    python -m tessera_diffusers.bench --out results/ --mode kernels --sizes n32k,wan720p
    python -m tessera_diffusers.bench --out /tmp/smoke --smoke  # tiny CPU run (oracle + executor)

Writes ``records.jsonl`` (as it goes), ``results.json``, ``results.md`` and plots to ``--out``.
Exit status 1 when any Tessera output failed its oracle check, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .config import (
    ALL_FAMILIES,
    BACKEND_NAMES,
    FLASHINFER_NAMES,
    SIZE_PROFILES,
    SMOKE_FAMILIES,
    BenchConfig,
    default_backends,
)
from .harness import RECORDS_FILE, load_done, run_benchmark
from .metrics import summarize
from .report import environment, write_reports


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tessera bench`` (also used by ``benchmarks/kernels.py``)."""
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--mode", choices=("bench", "kernels"), default="bench",
                        help="bench: Tessera's selected plan beside every baseline; kernels: every eligible catalog "
                             "plan beside dense SDPA and FlexAttention (issue 3's study)")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU configuration (oracle + PyTorch executor), seconds")
    parser.add_argument("--full", action="store_true", help="the whole evaluation split of the corpus (hours)")
    parser.add_argument("--sizes", type=comma_list, default=None,
                        help=f"size profiles, from {sorted(SIZE_PROFILES)} (default n32k)")
    parser.add_argument("--families", type=comma_list, default=None, help=f"families, from {list(ALL_FAMILIES)}")
    parser.add_argument("--sources", type=comma_list, default=None, help="corpus sources to draw cases from")
    parser.add_argument("--cases-per-family", type=int, default=1)
    parser.add_argument("--corpus", type=Path, default=None, help="a saved corpus directory instead of generated cases")
    parser.add_argument("--backends", type=comma_list, default=None, help=f"from {list(BACKEND_NAMES)}")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave the FlashInfer variants out")
    parser.add_argument("--all-plans", action="store_true", help="also time every eligible Tessera plan (gives regret)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="override the size profile's head count")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--warmup-ms", type=float, default=0.0,
                        help="then keep warming up until the device has been busy this long, so every backend is "
                             "timed under sustained load (e.g. 200; 0: the --warmup calls only)")
    parser.add_argument("--interleave", action="store_true",
                        help="validate every backend of a case first, then time them in turn with the device kept "
                             "busy (dense baselines timed on every case), instead of each right after its own setup")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--input-sets", type=int, default=3, help="rotated q/k/v sets (keeps operands out of L2)")
    parser.add_argument("--request-reps", type=int, default=3)
    parser.add_argument("--plan-request-reps", type=int, default=1,
                        help="complete requests timed per forced catalog plan (0: kernel latency only)")
    parser.add_argument("--plan-filter", default=None,
                        help="regular expression: only forced catalog plans whose name matches (e.g. 'lpt$|split2')")
    parser.add_argument("--validate-heads", type=int, default=2, help="heads checked against the oracle")
    parser.add_argument("--atol", type=float, default=None, help="absolute slack of the oracle check")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--resume", action="store_true", help="keep records.jsonl and measure only what is missing")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from records.jsonl")
    parser.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        return BenchConfig(
            out_dir=args.out,
            mode=args.mode,
            sizes=("smoke",),
            families=args.families or SMOKE_FAMILIES,
            sources=args.sources,
            cases_per_family=args.cases_per_family,
            backends=args.backends or ("reference", "tessera", "tessera-plans"),
            dtype=args.dtype,
            head_dim=64,
            batch=args.batch,
            heads=args.heads,
            warmup=1,
            interleave=args.interleave,
            reps=2,
            input_sets=2,
            request_reps=1,
            plan_filter=args.plan_filter,
            validate_heads=args.validate_heads,
            atol=args.atol,
            device=device,
            seed=args.seed,
            plots=not args.no_plots,
            resume=args.resume,
            progress=not args.no_progress,
        )
    backends = args.backends or default_backends(args.mode, torch.device(device).type)
    if args.no_flashinfer:
        backends = tuple(b for b in backends if b not in FLASHINFER_NAMES)
    if args.all_plans and "tessera-plans" not in backends:
        backends = backends + ("tessera-plans",)
    default_sizes = ("n32k", "wan720p") if args.mode == "kernels" else ("n32k",)
    return BenchConfig(
        out_dir=args.out,
        mode=args.mode,
        sizes=args.sizes or default_sizes,
        families=args.families or ALL_FAMILIES,
        sources=args.sources,
        cases_per_family=args.cases_per_family,
        full=args.full,
        corpus_dir=args.corpus,
        backends=backends,
        dtype=args.dtype,
        head_dim=args.head_dim,
        batch=args.batch,
        heads=args.heads,
        warmup=args.warmup,
        warmup_ms=args.warmup_ms,
        interleave=args.interleave,
        reps=args.reps,
        input_sets=args.input_sets,
        request_reps=args.request_reps,
        plan_request_reps=args.plan_request_reps,
        plan_filter=args.plan_filter,
        validate_heads=args.validate_heads,
        atol=args.atol,
        device=device,
        seed=args.seed,
        plots=not args.no_plots,
        resume=args.resume,
        progress=not args.no_progress,
    )


def measured_environment(out_dir: Path) -> dict | None:
    """The environment of the run that measured ``out_dir``'s records (its ``results.json``), so a
    report rebuilt elsewhere still names the GPU, the versions and the timer of the measurement."""
    path = out_dir / "results.json"
    if not path.is_file():
        return None
    try:
        env = json.loads(path.read_text()).get("environment")
    except (json.JSONDecodeError, AttributeError):
        return None
    return env if isinstance(env, dict) else None


def run(args: argparse.Namespace) -> int:
    """Run (or with ``--report-only`` re-report) a benchmark; see the module docstring."""
    config = config_from_args(args)
    device = torch.device(config.device)
    if device.type == "cpu" and not args.smoke and not args.report_only:
        print("tessera bench: no CUDA device, measuring on the CPU (use --smoke for the tiny configuration)",
              file=sys.stderr)
    out_dir = Path(config.out_dir)
    if args.report_only:
        records, _ = load_done(out_dir / RECORDS_FILE)
        unavailable_path = out_dir / "unavailable.json"
        unavailable = json.loads(unavailable_path.read_text()) if unavailable_path.is_file() else {}
        env = measured_environment(out_dir) or environment(device)
    else:
        records, unavailable = run_benchmark(config, log=lambda m: print(m, file=sys.stderr))
        env = environment(device)
    summary = summarize(records)
    written = write_reports(out_dir, config, env, records, summary, unavailable)
    print(f"tessera bench: {len(records)} records, wrote {', '.join(written)} to {out_dir}")
    invalid = [r for r in records if r.get("kind") == "tessera" and r.get("status") == "invalid"]
    for r in invalid[:10]:
        print(f"INVALID {r['backend']} on {r['case']}: {r.get('reason')}", file=sys.stderr)
    return 1 if invalid else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
