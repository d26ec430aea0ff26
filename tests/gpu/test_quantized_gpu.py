"""The 8-bit path on the GPU: the quantization pass against the twin's ``quantize``, and every 8-bit
kernel on every geometry family (partial blocks, empty rows, layouts, splits, persistent grids,
the grouped query layout) against the fp32 oracle within the 8-bit budget and against the twin.
Skipped without sm90 and a library with the 8-bit kernels."""

from __future__ import annotations

import math

import pytest
import torch

from tessera_diffusers import (
    KvLayout,
    PhysicalPlan,
    TaskOrganization,
    Traversal,
    build_mask_state,
    catalog,
    prepare,
    quantized,
    reference,
)
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.kernel_table import pv_format, quantized_rows
from tessera_diffusers.testing import TEST_GEOMETRIES, device_request, plans_to_check, random_mask, random_qkv

pytestmark = pytest.mark.gpu

QUANTIZED = quantized_rows()


def library():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the 8-bit kernels need sm90")
    from tessera_diffusers.library import quantized_library

    lib = quantized_library()
    if lib is None:
        pytest.skip("this build of the library has no 8-bit kernels")
    return lib


def offset_qkv(batch, seq_q, seq_kv, heads, dtype, seed):
    """Random q, k, v with per-channel offsets on k and v (what K smoothing and V centring are for)."""
    q, k, v = random_qkv(batch, seq_q, seq_kv, heads, 128, torch.float32, "cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    k = k + 3 * torch.randn(heads, 128, generator=gen, device="cuda")
    v = v + torch.randn(heads, 128, generator=gen, device="cuda")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def close_integers(got: torch.Tensor, want: torch.Tensor) -> None:
    """int8 tensors equal but for rare rounding ties (a scale, mean or reciprocal one ulp apart): at most 1 apart."""
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) <= 1
    assert float((diff > 0).float().mean()) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_quantization_pass_is_the_twins(dtype):
    from tessera_diffusers import quantized_ops

    library()
    q, k, v = offset_qkv(2, 1000, 777, 3, dtype, seed=3)
    scale = 1 / math.sqrt(128)
    got = quantized_ops.quantize(q, k, v, scale, pv="int8")
    want = quantized.quantize(q, k, v, scale, pv="int8")
    without_v = quantized_ops.quantize(q, k, v, scale, pv="bf16")  # Q and K alike, no V
    assert without_v.v8 is None and without_v.v_scale is None and without_v.v_mean is None
    for name in ("q8", "q_scale", "k8", "k_scale", "k_mean", "lse_shift"):
        assert torch.equal(getattr(without_v, name), getattr(got, name)), name
    close_integers(got.q8, want.q.transpose(1, 2))
    close_integers(got.k8[:, :, :777], want.k.transpose(1, 2))
    assert not bool(got.k8[:, :, 777:].any())
    # K's scale is one per 16-token chunk: 768 .. 783 share 768's (777 .. 783 are padding), later
    # chunks hold no key and keep scale 1 (a kernel's factor for their masked columns stays finite).
    assert torch.equal(got.k_scale[:, :, 768:784], got.k_scale[:, :, 768:769].expand(-1, -1, 16))
    assert bool((got.k_scale[:, :, 784:] == 1).all())
    close_integers(got.v_tokens(), want.v)
    torch.testing.assert_close(got.q_scale, want.q_scale.transpose(1, 2), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.k_scale[:, :, :777], want.k_scale.transpose(1, 2), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.k_mean, want.k_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.v_mean, want.v_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.v_scale, want.v_scale, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.lse_shift, want.lse_shift, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("row", QUANTIZED, ids=lambda r: r.name)
def test_every_8bit_entry_on_every_family(row):
    from tessera_diffusers import quantized_ops

    lib = library()
    if row.name not in lib.kernel_ids:
        pytest.skip(f"{row.name} is not in this build")
    kernel = catalog.base_kernel(row)
    pv = pv_format(row)
    failures, checked = [], 0
    for gi, (bq, bkv) in enumerate(TEST_GEOMETRIES):
        seq_q, seq_kv = 7 * bq + bq // 2 + 3, 9 * bkv - 5  # partial last blocks on both axes
        mask = random_mask(2, 3, seq_q, seq_kv, bq, bkv, density=0.35, seed=gi, device="cuda")
        q, k, v = offset_qkv(2, seq_q, seq_kv, 3, kernel.torch_dtype, seed=gi)
        scale = 1 / math.sqrt(128)
        oracle, oracle_lse = reference.attention(q.float(), k.float(), v.float(), mask, scale, True)
        twin = quantized.attention(q, k, v, mask, scale, pv=pv)
        x = quantized_ops.quantize(q, k, v, scale, pv)
        empty = torch.isinf(oracle_lse)  # [B, H, Sq]: rows with no active key
        for plan in plans_to_check(kernel, bq, bkv):
            if rejection(plan, device_request(q, k, mask, plan)) is not None:
                continue
            prepared = prepare(plan, build_mask_state(mask))
            out, lse = quantized_ops.run_quantized(prepared, q, k, v, scale, True, quantized=x, pv=pv)
            checked += 1
            fit = quantized.agreement(out, oracle)
            to_twin = quantized.agreement(out, twin.float())
            rows_empty = out.float().transpose(1, 2)[empty]
            lse_err = float((lse[~empty] - oracle_lse[~empty]).abs().max()) if bool((~empty).any()) else 0.0
            bad = []
            if not bool(torch.isfinite(out).all()):
                bad.append("non-finite output")
            if not fit.within_budget():
                bad.append(f"oracle cos {fit.cosine:.5f} rel {fit.relative_l2:.4f}")
            if to_twin.relative_l2 > 0.02:
                bad.append(f"twin rel {to_twin.relative_l2:.4f}")
            if bool(rows_empty.any()) or not bool((lse[empty] == -math.inf).all()):
                bad.append("empty rows not 0 / -inf")
            if lse_err > 0.05:
                bad.append(f"lse err {lse_err:.3f}")
            if bad:
                failures.append(f"{plan.name} ({bq}x{bkv}): " + ", ".join(bad))
    assert checked > 0
    assert not failures, "\n".join(failures)


def test_a_request_writes_every_row_and_bad_inputs_are_refused():
    from tessera_diffusers import quantized_ops
    from tessera_diffusers.errors import InvalidArgumentError

    library()
    kernel = catalog.base_kernel(QUANTIZED[0])
    mask = random_mask(1, 2, 1000, 1000, 32, 16, density=0.3, seed=5, device="cuda")
    q, k, v = offset_qkv(1, 1000, 1000, 2, kernel.torch_dtype, seed=5)
    plan = PhysicalPlan(32, 16, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 1), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    out, lse = quantized_ops.run_quantized(prepared, q, k, v, 1 / math.sqrt(128), True)
    assert bool(torch.isfinite(out).all()) and not bool(lse.isnan().any())
    with pytest.raises(InvalidArgumentError, match="q"):
        quantized_ops.run_quantized(prepared, q[..., :64], k[..., :64], v[..., :64], 0.125, False)


@pytest.mark.parametrize("pv", ["int8", "bf16"])
def test_sharp_queries_and_outlier_keys_stay_finite_and_within_the_budget(pv):
    # Heavy tails as real activations have them: queries 2x sharper and every 1,024th key 8x
    # larger, so whole KV tiles sit far below their rows' maxima (steps that underflow) and a few
    # keys dominate their chunks' scales. The twin measures 0.023 (16-bit P V) and 0.026 (8-bit P V)
    # relative L2 on such inputs.
    from tessera_diffusers import quantized_ops

    lib = library()
    if not lib.has_pv_format(pv):
        pytest.skip(f"this build has no 8-bit kernels with P V format {pv!r} (TESSERA_PV_FORMATS)")
    kernel = catalog.base_kernel(QUANTIZED[0])
    seq, heads = 8192, 2
    mask = random_mask(1, heads, seq, seq, 128, 128, density=0.1, empty_rows=False, seed=1, device="cuda")
    q, k, v = random_qkv(1, seq, seq, heads, 128, torch.float32, "cuda", seed=7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = 2 * q
    k = k + 2 * torch.randn(heads, 128, generator=gen, device="cuda")  # a new tensor: no view of v
    k[:, ::1024] *= 8
    q, k, v = (t.to(kernel.torch_dtype) for t in (q, k, v))
    plan = PhysicalPlan(128, 128, KvLayout.CONTIGUOUS, TaskOrganization(Traversal.LONGEST_FIRST, 1), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    out = quantized_ops.run_quantized(prepared, q, k, v, 1 / math.sqrt(128), False, pv=pv)
    oracle = reference.attention(q.float(), k.float(), v.float(), mask, 1 / math.sqrt(128))
    assert bool(torch.isfinite(out).all())
    fit = quantized.agreement(out, oracle)
    assert fit.within_budget(), vars(fit)


def test_an_8bit_mask_that_comes_back_runs_grouped_within_the_budget():
    """``Runtime.attention(..., precision="int8")``: a mask's first call in the selected plan, the
    calls after it re-prepared once in that plan's grouped layout (Selector.reused_plan), each within
    the 8-bit budget against the fp32 oracle."""
    from tessera_diffusers import Runtime
    from tessera_diffusers.plans import QLayout

    library()
    mask = random_mask(1, 4, 4096, 4096, 32, 32, density=0.15, seed=11, device="cuda")
    q, k, v = random_qkv(1, 4096, 4096, 4, 128, torch.bfloat16, "cuda", seed=11)
    oracle = reference.attention(q.float(), k.float(), v.float(), mask, 1 / math.sqrt(128))
    runtime = Runtime()
    layouts = []
    for _ in range(3):
        out = runtime.attention(q, k, v, mask, precision="int8")
        layouts.append(next(iter(runtime._cache.values())).prepared.plan.q_layout)
        assert quantized.agreement(out, oracle).within_budget()
    assert layouts == [QLayout.NATURAL, QLayout.GROUPED, QLayout.GROUPED] and runtime.regroupings == 1
