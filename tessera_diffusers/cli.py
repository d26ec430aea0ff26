"""Tessera: block-sparse attention for video diffusion transformers.

    tessera demo                  # see Tessera inside a video diffusion model (CPU ~10 s, GPU under a minute)
    tessera explain --geometry Q64K64 --seq 32768 --heads 24   # how one request is planned (seconds)
    tessera bench --out DIR       # Tessera beside dense and sparse baselines (GPU: minutes to hours)
    tessera profile --out DIR --minutes 8   # measure the plans, build a plan table (GPU, resumable)
    tessera build                 # recompile the CUDA kernels of a source checkout (nvcc, minutes)

`tessera <command> --help` describes each command. A mistake in the options ends in one line,
`tessera <command>: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from .cli_common import (
    CommandLineParser,
    arch,
    density,
    existing_file,
    geometry,
    head_dim,
    positive_int,
    regex,
    rejected,
    run_command,
)
from .errors import CatalogError, InvalidArgumentError, PlanTableError
from .plans import INPUT_PRECISION, PRECISIONS

# The example mask of `tessera explain` is built in memory (a float score per block first).
MAX_EXPLAIN_MASK_BLOCKS = 1 << 28
EXPLAIN_MASK_HEADS = 4  # the example mask's heads; the request keeps --heads


# -- tessera explain ------------------------------------------------------------------------------

EXPLAIN_DESCRIPTION = """\
Show how Tessera would plan one attention request: the plans it ranks (from the plan table of the
architecture, else the cost model), the ones it rejects and why, the one it chooses, and the plan a
mask that comes back gets. A random (or banded) example mask of the given density stands in for the
model's mask. Nothing runs on a GPU; it takes a few seconds.

    tessera explain --geometry Q64K64 --seq 32768 --heads 24
    tessera explain --geometry Q16K16 --seq 75600 --heads 40 --arch sm90 --mask banded
    tessera explain --geometry Q128K128 --precision int8
"""


def add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show how a request would be planned (ranking, rejections, choice)",
                       description=EXPLAIN_DESCRIPTION)
    p.add_argument("--geometry", type=geometry, default="Q64K64",
                   help="block sizes Q<B_Q>K<B_KV>, multiples of 16 in [16, 512] (default Q64K64)")
    p.add_argument("--seq", type=positive_int, default=32768, help="sequence length in tokens (default 32768)")
    p.add_argument("--heads", type=positive_int, default=24, help="attention heads (default 24)")
    p.add_argument("--head-dim", type=head_dim, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--precision", default=INPUT_PRECISION, choices=PRECISIONS,
                   help="input: computed in --dtype (default); int8: the 8-bit kernels (head dim 128, sm90)")
    p.add_argument("--density", type=density, default=0.1,
                   help="share of active blocks of the example mask, in (0, 1] (default 0.1)")
    p.add_argument("--mask", choices=("random", "banded"), default="random",
                   help="random short runs per head, or one diagonal band (long runs, neighbouring rows alike)")
    p.add_argument("--arch", type=arch, default=None,
                   help="e.g. sm90; default: this machine's GPU, else the --table's architecture, else sm90")
    tables = p.add_mutually_exclusive_group()
    tables.add_argument("--table", type=existing_file, default=None,
                        help="a plan table file (default: the shipped table of the architecture, else the cost model)")
    tables.add_argument("--no-table", action="store_true", help="rank with the cost model only")


def run_explain(args: argparse.Namespace) -> int:
    import torch

    from .catalog import all_kernels
    from .library import native_available
    from .mask_state import build_mask_state
    from .plan_table import load_plan_table
    from .plans import Request
    from .selector import AUTO, Selector
    from .testing import banded_mask, random_mask

    bq, bkv = args.geometry
    table = None if args.no_table else AUTO
    if args.table is not None:
        try:
            table = load_plan_table(args.table)
        except PlanTableError as err:
            raise InvalidArgumentError("--table", "a plan table file (tessera profile writes one)", err) from None
    device_arch = "sm{}{}".format(*torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    target = args.arch or device_arch
    if target is None:
        target = table.arch if args.table is not None else "sm90"
    if args.table is not None and table.arch != target:
        raise InvalidArgumentError("--table", f"a plan table of {target} (the architecture explained)",
                                   f"a table of {table.arch} ({args.table})", hint="pass --arch to choose another")
    heads = min(args.heads, EXPLAIN_MASK_HEADS)
    blocks = heads * -(-args.seq // bq) * -(-args.seq // bkv)
    if blocks > MAX_EXPLAIN_MASK_BLOCKS:
        raise InvalidArgumentError(
            "--seq", f"a length whose example mask fits in memory (at most {MAX_EXPLAIN_MASK_BLOCKS:,} blocks "
            f"of Q{bq}K{bkv} over {heads} heads)", f"{args.seq} ({blocks:,} blocks)")
    if args.mask == "banded":
        mask = banded_mask(heads, args.seq, bq, bkv, args.density)
    else:
        mask = random_mask(1, heads, args.seq, args.seq, bq, bkv, density=args.density, empty_rows=False)
    request = Request(1, args.heads, args.seq, args.seq, args.head_dim, args.dtype, bq, bkv, target,
                      precision=args.precision)
    # The loaded library's kernels where it serves the architecture explained (then a table profiled
    # on other kernel sources says so), else every kernel of the catalog.
    loaded = target == device_arch and native_available()
    selector, state = Selector(table=table, kernels=None if loaded else all_kernels()), build_mask_state(mask)
    selection = selector.rank(request, state)
    print(selection.explain())
    if selection.chosen is not None:  # what the runtime re-prepares the mask with when it comes back
        reused = selector.reused_plan(selection.chosen, request, state)
        by = selector.reused_request(selection.chosen, request)
        source = "the rule" if by is None else f"the table's {by.key} key"
        print(f"a mask that comes back: {reused.name} ({source})")
    return 0


# -- tessera build --------------------------------------------------------------------------------

BUILD_DESCRIPTION = """\
Compile the CUDA kernel library (libtessera_kernels.so) from the kernel sources of a source
checkout, into the directory the package loads it from (tessera_diffusers/_native/, or the
directory of TESSERA_NATIVE_LIB). `pip install .` already does this when nvcc is available; this
command is for rebuilding after editing the kernels.

Needs: a clone of the repository installed with `pip install -e .` (the csrc/ folder beside the
package), nvcc (the CUDA toolkit: on PATH, or NVCC / CUDA_HOME), and for the Hopper (sm90a)
kernels the CuTe headers (`pip install nvidia-cutlass`). Rebuilds are incremental; a full build of
one architecture takes about a minute on 16 cores, longer on fewer.

    tessera build --archs 90
    tessera build --archs 90 --only '_d128_bf16_' --jobs 8
"""


def archs_list(text: str) -> str:
    """Argument type: CUDA architectures as numbers, ``"80;90"`` or ``"80,90"``."""
    names = [a.strip() for a in text.replace(",", ";").split(";") if a.strip()]
    if not names or any(re.fullmatch(r"[1-9]\d{1,2}a?", a) is None for a in names):
        raise rejected('CUDA architectures as numbers separated by ";" or "," (e.g. "80;90")', text)
    return text


def add_build(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="recompile the CUDA kernel library from a source checkout (needs nvcc)",
                       description=BUILD_DESCRIPTION)
    p.add_argument("--archs", type=archs_list, default=None,
                   help='CUDA architectures, e.g. "80;90" (default: TESSERA_CUDA_ARCHS, else "80;90")')
    p.add_argument("--only", type=regex, default=None, help="build only the kernels whose name matches this regex")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel nvcc processes (default: MAX_JOBS, else all cores)")


def run_build(args: argparse.Namespace) -> int:
    import importlib.util

    from .library import library_path

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(os.path.dirname(here), "csrc", "build_native.py")
    if not os.path.isfile(script):
        raise CatalogError(
            f"needs a source checkout: no csrc/build_native.py beside the installed package ({here}); clone the "
            "repository and run `pip install -e .` there, then `tessera build`")
    spec = importlib.util.spec_from_file_location("tessera_build_native", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.find_nvcc() is None:
        raise CatalogError("needs nvcc (the CUDA toolkit): put it on PATH, or set NVCC or CUDA_HOME")
    try:
        lib = module.build_native_library(os.path.dirname(library_path()), args.archs, args.only, args.jobs)
    except RuntimeError as err:
        if args.only is not None and "no kernel matches" in str(err):
            raise InvalidArgumentError("--only", "a regex matching some kernel name", repr(args.only),
                                       hint=str(err)) from None
        raise
    return 0 if lib else 1


# -- tessera ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from .bench.cli import DESCRIPTION as BENCH_DESCRIPTION
    from .bench.cli import add_arguments as add_bench
    from .demo import DESCRIPTION as DEMO_DESCRIPTION
    from .demo import add_arguments as add_demo
    from .profile.cli import DESCRIPTION as PROFILE_DESCRIPTION
    from .profile.cli import add_arguments as add_profile

    parser = CommandLineParser(prog="tessera", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    add_demo(sub.add_parser("demo", description=DEMO_DESCRIPTION,
                            help="see Tessera inside a video diffusion model (tiny model on CPU, real size on GPU)"))
    add_bench(sub.add_parser("bench", description=BENCH_DESCRIPTION,
                             help="benchmark Tessera beside its baselines (JSON + markdown + plots)"))
    add_explain(sub)
    add_profile(sub.add_parser("profile", description=PROFILE_DESCRIPTION,
                               help="measure every plan on the mask corpus and build the plan table"))
    add_build(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run
    elif args.command == "bench":
        from .bench.cli import run
    elif args.command == "explain":
        run = run_explain
    elif args.command == "profile":
        from .profile.cli import run
    else:
        run = run_build
    return run_command(f"tessera {args.command}", run, args)


if __name__ == "__main__":
    sys.exit(main())
