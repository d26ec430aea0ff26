"""Native kernels against the fp32 oracle: every catalog entry x every geometry family x layouts
x splits, partial blocks and empty rows included. Skipped without CUDA and the native library."""

from __future__ import annotations

import math

import pytest
import torch

from tessera_diffusers import KvLayout, PhysicalPlan, TaskOrganization, Traversal, build_mask_state, prepare
from tessera_diffusers.catalog import all_kernels
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.testing import (
    TEST_GEOMETRIES,
    check_against_reference,
    device_request,
    plans_to_check,
    random_mask,
    random_qkv,
)

pytestmark = pytest.mark.gpu

SPLITS = (1, 3)
FAMILIES = ("portable", "hopper")


def fixed_kernel(family: str, tile_q: int, tile_kv: int, head_dim: int, dtype: str):
    """The 2-stage catalog entry of `family` with this shape (skips where it cannot run)."""
    from tessera_diffusers import ops

    if family == "hopper" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper family needs sm90")
    kernel = next(k for k in all_kernels() if k.family.value == family and (k.tile_q, k.tile_kv, k.head_dim, k.dtype)
                  == (tile_q, tile_kv, head_dim, dtype) and k.stages == 2)
    if kernel.name not in ops.load_library().kernel_ids:
        pytest.skip(f"{kernel.name} is not in this build of the library")
    return kernel


@pytest.mark.parametrize("kernel", all_kernels(), ids=lambda k: k.name)
def test_every_entry_on_every_family(kernel):
    from tessera_diffusers import ops

    if kernel.name not in ops.load_library().kernel_ids:
        pytest.skip(f"{kernel.name} is not in this build of the library")
    device = torch.device("cuda")
    dtype = kernel.torch_dtype
    failures, checked, skipped = [], 0, None
    for gi, (bq, bkv) in enumerate(TEST_GEOMETRIES):
        seq_q, seq_kv = 7 * bq + bq // 2 + 3, 9 * bkv - 5  # partial last blocks on both axes
        mask = random_mask(2, 3, seq_q, seq_kv, bq, bkv, density=0.35, seed=gi, device=device)
        q, k, v = random_qkv(2, seq_q, seq_kv, 3, kernel.head_dim, dtype, device, seed=gi)
        state = build_mask_state(mask)
        for plan in plans_to_check(kernel, bq, bkv, SPLITS):
            reason = rejection(plan, device_request(q, k, mask, plan))
            if reason is not None:
                skipped = reason
                continue
            prepared = prepare(plan, state)
            out, lse = ops.run_native(prepared, q, k, v, 1.0 / math.sqrt(kernel.head_dim), True)
            acc = check_against_reference(out, lse, q, k, v, mask)
            checked += 1
            if not acc.ok():
                failures.append(f"{plan.name}: {acc}")
    if checked == 0:
        pytest.skip(f"no plan of {kernel.name} is eligible on this device ({skipped})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("splits", [1, 4])
def test_poisoned_outputs_are_fully_written(splits, family):
    from tessera_diffusers import ops

    device = torch.device("cuda")
    kernel = fixed_kernel(family, 64, 64 if family == "portable" else 128, 128, "bf16")
    mask = random_mask(1, 2, 1000, 1000, 32, 16, density=0.3, seed=5, device=device)
    q, k, v = random_qkv(1, 1000, 1000, 2, 128, torch.bfloat16, device, seed=5)
    plan = PhysicalPlan(32, 16, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, splits), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 2, 1000), float("nan"), device=device)
    workspace = prepared.workspace(1, 2, 128).allocate(device) if splits > 1 else None
    ops.launch(q, k, v, prepared.tile_counts, prepared.tile_slots, prepared.tile_member, prepared.q_order,
               kernel.name, prepared.launch_config(), 1 / math.sqrt(128), out, lse, workspace)
    torch.cuda.synchronize()
    assert not bool(out.isnan().any()) and not bool(lse.isnan().any())
    assert check_against_reference(out, lse, q, k, v, mask).ok()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("splits", [1, 3])
def test_non_finite_scores_and_empty_rows_follow_the_executor(family, splits):
    """A row with a +inf score gets NaN and lse +inf, a row with a NaN score NaN and NaN, a row
    with no active key 0 and -inf: the executor's values (the oracle's), with one and several splits."""
    from tessera_diffusers import ops
    from tessera_diffusers.executor import run_prepared

    device = torch.device("cuda")
    kernel = fixed_kernel(family, 128, 64 if family == "portable" else 128, 128, "bf16")
    mask = random_mask(1, 2, 1000, 900, 32, 16, density=0.3, seed=9, device=device)
    q, k, v = random_qkv(1, 1000, 900, 2, 128, torch.bfloat16, device, seed=9)
    k = k.abs() + 0.1  # positive keys: a query with +inf in dim 0 scores +inf against every key
    active = [int(torch.nonzero(mask.to_dense(0, h).any(-1))[3]) for h in range(2)]
    q[0, active[0], 0, 0] = math.inf  # every active score of the row +inf
    q[0, active[1], 1, 3] = math.nan  # every active score of the row NaN
    seen = int(torch.nonzero(mask.to_dense(0, 1).any(0))[-1])
    k[0, seen, 1, 5] = math.nan  # one NaN score in each row of head 1 that sees this key
    plan = PhysicalPlan(32, 16, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, splits), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    out, lse = ops.run_native(prepared, q, k, v, 0.09, True)
    want, want_lse = run_prepared(prepared, q, k, v, 0.09, True)
    for value, what in ((math.inf, "+inf"), (-math.inf, "-inf")):
        assert bool((want_lse == value).any()), f"no {what} row in the executor's lse"
        assert torch.equal(lse == value, want_lse == value), f"{what} rows of the lse differ"
    assert bool(want_lse.isnan().any())
    assert torch.equal(lse.isnan(), want_lse.isnan()), "NaN rows of the lse differ"
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-3, rtol=0)
    rows_nan = want.isnan().transpose(1, 2)  # [B, H, Sq, D]
    assert torch.equal(out.isnan().transpose(1, 2), rows_nan)
    assert bool(rows_nan[0, 0, active[0]].all()) and bool(rows_nan[0, 1, active[1]].all())
    empty = want_lse == -math.inf
    assert bool((out.transpose(1, 2)[empty] == 0).all())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seq_q, seq_kv", [(5, 3), (70, 9), (17, 130)])
def test_sequences_shorter_than_a_tile(family, seq_q, seq_kv):
    """Sequences shorter than one tile or one KV slot (TMA boxes reach past the tensor's end)."""
    from tessera_diffusers import ops

    device = torch.device("cuda")
    kernel = fixed_kernel(family, 128, 128, 128, "bf16")
    mask = random_mask(1, 2, seq_q, seq_kv, 64, 64, density=1.0, empty_rows=False, seed=seq_q, device=device)
    q, k, v = random_qkv(1, seq_q, seq_kv, 2, 128, torch.bfloat16, device, seed=seq_q)
    plan = PhysicalPlan(64, 64, KvLayout.PACKED, TaskOrganization(), kernel)
    out, lse = ops.run_native(prepare(plan, build_mask_state(mask)), q, k, v, 0.088, True)
    acc = check_against_reference(out, lse, q, k, v, mask, 0.088)
    assert acc.ok(), str(acc)


@pytest.mark.parametrize("family", FAMILIES)
def test_persistent_grid_matches(family):
    from tessera_diffusers import ops

    device = torch.device("cuda")
    kernel = fixed_kernel(family, 128, 128, 128, "fp16")
    mask = random_mask(2, 4, 3000, 2900, 64, 64, density=0.3, seed=7, device=device)
    q, k, v = random_qkv(2, 3000, 2900, 4, 128, torch.float16, device, seed=7)
    plan = PhysicalPlan(64, 64, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 1, persistent=True), kernel)
    out, lse = ops.run_native(prepare(plan, build_mask_state(mask)), q, k, v, 0.1, True)
    assert check_against_reference(out, lse, q, k, v, mask, 0.1).ok()


@pytest.mark.parametrize("density", [0.3, 0.0])
def test_dynamic_schedule_equals_static(density):
    """A persistent Hopper grid launched eagerly takes its tasks from a counter of its own (zeroed
    by the launch); the custom op strides statically. Each task's arithmetic is the same wherever
    it runs: outputs equal bit for bit, for repeated launches of one prepared plan (the counter is
    per launch) and for a mask whose every row is empty (every task hands over no Q)."""
    from tessera_diffusers import ops

    device = torch.device("cuda")
    kernel = fixed_kernel("hopper", 128, 128, 128, "bf16")
    mask = random_mask(2, 3, 5000, 4100, 64, 64, density=max(density, 0.01), seed=11, device=device)
    if density == 0.0:
        mask = type(mask).from_blocks(torch.zeros_like(mask.blocks), 64, 64, 5000, 4100)
    plan = PhysicalPlan(64, 64, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 1, persistent=True), kernel)
    assert ops.dynamic_schedule(plan)
    prepared = prepare(plan, build_mask_state(mask))
    q, k, v = random_qkv(2, 5000, 4100, 3, 128, torch.bfloat16, device, seed=11)
    op_out, op_lse = torch.ops.tessera.sparse_attention_fwd(
        q, k, v, prepared.tile_counts, prepared.tile_slots, prepared.tile_member, prepared.q_order,
        kernel.name, list(prepared.launch_config()), 0.09)
    assert check_against_reference(op_out, op_lse, q, k, v, mask, 0.09).ok()
    for _ in range(3):
        out, lse = ops.run_direct(prepared, q, k, v, 0.09, True)
        assert torch.equal(out, op_out) and torch.equal(lse, op_lse)


@pytest.mark.parametrize("family", FAMILIES)
def test_offsets_past_two_to_the_31(family):
    """B * S * H * D > 2^31: the last (b, h) rows must still land in the right place."""
    from tessera_diffusers import LogicalMask, ops

    device = torch.device("cuda")
    batch, seq, heads, dim = 2, 75600, 120, 128
    assert batch * seq * heads * dim > 2**31
    q = torch.randn(batch, seq, heads, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    n = math.ceil(seq / 128)
    blocks = torch.zeros(batch, heads, n, n, dtype=torch.bool, device=device)
    blocks[-1, -1, -3:, -4:] = True  # only the very end of the tensors is active
    mask = LogicalMask(blocks, 128, 128, seq, seq)
    kernel = fixed_kernel(family, 128, 128, 128, "bf16")
    plan = PhysicalPlan(128, 128, KvLayout.CONTIGUOUS, TaskOrganization(), kernel)
    out, lse = ops.run_native(prepare(plan, build_mask_state(mask)), q, k, v, 1 / math.sqrt(dim), True)
    r0 = (n - 3) * 128
    sub_mask = LogicalMask(blocks[-1:, -1:, -3:, :], 128, 128, seq - r0, seq)
    acc = check_against_reference(
        out[-1:, r0:, -1:], lse[-1:, -1:, r0:], q[-1:, r0:, -1:], k[-1:, :, -1:], v[-1:, :, -1:], sub_mask
    )
    assert acc.ok(), str(acc)
    assert bool((out[:1] == 0).all()) and bool((out[-1:, :r0] == 0).all())


def test_public_api_routes_to_native():
    from tessera_diffusers import Runtime, block_sparse_attention

    device = torch.device("cuda")
    mask = random_mask(1, 4, 4096, 4096, 64, 64, density=0.2, seed=3, device=device)
    q, k, v = random_qkv(1, 4096, 4096, 4, 128, torch.bfloat16, device, seed=3)
    runtime = Runtime()
    out, lse = block_sparse_attention(q, k, v, mask, return_lse=True, runtime=runtime)
    assert check_against_reference(out, lse, q, k, v, mask).ok()
    block_sparse_attention(q, k, v, mask, runtime=runtime)
    assert runtime.hits == 0 and runtime.misses == 2  # return_lse is part of the request
    block_sparse_attention(q, k, v, mask, runtime=runtime)
    assert runtime.hits == 1


def test_torch_compile_and_cuda_graph():
    from tessera_diffusers import ops

    device = torch.device("cuda")
    kernel = fixed_kernel("portable", 64, 128, 64, "bf16")
    mask = random_mask(1, 2, 2048, 2048, 32, 32, density=0.3, seed=11, device=device)
    q, k, v = random_qkv(1, 2048, 2048, 2, 64, torch.bfloat16, device, seed=11)
    plan = PhysicalPlan(32, 32, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 2), kernel)
    prepared = prepare(plan, build_mask_state(mask))

    def f(q, k, v):
        return ops.run_native(prepared, q, k, v, 0.125, False) * 2

    compiled = torch.compile(f, fullgraph=True)
    expected = f(q, k, v)
    torch.testing.assert_close(compiled(q, k, v), expected)

    static_q = q.clone()
    f(static_q, k, v)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = f(static_q, k, v)
    static_q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(static_out, f(static_q, k, v))


@pytest.mark.parametrize("splits", SPLITS)
def test_direct_launch_equals_the_custom_op(splits):
    """The eager path (a launch template kept on the prepared plan) and the traceable custom op
    launch the same kernel: outputs equal bit for bit, with and without lse, for repeated calls
    with other inputs (the template keeps no tensor pointers)."""
    from tessera_diffusers import ops

    device = torch.device("cuda")
    kernel = fixed_kernel("portable", 128, 64, 128, "bf16")
    mask = random_mask(2, 3, 1000, 1100, 64, 64, density=0.3, seed=5, device=device)
    plan = PhysicalPlan(64, 64, KvLayout.CONTIGUOUS, TaskOrganization(Traversal.LONGEST_FIRST, splits), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    for seed in (1, 2):
        q, k, v = random_qkv(2, 1000, 1100, 3, 128, torch.bfloat16, device, seed=seed)
        direct_out, direct_lse = ops.run_direct(prepared, q, k, v, 0.09, True)
        op_out, op_lse = torch.ops.tessera.sparse_attention_fwd(
            q, k, v, prepared.tile_counts, prepared.tile_slots, prepared.tile_member, prepared.q_order,
            kernel.name, list(prepared.launch_config()), 0.09)
        assert torch.equal(direct_out, op_out) and torch.equal(direct_lse, op_lse)
        assert torch.equal(ops.run_direct(prepared, q, k, v, 0.09, False), op_out)
    assert len(prepared.launch_state.templates) == 1
