"""``tessera`` command line: demo (the main job), bench, explain, profile, build.

    tessera demo                  # built-in default: Wan-style video attention through Tessera
    tessera bench --out DIR       # benchmark harness (JSON + markdown + plots)
    tessera explain --geometry Q64K64 --seq 32768 --heads 24
    tessera profile --out DIR --minutes 8   # profile the catalog, build the plan table (resumable)
    tessera build                 # (re)build the native kernel library in place
"""

from __future__ import annotations

import argparse
import sys


def add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show how a request would be planned (ranking, rejections, choice)")
    p.add_argument("--geometry", default="Q64K64", help="Q{B_Q}K{B_KV}")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--mask", choices=("random", "banded"), default="random",
                   help="random short runs per head, or one diagonal band (long runs, neighbouring rows alike)")
    p.add_argument("--arch", default=None, help="e.g. sm90; default: this machine's GPU, else sm90")
    p.add_argument("--table", default=None,
                   help="a plan table file (default: the shipped table of the architecture, else the cost model)")
    p.add_argument("--no-table", action="store_true", help="rank with the cost model only")


def run_explain(args: argparse.Namespace) -> int:
    import torch

    from .catalog import all_kernels
    from .mask_state import build_mask_state
    from .plan_table import load_plan_table
    from .plans import Request
    from .selector import AUTO, Selector
    from .testing import banded_mask, random_mask

    bq, bkv = (int(x) for x in args.geometry.upper().lstrip("Q").split("K"))
    arch = args.arch
    if arch is None:
        arch = "sm{}{}".format(*torch.cuda.get_device_capability()) if torch.cuda.is_available() else "sm90"
    heads = min(args.heads, 4)
    if args.mask == "banded":
        mask = banded_mask(heads, args.seq, bq, bkv, args.density)
    else:
        mask = random_mask(1, heads, args.seq, args.seq, bq, bkv, density=args.density, empty_rows=False)
    request = Request(1, args.heads, args.seq, args.seq, args.head_dim, args.dtype, bq, bkv, arch)
    table = None if args.no_table else (load_plan_table(args.table) if args.table else AUTO)
    selector, state = Selector(table=table, kernels=all_kernels()), build_mask_state(mask)
    selection = selector.rank(request, state)
    print(selection.explain())
    if selection.chosen is not None:  # what the runtime re-prepares the mask with when it comes back
        reused = selector.reused_plan(selection.chosen, request, state)
        by = selector.reused_request(selection.chosen, request)
        source = "the rule" if by is None else f"the table's {by.key} key"
        print(f"a mask that comes back: {reused.name} ({source})")
    return 0


def add_build(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build the native kernel library into the installed package")
    p.add_argument("--archs", default=None, help='e.g. "80;90" (TESSERA_CUDA_ARCHS)')
    p.add_argument("--only", default=None, help="regex over kernel names")
    p.add_argument("--jobs", type=int, default=None)


def run_build(args: argparse.Namespace) -> int:
    import importlib.util
    import os

    from . import ops

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(os.path.dirname(here), "csrc", "build_native.py")
    if not os.path.isfile(script):
        print("tessera build needs a source checkout (csrc/build_native.py); reinstall from source instead")
        return 1
    spec = importlib.util.spec_from_file_location("tessera_build_native", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lib = module.build_native_library(os.path.dirname(ops.library_path()), args.archs, args.only, args.jobs)
    return 0 if lib else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the built-in default job (tiny Wan model on CPU, real-size attention on GPU)")
    from .demo import add_arguments as add_demo

    add_demo(demo)

    bench = sub.add_parser("bench", help="benchmark Tessera beside its baselines (JSON + markdown + plots)")
    from .bench.cli import add_arguments as add_bench

    add_bench(bench)
    add_explain(sub)
    profile = sub.add_parser("profile", help="profile every catalog plan on the corpus and build the plan table")
    from .profile.cli import add_arguments as add_profile

    add_profile(profile)
    add_build(sub)

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run as run_demo

        return run_demo(args)
    if args.command == "bench":
        from .bench.cli import run as run_bench

        return run_bench(args)
    if args.command == "explain":
        return run_explain(args)
    if args.command == "profile":
        from .profile.cli import run as run_profile

        return run_profile(args)
    return run_build(args)


if __name__ == "__main__":
    sys.exit(main())
