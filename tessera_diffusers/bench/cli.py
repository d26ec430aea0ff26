"""``tessera bench`` (also ``python -m tessera_diffusers.bench``): measure Tessera beside its
baselines on the mask corpus and write a report. What it writes and how long it takes: ``DESCRIPTION``."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..cli_common import (
    CommandLineParser,
    device,
    existing_dir,
    head_dim,
    names_from,
    non_negative_int,
    non_negative_number,
    output_dir,
    positive_int,
    regex,
    run_command,
)
from ..corpus import ALL_SOURCES, DEFAULTS_FAMILIES, FAMILIES
from ..errors import InvalidArgumentError
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

DESCRIPTION = """\
Measure Tessera beside dense attention (cuDNN and FlashAttention-2 SDPA) and sparse baselines
(FlexAttention, FlashInfer, and where built FastVideo's VSA and flex-block-attn) on masks of the
corpus: each case is checked against the exact masked-attention oracle, then timed. Writes to
--out: records.jsonl (as it goes; --resume continues from it), results.json, results.md and plots.
Exit status 1 when a Tessera output failed its oracle check, else 0.

Time: the default subset takes under 8 minutes on one H200, --full (the whole evaluation split)
hours, --smoke (a tiny configuration of the oracle and the PyTorch executor on the CPU) about 20 s.
Without a GPU and without --smoke it measures the PyTorch executor on the CPU at full size: slow,
and not a measure of GPU speed.

    tessera bench --out results/
    tessera bench --out results/ --mode kernels --sizes n32k,wan720p
    tessera bench --out /tmp/smoke --smoke
"""
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES + DEFAULTS_FAMILIES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tessera bench`` (also used by ``benchmarks/kernel_study.py``)."""
    parser.add_argument("--out", required=True, type=output_dir, help="output directory (created if missing)")
    parser.add_argument("--mode", choices=("bench", "kernels"), default="bench",
                        help="bench: Tessera's selected plan beside every baseline; kernels: every eligible catalog "
                             "plan beside dense SDPA and FlexAttention")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU configuration (oracle + PyTorch executor), seconds")
    parser.add_argument("--full", action="store_true", help="the whole evaluation split of the corpus (hours)")
    parser.add_argument("--sizes", type=names_from(SIZE_PROFILES), default=None,
                        help=f"size profiles, from {sorted(SIZE_PROFILES)} (default n32k)")
    parser.add_argument("--families", type=names_from(FAMILY_NAMES), default=None,
                        help=f"families, from {list(FAMILY_NAMES)} (default: all but "
                             f"{', '.join(f.name for f in DEFAULTS_FAMILIES)})")
    parser.add_argument("--sources", type=names_from(ALL_SOURCES), default=None,
                        help=f"corpus sources to draw cases from, from {list(ALL_SOURCES)}")
    parser.add_argument("--cases-per-family", type=positive_int, default=1)
    parser.add_argument("--corpus", type=existing_dir, default=None,
                        help="a saved corpus directory instead of generated cases")
    parser.add_argument("--backends", type=names_from(BACKEND_NAMES), default=None, help=f"from {list(BACKEND_NAMES)}")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave the FlashInfer variants out")
    parser.add_argument("--all-plans", action="store_true", help="also time every eligible Tessera plan (gives regret)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--head-dim", type=head_dim, default=128)
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=None, help="override the size profile's head count")
    parser.add_argument("--warmup", type=non_negative_int, default=3)
    parser.add_argument("--warmup-ms", type=non_negative_number, default=0.0,
                        help="then keep warming up until the device has been busy this long, so every backend is "
                             "timed under sustained load (e.g. 200; 0: the --warmup calls only)")
    parser.add_argument("--interleave", action="store_true",
                        help="validate every backend of a case first, then time them in turn with the device kept "
                             "busy (dense baselines timed on every case), instead of each right after its own setup")
    parser.add_argument("--reps", type=positive_int, default=10, help="timed runs, the median is kept")
    parser.add_argument("--input-sets", type=positive_int, default=3, help="rotated q/k/v sets (keeps operands out of L2)")
    parser.add_argument("--request-reps", type=positive_int, default=3, help="complete requests timed per backend")
    parser.add_argument("--plan-request-reps", type=non_negative_int, default=1,
                        help="complete requests timed per forced catalog plan (0: kernel latency only)")
    parser.add_argument("--plan-filter", type=regex, default=None,
                        help="regular expression: only forced catalog plans whose name matches (e.g. 'lpt$|split2')")
    parser.add_argument("--validate-heads", type=non_negative_int, default=2,
                        help="heads checked against the oracle (0: all)")
    parser.add_argument("--atol", type=non_negative_number, default=None, help="absolute slack of the oracle check")
    parser.add_argument("--device", type=device, default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--resume", action="store_true", help="keep records.jsonl and measure only what is missing")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from records.jsonl")
    parser.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = functools.partial(  # what both configurations take from the arguments
        BenchConfig,
        out_dir=args.out,
        mode=args.mode,
        sources=args.sources,
        cases_per_family=args.cases_per_family,
        dtype=args.dtype,
        batch=args.batch,
        heads=args.heads,
        interleave=args.interleave,
        plan_filter=args.plan_filter,
        validate_heads=args.validate_heads,
        atol=args.atol,
        device=device,
        seed=args.seed,
        plots=not args.no_plots,
        resume=args.resume,
        progress=not args.no_progress,
    )
    if args.smoke:  # tiny sizes, 64-dim heads, few timings
        return config(
            sizes=("smoke",),
            families=args.families or SMOKE_FAMILIES,
            backends=args.backends or ("reference", "tessera", "tessera-plans"),
            head_dim=64,
            warmup=1,
            reps=2,
            input_sets=2,
            request_reps=1,
        )
    backends = args.backends or default_backends(args.mode, torch.device(device).type)
    if args.no_flashinfer:
        backends = tuple(b for b in backends if b not in FLASHINFER_NAMES)
    if args.all_plans and "tessera-plans" not in backends:
        backends = backends + ("tessera-plans",)
    default_sizes = ("n32k", "wan720p") if args.mode == "kernels" else ("n32k",)
    return config(
        sizes=args.sizes or default_sizes,
        families=args.families or ALL_FAMILIES,
        full=args.full,
        corpus_dir=args.corpus,
        backends=backends,
        head_dim=args.head_dim,
        warmup=args.warmup,
        warmup_ms=args.warmup_ms,
        reps=args.reps,
        input_sets=args.input_sets,
        request_reps=args.request_reps,
        plan_request_reps=args.plan_request_reps,
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
        if not (out_dir / RECORDS_FILE).is_file():
            raise InvalidArgumentError("--out", f"a directory holding the {RECORDS_FILE} of an earlier run "
                                       "(--report-only)", str(out_dir))
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
    parser = CommandLineParser(prog="tessera bench", description=DESCRIPTION)
    add_arguments(parser)
    return run_command("tessera bench", run, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
