"""LogicalMask: constructors, validation, geometry helpers and debugging views."""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers import LogicalMask, MaskError, TesseraError, build_mask_state
from tessera_diffusers.testing import random_mask


def test_from_blocks_ranks_and_defaults():
    grid = torch.rand(5, 7) < 0.5
    m = LogicalMask.from_blocks(grid, 32, 16)
    assert m.blocks.shape == (1, 1, 5, 7)
    assert (m.seq_len_q, m.seq_len_kv) == (160, 112)
    m3 = LogicalMask.from_blocks(torch.rand(3, 5, 7) < 0.5, 32, 16, 150, 100)
    assert (m3.batch, m3.heads) == (1, 3)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"block_q": 24}, "block_q"),
        ({"block_q": 0}, "block_q"),
        ({"block_kv": 528}, "block_kv"),
        ({"block_kv": 16.0}, "block_kv"),
        ({"seq_len_q": 0}, "seq_len_q"),
        ({"seq_len_kv": -3}, "seq_len_kv"),
    ],
)
def test_bad_geometry_is_named(kwargs, argument):
    base = {"blocks": torch.ones(1, 1, 4, 4, dtype=torch.bool), "block_q": 16, "block_kv": 16, "seq_len_q": 64, "seq_len_kv": 64}
    base.update(kwargs)
    with pytest.raises(MaskError) as info:
        LogicalMask(**base)
    assert info.value.argument == argument
    assert isinstance(info.value, TesseraError)


def test_block_grid_must_match_sequence_lengths():
    with pytest.raises(MaskError, match=r"ceil\(100/16\)"):
        LogicalMask(torch.ones(1, 1, 6, 7, dtype=torch.bool), 16, 16, 100, 100)
    with pytest.raises(MaskError, match="torch.bool"):
        LogicalMask(torch.ones(1, 1, 7, 7), 16, 16, 100, 100)
    with pytest.raises(MaskError, match="4-D"):
        LogicalMask(torch.ones(7, 7, dtype=torch.bool), 16, 16, 100, 100)


def test_hunyuan_native_geometry_and_unequal_blocks_are_legal():
    m = LogicalMask.dense(113585, 113585, 384, 384)
    assert (m.num_blocks_q, m.num_blocks_kv) == (296, 296)
    m2 = LogicalMask.dense(75600, 75600, 64, 128)
    assert m2.block_sizes_kv()[-1].item() == 75600 - 590 * 128


def test_interactions_count_partial_blocks_exactly():
    m = random_mask(2, 3, 100, 90, 16, 32, density=0.5, seed=1)
    per = m.interactions()
    for b in range(2):
        for h in range(3):
            assert per[b, h].item() == int(m.to_dense(b, h).sum())
    assert m.effective_flops(2, 3, 64) == 4 * 64 * float(per.sum())


def test_broadcast_and_head_selection():
    m = random_mask(1, 4, 64, 64, 16, 16, seed=2)
    m.check_broadcast(3, 4)
    with pytest.raises(MaskError, match="mask head dim"):
        m.check_broadcast(1, 5)
    sub = m.select_heads(1, 3)
    assert torch.equal(sub.blocks, m.blocks[:, 1:3])
    assert m.expand(3, 4).blocks.shape == (3, 4, 4, 4)


def test_from_kv_blocks_and_csr_round_trip():
    m = random_mask(2, 3, 200, 170, 32, 16, density=0.4, seed=3)
    state = build_mask_state(m)
    again = LogicalMask.from_kv_blocks(state.kv_num_blocks, state.kv_indices, 32, 16, 200, 170)
    assert torch.equal(again.blocks, m.blocks)
    csr = LogicalMask.from_csr(
        state.row_offsets, state.compact_indices(), batch=2, heads=3, block_q=32, block_kv=16, seq_len_q=200, seq_len_kv=170
    )
    assert torch.equal(csr.blocks, m.blocks)
    with pytest.raises(MaskError, match="col_indices"):
        LogicalMask.from_csr(state.row_offsets, state.compact_indices()[:-1], batch=2, heads=3, block_q=32,
                             block_kv=16, seq_len_q=200, seq_len_kv=170)
    bad = state.compact_indices().clone()
    bad[0] = 99
    with pytest.raises(MaskError, match="out of range"):
        LogicalMask.from_csr(state.row_offsets, bad, batch=2, heads=3, block_q=32, block_kv=16, seq_len_q=200,
                             seq_len_kv=170)


def test_dense_view_and_picture():
    grid = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    m = LogicalMask.from_blocks(grid, 16, 16, 20, 40)
    dense = m.to_dense()
    assert dense.shape == (20, 40)
    assert dense[:16, :16].all() and not dense[:16, 16:32].any() and dense[:16, 32:].all()
    assert not dense[16:].any()
    text = m.to_string()
    assert text.splitlines()[1:] == ["#.#", "..."]
    assert "Q16K16" in repr(m) and "density=0.333" in repr(m)
    big = LogicalMask.dense(1 << 15, 1 << 15, 16, 16)
    with pytest.raises(MaskError, match="to_dense"):
        big.to_dense()
    assert len(big.to_string(max_cells=16).splitlines()) == 17
