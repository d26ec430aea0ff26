"""The 8-bit attention's quantization and its twin (``tessera_diffusers.quantized``) against the fp32
oracle: the accuracy budget on every test geometry (partial blocks and empty rows included), the
log-sum-exp with K's mean added back, and what breaks the budget."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from tessera_diffusers import quantized, reference
from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.kernel_table import DEFAULT_PV
from tessera_diffusers.testing import TEST_GEOMETRIES, random_mask, random_qkv

SEQ_Q, SEQ_KV, HEADS, HEAD_DIM = 600, 700, 2, 128
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_native():
    """``csrc/build_native.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("build_native_for_test", os.path.join(ROOT, "csrc", "build_native.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def request(block_q: int, block_kv: int, seed: int = 0):
    mask = random_mask(1, HEADS, SEQ_Q, SEQ_KV, block_q, block_kv, density=0.3, seed=seed)
    q, k, v = random_qkv(1, SEQ_Q, SEQ_KV, HEADS, HEAD_DIM, torch.bfloat16, "cpu", seed=seed)
    return q, k, v, mask


def with_channel_offsets(x: torch.Tensor, offset: float, every: int) -> torch.Tensor:
    """``x`` plus ``offset`` on every ``every``-th channel (the outlier channels of real activations)."""
    return (x.float() + offset * (torch.arange(x.shape[-1]) % every == 0)).to(x.dtype)


@pytest.mark.parametrize("pv", ["bf16", "int8"])
@pytest.mark.parametrize("geometry", TEST_GEOMETRIES, ids=lambda g: f"Q{g[0]}K{g[1]}")
def test_int8_attention_meets_the_budget_on_every_geometry(geometry, pv):
    q, k, v, mask = request(*geometry)
    oracle, oracle_lse = reference.attention(q, k, v, mask, return_lse=True, out_dtype=torch.float32)
    out, lse = quantized.attention(q, k, v, mask, return_lse=True, pv=pv)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == oracle_lse.shape
    agreement = quantized.agreement(out, oracle)
    assert agreement.within_budget(), agreement
    empty = torch.isinf(oracle_lse)  # [B, H, Sq]: the mask's empty rows
    assert bool(empty.any()) and bool((lse[empty] == -math.inf).all())
    assert bool((out.permute(0, 2, 1, 3)[empty] == 0).all())
    assert float((lse - oracle_lse)[~empty].abs().max()) < 0.02


def test_the_log_sum_exp_gets_the_mean_of_k_back():
    """K with offset channels: the smoothed scores are shifted per row; the lse is not."""
    q, k, v, mask = request(64, 64)
    k = with_channel_offsets(k, 3.0, 8)
    _, oracle_lse = reference.attention(q, k, v, mask, return_lse=True)
    _, lse = quantized.attention(q, k, v, mask, return_lse=True)
    finite = torch.isfinite(oracle_lse)
    shift = quantized.quantize(q, k, v, 1 / math.sqrt(HEAD_DIM)).lse_shift
    assert float(shift.abs().max()) > 1.0  # the test means something: the shift is large
    assert float((lse - oracle_lse)[finite].abs().max()) < 0.02


def test_without_k_smoothing_outlier_channels_break_the_budget():
    q, k, v, mask = request(64, 64)
    k = with_channel_offsets(k, 30.0, 16)
    oracle = reference.attention(q, k, v, mask, out_dtype=torch.float32)
    assert quantized.agreement(quantized.attention(q, k, v, mask), oracle).within_budget()
    unsmoothed = quantized.agreement(quantized.attention(q, k, v, mask, smooth_k=False), oracle)
    assert not unsmoothed.within_budget(), unsmoothed


def test_fp8_p_v_errs_about_three_times_as_much_as_int8():
    """e4m3 keeps 3 mantissa bits for P and V: on random inputs it misses the relative budget that
    unsigned 8-bit P per KV tile and signed 8-bit V per channel meet."""
    q, k, v, mask = request(128, 128)
    oracle = reference.attention(q, k, v, mask, out_dtype=torch.float32)
    int8 = quantized.agreement(quantized.attention(q, k, v, mask, pv="int8"), oracle)
    fp8 = quantized.agreement(quantized.attention(q, k, v, mask, pv="fp8"), oracle)
    assert fp8.cosine >= quantized.MIN_COSINE and fp8.relative_l2 > quantized.MAX_RELATIVE_L2
    assert fp8.relative_l2 > 2 * int8.relative_l2


def test_bf16_p_v_leaves_the_int8_q_k_share_of_the_error():
    """With P and V in bf16 only Q K^T is 8-bit: the error falls to about two thirds of the INT8 scheme's,
    still far above bf16 rounding of the exact output (the scores' quantization stays)."""
    q, k, v, mask = request(128, 128)
    oracle = reference.attention(q, k, v, mask, out_dtype=torch.float32)
    int8 = quantized.agreement(quantized.attention(q, k, v, mask, pv="int8"), oracle)
    bf16 = quantized.agreement(quantized.attention(q, k, v, mask, pv="bf16"), oracle)
    rounding = quantized.agreement(oracle.to(torch.bfloat16), oracle)
    assert bf16.within_budget() and bf16.relative_l2 < 0.8 * int8.relative_l2
    assert bf16.relative_l2 > 2 * rounding.relative_l2
    x = quantized.quantize(q, k, v, 0.125, pv="bf16")
    assert x.pv == "bf16" and x.v.dtype == torch.bfloat16 and bool((x.v_scale == 1).all())
    assert quantized.quantize(q, k, v, 0.125).pv == DEFAULT_PV  # the twin's default is what precision="int8" runs


def test_quantized_inputs_round_within_half_a_step():
    q, k, v, _ = request(64, 64)
    x = quantized.quantize(q, k, v, 1 / math.sqrt(HEAD_DIM), pv="int8")
    assert (x.q.dtype, x.k.dtype, x.v.dtype) == (torch.int8, torch.int8, torch.int8)
    assert int(x.q.abs().max()) == 127 and int(x.k.abs().max()) == 127  # each token uses the full range
    assert bool(((x.q.float() * x.q_scale.unsqueeze(-1) - q.float()).abs() <= x.q_scale.unsqueeze(-1) / 2 + 1e-6).all())
    centred_k = k.float() - x.k_mean.unsqueeze(1)
    assert bool(((x.k.float() * x.k_scale.unsqueeze(-1) - centred_k).abs() <= x.k_scale.unsqueeze(-1) / 2 + 1e-6).all())
    centred_v = v.float() - x.v_mean.unsqueeze(1)
    assert bool(((x.v.float() * x.v_scale.unsqueeze(1) - centred_v).abs() <= x.v_scale.unsqueeze(1) / 2 + 1e-6).all())


def test_k_has_one_scale_per_16_token_chunk():
    k = torch.randn(2, 37, 3, HEAD_DIM)  # chunks 0-15, 16-31 and a partial 32-36
    k[0, 20, 1] *= 50  # one large key sets its chunk's scale, not its neighbours'
    k[1, 32:, 2] = 0  # a chunk without a nonzero key keeps scale 1
    k8, scale = quantized.per_chunk_int8(k)
    assert quantized.K_CHUNK == 16 and scale.shape == (2, 37, 3) and k8.dtype == torch.int8
    for start, stop in ((0, 16), (16, 32), (32, 37)):
        want = k[:, start:stop].abs().amax((1, 3)) / 127
        want = torch.where(want > 0, want, torch.ones_like(want))
        assert torch.equal(scale[:, start:stop], want.unsqueeze(1).expand(-1, stop - start, -1))
    assert float(scale[0, 16, 1]) > 10 * float(scale[0, 0, 1]) and float(scale[1, 32, 2]) == 1.0
    assert bool(((k8.float() * scale.unsqueeze(-1) - k).abs() <= scale.unsqueeze(-1) / 2 + 1e-6).all())
    x = quantized.quantize(k, k, k, 0.125)
    assert torch.equal(x.k_scale, quantized.per_chunk_int8(k - k.mean(1, keepdim=True))[1])


def test_probabilities_are_rounded_per_kv_tile():
    p = torch.tensor([[1.0, 0.5, 0.01, 0.004, 0.001, 0.0]])
    tiled = quantized.rounded_probabilities(p, "int8", 3)  # tiles [1, .5, .01] and [.004, .001, 0]
    for values, top in ((slice(0, 3), 1.0), (slice(3, 6), 0.004)):
        steps = tiled[0, values] / top * 255  # whole steps of the tile's own maximum
        assert torch.allclose(steps, steps.round(), atol=1e-3)
        assert float((tiled[0, values] - p[0, values]).abs().max()) <= top / 255 / 2 * 1.001
    assert float(quantized.rounded_probabilities(p, "int8", 6)[0, 4]) == 0.0  # a row-wide step loses 0.001


def test_a_tile_whose_step_underflows_rounds_to_zero_not_nan():
    # exp of scores ~100 below the row's maximum: the tile's maximum is a denormal and a 255th of it is 0.
    p = torch.tensor([[1.0, 0.25, 1e-44, 5e-45]])
    tiled = quantized.rounded_probabilities(p, "int8", 2)
    assert torch.isfinite(tiled).all() and float(tiled[0, 2:].abs().max()) <= 1e-44


@pytest.mark.parametrize("bad, argument", [
    ({"pv": "int4"}, "pv"),
    ({"kv_tile": 0}, "kv_tile"),
    ({"kv_tile": True}, "kv_tile"),
    ({"scale": -1.0}, "scale"),
])
def test_bad_arguments_are_refused(bad, argument):
    q, k, v, mask = request(64, 64)
    with pytest.raises(InvalidArgumentError, match=argument):
        quantized.attention(q, k, v, mask, **bad)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_finite_inputs_are_refused(name):
    q, k, v, mask = request(64, 64)
    tensors = {"q": q, "k": k, "v": v}
    tensors[name] = tensors[name].clone()
    tensors[name][0, 5, 1, 3] = math.inf
    with pytest.raises(InvalidArgumentError, match=name):
        quantized.attention(tensors["q"], tensors["k"], tensors["v"], mask)


# ---- the native 8-bit path's CPU-checkable parts --------------------------------------------------


def test_a_v8_chunk_holds_each_token_once_in_the_p_fragments_column_order():
    """Byte j of a chunk row holds token chunk_token(j): thread t of a quad holds score columns 2t,
    2t + 1, 2t + 8, 2t + 9 and the 8-bit A operand reads its bytes as columns 4t .. 4t + 3."""
    from tessera_diffusers.quantized_ops import CHUNK, chunk_token

    assert sorted(chunk_token(j) for j in range(CHUNK)) == list(range(CHUNK))
    for t in range(4):
        assert [chunk_token(4 * t + b) for b in range(4)] == [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]


def test_v_tokens_undoes_the_chunk_layout():
    from tessera_diffusers.quantized_ops import CHUNK, QuantizedTensors, chunk_token

    batch, heads, seq, dim = 1, 2, 40, 128
    v = torch.randint(-127, 128, (batch, seq, heads, dim), dtype=torch.int8)
    padded = torch.zeros(batch, 48, heads, dim, dtype=torch.int8)
    padded[:, :seq] = v
    order = torch.tensor([chunk_token(j) for j in range(CHUNK)])
    chunks = padded.view(batch, 3, CHUNK, heads, dim).permute(0, 3, 1, 4, 2)[..., order]  # [B, H, C, D, 16]
    chunks = (chunks.to(torch.int16) + 128).to(torch.uint8)  # v8 holds v plus 128
    empty = torch.empty(0)
    x = QuantizedTensors(empty, empty, torch.empty(batch, heads, 48, dim), empty, chunks.contiguous(), empty, empty,
                         empty, empty, seq)
    assert torch.equal(x.v_tokens(), v)


def test_each_p_v_format_has_a_kernel_for_every_8bit_tile_and_the_product_runs_the_16bit_one():
    from tessera_diffusers.catalog import all_kernels, quantized_kernel
    from tessera_diffusers.kernel_table import DEFAULT_PV, QUANTIZED_FAMILIES, pv_format, quantized_rows

    assert DEFAULT_PV == "bf16" and set(QUANTIZED_FAMILIES) == {"int8", "bf16"}
    shapes = {pv: {(r.tile_q, r.tile_kv, r.head_dim, r.dtype, r.stages) for r in quantized_rows() if pv_format(r) == pv}
              for pv in QUANTIZED_FAMILIES}
    assert shapes["int8"] == shapes["bf16"] and shapes["int8"]
    hopper = [k for k in all_kernels() if k.family.value == "hopper" and quantized_kernel(k) is not None]
    assert hopper
    for spec in hopper:
        assert quantized_kernel(spec).family == QUANTIZED_FAMILIES[DEFAULT_PV]
        assert quantized_kernel(spec, "int8").family == "hopper8"
        assert quantized_kernel(spec, "int8").tile_q == quantized_kernel(spec).tile_q == spec.tile_q


def test_the_native_pass_and_kernels_refuse_an_unknown_p_v_format():
    from tessera_diffusers import quantized_ops

    q, k, v, _ = request(64, 64)
    with pytest.raises(InvalidArgumentError, match="pv"):
        quantized_ops.quantize(q, k, v, 0.1, pv="fp8")
    with pytest.raises(InvalidArgumentError, match="pv"):
        quantized_ops.run_quantized(None, q, k, v, 0.1, False, pv="int4")


def test_the_bench_names_each_p_v_format():
    from tessera_diffusers.bench.harness import make_backend

    for name, pv, kernel_only in [("tessera-int8", "bf16", False), ("tessera-int8-kernel", "bf16", True),
                                  ("tessera-int8pv", "int8", False), ("tessera-int8pv-kernel", "int8", True)]:
        backend = make_backend(name)
        assert (backend.name, backend.pv, backend.kernel_only) == (name, pv, kernel_only)


def test_the_bench_says_once_why_a_build_cannot_run_an_8bit_backend(monkeypatch):
    from tessera_diffusers import library
    from tessera_diffusers.bench.harness import make_backend

    class Build:
        def __init__(self, formats):
            self.formats = formats

        def has_pv_format(self, pv):
            return pv in self.formats

    int8, int8pv = make_backend("tessera-int8-kernel"), make_backend("tessera-int8pv-kernel")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert int8.unavailable() == "needs CUDA"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(library, "quantized_library", lambda: None)
    assert "no 8-bit kernels" in int8.unavailable()
    monkeypatch.setattr(library, "quantized_library", lambda: Build({"bf16"}))
    assert int8.unavailable() is None
    assert "'int8'" in int8pv.unavailable() and "TESSERA_PV_FORMATS" in int8pv.unavailable()


def test_an_8bit_request_has_its_own_key_and_unknown_precisions_are_refused():
    from tessera_diffusers.plans import Request
    from tessera_diffusers.runtime import make_request

    base = Request(1, 2, 256, 256, 128, "bf16", 64, 64, "sm90")
    assert base.key == "sm90/Q64K64/d128/bf16/bshd"
    assert Request(1, 2, 256, 256, 128, "bf16", 64, 64, "sm90", precision="int8").key == base.key + "/int8"
    mask = random_mask(1, 2, 256, 256, 64, 64, density=0.5, seed=0)
    q, k, _ = random_qkv(1, 256, 256, 2, 128, torch.float32, "cpu")
    with pytest.raises(InvalidArgumentError, match="precision"):
        make_request(q, k, mask, False, "fp8")


def test_int8_where_no_8bit_kernel_runs_warns_once_and_gives_the_16bit_result():
    from tessera_diffusers import Runtime

    mask = random_mask(1, 2, 300, 300, 64, 64, density=0.4, seed=1)
    q, k, v = random_qkv(1, 300, 300, 2, 128, torch.float32, "cpu", seed=1)
    runtime = Runtime()
    with pytest.warns(UserWarning, match="int8.*unavailable"):
        out = runtime.attention(q, k, v, mask, precision="int8")
    torch.testing.assert_close(out, reference.attention(q, k, v, mask))


def test_the_8bit_choice_is_the_best_ranked_plan_an_8bit_kernel_runs():
    from tessera_diffusers.catalog import all_kernels
    from tessera_diffusers.mask_state import build_mask_state
    from tessera_diffusers.plans import Request
    from tessera_diffusers.selector import Selector, has_quantized_variant

    mask = random_mask(1, 2, 4096, 4096, 64, 64, density=0.1, seed=2)
    request = Request(1, 2, 4096, 4096, 128, "bf16", 64, 64, "sm90", precision="int8")
    selection = Selector(kernels=all_kernels()).quantized(request, build_mask_state(mask))
    assert selection.chosen is not None and has_quantized_variant(selection.chosen)
    assert selection.ranking[0][0] == selection.chosen.name
    assert all(reason for _, reason in selection.rejected)
    assert any("8-bit" in note for note in selection.notes)


def test_the_8bit_choice_takes_one_cta_per_task_before_a_persistent_grid():
    from tessera_diffusers.catalog import all_kernels, plans_for
    from tessera_diffusers.mask_state import build_mask_state
    from tessera_diffusers.plans import Request
    from tessera_diffusers.selector import Selector

    mask = random_mask(1, 2, 4096, 4096, 128, 128, density=0.1, seed=4)
    request = Request(1, 2, 4096, 4096, 128, "bf16", 128, 128, "sm90", precision="int8")
    selection = Selector(kernels=all_kernels()).quantized(request, build_mask_state(mask))
    by_name = {p.name: p for p in plans_for(128, 128, all_kernels())}
    persistent = [by_name[name].tasks.persistent for name, _ in selection.ranking]
    assert True in persistent and False in persistent  # both kinds were candidates
    assert persistent == sorted(persistent)  # every one-CTA-per-task plan first
    assert not selection.chosen.tasks.persistent


def test_the_8bit_choice_follows_the_16bit_ranking_to_a_64x64_tile():
    import dataclasses

    from tessera_diffusers.catalog import all_kernels, quantized_kernel
    from tessera_diffusers.mask_state import build_mask_state
    from tessera_diffusers.plans import INPUT_PRECISION, Request
    from tessera_diffusers.selector import Selector

    mask = random_mask(1, 2, 8192, 8192, 64, 32, density=0.1, seed=2)
    request = Request(1, 2, 8192, 8192, 128, "bf16", 64, 32, "sm90", precision="int8")
    state = build_mask_state(mask)
    base = Selector(kernels=all_kernels()).rank(dataclasses.replace(request, precision=INPUT_PRECISION), state)
    assert (base.chosen.tile_q, base.chosen.tile_kv) == (64, 64)  # the 16-bit choice: a 64 x 64 plan
    chosen = Selector(kernels=all_kernels()).quantized(request, state).chosen
    assert (chosen.tile_q, chosen.tile_kv, chosen.mapping_name) == (64, 64, base.chosen.mapping_name)
    row = quantized_kernel(chosen.kernel)
    assert (row.tile_q, row.tile_kv, row.stages) == (64, 64, chosen.kernel.stages)


@pytest.mark.parametrize("block", [32, 64])
def test_an_8bit_mask_that_comes_back_takes_its_plans_grouped_layout(block, monkeypatch):
    """An 8-bit request regroups every Hopper plan that can (the 16-bit rule only blocks of at most
    GROUPED_MAX_BLOCK_Q rows), in the same 8-bit kernel; TESSERA_GROUP_QUERIES=0 keeps the plan."""
    import dataclasses

    from tessera_diffusers.catalog import all_kernels, plans_for, quantized_kernel
    from tessera_diffusers.mask_state import build_mask_state
    from tessera_diffusers.plans import INPUT_PRECISION, QLayout, Request
    from tessera_diffusers.selector import GROUP_QUERIES_ENV, GROUPED_MAX_BLOCK_Q, Selector

    monkeypatch.delenv(GROUP_QUERIES_ENV, raising=False)
    request = Request(1, 2, 4096, 4096, 128, "bf16", block, block, "sm90", precision="int8")
    state = build_mask_state(random_mask(1, 2, 4096, 4096, block, block, density=0.1, seed=5))
    plan = next(p for p in plans_for(block, block, all_kernels())
                if p.tile_q == 128 and p.q_layout is QLayout.NATURAL and quantized_kernel(p.kernel) is not None)
    selector = Selector(table=None, kernels=all_kernels())
    reused = selector.reused_plan(plan, request, state)
    assert reused == plan.grouped() and quantized_kernel(reused.kernel) == quantized_kernel(plan.kernel)
    assert selector.reused_request(plan, request) is None  # the table ranks 16-bit plans only
    sixteen = selector.reused_plan(plan, dataclasses.replace(request, precision=INPUT_PRECISION), state)
    assert sixteen == (plan.grouped() if block <= GROUPED_MAX_BLOCK_Q else plan)
    monkeypatch.setenv(GROUP_QUERIES_ENV, "0")
    assert selector.reused_plan(plan, request, state) == plan


def test_every_8bit_kernel_runs_the_plans_of_its_base_kernel():
    from tessera_diffusers.catalog import base_kernel, quantized_kernel
    from tessera_diffusers.kernel_table import pv_format, quantized_rows

    for row in quantized_rows():
        base = base_kernel(row)
        assert base.family.value == "hopper" and quantized_kernel(base, pv_format(row)) == row


def test_explain_says_where_every_pv_format_runs_pv():
    from tessera_diffusers.kernel_table import DEFAULT_PV, QUANTIZED_FAMILIES
    from tessera_diffusers.selector import PV_WHERE

    assert set(PV_WHERE) == set(QUANTIZED_FAMILIES) and DEFAULT_PV in PV_WHERE


def test_with_regime_reuse_an_8bit_request_takes_its_previous_decision_without_a_scan():
    from tessera_diffusers.catalog import all_kernels
    from tessera_diffusers.mask_state import build_mask_state
    from tessera_diffusers.plans import Request
    from tessera_diffusers.selector import Selector

    request = Request(1, 2, 4096, 4096, 128, "bf16", 64, 64, "sm90", precision="int8")
    selector = Selector(kernels=all_kernels(), reuse_regime=True)
    first = selector.quantized(request, build_mask_state(random_mask(1, 2, 4096, 4096, 64, 64, density=0.1, seed=2)))
    scans, reuses = selector.scans, selector.regime_reuses
    state = build_mask_state(random_mask(1, 2, 4096, 4096, 64, 64, density=0.1, seed=3))
    assert selector.quantized(request, state) is first
    assert selector.scans == scans and selector.regime_reuses == reuses + 1 and not state.statistics_read
    selector.forget_regimes()
    assert selector.quantized(request, state).chosen == first.chosen and selector.scans > scans
    fresh = Selector(kernels=all_kernels())  # without reuse every request is ranked
    fresh.quantized(request, state)
    scans = fresh.scans
    fresh.quantized(request, state)
    assert fresh.scans > scans


def test_8bit_sources_stay_out_of_the_16bit_kernels_hash(tmp_path):
    """An edit of the 8-bit path leaves the 16-bit plan table current (build_native.QUANTIZED_ONLY)."""
    import shutil

    build = build_native()
    src = tmp_path / "csrc"
    shutil.copytree(os.path.join(ROOT, "csrc", "include"), src / "include")
    shutil.copytree(os.path.join(ROOT, "csrc", "kernels"), src / "kernels")
    dirs = [str(src / "include"), str(src / "kernels")]

    def hashes():
        return (build.kernel_sources_hash(dirs, {}, [], [], exclude=build.GROUPING_ONLY + build.QUANTIZED_ONLY),
                build.kernel_sources_hash(dirs, {}, [], [], exclude=build.GROUPING_ONLY))

    before = hashes()
    with open(src / "include" / "tessera" / "quantized" / "attention.cuh", "a") as f:
        f.write("\nnamespace tessera { constexpr int kEdited = 1; }\n")
    after = hashes()
    assert after[0] == before[0] and after[1] != before[1]
    with open(src / "include" / "tessera" / "tasks.cuh", "a") as f:
        f.write("\nnamespace tessera { constexpr int kShared = 1; }\n")
    assert hashes()[0] != before[0]


def test_a_build_compiles_the_product_p_v_format_unless_told_otherwise():
    """``TESSERA_PV_FORMATS``: a default build compiles the 8-bit kernels of ``DEFAULT_PV`` only (the
    8-bit P V ones serve comparisons); a list adds formats; an unknown one is refused by name."""
    build = build_native()
    assert build.pv_formats({}) == (DEFAULT_PV,)
    assert build.pv_formats({"TESSERA_PV_FORMATS": " int8, bf16,int8 "}) == ("int8", "bf16")
    for bad in ("fp8", "bf16,int4", ","):
        with pytest.raises(RuntimeError, match="TESSERA_PV_FORMATS"):
            build.pv_formats({"TESSERA_PV_FORMATS": bad})


def test_a_library_knows_which_p_v_formats_its_build_compiled():
    from tessera_diffusers.kernel_table import pv_format, quantized_rows
    from tessera_diffusers.library import QuantizedLibrary

    product = [r.name for r in quantized_rows() if pv_format(r) == DEFAULT_PV]
    lib = QuantizedLibrary(lib=None, kernel_ids={name: i for i, name in enumerate(product)})
    assert lib.has_pv_format(DEFAULT_PV) and not lib.has_pv_format("int8")
    assert not QuantizedLibrary(lib=None, kernel_ids={}).has_pv_format(DEFAULT_PV)


def test_the_layout_constants_match_the_kernels_header():
    """``params.h``'s constants and their Python mirrors: the padding, the head dim, K's chunk."""
    import re

    from tessera_diffusers import kernel_table, quantized_ops

    with open(os.path.join(ROOT, "csrc", "include", "tessera", "quantized", "params.h")) as f:
        defines = dict(re.findall(r"^#define (TESSERA_QUANTIZED_\w+) (\d+)$", f.read(), re.MULTILINE))
    assert defines == {"TESSERA_QUANTIZED_ALIGN": str(quantized_ops.SEQ_ALIGN),
                       "TESSERA_QUANTIZED_HEAD_DIM": str(kernel_table.QUANTIZED_HEAD_DIM),
                       "TESSERA_QUANTIZED_K_CHUNK": str(quantized.K_CHUNK)}
