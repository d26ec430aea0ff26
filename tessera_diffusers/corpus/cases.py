"""Corpus cases: ``(family, source, grid, heads, seed) -> LogicalMask``, splits and enumeration.

A case is a small frozen value; its mask is built on demand, on any device, deterministically from
the case alone. Seeds are grouped in chunks of ``SEED_CHUNK``; each ``(source, chunk)`` belongs to
exactly one split (by a hash), so the profiling split and the evaluation split never share a
source seed chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache

import torch

from ..errors import InvalidArgumentError
from ..mask import LogicalMask
from .families import ALL_SOURCES, FAMILIES, MaskFamily, family_named
from .grids import LatentGrid, TokenLayout, block_boxes
from .selection import head_budgets
from .sources import SOURCES, SourceContext

SEED_CHUNK = 16
SPLITS: tuple[str, ...] = ("profiling", "evaluation")
# Seeds per (family, source, grid) combination in the default enumeration of each split: 12 gives
# 2,196 evaluation cases over the 183 feasible combinations.
SEEDS_PER_COMBO = 12
# Per-head density spread: head targets are the case target times exp(N(0, HEAD_SPREAD^2)), renormalized.
HEAD_SPREAD = 0.25


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of values (stable across processes and platforms)."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded from ``parts``."""
    return torch.Generator().manual_seed(stable_seed(*parts))


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise InvalidArgumentError("split", f"one of {SPLITS}", repr(split))
    return split


def split_of(source: str, seed: int) -> str:
    """The split that owns ``seed`` of ``source``: decided per seed chunk, never per seed."""
    chunk = seed // SEED_CHUNK
    return SPLITS[stable_seed("tessera-corpus-split", source, chunk) & 1]


@cache
def split_seeds(source: str, split: str, count: int) -> tuple[int, ...]:
    """The first ``count`` seeds of ``source`` that belong to ``split``."""
    check_split(split)
    seeds: list[int] = []
    seed = 0
    while len(seeds) < count:
        if split_of(source, seed) == split:
            seeds.append(seed)
        seed += 1
    return tuple(seeds)


@dataclass(frozen=True)
class CaseSpec:
    """One corpus case. ``build(device)`` makes its mask: ``[1, heads, nQ, nKV]`` blocks, seq lengths
    of the family's layout over ``grid`` (frame-major, or SSTA tiles for Q384K384)."""

    family: str
    source: str
    grid: LatentGrid
    heads: int
    seed: int

    def __post_init__(self) -> None:
        fam = family_named(self.family)
        if self.source not in fam.sources:
            raise InvalidArgumentError("source", f"one of {fam.sources} for family {self.family}", repr(self.source))
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads <= 0:
            raise InvalidArgumentError("heads", "a positive int", repr(self.heads))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgumentError("seed", "a non-negative int", repr(self.seed))

    @property
    def name(self) -> str:
        return f"{self.family}/{self.source}/{self.grid.name}/h{self.heads}/s{self.seed}"

    @property
    def split(self) -> str:
        return split_of(self.source, self.seed)

    @property
    def mask_family(self) -> MaskFamily:
        return family_named(self.family)

    @property
    def layout(self) -> TokenLayout:
        return self.mask_family.layout(self.grid)

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    def target_density(self) -> float:
        """The case's target density (drawn from the family's inner range)."""
        lo, hi = self.mask_family.target_range()
        rng = generator("case", self.family, self.source, self.seed, self.grid.name, self.heads)
        return lo + (hi - lo) * float(torch.rand(1, generator=rng, dtype=torch.float64))

    def build(self, device: torch.device | str = "cpu") -> LogicalMask:
        """The case's mask on ``device`` (vectorized torch; deterministic per device type)."""
        fam = self.mask_family
        reason = fam.infeasibility(self.grid)
        if reason is not None:
            raise InvalidArgumentError("case", f"a feasible (family, grid) pair for {self.name}", reason)
        device = torch.device(device)
        layout = fam.layout(self.grid)
        q_boxes = block_boxes(layout, fam.block_q, device)
        kv_boxes = block_boxes(layout, fam.block_kv, device)
        n_q, n_kv = q_boxes.count, kv_boxes.count
        rng = generator("case", self.family, self.source, self.seed, self.grid.name, self.heads)
        lo, hi = fam.target_range()
        target = lo + (hi - lo) * float(torch.rand(1, generator=rng, dtype=torch.float64))
        spread = torch.exp(HEAD_SPREAD * torch.randn(self.heads, generator=rng, dtype=torch.float64))
        targets = target * spread / spread.mean()
        text = q_boxes.text.unsqueeze(1) | kv_boxes.text.unsqueeze(0)
        floors = torch.full((self.heads,), int(text.sum()), dtype=torch.int64)
        budgets = head_budgets(targets, floors, n_q * n_kv)
        ctx = SourceContext(
            family=fam,
            layout=layout,
            heads=self.heads,
            budgets=tuple(budgets),
            q_boxes=q_boxes,
            kv_boxes=kv_boxes,
            scene=generator("scene", self.source, self.seed, self.grid.name, self.heads),
            rng=rng,
            salt=stable_seed("jitter", self.name) & 0x7FFFFFFF,
            device=device,
        )
        blocks = SOURCES[self.source](ctx)  # [H, nQ, nKV]
        seq = layout.seq_len
        return LogicalMask(blocks.unsqueeze(0), fam.block_q, fam.block_kv, seq, seq)

    def to_dict(self) -> dict:
        return {
            "family": self.family,
            "source": self.source,
            "grid": self.grid.to_dict(),
            "heads": self.heads,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CaseSpec:
        return cls(str(data["family"]), str(data["source"]), LatentGrid.from_dict(data["grid"]), int(data["heads"]),
                   int(data["seed"]))


def combinations(
    families: Iterable[str] | None = None,
    sources: Iterable[str] | None = None,
    grids: Iterable[LatentGrid] | None = None,
) -> list[tuple[MaskFamily, str, LatentGrid]]:
    """Feasible ``(family, source, grid)`` triples, in family order. ``grids`` replaces each
    family's own grid list when given."""
    fams = FAMILIES if families is None else tuple(family_named(f) for f in families)
    wanted_sources = None if sources is None else tuple(sources)
    if wanted_sources is not None:
        for s in wanted_sources:
            if s not in ALL_SOURCES:
                raise InvalidArgumentError("sources", f"names from {ALL_SOURCES}", repr(s))
    grid_list = None if grids is None else tuple(grids)
    out = []
    for fam in fams:
        for source in fam.sources:
            if wanted_sources is not None and source not in wanted_sources:
                continue
            for grid in fam.grids if grid_list is None else grid_list:
                if fam.feasible(grid):
                    out.append((fam, source, grid))
    return out


def enumerate_cases(
    split: str = "evaluation",
    *,
    families: Iterable[str] | None = None,
    sources: Iterable[str] | None = None,
    grids: Iterable[LatentGrid] | None = None,
    seeds_per_combo: int = SEEDS_PER_COMBO,
    heads: int | None = None,
) -> Iterator[CaseSpec]:
    """Cases of one split, lazily: seed rank by seed rank over every feasible combination, so any
    prefix covers all combinations evenly. ``heads`` overrides each grid's model head count."""
    check_split(split)
    combos = combinations(families, sources, grids)
    seeds = {source: split_seeds(source, split, seeds_per_combo) for _, source, _ in combos}
    for rank in range(seeds_per_combo):
        for fam, source, grid in combos:
            yield CaseSpec(fam.name, source, grid, heads or grid.heads, seeds[source][rank])


def count_cases(
    split: str = "evaluation",
    *,
    families: Iterable[str] | None = None,
    sources: Iterable[str] | None = None,
    grids: Iterable[LatentGrid] | None = None,
    seeds_per_combo: int = SEEDS_PER_COMBO,
) -> int:
    check_split(split)
    return len(combinations(families, sources, grids)) * seeds_per_combo
