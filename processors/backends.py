"""Attention backends the processor runs masks with, and the log-sum-exp merge of partial results.

A backend computes block-sparse attention for a ``LogicalMask`` and keeps its per-mask plan state
in the ``CacheSlot`` it is handed (so state lives exactly as long as the mask in the step cache):

    backend.attention(q, k, v, mask, slot=slot, cache=cache, return_lse=...)
        q [B, Sq, H, D], k, v [B, Skv, H, D] -> out [B, Sq, H, D] (and lse [B, H, Sq] fp32,
        natural log, -inf for rows without keys)

``TesseraBackend`` is the default. The benchmark plugs FlexAttention and FlashInfer in through the
same two methods.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, runtime_checkable

import torch

from tessera_diffusers import reference
from tessera_diffusers.mask import LogicalMask
from tessera_diffusers.mask_state import build_mask_state
from tessera_diffusers.runtime import Runtime, execute, make_request
from tessera_diffusers.validation import check_inputs

from .plan_cache import CacheSlot, StepCache, tensor_nbytes

AttentionResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
DENSE_BLOCK = 128  # block size of the dense helper masks (text keys / text queries)


@runtime_checkable
class SparseAttentionBackend(Protocol):
    name: str

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: LogicalMask,
        *,
        slot: CacheSlot,
        cache: StepCache,
        return_lse: bool = False,
        part: Hashable = None,
    ) -> AttentionResult:
        """Attention of ``q, k, v [B, S, H, D]`` under ``mask``; plan state goes in ``slot`` through
        ``cache.plan``, keyed with ``part`` (several head parts of one slot's mask, e.g. the head
        chunks of a pipelined context-parallel call, each with its own plan)."""
        ...


class TesseraBackend:
    """Tessera's block-sparse attention with the prepared plan kept in the step cache.

    Selection goes through ``runtime`` (its catalog and plan selection); the prepared plan of each
    mask is stored in the mask's cache slot, so the runtime's own per-mask cache is not used; a
    reused mask's plan goes through ``Runtime.regrouped`` as the runtime's cache hits do.
    ``TesseraBackend(Runtime(selector=Selector(reuse_regime=True)))`` lets each new mask of a layer
    take the previous mask's regime without a statistics read (no host sync per step)."""

    name = "tessera"

    def __init__(self, runtime: Runtime | None = None):
        self.runtime = runtime or Runtime()

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: LogicalMask,
        *,
        slot: CacheSlot,
        cache: StepCache,
        return_lse: bool = False,
        part: Hashable = None,
    ) -> AttentionResult:
        scale = check_inputs(q, k, v, mask, None)
        request = make_request(q, k, mask, return_lse)

        built = []

        def build():
            prepared = self.runtime.plan_request(build_mask_state(mask), request, None)
            built.append(prepared)
            return prepared, tensor_nbytes(prepared)

        plan_key = (self.name, request, part)
        prepared = cache.plan(slot, plan_key, build)
        if prepared is None:  # no native plan for this request: the reference path
            return reference.attention(q, k, v, mask, scale, return_lse)
        if not built and prepared.compaction_pending:  # a reused worst-case plan: its compact size once known
            before = tensor_nbytes(prepared)
            if prepared.settle():
                cache.plan_resized(slot, tensor_nbytes(prepared) - before)
        if not built:  # a reused mask: the plan Runtime.regrouped names for it (the grouped query layout)
            reused = self.runtime.regrouped(prepared, request)
            if reused is not prepared:
                cache.plan_replaced(slot, plan_key, reused, tensor_nbytes(reused) - tensor_nbytes(prepared))
                prepared = reused
        return execute(prepared, q, k, v, scale, return_lse)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets from their normalized outputs and log-sum-exps.

    ``out_* [B, S, H, D]``, ``lse_* [B, H, S]`` fp32 -> (out ``[B, S, H, D]`` in ``out_a``'s dtype,
    lse ``[B, H, S]``). A row with no key on either side stays 0 (lse -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse)).transpose(1, 2).unsqueeze(-1)
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse)).transpose(1, 2).unsqueeze(-1)
    out = out_a.to(torch.float32) * w_a + out_b.to(torch.float32) * w_b
    return out.to(out_a.dtype), lse


def dense_lse_attention(
    backend: SparseAttentionBackend,
    cache: StepCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention with log-sum-exp through ``backend``, with a dense mask shared by shape
    (blocks of 128 tokens, 64 for short sequences; the last block is partial)."""
    seq_q, seq_kv = q.shape[1], k.shape[1]
    block_q, block_kv = dense_block(seq_q), dense_block(seq_kv)
    key = ("dense", seq_q, seq_kv, block_q, block_kv, str(q.device))
    slot = cache.shared_slot(key, lambda: LogicalMask.dense(seq_q, seq_kv, block_q, block_kv, device=q.device))
    return backend.attention(q, k, v, slot.mask, slot=slot, cache=cache, return_lse=True)


def dense_block(seq: int) -> int:
    return DENSE_BLOCK if seq > DENSE_BLOCK // 2 else DENSE_BLOCK // 2
