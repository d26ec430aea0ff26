"""Kernel study: every eligible Tessera catalog plan on every corpus family, beside dense
cuDNN SDPA, dense FlashAttention-2 SDPA and FlexAttention, measured in one run.

    python benchmarks/kernel_study.py --out $OUT                                  # N=32768/H=24 and Wan 720p
    python benchmarks/kernel_study.py --out $OUT --sizes n32k                     # one size
    python benchmarks/kernel_study.py --out $OUT --sizes wan720p --families Q16K16,Q32K16
    python benchmarks/kernel_study.py --out $OUT --resume                         # continue a cut-short run
    python benchmarks/kernel_study.py --out $OUT --backends sdpa-cudnn,flex,flashinfer-var-fa3,tessera,tessera-plans

A thin front end of ``tessera bench --mode kernels`` (see ``tessera_diffusers/bench``): the same
options, with five timed runs per plan by default (median of 5 after 3 warm-ups). Records are
appended to ``$OUT/records.jsonl`` as they are measured; ``results.md`` has a "kernel study" table
per size (best plan per family, its speedup over FlexAttention, its share of dense FA2 TFLOP/s).
"""

from __future__ import annotations

import sys

from tessera_diffusers.bench import cli

DEFAULTS = ["--mode", "kernels", "--reps", "5"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return cli.main(DEFAULTS + args)  # later options win, so the caller can override the defaults


if __name__ == "__main__":
    raise SystemExit(main())
