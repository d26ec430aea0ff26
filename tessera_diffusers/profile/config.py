"""What a profiling run measures: cases of the corpus's profiling split at benchmark sizes, and how.

Cases come out seed rank by seed rank over every (size, family, source), so any prefix of the list
— what a time budget leaves — covers every request key evenly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..bench.config import ALL_FAMILIES, SIZE_PROFILES
from ..corpus import CaseSpec, family_named, split_seeds
from ..corpus.families import DEFAULTS_FAMILIES
from ..errors import InvalidArgumentError
from .records import method_name

SPLIT = "profiling"  # what tables are built from: the evaluation split judges them on cases they have not seen
SPLITS = ("profiling", "evaluation")
SMOKE_FAMILIES: tuple[str, ...] = ("Q32K16", "Q64K64")


@dataclass(frozen=True)
class ProfileConfig:
    """One profiling run. ``cases()`` lists what it measures, in order."""

    out_dir: Path
    sizes: tuple[str, ...] = ("n32k",)
    families: tuple[str, ...] = ALL_FAMILIES
    sources: tuple[str, ...] | None = None
    cases_per_combo: int = 12  # seeds per (size, family, source)
    max_cases: int | None = None
    dtype: str = "bf16"
    head_dim: int = 128
    batch: int = 1
    heads: int | None = None  # overrides the size profile's head counts
    warmup: int = 3
    reps: int = 5
    input_sets: int = 3
    validate_heads: int = 2
    atol: float | None = None
    # After the validation run, one timed run; a plan slower than abandon_factor x the case's best
    # median so far keeps that single sample instead of warm-ups + reps: its latency is still
    # recorded (one CUDA-event sample of a millisecond kernel), it only costs less time. 0: off.
    abandon_factor: float = 1.25
    # Opt-in coverage lever: once a (size, request key) has this many complete cases, later cases
    # time only its contenders — plans within contender_regret of the best on one of those cases —
    # and plans not yet measured on it. Rankings only ever hold plans timed on all their cases, so
    # the table stays honest; a plan that never came close on the first cases is not revisited.
    # 0 (default): every eligible plan on every case. With interleaved timing the later cases are
    # timed in smaller batches; on the H200 the best 64-row tile against the best 128-row tile
    # stayed within the timing noise whether timed alone or among all plans (docs/results.md).
    contenders_after: int = 0
    contender_regret: float = 1.2
    # Validate every plan of a case first, then time them in turn with the GPU kept busy from the
    # first warm-up to the last sample (bench.timing.time_interleaved); abandon_factor does not
    # apply. False: each plan right after its own validation (warmup + reps), whose times depend on
    # the plan's place in the order (docs/results.md, "Design decisions").
    interleave: bool = True
    # With interleave: a dense bf16 context_gemm^3 GEMM launched before every timed kernel, outside
    # its timed span (bench.timing.gemm_context), so that every plan meets the clock and L2 state of a
    # model's forward pass whatever else shares its batch. 0: off. Records note it (their
    # timing_method), and times taken in different contexts are not compared.
    context_gemm: int = 0
    # Profile masks that come back (``Request.reused_mask``, the table's ``/reused`` keys): each
    # case's plans are the natural ones and the grouped query layout of each that groups in its
    # kernel (``plans.with_grouped_layouts``), timed side by side; the grouping itself, paid once
    # per mask, is not in the times. Case records are keyed apart (``:reused``).
    reused_masks: bool = False
    minutes: float | None = None  # time budget of the measuring loop (None: no limit)
    plan_filter: str | None = None  # regular expression over plan names
    device: str = "cuda"
    seed: int = 0
    # "evaluation" measures held-out cases for selection regret; the table compiler never reads them.
    split: str = SPLIT
    resume: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        for size in self.sizes:
            if size not in SIZE_PROFILES:
                raise InvalidArgumentError("sizes", f"names from {sorted(SIZE_PROFILES)}", repr(size))
        if not self.families:
            raise InvalidArgumentError("families", "at least one family", "none")
        if self.split not in SPLITS:
            raise InvalidArgumentError("split", f"one of {SPLITS}", repr(self.split))
        for name in self.families:
            family_named(name)
        for name, value, least in (("warmup", self.warmup, 0), ("reps", self.reps, 1),
                                   ("input_sets", self.input_sets, 1), ("cases_per_combo", self.cases_per_combo, 1),
                                   ("batch", self.batch, 1), ("validate_heads", self.validate_heads, 1),
                                   ("contenders_after", self.contenders_after, 0),
                                   ("context_gemm", self.context_gemm, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgumentError(name, f"an int >= {least}", repr(value))
        if self.max_cases is not None and self.max_cases < 0:
            raise InvalidArgumentError("max_cases", "a non-negative int or None", repr(self.max_cases))
        if self.context_gemm and not self.interleave:
            raise InvalidArgumentError("context_gemm", "0 with sequential timing (a context is for interleaved timing)",
                                       repr(self.context_gemm))
        if self.minutes is not None and self.minutes < 0:
            raise InvalidArgumentError("minutes", "a non-negative number or None", repr(self.minutes))
        if self.contender_regret < 1:
            raise InvalidArgumentError("contender_regret", "a number >= 1", repr(self.contender_regret))
        if self.abandon_factor != 0 and self.abandon_factor <= 1:
            raise InvalidArgumentError("abandon_factor", "0 (off) or a number > 1", repr(self.abandon_factor))
        if self.plan_filter is not None:
            try:
                re.compile(self.plan_filter)
            except re.error as err:
                raise InvalidArgumentError("plan_filter", "a regular expression", f"{self.plan_filter!r} ({err})") from err

    @property
    def context(self) -> str | None:
        """The timing context its records note ("gemm<n>"), or None."""
        return f"gemm{self.context_gemm}" if self.context_gemm else None

    @property
    def timing_method(self) -> str:
        """What ``records.timing_method`` says of this run's timed records."""
        return method_name(self.interleave, self.context)

    def cases(self) -> list[tuple[str, CaseSpec]]:
        """``(size, case)`` pairs of the split: seed rank major, then size, family, source."""
        combos = []
        for size in self.sizes:
            profile = SIZE_PROFILES[size]
            for name in self.families:
                family = family_named(name)
                grid, heads = profile.grid_for(name)
                if not family.feasible(grid) or (family in DEFAULTS_FAMILIES and grid not in family.grids):
                    continue  # the defaults' families hold their own models' grids only
                for source in family.sources:
                    if self.sources is None or source in self.sources:
                        combos.append((size, name, source, grid, self.heads or heads))
        out = []
        for rank in range(self.cases_per_combo):
            for size, name, source, grid, heads in combos:
                seed = split_seeds(source, self.split, self.cases_per_combo)[rank]
                out.append((size, CaseSpec(name, source, grid, heads, seed)))
        return out if self.max_cases is None else out[: self.max_cases]


def smoke_config(out_dir: Path, **overrides) -> ProfileConfig:
    """The tiny CPU configuration: the PyTorch executor on N=1,024, H=2, D=64, seconds in all."""
    settings = {"sizes": ("smoke",), "families": SMOKE_FAMILIES, "cases_per_combo": 1, "head_dim": 64,
                "warmup": 1, "reps": 2, "input_sets": 2, "device": "cpu"}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return ProfileConfig(out_dir=out_dir, **settings)
