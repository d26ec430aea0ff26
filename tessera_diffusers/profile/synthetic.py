"""Synthetic latency matrices with a known structure: for tests of the compiler and for the CPU
dispatch micro-benchmark. Never a source of a shipped table (a table is built from measurements).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from types import MappingProxyType

from ..catalog import catalog_hash
from ..cost_model import ROW_UNION_KEY, estimate_ms
from ..plan_table import STAT_NAMES
from ..plans import KernelSpec, PhysicalPlan, Request
from .compile import Profile, ProfiledCase

# Ranges statistics are drawn from (uniform), roughly those of the corpus masks.
STAT_RANGES: dict[str, tuple[float, float]] = {
    "density": (0.02, 0.30),
    "run_coverage": (0.0, 1.0),
    "max_row_blocks": (4.0, 128.0),
    "mean_row_blocks": (2.0, 64.0),
    "mean_run_length": (1.0, 8.0),
    "empty_row_fraction": (0.0, 0.2),
    "row_imbalance": (1.0, 3.0),
    "row_overlap": (0.0, 1.0),
}

# latency(plan, request, stats by name, rng) -> ms, or None where the plan is not valid on the case
Latency = Callable[[PhysicalPlan, Request, dict[str, float], random.Random], "float | None"]


def random_stats(rng: random.Random) -> dict[str, float]:
    return {name: rng.uniform(*STAT_RANGES[name]) for name in STAT_NAMES}


def synthetic_profile(
    arch: str,
    kernels: tuple[KernelSpec, ...],
    plans: Sequence[PhysicalPlan],
    requests: Sequence[Request],
    latency: Latency,
    cases_per_request: int,
    groups: int = 4,
    seed: int = 0,
    row_unions: Callable[[random.Random], dict[int, float]] | None = None,
) -> Profile:
    """``cases_per_request`` cases per request with random statistics, spread over ``groups``
    CV groups, each with ``latency(plan, request, stats, rng)`` for every plan of its geometry.
    ``row_unions(rng)`` gives each case row-union ratios too (``ProfiledCase.row_unions``), which
    ``latency`` then finds in ``stats`` as ``row_union_<rows>`` (where the cost model reads them)."""
    rng = random.Random(seed)
    cases = []
    for request in requests:
        mine = [p for p in plans if (p.block_q, p.block_kv) == (request.block_q, request.block_kv)]
        for i in range(cases_per_request):
            stats = random_stats(rng)
            unions = row_unions(rng) if row_unions else {}
            seen = stats | {f"{ROW_UNION_KEY}{rows}": ratio for rows, ratio in unions.items()}
            lat = {}
            for plan in mine:
                ms = latency(plan, request, seen, rng)
                if ms is not None:
                    lat[plan.name] = float(ms)
            cases.append(ProfiledCase(f"{request.name}#{i}", request, tuple(stats[s] for s in STAT_NAMES),
                                      f"source{i % groups}", MappingProxyType(lat), MappingProxyType(unions)))
    return Profile(arch, catalog_hash(kernels), kernels, tuple(cases),
                   MappingProxyType({p.name: p for p in plans}))


def cost_model_latency(noise: float = 0.02) -> Latency:
    """Latencies from the roofline cost model with multiplicative noise: a structured, realistic
    looking L where different plans win in different regions of the statistics."""

    def latency(plan: PhysicalPlan, request: Request, stats: dict[str, float], rng: random.Random) -> float:
        return estimate_ms(plan, request, stats) * (1.0 + noise * rng.gauss(0.0, 1.0))

    return latency
