"""The oracle against plain dense masked softmax, including the empty-row contract."""

from __future__ import annotations

import math

import pytest
import torch

from tessera_diffusers import LogicalMask, reference
from tessera_diffusers.testing import random_mask


def dense_masked(q, k, v, mask, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            allowed = mask.to_dense(b, h)
            s = (q[b, :, h].double() @ k[b, :, h].double().T) * scale
            s = s.masked_fill(~allowed, -math.inf)
            has = allowed.any(-1)
            p = torch.softmax(s[has], -1)
            out[b, has, h] = p @ v[b, :, h].double()
            lse[b, h, has] = torch.logsumexp(s[has], -1)
    return out, lse


@pytest.mark.parametrize("bq,bkv", [(16, 16), (32, 16), (48, 80), (64, 32)])
def test_matches_dense_masked_softmax(bq, bkv):
    torch.manual_seed(0)
    mask = random_mask(2, 3, 150, 170, bq, bkv, density=0.4, seed=bq + bkv)
    q, k, v = torch.randn(2, 150, 3, 24), torch.randn(2, 170, 3, 24), torch.randn(2, 170, 3, 24)
    out, lse = reference.attention(q, k, v, mask, 0.3, return_lse=True)
    exp_out, exp_lse = dense_masked(q, k, v, mask, 0.3)
    torch.testing.assert_close(out.double(), exp_out, atol=2e-6, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(exp_lse))
    finite = torch.isfinite(exp_lse)
    torch.testing.assert_close(lse.double()[finite], exp_lse[finite], atol=2e-5, rtol=1e-5)


def test_empty_rows_give_zero_and_minus_inf(monkeypatch):
    monkeypatch.setattr(reference, "CHUNK_SCORE_ELEMENTS", 64)  # many small chunks
    blocks = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    blocks[0, 0, 0, 1] = True
    mask = LogicalMask(blocks, 16, 16, 64, 64)
    q, k, v = (torch.randn(1, 64, 1, 8) for _ in range(3))
    out, lse = reference.attention(q, k, v, mask, return_lse=True)
    assert not bool(out.isnan().any())
    assert bool((out[:, 16:] == 0).all()) and bool((lse[..., 16:] == -math.inf).all())
    assert bool(torch.isfinite(lse[..., :16]).all())


def test_low_precision_twin_is_close_but_not_exact():
    mask = random_mask(1, 2, 128, 128, 32, 32, density=0.5, seed=4)
    q, k, v = (torch.randn(1, 128, 2, 32).to(torch.bfloat16) for _ in range(3))
    exact = reference.attention(q, k, v, mask, out_dtype=torch.float32)
    twin = reference.attention(q, k, v, mask, out_dtype=torch.bfloat16, p_dtype=torch.bfloat16)
    error = (twin.float() - exact).abs().max().item()
    assert 0 < error < 2e-2
