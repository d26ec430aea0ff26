"""Hostile inputs: non-finite q/k/v through the executor and the oracle, malformed index tensors
and numpy arrays given as masks, and requests too large for the fp32 oracle."""

from __future__ import annotations

import math

import pytest
import torch

from tessera_diffusers import (
    InvalidArgumentError,
    KvLayout,
    LogicalMask,
    MaskError,
    PhysicalPlan,
    TaskOrganization,
    Traversal,
    build_mask_state,
    prepare,
    reference,
)
from tessera_diffusers.catalog import reference_kernel
from tessera_diffusers.errors import describe_tensor
from tessera_diffusers.executor import merge_splits, run_prepared
from tessera_diffusers.testing import random_mask

np = pytest.importorskip("numpy")

HEAD_DIM = 16
SCALE = 0.25


def executor_plans(block_q: int, block_kv: int) -> list[PhysicalPlan]:
    """Direct, coarsened, refined, packed and grouped plans, with 1 and 3 splits."""
    plans = []
    for tile_q, tile_kv in ((64, 64), (128, 64), (16, 32)):
        for layout in KvLayout:
            for splits in (1, 3):
                kernel = reference_kernel(HEAD_DIM, "fp32", tile_q, tile_kv)
                plan = PhysicalPlan(block_q, block_kv, layout, TaskOrganization(Traversal.LONGEST_FIRST, splits), kernel)
                if layout is KvLayout.PACKED and plan.slots_per_tile < 2:
                    continue
                if plan.q_units_per_tile * plan.slots_per_tile > 64:
                    continue
                plans.append(plan)
                if layout is KvLayout.PACKED and tile_q > block_q:
                    plans.append(plan.grouped())
    return plans


def non_finite_pattern(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"nan": x.isnan(), "+inf": x.isposinf(), "-inf": x.isneginf(), "zero": x == 0}


def assert_same_function(out, lse, want, want_lse, name):
    """Same NaN / +inf / -inf / 0 entries exactly, finite values to fp32 accuracy."""
    for tensor, expected, what in ((out, want, "out"), (lse, want_lse, "lse")):
        got, exp = non_finite_pattern(tensor), non_finite_pattern(expected)
        for kind in ("nan", "+inf", "-inf"):
            assert torch.equal(got[kind], exp[kind]), f"{name}: {what} {kind} entries differ"
        finite = torch.isfinite(expected)
        torch.testing.assert_close(tensor[finite], expected[finite], atol=1e-4, rtol=1e-4, msg=f"{name}: {what}")


def check_executor_against_oracle(q, k, v, mask):
    want, want_lse = reference.attention(q, k, v, mask, SCALE, True)
    state = build_mask_state(mask)
    plans = executor_plans(mask.block_q, mask.block_kv)
    assert len(plans) >= 6
    for plan in plans:
        out, lse = run_prepared(prepare(plan, state), q, k, v, SCALE, True)
        assert_same_function(out, lse, want, want_lse, plan.name)
    return want, want_lse


GEOMETRIES = ((16, 16), (128, 64))  # coarsened / packed / grouped plans; direct / refined plans


def poisoned_problem(seed: int = 0, block_q: int = 16, block_kv: int = 16):
    mask = random_mask(1, 2, block_q * 9 + 5, block_kv * 7 - 5, block_q, block_kv, density=0.4, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, s, 2, HEAD_DIM, generator=gen) for s in (mask.seq_len_q, mask.seq_len_kv, mask.seq_len_kv))
    return mask, q, k, v


def active_row(mask: LogicalMask, h: int = 0) -> int:
    return int(torch.nonzero(mask.to_dense(0, h).any(-1))[3])


def empty_rows(mask: LogicalMask, h: int = 0) -> torch.Tensor:
    return ~mask.to_dense(0, h).any(-1)


# ------------------------------------------------------------------ 1. non-finite inputs


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("poison", ["inf_in_q", "huge_fp32", "one_inf_key"])
def test_plus_inf_score_gives_nan_row_and_plus_inf_lse_in_every_plan(poison, geometry):
    mask, q, k, v = poisoned_problem(1, *geometry)
    row = active_row(mask)
    hit = torch.zeros(mask.seq_len_q, dtype=torch.bool)
    hit[row] = True
    if poison == "inf_in_q":  # every score of the row is +-inf
        q[0, row, 0, 0] = math.inf
    elif poison == "huge_fp32":  # finite inputs whose products overflow fp32
        q[0, row, 0] *= 1e30
        k[0, :, 0] *= 1e20
    else:  # exactly one +inf score in each row that sees the key, the others finite
        q = q.abs() + 0.1
        key = int(torch.nonzero(mask.to_dense(0, 0)[row])[0])
        k[0, key, 0] = 3e38
        hit = mask.to_dense(0, 0)[:, key]
    want, want_lse = check_executor_against_oracle(q, k, v, mask)
    # Dense attention: softmax over a row holding +inf is inf/inf = NaN; logsumexp is +inf.
    assert bool(want[0, hit, 0].isnan().all()) and bool((want_lse[0, 0, hit] == math.inf).all())
    assert bool(torch.isfinite(want[0, ~hit, 0]).all())


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_score_gives_nan_row_and_nan_lse_in_every_plan(where, geometry):
    mask, q, k, v = poisoned_problem(2, *geometry)
    dense = mask.to_dense(0, 0)
    if where == "q":
        row = active_row(mask)
        q[0, row, 0, 3] = math.nan
        hit = torch.zeros(mask.seq_len_q, dtype=torch.bool)
        hit[row] = True
    else:
        key = int(torch.nonzero(dense.any(0))[0])
        k[0, key, 0, 3] = math.nan
        hit = dense[:, key]  # only rows whose E(M) holds the key see it
    want, want_lse = check_executor_against_oracle(q, k, v, mask)
    assert bool(want[0, hit, 0].isnan().all()) and bool(want_lse[0, 0, hit].isnan().all())
    assert bool(torch.isfinite(want[0, ~hit, 0]).all())


def test_nan_value_of_an_active_key_gives_nan_rows_and_empty_rows_stay_zero():
    mask, q, k, v = poisoned_problem(3)
    blocks = mask.blocks.clone()
    blocks[..., 2] = blocks.any(-1)  # a sink column: every non-empty row sees KV block 2
    mask = LogicalMask(blocks, 16, 16, mask.seq_len_q, mask.seq_len_kv)
    v[0, 2 * 16 + 5, 0, 7] = math.nan
    want, want_lse = check_executor_against_oracle(q, k, v, mask)
    empty = empty_rows(mask)
    assert bool(empty.any()) and bool((~empty).any())
    assert bool(want[0, ~empty, 0, 7].isnan().all()) and bool(torch.isfinite(want_lse[0, 0, ~empty]).all())
    assert bool((want[0, empty, 0] == 0).all()) and bool((want_lse[0, 0, empty] == -math.inf).all())


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_minus_inf_scores_weigh_zero_and_an_all_minus_inf_row_is_empty(geometry):
    mask, q, k, v = poisoned_problem(4, *geometry)
    q = q.abs() + 0.1  # positive queries: a key of -3e38 everywhere scores -inf against every row
    row = active_row(mask)
    dense = mask.to_dense(0, 0)
    keys = torch.nonzero(dense[row]).flatten()
    k[0, keys[0], 0] = -3e38
    want, want_lse = check_executor_against_oracle(q, k, v, mask)
    # Key keys[0] is as good as masked out for every row (when the row has another key).
    masked = dense.clone()
    masked[:, keys[0]] = False
    ok = masked.any(-1)
    blocks_without = torch.zeros(mask.seq_len_q, mask.seq_len_kv)
    blocks_without[~masked] = -math.inf
    s = q[0, :, 0] @ k[0, :, 0].T * SCALE + blocks_without
    torch.testing.assert_close(want[0, ok, 0], torch.softmax(s[ok], -1) @ v[0, :, 0], atol=1e-5, rtol=1e-5)
    # Now every active key of `row` scores -inf: the row is empty (0, -inf), not NaN.
    k[0, keys, 0] = -3e38
    want, want_lse = check_executor_against_oracle(q, k, v, mask)
    assert bool((want[0, row, 0] == 0).all()) and want_lse[0, 0, row] == -math.inf


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_empty_rows_give_zero_and_minus_inf_next_to_poisoned_rows(geometry):
    mask, q, k, v = poisoned_problem(5, *geometry)
    q[0, active_row(mask), 0, 0] = math.inf
    q[0, active_row(mask, 1), 1, 0] = math.nan
    want, want_lse = check_executor_against_oracle(q, k, v, mask)
    for h in range(2):
        empty = empty_rows(mask, h)
        assert bool(empty.any())
        assert bool((want[0, empty, h] == 0).all()) and bool((want_lse[0, h, empty] == -math.inf).all())


def test_columns_past_the_sequence_read_zeros_not_the_first_token():
    """A tile's columns past Skv are zero-filled (as the kernels' loads are), so a NaN in a token that
    no tile reads stays out of every row."""
    mask, q, k, v = poisoned_problem(6)
    blocks = mask.blocks.clone()
    blocks[..., :4] = False  # nobody reads KV tokens 0-63 (no tile of up to 64 columns holds them) ...
    blocks[..., -1] |= blocks.any(-1)  # ... and every non-empty row reads the partial last block
    mask = LogicalMask(blocks, 16, 16, mask.seq_len_q, mask.seq_len_kv)
    v[0, 0], k[0, 0] = math.nan, math.nan
    want, _ = check_executor_against_oracle(q, k, v, mask)
    assert bool(torch.isfinite(want).all())


def test_merge_propagates_non_finite_parts():
    o = torch.randn(2, 4, 8)
    lse = torch.tensor([[0.5, math.inf, math.nan, -math.inf], [1.0, 2.0, 0.3, -math.inf]])
    o[0, 1:3] = math.nan  # what a split that saw +inf / NaN writes
    o[:, 3] = 0
    out, merged = merge_splits(o, lse)
    assert bool(torch.isfinite(out[0]).all()) and math.isfinite(merged[0])
    assert bool(out[1].isnan().all()) and merged[1] == math.inf
    assert bool(out[2].isnan().all()) and math.isnan(merged[2])
    assert bool((out[3] == 0).all()) and merged[3] == -math.inf


# ------------------------------------------------------------------ 2. index-tensor constructors


def kv_lists():
    mask = random_mask(1, 2, 100, 90, 16, 16, density=0.4, seed=7)
    state = build_mask_state(mask)
    return mask, state.kv_num_blocks, state.kv_indices


@pytest.mark.parametrize("field, value", [("block_kv", 0), ("block_q", 0), ("seq_len_kv", 0), ("block_kv", 16.0)])
def test_from_kv_blocks_validates_geometry_before_dividing(field, value):
    _, counts, indices = kv_lists()
    args = {"block_q": 16, "block_kv": 16, "seq_len_q": 100, "seq_len_kv": 90}
    args[field] = value
    with pytest.raises(MaskError) as info:
        LogicalMask.from_kv_blocks(counts, indices, **args)
    assert info.value.argument == field


@pytest.mark.parametrize("which", ["kv_num_blocks", "kv_indices"])
def test_from_kv_blocks_refuses_float_index_tensors(which):
    _, counts, indices = kv_lists()
    tensors = {"kv_num_blocks": counts, "kv_indices": indices}
    tensors[which] = tensors[which].float() + 0.7  # 1.7 must not become block 1
    with pytest.raises(MaskError, match="float32") as info:
        LogicalMask.from_kv_blocks(tensors["kv_num_blocks"], tensors["kv_indices"], 16, 16, 100, 90)
    assert info.value.argument == which


def test_from_kv_blocks_refuses_numpy_and_bad_counts():
    mask, counts, indices = kv_lists()
    with pytest.raises(MaskError, match=r"numpy\.ndarray\(shape=\(1, 2, 7\)") as info:
        LogicalMask.from_kv_blocks(counts.numpy(), indices, 16, 16, 100, 90)
    assert info.value.argument == "kv_num_blocks" and "tensor(" not in str(info.value)
    with pytest.raises(MaskError, match="kv_num_blocks"):
        LogicalMask.from_kv_blocks(counts + indices.shape[-1], indices, 16, 16, 100, 90)
    with pytest.raises(MaskError, match="kv_num_blocks"):  # 7 query blocks, lengths for 8
        LogicalMask.from_kv_blocks(counts, indices, 16, 16, 120, 90)
    with pytest.raises(MaskError, match="one device"):
        LogicalMask.from_kv_blocks(counts, indices.to("meta"), 16, 16, 100, 90)
    assert torch.equal(LogicalMask.from_kv_blocks(counts.int(), indices.int(), 16, 16, 100, 90).blocks, mask.blocks)


def csr_args():
    mask = random_mask(2, 3, 200, 170, 32, 16, density=0.4, seed=3)
    state = build_mask_state(mask)
    kwargs = {"batch": 2, "heads": 3, "block_q": 32, "block_kv": 16, "seq_len_q": 200, "seq_len_kv": 170}
    return mask, state.row_offsets, state.compact_indices(), kwargs


@pytest.mark.parametrize("which", ["row_offsets", "col_indices"])
def test_from_csr_refuses_float_index_tensors(which):
    _, offsets, cols, kwargs = csr_args()
    tensors = {"row_offsets": offsets, "col_indices": cols}
    tensors[which] = tensors[which].double()
    with pytest.raises(MaskError, match="float64") as info:
        LogicalMask.from_csr(tensors["row_offsets"], tensors["col_indices"], **kwargs)
    assert info.value.argument == which


@pytest.mark.parametrize("field, value", [("batch", 2.0), ("heads", 0), ("heads", True), ("batch", "2")])
def test_from_csr_refuses_non_int_batch_and_heads(field, value):
    _, offsets, cols, kwargs = csr_args()
    kwargs[field] = value
    with pytest.raises(MaskError) as info:
        LogicalMask.from_csr(offsets, cols, **kwargs)
    assert info.value.argument == field


def test_from_csr_refuses_numpy_and_split_devices():
    mask, offsets, cols, kwargs = csr_args()
    with pytest.raises(MaskError, match=r"numpy\.ndarray\(shape=") as info:
        LogicalMask.from_csr(offsets, cols.numpy(), **kwargs)
    assert info.value.argument == "col_indices"
    with pytest.raises(MaskError, match="one device"):
        LogicalMask.from_csr(offsets.to("meta"), cols, **kwargs)
    assert torch.equal(LogicalMask.from_csr(offsets.int(), cols.int(), **kwargs).blocks, mask.blocks)


# ------------------------------------------------------------------ 3. numpy masks


def test_numpy_mask_is_called_a_numpy_array():
    grid = np.ones((1, 1, 4, 4), dtype=bool)
    with pytest.raises(MaskError, match=r"numpy\.ndarray\(shape=\(1, 1, 4, 4\), dtype=bool\)") as info:
        LogicalMask(grid, 16, 16, 64, 64)
    assert "tensor(" not in str(info.value)
    with pytest.raises(MaskError, match=r"numpy\.ndarray\(shape=\(4, 4\), dtype=bool\)") as info:
        LogicalMask.from_blocks(np.ones((4, 4), dtype=bool), 64)
    assert "tensor(" not in str(info.value)


def test_describe_tensor_never_prints_a_large_value():
    big = np.zeros((2000, 2000), dtype=np.float32)
    assert describe_tensor(big) == "numpy.ndarray(shape=(2000, 2000), dtype=float32)"
    assert describe_tensor(torch.zeros(2, 3)) == "tensor(shape=(2, 3), dtype=torch.float32, device=cpu)"
    for value in (list(range(100_000)), "x" * 10_000, {i: i for i in range(10_000)}):
        text = describe_tensor(value)
        assert text.startswith(type(value).__name__ + " ") and len(text) <= 100, text


# ------------------------------------------------------------------ 4. requests too large for the oracle


def huge_request(device: str):
    seq, heads, block = 1 << 26, 24, 512
    if device == "meta":
        q = torch.empty(1, seq, heads, 128, dtype=torch.bfloat16, device="meta")
    else:  # zero-stride: a 1 x 64M x 24 x 128 view of 128 elements
        q = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16).expand(1, seq, heads, 128)
    n = seq // block
    blocks = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(1, 1, n, n)
    return q, LogicalMask(blocks, block, block, seq, seq)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_reference_refuses_a_huge_request_before_allocating(device):
    q, mask = huge_request(device)
    with pytest.raises(InvalidArgumentError, match="GiB") as info:
        reference.attention(q, q, q, mask)
    assert info.value.argument == "q, k"
    assert "native plan on CUDA" in str(info.value) and "MAX_REFERENCE_BYTES" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="GiB"):
        reference.dense_attention(q, q, q)


def test_reference_bounds_the_chunk_not_the_dense_product():
    # Wan 720p: the dense scores would be 12 x 75600^2 fp32 = 255 GiB, the chunked oracle needs < 2 GiB.
    q = torch.empty(1, 75600, 12, 128, dtype=torch.bfloat16, device="meta")
    mask = LogicalMask(torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, 1182, 1182), 64, 64, 75600, 75600)
    need = reference.reference_bytes(q, q, mask)
    assert need < 2 << 30 < reference.MAX_REFERENCE_BYTES


def test_reference_limit_is_the_module_constant(monkeypatch):
    mask, q, k, v = poisoned_problem(8)
    reference.attention(q, k, v, mask)
    monkeypatch.setattr(reference, "MAX_REFERENCE_BYTES", reference.reference_bytes(q, k, mask) - 1)
    with pytest.raises(InvalidArgumentError, match="q, k"):
        reference.attention(q, k, v, mask)
