"""Public API: results on the reference path, plan forcing, caching and every user error."""

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
    Runtime,
    TaskOrganization,
    TesseraError,
    block_sparse_attention,
    reference,
)
from tessera_diffusers.catalog import reference_kernel
from tessera_diffusers.testing import random_mask


def inputs(b=1, s=96, h=2, d=32, dtype=torch.float32):
    return tuple(torch.randn(b, s, h, d, dtype=dtype) for _ in range(3))


def test_api_matches_oracle_and_forced_plan():
    q, k, v = inputs()
    mask = random_mask(1, 2, 96, 96, 32, 16, density=0.4, seed=1)
    out, lse = block_sparse_attention(q, k, v, mask, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, mask, return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    plan = PhysicalPlan(32, 16, KvLayout.PACKED, TaskOrganization(num_splits=2), reference_kernel(32, "fp32", 64, 64))
    forced = block_sparse_attention(q, k, v, mask, plan=plan)
    torch.testing.assert_close(forced, ref, atol=1e-5, rtol=1e-4)


def test_bf16_inputs_keep_their_dtype_and_strided_views_work():
    qkv = torch.randn(1, 80, 3, 2, 64).to(torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    mask = random_mask(1, 1, 80, 80, 16, 16, density=0.5, seed=2)
    out = block_sparse_attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_runtime_caches_exact_repeats_per_mask_object():
    q, k, v = inputs()
    runtime = Runtime()
    mask = random_mask(1, 2, 96, 96, 32, 32, seed=3)
    plan = PhysicalPlan(32, 32, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(32, "fp32", 64, 64))
    for _ in range(3):
        block_sparse_attention(q, k, v, mask, plan=plan, runtime=runtime)
    assert (runtime.hits, runtime.misses) == (2, 1)
    other = LogicalMask(mask.blocks.clone(), 32, 32, 96, 96)
    block_sparse_attention(q, k, v, other, plan=plan, runtime=runtime)
    assert runtime.misses == 2


def bad_calls():
    q, k, v = inputs()
    mask = random_mask(1, 2, 96, 96, 32, 32, seed=4)
    yield "q", (q.to(torch.int32), k, v, mask), {}
    yield "q", (q[0], k, v, mask), {}
    yield "k/v", (q, k.to(torch.float16), v, mask), {}
    yield "v", (q, k, v[:, :50], mask), {}
    yield "k", (q, k[:, :, :1], v[:, :, :1], mask), {}
    yield "q", (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, mask), {}
    yield "mask", (q, k, v, random_mask(1, 2, 64, 96, 32, 32)), {}
    yield "mask head dim", (q, k, v, random_mask(1, 3, 96, 96, 32, 32)), {}
    yield "mask batch dim", (q, k, v, random_mask(2, 2, 96, 96, 32, 32)), {}
    yield "mask", (q, k, v, torch.ones(1, 1, 3, 3, dtype=torch.bool)), {}
    yield "q", (q[:, :0], k, v, mask), {}
    yield "scale", (q, k, v, mask), {"scale": float("nan")}
    yield "scale", (q, k, v, mask), {"scale": -1.0}
    nan_q = q.clone()
    nan_q[0, 3, 1, 2] = float("nan")
    yield "q", (nan_q, k, v, mask), {"check_finite": True}


@pytest.mark.parametrize("argument,args,kwargs", list(bad_calls()))
def test_bad_inputs_raise_named_tessera_errors(argument, args, kwargs):
    with pytest.raises(TesseraError) as info:
        block_sparse_attention(*args, **kwargs)
    assert isinstance(info.value, (InvalidArgumentError, MaskError))
    assert info.value.argument == argument
    assert "expected" in str(info.value)


def test_nan_inputs_propagate_only_to_rows_that_see_them():
    q, k, v = inputs(s=64, h=1)
    blocks = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    blocks[0, 0, 0, 0] = blocks[0, 0, 1, 1] = True
    mask = LogicalMask(blocks, 16, 16, 64, 64)
    k = k.clone()
    k[0, 20, 0, 0] = float("nan")  # inside KV block 1, seen only by query block 1
    out = block_sparse_attention(q, k, v, mask)
    assert bool(out[:, 16:32].isnan().all()) and not bool(out[:, :16].isnan().any())
    assert bool((out[:, 32:] == 0).all())
    assert not math.isnan(float(out[0, 0, 0, 0]))


def test_runtime_drops_the_prepared_plan_of_a_dead_mask():
    """A loop of new masks must not keep every old mask's metadata alive in the runtime's cache."""
    import gc

    from tessera_diffusers import Runtime, block_sparse_attention
    from tessera_diffusers.testing import random_mask, random_qkv

    runtime = Runtime()
    q, k, v = random_qkv(1, 256, 256, 2, 16, torch.float32, torch.device("cpu"), seed=0)
    for seed in range(3):
        mask = random_mask(1, 2, 256, 256, 64, 64, density=0.5, seed=seed)
        block_sparse_attention(q, k, v, mask, runtime=runtime)
        assert len(runtime._cache) == 1
        del mask
        gc.collect()
        assert len(runtime._cache) == 0
