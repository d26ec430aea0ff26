"""Build part of the corpus and save it (packed bits + manifest), or list what a split holds.

    python -m tessera_diffusers.corpus --split evaluation --list
    python -m tessera_diffusers.corpus --split profiling --out corpus_dir --device cuda --families Q64K64 --limit 50
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .cases import SEEDS_PER_COMBO, SPLITS, count_cases, enumerate_cases
from .grids import GRIDS, grid_named
from .storage import save_corpus


def comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera_diffusers.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--split", choices=SPLITS, default="evaluation")
    parser.add_argument("--families", type=comma_list, default=None)
    parser.add_argument("--sources", type=comma_list, default=None)
    parser.add_argument("--grids", type=comma_list, default=None, help=f"from {[g.name for g in GRIDS]}")
    parser.add_argument("--seeds-per-combo", type=int, default=SEEDS_PER_COMBO)
    parser.add_argument("--heads", type=int, default=None, help="override each grid's model head count")
    parser.add_argument("--limit", type=int, default=None, help="first N cases only")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="directory to save the masks to")
    parser.add_argument("--list", action="store_true", help="print the case names instead of building them")
    args = parser.parse_args(argv)

    grids = None if args.grids is None else [grid_named(g) for g in args.grids]
    selection = {"families": args.families, "sources": args.sources, "grids": grids,
                 "seeds_per_combo": args.seeds_per_combo}
    total = count_cases(args.split, **selection)
    cases = itertools.islice(enumerate_cases(args.split, heads=args.heads, **selection), args.limit)
    if args.list or args.out is None:
        for case in cases:
            print(case.name)
        print(f"{total} cases in the {args.split} split for this selection", file=sys.stderr)
        return 0

    def built():
        for case in cases:
            start = time.perf_counter()
            mask = case.build(args.device)
            print(f"{case.name}: density {mask.density():.4f}, {time.perf_counter() - start:.2f}s", file=sys.stderr)
            yield case, mask

    manifest = save_corpus(args.out, built())
    print(f"saved to {manifest.parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
