"""Native launch preparation and mask statistics without a GPU: the dispatch between the native and
the torch code, and the Python side of the native path (struct mirrors, buffer layout, views, op
counts) run against an emulation of the CUDA kernels in Python over raw memory.

The emulation follows ``csrc/include/tessera/prepare.cuh`` one CTA at a time (the same geometry,
flags, scan positions, read-back of the slots, rank keys and per-row counts), so its agreement with
the torch code checks the kernels' index math as well; ``test_native_prepare_gpu.py`` checks the
kernels themselves on a GPU."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import itertools
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera_diffusers import (
    InvalidArgumentError,
    KvLayout,
    LogicalMask,
    PhysicalPlan,
    TaskOrganization,
    Traversal,
    build_mask_state,
    library,
    mask_counts,
    mask_state,
    native_prepare,
    prepare,
)
from tessera_diffusers.catalog import reference_kernel
from tessera_diffusers.library import NativeLibrary
from tessera_diffusers.mask_state import count_blocks, group_activity, host_stats_from_counts, stats_from_counts
from tessera_diffusers.prepare import prepare_torch
from tessera_diffusers.testing import metadata_difference, metadata_plans, random_mask

prepare_module = importlib.import_module("tessera_diffusers.prepare")  # the package exports the function

CUDA_INVALID_VALUE = 1


def raw(address: int, ctype, count: int) -> np.ndarray:
    """``count`` elements of ``ctype`` at ``address`` as a writable numpy array (no copy)."""
    return np.ctypeslib.as_array((ctype * count).from_address(address))


def block_reader(m):
    """``active(b, h, i, j)`` over the TesseraBlockMask ``m`` (any strides)."""
    stride = list(m.stride)
    extent = sum((n - 1) * s for n, s in zip((m.batch, m.heads, m.rows, m.cols), stride)) + 1
    data = raw(m.blocks, ctypes.c_uint8, extent)
    return data, stride


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class EmulatedGeometry:
    """``make_geometry`` of prepare.cuh: the same checks and derived sizes."""

    def __init__(self, p):
        m = p.mask
        ok = all(v > 0 for v in (p.block_q, p.block_kv, p.seq_q, p.seq_kv, p.tile_q, p.tile_kv, p.q_unit, p.kv_unit))
        ok = ok and m.blocks and min(m.batch, m.heads, m.rows, m.cols) >= 1 and min(m.stride) >= 0
        ok = ok and not (p.block_q % p.q_unit or p.tile_q % p.q_unit or p.block_kv % p.kv_unit or p.tile_kv % p.kv_unit)
        ok = ok and (p.tile_q // p.q_unit) * (p.tile_kv // p.kv_unit) <= 64
        ok = ok and m.rows == ceil_div(p.seq_q, p.block_q) and m.cols == ceil_div(p.seq_kv, p.block_kv)
        ok = ok and p.num_q_tiles == ceil_div(p.seq_q, p.tile_q)
        self.ok = bool(ok)
        if not self.ok:
            return
        self.p = p
        self.data, self.stride = block_reader(m)
        self.heads = m.heads
        self.rq, self.rk = p.block_q // p.q_unit, p.block_kv // p.kv_unit
        self.kq, self.slots = p.tile_q // p.q_unit, p.tile_kv // p.kv_unit
        self.live_q_units = ceil_div(p.seq_q, p.q_unit)
        self.kv_units = ceil_div(p.seq_kv, p.kv_unit)
        self.kv_groups = ceil_div(self.kv_units, self.slots)
        self.nqt = p.num_q_tiles
        self.kv_unit = p.kv_unit
        self.packed = bool(p.packed)
        self.tile_rows = m.batch * m.heads * self.nqt
        self.num_flags = self.kv_units if self.packed else self.kv_groups

    def tile_count(self, flags: int) -> int:
        return ceil_div(flags, self.slots) if self.packed else flags

    def load_query_units(self, tile_row: int) -> tuple[int, list[int]]:
        t, bh = tile_row % self.nqt, tile_row // self.nqt
        mb, mh = bh // self.heads, bh % self.heads
        rows = []
        for a in range(self.kq):
            unit = t * self.kq + a
            rows.append((unit // self.rq) * self.stride[2] if unit < self.live_q_units else -1)
        return mb * self.stride[0] + mh * self.stride[1], rows

    def unit_active(self, base: int, rows: list[int], a: int, column: int) -> bool:
        return rows[a] >= 0 and self.data[base + rows[a] + column] != 0

    def unit_column(self, unit: int) -> int:
        return (unit // self.rk) * self.stride[3]

    def kv_flag(self, base: int, rows: list[int], f: int) -> bool:
        units = [f] if self.packed else range(f * self.slots, min(f * self.slots + self.slots, self.kv_units))
        return any(self.unit_active(base, rows, a, self.unit_column(u)) for u in units for a in range(self.kq))


class EmulatedHandle:
    """The preparation functions of the library, emulated (see the module docstring)."""

    def __init__(self):
        self.calls: list[str] = []

    @staticmethod
    def tessera_error_string(code: int) -> bytes:
        return b"invalid argument" if code == CUDA_INVALID_VALUE else b"emulated error"

    def tessera_prepare_counts(self, params, host_max, stream) -> int:
        self.calls.append("prepare_counts")
        p = params._obj
        g = EmulatedGeometry(p)
        if not g.ok or not p.tile_counts or not p.max_count:
            return CUDA_INVALID_VALUE
        counts = raw(p.tile_counts, ctypes.c_int32, g.tile_rows)
        longest = raw(p.max_count, ctypes.c_int32, 1)
        longest[0] = 0
        for tile_row in range(g.tile_rows):
            base, rows = g.load_query_units(tile_row)
            count = g.tile_count(sum(g.kv_flag(base, rows, f) for f in range(g.num_flags)))
            counts[tile_row] = count
            longest[0] = max(longest[0], count)
        if host_max is not None:
            host_max._obj.value = int(longest[0])
        return 0

    def tessera_prepare_fill(self, params, stream) -> int:
        self.calls.append("prepare_fill")
        p = params._obj
        g = EmulatedGeometry(p)
        if not g.ok or not (p.tile_counts and p.tile_slots and p.tile_member and p.q_order) or p.capacity < 1:
            return CUDA_INVALID_VALUE
        cap, s_per = p.capacity, g.slots
        counts = raw(p.tile_counts, ctypes.c_int32, g.tile_rows)
        all_slots = raw(p.tile_slots, ctypes.c_int32, g.tile_rows * cap * s_per)
        all_members = raw(p.tile_member, ctypes.c_int64, g.tile_rows * cap)
        for tile_row in range(g.tile_rows):  # prepare_fill_kernel, one CTA each
            base, rows = g.load_query_units(tile_row)
            slots = all_slots[tile_row * cap * s_per:(tile_row + 1) * cap * s_per]
            placed = 0  # the block scan's positions are the flags' running count
            for f in range(g.num_flags):
                if not g.kv_flag(base, rows, f):
                    continue
                if g.packed:
                    if placed < cap * s_per:
                        slots[placed] = f * g.kv_unit
                elif placed < cap:
                    for s in range(s_per):
                        unit = f * s_per + s
                        slots[placed * s_per + s] = unit * g.kv_unit if unit < g.kv_units else -1
                placed += 1
            first_empty = placed if g.packed else placed * s_per
            slots[first_empty:] = -1
            counts[tile_row] = g.tile_count(placed)
            for tile in range(cap):  # membership words read back from the slots
                word = 0
                for s in range(s_per):
                    start = int(slots[tile * s_per + s])
                    if start < 0:
                        continue
                    column = g.unit_column(start // g.kv_unit)
                    for a in range(g.kq):
                        if g.unit_active(base, rows, a, column):
                            word |= 1 << (a * s_per + s)
                all_members[tile_row * cap + tile] = word - (1 << 64) if word >= 1 << 63 else word
        order = raw(p.q_order, ctypes.c_int32, g.tile_rows)
        for bh in range(g.tile_rows // g.nqt):  # prepare_order_kernel
            row = [int(c) for c in counts[bh * g.nqt:(bh + 1) * g.nqt]]
            keys = [(c << 32) | (~i & 0xFFFFFFFF) for i, c in enumerate(row)]
            for i, key in enumerate(keys):
                rank = sum(k > key for k in keys) if p.longest_first else i
                order[bh * g.nqt + rank] = i
        return 0

    def tessera_mask_counts(self, params, host_counts, stream) -> int:
        self.calls.append("mask_counts")
        p = params._obj
        m = p.mask
        if not m.blocks or min(m.batch, m.heads, m.rows, m.cols) < 1 or not p.counts or not 0 <= p.num_groups <= 4:
            return CUDA_INVALID_VALUE
        data, (s0, s1, s2, s3) = block_reader(m)
        out = raw(p.counts, ctypes.c_int64, mask_counts.MASK_COUNT_SLOTS)
        out[:] = 0
        groups = list(p.group_rows)[:p.num_groups]
        row_counts = raw(p.row_counts, ctypes.c_int32, m.batch * m.heads * m.rows) if p.row_counts else None
        for row in range(m.batch * m.heads * m.rows):  # mask_count_kernel, one warp each
            i, bh = row % m.rows, row // m.rows
            r = (bh // m.heads) * s0 + (bh % m.heads) * s1 + i * s2
            active = 0
            for j in range(m.cols):
                if not data[r + j * s3]:
                    continue
                active += 1
                left = j > 0 and data[r + (j - 1) * s3]
                right = j + 1 < m.cols and data[r + (j + 1) * s3]
                if not left:
                    out[2] += 1
                    out[1] += int(not right)
                out[3] += int(i > 0 and bool(data[r + j * s3 - s2]))
            for k, group in enumerate(groups):
                if i % group:
                    continue
                in_group = min(group, m.rows - i)
                out[6 + k] += sum(any(data[r + ii * s2 + j * s3] for ii in range(in_group)) for j in range(m.cols))
            out[0] += active
            out[4] = max(out[4], active)
            out[5] += int(active == 0)
            if row_counts is not None:
                row_counts[row] = active
        if host_counts is not None:
            for c in range(mask_counts.MASK_COUNT_SLOTS):
                host_counts[c] = int(out[c])
        return 0


def emulated_library() -> NativeLibrary:
    return NativeLibrary("emulated", EmulatedHandle(), {}, {})


class OpCounter(TorchDispatchMode):
    """Ops dispatched inside the mode: allocations, views, and everything else (launches on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.views = 0
        self.others: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.others.append(str(func))
        return func(*args, **(kwargs or {}))


def assert_same_metadata(got, want, what: str) -> None:
    difference = metadata_difference(got, want)
    assert difference is None, f"{what}: {difference}"


GEOMETRIES = ((16, 16), (32, 16), (64, 32), (128, 128), (256, 256), (384, 384), (48, 80))


@pytest.mark.parametrize("bq,bkv", GEOMETRIES, ids=str)
def test_emulated_native_prepare_equals_torch(bq, bkv):
    seq_q, seq_kv = max(11 * bq, 900) + bq // 2 + 3, max(13 * bkv, 1100) - 5  # partial last blocks, Sq != Skv
    masks = [
        random_mask(2, 3, seq_q, seq_kv, bq, bkv, density=0.35, seed=bq + bkv),
        random_mask(1, 1, seq_kv, seq_q, bq, bkv, density=0.2, seed=bq * bkv),  # broadcast B and H
    ]
    lib = emulated_library()
    for mask, (plan, compact) in itertools.product(masks, itertools.product(metadata_plans(bq, bkv), (True, False))):
        state = build_mask_state(mask)
        native = native_prepare.prepare_native(plan, state, compact, library=lib)
        assert_same_metadata(native, prepare_torch(plan, state, compact), f"{plan.name} compact={compact}")


def test_emulated_native_prepare_on_strided_blocks_and_odd_units():
    """Expanded (stride 0) and sliced block tensors; reference tiles where kq * S = 64 and kq = 1."""
    lib = emulated_library()
    base = random_mask(1, 2, 200, 330, 16, 16, density=0.3, seed=3).blocks
    wide = torch.zeros(1, 2, base.shape[2], base.shape[3] + 7, dtype=torch.bool)
    wide[..., 3:3 + base.shape[3]] = base
    masks = [
        LogicalMask(base.expand(3, 2, -1, -1), 16, 16, 200, 330),
        LogicalMask(wide[..., 3:3 + base.shape[3]], 16, 16, 200, 330),
        LogicalMask(base.transpose(2, 3).contiguous().transpose(2, 3), 16, 16, 200, 330),
    ]
    tiles = ((128, 128), (64, 128), (16, 16), (32, 64))
    for mask, (tq, tk), layout, compact in itertools.product(masks, tiles, KvLayout, (True, False)):
        plan = PhysicalPlan(16, 16, layout, TaskOrganization(), reference_kernel(16, "fp32", tq, tk))
        if layout is KvLayout.PACKED and plan.slots_per_tile < 2:
            continue
        state = build_mask_state(mask)
        native = native_prepare.prepare_native(plan, state, compact, library=lib)
        assert_same_metadata(native, prepare_torch(plan, state, compact), plan.name)


def test_a_new_mask_of_a_known_request_reuses_the_parameter_block():
    """What depends only on (plan, mask shape and strides) is built once: the next mask of the same
    request copies it and still gets its own metadata, bit for bit."""
    lib = emulated_library()
    plan = PhysicalPlan(32, 32, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST),
                        reference_kernel(32, "fp32", 64, 128))
    masks = [random_mask(1, 2, 700, 900, 32, 32, density=d, seed=s) for s, d in ((5, 0.3), (6, 0.05), (7, 0.6))]
    for compact in (True, False):
        native_prepare.params_template.cache_clear()
        for mask in masks:
            state = build_mask_state(mask)
            native = native_prepare.prepare_native(plan, state, compact, library=lib)
            assert_same_metadata(native, prepare_torch(plan, state, compact), f"compact={compact}")
        info = native_prepare.params_template.cache_info()
        assert (info.misses, info.hits) == (1, len(masks) - 1)


def test_emulated_mask_counts_equal_torch():
    lib = emulated_library()
    for seed, (bm, hm) in enumerate(((2, 3), (1, 1), (1, 4))):
        mask = random_mask(bm, hm, 170 + 9 * seed, 230, 16, 32, density=0.1 + 0.2 * seed, seed=seed)
        blocks = mask.blocks
        for groups in ((), (2,), (1, 3, 4, 50)):
            got = mask_counts.launch_mask_counts(blocks, groups, read=bool(seed % 2), library=lib)
            row_counts = blocks.sum(-1, dtype=torch.int32)
            assert tuple(got.counts.tolist()) == tuple(count_blocks(blocks, row_counts).tolist())
            assert torch.equal(got.row_counts, row_counts)
            assert got.unions == {r: int(group_activity(blocks, r, dim=-2).sum()) for r in groups}


def test_native_prepare_dispatches_a_few_ops_and_no_torch_read():
    """The point of the native path: allocations and views only, the host read inside the ctypes call."""
    mask = random_mask(2, 3, 1000, 1200, 16, 16, density=0.2, seed=1)
    state = build_mask_state(mask)
    plan = PhysicalPlan(16, 16, KvLayout.PACKED, TaskOrganization(Traversal.LONGEST_FIRST, 2),
                        reference_kernel(16, "fp32", 64, 64))
    lib = emulated_library()
    # Views: one int32 view of the int64 buffer (the mode also shows a detach under it) and one
    # as_strided per tensor.
    with OpCounter() as compact:
        native_prepare.prepare_native(plan, state, True, library=lib)
    assert compact.others == ["aten.empty.memory_format"] * 2 and compact.views <= 6, (compact.others, compact.views)
    with OpCounter() as capturable:
        native_prepare.prepare_native(plan, state, False, library=lib)
    assert capturable.others == ["aten.empty.memory_format"] and capturable.views <= 6
    assert lib.handle.calls == ["prepare_counts", "prepare_fill", "prepare_fill"]
    with OpCounter() as counts:
        mask_counts.launch_mask_counts(mask.blocks, (2, 4), read=True, library=lib)
    assert counts.others == ["aten.empty.memory_format"] and counts.views <= 4


def test_native_failure_raises():
    from tessera_diffusers.errors import NativeKernelError

    class Failing(EmulatedHandle):
        def tessera_prepare_fill(self, params, stream) -> int:
            return CUDA_INVALID_VALUE

    mask = random_mask(1, 2, 300, 300, 32, 32, seed=2)
    plan = PhysicalPlan(32, 32, KvLayout.PACKED, TaskOrganization(), reference_kernel(16, "fp32", 64, 64))
    with pytest.raises(NativeKernelError, match="native prepare .metadata. failed: CUDA error 1 .invalid argument"):
        native_prepare.prepare_native(plan, build_mask_state(mask), library=NativeLibrary("x", Failing(), {}, {}))


def emulated_native_path(lib: NativeLibrary, launches: list | None = None):
    """A stand-in for the modules the native paths return on CUDA (``mask_state.native_path``:
    ``mask_counts``; ``prepare.native_path``: ``native_prepare``), running the emulated library on
    CPU tensors (records the group sizes of each statistics launch)."""

    def launch_mask_counts(blocks, groups=(), read=True):
        if launches is not None:
            launches.append(groups)
        return mask_counts.launch_mask_counts(blocks, groups, read, library=lib)

    return SimpleNamespace(
        prepare_native=functools.partial(native_prepare.prepare_native, library=lib),
        launch_mask_counts=launch_mask_counts,
        union_rows_to_prefetch=mask_counts.union_rows_to_prefetch,
        MAX_UNION_GROUPS=library.MAX_UNION_GROUPS,
    )


def test_cpu_tensors_take_the_torch_path(monkeypatch):
    """On CPU the native path is never asked, whatever the library and the switch."""
    def refuse(*args, **kwargs):
        raise AssertionError("the native path was taken for CPU tensors")

    monkeypatch.setattr(library, "native_path_enabled", refuse)
    monkeypatch.setattr(library, "native_library", refuse)
    assert mask_state.native_path(torch.device("cpu")) is None
    assert prepare_module.native_path(torch.device("cpu")) is None
    mask = random_mask(1, 2, 300, 300, 32, 32, seed=2)
    state = build_mask_state(mask)
    plan = PhysicalPlan(32, 32, KvLayout.PACKED, TaskOrganization(), reference_kernel(16, "fp32", 64, 64))
    assert_same_metadata(prepare(plan, state), prepare_torch(plan, state), plan.name)
    assert state.native_counts() is None
    state.host_stat_values, state.row_union_ratios((2, 4))
    with pytest.raises(InvalidArgumentError, match="a CUDA tensor"):
        library.require_library(torch.device("cpu"), None)


def test_switch_and_library_decide_the_native_path(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(library, "native_library", emulated_library)
    monkeypatch.delenv(library.NATIVE_PREPARE_ENV, raising=False)
    assert library.native_path_enabled(cuda)
    assert mask_state.native_path(cuda) is mask_counts and prepare_module.native_path(cuda) is native_prepare
    assert not library.native_path_enabled(torch.device("cpu"))
    monkeypatch.setenv(library.NATIVE_PREPARE_ENV, "0")
    assert not library.native_path_enabled(cuda)
    assert mask_state.native_path(cuda) is None and prepare_module.native_path(cuda) is None
    monkeypatch.setenv(library.NATIVE_PREPARE_ENV, "1")
    assert library.native_path_enabled(cuda)
    monkeypatch.setattr(library, "native_library", lambda: None)
    assert not library.native_path_enabled(cuda)
    assert mask_state.native_path(cuda) is None and prepare_module.native_path(cuda) is None


def test_prepare_dispatches_to_the_native_path(monkeypatch):
    lib = emulated_library()
    monkeypatch.setattr(prepare_module, "native_path", lambda device: emulated_native_path(lib))
    mask = random_mask(2, 1, 500, 400, 32, 16, density=0.3, seed=8)
    state = build_mask_state(mask)
    for layout in KvLayout:
        plan = PhysicalPlan(32, 16, layout, TaskOrganization(), reference_kernel(16, "fp32", 64, 64))
        for compact in (True, False):
            prepared = prepare(plan, state, compact)
            assert_same_metadata(prepared, prepare_torch(plan, state, compact), plan.name)
    assert lib.handle.calls == ["prepare_counts", "prepare_fill", "prepare_fill"] * 2


def test_mask_state_reads_native_counts_once(monkeypatch):
    """MaskState on the native path (emulated, on CPU tensors): one launch with the prefetched union
    sizes serves stat_counts, kv_num_blocks, the host statistics and row_union_ratios."""
    lib = emulated_library()
    launches = []
    monkeypatch.setattr(mask_state, "native_path", lambda device: emulated_native_path(lib, launches))
    for seed in range(3):
        mask = random_mask(2, 3, 300, 200, 16, 16, density=0.1 + 0.3 * seed, seed=seed)
        state = build_mask_state(mask)
        launches.clear()
        values = state.host_stat_values
        assert launches == [(4, 8)]  # the query-tile heights of the kernel table over Q16
        ratios = state.row_union_ratios((2, 4, 8, 3))
        assert launches == [(4, 8), (2, 3)]  # then only the sizes the first launch lacked
        assert state.row_union_ratios((8, 4, 1)) == {8: ratios[8], 4: ratios[4], 1: 1.0}
        assert torch.equal(state.stat_counts, count_blocks(mask.blocks, mask.blocks.sum(-1, dtype=torch.int32)))
        assert state.kv_num_blocks is state.native_counts().row_counts
        assert len(launches) == 2 and lib.handle.calls.count("mask_counts") == 2 * (seed + 1)
        with monkeypatch.context() as torch_only:
            torch_only.setattr(mask_state, "native_path", lambda device: None)
            oracle = build_mask_state(mask)
            assert values == oracle.host_stat_values
            assert ratios == oracle.row_union_ratios((2, 4, 8, 3))
            assert torch.equal(state.kv_num_blocks, oracle.kv_num_blocks)
            assert torch.equal(state.stats, oracle.stats)
    # The device counts first (no read), the host values later: one launch, one read of its buffer.
    state = build_mask_state(random_mask(1, 2, 300, 300, 64, 64, seed=4))
    launches.clear()
    with OpCounter() as ops_counted:
        state.stat_counts  # noqa: B018
    assert launches == [(2,)] and ops_counted.others == ["aten.empty.memory_format"]
    with OpCounter() as read:
        state.host_stat_values  # noqa: B018
    assert launches == [(2,)] and read.others == [], read.others  # on CUDA: tolist's one copy to the host


def test_host_ratios_equal_the_tensor_ratios():
    rng = random.Random(0)
    cases = [(0, 0, 0, 0, 0, 7), (1, 1, 1, 0, 1, 0)]
    for _ in range(300):
        active = rng.randrange(0, 10**rng.randrange(1, 12))
        runs = rng.randrange(0, active + 1)
        cases.append((active, rng.randrange(0, runs + 1), runs, rng.randrange(0, active + 1),
                      rng.randrange(0, active + 1), rng.randrange(0, 10**6)))
    for counts in cases:
        rows, total = rng.randrange(1, 10**6), rng.randrange(10**6, 10**12)
        expected = tuple(stats_from_counts(torch.tensor(counts), rows, total).tolist())
        assert host_stats_from_counts(counts, rows, total) == expected, counts


def test_union_prefetch_follows_the_kernel_tiles():
    assert mask_counts.union_rows_to_prefetch(16) == (4, 8)
    assert mask_counts.union_rows_to_prefetch(32) == (2, 4)
    assert mask_counts.union_rows_to_prefetch(64) == (2,)
    assert mask_counts.union_rows_to_prefetch(128) == ()
    assert math.prod(mask_counts.union_rows_to_prefetch(384)) == 1


def test_default_compaction_policy():
    """``prepare(compact=None)``: the CPU path always compacts; the worst-case size the native path
    compares with SYNC_FREE_METADATA_BYTES counts slots and membership words at ceil(nUk / S)."""
    from tessera_diffusers.catalog import reference_kernel
    from tessera_diffusers.prepare import worst_case_metadata_bytes
    from tessera_diffusers.testing import random_mask

    mask = random_mask(1, 3, 1000, 1100, 64, 32, density=0.2, seed=4)
    plan = PhysicalPlan(64, 32, KvLayout.PACKED, TaskOrganization(), reference_kernel(16, "fp32", 128, 128))
    n_qt, cap = math.ceil(1000 / 128), math.ceil(math.ceil(1100 / 32) / 4)
    assert worst_case_metadata_bytes(plan, mask) == 3 * n_qt * cap * (8 + 4 * 4)
    state = build_mask_state(mask)
    assert prepare(plan, state).capacity == prepare(plan, state, compact=True).capacity < cap


def test_deferred_compaction_gives_the_compact_metadata():
    """The trimmed copy of a worst-case plan (``compacted``) equals ``compact=True`` bit for bit and
    runs the same; the worst case itself is left as it was, and a pinned plan (captured / compiled)
    gives no copy."""
    from tessera_diffusers.catalog import reference_kernel
    from tessera_diffusers.executor import run_prepared
    from tessera_diffusers.prepare import prepare_torch
    from tessera_diffusers.testing import metadata_difference, random_mask

    mask = random_mask(2, 3, 1000, 1100, 64, 32, density=0.2, seed=5)
    state = build_mask_state(mask)
    for layout in (KvLayout.PACKED, KvLayout.CONTIGUOUS):
        plan = PhysicalPlan(64, 32, layout, TaskOrganization(), reference_kernel(16, "fp32", 128, 128))
        compact = prepare_torch(plan, state, compact=True)
        worst = prepare_torch(plan, state, compact=False)
        assert worst.capacity > compact.capacity and not worst.compaction_pending
        assert worst.compacted() is None  # nothing deferred
        worst.defer_compaction()
        assert worst.compaction_pending
        q, k, v = (torch.randn(2, n, 3, 16, generator=torch.Generator().manual_seed(i)) for i, n in
                   enumerate((1000, 1100, 1100)))
        before = run_prepared(worst, q, k, v, 0.25)
        slots = worst.tile_slots
        trimmed = worst.compacted()
        assert trimmed is not None and not worst.compaction_pending and worst.compacted() is None
        assert worst.tile_slots is slots and worst.capacity > trimmed.capacity == compact.capacity
        assert not trimmed.compaction_pending and not trimmed.launch_state.templates
        assert metadata_difference(trimmed, compact) is None, layout
        assert torch.equal(run_prepared(trimmed, q, k, v, 0.25), before)
        with pytest.raises(dataclasses.FrozenInstanceError):
            trimmed.capacity = 1

        pinned = prepare_torch(plan, state, compact=False)
        pinned.defer_compaction()
        pinned.pin()
        slots = pinned.tile_slots
        assert not pinned.compaction_pending and pinned.compacted() is None and pinned.tile_slots is slots


def test_the_runtime_keeps_the_compact_copy_of_a_reused_worst_case_plan():
    """``Runtime.reuse`` is the one place a kept plan changes: a hit after the deferred count has
    landed replaces the cached worst case by its compact copy (the worst case itself untouched),
    the output unchanged; later hits return that copy as is."""
    from tessera_diffusers import Runtime
    from tessera_diffusers.catalog import reference_kernel
    from tessera_diffusers.prepare import prepare_torch
    from tessera_diffusers.testing import metadata_difference, random_mask

    mask = random_mask(1, 2, 600, 1400, 64, 32, density=0.03, seed=9)
    plan = PhysicalPlan(64, 32, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(16, "fp32", 128, 128))

    class WorstCase(Runtime):
        def plan_request(self, state, request, forced):
            prepared = prepare_torch(plan, state, compact=False)
            prepared.defer_compaction()
            return prepared

    runtime = WorstCase()
    q, k, v = (torch.randn(1, n, 2, 16, generator=torch.Generator().manual_seed(i)) for i, n in
               enumerate((600, 1400, 1400)))
    first = runtime.attention(q, k, v, mask, plan=plan)
    (key, entry), = runtime._cache.items()
    worst = entry.prepared
    assert worst.compaction_pending
    second = runtime.attention(q, k, v, mask, plan=plan)
    kept = runtime._cache[key].prepared
    assert kept is not worst and kept.capacity < worst.capacity and not kept.compaction_pending
    assert metadata_difference(kept, prepare_torch(plan, build_mask_state(mask), compact=True)) is None
    assert torch.equal(first, second) and torch.equal(runtime.attention(q, k, v, mask, plan=plan), first)
    assert runtime._cache[key].prepared is kept and (runtime.hits, runtime.misses) == (2, 1)
