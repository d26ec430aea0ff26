"""What a benchmark run measures: size profiles, backend sets, and the run configuration."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..corpus import (
    BENCH_32K,
    FAMILIES,
    HV_480P,
    HV_480P_VIDEO,
    HV_720P,
    HV_720P_VIDEO,
    WAN_480P,
    WAN_720P,
    LatentGrid,
    family_named,
    split_seeds,
)
from ..corpus.cases import CaseSpec
from ..errors import InvalidArgumentError

MODES = ("bench", "kernels")


@dataclass(frozen=True)
class SizeProfile:
    """Grids and head counts one benchmark size uses: ``grid`` for the nine frame-major families,
    ``tiled_grid`` for Q384K384 (its tiled canvas sets the sequence length)."""

    name: str
    grid: LatentGrid
    heads: int
    tiled_grid: LatentGrid
    tiled_heads: int
    description: str

    def grid_for(self, family: str) -> tuple[LatentGrid, int]:
        if family_named(family).tiled:
            return self.tiled_grid, self.tiled_heads
        return self.grid, self.heads


SMOKE_GRID = LatentGrid("smoke", 2, 16, 32, 0, 2)  # 1,024 tokens
SMOKE_TILED_GRID = LatentGrid("smoke-tiled", 12, 16, 32, 0, 2)  # 16 tiles of 384 tokens

SIZE_PROFILES: Mapping[str, SizeProfile] = MappingProxyType({
    "n32k": SizeProfile(
        "n32k", BENCH_32K, 24, BENCH_32K, 24,
        "N=32,768, H=24 (Q384K384: the same grid in 6x8x8 tiles, N=36,864)",
    ),
    "wan720p": SizeProfile(
        "wan720p", WAN_720P, 40, HV_720P, 16,
        "Wan2.1 720p N=75,600, H=40 (Q384K384: HunyuanVideo-1.5 720p, N=140,225, H=16)",
    ),
    "smoke": SizeProfile("smoke", SMOKE_GRID, 2, SMOKE_TILED_GRID, 2, "CPU smoke: N=1,024 (Q384K384: N=6,144), H=2"),
    # The sparse calls of the two models as the one-liner makes them (video tokens only), for the
    # defaults' families (corpus.DEFAULTS_FAMILIES) and any frame-major family.
    **{name: SizeProfile(name, grid, heads, tiled, 16, f"{model} {res}: N={grid.video_tokens:,}, H={heads}")
       for name, model, res, grid, heads, tiled in (
           ("wan14b-720p", "Wan2.1-14B", "720p", WAN_720P, 40, HV_720P),
           ("wan14b-480p", "Wan2.1-14B", "480p", WAN_480P, 40, HV_480P),
           ("wan1.3b-720p", "Wan2.1-1.3B", "720p", WAN_720P, 12, HV_720P),
           ("wan1.3b-480p", "Wan2.1-1.3B", "480p", WAN_480P, 12, HV_480P),
           ("hv15-720p", "HunyuanVideo-1.5", "720p", HV_720P_VIDEO, 16, HV_720P),
           ("hv15-480p", "HunyuanVideo-1.5", "480p", HV_480P_VIDEO, 16, HV_480P),
       )},
})
# The sizes the one-liner runs on both models (the plan table's model buckets).
MODEL_SIZES: tuple[str, ...] = ("wan14b-720p", "wan14b-480p", "wan1.3b-720p", "wan1.3b-480p", "hv15-720p", "hv15-480p")

ALL_FAMILIES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
SMOKE_FAMILIES: tuple[str, ...] = ("Q32K16", "Q64K64", "Q384K384")

# Backend names understood by --backends ("tessera-plans" expands to every eligible catalog plan).
BASELINE_NAMES: tuple[str, ...] = (
    "sdpa-cudnn",
    "sdpa-fa2",
    "flex",
    "flex-tuned",
    "flashinfer-bsr-fa2",
    "flashinfer-bsr-fa3",
    "flashinfer-var-fa2",
    "flashinfer-var-fa3",
    "vsa",
    "flex-block-attn",
    "spargeattn",
    "spargeattn-kernel",
    "reference",
)
TESSERA_NAMES: tuple[str, ...] = ("tessera", "tessera-plans", "tessera-int8", "tessera-int8-kernel", "tessera-int8pv",
                                   "tessera-int8pv-kernel")
BACKEND_NAMES: tuple[str, ...] = BASELINE_NAMES + TESSERA_NAMES
FLASHINFER_NAMES: tuple[str, ...] = tuple(n for n in BASELINE_NAMES if n.startswith("flashinfer"))
# The ThunderKittens peers (bench/thunderkittens_backends.py): built on the GPU machine, not on PyPI.
THUNDERKITTENS_NAMES: tuple[str, ...] = ("vsa", "flex-block-attn")


def default_backends(mode: str, device_type: str) -> tuple[str, ...]:
    """Backends a run measures unless told otherwise: on CUDA, bench mode = Tessera's selected plan
    beside every baseline (the ThunderKittens peers and SpargeAttn only where installed); kernels mode = every
    eligible catalog plan beside dense SDPA and FlexAttention (add FlashInfer or the peers with
    ``--backends``); on a CPU, the oracle and the executor."""
    if device_type != "cuda":
        return ("reference", "tessera", "tessera-plans")
    if mode == "kernels":
        return ("sdpa-cudnn", "sdpa-fa2", "flex", "tessera", "tessera-plans")
    from .sparge_backends import installed
    from .thunderkittens_backends import installed_peers

    return ("sdpa-cudnn", "sdpa-fa2", "flex", "tessera") + FLASHINFER_NAMES + installed_peers() + installed()


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. ``cases()`` lists what it measures."""

    out_dir: Path
    mode: str = "bench"
    sizes: tuple[str, ...] = ("n32k",)
    families: tuple[str, ...] = ALL_FAMILIES
    sources: tuple[str, ...] | None = None
    cases_per_family: int = 1
    full: bool = False
    corpus_dir: Path | None = None
    backends: tuple[str, ...] = ()
    dtype: str = "bf16"
    head_dim: int = 128
    batch: int = 1
    heads: int | None = None  # overrides the size profile's head counts
    warmup: int = 3
    # After the warm-up calls, keep calling until the device has been busy this long (ms) before the
    # timed calls, so every backend is timed under sustained load. 0: the warm-up calls only.
    warmup_ms: float = 0.0
    # Validate every backend of a case first, then time them in turn with the device kept busy
    # (harness.interleaved_case); dense baselines are then timed on every case.
    interleave: bool = False
    reps: int = 10
    input_sets: int = 3
    request_reps: int = 3
    plan_request_reps: int = 1  # complete requests timed per forced catalog plan (0: none)
    plan_filter: str | None = None  # regular expression over plan names (forced plans only)
    validate_heads: int = 2
    atol: float | None = None
    device: str = "cuda"
    seed: int = 0
    plots: bool = True
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError("mode", f"one of {MODES}", repr(self.mode))
        for size in self.sizes:
            if size not in SIZE_PROFILES:
                raise InvalidArgumentError("sizes", f"names from {sorted(SIZE_PROFILES)}", repr(size))
        for name in self.families:
            family_named(name)
        for name in self.backends:
            if name not in BACKEND_NAMES:
                raise InvalidArgumentError("backends", f"names from {BACKEND_NAMES}", repr(name))
        if self.plan_filter is not None:
            try:
                re.compile(self.plan_filter)
            except re.error as err:
                raise InvalidArgumentError("plan_filter", "a regular expression", f"{self.plan_filter!r} ({err})") from err
        for name, value, least in (("warmup", self.warmup, 0), ("reps", self.reps, 1), ("input_sets", self.input_sets, 1),
                                   ("request_reps", self.request_reps, 1), ("cases_per_family", self.cases_per_family, 1),
                                   ("plan_request_reps", self.plan_request_reps, 0),
                                   ("batch", self.batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgumentError(name, f"an int >= {least}", repr(value))
        if isinstance(self.warmup_ms, bool) or not isinstance(self.warmup_ms, (int, float)) or not self.warmup_ms >= 0:
            raise InvalidArgumentError("warmup_ms", "a number of milliseconds >= 0", repr(self.warmup_ms))

    def cases(self) -> list[tuple[str, CaseSpec]]:
        """``(size label, case)`` pairs: the whole evaluation split with ``full``, else
        ``cases_per_family`` evaluation cases per family and size (sources rotate across families)."""
        from ..corpus import enumerate_cases

        if self.full:
            return [("evaluation", c) for c in enumerate_cases("evaluation", families=self.families,
                                                              sources=self.sources, heads=self.heads)]
        out = []
        for size in self.sizes:
            profile = SIZE_PROFILES[size]
            for index, name in enumerate(self.families):
                family = family_named(name)
                grid, heads = profile.grid_for(name)
                sources = [s for s in family.sources if self.sources is None or s in self.sources]
                for k in range(self.cases_per_family if sources else 0):
                    source = sources[(index + k) % len(sources)]
                    rank = k // len(sources)
                    seed = split_seeds(source, "evaluation", rank + 1)[rank]
                    out.append((size, CaseSpec(name, source, grid, self.heads or heads, seed)))
        return out
