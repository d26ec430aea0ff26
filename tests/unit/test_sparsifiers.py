"""Sparsifiers and the tile layout, on the CPU: token order, tile -> block masks, pooling, the SSTA
window / top-k rule, the adaptive choice, static masks and dense warm-up."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tessera_diffusers import InvalidArgumentError, LogicalMask, MaskError
from tessera_diffusers.sparsifiers import (
    AdaptiveSparsifier,
    DenseWarmup,
    LatentGrid,
    SSTASparsifier,
    StaticSparsifier,
    all_active,
    ssta_64,
    ssta_384,
    tile_layout,
    top_k_for_block_density,
    top_k_for_density,
)

GRIDS = [LatentGrid(5, 9, 10), LatentGrid(4, 8, 8), LatentGrid(3, 7, 13), LatentGrid(1, 8, 16)]
TILES = [(2, 4, 4), (1, 4, 4), (4, 4, 4), (3, 2, 8)]


def raster_coords(grid: LatentGrid) -> torch.Tensor:
    f, h, w = torch.meshgrid(
        torch.arange(grid.frames), torch.arange(grid.height), torch.arange(grid.width), indexing="ij"
    )
    return torch.stack([f, h, w], -1).reshape(-1, 3)


def brute_tile_of(grid: LatentGrid, tile) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Tile id (by the documented order: full tiles first, then partial ones, each in raster order
    over the tile grid) of every raster token, computed with plain loops."""
    counts = [math.ceil(n / t) for n, t in zip(grid.as_tuple(), tile)]
    full = [n // t for n, t in zip(grid.as_tuple(), tile)]
    all_tiles = list(itertools.product(*(range(c) for c in counts)))
    ordered = [t for t in all_tiles if all(t[i] < full[i] for i in range(3))]
    ordered += [t for t in all_tiles if not all(t[i] < full[i] for i in range(3))]
    rank = {t: r for r, t in enumerate(ordered)}
    coords = raster_coords(grid)
    ids = [rank[tuple(int(c) // s for c, s in zip(row, tile))] for row in coords]
    return torch.tensor(ids), ordered


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
def test_layout_orders_tokens_tile_by_tile(grid, tile):
    layout = tile_layout(grid, tile)
    t = layout.tensors("cpu")
    seq = grid.num_tokens
    assert torch.equal(torch.sort(t.order).values, torch.arange(seq))
    assert torch.equal(t.order[t.inverse], torch.arange(seq))

    tile_of_raster, ordered = brute_tile_of(grid, layout.tile)
    # Tiles appear in the documented order, each as one contiguous run, raster order inside.
    assert torch.equal(tile_of_raster[t.order], t.token_tile)
    assert torch.all(t.token_tile[1:] >= t.token_tile[:-1])
    for tile_id in range(layout.num_tiles):
        members = t.order[t.token_tile == tile_id]
        assert torch.all(members[1:] > members[:-1])
    assert [tuple(c) for c in t.tile_coords.tolist()] == ordered
    # Full tiles first, each exactly one tile volume.
    assert torch.all(t.tile_sizes[: layout.num_full_tiles] == layout.tile_volume)

    x = torch.randn(2, seq, 3, 4)
    assert torch.equal(layout.to_raster(layout.to_layout(x)), x)


def test_raster_layout_is_identity_and_divisible_grid_is_aligned():
    grid = LatentGrid(4, 8, 8)
    assert tile_layout(grid, None).is_identity()
    aligned = tile_layout(grid, (2, 4, 4))
    assert aligned.aligned and aligned.block == 32 and aligned.num_blocks == aligned.num_tiles
    assert not tile_layout(LatentGrid(5, 9, 10), (2, 4, 4)).aligned


@pytest.mark.parametrize(
    "grid,tile",
    [(LatentGrid(5, 9, 10), (2, 4, 4)), (LatentGrid(3, 7, 13), (3, 2, 8)), (LatentGrid(4, 8, 8), (2, 4, 4))],
    ids=str,
)
def test_tiles_to_mask_is_exact_on_full_tiles_and_a_superset_elsewhere(grid, tile):
    layout = tile_layout(grid, tile)
    gen = torch.Generator().manual_seed(0)
    n_t = layout.num_tiles
    tile_mask = torch.rand(2, 3, n_t, n_t, generator=gen) < 0.2
    mask = layout.tiles_to_mask(tile_mask)
    assert isinstance(mask, LogicalMask) and mask.block_q == layout.block
    token_tile = layout.tensors("cpu").token_tile
    full_tokens = layout.num_full_tiles * layout.tile_volume
    for b, h in [(0, 0), (1, 2)]:
        want = tile_mask[b, h][token_tile][:, token_tile]  # token-level tile mask
        got = mask.to_dense(b, h)
        assert torch.all(got | ~want), "a block mask must keep every pair its tile mask keeps"
        if layout.block == layout.tile_volume:
            assert torch.equal(got[:full_tokens, :full_tokens], want[:full_tokens, :full_tokens])
        if layout.aligned:
            assert torch.equal(got, want)


def test_pool_tiles_is_the_mean_over_each_tile():
    grid, tile = LatentGrid(5, 9, 10), (2, 4, 4)
    layout = tile_layout(grid, tile)
    x_raster = torch.randn(2, grid.num_tokens, 3, 5, dtype=torch.float64)
    pooled = layout.pool_tiles(layout.to_layout(x_raster).to(torch.float32))
    tile_of_raster, _ = brute_tile_of(grid, layout.tile)
    for tile_id in [0, 7, layout.num_full_tiles, layout.num_tiles - 1]:
        want = x_raster[:, tile_of_raster == tile_id].mean(1)  # [B, H, D]
        torch.testing.assert_close(pooled[:, :, tile_id], want.to(torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [(3, 3, 3), (1, 3, 3), (3, 1, 5)])
def test_window_is_clamped_at_the_borders(window):
    layout = tile_layout(LatentGrid(10, 12, 20), (2, 4, 4))  # tile grid 5 x 3 x 5
    mask = layout.window_mask(window, "cpu")
    counts = [min(w, n) for w, n in zip(window, layout.tiles_per_axis)]
    assert torch.all(mask.sum(1) == math.prod(counts))
    coords = layout.tensors("cpu").tile_coords.tolist()
    for i in [0, 5, len(coords) - 1]:
        lo = [min(max(c - w // 2, 0), n - min(w, n)) for c, w, n in zip(coords[i], window, layout.tiles_per_axis)]
        want = [
            all(lo[a] <= cj[a] < lo[a] + min(window[a], layout.tiles_per_axis[a]) for a in range(3)) for cj in coords
        ]
        assert mask[i].tolist() == want


def test_ssta_top_k_picks_the_best_scores_outside_the_window():
    grid = LatentGrid(8, 16, 16)  # 4 x 4 x 4 tiles of 2 x 4 x 4
    sparsifier = SSTASparsifier(tile=(2, 4, 4), window=(1, 3, 3), top_k=10, lam=1.0, halve_top_k_at_frames=0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, grid.num_tokens, 2, 8, generator=gen)
    k = torch.randn(1, grid.num_tokens, 2, 8, generator=gen)
    layout = sparsifier.layout(grid)
    tiles = sparsifier.tile_mask(q, k, grid)
    window = layout.window_mask((1, 3, 3), "cpu")
    qp = torch.nn.functional.normalize(layout.pool_tiles(q), dim=-1)
    kp = torch.nn.functional.normalize(layout.pool_tiles(k), dim=-1)
    cos = qp @ kp.transpose(-1, -2)  # lam = 1: pure query-key similarity
    for h in range(2):
        for i in [0, 13, 63]:
            outside = [j for j in range(layout.num_tiles) if not window[i, j]]
            best = sorted(outside, key=lambda j: -float(cos[0, h, i, j]))[:10]
            want = set(best) | {j for j in range(layout.num_tiles) if window[i, j]}
            assert set(torch.nonzero(tiles[0, h, i]).flatten().tolist()) == want
    assert torch.all(tiles.sum(-1) == window[0].sum() + 10)


def test_ssta_redundancy_term_prefers_distinct_keys():
    """With lam = 0 only key redundancy counts: the tiles whose pooled keys are least similar to
    the others are chosen, for every query tile alike."""
    grid = LatentGrid(1, 8, 32)  # 8 tiles of 1 x 4 x 8 on a 1 x 2 x 4 tile grid
    sparsifier = SSTASparsifier(tile=(1, 4, 8), window=(1, 1, 1), top_k=1, lam=0.0, halve_top_k_at_frames=0)
    layout = sparsifier.layout(grid)
    base = torch.randn(1, 1, 1, 16)
    k_tiles = base.expand(1, layout.num_tiles, 1, 16).clone()
    k_tiles[:, 5] = -base  # one tile unlike the others
    assert layout.aligned
    k = k_tiles.repeat_interleave(layout.tile_volume, 1)  # [1, S, 1, 16] in tile order
    q = torch.randn_like(k)
    tiles = sparsifier.tile_mask(q, k, grid)
    assert torch.all(tiles[0, 0, [i for i in range(8) if i != 5], 5])


def test_ssta_defaults_match_hunyuan_video15_at_720p():
    grid = LatentGrid(31, 45, 80)
    sparsifier = ssta_384()
    layout = sparsifier.layout(grid)
    assert (layout.num_tiles, layout.block, sparsifier.effective_top_k(grid)) == (360, 384, 32)
    assert sparsifier.effective_top_k(LatentGrid(33, 45, 80)) == 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, grid.num_tokens, 1, 8, generator=gen)
    k = torch.randn(1, grid.num_tokens, 1, 8, generator=gen)
    mask = sparsifier(q, k, layer=0, step=0, grid=grid)
    assert (mask.block_q, mask.num_blocks_q, mask.seq_len_q) == (384, 291, 111_600)
    tiles = sparsifier.tile_mask(q, k, grid)
    assert torch.all(tiles.sum(-1) == 27 + 32)
    assert abs(float(tiles.float().mean()) - sparsifier.expected_density(grid)) < 1e-6
    # The 64-token variant keeps the token budget.
    small = ssta_64()
    assert small.layout(grid).block == 64 and small.effective_top_k(grid) == 192


def test_top_k_for_block_density_hits_the_block_budget():
    grid = LatentGrid(13, 25, 36)  # 4 x 4 x 4 tiles leave partial tiles on every axis
    base = SSTASparsifier(tile=(4, 4, 4), window=(1, 3, 3))
    top_k = top_k_for_block_density(base, grid, 0.15)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, grid.num_tokens, 4, 32, generator=gen)
    k = torch.randn(1, grid.num_tokens, 4, 32, generator=gen)

    def density(t: int) -> float:
        return SSTASparsifier(tile=(4, 4, 4), window=(1, 3, 3), top_k=t)(q, k, layer=0, step=0, grid=grid).density()

    assert abs(density(top_k) - 0.15) < 0.02
    assert abs(density(top_k) - 0.15) <= abs(density(top_k + 4) - 0.15)
    tile_level = SSTASparsifier(tile=(4, 4, 4), window=(1, 3, 3), top_k=top_k).expected_density(grid)
    assert tile_level < density(top_k)  # the union over border tiles makes blocks denser than tiles


def test_top_k_for_density_hits_the_budget():
    grid = LatentGrid(21, 45, 80)
    base = SSTASparsifier(window=(1, 3, 3))
    top_k = top_k_for_density(base, grid, 0.10)
    tuned = SSTASparsifier(window=(1, 3, 3), top_k=top_k)
    assert abs(tuned.expected_density(grid) - 0.10) < 1.0 / tuned.layout(grid).num_tiles


def local_qk(grid: LatentGrid, heads_local: int, heads_flat: int, seed: int = 0):
    """q, k in raster order where some heads attend locally (sharp, position-coded) and the rest
    uniformly (all-equal keys)."""
    gen = torch.Generator().manual_seed(seed)
    seq = grid.num_tokens
    pos = raster_coords(grid).to(torch.float32)
    freqs = torch.randn(3, 16, generator=gen)
    code = torch.cat([torch.sin(pos @ freqs), torch.cos(pos @ freqs)], -1) * 4.0  # [S, 32]
    local = code[None, :, None, :].expand(1, seq, heads_local, 32)
    flat_q = torch.randn(1, seq, heads_flat, 32, generator=gen) * 0.01
    flat_k = torch.zeros(1, seq, heads_flat, 32)
    return torch.cat([local, flat_q], 2), torch.cat([local, flat_k], 2)


def test_adaptive_gives_sharp_heads_less_density_and_keeps_the_diagonal():
    grid = LatentGrid(4, 16, 16)
    sparsifier = AdaptiveSparsifier(
        tile=(2, 8, 8),
        block_sizes=(32, 64, 128),
        block_costs=(1.0, 1.0, 1.0),
        mass=0.8,
        min_density=0.02,
        max_density=0.9,
    )
    q, k = local_qk(grid, heads_local=1, heads_flat=1)
    layout = sparsifier.layout(grid)
    q, k = layout.to_layout(q), layout.to_layout(k)
    decision, _ = sparsifier.decide(q, k, grid)
    assert decision.block in (32, 64, 128)
    assert float(decision.density[0, 0]) < float(decision.density[0, 1])
    mask = sparsifier(q, k, layer=0, step=0, grid=grid)
    assert mask.block_q == decision.block and mask.seq_len_q == grid.num_tokens
    assert torch.all(mask.blocks[0, :].diagonal(dim1=-2, dim2=-1))
    kept = mask.blocks.float().mean(-1)  # [B, H, nB]
    assert float(kept[0, 0].mean()) < float(kept[0, 1].mean())


def test_adaptive_geometry_follows_block_costs():
    grid = LatentGrid(4, 16, 16)
    q, k = local_qk(grid, 2, 0)
    for costs, expected in [((0.1, 1.0, 1.0), 32), ((1.0, 1.0, 0.1), 128)]:
        sparsifier = AdaptiveSparsifier(tile=(2, 8, 8), block_sizes=(32, 64, 128), block_costs=costs)
        decision, _ = sparsifier.decide(q, k, grid)
        assert decision.block == expected
        assert min(decision.costs, key=decision.costs.get) == expected


def test_static_sparsifier_returns_one_mask_object_per_grid():
    grid = LatentGrid(2, 4, 8)
    calls = []

    def factory(g):
        calls.append(g)
        return LogicalMask.dense(g.num_tokens, g.num_tokens, 16, 16)

    sparsifier = StaticSparsifier(factory, tile=(1, 4, 4))
    q = torch.randn(1, grid.num_tokens, 2, 8)
    first = sparsifier(q, q, layer=0, step=0, grid=grid)
    assert sparsifier(q, q, layer=3, step=9, grid=grid) is first and len(calls) == 1
    with pytest.raises(MaskError, match="sequence lengths"):
        StaticSparsifier(LogicalMask.dense(32, 32, 16, 16))(q, q, layer=0, step=0, grid=LatentGrid(2, 4, 5))
    assert all_active((1, 4, 4))(q, q, layer=0, step=0, grid=grid).density() == 1.0


def test_dense_warmup_is_dense_for_early_steps_and_layers():
    inner = all_active((1, 4, 4))
    warm = DenseWarmup(inner, steps=2, layers=1)
    grid = LatentGrid(2, 4, 8)
    q = torch.randn(1, grid.num_tokens, 2, 8)
    assert warm(q, q, layer=3, step=1, grid=grid) is None
    assert warm(q, q, layer=0, step=5, grid=grid) is None
    assert isinstance(warm(q, q, layer=1, step=2, grid=grid), LogicalMask)
    assert warm.layout(grid) == inner.layout(grid)


@pytest.mark.parametrize(
    "make,argument",
    [
        (lambda: SSTASparsifier(tile=(0, 8, 8)), "tile[0]"),
        (lambda: SSTASparsifier(top_k=-1), "top_k"),
        (lambda: SSTASparsifier(lam=1.5), "lam"),
        (lambda: AdaptiveSparsifier(block_sizes=(64, 96)), "block_sizes"),
        (lambda: AdaptiveSparsifier(block_costs=(1.0,)), "block_costs"),
        (lambda: DenseWarmup(all_active(), steps=-1), "steps"),
        (lambda: LatentGrid(0, 4, 4), "latent grid[0]"),
        (lambda: tile_layout(LatentGrid(2, 4, 4), (1, 4, 4), block=40), "block"),
    ],
)
def test_invalid_arguments_name_the_argument(make, argument):
    with pytest.raises(InvalidArgumentError) as info:
        make()
    assert info.value.argument == argument


def test_sparsifier_checks_token_count():
    grid = LatentGrid(2, 4, 8)
    q = torch.randn(1, grid.num_tokens + 1, 2, 8)
    with pytest.raises(InvalidArgumentError, match="S = 64"):
        SSTASparsifier(tile=(1, 4, 4))(q, q, layer=0, step=0, grid=grid)
