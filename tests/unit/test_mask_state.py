"""MaskState: block-CSR and statistics against brute force."""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers import LogicalMask, Stat, build_mask_state
from tessera_diffusers.testing import random_mask


def brute_stats(blocks: torch.Tensor) -> dict[str, float]:
    rows = blocks.reshape(-1, blocks.shape[-1]).tolist()
    active = sum(map(sum, rows))
    in_long, runs, overlap = 0, 0, 0
    grid = blocks.reshape(-1, blocks.shape[-2], blocks.shape[-1]).tolist()
    for g in grid:
        for i, row in enumerate(g):
            for j, a in enumerate(row):
                if not a:
                    continue
                left = j > 0 and row[j - 1]
                right = j + 1 < len(row) and row[j + 1]
                in_long += left or right
                runs += not left
                overlap += i > 0 and g[i - 1][j]
    counts = [sum(r) for r in rows]
    mean = sum(counts) / len(counts)
    return {
        "density": active / blocks.numel(),
        "run_coverage": in_long / active if active else 0.0,
        "max_row_blocks": max(counts),
        "mean_row_blocks": mean,
        "mean_run_length": active / runs if runs else 0.0,
        "empty_row_fraction": counts.count(0) / len(counts),
        "row_imbalance": max(counts) / mean if mean else 0.0,
        "row_overlap": overlap / active if active else 0.0,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_csr_and_stats_match_brute_force(seed):
    m = random_mask(2, 3, 150, 230, 16, 32, density=0.35, seed=seed)
    state = build_mask_state(m)
    blocks = m.blocks
    assert torch.equal(state.kv_num_blocks, blocks.sum(-1).to(torch.int32))
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in blocks.shape[:3])).tolist():
        b, h, i = idx
        expected = torch.nonzero(blocks[b, h, i]).flatten().tolist()
        row = state.kv_indices[b, h, i].tolist()
        assert row[: len(expected)] == expected and all(x == -1 for x in row[len(expected):])
    assert state.row_offsets[-1].item() == int(blocks.sum())
    assert torch.equal(state.compact_indices(), torch.nonzero(blocks)[:, -1].to(torch.int32))
    got = state.host_stats()
    for name, value in brute_stats(blocks).items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_empty_mask_has_zero_statistics():
    m = LogicalMask(torch.zeros(1, 2, 4, 5, dtype=torch.bool), 16, 16, 64, 80)
    state = build_mask_state(m)
    assert state.stat(Stat.RUN_COVERAGE) == 0.0
    assert state.stat(Stat.DENSITY) == 0.0
    assert state.stat(Stat.MEAN_RUN_LENGTH) == 0.0
    assert state.stat(Stat.EMPTY_ROW_FRACTION) == 1.0
    assert bool((state.kv_indices == -1).all())


def test_runs_of_the_design_example():
    row = torch.zeros(1, 1, 1, 12, dtype=torch.bool)
    row[..., [2, 3, 4, 9]] = True  # runs [2, 4] and [9, 9]
    state = build_mask_state(LogicalMask(row, 16, 16, 16, 192))
    assert state.stat(Stat.RUN_COVERAGE) == pytest.approx(3 / 4)
    assert state.stat(Stat.MEAN_RUN_LENGTH) == pytest.approx(2.0)


def test_row_union_ratios_match_brute_force():
    """The measured query-axis waste: r block rows computing the union of their KV blocks."""
    mask = random_mask(2, 3, 1000, 900, 16, 32, density=0.3, seed=4)
    state = build_mask_state(mask)
    ratios = state.row_union_ratios((1, 3, 4, 8))
    blocks = mask.blocks.float()
    active = blocks.sum().item()
    assert ratios[1] == 1.0
    for r in (3, 4, 8):
        # every query tile of r rows (a partial last tile too, as the kernels pad it) computes the union
        expected = sum(r * blocks[b, h, i:i + r].amax(0).sum().item()
                       for b in range(blocks.shape[0]) for h in range(blocks.shape[1])
                       for i in range(0, blocks.shape[2], r))
        assert abs(ratios[r] - expected / active) < 1e-9, (r, ratios[r], expected / active)
    assert build_mask_state(random_mask(1, 1, 64, 64, 16, 16, density=0.0, empty_rows=False)).row_union_ratios((4,))[4] == 1.0
