"""The mask corpus: geometry and density by construction, per-head variation, partial blocks, empty
rows, determinism, disjoint splits, enumeration size, and the packed-bit store (CPU, small grids)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tessera_diffusers import LogicalMask
from tessera_diffusers.corpus import (
    DEFAULTS_FAMILIES,
    DEFAULTS_SOURCE,
    FAMILIES,
    HV_720P,
    NINE_FAMILIES,
    SEED_CHUNK,
    SPLITS,
    VIDEO_SOURCES,
    CaseSpec,
    LatentGrid,
    TokenLayout,
    combinations,
    count_cases,
    enumerate_cases,
    family_named,
    load_corpus,
    save_corpus,
    split_of,
    split_seeds,
)
from tessera_diffusers.corpus.grids import block_boxes
from tessera_diffusers.corpus.selection import head_budgets, select_blocks
from tessera_diffusers.errors import InvalidArgumentError

# Small grids: 4,096 frame-major tokens (a power of two), 4,324 with text (partial last blocks),
# and a 3 x 4 x 6 tile canvas with text for the tiled Q384K384 family.
GRID = LatentGrid("t-plain", 8, 16, 32, 0, 3)
GRID_TEXT = LatentGrid("t-text", 8, 16, 33, 100, 3)
GRID_TILES = LatentGrid("t-tiles", 18, 30, 48, 64, 3)


def family_cases() -> list[CaseSpec]:
    cases = []
    for fam in FAMILIES:
        grid = GRID_TILES if fam.tiled else GRID
        for source in fam.sources:
            cases.append(CaseSpec(fam.name, source, grid, 3, 5))
    return cases


CASES = family_cases()


@pytest.fixture(scope="module")
def built() -> dict[str, LogicalMask]:
    return {case.name: case.build("cpu") for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.family}-{c.source}")
def test_family_geometry_and_density(case: CaseSpec, built: dict[str, LogicalMask]) -> None:
    mask = built[case.name]
    fam = family_named(case.family)
    layout = fam.layout(case.grid)
    assert (mask.block_q, mask.block_kv) == (fam.block_q, fam.block_kv)
    assert mask.seq_len_q == mask.seq_len_kv == layout.seq_len
    n_q, n_kv = math.ceil(layout.seq_len / fam.block_q), math.ceil(layout.seq_len / fam.block_kv)
    assert tuple(mask.blocks.shape) == (1, 3, n_q, n_kv)
    density = mask.density()
    assert fam.density_lo <= density <= fam.density_hi, f"{case.name}: density {density:.4f}"
    assert abs(density - case.target_density()) < 0.01  # hit by construction, not by luck
    heads = mask.blocks[0]
    assert not all(torch.equal(heads[0], heads[h]) for h in range(1, heads.shape[0])), "no per-head variation"


def test_every_family_is_covered() -> None:
    assert {c.family for c in CASES} == {f.name for f in FAMILIES}
    assert len(NINE_FAMILIES) == 9
    geometries = {(f.block_q, f.block_kv) for f in FAMILIES if f.name in NINE_FAMILIES}
    assert geometries == {(16, 16), (32, 16), (32, 32), (64, 32), (64, 64), (128, 64), (128, 128)}
    native = family_named("Q384K384")
    assert native.tiled and (native.block_q, native.block_kv) == (384, 384)


@pytest.mark.parametrize("source", VIDEO_SOURCES)
def test_text_grid_partial_blocks_and_dense_text(source: str) -> None:
    case = CaseSpec("Q64K64-DD", source, GRID_TEXT, 2, 1)
    mask = case.build()
    fam = family_named("Q64K64-DD")
    assert mask.seq_len_q % 64 != 0  # the last block of each axis is partial
    assert fam.contains(mask.density())
    video = GRID_TEXT.video_tokens
    first_text_row = video // 64
    assert bool(mask.blocks[0, :, first_text_row:, :].all()), "text rows must be dense"
    assert bool(mask.blocks[0, :, :, first_text_row:].all()), "text columns must be dense"
    assert bool(mask.blocks[..., -1].any()), "the partial last key block is used"


def test_empty_rows_appear_in_importance_source() -> None:
    empty_cases = 0
    for seed in range(6):
        mask = CaseSpec("Q32K32", "importance_topk", GRID, 3, seed).build()
        empty_cases += int((~mask.blocks.any(-1)).any())
    assert empty_cases > 0
    window = CaseSpec("Q32K32", "sliding_tile", GRID, 3, 0).build()
    assert bool(window.blocks.any(-1).all()), "a sliding window never leaves a row empty"


def test_ssta_window_is_always_active() -> None:
    case = CaseSpec("Q384K384", "ssta", GRID_TILES, 3, 2)
    mask = case.build()
    layout = TokenLayout(GRID_TILES, tiled=True)
    assert layout.tile_counts == (3, 4, 6)
    n_video = math.prod(layout.tile_counts)
    blocks = mask.blocks[0]
    diagonal = blocks[:, torch.arange(n_video), torch.arange(n_video)]
    assert bool(diagonal.all()), "every tile sees itself (the centre of its window)"
    assert bool(blocks[:, n_video:, :].all()) and bool(blocks[:, :, n_video:].all()), "text dense"


@pytest.mark.parametrize("family", DEFAULTS_FAMILIES, ids=lambda f: f.name)
def test_defaults_families_are_the_default_sparsifiers_masks_at_model_sizes(family) -> None:
    """The defaults' masks over each model grid's video tokens: one 384-token block per query and
    key block, every block sees itself (its tile window), density searched up to the case's target."""
    assert family not in FAMILIES and family.sources == (DEFAULTS_SOURCE,)
    for grid in family.grids:
        case = CaseSpec(family.name, DEFAULTS_SOURCE, grid, 2, 3)
        mask = case.build()
        n = math.ceil(grid.video_tokens / 384)
        assert grid.text_tokens == 0 and mask.seq_len_q == mask.seq_len_kv == grid.video_tokens
        assert tuple(mask.blocks.shape) == (1, 2, n, n) and (mask.block_q, mask.block_kv) == (384, 384)
        assert bool(mask.blocks[0][:, torch.arange(n), torch.arange(n)].all()), "each block sees its own tile"
        density = mask.density()
        assert family.contains(density), f"{case.name}: density {density:.4f}"
        assert case.target_density() - 1e-3 <= density <= case.target_density() + 0.03, case.name
    with pytest.raises(ValueError, match="tessera_default builds"):
        CaseSpec("Q384K384-H", DEFAULTS_SOURCE, HV_720P, 2, 0).build()  # text tokens: not its layout


def test_token_layouts() -> None:
    grid = LatentGrid("g", 3, 4, 5)
    coords = TokenLayout(grid).coords("cpu")
    p = 2 * 20 + 3 * 5 + 4  # frame-major raster: t = 2, y = 3, x = 4
    assert coords[p].tolist() == [2, 3, 4]
    tiled = TokenLayout(LatentGrid("h", 7, 9, 10), tiled=True)
    assert tiled.tile_counts == (2, 2, 2) and tiled.video_len == 8 * 384
    boxes = block_boxes(tiled, 384, "cpu")
    assert ((boxes.hi - boxes.lo + 1) == torch.tensor([6, 8, 8])).all(), "a 384-token block is one 6x8x8 tile"
    assert int(tiled.real("cpu").sum()) == 7 * 9 * 10


def test_determinism() -> None:
    case = CaseSpec("Q64K32", "clustered_permuted", GRID, 2, 7)
    assert torch.equal(case.build().blocks, case.build().blocks)
    other = CaseSpec("Q64K32", "clustered_permuted", GRID, 2, 8)
    assert not torch.equal(case.build().blocks, other.build().blocks)


def test_splits_never_share_a_source_seed_chunk() -> None:
    for source in ("sliding_tile", "temporal_heads", "importance_topk", "clustered_permuted", "text_sink", "ssta"):
        chunks = {split: {s // SEED_CHUNK for s in split_seeds(source, split, 3 * SEED_CHUNK)} for split in SPLITS}
        assert chunks["profiling"].isdisjoint(chunks["evaluation"])
        for split in SPLITS:
            assert all(split_of(source, s) == split for s in split_seeds(source, split, 40))
    evaluation = {(c.source, c.seed // SEED_CHUNK) for c in enumerate_cases("evaluation", seeds_per_combo=3)}
    profiling = {(c.source, c.seed // SEED_CHUNK) for c in enumerate_cases("profiling", seeds_per_combo=3)}
    assert evaluation.isdisjoint(profiling)


def test_evaluation_split_has_at_least_2000_cases() -> None:
    assert count_cases("evaluation") >= 2000
    names = [c.name for c in enumerate_cases("evaluation")]
    assert len(names) == count_cases("evaluation") == len(set(names))
    assert {c.family for c in enumerate_cases("evaluation", seeds_per_combo=1)} == {f.name for f in FAMILIES}


def test_infeasible_combinations_are_excluded_and_refused() -> None:
    fam = family_named("Q64K64-HD")
    assert not fam.feasible(HV_720P)  # text alone is most of a 4-6% budget there
    assert all(not (f.name == "Q64K64-HD" and g.name == "hv720p") for f, _, g in combinations())
    with pytest.raises(InvalidArgumentError):
        CaseSpec("Q64K64-HD", "sliding_tile", HV_720P, 2, 0).build()
    with pytest.raises(InvalidArgumentError):
        CaseSpec("Q384K384", "sliding_tile", GRID_TILES, 2, 0)  # not a source of that family


def test_select_blocks_takes_exact_budgets() -> None:
    gen = torch.Generator().manual_seed(0)
    score = torch.rand(20, 30, generator=gen, dtype=torch.float64)
    forced = torch.zeros(20, 30, dtype=torch.bool)
    forced[:, 0] = True
    empty = torch.zeros(20, dtype=torch.bool)
    empty[3] = True
    for mode in ("row", "global"):
        chosen = select_blocks(score, 97, mode, forced=forced, empty_rows=empty)
        assert int(chosen.sum()) == 97
        assert not bool(chosen[3].any())
        assert bool(chosen[~empty, 0].all())
    rows = select_blocks(score, 97, "row", forced=forced, empty_rows=empty).sum(1)
    assert int(rows.max() - rows[~empty].min()) <= 1  # row mode: equal quotas up to the remainder
    assert head_budgets(torch.tensor([0.1, 0.1]), torch.tensor([30, 5]), 200) == [30, 10]


def test_save_load_round_trip(tmp_path) -> None:
    cases = [CaseSpec("Q64K64-DD", "text_sink", GRID_TEXT, 2, 3), CaseSpec("Q128K128", "sliding_tile", GRID, 2, 4)]
    masks = [c.build() for c in cases]
    foreign = LogicalMask(torch.rand(1, 1, 5, 7, generator=torch.Generator().manual_seed(1)) < 0.3, 32, 48, 150, 300)
    from tessera_diffusers.corpus import CorpusEntry

    save_corpus(tmp_path, list(zip(cases, masks)) + [CorpusEntry(None, foreign, {"name": "dump", "source": "x"})])
    loaded = load_corpus(tmp_path)
    assert [e.case for e in loaded[:2]] == cases and loaded[2].case is None and loaded[2].info["source"] == "x"
    for entry, mask in zip(loaded, masks + [foreign]):
        assert torch.equal(entry.mask.blocks, mask.blocks)
        assert (entry.mask.block_q, entry.mask.block_kv, entry.mask.seq_len_q, entry.mask.seq_len_kv) == (
            mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv)
    # Packed bits: the stored array is an eighth of the block count (rounded up).
    with np.load(tmp_path / "masks.npz") as arrays:
        assert arrays["m000000"].nbytes == math.ceil(masks[0].blocks.numel() / 8)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["entries"][1]["sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidArgumentError):
        load_corpus(tmp_path)
