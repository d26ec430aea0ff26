"""The benchmark harness: Tessera beside dense SDPA, FlexAttention and FlashInfer on the mask corpus.

    python -m tessera_diffusers.bench --out results/          # or: tessera bench --out results/

Programmatic use::

    from tessera_diffusers.bench import BenchConfig, run_benchmark, summarize, write_reports, environment
    records, unavailable = run_benchmark(BenchConfig(out_dir=Path("results")))
    summary = summarize(records)

Modules: ``config`` (what a run measures), ``problem`` (inputs and the oracle check), ``timing``
(CUDA events / host clock), ``backends`` (dense SDPA, FlexAttention, oracle), ``flashinfer_backends``
and ``thunderkittens_backends`` (VSA, flex-block-attn; isolated), ``tessera_backends`` (selected plan, forced plans), ``harness`` (the loop), ``metrics``
(aggregates), ``report`` (JSON, markdown, plots), ``cli`` (``add_arguments`` / ``run``).
"""

from .config import SIZE_PROFILES, BenchConfig, SizeProfile
from .harness import run_benchmark
from .metrics import summarize
from .report import environment, write_reports

__all__ = ["SIZE_PROFILES", "BenchConfig", "SizeProfile", "environment", "run_benchmark", "summarize", "write_reports"]
