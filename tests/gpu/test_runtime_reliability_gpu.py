"""The runtime under misuse on the GPU: a loop of new masks holds no device memory, metadata that
do not match the tensors are refused before any launch, gradients are refused rather than dropped,
a mask written in place is prepared again, and one Runtime serves many threads."""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers import LogicalMask, Runtime, block_sparse_attention, build_mask_state, prepare, reference
from tessera_diffusers.catalog import all_kernels
from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.ops import run_native
from tessera_diffusers.plans import KvLayout, PhysicalPlan, TaskOrganization
from tessera_diffusers.testing import random_mask, run_in_threads

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


def qkv(batch, seq, heads, dim=128, seed=0, seq_kv=None):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shapes = ((batch, seq, heads, dim), (batch, seq_kv or seq, heads, dim), (batch, seq_kv or seq, heads, dim))
    return tuple(torch.randn(s, generator=gen, device=DEVICE, dtype=torch.bfloat16) for s in shapes)


def new_mask(seed: int, heads: int = 2, seq: int = 32768, block: int = 128) -> LogicalMask:
    n = seq // block
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks = torch.rand(1, heads, n, n, generator=gen, device=DEVICE) < 0.05
    blocks |= torch.eye(n, dtype=torch.bool, device=DEVICE)
    return LogicalMask(blocks, block, block, seq, seq)


def test_a_loop_of_new_masks_holds_no_device_memory():
    """10,000 new masks at 32k tokens through one Runtime: device memory stays within 5% of its level
    after the first 256 calls, and once the last mask is dropped the runtime holds nothing."""
    runtime = Runtime()
    q, k, v = qkv(1, 32768, 2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    level = None
    for i in range(10_000):
        mask = new_mask(i % 64)  # new objects; 64 patterns keep mask making cheap
        block_sparse_attention(q, k, v, mask, runtime=runtime)
        if i == 255:
            torch.cuda.synchronize()
            level = torch.cuda.memory_allocated()
        del mask
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    print(f"device memory: {before} B before, {level} B after 256 masks, {after} B after 10,000")
    assert abs(after - level) <= 0.05 * level, (before, level, after)
    assert len(runtime._cache) == 0 and runtime.misses == 10_000
    assert after - before < 8 << 20, (before, after)  # no mask's metadata is left


def prepared_on(mask: LogicalMask):
    kernel = next(k for k in all_kernels() if k.family.value == "hopper" and (k.tile_q, k.tile_kv, k.head_dim, k.dtype,
                                                                           k.stages) == (128, 128, 128, "bf16", 2))
    plan = PhysicalPlan(mask.block_q, mask.block_kv, KvLayout.PACKED, TaskOrganization(), kernel)
    return prepare(plan, build_mask_state(mask))


MISMATCHES = ("batch", "heads", "queries", "keys", "k/v shapes", "v dtype", "slots", "capacity", "query tiles")


def mismatches():
    mask = random_mask(2, 2, 1024, 1024, 64, 64, seed=1, device=DEVICE)
    prepared = prepared_on(mask)
    q, k, v = qkv(2, 1024, 2)
    yield "batch", prepared, qkv(4, 1024, 2), None
    yield "heads", prepared, qkv(2, 1024, 4), None
    yield "queries", prepared, (qkv(2, 2048, 2)[0], k, v), None
    yield "keys", prepared, qkv(2, 1024, 2, seq_kv=2048), None
    yield "k/v shapes", prepared, (q, k, v[:, :512]), None
    yield "v dtype", prepared, (q, k, v.half()), None
    config = prepared.launch_config()
    yield "slots", prepared, (q, k, v), list(config._replace(slots=64, kv_unit_log2=1))
    yield "capacity", prepared, (q, k, v), list(config._replace(capacity=config.capacity + 3))
    yield "query tiles", prepared, (q, k, v), list(config._replace(num_q_tiles=config.num_q_tiles + 1))


@pytest.mark.parametrize("name", MISMATCHES)
def test_mismatched_metadata_are_refused_before_any_launch(name):
    _, prepared, (q, k, v), config = next(case for case in mismatches() if case[0] == name)
    torch.cuda.synchronize()
    with pytest.raises(InvalidArgumentError), torch.no_grad():
        if config is None:
            run_native(prepared, q, k, v, 0.088, False)
        else:  # the public custom op with a forged config
            torch.ops.tessera.sparse_attention_fwd(q, k, v, prepared.tile_counts, prepared.tile_slots,
                                                   prepared.tile_member, prepared.q_order, prepared.plan.kernel.name,
                                                   config, 0.088, None)
    torch.cuda.synchronize()  # nothing was launched that could fault


def test_gradients_are_refused_on_the_native_path():
    mask = random_mask(1, 2, 1024, 1024, 64, 64, seed=2, device=DEVICE)
    q, k, v = qkv(1, 1024, 2)
    q.requires_grad_()
    with pytest.raises(InvalidArgumentError, match="do not require grad"):
        block_sparse_attention(q, k, v, mask)
    with torch.no_grad():
        out = block_sparse_attention(q, k, v, mask)
    torch.testing.assert_close(out.float(), reference.attention(q.detach(), k, v, mask).float(), atol=2e-2, rtol=2e-2)


def test_a_mask_written_in_place_is_prepared_again_on_the_gpu():
    runtime = Runtime()
    mask = random_mask(1, 2, 1024, 1024, 64, 64, density=0.3, seed=3, device=DEVICE)
    q, k, v = qkv(1, 1024, 2)
    first = block_sparse_attention(q, k, v, mask, runtime=runtime)
    mask.blocks.logical_not_()
    again = block_sparse_attention(q, k, v, mask, runtime=runtime)
    torch.testing.assert_close(again.float(), reference.attention(q, k, v, mask).float(), atol=2e-2, rtol=2e-2)
    assert not torch.allclose(first, again) and runtime.misses == 2


def test_one_runtime_serves_eight_threads_on_the_gpu():
    runtime = Runtime(max_entries=3)
    q, k, v = qkv(1, 2048, 2)
    kept = [random_mask(1, 2, 2048, 2048, 64, 64, density=0.3, seed=s, device=DEVICE) for s in range(4)]
    expected = [block_sparse_attention(q, k, v, m) for m in kept]
    sizes = []

    def worker(index: int) -> None:
        for call in range(500):
            which = (index + call) % 4
            mask = kept[which] if call % 3 else LogicalMask(kept[which].blocks.clone(), 64, 64, 2048, 2048)
            out = block_sparse_attention(q, k, v, mask, runtime=runtime)
            sizes.append(len(runtime._cache))
            # A mask that comes back may be re-prepared in the grouped query layout: same values
            # up to bf16 rounding.
            if not torch.allclose(out.float(), expected[which].float(), atol=2e-2, rtol=2e-2):
                raise AssertionError(f"call {call}: output differs")

    errors = run_in_threads(worker, 8)
    assert not errors, errors[:3]
    assert len(sizes) == 4000 and max(sizes) <= 3
