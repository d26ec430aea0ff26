"""Query-block grouping (tessera_diffusers/regroup.py) on the CPU: the torch code against a scalar
transcription of the algorithm in the module docstring (one segment per head and several segment
sizes), the properties every grouping has (a permutation padded with -1, each segment's positions
holding its own blocks, never more key blocks than the natural order), worked examples and the
argument checks. ``test_regroup_gpu.py`` checks the CUDA kernel against the torch code."""

from __future__ import annotations

import ctypes
import itertools
import math

import pytest
import torch

from tessera_diffusers import InvalidArgumentError, regroup
from tessera_diffusers.mask_state import group_activity
from tessera_diffusers.regroup import (
    DEFAULT_WINDOW,
    TesseraGroupParams,
    group_query_blocks,
    group_query_blocks_torch,
    permuted_blocks,
    query_grouping,
)

GROUPS = (1, 2, 4, 8)
WINDOWS = (1, 3, DEFAULT_WINDOW)


def scalar_grouping(
    rows: list[set[int]], group: int, window: int, segment: int = 0, lack_weight: int = regroup.LACK_WEIGHT
) -> tuple[list[int], tuple[int, int]]:
    """The module docstring's algorithm for one head, one set operation at a time: the greedy in
    each segment of ``segment`` rows rounded up to whole groups (0: one segment); a pick counts a
    candidate's blocks outside the union plus ``lack_weight`` times the union's it lacks."""
    n = len(rows)
    length = -(-segment // group) * group or n
    free = [True] * n
    order: list[int] = []
    greedy = 0
    for lo in range(0, n, length):
        hi = min(lo + length, n)
        seed = lo
        while len(order) < hi:
            while not free[seed]:
                seed += 1
            free[seed] = False
            order.append(seed)
            union = set(rows[seed])
            for _ in range(1, min(group, hi - len(order) + 1)):
                candidates = [c for c in range(seed + 1, min(seed + window, hi - 1) + 1) if free[c]]
                if candidates:
                    pick = min(candidates, key=lambda c: (len(rows[c] - union) + lack_weight * len(union - rows[c]), c))
                else:
                    pick = next(c for c in range(seed + 1, hi) if free[c])
                free[pick] = False
                order.append(pick)
                union |= rows[pick]
            greedy += len(union)
    natural = sum(len(set().union(*rows[t:t + group])) for t in range(0, n, group))
    if natural <= greedy:
        order = list(range(n))
    return order + [-1] * (math.ceil(n / group) * group - n), (natural, greedy)


def key_sets(blocks: torch.Tensor) -> list[list[set[int]]]:
    """Per head (flattened over Bm, Hm), each row's key set."""
    heads = blocks.reshape(-1, *blocks.shape[2:])
    return [[set(torch.nonzero(row).flatten().tolist()) for row in head] for head in heads]


def random_blocks(bm: int, hm: int, n_q: int, n_kv: int, density: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(bm, hm, n_q, n_kv, generator=gen) < density


def structured_blocks(heads: int, n_q: int, n_kv: int, seed: int) -> torch.Tensor:
    """A band around the diagonal with rows of a few periods alike (a temporal head's pattern),
    plus a few random global columns."""
    gen = torch.Generator().manual_seed(seed)
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_kv)[None, :]
    period = torch.randint(2, 6, (heads, 1, 1), generator=gen)
    band = ((i % period) * n_kv // 8 - j).abs() <= 2  # [heads, nQ, nKV]
    columns = torch.rand(heads, 1, n_kv, generator=gen) < 0.05
    return (band | columns)[None]


def test_cases() -> list[tuple[str, torch.Tensor]]:
    return [
        ("random sparse", random_blocks(2, 3, 13, 9, 0.25, seed=1)),
        ("random dense", random_blocks(1, 2, 19, 40, 0.6, seed=2)),
        ("structured", structured_blocks(3, 23, 37, seed=3)),
        ("one row", random_blocks(1, 2, 1, 5, 0.5, seed=4)),
        ("empty rows", random_blocks(1, 2, 11, 7, 0.3, seed=5) & (torch.arange(11) % 3 != 1)[:, None]),
    ]


test_cases.__test__ = False  # a helper, not a test


def scheduled_key_blocks(blocks: torch.Tensor, q_units: torch.Tensor, group: int) -> torch.Tensor:
    """``[Bm, Hm]``: the key blocks of each group's union in the order ``q_units``, summed."""
    return group_activity(permuted_blocks(blocks, q_units), group, dim=-2).sum((-2, -1))


def assert_equals_the_scalar_algorithm(blocks: torch.Tensor, group: int, window: int, segment: int, label: str,
                                       lack_weight: int = regroup.LACK_WEIGHT):
    grouping = group_query_blocks_torch(blocks, group, window, segment=segment, lack_weight=lack_weight)
    bm, hm = blocks.shape[:2]
    units = grouping.q_units.reshape(bm * hm, -1).tolist()
    key_blocks = grouping.key_blocks.reshape(bm * hm, 2).tolist()
    for head, rows in enumerate(key_sets(blocks)):
        order, counts = scalar_grouping(rows, group, window, segment, lack_weight)
        where = f"{label} head {head} g={group} W={window} S={segment} w={lack_weight}"
        assert units[head] == order, where
        assert tuple(key_blocks[head]) == counts, where


@pytest.mark.parametrize("group,window", list(itertools.product(GROUPS, WINDOWS)), ids=str)
def test_torch_grouping_equals_the_scalar_algorithm(group, window):
    for label, blocks in test_cases():
        assert_equals_the_scalar_algorithm(blocks, group, window, 0, label)


@pytest.mark.parametrize("lack_weight", [0, 1, 2])
@pytest.mark.parametrize("group", [2, 4], ids=str)
def test_torch_grouping_weighing_lacking_blocks_equals_the_scalar_algorithm(group, lack_weight):
    for label, blocks in test_cases():
        assert_equals_the_scalar_algorithm(blocks, group, DEFAULT_WINDOW, 0, label, lack_weight)
        assert_equals_the_scalar_algorithm(blocks, group, 3, 8, label, lack_weight)


def test_lack_weight_one_picks_the_row_most_alike_not_the_smallest():
    # Seed 0 ({0..3}): rows 1, 2 and 3 each add one key block, but row 2 lacks none of the seed's.
    # Counting only what a row adds takes row 1 (the lowest of the tie), which leaves rows 2 and 3
    # to pair: no better than the natural order, which then wins the tie.
    blocks = rows_to_blocks([{0, 1, 2, 3}, {4}, {0, 1, 2, 3, 4}, {4}], 5)
    added_only = group_query_blocks_torch(blocks, 2, 3, lack_weight=0)
    assert added_only.q_units.flatten().tolist() == [0, 1, 2, 3]
    assert added_only.key_blocks.flatten().tolist() == [10, 10]
    difference = group_query_blocks_torch(blocks, 2, 3, lack_weight=1)
    assert difference.q_units.flatten().tolist() == [0, 2, 1, 3]
    assert difference.key_blocks.flatten().tolist() == [10, 6]


def segmented_cases() -> list[tuple[str, torch.Tensor]]:
    """Masks of several segments: nQ a multiple of neither the group nor the segment, empty rows,
    rows alike a few apart (so that segment boundaries change the greedy)."""
    return [
        ("random sparse", random_blocks(2, 2, 29, 11, 0.25, seed=11)),
        ("random dense", random_blocks(1, 2, 41, 23, 0.55, seed=12)),
        ("structured", structured_blocks(3, 53, 37, seed=13)),
        ("empty rows", random_blocks(1, 3, 35, 9, 0.35, seed=14) & (torch.arange(35) % 4 != 2)[:, None]),
        ("all empty", torch.zeros(1, 1, 19, 6, dtype=torch.bool)),
    ]


@pytest.mark.parametrize("segment", (1, 2, 3, 5, 8, 12, 16))
@pytest.mark.parametrize("group,window", list(itertools.product((1, 2, 3, 4), (1, 3, DEFAULT_WINDOW))), ids=str)
def test_segmented_torch_grouping_equals_the_scalar_algorithm(group, window, segment):
    for label, blocks in segmented_cases():
        assert_equals_the_scalar_algorithm(blocks, group, window, segment, label)


@pytest.mark.parametrize("group", (1, 2, 3, 4, 8))
def test_segment_zero_or_past_the_rows_is_one_segment(group):
    for label, blocks in segmented_cases():
        n_q = blocks.shape[2]
        one = query_grouping(blocks, group, 5, segment=0)
        for segment in (n_q, n_q + 1, 10 * n_q):
            other = query_grouping(blocks, group, 5, segment=segment)
            assert torch.equal(other.q_units, one.q_units) and torch.equal(other.key_blocks, one.key_blocks), label


def test_a_segment_rounds_up_to_whole_groups():
    blocks = structured_blocks(2, 45, 30, seed=15)
    for group, segment, whole in ((2, 3, 4), (4, 5, 8), (4, 8, 8), (3, 7, 9), (8, 1, 8)):
        rounded = query_grouping(blocks, group, 6, segment=segment)
        exact = query_grouping(blocks, group, 6, segment=whole)
        assert torch.equal(rounded.q_units, exact.q_units) and torch.equal(rounded.key_blocks, exact.key_blocks)


@pytest.mark.parametrize("group,segment", [(1, 1), (2, 2), (2, 6), (3, 9), (4, 8), (4, 12), (8, 16)], ids=str)
def test_segments_hold_their_own_blocks(group, segment):
    """Each segment's positions hold exactly its blocks (groups never cross a boundary), -1 only past
    nQ, and the schedule is the fewer of natural and greedy."""
    for label, blocks in segmented_cases():
        grouping = query_grouping(blocks, group, DEFAULT_WINDOW, segment=segment)
        q_units = grouping.q_units.long()
        n_q = blocks.shape[2]
        assert tuple(q_units.shape) == (*blocks.shape[:2], math.ceil(n_q / group) * group), label
        assert (q_units[..., n_q:] == -1).all(), label
        for lo in range(0, n_q, segment):
            hi = min(lo + segment, n_q)
            held = q_units[..., lo:hi].sort(-1).values
            assert torch.equal(held, torch.arange(lo, hi).expand_as(held)), f"{label} segment [{lo}, {hi})"
        natural = group_activity(blocks, group, dim=-2).sum((-2, -1))
        assert torch.equal(grouping.key_blocks[..., 0], natural), label
        assert torch.equal(scheduled_key_blocks(blocks, q_units, group), grouping.key_blocks.min(-1).values), label


def test_cpu_batches_group_like_one_batch(monkeypatch):
    blocks = structured_blocks(3, 61, 40, seed=16)
    whole = query_grouping(blocks, 4, 6, segment=8)
    monkeypatch.setattr(regroup, "CPU_BATCH_BYTES", 1)  # one segment per batch
    batched = query_grouping(blocks, 4, 6, segment=8)
    assert torch.equal(batched.q_units, whole.q_units) and torch.equal(batched.key_blocks, whole.key_blocks)


@pytest.mark.parametrize("group,window", list(itertools.product(GROUPS, WINDOWS)), ids=str)
def test_grouping_is_a_padded_permutation_scheduling_no_more_than_natural(group, window):
    for label, blocks in test_cases():
        q_units = group_query_blocks(blocks, group, window)  # the torch code on the CPU
        n_q = blocks.shape[2]
        slots = math.ceil(n_q / group) * group
        assert q_units.dtype == torch.int32 and tuple(q_units.shape) == (*blocks.shape[:2], slots), label
        assert torch.equal(q_units[..., :n_q].sort(-1).values, torch.arange(n_q, dtype=torch.int32).expand_as(
            q_units[..., :n_q])), label
        assert (q_units[..., n_q:] == -1).all(), label
        natural = group_activity(blocks, group, dim=-2).sum((-2, -1))
        chosen = scheduled_key_blocks(blocks, q_units, group)
        assert (chosen <= natural).all(), label
        key_blocks = query_grouping(blocks, group, window).key_blocks
        assert torch.equal(key_blocks[..., 0], natural), label
        assert torch.equal(chosen, key_blocks.min(-1).values), label


def test_group_one_is_the_natural_order():
    blocks = random_blocks(2, 2, 10, 6, 0.4, seed=7)
    q_units = group_query_blocks(blocks, 1, 3)
    assert torch.equal(q_units, torch.arange(10, dtype=torch.int32).expand(2, 2, 10))


def rows_to_blocks(rows: list[set[int]], n_kv: int) -> torch.Tensor:
    blocks = torch.zeros(1, 1, len(rows), n_kv, dtype=torch.bool)
    for i, row in enumerate(rows):
        blocks[0, 0, i, sorted(row)] = True
    return blocks


def test_alike_rows_are_grouped():
    blocks = rows_to_blocks([{0, 1}, {2, 3}, {0, 1}, {2, 3}], 4)
    grouping = query_grouping(blocks, 2)
    assert grouping.q_units.flatten().tolist() == [0, 2, 1, 3]
    assert grouping.key_blocks.flatten().tolist() == [8, 4]


def test_ties_go_to_the_lowest_block():
    # From seed 0, rows 2 and 3 add nothing: 2 first; from seed 1, rows 4 and 5: 4 first.
    blocks = rows_to_blocks([{0}, {1}, {0}, {0}, {1}, {1}], 2)
    grouping = query_grouping(blocks, 3)
    assert grouping.q_units.flatten().tolist() == [0, 2, 3, 1, 4, 5]
    assert grouping.key_blocks.flatten().tolist() == [4, 2]


def test_the_window_bounds_the_candidates():
    blocks = rows_to_blocks([{0}, {1}, {2}, {0}], 3)
    assert group_query_blocks(blocks, 2, 3).flatten().tolist() == [0, 3, 1, 2]
    # Window 1 only sees row 1 from seed 0: the natural order, which the greedy then only ties.
    assert group_query_blocks(blocks, 2, 1).flatten().tolist() == [0, 1, 2, 3]


def test_a_segment_boundary_keeps_alike_rows_apart():
    blocks = rows_to_blocks([{0}, {1}, {0}, {1}], 2)
    assert group_query_blocks(blocks, 2, segment=0).flatten().tolist() == [0, 2, 1, 3]
    # Segments [0, 2) and [2, 4): each segment's only group is its natural one.
    grouping = query_grouping(blocks, 2, segment=2)
    assert grouping.q_units.flatten().tolist() == [0, 1, 2, 3]
    assert grouping.key_blocks.flatten().tolist() == [4, 4]
    # Segments [0, 3) and a last one of row 3 alone: the window of seed 0 stops at row 2.
    blocks = rows_to_blocks([{0}, {1}, {2}, {0}], 3)
    assert query_grouping(blocks, 3, 3, segment=0).key_blocks.flatten().tolist() == [4, 3]
    grouping = query_grouping(blocks, 3, 3, segment=3)
    assert grouping.q_units.flatten().tolist() == [0, 1, 2, 3, -1, -1]
    assert grouping.key_blocks.flatten().tolist() == [4, 4]


def test_a_full_window_falls_back_to_the_next_free_block():
    # Seed 0 takes rows 2 and 3; from seed 1 the window (1, 4] holds only row 4 free, and once it is
    # taken the group's last row is the first free one after the seed: row 5.
    blocks = rows_to_blocks([{0}, {1}, {0}, {0}, {2}, {3}], 4)
    grouping = query_grouping(blocks, 3, 3)
    assert grouping.q_units.flatten().tolist() == [0, 2, 3, 1, 4, 5]
    assert grouping.key_blocks.flatten().tolist() == [5, 4]


def test_expanded_blocks_group_like_their_copy():
    base = structured_blocks(1, 17, 21, seed=8)
    expanded = base.expand(2, 3, -1, -1)  # stride 0 over Bm and Hm
    grouping = query_grouping(expanded, 4, 5)
    copy = query_grouping(expanded.contiguous(), 4, 5)
    assert torch.equal(grouping.q_units, copy.q_units) and torch.equal(grouping.key_blocks, copy.key_blocks)


def test_permuted_blocks_reads_rows_in_order_and_leaves_padding_empty():
    blocks = random_blocks(1, 1, 5, 6, 0.5, seed=9).expand(2, 3, -1, -1)
    q_units = torch.tensor([4, 0, 3, 1, 2, -1], dtype=torch.int32).expand(2, 3, -1)
    rows = permuted_blocks(blocks, q_units)
    assert rows.shape == (2, 3, 6, 6)
    assert torch.equal(rows[..., :5, :], blocks[..., [4, 0, 3, 1, 2], :])
    assert not rows[..., 5, :].any()


@pytest.mark.parametrize("call,argument", [
    (lambda b: group_query_blocks(b, 0), "group"),
    (lambda b: group_query_blocks(b, 2, 0), "window"),
    (lambda b: group_query_blocks(b, 2.0), "group"),
    (lambda b: group_query_blocks(b, True), "group"),
    (lambda b: group_query_blocks(b.float(), 2), "blocks"),
    (lambda b: group_query_blocks(b[0], 2), "blocks"),
    (lambda b: group_query_blocks(b[:, :, :0], 2), "blocks"),
    (lambda b: group_query_blocks(b, 2, native=True), "blocks"),  # the native path needs CUDA
    (lambda b: group_query_blocks(b, 2, segment=-2), "segment"),
    (lambda b: group_query_blocks(b, 2, segment=2.0), "segment"),
    (lambda b: group_query_blocks(b, 2, segment=True), "segment"),
    (lambda b: group_query_blocks_torch(b, 2, segment=None), "segment"),
    (lambda b: group_query_blocks_torch(b, 2, lack_weight=-1), "lack_weight"),
    (lambda b: group_query_blocks_torch(b, 2, lack_weight=0.5), "lack_weight"),
    (lambda b: permuted_blocks(b, torch.zeros(1, 1, 4)), "q_units"),
    (lambda b: permuted_blocks(b, torch.zeros(2, 1, 4, dtype=torch.int32)), "q_units"),
], ids=["group 0", "window 0", "float group", "bool group", "float blocks", "3-D blocks", "no rows",
        "native on cpu", "negative segment", "float segment", "bool segment", "no segment", "negative lack_weight",
        "float lack_weight", "float q_units",
        "q_units of another shape"])
def test_bad_arguments_raise(call, argument):
    blocks = random_blocks(1, 1, 4, 3, 0.5, seed=10)
    with pytest.raises(InvalidArgumentError) as info:
        call(blocks)
    assert info.value.argument == argument


def test_struct_mirror_layout():
    # TesseraBlockMask (56 bytes), four int32, then three pointers.
    assert ctypes.sizeof(TesseraGroupParams) == 96
    assert TesseraGroupParams.segment.offset == 68
    assert TesseraGroupParams.q_units.offset == 72
    assert TesseraGroupParams.segment_key_blocks.offset == 88
