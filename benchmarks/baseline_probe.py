#!/usr/bin/env python3
"""Baseline probe: why the H200 baselines depart from issue 5's anchors (DESIGN section 9).

The committed H200 run (``benchmarks/results/h200_bench_n32k``; N=32,768, H=24, D=128, bf16, ~10%)
found FlexAttention about 2x *faster* than the anchors (Q64K64 3.1 ms vs ~6.5 ms) and FlashInfer's
fa3 backend far *slower* (column "fa3": Q128K128 7.1 ms vs fa2 4.2 ms; Q16K16 83 ms vs 10.8 ms). This
script isolates the causes on the same corpus cases the harness used, in one run, and writes
``probe.json`` and ``probe.md`` to ``--out``.

    python3 benchmarks/baseline_probe.py --out /tmp/probe             # on the H200
    python3 benchmarks/baseline_probe.py --out /tmp/probe --dry-run   # CPU: masks, counts, source only

What it measures
----------------
Flex (Q64K64, Q128K128), each output checked against an fp32 masked SDPA on heads 0 and H-1:
  * ``harness``: ``BlockMask.from_kv_blocks`` at the logical block size, every active block a *full*
    block (no ``mask_mod``), kernel BLOCK_M/N matched to the geometry, ``torch.compile``d.
  * ``harness-contiguous-BHSD``: the same, with q/k/v copied to contiguous (B, H, S, D) (the harness
    passes transposed views of the diffusers (B, S, H, D) tensors).
  * ``partial+mask_mod``: the same blocks declared *partial*, with a ``mask_mod`` reading the block
    table (what ``create_block_mask``-style code runs: the mask is evaluated in every tile).
  * ``coarse128-default``: a 128x128 BlockMask derived from the same mask (128-blocks covered by
    active blocks are full, touched ones partial with the table ``mask_mod``; exact), default kernel
    options (torch's H100 config, BLOCK_M=128, BLOCK_N=64): the common "default flex" setup.
  * ``default-options@native``: default kernel options with the native 64x64 BlockMask (torch 2.11
    refuses: BLOCK_M=128 does not divide 64; recorded as an error, not a time).
  * ``eager``: uncompiled ``flex_attention`` on one head (dense fp32 math, extrapolated x H), with
    the harness BlockMask and with the table ``mask_mod``, beside the compiled kernel on that head.
  * counts: |E(M)| against the token pairs in the (q block, kv block) pairs flex visits
    (``kv_num_blocks + full_kv_num_blocks``), and the BlockMask's block set against the mask.
FlashInfer 0.3.1 (Q16K16, Q64K64, Q128K128), layout and plan() arguments exactly as the harness:
  * ``bsr-fa2``, ``bsr-fa3``, ``var-fa2``, ``var-fa3``: kernel time of ``run()`` (CUDA events),
    plan() host time, the plan FlashInfer chose (tensor cores, CTA tile, R/C as passed).
  * ``bsr-fa3`` split: the block->token index expansion kernel alone; ``run()`` with that expansion
    cached (the fa3 attention kernel alone); an equivalent vectorised torch expansion (checked equal).
  * counts/models: folded block rows, nnz, per-token index entries, Q-tile fill of fa2's and fa3's
    CTA_Q, and the expansion kernel's serial work (no GPU needed: also in ``--dry-run``).
  * ``--fp16-qk`` (opt-in, two more JIT modules): bsr-fa2/fa3 with ``use_fp16_qk_reduction=True``.
Only three FlashInfer JIT modules are built (bf16 batch-prefill fa2, the same for fa3, ``page``);
the build starts in a background thread at start-up so it overlaps the Flex compiles.

Mechanisms found in the FlashInfer 0.3.1 source (the script re-reads the source and prints the lines)
----------------------------------------------------------------------------------------------------
1. The report's "fa3" column mixed two wrappers. ``FlashInferBase.describe()`` returned a "backend"
   key that overwrote the record's backend name, so ``flashinfer-bsr-fa3`` and ``flashinfer-var-fa3``
   were both recorded as "fa3" and averaged: Q128K128 7.125 = (11.29 bsr + 2.96 var) / 2. The
   variable-block fa3 wrapper ran at 2.96 ms there, near the anchor (~2.7). Fixed in
   ``tessera_diffusers/bench/flashinfer_backends.py`` (key renamed) and ``harness.py`` (the record
   keeps its backend name; old records are relabelled when loaded).
2. ``BlockSparseAttentionWrapper.run()`` with backend fa3 and C > 1 calls
   ``block_sparse_indices_to_vector_sparse_offsets`` on *every* call: the fa3 kernel has no BSR mode,
   it gathers K/V per token (page size 1, ``USE_TMA_LOAD_KV=false``), so block indices are expanded
   to one int32 per key token (nnz*C entries: 179M at Q16K16, hence the 128M-buffer overflow). The
   expansion kernel (``include/flashinfer/page.cuh``) is launched with grid = #SMs, 512 threads, and
   loops ``for (int b = blockIdx.x; b < batch_size; ++b)``: the row loop advances by 1, not by
   ``gridDim.x``, so CTA 0 walks every block row alone (and every CTA rewrites the rows after its
   index). Its time grows with the number of block rows (H*N/R) and is counted in ``run()``.
   The variable-block wrapper passes block_size 1, which skips that kernel.
3. The fa3 paged kernel for head_dim 128 is fixed at CTA_Q=128, CTA_KV=96 and the SM90 scheduler
   uses cta_tile_q=128 for every request. Each BSR block row is one request of R query rows, so a
   tile is R/128 full: 12.5% at R=16, 50% at R=64 (fa2 picks a 16/64/128-row tile from the average
   request length, ``FA2DetermineCtaTileQ``). That is consistent with var-fa3 (no expansion) losing
   to fa2 below R=128 and winning at R>=128 in the committed run; the probe prints tile fill beside
   the attention-only times so the two can be compared.
4. Not causes: no per-token fallback *kernel* is chosen for small blocks (the CUDA-core decode path
   is taken only when R*(qo/kv heads) < 4; R >= 16 here); the JIT builds all four mask modes into
   each module and run() uses NON_CAUSAL (no custom mask; fa3 would refuse one); the dtypes are the
   inputs' (bf16, passed to plan()); ``use_fp16_qk_reduction`` is rejected by fa3's backend check
   and only changes fa2's accumulator for fp16 inputs, never for bf16.
Flex: eager ``flex_attention`` evaluates only ``mask_mod`` over the dense S x S scores and ignores
the BlockMask's block lists, so eager with the harness BlockMask (no mask_mod) computes *dense*
attention (wrong) and eager with a table mask_mod is exact but dense-cost; neither can be a
few-ms anchor. The anchor's ~2x is what a coarser or mask_mod-evaluating setup costs; the probe
times those setups rather than guessing which one the anchor used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

from tessera_diffusers.bench.backends import (
    FlexAttentionBackend,
    flex_kernel_options,
    kv_block_lists,
    to_heads_first,
)
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.flashinfer_backends import (
    FlashInferBsr,
    FlashInferVariable,
    folded_bsr,
    gathered_key_tokens,
    import_flashinfer,
)
from tessera_diffusers.bench.harness import problem_for
from tessera_diffusers.bench.problem import Problem, make_inputs
from tessera_diffusers.bench.timing import synchronize, time_kernel, time_request

FLEX_FAMILIES = ("Q64K64", "Q128K128")
FI_FAMILIES = ("Q16K16", "Q64K64", "Q128K128")
ANCHORS_MS = {  # DESIGN section 9, one H200, N=32768, H=24, D=128, bf16, ~10%
    "flex": {"Q16K16": 35.4, "Q64K64": 6.5, "Q128K128": 3.4},
    "flashinfer-best": {"Q64K64": 4.6, "Q128K128": 2.7},
    "dense-cudnn": 20.4,
}
FA3_CTA_Q = 128  # SM90 paged prefill, head_dim 128 (prefill_sm90.cuh; scheduler.cuh cta_tile_q)
FA3_CTA_KV = 96
EXPAND_THREADS = 512  # BlockSparseIndicesToVectorSparseOffset launch (page.cuh)
FI_DEFAULT_VECTOR_BUFFER = 128 * 1024 * 1024
CHECK_SLACK = 4.0  # the harness's BASELINE_SLACK: a baseline passes within 4x the strict tolerance
ATOL = 2e-3
LEGACY_RECORDS = ROOT / "benchmarks" / "results" / "h200_bench_n32k" / "records.jsonl"


# ---------------------------------------------------------------------------------------- clock


class Clock:
    """Timestamps for the log, the time spent waiting on FlashInfer JIT, and a soft budget."""

    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.jit_s = 0.0
        self.events: list[dict] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp} +{self.elapsed():6.1f}s] {msg}", flush=True)
        self.events.append({"t_s": round(self.elapsed(), 2), "msg": msg})

    def over_budget(self) -> bool:
        """Past the budget, not counting FlashInfer JIT (which a warm cache removes)."""
        return self.elapsed() - self.jit_s > self.budget_s


def host_timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def short(err: BaseException, limit: int = 400) -> str:
    text = f"{type(err).__name__}: {err}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def free_cuda() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ the cases


def harness_cases(families: set[str]) -> dict[str, tuple[str, Any, BenchConfig]]:
    """The exact cases of the committed H200 run: the default bench config (all families, n32k, one
    evaluation case each; sources rotate with the family's position, so the full list is needed)."""
    config = BenchConfig(out_dir=Path(tempfile.gettempdir()) / "baseline_probe_unused")
    out = {}
    for size, case in config.cases():
        if case.family in families and case.family not in out:
            out[case.family] = (size, case, config)
    return out


def mask_facts(problem: Problem) -> dict:
    mask = problem.mask
    blocks = mask.blocks.expand(problem.batch, problem.heads, -1, -1)
    active = int(blocks.sum())
    pairs = int(mask.interactions().sum()) * (problem.batch // mask.batch) * (problem.heads // mask.heads)
    empty_rows = int((~blocks.any(-1)).sum())
    return {
        "case": problem.name,
        "seq_len": problem.seq_q,
        "heads": problem.heads,
        "block_q": mask.block_q,
        "block_kv": mask.block_kv,
        "grid": [mask.num_blocks_q, mask.num_blocks_kv],
        "density": round(mask.density(), 5),
        "active_blocks": active,
        "E_pairs": pairs,
        "effective_gflop": 4.0 * problem.head_dim * pairs / 1e9,
        "empty_block_rows": empty_rows,
        "partial_last_block": bool(problem.seq_q % mask.block_q or problem.seq_kv % mask.block_kv),
    }


# --------------------------------------------------------------------------- the fp32 reference


class Reference:
    """fp32 masked SDPA (math backend) on a few heads, chunked over query rows; a bf16 twin gives
    the same-precision error scale (tolerance = 2 * twin + atol, the harness's criterion), and an
    unmasked bf16 output shows the check would catch a dense (mask-ignoring) result."""

    def __init__(self, problem: Problem, qkv: tuple[torch.Tensor, ...], heads: list[int], chunk: int = 4096):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.heads = heads
        mask = problem.mask
        q, k, v = (t[:, :, heads].transpose(1, 2) for t in qkv)  # [1, h, S, D]
        blocks = mask.blocks.expand(1, problem.heads, -1, -1)[0, heads]  # [h, nQ, nKV]
        s_q, s_kv = problem.seq_q, problem.seq_kv
        ref = torch.empty(1, len(heads), s_q, q.shape[-1], dtype=torch.float32, device=q.device)
        twin = torch.empty_like(ref)
        dense = torch.empty_like(ref)
        has_key = blocks.any(-1).repeat_interleave(mask.block_q, dim=1)[:, :s_q]  # [h, S]
        for i, _ in enumerate(heads):
            for r0 in range(0, s_q, chunk):
                r1 = min(s_q, r0 + chunk)
                rows = torch.arange(r0, r1, device=q.device) // mask.block_q
                tok = blocks[i, rows].repeat_interleave(mask.block_kv, dim=1)[:, :s_kv]  # [rows, S_kv]
                tok = tok | ~tok.any(-1, keepdim=True)  # rows without keys: anything finite, zeroed below
                qi, ki, vi = q[:, i : i + 1, r0:r1], k[:, i : i + 1], v[:, i : i + 1]
                with sdpa_kernel([SDPBackend.MATH]):
                    ref[:, i, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
                        qi.float(), ki.float(), vi.float(), attn_mask=tok, scale=problem.scale)[:, 0]
                twin[:, i, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=tok, scale=problem.scale)[:, 0].float()
                dense[:, i, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
                    qi, ki, vi, scale=problem.scale)[:, 0].float()
        keep = has_key[None, :, :, None]
        self.ref = ref * keep
        self.has_key = has_key  # [h, S]
        self.twin_error = self._err(twin * keep)
        self.tolerance = 2 * self.twin_error + ATOL
        self.dense_error = self._err(dense)
        self.empty_rows = int((~has_key).sum())

    def _err(self, out_hs: torch.Tensor) -> float:
        rows = self.has_key
        if not bool(rows.any()):
            return 0.0
        return float((out_hs[0][rows] - self.ref[0][rows]).abs().max())

    def check(self, out_bshd: torch.Tensor, heads: list[int] | None = None) -> dict:
        """``out_bshd [1, S, H', D]``; ``heads`` are the columns of ``out`` matching ``self.heads``."""
        cols = self.heads if heads is None else heads
        sub = out_bshd[:, :, cols].transpose(1, 2).float()  # [1, h, S, D]
        finite = bool(torch.isfinite(sub[0][self.has_key]).all())
        err = self._err(sub) if finite else math.inf
        empty = ~self.has_key
        empty_zero = self.empty_rows == 0 or bool((sub[0][empty] == 0).all())
        return {
            "max_abs_error": err,
            "tolerance": self.tolerance,
            "ok": finite and err <= CHECK_SLACK * self.tolerance,
            "strict_ok": finite and err <= self.tolerance and empty_zero,
            "empty_rows_zero": empty_zero,
            "dense_output_error": self.dense_error,
        }


# ------------------------------------------------------------------------------------------ flex


def coarse_blocks(blocks: torch.Tensor, fq: int, fk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full, partial)`` bool block sets of a ``fq x fk`` coarser grid: full where every fine block
    is active, partial where some are."""
    b, h, n_q, n_kv = blocks.shape
    pad_q, pad_k = (-n_q) % fq, (-n_kv) % fk
    if pad_q or pad_k:
        blocks = torch.nn.functional.pad(blocks, (0, pad_k, 0, pad_q), value=False)
    view = blocks.reshape(b, h, (n_q + pad_q) // fq, fq, (n_kv + pad_k) // fk, fk)
    any_ = view.any(5).any(3)
    all_ = view.all(5).all(3)
    return all_, any_ & ~all_


def flex_block_mask(fb: FlexAttentionBackend, problem: Problem, full: torch.Tensor | None, partial: torch.Tensor | None,
                    block: tuple[int, int], mask_mod: Any = None) -> Any:
    """A BlockMask from bool block sets (``full`` may be None: no full blocks, HAS_FULL_BLOCKS off)."""
    kwargs = dict(fb._from_kv_extra)
    if fb._has_seq_lengths:
        kwargs["seq_lengths"] = (problem.seq_q, problem.seq_kv)
    if partial is None:
        partial = torch.zeros_like(full)
    p_counts, p_idx = kv_block_lists(partial)
    if full is None:
        return fb._block_mask_cls.from_kv_blocks(p_counts, p_idx, BLOCK_SIZE=block, mask_mod=mask_mod, **kwargs)
    f_counts, f_idx = kv_block_lists(full)
    return fb._block_mask_cls.from_kv_blocks(p_counts, p_idx, f_counts, f_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                              **kwargs)


def block_mask_facts(bm: Any, problem: Problem) -> dict:
    """What flex will visit: partial/full (q block, kv block) pairs, the token pairs they cover, and
    whether the mask_mod is the no-op."""
    bq, bkv = bm.BLOCK_SIZE if isinstance(bm.BLOCK_SIZE, tuple) else (bm.BLOCK_SIZE, bm.BLOCK_SIZE)
    partial = int(bm.kv_num_blocks.sum())
    full = int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0
    n_q = math.ceil(problem.seq_q / bq)
    n_kv = math.ceil(problem.seq_kv / bkv)
    # token pairs of the visited blocks (last blocks clipped to the sequence)
    visited_pairs = (partial + full) * bq * bkv
    if problem.seq_q % bq or problem.seq_kv % bkv:
        visited_pairs = None  # exact clipping needs the index lists; the harness sizes are divisible
    mod = getattr(bm, "mask_mod", None)
    return {
        "BLOCK_SIZE": [bq, bkv],
        "grid": [n_q, n_kv],
        "partial_blocks": partial,
        "full_blocks": full,
        "has_full_blocks": bm.full_kv_num_blocks is not None,
        "mask_mod": getattr(mod, "__name__", type(mod).__name__),
        "visited_token_pairs": visited_pairs,
    }


def flex_structure(problem: Problem, fb: FlexAttentionBackend) -> dict:
    """Counts that need no GPU: the harness BlockMask against |E(M)|, the coarse-128 overcompute."""
    mask = problem.mask
    facts = mask_facts(problem)
    bm = fb.block_mask(problem)
    out = {"harness_block_mask": block_mask_facts(bm, problem),
           "harness_kernel_options": flex_kernel_options(mask.block_q, mask.block_kv)}
    same = None
    if hasattr(bm, "to_dense"):
        dense = bm.to_dense().to(torch.bool)
        same = bool(torch.equal(dense, mask.blocks.expand(problem.batch, problem.heads, -1, -1)))
    out["block_mask_equals_logical_mask"] = same
    vp = out["harness_block_mask"]["visited_token_pairs"]
    out["visited_over_E"] = None if vp is None else vp / facts["E_pairs"]
    if 128 % mask.block_q == 0 and 128 % mask.block_kv == 0 and (mask.block_q, mask.block_kv) != (128, 128):
        full, partial = coarse_blocks(mask.blocks.expand(problem.batch, problem.heads, -1, -1),
                                      128 // mask.block_q, 128 // mask.block_kv)
        n_full, n_partial = int(full.sum()), int(partial.sum())
        out["coarse128"] = {"full_blocks": n_full, "partial_blocks": n_partial,
                            "visited_over_E": (n_full + n_partial) * 128 * 128 / facts["E_pairs"],
                            "partial_share": n_partial / max(1, n_full + n_partial)}
    return out


def flex_section(ctx: dict, problem: Problem, ref: Reference, inputs: list, clock: Clock, args: argparse.Namespace) -> dict:
    from torch.nn.attention.flex_attention import flex_attention

    fb = FlexAttentionBackend()
    compiled = fb.compiled()
    mask = problem.mask
    facts = ctx["structure"][problem.family]["mask"]
    E = facts["E_pairs"]
    gflop = 4.0 * problem.head_dim * E / 1e9
    hf = [to_heads_first(*s) for s in inputs]
    n = len(hf)
    table = mask.blocks.expand(1, problem.heads, -1, -1).contiguous()
    bq, bkv = mask.block_q, mask.block_kv

    def table_mod(b, h, q_idx, kv_idx):
        return table[0, h, q_idx // bq, kv_idx // bkv]

    results: dict[str, dict] = {}

    def measure(name: str, bm: Any, options: dict | None, note: str, optional: bool = False,
                sets: list | None = None) -> None:
        if optional and clock.over_budget():
            results[name] = {"status": "skipped", "reason": f"over the {clock.budget_s:.0f} s budget", "note": note}
            clock.log(f"flex {problem.family} {name}: skipped (budget)")
            return
        rec: dict[str, Any] = {"note": note, "kernel_options": options if options is not None else "torch default",
                               "block_mask": block_mask_facts(bm, problem)}
        vp = rec["block_mask"]["visited_token_pairs"]
        rec["visited_over_E"] = None if vp is None else vp / E
        extra = {} if options is None else {"kernel_options": options}

        operands = hf if sets is None else sets

        def run(i: int) -> torch.Tensor:
            return compiled(*operands[i], block_mask=bm, scale=problem.scale, **extra)

        try:
            out, first = host_timed(lambda: run(0), problem.device)
            rec["first_call_s"] = round(first, 2)
            rec["check"] = ref.check(out.transpose(1, 2))
            del out
            t = time_kernel(run, n, args.warmup, args.reps, problem.device)
            rec.update(status="ok", kernel_ms=t.median_ms, samples_ms=list(t.samples_ms),
                       tflops_effective=gflop / t.median_ms, visited_tflops=(vp * 4 * problem.head_dim / 1e9 / t.median_ms
                                                                            if vp else None))
            clock.log(f"flex {problem.family} {name}: {t.median_ms:.3f} ms (first call {first:.1f} s), "
                      f"err {rec['check']['max_abs_error']:.2e} (tol {rec['check']['tolerance']:.2e})")
        except Exception as err:  # noqa: BLE001  (a failing variant is a finding)
            rec.update(status="error", reason=short(err))
            clock.log(f"flex {problem.family} {name}: error {short(err, 200)}")
        results[name] = rec
        free_cuda()

    # (a) the harness configuration
    prepared_bm, opts, _ = fb.prepare(problem)
    measure("harness", prepared_bm, opts, "full blocks at the logical size, no mask_mod, BLOCK_M/N matched")
    # the harness hands flex (B, H, S, D) *views* of the diffusers (B, S, H, D) tensors; a contiguous copy
    # is what most flex users pass
    contiguous = [tuple(t.contiguous() for t in s) for s in hf]
    measure("harness-contiguous-BHSD", prepared_bm, opts, "as harness, q/k/v copied to contiguous (B, H, S, D)",
            optional=True, sets=contiguous)
    del contiguous
    # the mask_mod path at the same block size: every block partial, the table evaluated per element
    partial_bm = flex_block_mask(fb, problem, None, mask.blocks.expand(1, problem.heads, -1, -1), (bq, bkv), table_mod)
    measure("partial+mask_mod", partial_bm, opts, "same blocks declared partial; mask_mod = block-table lookup",
            optional=True)
    del partial_bm
    # (b) coarser 128x128 BlockMask with torch's default kernel options
    if (bq, bkv) != (128, 128) and 128 % bq == 0 and 128 % bkv == 0:
        full, partial = coarse_blocks(table, 128 // bq, 128 // bkv)
        coarse_bm = flex_block_mask(fb, problem, full, partial, (128, 128), table_mod)
        measure("coarse128-default", coarse_bm, None,
                "128x128 BlockMask from the same mask (touched-but-not-covered blocks partial + table mask_mod), "
                "default kernel options")
        del coarse_bm, full, partial
    else:
        results["coarse128-default"] = {"status": "same-as-harness",
                                        "note": "at 128x128 the harness options equal torch's H100 default "
                                                f"(BLOCK_M=128, BLOCK_N=64, 8 warps, 3 stages): {opts}"}
    # (c) eager (uncompiled) on one head, extrapolated; compiled on the same head for the ratio
    if problem.family in args.eager_families:
        results.update(flex_eager(fb, compiled, flex_attention, problem, ref, hf, table_mod, opts, clock, args))
    # default kernel options at the native block size (torch picks BLOCK_M=128 on H100); last, as it
    # is expected to fail inside the compiler
    if bq < 128:
        measure("default-options@native", prepared_bm, None,
                "native BlockMask, no kernel_options: torch's H100 default BLOCK_M=128 must divide the Q block",
                optional=True)
    return results


def flex_eager(fb: FlexAttentionBackend, compiled: Any, flex_attention: Any, problem: Problem, ref: Reference,
               hf: list, table_mod: Any, opts: dict, clock: Clock, args: argparse.Namespace) -> dict:
    """Uncompiled flex on head 0 (it materializes S x S fp32 scores: one head only)."""
    out: dict[str, dict] = {}
    if clock.over_budget():
        out["eager"] = {"status": "skipped", "reason": "over budget"}
        return out
    mask = problem.mask
    head = ref.heads[0]
    one = [tuple(t[:, head : head + 1] for t in s) for s in hf]
    blocks1 = mask.blocks.expand(1, problem.heads, -1, -1)[:, head : head + 1]
    pairs1 = int(mask.select_heads(head, head + 1).interactions().sum()) if mask.heads > 1 else \
        int(mask.interactions().sum())
    gflop1 = 4.0 * problem.head_dim * pairs1 / 1e9
    bm_full = flex_block_mask(fb, problem, blocks1, None, (mask.block_q, mask.block_kv))

    def table_mod1(b, h, q_idx, kv_idx):  # h is 0 in the one-head problem
        return table_mod(b, h + head, q_idx, kv_idx)

    bm_mod = flex_block_mask(fb, problem, None, blocks1, (mask.block_q, mask.block_kv), table_mod1)
    runs = [
        ("compiled-1head", lambda i: compiled(*one[i], block_mask=bm_full, scale=problem.scale, kernel_options=opts),
         "harness configuration on one head (the ratio's denominator)"),
        ("eager-1head-harness-blockmask", lambda i: flex_attention(*one[i], block_mask=bm_full, scale=problem.scale),
         "uncompiled; the BlockMask has no mask_mod, and eager applies only mask_mod: DENSE attention"),
        ("eager-1head-table-mask_mod", lambda i: flex_attention(*one[i], block_mask=bm_mod, scale=problem.scale),
         "uncompiled; exact through mask_mod, dense S x S fp32 cost"),
    ]
    import warnings

    for name, fn, note in runs:
        rec: dict[str, Any] = {"note": note, "head": head}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                o, first = host_timed(lambda fn=fn: fn(0), problem.device)
                rec["first_call_s"] = round(first, 2)
                rec["check"] = ref_check_one(ref, o, 0)
                del o
                free_cuda()
                warm, reps = (args.warmup, args.reps) if name.startswith("compiled") else (1, 2)
                t = time_kernel(fn, len(one), warm, reps, problem.device)
            rec.update(status="ok", kernel_ms_1head=t.median_ms,
                       extrapolated_ms_all_heads=t.median_ms * problem.heads,
                       tflops_effective=gflop1 / t.median_ms)
            clock.log(f"flex {problem.family} {name}: {t.median_ms:.3f} ms/head (x{problem.heads} = "
                      f"{t.median_ms * problem.heads:.1f} ms), err {rec['check']['max_abs_error']:.2e}")
        except Exception as err:  # noqa: BLE001
            rec.update(status="error", reason=short(err))
            clock.log(f"flex {problem.family} {name}: error {short(err, 200)}")
        out[name] = rec
        free_cuda()
    return out


def ref_check_one(ref: Reference, out_bhsd: torch.Tensor, ref_col: int) -> dict:
    """Check a one-head output ``[1, 1, S, D]`` against reference column ``ref_col``."""
    rows = ref.has_key[ref_col]
    o = out_bhsd[0, 0].float()
    r = ref.ref[0, ref_col]
    finite = bool(torch.isfinite(o[rows]).all())
    err = float((o[rows] - r[rows]).abs().max()) if finite and bool(rows.any()) else (0.0 if finite else math.inf)
    return {"max_abs_error": err, "tolerance": ref.tolerance, "ok": finite and err <= CHECK_SLACK * ref.tolerance,
            "dense_output_error": ref.dense_error}


def flex_eager_semantics_cpu() -> dict:
    """Tiny CPU demonstration: eager flex with a BlockMask built by ``from_kv_blocks`` (no mask_mod)
    equals *dense* attention, not the block-masked one."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError as err:
        return {"status": "skipped", "reason": short(err)}
    import warnings

    gen = torch.Generator().manual_seed(0)
    s, b = 256, 64
    n = s // b
    blocks = torch.rand(1, 1, n, n, generator=gen) < 0.4
    blocks[..., 0] = True
    counts, idx = kv_block_lists(blocks)
    bm = BlockMask.from_kv_blocks(torch.zeros_like(counts), torch.zeros_like(idx), counts, idx, BLOCK_SIZE=(b, b))
    q, k, v = (torch.randn(1, 1, s, 32, generator=gen) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=bm)
    tok = blocks.repeat_interleave(b, 2).repeat_interleave(b, 3)
    masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tok)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return {"status": "ok", "eager_vs_masked_max_err": float((out - masked).abs().max()),
            "eager_vs_dense_max_err": float((out - dense).abs().max()),
            "conclusion": "eager flex ignores the BlockMask block lists (only mask_mod is applied)"
            if float((out - dense).abs().max()) < 1e-4 < float((out - masked).abs().max())
            else "eager flex follows the block lists in this torch"}


# ------------------------------------------------------------------------------------ flashinfer


def fa2_cta_tile_q(avg_packed_qo_len: int, head_dim: int = 128) -> int:
    """``FA2DetermineCtaTileQ`` (include/flashinfer/utils.cuh) on sm80+."""
    if avg_packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed_qo_len > 16 else 16


def fi_structure(problem: Problem, sms: int) -> dict:
    """Layouts and models of the FlashInfer variants for one problem (no GPU needed)."""
    mask = problem.mask
    r, c = mask.block_q, mask.block_kv
    indptr, indices = folded_bsr(mask.blocks, problem.batch, problem.heads)
    rows = indptr.numel() - 1
    nnz = indices.numel()
    kv_lens = (indptr[1:] - indptr[:-1]).to(torch.int64) * c
    iters = torch.div(kv_lens + EXPAND_THREADS - 1, EXPAND_THREADS, rounding_mode="floor")
    row_visits = sum(max(0, rows - cta) for cta in range(min(sms, rows)))
    bh = problem.batch * problem.heads
    fa2_tile = fa2_cta_tile_q(r)
    return {
        "bsr_plan_args": {"M": bh * problem.seq_q, "N": bh * problem.seq_kv, "R": r, "C": c, "num_qo_heads": 1,
                          "num_kv_heads": 1, "head_dim": problem.head_dim, "q/kv/o_data_type": str(problem.dtype),
                          "sm_scale": problem.scale, "mask": None, "causal": False, "use_fp16_qk_reduction": False},
        "var_plan_args": {"block_mask_map": [problem.heads, mask.num_blocks_q, mask.num_blocks_kv],
                          "block_row_sz": r, "block_col_sz": c, "num_qo_heads": problem.heads,
                          "num_kv_heads": problem.heads, "q/kv_data_type": str(problem.dtype)},
        "block_rows_folded": rows,
        "nnz_blocks": nnz,
        "tensor_core_path": r * 1 >= 4,  # plan(): CUDA-core decode only when R * (qo/kv heads) < 4
        "fa2_cta_tile_q": fa2_tile,
        "fa2_q_tile_fill": r / (math.ceil(r / fa2_tile) * fa2_tile),
        "fa3_cta_tile_q": FA3_CTA_Q,
        "fa3_q_tile_fill": r / (math.ceil(r / FA3_CTA_Q) * FA3_CTA_Q),
        "fa3_cta_kv": FA3_CTA_KV,
        "fa3_bsr_vector_indices": nnz * c,
        "fa3_bsr_vector_indices_over_default_buffer": nnz * c / FI_DEFAULT_VECTOR_BUFFER,
        "var_token_indices": gathered_key_tokens(problem),
        "expand_kernel": {
            "grid_ctas": sms,
            "threads": EXPAND_THREADS,
            "cta0_row_iterations": int(iters.sum()),
            "row_visits_all_ctas": row_visits,
            "redundancy_vs_one_visit_per_row": row_visits / max(1, rows),
            "bytes_written_once": nnz * c * 4,
        },
    }


def prebuild_flashinfer(backends: tuple[str, ...], clock: Clock, status: dict) -> threading.Thread | None:
    """Build (not load) the JIT modules the probe needs in a background thread."""
    try:
        from flashinfer.jit import gen_batch_prefill_module
        from flashinfer.page import gen_page_module
    except Exception as err:  # noqa: BLE001
        status["prebuild"] = f"not started: {short(err)}"
        return None

    def work() -> None:
        t0 = time.monotonic()
        done = []
        try:
            specs = []
            if "fa3" in backends:
                specs.append(("page", gen_page_module()))
            for b in backends:
                specs.append((f"prefill-{b}", gen_batch_prefill_module(
                    b, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 128, 128, 0, False, False, False)))
            for name, spec in specs:
                t1 = time.monotonic()
                spec.build(verbose=False)
                done.append(f"{name} {time.monotonic() - t1:.1f}s")
            status["prebuild"] = f"ok in {time.monotonic() - t0:.1f} s ({', '.join(done)})"
        except Exception as err:  # noqa: BLE001  (the main thread then builds, or reports, itself)
            status["prebuild"] = f"failed after {time.monotonic() - t0:.1f} s: {short(err)}"

    thread = threading.Thread(target=work, name="flashinfer-prebuild", daemon=True)
    thread.start()
    clock.log(f"flashinfer JIT prebuild started in the background ({', '.join(backends)} + page)")
    return thread


def plan_summary(wrapper: Any) -> dict:
    raw = getattr(wrapper, "_plan_info", None)  # a list, or an int64 tensor in 0.3.1
    info = [] if raw is None else (raw.tolist() if torch.is_tensor(raw) else list(raw))
    out = {"backend": getattr(wrapper, "_backend", None), "use_tensor_cores": getattr(wrapper, "_use_tensor_cores", None),
           "mask_mode": getattr(wrapper, "_mask_mode", None), "R": getattr(wrapper, "R", None),
           "C": getattr(wrapper, "C", None), "o_dtype": str(getattr(wrapper, "_o_dtype", None))}
    if len(info) == 15:  # fa2 PrefillPlanInfo
        out.update(plan_cta_tile_q=int(info[3]), padded_batch_size=int(info[0]), split_kv=bool(info[14]))
    elif info:
        out["plan_info_len"] = len(info)
    return out


def fi_variant(name: str, backend: Any, problem: Problem, inputs: list, ref: Reference, clock: Clock,
               args: argparse.Namespace, gflop: float) -> tuple[dict, Any, list]:
    rec: dict[str, Any] = {}
    reason = backend.unavailable() or backend.unsupported(problem)
    if reason:
        rec.update(status="skipped", reason=reason)
        clock.log(f"flashinfer {problem.family} {name}: skipped ({reason})")
        return rec, None, []
    t0 = time.monotonic()
    prepared, first_plan = host_timed(lambda: backend.prepare(problem), problem.device)
    if first_plan > 5:  # the first plan() of a backend builds/loads its JIT module
        clock.jit_s += first_plan
    converted = [backend.convert(*s) for s in inputs]
    out, first_run = host_timed(lambda: backend.run(prepared, converted[0]), problem.device)
    if first_run > 5:
        clock.jit_s += first_run
    rec["first_call_s"] = round(time.monotonic() - t0, 2)
    rec["plan"] = plan_summary(prepared)
    rec["check"] = ref.check(backend.to_bshd(out, problem))
    del out
    t = time_kernel(lambda i: backend.run(prepared, converted[i]), len(converted), args.warmup, args.reps,
                    problem.device)
    plans = time_request(lambda i: backend.prepare(problem), 1, 0, args.plan_reps, problem.device)
    rec.update(status="ok", kernel_ms=t.median_ms, samples_ms=list(t.samples_ms), tflops_effective=gflop / t.median_ms,
               plan_ms=plans.median_ms)
    clock.log(f"flashinfer {problem.family} {name}: {t.median_ms:.3f} ms, plan {plans.median_ms:.1f} ms, "
              f"err {rec['check']['max_abs_error']:.2e} (tol {rec['check']['tolerance']:.2e}), plan {rec['plan']}")
    return rec, prepared, converted


def fa3_bsr_split(wrapper: Any, backend: Any, problem: Problem, converted: list, ref: Reference, clock: Clock,
                  args: argparse.Namespace, gflop: float) -> dict:
    """``run()`` of bsr-fa3 split into the index expansion and the attention kernel."""
    import flashinfer.sparse as fs

    out: dict[str, Any] = {}
    orig = fs.block_sparse_indices_to_vector_sparse_offsets
    c = int(wrapper.C)
    nnz = int(wrapper._paged_kv_indices_buf.numel())
    n = len(converted)

    def expand(_: int) -> Any:  # exactly the call run() makes (k folded to [nnz_blocks, C, 1, D]: stride C)
        return orig(wrapper._paged_kv_indices_buf, wrapper._paged_kv_indptr_buf, wrapper._vector_sparse_indices_buffer,
                    wrapper._vector_sparse_indptr_buffer, wrapper._kv_lens_buffer, c, 1, c)

    t = time_kernel(expand, n, 1, args.reps, problem.device)
    out["expansion_ms"] = t.median_ms
    offsets = torch.arange(c, device=problem.device, dtype=torch.int32)

    def torch_expand(_: int) -> torch.Tensor:
        return (wrapper._paged_kv_indices_buf[:, None] * c + offsets[None, :]).reshape(-1)

    mine = torch_expand(0)
    out["torch_expansion_equal"] = bool(torch.equal(mine, wrapper._vector_sparse_indices_buffer[: nnz * c]))
    del mine
    out["torch_expansion_ms"] = time_kernel(torch_expand, n, 1, args.reps, problem.device).median_ms
    cached = wrapper._vector_sparse_indices_buffer
    fs.block_sparse_indices_to_vector_sparse_offsets = lambda *a, **k: cached
    try:
        o = backend.run(wrapper, converted[0])
        out["kernel_only_check"] = ref.check(backend.to_bshd(o, problem))
        del o
        t = time_kernel(lambda i: backend.run(wrapper, converted[i]), n, args.warmup, args.reps, problem.device)
        out["attention_kernel_only_ms"] = t.median_ms
        out["attention_kernel_only_tflops"] = gflop / t.median_ms
    finally:
        fs.block_sparse_indices_to_vector_sparse_offsets = orig
    clock.log(f"flashinfer {problem.family} bsr-fa3 split: expansion {out['expansion_ms']:.3f} ms "
              f"(torch equivalent {out['torch_expansion_ms']:.3f} ms, equal={out['torch_expansion_equal']}), "
              f"attention kernel alone {out['attention_kernel_only_ms']:.3f} ms")
    return out


def flashinfer_section(ctx: dict, problem: Problem, ref: Reference, inputs: list, clock: Clock,
                       args: argparse.Namespace) -> dict:
    gflop = ctx["structure"][problem.family]["mask"]["effective_gflop"]
    results: dict[str, dict] = {}
    for fi_backend in args.fi_backends:
        for cls, label in ((FlashInferBsr, "bsr"), (FlashInferVariable, "var")):
            name = f"{label}-{fi_backend}"
            backend = None
            try:
                backend = cls(fi_backend)
                rec, wrapper, converted = fi_variant(name, backend, problem, inputs, ref, clock, args, gflop)
                if wrapper is not None and label == "bsr" and fi_backend == "fa3" and int(wrapper.C) > 1:
                    try:
                        rec["split"] = fa3_bsr_split(wrapper, backend, problem, converted, ref, clock, args, gflop)
                    except Exception as err:  # noqa: BLE001
                        rec["split"] = {"status": "error", "reason": short(err)}
                        clock.log(f"flashinfer {problem.family} bsr-fa3 split: error {short(err, 200)}")
                if backend is not None:
                    rec["notes"] = sorted(set(backend.notes))
                del wrapper, converted
            except Exception as err:  # noqa: BLE001
                rec = {"status": "error", "reason": short(err), "traceback": traceback.format_exc()[-1500:]}
                clock.log(f"flashinfer {problem.family} {name}: error {short(err, 300)}")
            results[name] = rec
            del backend
            free_cuda()
    if args.fp16_qk and problem.family == args.fi_families[0]:
        for fi_backend in args.fi_backends:
            name = f"bsr-{fi_backend}-fp16qk"
            try:
                backend = FlashInferBsr(fi_backend)
                wrapper = backend._wrapper
                if wrapper is not None:
                    plan = wrapper.plan
                    wrapper.plan = lambda *a, _plan=plan, **k: _plan(*a, use_fp16_qk_reduction=True, **k)
                rec, _, _ = fi_variant(name, backend, problem, inputs, ref, clock, args, gflop)
                rec["note"] = "use_fp16_qk_reduction=True (a separate JIT module); bf16 inputs"
            except Exception as err:  # noqa: BLE001  (fa3 may refuse the flag; that is the finding)
                rec = {"status": "error", "reason": short(err)}
                clock.log(f"flashinfer {problem.family} {name}: error {short(err, 300)}")
            results[name] = rec
            backend = None
            free_cuda()
    return results


# ---------------------------------------------------------------------------- source evidence


def flashinfer_sources(wheel_dir: Path) -> tuple[dict[str, str], str]:
    """The FlashInfer files the mechanisms live in: from the installed package (located without
    importing it), else from the wheel in ``wheels/``."""
    names = {
        "sparse.py": "flashinfer/sparse.py",
        "page.cuh": "flashinfer/data/include/flashinfer/page.cuh",
        "prefill_sm90.cuh": "flashinfer/data/include/flashinfer/attention/hopper/prefill_sm90.cuh",
        "scheduler.cuh": "flashinfer/data/include/flashinfer/attention/scheduler.cuh",
        "utils.cuh": "flashinfer/data/include/flashinfer/utils.cuh",
        "prefill.cuh": "flashinfer/data/include/flashinfer/attention/prefill.cuh",
        "utils.py": "flashinfer/utils.py",
        "jit_attention.py": "flashinfer/jit/attention/pytorch.py",
    }
    out: dict[str, str] = {}
    spec = importlib.util.find_spec("flashinfer")
    if spec is not None and spec.origin:
        base = Path(spec.origin).parent.parent
        for key, rel in names.items():
            p = base / rel
            if p.is_file():
                out[key] = p.read_text(errors="replace")
        if out:
            return out, f"installed package at {base / 'flashinfer'}"
    wheels = sorted(wheel_dir.glob("flashinfer_python-*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[-1]) as zf:
            members = set(zf.namelist())
            for key, rel in names.items():
                if rel in members:
                    out[key] = zf.read(rel).decode(errors="replace")
        return out, f"wheel {wheels[-1].relative_to(ROOT) if wheels[-1].is_relative_to(ROOT) else wheels[-1]}"
    return out, "not found (no installed flashinfer, no wheel)"


def find_line(text: str, pattern: str, start: int = 0) -> tuple[int, str] | None:
    lines = text.splitlines()
    rx = re.compile(pattern)
    for i in range(start, len(lines)):
        if rx.search(lines[i]):
            return i + 1, lines[i].strip()
    return None


def source_evidence(wheel_dir: Path) -> dict:
    files, origin = flashinfer_sources(wheel_dir)
    claims = [
        ("fa3 run() expands BSR block indices to per-token offsets on every call", "sparse.py",
         r"sparse_indices = block_sparse_indices_to_vector_sparse_offsets\(", None),
        ("fa3 plan() rewrites kv_indptr to token level (vector-sparse)", "sparse.py",
         r"kv_indptr_host = vector_sparse_indptr_host", None),
        ("CUDA-core decode path only when R * group < 4 (not for R >= 16)", "sparse.py",
         r"R \* \(num_qo_heads // num_kv_heads\) < 4", None),
        ("expansion kernel: row loop steps by 1, not gridDim.x (CTA 0 walks every row)", "page.cuh",
         r"for \(int b = blockIdx\.x; b < batch_size; \+\+b\)", None),
        ("expansion kernel: grid = number of SMs, 512 threads", "page.cuh",
         r"cudaLaunchKernel\(\(void\*\)kernel, num_sms, num_threads", None),
        ("fa3 paged kernel gathers K/V without TMA", "prefill_sm90.cuh", r"USE_TMA_LOAD_KV=\*/false",
         r"BatchPrefillWithPagedKVCacheDispatched\(Params"),
        ("fa3 paged kernel, head_dim 128: CTA_Q = 128", "prefill_sm90.cuh", r"CTA_Q_=\*/128",
         r"HEAD_DIM_VO == 128\) \{"),
        ("fa3 paged kernel, head_dim 128: CTA_KV = 96", "prefill_sm90.cuh", r"CTA_KV_=\*/96",
         r"HEAD_DIM_VO == 128\) \{"),
        ("fa3 paged kernel refuses custom masks", "prefill_sm90.cuh", r"MASK_MODE == MaskMode::kCustom", None),
        ("SM90 scheduler: cta_tile_q = 128 for every request", "scheduler.cuh", r"int cta_tile_q = 128;", None),
        ("fa2 picks its Q tile from the average request length", "utils.cuh",
         r"inline uint32_t FA2DetermineCtaTileQ", None),
        ("fp16 QK reduction changes fa2's accumulator only for fp16 inputs", "prefill.cuh",
         r"USE_FP16_QK_REDUCTION && std::is_same_v<DTypeQ, half>", None),
        ("fa3 is not eligible with use_fp16_qk_reduction", "utils.py", r"if use_fp16_qk_reductions:", None),
        ("JIT builds every mask mode into each batch-prefill module", "jit_attention.py",
         r"batch_prefill_paged_sm90_kernel_mask_\{mask_mode\}", None),
    ]
    out = {"origin": origin, "claims": []}
    for claim, key, pattern, anchor in claims:
        text = files.get(key)
        hit = None
        if text is not None:
            start = 0
            if anchor:
                a = find_line(text, anchor)
                start = a[0] if a else 0
            hit = find_line(text, pattern, start)
        out["claims"].append({"claim": claim, "file": key, "found": hit is not None,
                              "line": hit[0] if hit else None, "text": hit[1] if hit else None})
    return out


# ------------------------------------------------------------------------------- legacy records


def legacy_records(path: Path) -> dict:
    """The committed run's FlashInfer records, per wrapper: shows the report's "fa2"/"fa3" columns
    averaged the BSR and variable-block wrappers (the describe() key collision)."""
    if not path.is_file():
        return {"status": "skipped", "reason": f"{path} not found"}
    per_family: dict[str, dict[str, float]] = defaultdict(dict)
    mislabelled = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("status") != "ok" or "wrapper" not in r:
            continue
        wrapper = "bsr" if r["wrapper"] == "BlockSparseAttentionWrapper" else "var"
        fi_backend = r.get("fi_backend") or r["backend"].rsplit("-", 1)[-1]
        mislabelled += r["backend"] in ("fa2", "fa3")
        per_family[r["family"]][f"{wrapper}-{fi_backend}"] = round(r["kernel_ms"], 3)
    if mislabelled:
        for entry in per_family.values():
            for col in ("fa2", "fa3"):
                vals = [v for k, v in entry.items() if k.endswith(col)]
                if vals:
                    entry[f"report '{col}' column"] = round(statistics.fmean(vals), 3)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return {"status": "ok", "path": str(shown), "records_labelled_only_fa2_or_fa3": mislabelled,
            "per_family_ms": dict(per_family)}


# ---------------------------------------------------------------------------------------- report


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}g}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.{digits}f}".rstrip("0").rstrip(".")
    return str(x)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return out


def findings(result: dict) -> list[str]:
    """Plain statements derived from what was measured (or, in a dry run, counted)."""
    out: list[str] = []
    st = result.get("structure", {})
    legacy = result.get("legacy_records", {})
    if legacy.get("records_labelled_only_fa2_or_fa3"):
        q = legacy["per_family_ms"].get("Q128K128", {})
        column = q.get("report 'fa3' column")
        out.append(f"Committed report: {legacy['records_labelled_only_fa2_or_fa3']} FlashInfer records carry only "
                   f"'fa2'/'fa3' as backend, so each column averaged the BSR and variable-block wrappers "
                   f"(Q128K128: bsr-fa3 {fmt(q.get('bsr-fa3'))} ms, var-fa3 {fmt(q.get('var-fa3'))} ms, "
                   f"report column {fmt(column)} ms).")
    for fam, s in st.items():
        fl = s.get("flex")
        if fl:
            out.append(f"{fam}: the harness BlockMask visits {fl['harness_block_mask']['full_blocks']} full + "
                       f"{fl['harness_block_mask']['partial_blocks']} partial blocks = {fmt(fl['visited_over_E'])} x |E(M)| "
                       f"(mask_mod {fl['harness_block_mask']['mask_mod']}); block set equal to the mask: "
                       f"{fl['block_mask_equals_logical_mask']}.")
            if "coarse128" in fl:
                c = fl["coarse128"]
                out.append(f"{fam}: at 128x128 the same mask touches {fmt(c['visited_over_E'])} x |E(M)| token pairs, "
                           f"{fmt(100 * c['partial_share'], 3)}% of the 128-blocks partial (mask_mod evaluated).")
        fi = s.get("flashinfer")
        if fi:
            e = fi["expand_kernel"]
            out.append(f"{fam}: fa3 Q-tile fill {fmt(100 * fi['fa3_q_tile_fill'], 3)}% (CTA_Q 128 vs R={fi['bsr_plan_args']['R']}), "
                       f"fa2 {fmt(100 * fi['fa2_q_tile_fill'], 3)}% (tile {fi['fa2_cta_tile_q']}); bsr-fa3 expands "
                       f"{fi['fa3_bsr_vector_indices']:,} token indices per run(), CTA 0 alone does "
                       f"{e['cta0_row_iterations']:,} 512-wide iterations over {fi['block_rows_folded']:,} block rows.")
    for fam, fl in result.get("flex", {}).items():
        h = fl.get("harness", {})
        if h.get("status") == "ok":
            others = ", ".join(f"{k} {fmt(v['kernel_ms'])} ms" if "kernel_ms" in v else
                               f"{k} {fmt(v.get('extrapolated_ms_all_heads'))} ms (1 head x H)"
                               for k, v in fl.items() if k != "harness" and v.get("status") == "ok")
            anchor = ANCHORS_MS["flex"].get(fam)
            out.append(f"{fam} flex: harness {fmt(h['kernel_ms'])} ms (anchor {fmt(anchor)}), check ok={h['check']['ok']}; "
                       f"{others}.")
    for fam, fi in result.get("flashinfer", {}).items():
        parts = [f"{k} {fmt(v.get('kernel_ms'))} ms" for k, v in fi.items() if v.get("status") == "ok"]
        b3 = fi.get("bsr-fa3", {}).get("split", {})
        if "expansion_ms" in b3:
            parts.append(f"bsr-fa3 = expansion {fmt(b3['expansion_ms'])} ms + attention {fmt(b3.get('attention_kernel_only_ms'))} ms "
                         f"(torch expansion {fmt(b3['torch_expansion_ms'])} ms)")
        attn = b3.get("attention_kernel_only_ms")
        fa2 = fi.get("bsr-fa2", {}).get("kernel_ms")
        model = st.get(fam, {}).get("flashinfer", {})
        if attn and fa2 and model:
            parts.append(f"fa3 attention-only / bsr-fa2 = {fmt(attn / fa2)} at fa3 Q-tile fill "
                         f"{fmt(100 * model['fa3_q_tile_fill'], 3)}% vs fa2 {fmt(100 * model['fa2_q_tile_fill'], 3)}%")
        if parts:
            out.append(f"{fam} FlashInfer: " + "; ".join(parts) + ".")
    return out


def write_reports(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "probe.json").write_text(json.dumps(result, indent=1, default=str))
    md = ["# Baseline probe", "", f"- {result['env']}", f"- mode: {'dry run (CPU, no timings)' if result['dry_run'] else 'measured'}",
          f"- wall time {fmt(result.get('wall_s'))} s (FlashInfer JIT {fmt(result.get('jit_s'))} s)", ""]
    md += ["## Findings", ""] + [f"- {f}" for f in result.get("findings", [])] + [""]
    md += ["## Mask structure", ""]
    rows = []
    for fam, s in result.get("structure", {}).items():
        m = s["mask"]
        fl = s.get("flex", {})
        fi = s.get("flashinfer", {})
        rows.append([fam, m["case"], fmt(100 * m["density"], 3), m["active_blocks"], m["E_pairs"],
                     fl.get("visited_over_E"), (fl.get("coarse128") or {}).get("visited_over_E"),
                     fi.get("fa2_q_tile_fill"), fi.get("fa3_q_tile_fill"), fi.get("fa3_bsr_vector_indices")])
    md += table(["family", "case", "density %", "active blocks", "E(M) token pairs", "flex visited / E(M)",
                 "coarse128 visited / E(M)",
                 "fa2 Q-tile fill", "fa3 Q-tile fill", "bsr-fa3 token indices"], rows) + [""]
    if result.get("flex"):
        md += ["## FlexAttention (kernel ms; eager rows: per head and x H)", ""]
        rows = []
        for fam, variants in result["flex"].items():
            for name, v in variants.items():
                ms = v.get("kernel_ms", v.get("kernel_ms_1head"))
                rows.append([fam, name, v.get("status"), ms, v.get("extrapolated_ms_all_heads"), v.get("tflops_effective"),
                             v.get("visited_over_E"), (v.get("check") or {}).get("max_abs_error"),
                             (v.get("check") or {}).get("ok"), v.get("reason") or v.get("note")])
        md += table(["family", "variant", "status", "ms", "ms x H", "eff TFLOP/s", "visited / E(M)", "max err", "ok", "note"],
                    rows) + [""]
    if result.get("flashinfer"):
        md += ["## FlashInfer 0.3.1 (kernel ms = run(); plan ms = host)", ""]
        rows = []
        for fam, variants in result["flashinfer"].items():
            for name, v in variants.items():
                sp = v.get("split", {})
                plan = v.get("plan", {})
                rows.append([fam, name, v.get("status"), v.get("kernel_ms"), v.get("tflops_effective"), v.get("plan_ms"),
                             plan.get("plan_cta_tile_q"), sp.get("expansion_ms"), sp.get("attention_kernel_only_ms"),
                             sp.get("torch_expansion_ms"), (v.get("check") or {}).get("ok"), v.get("reason")])
        md += table(["family", "variant", "status", "ms", "eff TFLOP/s", "plan ms", "fa2 CTA_Q", "fa3 expansion ms",
                     "fa3 attention-only ms", "torch expansion ms", "ok", "reason"], rows) + [""]
    ev = result.get("source_evidence", {})
    if ev:
        md += [f"## FlashInfer source evidence ({ev.get('origin')})", ""]
        md += table(["claim", "file:line", "source"],
                    [[c["claim"], f"{c['file']}:{c['line']}" if c["found"] else f"{c['file']}: NOT FOUND",
                      f"`{c['text']}`" if c["text"] else "-"] for c in ev.get("claims", [])]) + [""]
    lg = result.get("legacy_records", {})
    if lg.get("status") == "ok":
        md += [f"## Committed records per wrapper ({lg['path']})", ""]
        fams = lg["per_family_ms"]
        cols = sorted({k for d in fams.values() for k in d})
        md += table(["family"] + cols, [[f] + [d.get(c) for c in cols] for f, d in fams.items()]) + [""]
    (out_dir / "probe.md").write_text("\n".join(md))


def print_summary(result: dict) -> None:
    print("\n=== baseline probe summary ===")
    for fam, s in result.get("structure", {}).items():
        m = s["mask"]
        print(f"{fam:9s} {m['case']}: density {100 * m['density']:.2f}%, {m['active_blocks']:,} blocks, "
              f"|E(M)| {m['E_pairs']:,} ({m['effective_gflop']:.0f} GFLOP)")
    for fam, variants in result.get("flex", {}).items():
        for name, v in variants.items():
            ms = v.get("kernel_ms", v.get("kernel_ms_1head"))
            print(f"  flex {fam:9s} {name:30s} {v.get('status', '-'):8s} {fmt(ms):>9s} ms  "
                  f"eff {fmt(v.get('tflops_effective')):>7s} TF/s  ok={(v.get('check') or {}).get('ok')}  "
                  f"{v.get('reason') or ''}")
    for fam, variants in result.get("flashinfer", {}).items():
        for name, v in variants.items():
            sp = v.get("split") or {}
            extra = (f" [expansion {fmt(sp.get('expansion_ms'))} + attention {fmt(sp.get('attention_kernel_only_ms'))}]"
                     if "expansion_ms" in sp else "")
            print(f"  fi   {fam:9s} {name:30s} {v.get('status', '-'):8s} {fmt(v.get('kernel_ms')):>9s} ms  "
                  f"plan {fmt(v.get('plan_ms')):>7s} ms  ok={(v.get('check') or {}).get('ok')}{extra}  {v.get('reason') or ''}")
    print("findings:")
    for f in result.get("findings", []):
        print(f"  - {f}")


# ------------------------------------------------------------------------------------------ main


def environment(device: torch.device) -> str:
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    spec = importlib.util.find_spec("triton")
    if spec is not None:
        try:
            import triton

            parts.append(f"triton {triton.__version__}")
        except Exception:  # noqa: BLE001
            parts.append("triton (broken import)")
    else:
        parts.append("triton not installed")
    fi_spec = importlib.util.find_spec("flashinfer")
    parts.append("flashinfer installed" if fi_spec else "flashinfer not installed")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        parts.append(f"{p.name} sm{p.major}{p.minor} ({p.multi_processor_count} SMs)")
    else:
        parts.append("CPU")
    return ", ".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for probe.json and probe.md")
    p.add_argument("--dry-run", action="store_true", help="CPU: build masks, count, read the source; no timings")
    p.add_argument("--sections", default="flex,flashinfer", help="comma list from flex,flashinfer")
    p.add_argument("--flex-families", default=",".join(FLEX_FAMILIES))
    p.add_argument("--fi-families", default=",".join(FI_FAMILIES))
    p.add_argument("--fi-backends", default="fa2,fa3")
    p.add_argument("--eager-families", default="Q64K64", help="families for the one-head eager flex timing ('' = none)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--input-sets", type=int, default=3)
    p.add_argument("--plan-reps", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=110.0,
                   help="soft budget (FlashInfer JIT excluded): optional variants are skipped past it")
    p.add_argument("--no-prebuild", action="store_true", help="do not build the FlashInfer JIT modules in the background")
    p.add_argument("--fp16-qk", action="store_true",
                   help="also run bsr-fa2/fa3 with use_fp16_qk_reduction=True on the first FlashInfer family "
                        "(two more JIT modules, minutes; the source already shows it cannot matter for bf16)")
    p.add_argument("--records", type=Path, default=LEGACY_RECORDS, help="committed records.jsonl to re-read per wrapper")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())
    args.sections = split(args.sections)
    args.flex_families = split(args.flex_families)
    args.fi_families = split(args.fi_families)
    args.fi_backends = split(args.fi_backends)
    args.eager_families = split(args.eager_families)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Clock(args.budget_s)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    result: dict[str, Any] = {"env": environment(device), "dry_run": not cuda, "args": {k: (list(v) if isinstance(v, tuple)
                              else str(v)) for k, v in vars(args).items()}, "structure": {}, "skipped": {}}
    clock.log(f"baseline probe: {result['env']}")
    if not cuda and not args.dry_run:
        clock.log("no CUDA device: running as --dry-run (masks, counts and source only)")

    # availability (skip with a clear message, never fake)
    want_flex = "flex" in args.sections
    want_fi = "flashinfer" in args.sections
    if want_flex and importlib.util.find_spec("triton") is None:
        result["skipped"]["flex timings"] = "triton is not installed: compiled FlexAttention needs it on CUDA"
    if want_fi:
        fi_module, fi_error = import_flashinfer()
        if fi_module is None:
            result["skipped"]["flashinfer timings"] = fi_error
        else:
            result["flashinfer_version"] = str(getattr(fi_module, "__version__", "unknown"))
    for what, why in result["skipped"].items():
        clock.log(f"SKIP {what}: {why}")
    flex_ok = cuda and want_flex and "flex timings" not in result["skipped"]
    fi_ok = cuda and want_fi and "flashinfer timings" not in result["skipped"]

    prebuild_status: dict[str, str] = {}
    thread = None
    if fi_ok and not args.no_prebuild:
        thread = prebuild_flashinfer(args.fi_backends, clock, prebuild_status)

    result["source_evidence"] = source_evidence(ROOT / "wheels")
    found = sum(c["found"] for c in result["source_evidence"]["claims"])
    clock.log(f"flashinfer source ({result['source_evidence']['origin']}): {found}/"
              f"{len(result['source_evidence']['claims'])} claims located")
    for c in result["source_evidence"]["claims"]:
        clock.log(f"  [{'x' if c['found'] else ' '}] {c['claim']}: {c['file']}:{c['line']}  {c['text'] or ''}")
    result["legacy_records"] = legacy_records(args.records)
    result["flex_eager_semantics_cpu"] = flex_eager_semantics_cpu()
    clock.log(f"eager flex semantics (tiny CPU case): {result['flex_eager_semantics_cpu']}")

    families = [f for f in dict.fromkeys((args.flex_families if want_flex else ()) + (args.fi_families if want_fi else ()))]
    cases = harness_cases(set(families))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
    problems: dict[str, Problem] = {}
    for fam in families:
        if fam not in cases:
            result["skipped"][f"family {fam}"] = "not in the harness's case list"
            continue
        (problem, build_s) = host_timed(lambda c=cases[fam]: problem_for(c[0], c[1], c[2], device), device)
        problems[fam] = problem
        s = {"mask": mask_facts(problem)}
        if want_flex and fam in args.flex_families:
            try:
                s["flex"] = flex_structure(problem, FlexAttentionBackend())
            except Exception as err:  # noqa: BLE001  (e.g. a torch without FlexAttention)
                s["flex_error"] = short(err)
        if want_fi and fam in args.fi_families:
            s["flashinfer"] = fi_structure(problem, sms)
        result["structure"][fam] = s
        m = s["mask"]
        clock.log(f"{fam}: {m['case']} built in {build_s:.1f} s on {device.type}: density {100 * m['density']:.2f}%, "
                  f"{m['active_blocks']:,} active blocks, |E(M)| {m['E_pairs']:,}")

    if flex_ok or fi_ok:
        refs: dict[str, Reference] = {}
        for fam, problem in problems.items():
            inputs = make_inputs(problem, args.input_sets, args.seed)
            heads = sorted({0, problem.heads - 1})
            (ref, ref_s) = host_timed(lambda p=problem, x=inputs[0], h=heads: Reference(p, x, h), device)
            refs[fam] = ref
            clock.log(f"{fam}: fp32 masked-SDPA reference on heads {heads} in {ref_s:.1f} s (twin error "
                      f"{ref.twin_error:.2e}, an unmasked output would be off by {ref.dense_error:.2e})")
            if flex_ok and fam in args.flex_families:
                result.setdefault("flex", {})[fam] = flex_section(result, problem, ref, inputs, clock, args)
            del inputs
            free_cuda()
        if fi_ok:
            if thread is not None:
                t0 = time.monotonic()
                clock.log("waiting for the flashinfer JIT prebuild ...")
                thread.join()
                waited = time.monotonic() - t0
                clock.jit_s += waited
                clock.log(f"flashinfer prebuild: {prebuild_status.get('prebuild')} (waited {waited:.1f} s)")
            result["flashinfer_prebuild"] = prebuild_status.get("prebuild")
            for fam in args.fi_families:
                if fam not in problems:
                    continue
                problem = problems[fam]
                inputs = make_inputs(problem, args.input_sets, args.seed)
                result.setdefault("flashinfer", {})[fam] = flashinfer_section(result, problem, refs[fam], inputs, clock, args)
                del inputs
                free_cuda()

    result["wall_s"] = round(clock.elapsed(), 1)
    result["jit_s"] = round(clock.jit_s, 1)
    result["findings"] = findings(result)
    result["log"] = clock.events
    write_reports(args.out, result)
    print_summary(result)
    clock.log(f"wrote {args.out / 'probe.json'} and {args.out / 'probe.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
