"""``tessera profile`` (also ``python -m tessera_diffusers.profile``): profile the catalog on the
corpus's profiling split, then build the plan table. What it writes and how long it takes: ``DESCRIPTION``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bench.config import ALL_FAMILIES, SIZE_PROFILES
from ..cli_common import (
    CommandLineParser,
    device,
    existing_file,
    head_dim,
    int_at_least,
    names_from,
    non_negative_int,
    non_negative_number,
    number_at_least,
    output_dir,
    output_file,
    positive_int,
    regex,
    rejected,
    run_command,
)
from ..corpus import ALL_SOURCES, DEFAULTS_FAMILIES, FAMILIES
from ..errors import CatalogError, InvalidArgumentError, PlanTableError
from ..plan_table import FeatureSchema
from .config import SPLIT, SPLITS, ProfileConfig, smoke_config
from .records import RECORDS_FILE, read_records

REPORT_FILE = "compile_report.md"
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES + DEFAULTS_FAMILIES)
DESCRIPTION = f"""\
Measure every eligible plan of the kernel catalog on masks of the corpus's profiling split (each
checked against the exact masked-attention oracle, then timed), then build the plan table the
selector ranks plans with. Runs on a GPU with the native kernel library; without one it profiles
the PyTorch executor's plans on the CPU, which says nothing about GPU speed.

Writes to --out: {RECORDS_FILE} (measurements, appended as they are made; running the same command
again continues where the last one stopped, --fresh starts over), plan_table_<arch>.json and
{REPORT_FILE}. To use the table, point TESSERA_PLAN_TABLE at it (or copy it to
tessera_diffusers/data/). Exit status 1 when a plan failed its oracle check in this run.

Time: as long as --minutes allows; without it, until the whole profiling split is measured (hours
at the default size; a later run resumes where it stopped). --smoke, a tiny CPU configuration,
takes seconds.

    tessera profile --out DIR --minutes 8          # measure for 8 minutes (resumes DIR), build the table
    tessera profile --out DIR --compile-only       # rebuild the table from DIR/{RECORDS_FILE}
    tessera profile --out /tmp/p --smoke           # tiny CPU run of the PyTorch executor's plans
"""


def abandon_factor(text: str) -> float:
    """Argument type: 0 (off) or a slowdown factor above 1."""
    value = non_negative_number(text)
    if 0 < value <= 1:
        raise rejected("0 (off) or a number > 1", text)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tessera profile``."""
    parser.add_argument("--out", required=True, type=output_dir,
                        help=f"directory of {RECORDS_FILE} and the table (created if missing)")
    parser.add_argument("--minutes", type=non_negative_number, default=None,
                        help="time budget of the measuring loop (default: no limit)")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU configuration (PyTorch executor plans)")
    parser.add_argument("--sizes", type=names_from(SIZE_PROFILES), default=None,
                        help=f"size profiles from {sorted(SIZE_PROFILES)} (default n32k)")
    parser.add_argument("--families", type=names_from(FAMILY_NAMES), default=None,
                        help=f"from {list(FAMILY_NAMES)} (default: all but {', '.join(f.name for f in DEFAULTS_FAMILIES)})")
    parser.add_argument("--sources", type=names_from(ALL_SOURCES), default=None,
                        help=f"corpus sources to draw cases from, from {list(ALL_SOURCES)}")
    parser.add_argument("--cases-per-combo", type=positive_int, default=None,
                        help="seeds per (size, family, source) of the profiling split (default 12)")
    parser.add_argument("--max-cases", type=non_negative_int, default=None, help="stop after this many cases")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--head-dim", type=head_dim, default=None, help="default 128 (64 with --smoke)")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=None, help="override the size profile's head count")
    parser.add_argument("--warmup", type=non_negative_int, default=None,
                        help="untimed runs before the timed ones (default 3)")
    parser.add_argument("--reps", type=positive_int, default=None, help="timed runs, the median is kept (default 5)")
    parser.add_argument("--input-sets", type=positive_int, default=None, help="rotated q/k/v sets (default 3)")
    parser.add_argument("--validate-heads", type=positive_int, default=2, help="heads checked against the oracle")
    parser.add_argument("--atol", type=non_negative_number, default=None, help="absolute slack of the oracle check")
    parser.add_argument("--abandon-factor", type=abandon_factor, default=1.25,
                        help="with --sequential: keep one sample of a plan this many times slower than the case's "
                             "best (0: off)")
    parser.add_argument("--contenders-after", type=non_negative_int, default=0,
                        help="after this many cases of a request key, time only plans within --contender-regret of "
                             "the best on one of them (and plans not yet seen); 0: every plan on every case")
    parser.add_argument("--contender-regret", type=number_at_least(1.0), default=1.2,
                        help="see --contenders-after (a slowdown factor, at least 1)")
    parser.add_argument("--context-gemm", type=non_negative_int, default=0, metavar="N",
                        help="launch a dense bf16 N x N x N GEMM before every timed plan (a model's projections "
                             "between attention calls), so every plan meets the same clock and L2 state whatever "
                             "else is in its batch; records note it. 0: off")
    parser.add_argument("--sequential", action="store_true",
                        help="time each plan right after its own validation (--abandon-factor applies) instead of "
                             "validating a case's plans first and timing them in turn with the GPU kept busy")
    parser.add_argument("--plan-filter", type=regex, default=None, help="regular expression over plan names")
    parser.add_argument("--reused-masks", action="store_true",
                        help="profile masks that come back: natural plans and their grouped query layout side by "
                             "side, under each request key's /reused key")
    parser.add_argument("--device", type=device, default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=SPLITS, default=SPLIT,
                        help="corpus split to measure: evaluation cases judge a table (selection regret) and "
                             "are never compiled into one")
    parser.add_argument("--fresh", action="store_true", help=f"discard DIR/{RECORDS_FILE} and start over")
    parser.add_argument("--no-progress", action="store_true")
    table = parser.add_argument_group("table building")
    when = table.add_mutually_exclusive_group()
    when.add_argument("--no-compile", action="store_true", help="measure only")
    when.add_argument("--compile-only", action="store_true", help="build the table from the records only")
    table.add_argument("--records", type=existing_file, nargs="+", default=None,
                       help=f"records files to build from (default DIR/{RECORDS_FILE}); a request key in several "
                            "of them takes its cases from the last one (a re-profile supersedes it)")
    table.add_argument("--table", type=output_file, default=None,
                       help="where to write it (default DIR/plan_table_<arch>.json)")
    table.add_argument("--arch", default=None, help="architecture to build for when the records hold several")
    table.add_argument("--min-leaf", type=positive_int, default=32, help="profiled cases per regime at least")
    table.add_argument("--min-leaf-reused", type=non_negative_int, default=None,
                       help="the same for the /reused keys, masks that come back (default 20, never above --min-leaf; 0: --min-leaf)")
    table.add_argument("--max-depth", type=non_negative_int, default=4, help="deepest regime tree cross-validation may choose")
    table.add_argument("--folds", type=int_at_least(2), default=5, help="GroupKFold folds (groups: corpus sources)")


def config_from_args(args: argparse.Namespace) -> ProfileConfig:
    if args.smoke:
        return smoke_config(
            args.out, sizes=args.sizes, families=args.families, sources=args.sources,
            cases_per_combo=args.cases_per_combo, max_cases=args.max_cases, dtype=args.dtype,
            head_dim=args.head_dim, batch=args.batch, heads=args.heads, warmup=args.warmup, reps=args.reps,
            input_sets=args.input_sets, validate_heads=args.validate_heads, atol=args.atol,
            abandon_factor=args.abandon_factor, minutes=args.minutes, plan_filter=args.plan_filter,
            contenders_after=args.contenders_after, contender_regret=args.contender_regret,
            interleave=not args.sequential, context_gemm=args.context_gemm, device=args.device, seed=args.seed,
            split=args.split, reused_masks=args.reused_masks, resume=not args.fresh, progress=not args.no_progress)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return ProfileConfig(
        out_dir=args.out,
        sizes=args.sizes or ("n32k",),
        families=args.families or ALL_FAMILIES,
        sources=args.sources,
        cases_per_combo=args.cases_per_combo or 12,
        max_cases=args.max_cases,
        dtype=args.dtype,
        head_dim=args.head_dim or 128,
        batch=args.batch,
        heads=args.heads,
        warmup=3 if args.warmup is None else args.warmup,
        reps=args.reps or 5,
        input_sets=args.input_sets or 3,
        validate_heads=args.validate_heads,
        atol=args.atol,
        abandon_factor=args.abandon_factor,
        contenders_after=args.contenders_after,
        contender_regret=args.contender_regret,
        interleave=not args.sequential,
        context_gemm=args.context_gemm,
        minutes=args.minutes,
        plan_filter=args.plan_filter,
        device=device,
        seed=args.seed,
        split=args.split,
        reused_masks=args.reused_masks,
        resume=not args.fresh,
        progress=not args.no_progress,
    )


def build_table(records: Sequence[Path], out: Path | None, out_dir: Path, arch: str | None,
                min_leaf: int, max_depth: int, folds: int, log=print, min_leaf_reused: int | None = None) -> Path:
    """Compile the records into a table file and a report next to it. Raises ``PlanTableError``.
    ``min_leaf_reused``: None keeps ``CompileOptions``' default, 0 makes it ``min_leaf``."""
    from .compile import CompileOptions, compile_table, load_profile

    profile = load_profile(records, arch)
    reused = {} if min_leaf_reused is None else {"min_leaf_reused": min_leaf_reused or None}
    options = CompileOptions(FeatureSchema(), min_leaf=min_leaf, max_depth=max_depth, folds=folds, **reused)
    try:
        table, report = compile_table(profile, options, {"records": [str(p) for p in records]})
    except ImportError as err:
        raise PlanTableError(f"building a table needs scikit-learn (pip install 'tessera-diffusers[profile]'): {err}") \
            from err
    path = table.save(out or out_dir / f"plan_table_{profile.arch}.json")
    markdown = report.to_markdown()
    (path.parent / REPORT_FILE).write_text(markdown)
    log(markdown)
    log(f"tessera profile: wrote {path} ({len(table.keys)} keys, "
        f"{sum(len(b.regimes) for k in table.keys.values() for b in k.buckets.values())} regimes)")
    return path


def invalid_plans(path: Path, since_line: int) -> list[dict]:
    """Plan records past ``since_line`` that failed their oracle check."""
    records = list(read_records([path]))[since_line:]
    return [r for r in records if r.get("type") == "plan" and r.get("status") == "invalid"]


def run(args: argparse.Namespace) -> int:
    """Profile (unless ``--compile-only``), then build the table (unless ``--no-compile``)."""
    out_dir = Path(args.out)
    records_path = out_dir / RECORDS_FILE
    if args.compile_only and args.records is None and not records_path.is_file():
        raise InvalidArgumentError("--out", f"a directory holding {RECORDS_FILE} to build the table from "
                                   "(--compile-only; or name files with --records)", str(out_dir))
    if args.context_gemm and args.sequential:
        raise InvalidArgumentError("--context-gemm", "0 with --sequential (a context is for interleaved timing)",
                                   args.context_gemm)
    invalid: list[dict] = []
    if not args.compile_only:
        config = config_from_args(args)
        if torch.device(config.device).type == "cpu" and not args.smoke:
            print("tessera profile: no CUDA device, profiling PyTorch executor plans on the CPU "
                  "(use --smoke for the tiny configuration)", file=sys.stderr)
        from .runner import run_profile

        before = 0 if args.fresh else len(list(read_records([records_path])))
        try:
            summary = run_profile(config, log=lambda m: print(m, file=sys.stderr))
        except CatalogError as err:
            print(f"tessera profile: {err}", file=sys.stderr)
            return 1
        print(f"tessera profile: {summary}")
        invalid = invalid_plans(records_path, before)
        for r in invalid[:10]:
            print(f"INVALID {r['plan']} on {r['case']}: {r.get('reason')}", file=sys.stderr)
    if not args.no_compile and getattr(args, "split", SPLIT) != SPLIT:
        print("tessera profile: evaluation-split records are not compiled into a table", file=sys.stderr)
    elif not args.no_compile:
        try:
            build_table(args.records or [records_path], args.table, out_dir, args.arch, args.min_leaf,
                        args.max_depth, args.folds, min_leaf_reused=args.min_leaf_reused)
        except PlanTableError as err:
            print(f"tessera profile: no table built: {err}", file=sys.stderr)
            if args.compile_only:
                return 1
    return 1 if invalid else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandLineParser(prog="tessera profile", description=DESCRIPTION)
    add_arguments(parser)
    return run_command("tessera profile", run, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
