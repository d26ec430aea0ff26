"""The query-grouping kernel (``csrc/include/tessera/regroup.cuh``) on a GPU against the torch code,
its oracle: the same ``q_units`` and ``key_blocks`` bit for bit on random and structured masks,
broadcast (expanded, stride 0) masks, unaligned and strided columns, nKV not a multiple of 32,
~4800 columns, windows up to 256, one segment per head, the default segments and segments of two
groups (nQ not a multiple of the segment), and the torch path for what the kernel's shared memory
cannot hold. Skipped without CUDA and a library with ``tessera_group_query_blocks``.

    python -m pytest -q -m gpu tests/gpu/test_regroup_gpu.py
"""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from tessera_diffusers import config, library, regroup
from tessera_diffusers.library import block_mask_struct, stream_handle

pytestmark = pytest.mark.gpu

CUDA_INVALID_VALUE = 1
# Segment sizes as functions of the group: one segment per head, the default, two groups per segment.
SEGMENTS = {
    "one segment": lambda group: 0,
    "default segments": lambda group: regroup.DEFAULT_SEGMENT,
    "two groups": lambda group: 2 * group,
}


@pytest.fixture(autouse=True)
def grouping_kernel_present():
    if library.grouping_library() is None:
        pytest.skip("the loaded library has no tessera_group_query_blocks (rebuild it)")
    if not config.get("native_prepare"):
        pytest.skip(f"{library.NATIVE_PREPARE_ENV}=0 turns the native path off")


def random_blocks(bm: int, hm: int, n_q: int, n_kv: int, density: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(bm, hm, n_q, n_kv, generator=gen) < density).cuda()


def structured_blocks(heads: int, n_q: int, n_kv: int, seed: int) -> torch.Tensor:
    """``[1, heads, nQ, nKV]``: a band whose position repeats with a per-head period (rows a few
    apart alike, as in temporal heads), plus a few random global columns."""
    gen = torch.Generator().manual_seed(seed)
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_kv)[None, :]
    period = torch.randint(2, 9, (heads, 1, 1), generator=gen)
    width = max(2, n_kv // 64)
    band = ((i % period) * (n_kv // 8) + (i // period) % 5 * width - j).abs() <= width
    columns = torch.rand(heads, 1, n_kv, generator=gen) < 0.03
    return (band | columns)[None].cuda()


def masks() -> list[tuple[str, torch.Tensor]]:
    base = structured_blocks(3, 70, 45, seed=1)
    wide = torch.zeros(1, 3, 70, 45 + 7, dtype=torch.bool, device="cuda")
    wide[..., 3:48] = base
    return [
        ("random", random_blocks(2, 3, 37, 45, 0.3, seed=2)),
        ("structured", structured_blocks(4, 130, 100, seed=3)),
        ("several default segments", structured_blocks(3, 600, 90, seed=12)),  # 600 = 4 x 128 + 88
        ("expanded (stride 0)", base[:, :1].expand(2, 3, -1, -1)),
        ("unaligned rows", wide[..., 3:48]),
        ("strided columns", base.transpose(-1, -2).contiguous().transpose(-1, -2)),
        ("one word", random_blocks(1, 2, 50, 32, 0.4, seed=4)),
        ("one column", random_blocks(1, 2, 29, 1, 0.5, seed=5)),
        ("one row", random_blocks(1, 2, 1, 70, 0.5, seed=6)),
        ("empty", torch.zeros(1, 2, 33, 40, dtype=torch.bool, device="cuda")),
        ("dense", torch.ones(1, 2, 33, 40, dtype=torch.bool, device="cuda")),
    ]


def assert_native_equals_torch(blocks: torch.Tensor, group: int, window: int, label: str, segment: int) -> None:
    native = regroup.group_query_blocks_native(blocks, group, window, segment=segment)
    oracle = regroup.group_query_blocks_torch(blocks, group, window, segment=segment)
    where = f"{label} g={group} W={window} S={segment}"
    assert torch.equal(native.key_blocks, oracle.key_blocks), where
    assert native.q_units.dtype == torch.int32, where
    assert torch.equal(native.q_units, oracle.q_units), where


@pytest.mark.parametrize("segments", SEGMENTS)
@pytest.mark.parametrize("group,window", list(itertools.product((1, 2, 4, 8), (1, 3, 64, 256))), ids=str)
def test_native_grouping_equals_torch(group, window, segments):
    for label, blocks in masks():
        assert_native_equals_torch(blocks, group, window, label, SEGMENTS[segments](group))


@pytest.mark.parametrize("n_q,n_kv,heads,window", [
    (300, 4725, 3, 64),  # Wan 720p's columns: 148 words, not a multiple of 32
    (300, 4800, 2, 256),  # the widest window, 150 words: a ring of ~170 KB
    (700, 1024, 2, 1000),  # more candidates than lanes: 32 per lane (one segment), 8 (default segments)
], ids=["4725-cols", "4800-cols-w256", "w1000"])
@pytest.mark.parametrize("segments", SEGMENTS)
def test_native_grouping_on_wide_masks(n_q, n_kv, heads, window, segments):
    for group in (4, 8):
        segment = SEGMENTS[segments](group)
        assert_native_equals_torch(structured_blocks(heads, n_q, n_kv, seed=n_kv), group, window, "structured", segment)
        assert_native_equals_torch(random_blocks(1, heads, n_q, n_kv, 0.15, seed=group), group, window, "random",
                                   segment)


@pytest.mark.parametrize("segment", [0, regroup.DEFAULT_SEGMENT], ids=["one segment", "default segments"])
def test_native_grouping_on_a_wan_sized_head(segment):
    """One head of Wan 720p with 16-token blocks: 4725 x 4725 (a ring refilled ~18 times in one
    segment; 37 default segments of 128, the last of 117 rows)."""
    blocks = structured_blocks(1, 4725, 4725, seed=7)
    assert_native_equals_torch(blocks, 4, 64, "wan", segment)


def test_what_the_kernel_cannot_hold_takes_the_torch_path():
    # In one segment: a ring of ~1060 rows of 128 words (~540 KB), and a window past the kernel's
    # 1024 candidates (the default segments would hold both).
    cases = ((structured_blocks(1, 1100, 4096, seed=8), 1024), (random_blocks(1, 1, 1300, 64, 0.2, seed=9), 1200))
    for blocks, window in cases:
        assert_native_equals_torch(blocks, 4, window, f"W={window}", 0)


def test_the_dispatch_takes_the_kernel_on_cuda(monkeypatch):
    blocks = structured_blocks(2, 90, 70, seed=10)
    assert regroup.native_grouping_enabled(blocks.device)
    native = regroup.group_query_blocks(blocks, 4)
    monkeypatch.setenv(library.NATIVE_PREPARE_ENV, "0")
    assert not regroup.native_grouping_enabled(blocks.device)
    assert torch.equal(regroup.group_query_blocks(blocks, 4), native)


def test_bad_parameters_are_refused_by_the_launcher():
    lib = library.grouping_library()
    blocks = random_blocks(1, 2, 10, 20, 0.3, seed=11)
    q_units = torch.empty(1, 2, 12, dtype=torch.int32, device="cuda")
    scratch = torch.empty(1, 2, 2, 2, dtype=torch.int64, device="cuda")  # two segments of 8 rows

    def launch(group: int, window: int, slots: int, out: int, segment: int = 8, counts: int | None = None) -> int:
        p = library.TesseraGroupParams()
        p.mask = block_mask_struct(blocks)
        p.group, p.window, p.num_slots, p.segment, p.q_units, p.key_blocks = group, window, slots, segment, out, None
        p.segment_key_blocks = scratch.data_ptr() if counts is None else counts
        return lib.handle.tessera_group_query_blocks(ctypes.byref(p), stream_handle(blocks.device))

    assert launch(4, 3, 12, q_units.data_ptr()) == 0
    assert launch(0, 3, 12, q_units.data_ptr()) == CUDA_INVALID_VALUE
    assert launch(4, 0, 12, q_units.data_ptr()) == CUDA_INVALID_VALUE
    assert launch(4, 3, 10, q_units.data_ptr()) == CUDA_INVALID_VALUE  # not whole groups
    assert launch(4, 3, 12, 0) == CUDA_INVALID_VALUE
    assert launch(4, 3, 12, q_units.data_ptr(), segment=6) == CUDA_INVALID_VALUE  # not whole groups
    assert launch(4, 3, 12, q_units.data_ptr(), segment=-4) == CUDA_INVALID_VALUE
    assert launch(4, 3, 12, q_units.data_ptr(), counts=0) == CUDA_INVALID_VALUE  # no scratch
    assert lib.handle.tessera_group_query_blocks(None, stream_handle(blocks.device)) == CUDA_INVALID_VALUE
    torch.cuda.synchronize()
    assert torch.equal(q_units, regroup.group_query_blocks_torch(blocks, 4, 3, segment=8).q_units)
