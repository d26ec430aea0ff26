"""The benchmark harness on the CPU: the smoke run end to end, the baselines' mask conversions
(checked without a GPU by rebuilding the logical mask from them), timing, the oracle check and the
aggregate metrics on hand-made records."""

from __future__ import annotations

import json
import math
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from tessera_diffusers import LogicalMask, reference
from tessera_diffusers.bench import cli
from tessera_diffusers.bench.backends import (
    FlexAttentionBackend,
    FlexAttentionTuned,
    OracleBackend,
    Skip,
    fastest_option,
    flex_candidate_options,
    flex_kernel_options,
    kv_block_lists,
)
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.flashinfer_backends import (
    FlashInferBsr,
    FlashInferVariable,
    bsr_plan_args,
    folded_bsr,
    gathered_key_tokens,
    plan_growing_workspace,
    variable_block_sizes,
    workspace_of_overflow,
)
from tessera_diffusers.bench.harness import RunState, interleaved_case
from tessera_diffusers.bench.metrics import compare, geometric_mean, regrets, summarize
from tessera_diffusers.bench.problem import OracleCheck, Problem, check_heads, make_inputs
from tessera_diffusers.bench.timing import time_interleaved, time_kernel, time_request
from tessera_diffusers.corpus import CaseSpec, LatentGrid
from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.testing import random_mask


def small_problem(seed: int = 0, heads: int = 3) -> Problem:
    mask = random_mask(1, heads, 200, 200, 32, 48, density=0.3, seed=seed)  # partial blocks, empty rows
    return Problem("p", "test", "Q32K48", "random", mask, 1, heads, 16, torch.float32)


def test_smoke_run_writes_its_files(tmp_path) -> None:
    out = tmp_path / "smoke"
    rc = cli.main(["--smoke", "--out", str(out), "--no-progress", "--families", "Q32K16,Q64K64-DD"])
    assert rc == 0
    for name in ("records.jsonl", "results.json", "results.md", "speedup_vs_dense_smoke.png",
                 "latency_vs_density_smoke.png"):
        assert (out / name).is_file(), name
    payload = json.loads((out / "results.json").read_text())
    records = payload["records"]
    assert {r["family"] for r in records} == {"Q32K16", "Q64K64-DD"}
    by_backend = {}
    for r in records:
        by_backend.setdefault(r["backend"].split(":")[0], []).append(r)
    assert all(r["status"] == "ok" and r["check"]["ok"] for r in by_backend["reference"])
    plans = by_backend["tessera"]
    assert any(r["status"] == "ok" for r in plans), "the PyTorch executor plans are measured on the CPU"
    for r in plans:
        if r["status"] == "ok":
            assert r["check"]["ok"] and r["kernel_ms"] > 0 and r["request_ms"] > 0 and len(r["kernel"]["samples_ms"]) == 2
    selected = [r for r in plans if r["backend"] == "tessera"]
    assert selected and all(r["status"] == "skipped" for r in selected)  # no native kernels on a CPU
    assert payload["environment"]["torch"] == torch.__version__
    markdown = (out / "results.md").read_text()
    assert "# Tessera benchmark" in markdown and "Q64K64-DD" in markdown and "torch " + torch.__version__ in markdown
    # The report can be rebuilt from the records alone, and it keeps the measuring run's environment
    # (a report rebuilt on another machine must not name that machine's GPU, versions or timer).
    payload["environment"].update(gpu="NVIDIA H200", capability="sm90", torch="2.11.0+cu130")
    (out / "results.json").write_text(json.dumps(payload))
    assert cli.main(["--smoke", "--out", str(out), "--no-progress", "--report-only"]) == 0
    rebuilt = (out / "results.md").read_text()
    assert "NVIDIA H200 sm90" in rebuilt and "torch 2.11.0+cu130" in rebuilt and "CUDA-event timings" in rebuilt
    assert json.loads((out / "results.json").read_text())["environment"]["gpu"] == "NVIDIA H200"


def test_interleaved_bench_times_a_case_in_turn(tmp_path) -> None:
    out = tmp_path / "interleaved"
    assert cli.main(["--smoke", "--interleave", "--out", str(out), "--no-progress", "--families", "Q64K64-DD",
                     "--no-plots"]) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["status"] == "ok"]
    assert len(timed) >= 3 and any(r["backend"] == "reference" for r in timed)
    names = sorted(r["backend"] for r in timed)
    for r in timed:  # one batch: every valid backend of the case timed with all the others
        assert r["timing_method"] == "interleaved" and sorted(r["timed_with"]) == names
        assert len(r["kernel"]["samples_ms"]) == 2 and r["request_ms"] > 0 and r["check"]["ok"]
    assert "timed in turn with the device kept busy" in (out / "results.md").read_text()
    assert cli.main(["--smoke", "--out", str(out), "--no-progress", "--report-only", "--no-plots"]) == 0
    assert "timed in turn with the device kept busy" in (out / "results.md").read_text()  # from the records


class Flaky(OracleBackend):
    """The oracle under another name; ``oom_once`` runs out of memory on its first preparation."""

    def __init__(self, name: str, oom_once: bool = False, wrong: bool = False):
        self.name, self.oom_left, self.wrong = name, int(oom_once), wrong

    def prepare(self, problem: Problem):
        if self.oom_left:
            self.oom_left -= 1
            raise torch.OutOfMemoryError("simulated: the held backends fill the device")
        return problem

    def run(self, prepared, inputs):
        out = super().run(prepared, inputs)
        return out + 1.0 if self.wrong else out


class DenseFake(OracleBackend):
    """Full attention (every block active) on the oracle: a dense baseline the CPU can run."""

    kind = "dense"

    def __init__(self, name: str):
        self.name = name

    def run(self, prepared, inputs):
        q, k, v = inputs
        full = LogicalMask.dense(prepared.seq_q, prepared.seq_kv, 128, 128)
        return reference.attention(q, k, v, full, prepared.scale)


def test_interleaved_bench_makes_room_when_out_of_memory(tmp_path) -> None:
    """Out of memory while others are held: they are timed as a batch and freed, then the backend is
    validated again; an invalid output is recorded and never timed. A dense baseline is checked
    against full attention and timed with the case's other backends (not shared across cases)."""
    problem = small_problem()
    config = BenchConfig(out_dir=tmp_path, device="cpu", warmup=1, reps=2, input_sets=2, request_reps=1,
                         interleave=True, progress=False)
    state = RunState(config, torch.device("cpu"), [], {}, [], set(), {}, tmp_path / "records.jsonl", lambda _: None)
    inputs = make_inputs(problem, 2, 0)
    oracle = OracleCheck(problem, inputs[0], check_heads(problem.heads, 2), None)
    backends = [Flaky("a"), Flaky("b"), Flaky("c", oom_once=True), Flaky("d", wrong=True), Flaky("e"),
                DenseFake("f")]
    interleaved_case(state, problem, backends, inputs, oracle, None)
    by_name = {r["backend"]: r for r in state.records}
    assert sorted(by_name) == ["a", "b", "c", "d", "e", "f"]
    assert by_name["a"]["timed_with"] == by_name["b"]["timed_with"] == ["a", "b"]
    assert by_name["c"]["timed_with"] == by_name["e"]["timed_with"] == by_name["f"]["timed_with"] == ["c", "e", "f"]
    assert by_name["d"]["status"] == "invalid" and "timed_with" not in by_name["d"]
    # "ok" for f means its full attention passed the dense oracle (the masked one would refuse it)
    assert all(by_name[n]["status"] == "ok" for n in "abcef") and by_name["f"]["kind"] == "dense"


def test_flex_block_mask_is_the_logical_mask() -> None:
    backend = FlexAttentionBackend()
    if backend._error:  # a torch without FlexAttention: nothing to check here
        pytest.skip(backend._error)
    problem = small_problem()
    block_mask = backend.block_mask(problem)
    assert block_mask.BLOCK_SIZE == (32, 48)
    assert tuple(block_mask.seq_lengths) == (200, 200)
    assert torch.equal(block_mask.to_dense().bool(), problem.mask.blocks)
    counts, indices = kv_block_lists(problem.mask.blocks)
    assert torch.equal(counts, problem.mask.blocks.sum(-1).to(torch.int32))
    first = indices[0, 0, 0, : int(counts[0, 0, 0])]
    assert torch.equal(first.sort().values, first) and bool(problem.mask.blocks[0, 0, 0, first.long()].all())
    assert flex_kernel_options(16, 16)["BLOCK_M"] == 16 and flex_kernel_options(384, 384)["BLOCK_N"] == 64
    assert flex_kernel_options(128, 64) == {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


def test_flex_candidates_start_with_the_matched_options_and_stay_valid() -> None:
    for block_q, block_kv in ((16, 16), (64, 32), (64, 64), (128, 128), (384, 384)):
        candidates = flex_candidate_options(block_q, block_kv)
        assert candidates[0] == flex_kernel_options(block_q, block_kv)
        assert len(candidates) == len({tuple(sorted(c.items())) for c in candidates})  # no repeats
        for option in candidates:  # FlexAttention needs tiles that divide the blocks
            assert block_q % option["BLOCK_M"] == 0 and block_kv % option["BLOCK_N"] == 0
    assert {c["BLOCK_N"] for c in flex_candidate_options(128, 128)} == {64, 128}
    assert {c["BLOCK_N"] for c in flex_candidate_options(64, 64)} == {64}
    assert {(c["num_warps"], c["num_stages"]) for c in flex_candidate_options(64, 64)} == {(4, 2), (4, 3), (8, 2), (8, 3)}


def test_flex_tuned_keeps_the_fastest_option_per_shape_and_reports_what_it_tried() -> None:
    backend = FlexAttentionTuned()
    if backend._error:
        pytest.skip(backend._error)
    problem = small_problem()
    timed = []

    def time_options(problem, block_mask, option):
        timed.append(option)
        if option["num_stages"] == 2 and option["num_warps"] == 8:
            raise RuntimeError("out of resource: shared memory")  # a failed candidate is only ruled out
        return 1.0 + option["num_warps"] / 10 - option["num_stages"] / 100

    backend.time_options = time_options
    chosen = backend.kernel_options(problem)
    assert chosen == {**flex_kernel_options(32, 48), "num_warps": 4, "num_stages": 3}
    assert len(timed) == len(flex_candidate_options(32, 48))
    assert backend.kernel_options(problem) == chosen and len(timed) == len(flex_candidate_options(32, 48))  # once
    (tried,) = backend.tried.values()
    assert sum(isinstance(t["ms"], str) for t in tried) == 1 and "out of resource" in next(
        t["ms"] for t in tried if isinstance(t["ms"], str))
    assert backend.describe()["tried"] is backend.tried
    with pytest.raises(Skip, match="no FlexAttention configuration ran"):
        fastest_option([{"a": 1}], lambda option: 1 / 0)


@pytest.fixture
def dynamo_settings_restored():
    """The Flex backend raises dynamo's recompile limits process-wide; put them back after the test."""
    config = torch._dynamo.config
    names = ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit")
    saved = {n: getattr(config, n) for n in names if hasattr(config, n)}
    yield
    for name, value in saved.items():
        setattr(config, name, value)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler for inductor")
def test_flex_compiled_on_cpu_follows_the_block_mask(dynamo_settings_restored) -> None:
    """Inductor's CPU FlexAttention template honours block sparsity, so the BlockMask the baseline
    builds (every active block full, partial last blocks, empty rows) can be checked end to end."""
    backend = FlexAttentionBackend()
    if backend._error:
        pytest.skip(backend._error)
    mask = CaseSpec("Q64K64-DD", "importance_topk", LatentGrid("flex", 3, 16, 30, 0, 2), 2, 3).build()
    assert mask.seq_len_q % 64 and bool((~mask.blocks.any(-1)).any())  # partial blocks and empty rows
    problem = Problem("flex", "test", "Q64K64-DD", "importance_topk", mask, 1, 2, 64, torch.float32)
    inputs = make_inputs(problem, 1, seed=3)[0]
    block_mask, _, scale = backend.prepare(problem)
    out = backend.compiled()(*backend.convert(*inputs), block_mask=block_mask, scale=scale)
    check = OracleCheck(problem, inputs, [0, 1]).compare(backend.to_bshd(out, problem))
    assert check.ok, check


def test_flashinfer_inputs_rebuild_the_mask() -> None:
    problem = small_problem(seed=1)
    blocks = problem.mask.blocks  # [1, 3, nQ, nKV]
    n_q, n_kv = blocks.shape[-2:]
    indptr, indices = folded_bsr(blocks, 1, 3)
    assert indptr.numel() == 3 * n_q + 1 and int(indptr[-1]) == indices.numel() == int(blocks.sum())
    folded = torch.zeros(3 * n_q, 3 * n_kv, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(3 * n_q), (indptr[1:] - indptr[:-1]).long())
    folded[rows, indices.long()] = True
    for h in range(3):  # block-diagonal: head h's rows see only head h's keys
        assert torch.equal(folded[h * n_q:(h + 1) * n_q, h * n_kv:(h + 1) * n_kv], blocks[0, h])
    assert int(folded.sum()) == int(blocks.sum())
    block_map, row_sz, col_sz = variable_block_sizes(problem)
    assert torch.equal(block_map, blocks[0]) and row_sz.dtype == torch.int32
    assert (row_sz.sum(1) == 200).all() and (col_sz.sum(1) == 200).all() and int(col_sz[0, -1]) == 200 - 4 * 48
    assert gathered_key_tokens(problem) == int((blocks[0].double() @ col_sz[0].double()).sum())


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [Hq, M, D]``, ``k, v [Hkv, N, D]``, ``allowed [Hkv|1, M, N]``: fp64 attention, rows without
    a key give 0."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.nan_to_num(torch.softmax(scores, -1), nan=0.0) @ v.double()


def flashinfer_bsr_semantics(q, k, v, indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads, head_dim, scale):
    """What ``BlockSparseAttentionWrapper.plan(indptr, indices, M, N, R, C, ...)`` then ``run(q, k, v)``
    compute, per FlashInfer's docstring (0.3.1 and 0.7.4): q ``[M, Hq, D]``, k, v ``[N, Hkv, D]``;
    block row ``i`` is query rows ``[i*R, min((i+1)*R, M))``, block column ``j`` keys ``[j*C, (j+1)*C)``."""
    assert q.shape == (M, num_qo_heads, head_dim) and k.shape == v.shape == (N, num_kv_heads, head_dim)
    assert indptr.numel() - 1 == math.ceil(M / R) and N % C == 0 and int(indices.max()) < N // C
    allowed = torch.zeros(M, N, dtype=torch.bool)
    for i in range(indptr.numel() - 1):
        for j in indices[int(indptr[i]):int(indptr[i + 1])].tolist():
            allowed[i * R:min((i + 1) * R, M), j * C:(j + 1) * C] = True
    out = masked_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allowed[None], scale)
    return out.transpose(0, 1)  # [M, Hq, D]


def flashinfer_variable_semantics(q, k, v, block_mask_map, block_row_sz, block_col_sz, scale):
    """What ``VariableBlockSparseAttentionWrapper`` computes: q ``[H, S, D]``; block ``(i, j)`` of head
    ``h`` covers query rows ``block_row_sz[h, :i].sum()`` + ``[0, block_row_sz[h, i])`` and the same
    for keys with ``block_col_sz``."""
    heads = q.shape[0]
    allowed = torch.zeros(heads, q.shape[1], k.shape[1], dtype=torch.bool)
    for h in range(heads):
        rows = torch.cat([torch.zeros(1, dtype=torch.long), block_row_sz[h].long().cumsum(0)])
        cols = torch.cat([torch.zeros(1, dtype=torch.long), block_col_sz[h].long().cumsum(0)])
        for i, j in torch.nonzero(block_mask_map[h]).tolist():
            allowed[h, rows[i]:rows[i + 1], cols[j]:cols[j + 1]] = True
    return masked_attention(q, k, v, allowed, scale)


def test_flashinfer_bsr_fold_computes_the_masked_attention() -> None:
    """The BSR variant's plan arguments and folded q, k, v, run through FlashInfer's documented BSR
    semantics and unfolded, give the problem's masked attention (per-batch, per-head masks)."""
    mask = random_mask(2, 3, 192, 144, 32, 48, density=0.4, seed=5)  # whole blocks, empty rows
    problem = Problem("p", "test", "Q32K48", "random", mask, 2, 3, 16, torch.float32)
    backend = FlashInferBsr("fa2")
    q, k, v = make_inputs(problem, 1, seed=4)[0]
    args = bsr_plan_args(problem)
    assert args[2:] == (2 * 3 * 192, 2 * 3 * 144, 32, 48, 1, 1, 16)
    out = flashinfer_bsr_semantics(*backend.convert(q, k, v), *args, problem.scale)
    want = reference.attention(q, k, v, mask, problem.scale)
    torch.testing.assert_close(backend.to_bshd(out, problem).float(), want, rtol=1e-5, atol=1e-5)


def test_flashinfer_variable_blocks_compute_the_masked_attention() -> None:
    """The variable-block variant's plan arguments (partial last blocks) and (H, S, D) inputs, run
    through FlashInfer's documented semantics, give the problem's masked attention."""
    problem = small_problem(seed=2)  # 200 tokens in 32 x 48 blocks: partial last blocks, empty rows
    backend = FlashInferVariable("fa2")
    q, k, v = make_inputs(problem, 1, seed=5)[0]
    out = flashinfer_variable_semantics(*backend.convert(q, k, v), *variable_block_sizes(problem), problem.scale)
    want = reference.attention(q, k, v, problem.mask, problem.scale)
    torch.testing.assert_close(backend.to_bshd(out, problem).float(), want, rtol=1e-5, atol=1e-5)


def test_flashinfer_plan_grows_the_workspace_the_overflow_names() -> None:
    """FlashInfer's scheduler names the allocation that overflowed: split-KV partial outputs are in the
    float workspace, the rest of the plan in the int one; anything else is not retried."""
    def overflow(name: str) -> str:  # the message of flashinfer/allocator.h (0.7.4)
        return (f"Buffer overflow when allocating memory for {name} with size 4096 and alignment 16, but only 0 "
                "bytes available in AlignedAllocator. Increase the workspace buffer size.")

    assert workspace_of_overflow(overflow("batch_prefill_tmp_v")) == "float"
    assert workspace_of_overflow(overflow("batch_prefill_tmp_s")) == "float"
    assert workspace_of_overflow(overflow("batch_prefill_sm90_qo_tile_indices")) == "int"
    assert workspace_of_overflow(overflow("batch_prefill_merge_indptr")) == "int"
    grown: list[str] = []
    fake = SimpleNamespace(grow_float_workspace=lambda: grown.append("float"),
                           grow_int_workspace=lambda: grown.append("int"))
    errors = [RuntimeError(overflow("batch_prefill_tmp_v")), RuntimeError(overflow("batch_prefill_request_indices"))]

    def plan() -> None:
        if errors:
            raise errors.pop(0)

    plan_growing_workspace(fake, plan)
    assert grown == ["float", "int"]
    with pytest.raises(RuntimeError, match="unrelated"):
        plan_growing_workspace(fake, lambda: (_ for _ in ()).throw(RuntimeError("unrelated failure")))
    assert grown == ["float", "int"]


def test_flashinfer_token_lists_follow_the_wrapper_version() -> None:
    """0.3.1's fa3 BSR expands block indices into per-token offsets in fixed buffers (int32-bounded,
    grown to fit, reported in the record); 0.7.4's has no such buffers; the variable wrapper lists
    tokens on both."""
    old = FlashInferBsr("fa3")
    old._wrapper = SimpleNamespace(_vector_sparse_indices_buffer=torch.empty(4, dtype=torch.int32),
                                   _vector_sparse_indptr_buffer=torch.empty(2, dtype=torch.int32))
    assert old.token_indexed() and "run_includes" in old.describe()
    old.grow_vector_sparse(3, 10, torch.device("cpu"))
    assert old._wrapper._vector_sparse_indices_buffer.numel() == 11 and old._wrapper._vector_sparse_indptr_buffer.numel() == 4
    new = FlashInferBsr("fa3")
    new._wrapper = SimpleNamespace()
    assert not new.token_indexed() and "run_includes" not in new.describe()
    new.grow_vector_sparse(3, 10, torch.device("cpu"))  # nothing to grow
    assert vars(new._wrapper) == {}
    fa2 = FlashInferBsr("fa2")
    fa2._wrapper = old._wrapper
    assert not fa2.token_indexed()
    assert FlashInferVariable("fa3").token_indexed() and FlashInferVariable("fa2").token_indexed()


def test_flashinfer_records_keep_their_variant_name() -> None:
    """describe() is merged into the record: it must not carry a "backend" key, which would
    overwrite the variant's name and average the BSR and variable-block records in the report."""
    for backend in (FlashInferBsr("fa3"), FlashInferVariable("fa2")):  # no flashinfer here: still describable
        assert "backend" not in backend.describe()


def test_timing_rotates_inputs_and_counts_reps() -> None:
    calls = []
    timing = time_kernel(calls.append, 3, 2, 5, torch.device("cpu"))
    assert calls == [0, 1, 2, 0, 1, 2, 0]  # 2 warm-ups then 5 timed, rotating over 3 sets
    assert len(timing.samples_ms) == 5 and timing.timer == "host_monotonic"
    calls.clear()
    timing = time_request(calls.append, 2, 1, 3, torch.device("cpu"))
    assert calls == [0, 1, 0, 1] and len(timing.samples_ms) == 3
    with pytest.raises(InvalidArgumentError):
        time_kernel(calls.append, 1, 0, 0, torch.device("cpu"))


def test_sustained_warmup_runs_until_the_device_was_busy_that_long() -> None:
    """time_kernel(..., warmup_ms): after the counted warm-ups, calls in growing batches until they
    took that long (host time on a CPU), rotating the input sets on; then the timed calls."""
    calls = []

    def run(i):
        calls.append(i)
        time.sleep(0.001)

    timing = time_kernel(run, 3, 2, 4, torch.device("cpu"), warmup_ms=6.0)
    warm = len(calls) - 2 - 4
    assert 3 <= warm <= 7  # batches of 1, 2, 4 calls of >= 1 ms each reach 6 ms after 3 to 7 calls
    assert calls == [i % 3 for i in range(len(calls))] and len(timing.samples_ms) == 4
    with pytest.raises(InvalidArgumentError, match="warmup_ms"):
        time_kernel(run, 1, 0, 1, torch.device("cpu"), warmup_ms=-1.0)


def test_interleaved_timing_takes_every_kernel_in_turn() -> None:
    """Warm-up rounds of every kernel, then reps rounds, each a permutation of the kernels (the same
    in every run), input set (warmup + r) % n_sets in round r: one Timing of reps samples per kernel,
    in the runs' order. No kernel follows the same one in every round."""
    calls = []
    runs = [lambda i, j=j: calls.append((j, i)) for j in range(5)]
    timings = time_interleaved(runs, 2, 1, 8, torch.device("cpu"))
    assert calls[:5] == [(j, 0) for j in range(5)]  # one warm-up round on set 0
    rounds = [calls[5 + 5 * r: 10 + 5 * r] for r in range(8)]
    for r, launched in enumerate(rounds):
        assert sorted(j for j, _ in launched) == list(range(5)) and {i for _, i in launched} == {(1 + r) % 2}
    for j in range(5):
        before = {launched[k - 1][0] for launched in rounds for k in range(1, 5) if launched[k][0] == j}
        assert len(before) >= 2, f"kernel {j} always follows the same kernel"
    first = list(calls)
    calls.clear()
    time_interleaved(runs, 2, 1, 8, torch.device("cpu"))
    assert calls == first  # the same order in every run
    assert [len(t.samples_ms) for t in timings] == [8] * 5 and timings[0].timer == "host_monotonic"
    calls.clear()  # other work launched before every kernel, warm-ups included
    time_interleaved(runs, 2, 1, 8, torch.device("cpu"), between=lambda: calls.append(("between", None)))
    assert calls[0::2] == [("between", None)] * 45 and calls[1::2] == first
    assert time_interleaved([], 2, 1, 3, torch.device("cpu")) == []
    with pytest.raises(InvalidArgumentError):
        time_interleaved(runs, 1, 0, 0, torch.device("cpu"))


def test_oracle_check_accepts_the_oracle_and_rejects_errors() -> None:
    problem = small_problem(seed=2)
    q, k, v = make_inputs(problem, 1, seed=0)[0]
    assert not bool((q == 0).any())
    heads = check_heads(problem.heads, 2)
    assert heads == [0, 2]
    check = OracleCheck(problem, (q, k, v), heads)
    from tessera_diffusers import reference

    exact = reference.attention(q, k, v, problem.mask)
    assert check.compare(exact).ok
    empty_rows = ~problem.mask.blocks.any(-1)
    assert bool(empty_rows[0, heads].any()), "the test mask has empty rows on the checked heads"
    wrong = exact.clone()
    wrong[0, 5, 0, 0] += 0.1
    result = check.compare(wrong)
    assert not result.ok and not result.within_tolerance
    nonzero_empty = exact.clone()
    row_block = int(torch.nonzero(empty_rows[0, 0])[0])
    nonzero_empty[0, row_block * 32, 0] = 1.0
    result = check.compare(nonzero_empty)
    assert result.within_tolerance and not result.empty_rows_zero and not result.ok
    nan = exact.clone()
    nan[0, 0, 2, 0] = math.nan
    assert not check.compare(nan).within_tolerance


def record(case: str, backend: str, family: str, ms: float, **extra) -> dict:
    base = {"size": "s", "case": case, "backend": backend, "family": family, "status": "ok", "kernel_ms": ms,
            "request_ms": 2 * ms, "tflops": 100.0 / ms, "density": 0.1}
    return {**base, **extra}


def test_metrics_on_known_records() -> None:
    records = [
        record("a", "tessera", "Q64K64", 1.0, selected_plan="p1"),
        record("b", "tessera", "Q64K64", 3.0, selected_plan="p2"),
        record("a", "flex", "Q64K64", 3.0),
        record("b", "flex", "Q64K64", 3.05),
        record("c", "tessera", "Q16K16", 2.0, selected_plan="p1"),
        record("c", "flex", "Q16K16", 1.0),
        record("a", "sdpa-cudnn", "Q64K64", 10.0, tflops=50.0),
        record("a", "flashinfer-bsr-fa2", "Q64K64", 2.0),
        record("b", "flashinfer-bsr-fa2", "Q64K64", 2.0),
        record("a", "flashinfer-var-fa2", "Q64K64", 1.5),  # faster, but ran on fewer cases
        record("a", "tessera:p1", "Q64K64", 1.0),
        record("a", "tessera:p2", "Q64K64", 0.8),
        record("b", "tessera:p1", "Q64K64", 2.5),
        {**record("b", "tessera:p2", "Q64K64", 9.0), "status": "invalid", "reason": "x"},
    ]
    flex = compare(records, "tessera", "flex")["s"]
    assert flex["families"]["Q64K64"]["speedup"] == pytest.approx((3.0 + 3.05) / (1.0 + 3.0))  # ratio of means
    assert flex["families"]["Q16K16"]["speedup"] == pytest.approx(0.5)
    assert flex["paired_case_gm"] == pytest.approx(geometric_mean([3.0, 3.05 / 3.0, 0.5]))
    assert flex["nine_family_gm"] == pytest.approx(math.sqrt(6.05 / 4.0 * 0.5))
    assert (flex["win"], flex["tie"], flex["loss"]) == (1, 1, 1)  # b is within the 3% band
    regret = {r["case"]: r for r in regrets(records)}
    assert regret["a"]["regret"] == pytest.approx(1.0 / 0.8) and regret["a"]["best_plan"] == "p2"
    # b selected p2, whose forced run was invalid: its own timed run (3.0) against the best valid plan (2.5)
    assert regret["b"]["regret"] == pytest.approx(1.2) and regret["b"]["best_plan"] == "p1"
    summary = summarize(records)
    fam = summary["families"]["s"]["Q64K64"]
    assert fam["flashinfer-best"]["variants"] == ["flashinfer-bsr-fa2"]  # the variant that ran on both cases
    assert fam["tessera"]["efficiency"] == pytest.approx((100.0 / 1.0) / 50.0)  # only case a has cuDNN
    assert fam["tessera-best-plan"]["variants"] == ["tessera:p1"]  # the only plan valid on every case
    assert summary["status"]["tessera:*"]["invalid"] == 1


def test_report_commit_only_for_the_top_of_a_checkout(tmp_path) -> None:
    """A copy of the sources inside another repository (as on the GPU host, where the tree runs
    from a folder of a checkout) reports no commit instead of the outer repository's HEAD."""
    import subprocess

    from tessera_diffusers.bench.report import source_commit

    if shutil.which("git") is None:
        pytest.skip("no git")
    outer = tmp_path / "outer"
    inner = outer / "copy"
    inner.mkdir(parents=True)
    run = {"cwd": outer, "capture_output": True}
    subprocess.run(["git", "init", "-q"], check=True, **run)
    (outer / "f").write_text("x")
    subprocess.run(["git", "add", "f"], check=True, **run)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"], check=True, **run)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True, check=True, **run).stdout.strip()
    assert source_commit(outer) == head
    assert source_commit(inner) is None
    assert source_commit(tmp_path) is None
