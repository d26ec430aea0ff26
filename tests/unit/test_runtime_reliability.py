"""The runtime under misuse (CPU): dropped masks are released at once, a mask written in place is
prepared again, forced plans are checked, gradients never silently vanish on the native path, the
launch refuses metadata that does not match its tensors, and one Runtime serves many threads."""

from __future__ import annotations

import ctypes.util
import os
import weakref

import pytest
import torch

from tessera_diffusers import LogicalMask, Runtime, block_sparse_attention, build_mask_state, library, reference
from tessera_diffusers.catalog import hopper_kernels, reference_kernel
from tessera_diffusers.errors import CatalogError, InvalidArgumentError
from tessera_diffusers.ops import check_launch, run_native
from tessera_diffusers.plans import KvLayout, PhysicalPlan, TaskOrganization
from tessera_diffusers.prepare import prepare
from tessera_diffusers.testing import random_mask, run_in_threads

SEQ, HEADS, DIM = 128, 2, 16


def executor_plan(block: int = 32) -> PhysicalPlan:
    """A plan of the PyTorch executor: on CPU it prepares metadata like a native plan does."""
    return PhysicalPlan(block, block, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(DIM, "fp32", 64, 64))


def qkv(batch: int = 1, seq: int = SEQ, heads: int = HEADS, dim: int = DIM, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, heads, dim, generator=gen).to(dtype) for _ in range(3))


def test_a_dropped_mask_and_its_prepared_plan_leave_the_cache_at_once():
    """The cached plan refers to a view of the mask, so the cache never keeps the user's mask alive:
    dropping it frees the entry by reference counting alone, no garbage collection needed."""
    runtime, (q, k, v) = Runtime(max_entries=8), qkv()
    for seed in range(20):
        mask = random_mask(1, HEADS, SEQ, SEQ, 32, 32, density=0.5, seed=seed)
        block_sparse_attention(q, k, v, mask, plan=executor_plan(), runtime=runtime)
        alive = weakref.ref(mask)
        assert len(runtime._cache) == 1 and next(iter(runtime._cache.values()))[-1] is not None  # a prepared plan
        del mask
        assert alive() is None and len(runtime._cache) == 0


def test_a_mask_written_in_place_is_prepared_again():
    runtime, (q, k, v) = Runtime(), qkv()
    mask = random_mask(1, HEADS, SEQ, SEQ, 32, 32, density=0.3, seed=1)
    for plan in (executor_plan(), None):  # the prepared path and the reference oracle behave the same
        first = block_sparse_attention(q, k, v, mask, plan=plan, runtime=runtime)
        torch.testing.assert_close(first, reference.attention(q, k, v, mask), atol=2e-5, rtol=1e-5)
        mask.blocks.logical_not_()
        again = block_sparse_attention(q, k, v, mask, plan=plan, runtime=runtime)
        torch.testing.assert_close(again, reference.attention(q, k, v, mask), atol=2e-5, rtol=1e-5)
        assert not torch.allclose(first, again)
    assert runtime.hits == 0 and runtime.misses == 4


def test_forced_plans_are_checked_before_they_run():
    with pytest.raises(InvalidArgumentError, match="num_splits: expected an int >= 1"):
        TaskOrganization(num_splits=0)
    with pytest.raises(InvalidArgumentError, match="persistent"):
        TaskOrganization(persistent=1)
    q, k, v = qkv()
    mask = random_mask(1, HEADS, SEQ, SEQ, 32, 32, seed=2)
    with pytest.raises(InvalidArgumentError, match="plan: expected a plan that can serve .*geometry_matches"):
        block_sparse_attention(q, k, v, mask, plan=executor_plan(block=64))
    split = PhysicalPlan(32, 32, KvLayout.CONTIGUOUS, TaskOrganization(num_splits=64), reference_kernel(DIM, "fp32"))
    with pytest.raises(InvalidArgumentError, match="splits_are_useful"):
        block_sparse_attention(q, k, v, mask, plan=split)


def native_prepared(mask: LogicalMask, head_dim: int = 64):
    """A Hopper plan prepared on CPU tensors: its metadata are what a launch would read."""
    kernel = next(k for k in hopper_kernels() if (k.tile_q, k.tile_kv, k.head_dim, k.dtype) == (128, 128, head_dim,
                                                                                              "bf16"))
    plan = PhysicalPlan(mask.block_q, mask.block_kv, KvLayout.PACKED, TaskOrganization(), kernel)
    return prepare(plan, build_mask_state(mask))


def test_the_native_path_refuses_tensors_that_require_grad():
    mask = random_mask(1, HEADS, 256, 256, 64, 64, seed=3)
    prepared = native_prepared(mask)
    q, k, v = (t.requires_grad_() for t in qkv(seq=256, dim=64, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgumentError, match="do not require grad"):
        run_native(prepared, q, k, v, 0.125, False)


def mismatched_calls():
    """(what, q, k, v, metadata, config) that no kernel may read: each would read past an allocation."""
    mask = random_mask(2, HEADS, 256, 256, 64, 64, seed=4)
    prepared = native_prepared(mask)
    q, k, v = qkv(batch=2, seq=256, dim=64, dtype=torch.bfloat16)
    meta, config = prepared.metadata, prepared.launch_config()
    bigger = qkv(batch=4, seq=256, dim=64, dtype=torch.bfloat16)
    yield "batch of q beyond the mask's", prepared, bigger, meta, config
    more_heads = qkv(batch=2, seq=256, heads=4, dim=64, dtype=torch.bfloat16)
    yield "heads of q beyond the mask's", prepared, more_heads, meta, config
    yield "longer queries", prepared, (qkv(batch=2, seq=384, dim=64, dtype=torch.bfloat16)[0], k, v), meta, config
    longer = qkv(batch=2, seq=384, dim=64, dtype=torch.bfloat16)
    yield "longer keys", prepared, (q, longer[1], longer[2]), meta, config
    yield "k and v of other shapes", prepared, (q, k, v[:, :128]), meta, config
    yield "v of another dtype", prepared, (q, k, v.half()), meta, config
    # 64 slots of 2 tokens: past the kernel's slot array
    yield "more slots than the kernel holds", None, (q, k, v), meta, list(config._replace(slots=64, kv_unit_log2=1))
    yield ("a capacity the metadata do not have", None, (q, k, v), meta,
           list(config._replace(capacity=config.capacity + 3)))
    yield ("more query tiles than Sq makes", None, (q, k, v), meta,
           list(config._replace(num_q_tiles=config.num_q_tiles + 1)))
    yield "a config of six ints", None, (q, k, v), meta, list(config)[:6]


@pytest.mark.parametrize("case", list(mismatched_calls()), ids=lambda c: c[0])
def test_launch_refuses_metadata_that_do_not_match_the_tensors(case):
    _, prepared, (q, k, v), meta, config = case
    with pytest.raises(InvalidArgumentError):
        if prepared is not None:  # the product's path: the check runs before the launch template is built
            with torch.no_grad():
                run_native(prepared, q, k, v, 0.125, False)
        else:  # the custom op's check (its CUDA body calls the same function first)
            check_launch(q, k, v, native_prepared(random_mask(2, HEADS, 256, 256, 64, 64, seed=4)).plan.kernel,
                         meta, config)


def test_launch_accepts_what_prepare_builds():
    for batch, heads in ((1, 1), (2, HEADS)):  # a broadcast mask and a full one
        mask = random_mask(batch, heads, 300, 200, 64, 64, seed=5)
        prepared = native_prepared(mask)
        q, _, _ = qkv(batch=2, seq=300, dim=64, dtype=torch.bfloat16)
        k, v, _ = qkv(batch=2, seq=200, dim=64, dtype=torch.bfloat16)
        prepared.check_call(q, k, v)
        check_launch(q, k, v, prepared.plan.kernel, prepared.metadata, prepared.launch_config())


def test_one_runtime_serves_eight_threads():
    """8 threads x 500 calls on one Runtime, on masks that stay and masks made per call, a cache
    bound small enough to evict all the time: no exception, the bound kept, every output equal to
    the single-threaded one."""
    runtime = Runtime(max_entries=3)
    q, k, v = qkv()
    kept = [random_mask(1, HEADS, SEQ, SEQ, 32, 32, density=0.4, seed=s) for s in range(4)]
    expected = [block_sparse_attention(q, k, v, m, plan=executor_plan()) for m in kept]
    sizes = []

    def worker(index: int) -> None:
        for call in range(500):
            which = (index + call) % 4
            mask = kept[which] if call % 3 else LogicalMask(kept[which].blocks.clone(), 32, 32, SEQ, SEQ)
            out = block_sparse_attention(q, k, v, mask, plan=executor_plan(), runtime=runtime)
            sizes.append(len(runtime._cache))
            if not torch.equal(out, expected[which]):
                raise AssertionError(f"call {call}: output differs")

    errors = run_in_threads(worker, 8, switch_interval=1e-6)  # switch threads as often as possible
    assert not errors, errors[:3]
    assert len(sizes) == 4000 and max(sizes) <= 3


def test_native_lib_override_must_be_a_tessera_library(monkeypatch):
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no C math library to stand in for a foreign shared library")
    path = next((os.path.join(d, libm) for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64",
                                                 "/usr/lib64", "/lib", "/usr/lib")
                 if os.path.isfile(os.path.join(d, libm))), None)
    if path is None:
        pytest.skip(f"{libm} not found on disk")
    monkeypatch.setenv("TESSERA_NATIVE_LIB", path)
    library.load_library.cache_clear()
    try:
        with pytest.raises(CatalogError, match="is not a Tessera kernel library"):
            library.load_library()
    finally:
        library.load_library.cache_clear()


STUB_LIBRARY = r"""
#include <stddef.h>
int tessera_abi_version(void) { return ABI; }
int tessera_num_kernels(void) { return 0; }
const char* tessera_kernel_name(int id) { return NULL; }
const char* tessera_error_string(int e) { return "stub"; }
int tessera_attention_forward(int id, const void* p, void* s) { return 1; }
int tessera_split_merge(const void* p, void* s) { return 1; }
int tessera_struct_bytes(int which) { return which == WRONG ? SIZE : which == 0 ? ATTN : which == 1 ? MERGE : -1; }
"""


@pytest.mark.parametrize("struct", [library.TesseraAttnParams, library.TesseraMergeParams])
def test_a_library_whose_launch_structs_differ_from_their_mirrors_is_refused_at_load(monkeypatch, tmp_path, struct):
    """The launch and merge parameters cross the C ABI on every call: a library built from other
    headers than the package's mirrors must fail at load, naming the struct, not misread fields."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in library")
    source, path = tmp_path / "stub.c", tmp_path / "libstub.so"
    source.write_text(STUB_LIBRARY)
    wrong = ctypes.sizeof(struct) + 8
    subprocess.run([compiler, "-shared", "-fPIC", f"-DABI={library.ABI_VERSION}", f"-DWRONG={library.STRUCT_IDS[struct]}",
                    f"-DSIZE={wrong}", f"-DATTN={ctypes.sizeof(library.TesseraAttnParams)}",
                    f"-DMERGE={ctypes.sizeof(library.TesseraMergeParams)}", "-o", str(path), str(source)], check=True)
    monkeypatch.setenv("TESSERA_NATIVE_LIB", str(path))
    library.load_library.cache_clear()
    try:
        with pytest.raises(CatalogError, match=f"{struct.__name__} has {wrong} bytes"):
            library.load_library()
    finally:
        library.load_library.cache_clear()


def test_a_runtime_in_use_can_be_deep_copied():
    """A model holding a Runtime (the processor's per-layer ones) must stay copyable (EMA copies,
    checkpoints in memory); the copy gets a lock of its own."""
    import copy

    runtime, (q, k, v) = Runtime(), qkv()
    mask = random_mask(1, HEADS, SEQ, SEQ, 32, 32, seed=6)
    first = block_sparse_attention(q, k, v, mask, plan=executor_plan(), runtime=runtime)
    twin = copy.deepcopy(runtime)
    assert twin._lock is not runtime._lock
    assert torch.equal(block_sparse_attention(q, k, v, mask, plan=executor_plan(), runtime=twin), first)


def test_log_records_go_to_the_package_logger(caplog, tmp_path):
    """Informational events are log records of the "tessera_diffusers" logger (a NullHandler keeps
    them silent unless the application configures logging), not warnings."""
    import logging
    import shutil
    import warnings

    from tessera_diffusers.plan_table import load_table_file, shipped_table_path

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("tessera_diffusers").handlers)
    copy = tmp_path / "plan_table_sm90.json"
    shutil.copy(shipped_table_path("sm90"), copy)
    with caplog.at_level(logging.INFO, logger="tessera_diffusers"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_table_file(str(copy)).table is not None
    (record,) = [r for r in caplog.records if r.name == "tessera_diffusers.plan_table"]
    assert str(copy) in record.getMessage() and "request keys" in record.getMessage()
