"""The ctypes launch parameters the eager native path fills (``ops.run_direct``), checked field by
field on the CPU with the launch itself intercepted: pointers of this call's tensors, strides,
sizes and the plan's metadata, and the split-K merge. Needs the native library to load (it is
built by ``pip install .`` where nvcc exists); no GPU."""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers import KvLayout, PhysicalPlan, TaskOrganization, Traversal, build_mask_state, prepare
from tessera_diffusers.catalog import portable_kernels
from tessera_diffusers.errors import CatalogError
from tessera_diffusers.testing import random_mask, random_qkv

ops = pytest.importorskip("tessera_diffusers.ops")


@pytest.fixture()
def launches(monkeypatch):
    try:
        ops.load_library()
    except CatalogError as err:
        pytest.skip(f"native library not loadable here: {err}")
    seen = []
    monkeypatch.setattr(ops, "launch_filled", lambda template, p, m, device: seen.append((template, p, m)))
    return seen


@pytest.mark.parametrize("splits", (1, 3))
def test_direct_launch_fills_every_field(launches, splits):
    kernel = next(k for k in portable_kernels() if (k.tile_q, k.tile_kv, k.head_dim, k.dtype) == (64, 64, 64, "bf16"))
    mask = random_mask(2, 1, 300, 500, 32, 32, density=0.3, seed=2)
    plan = PhysicalPlan(32, 32, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, splits), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    q, k, v = random_qkv(2, 300, 500, 3, 64, torch.bfloat16, torch.device("cpu"), seed=1)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # other (b, s, h) strides than q's
    for call in range(2):
        out, lse = ops.run_direct(prepared, q, k, v, 0.125, True)
        template, p, m = launches[-1]
        assert (p.q, p.k, p.v, p.o, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
        assert [list(s) for s in (p.q_stride, p.k_stride, p.v_stride, p.o_stride)] == \
            [list(t.stride()[:3]) for t in (q, k, v, out)]
        assert (p.batch, p.heads, p.seq_q, p.seq_kv, p.mask_batch, p.mask_heads) == (2, 3, 300, 500, 2, 1)
        assert [p.num_q_tiles, p.capacity, p.slots, p.q_unit_log2, p.kv_unit_log2, p.num_splits] == \
            list(prepared.launch_config())[:6]
        assert (p.tile_counts, p.tile_slots, p.tile_member, p.q_order) == tuple(
            t.data_ptr() for t in (prepared.tile_counts, prepared.tile_slots, prepared.tile_member, prepared.q_order))
        assert p.grid_size == 0 and p.scale_log2 == pytest.approx(0.125 * ops.LOG2E)
        assert template.kernel_id == ops.load_library().kernel_ids[kernel.name]
        if splits == 1:
            assert m is None and not p.o_partial
        else:
            assert (m.o_partial, m.lse_partial, m.o, m.lse) == (p.o_partial, p.lse_partial, p.o, p.lse) and p.o_partial
            assert (m.batch, m.heads, m.seq_q, m.head_dim, m.num_splits, m.dtype) == (2, 3, 300, 64, splits, 0)
            assert list(m.o_stride) == list(out.stride()[:3])
    assert len(prepared.launch_state.templates) == 1  # the second call reused the template
    out = ops.run_direct(prepared, q, k, v, 0.125, False)
    assert not launches[-1][1].lse and launches[-1][1].o == out.data_ptr()

    # The next mask of the same request (uncompacted: the same launch config): the process-wide
    # template is reused, bound to that mask's metadata.
    for seed in (9, 10):
        nxt = prepare(plan, build_mask_state(random_mask(2, 1, 300, 500, 32, 32, density=0.3, seed=seed)),
                      compact=False)
        info = ops.unbound_template.cache_info()
        ops.run_direct(nxt, q, k, v, 0.125, True)
        if seed == 10:
            assert ops.unbound_template.cache_info().hits == info.hits + 1
        p = launches[-1][1]
        assert (p.tile_counts, p.tile_slots, p.tile_member, p.q_order) == tuple(
            t.data_ptr() for t in (nxt.tile_counts, nxt.tile_slots, nxt.tile_member, nxt.q_order))


def test_the_custom_op_launch_fills_the_same_fields(launches):
    """``ops.launch`` (the custom op's body) builds its parameters like the eager path."""
    kernel = next(k for k in portable_kernels() if (k.tile_q, k.tile_kv, k.head_dim, k.dtype) == (128, 64, 128, "fp16"))
    mask = random_mask(1, 2, 700, 700, 64, 64, density=0.4, seed=3)
    plan = PhysicalPlan(64, 64, KvLayout.CONTIGUOUS, TaskOrganization(Traversal.LONGEST_FIRST, 2), kernel)
    prepared = prepare(plan, build_mask_state(mask))
    q, k, v = random_qkv(1, 700, 700, 2, 128, torch.float16, torch.device("cpu"), seed=4)
    ops.run_direct(prepared, q, k, v, 0.1, True)
    direct = launches[-1][1]
    out, lse, workspace, _ = ops.output_buffers(q, 2, True)
    ops.launch(q, k, v, prepared.tile_counts, prepared.tile_slots, prepared.tile_member, prepared.q_order,
               kernel.name, prepared.launch_config(), 0.1, out, lse, workspace)
    _, p, m = launches[-1]
    pointers = {"q", "k", "v", "o", "lse", "o_partial", "lse_partial"}
    for name, _ in ops.TesseraAttnParams._fields_:
        if name not in pointers:
            a, b = getattr(p, name), getattr(direct, name)
            assert (list(a) if hasattr(a, "__len__") else a) == (list(b) if hasattr(b, "__len__") else b), name
    assert (p.o, p.lse, p.o_partial) == (out.data_ptr(), lse.data_ptr(), workspace[0].data_ptr())
    assert (m.o, m.lse_partial) == (out.data_ptr(), workspace[1].data_ptr())


def test_persistent_hopper_launches_count_tasks_in_their_own_output(launches, monkeypatch):
    """A persistent Hopper plan launched eagerly gets the address of a task counter just past its
    output (one allocation per launch, so no two launches share one); the custom op, the portable
    family and non-persistent grids stride statically (no counter)."""
    from types import SimpleNamespace

    from tessera_diffusers.catalog import hopper_kernels

    # A persistent grid is sized from the device's SMs: an H200's here.
    monkeypatch.setattr(ops, "ctas_per_sm", lambda kernel, index: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=132))
    ops.unbound_template.cache_clear()

    kernel = next(k for k in hopper_kernels() if (k.tile_q, k.tile_kv, k.head_dim, k.dtype) == (128, 128, 128, "bf16"))
    if kernel.name not in ops.load_library().kernel_ids:
        pytest.skip(f"{kernel.name} is not in this build of the library")
    mask = random_mask(1, 2, 700, 700, 64, 64, density=0.4, seed=3)
    q, k, v = random_qkv(1, 700, 700, 2, 128, torch.bfloat16, torch.device("cpu"), seed=4)
    persistent = TaskOrganization(Traversal.LONGEST_FIRST, 1, persistent=True)
    prepared = prepare(PhysicalPlan(64, 64, KvLayout.PACKED, persistent, kernel), build_mask_state(mask))
    counters = set()
    for _ in range(2):
        out = ops.run_direct(prepared, q, k, v, 0.1, False)
        p = launches[-1][1]
        assert p.task_counter == out.data_ptr() + out.numel() * out.element_size() and p.grid_size == 132
        counters.add(p.task_counter)
        assert out.untyped_storage().nbytes() >= out.numel() * out.element_size() + ops.TASK_COUNTER_BYTES
        del out
    out, lse, workspace, counter = ops.output_buffers(q, 1, True)  # the custom op's body
    ops.launch(q, k, v, prepared.tile_counts, prepared.tile_slots, prepared.tile_member, prepared.q_order,
               kernel.name, prepared.launch_config(), 0.1, out, lse, workspace)
    assert counter is None and launches[-1][1].task_counter is None
    for org, family_kernel in ((TaskOrganization(), kernel), (persistent, next(
            k for k in portable_kernels() if (k.tile_q, k.tile_kv, k.head_dim, k.dtype) == (128, 128, 128, "bf16")))):
        other = prepare(PhysicalPlan(64, 64, KvLayout.PACKED, org, family_kernel), build_mask_state(mask))
        ops.run_direct(other, q, k, v, 0.1, False)
        assert launches[-1][1].task_counter is None
    ops.unbound_template.cache_clear()  # no template with this test's grid size outlives it


def test_tensors_the_kernels_cannot_load_are_copied_to_aligned_storage():
    """cp.async and TMA read 16-byte chunks: a view at an odd storage offset is copied even when it is
    contiguous (``contiguous()`` would return it as it is), a strided view too; aligned ones pass."""
    from tessera_diffusers.ops import aligned, with_aligned_loads

    base = torch.randn(1 * 64 * 2 * 128 + 1, dtype=torch.bfloat16)
    shifted = base[1:].view(1, 64, 2, 128)  # contiguous, base 2 bytes past an aligned address
    assert shifted.is_contiguous() and not aligned(shifted) and not aligned(shifted.contiguous())
    copy = with_aligned_loads(shifted)
    assert aligned(copy) and torch.equal(copy, shifted)
    strided = torch.randn(1, 64, 3, 128, dtype=torch.bfloat16)[:, :, 1:, :]  # h stride 128, s stride 384
    assert with_aligned_loads(strided) is strided  # its strides are multiples of 8 elements
    odd = torch.randn(1, 64, 2, 132, dtype=torch.bfloat16)[..., :128]  # s stride 264, h stride 132
    assert not aligned(odd) and aligned(with_aligned_loads(odd)) and torch.equal(with_aligned_loads(odd), odd)
    ok = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    assert with_aligned_loads(ok) is ok
