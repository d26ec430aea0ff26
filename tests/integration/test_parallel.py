"""Context parallelism (Ulysses): two CPU processes over gloo on 127.0.0.1 equal one process.

The two-process part runs ``tests/integration/test_parallel_worker.py`` twice (rank 0 and 1) with a free
loopback port and a hard time limit, then checks what each rank reports:

- (a) ``ulysses_attention``: per-head, broadcast-head and this-rank's-heads masks with partial
  blocks and empty rows, output and log-sum-exp against ``block_sparse_attention`` on the whole
  sequence; plan reuse through the slice memo; the all-to-all round trip;
- (b) a tiny random-weight Wan2.1 transformer with ``TesseraProcessor`` under diffusers'
  ``enable_parallelism(ContextParallelConfig(ulysses_degree=2))`` against the same model and
  sparsifier in one process: static per-head masks (sliced), SSTA masks computed per rank, a dense
  warm-up step; attach before and after ``enable_parallelism``;
- refusals: ring attention at ``enable_parallelism``, HunyuanVideo-1.5 joint attention at its call.

The in-process tests check the configuration refusals without any process group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tessera_diffusers
from tessera_diffusers import TesseraError
from tessera_diffusers.parallel import ContextParallelError, Ulysses
from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.testing import run_ranks

WORKER = Path(__file__).with_name("test_parallel_worker.py")
PACKAGE_ROOT = Path(tessera_diffusers.__file__).resolve().parents[1]
PROCESSORS_ROOT = Path(sys.modules[TesseraProcessor.__module__].__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    PROCESSORS_ROOT != PACKAGE_ROOT,
    reason=f"mixed install: tessera_diffusers from {PACKAGE_ROOT} but its processors from {PROCESSORS_ROOT} "
    "(a stale editable install; run pip install -e . in the checkout under test)",
)
WORLD = 2
TIMEOUT_S = 120  # both ranks together; they need about 10 s on two cores
EXACT = 1e-5  # fp32 on the CPU: the same per-row arithmetic in both runs


def launch(out: Path, cases: str) -> list[subprocess.CompletedProcess]:
    """Run both ranks; kill them if they outlive ``TIMEOUT_S``."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    try:
        return run_ranks(WORKER, WORLD, ["--cases", cases, "--out", str(out)], env=env, timeout=TIMEOUT_S)
    except TimeoutError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp")
    results = launch(out, "raw,wan,refusals")
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{result.stderr[-4000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


# --------------------------------------------------------------------------- (a) the raw function
@pytest.mark.parametrize("mask", ["per_head", "broadcast_heads", "per_head_batch1"])
def test_ulysses_attention_equals_single_process(reports, mask):
    for rank, report in enumerate(reports):
        case = report["raw"][mask]
        assert case["out_shape"] == [2, 100, 4, 16] and case["lse_shape"] == [2, 4, 100], rank
        assert case["out_err"] <= EXACT, (rank, case)
        assert case["lse_err"] <= EXACT and case["lse_inf_match"], (rank, case)
        assert case["chunks1_err"] <= EXACT and case["chunks2_err"] <= EXACT, (rank, case)


def test_ulysses_attention_local_heads_plan_reuse_and_round_trip(reports):
    for rank, report in enumerate(reports):
        raw = report["raw"]
        assert raw["ulysses"] == f"Ulysses(rank={rank}, degree={WORLD})"
        assert raw["local_heads_err"] <= EXACT
        # each of the rank's two head chunks of one mask is planned once, then reused
        assert (raw["repeat_misses"], raw["repeat_hits"]) == (2, 2)
        assert raw["slice_is_memoized"] and raw["round_trip_exact"]
        assert raw["chunked_round_trip_exact"] and raw["chunks_are_head_slices"]
        assert raw["head_chunks"] == [2, 3, 2, 1]  # largest divisor of H/N (2, 6, 10, 4) up to `chunks`
        resend, empty, early, zero, uneven = raw["chunk_errors"]
        assert resend.startswith("InvalidArgumentError: chunk: expected a chunk in [0, 2) not sent yet, got 0"), resend
        assert empty.startswith("InvalidArgumentError: x: expected [2, 200, 1, 16] (chunk 1's heads)"), empty
        assert early.startswith("InvalidArgumentError: HeadChunkGather: expected all 2 chunks sent"), early
        assert zero.startswith("InvalidArgumentError: chunks: expected an int >= 1"), zero
        assert uneven.startswith("InvalidArgumentError: chunks: expected a divisor of this rank's 2 heads"), uneven
        # uneven chunks (weights 1:2 of 3 heads per rank): spans, attention, round trip, bad spans
        assert raw["uneven_spans"] == [[[0, 1], [1, 3]], [[0, 2], [2, 10], [10, 18], [18, 20]]]
        assert raw["uneven_err"] <= EXACT and raw["uneven_round_trip_exact"]
        assert raw["overlapping_spans_error"].startswith("InvalidArgumentError: chunks: expected an int or spans")
        assert raw["wrong_heads_error"].startswith("MaskError: mask head dim: expected 1, 4 (all heads) or 2")


# --------------------------------------------------------------------------- (b) tiny Wan under diffusers cp
CASES = ["static_per_head", "ssta", "warmup_then_ssta"]


@pytest.mark.parametrize("order", ["attach_first", "parallel_first"])
@pytest.mark.parametrize("case", CASES)
def test_wan_context_parallel_equals_single_process(reports, order, case):
    for rank, report in enumerate(reports):
        got = report["wan"][f"{order}/{case}"]
        assert got["ulysses"] == f"Ulysses(rank={rank}, degree={WORLD})"
        assert got["out_shape"] == [1, 4, 2, 16, 16]  # gathered by the _cp_plan's proj_out hook
        assert max(got["errs"]) <= EXACT, (rank, got)
        sparse_steps = got["vs_dense"][1:] if case == "warmup_then_ssta" else got["vs_dense"]
        assert min(sparse_steps) > 1e-3, (rank, got)  # the masks really are sparse
        # Same decisions and the same plan reuse per layer as one process (per rank: its heads).
        for counter in ("sparse_calls", "dense_calls", "plan_builds", "plan_reuses"):
            assert got[counter][0] == got[counter][1], (rank, counter, got)
    if case == "warmup_then_ssta":
        assert reports[0]["wan"][f"{order}/{case}"]["dense_calls"][0] == 2
    if case == "static_per_head":
        # the slices' plans live as long as the static mask: steps 1 and 2 of both layers reuse them
        assert reports[0]["wan"][f"{order}/{case}"]["plan_reuses"][0] == 2 * 2


@pytest.mark.parametrize("case", ["ssta", "static_per_head", "warmup_then_ssta"])
def test_wan_pipelined_head_chunks_equal_single_process(reports, case):
    for rank, report in enumerate(reports):
        got = report["wan"][f"pipelined/{case}"]
        assert got["chunks"] == 2, (rank, got)
        assert max(got["errs"]) <= EXACT, (rank, got)
        # SSTA is head-separable: it runs on each 1-head chunk as it arrives; the static mask
        # (not computed from q, k) on the rank's 2 heads at once
        assert got["sparsifier_heads"] == ([2] if case == "static_per_head" else [1]), (rank, got)
        if case == "warmup_then_ssta":  # step 0 dense (not kept), step 1 computes, step 2 reuses
            assert got["dense_calls"] == [2, 2] and got["sparse_calls"] == [4, 4], (rank, got)
            continue
        assert got["sparse_calls"][0] == got["sparse_calls"][1] == 2 * 3, (rank, got)  # 2 layers x 3 steps
        assert got["masks_computed"] == [4, 4] and got["mask_reuses"] == [2, 2], (rank, got)  # steps 0 and 2
        # one plan per head chunk of each mask (one process: one plan per mask); the static
        # sparsifier hands back the same mask object at step 2, whose plans are kept
        assert got["plan_builds"] == ([4, 2] if case == "static_per_head" else [8, 4]), (rank, got)


def test_join_head_chunks():
    import torch

    from tessera_diffusers import LogicalMask
    from tessera_diffusers.errors import MaskError
    from tessera_diffusers.parallel import ContextParallelError, join_head_chunks
    from tessera_diffusers.testing import random_mask

    parts = [random_mask(1, 2, 100, 100, 16, 16, density=0.3, seed=s) for s in range(3)]
    joined = join_head_chunks(parts, 2)
    assert joined.heads == 6 and torch.equal(joined.blocks, torch.cat([p.blocks for p in parts], 1))
    broadcast = random_mask(1, 1, 100, 100, 16, 16, density=0.3, seed=9)
    assert join_head_chunks([broadcast, broadcast], 2) is broadcast
    mixed = join_head_chunks([broadcast, parts[0]], 2)
    assert mixed.heads == 4 and torch.equal(mixed.blocks[:, :2], broadcast.blocks.expand(1, 2, -1, -1))
    assert join_head_chunks([None, None], 2) is None
    with pytest.raises(ContextParallelError, match="dense decision"):
        join_head_chunks([None, parts[0]], 2)
    with pytest.raises(MaskError, match="head chunk 1"):
        join_head_chunks([parts[0], random_mask(1, 3, 100, 100, 16, 16, seed=4)], 2)
    with pytest.raises(MaskError, match="head chunk 1"):
        join_head_chunks([parts[0], LogicalMask(parts[1].blocks, 16, 16, 100, 99)], 2)


def test_stock_context_parallel_baseline(reports):
    """diffusers' own Ulysses on the same model agrees too (the harness itself is sound)."""
    for report in reports:
        assert report["wan"]["stock_cp_err"] <= EXACT


def test_detach_hands_context_parallelism_back_to_the_stock_processors(reports):
    for report in reports:
        assert report["wan"]["detached_err"] <= EXACT


# --------------------------------------------------------------------------- refusals
def test_ring_attention_refused_at_enable_parallelism(reports):
    for report in reports:
        error = report["refusals"]["ring"]
        assert error.startswith("ContextParallelError: ContextParallelConfig.ring_degree: expected 1"), error


def test_hunyuan_video15_refused_under_context_parallelism(reports):
    for report in reports:
        error = report["refusals"]["hv15"]
        assert error.startswith("ContextParallelError: hunyuan_video15_joint_attention"), error


def cp_config(**fields) -> SimpleNamespace:
    values = {"ring_degree": 1, "ulysses_degree": 2, "ulysses_anything": False, "_ulysses_mesh": None}
    return SimpleNamespace(context_parallel_config=SimpleNamespace(**{**values, **fields}))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"ring_degree": 2, "ulysses_degree": 1}, "ring_degree: expected 1 (Ulysses only), got 2"),
        ({"ring_degree": 2, "ulysses_degree": 2}, "ring_degree: expected 1 (Ulysses only), got 2"),
        ({"ulysses_anything": True}, "ulysses_anything: expected False"),
        ({}, "set up by transformer.enable_parallelism"),
    ],
    ids=["ring", "unified", "ulysses_anything", "not_set_up"],
)
def test_config_refusals(fields, message):
    with pytest.raises(ContextParallelError, match=re.escape(message)):
        Ulysses.from_parallel_config(cp_config(**fields))
    processor = TesseraProcessor()
    with pytest.raises(TesseraError, match=re.escape(message)):
        processor._parallel_config = cp_config(**fields)  # what enable_parallelism does
    assert processor.ulysses is None and processor._parallel_config is None


def test_no_context_parallelism_is_a_no_op():
    assert Ulysses.from_parallel_config(None) is None
    assert Ulysses.from_parallel_config(SimpleNamespace(context_parallel_config=None)) is None
    processor = TesseraProcessor()
    processor._parallel_config = None
    assert processor.ulysses is None


def test_ulysses_needs_torch_distributed():
    with pytest.raises(ContextParallelError, match="not initialised"):
        Ulysses()
