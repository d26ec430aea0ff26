"""Attention backends the processor runs masks with, and the log-sum-exp merge of partial results.

A backend computes block-sparse attention for a ``LogicalMask`` and keeps its per-mask plan state
in the ``CacheSlot`` it is handed, or counts it there (``StepCache.track``) where its owner keeps it
as long as the mask lives (Tessera's ``Runtime``):

    backend.attention(q, k, v, mask, slot=slot, cache=cache, return_lse=...)
        q [B, Sq, H, D], k, v [B, Skv, H, D] -> out [B, Sq, H, D] (and lse [B, H, Sq] fp32,
        natural log, -inf for rows without keys)

``TesseraBackend`` is the default. The benchmark plugs FlexAttention and FlashInfer in through the
same method; ``TimedBackend`` times any of them.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from tessera_diffusers import reference
from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.mask import LogicalMask
from tessera_diffusers.plans import INPUT_PRECISION, PRECISIONS
from tessera_diffusers.runtime import Runtime, execute, make_request
from tessera_diffusers.selector import Selector
from tessera_diffusers.validation import check_inputs

from .plan_cache import CacheSlot, StepCache

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
    """Tessera's block-sparse attention, each cache key (a layer and guidance branch, or a shared
    dense helper mask) planning through a ``Runtime`` of its own.

    The Runtime keeps each mask's prepared plan while the mask lives (the step cache holds the mask
    and counts the plan's bytes), and with ``reuse_regime`` (on by default) its selector lets each
    new mask of the layer take the plan-table regime of the layer's previous mask without a
    statistics read or a ranking scan: from a layer's second sparse step on, a new mask pays only
    its launch preparation. ``runtime`` given: every key plans through that one Runtime instead
    (its ``max_entries`` then bounds the plans of all layers, branches and head parts together).
    ``precision``: as ``block_sparse_attention``'s (``"int8"``: the 8-bit kernels; where they cannot
    run, the 16-bit ones with a warning)."""

    name = "tessera"

    def __init__(self, runtime: Runtime | None = None, *, reuse_regime: bool = True,
                 precision: str = INPUT_PRECISION):
        if precision not in PRECISIONS:
            raise InvalidArgumentError("precision", f"one of {PRECISIONS}", repr(precision))
        self.runtime = runtime
        self.reuse_regime = reuse_regime
        self.precision = precision
        self.warned: set[str] = set()  # what the backend said once for all its keys' Runtimes
        self.runtimes: dict[Hashable, Runtime] = {}  # cache key -> its Runtime (when runtime is None)
        self.plan_counts: dict[Hashable, list[int]] = {}  # cache key -> [plans prepared, selections reused]

    def runtime_for(self, key: Hashable) -> Runtime:
        if self.runtime is not None:
            return self.runtime
        runtime = self.runtimes.get(key)
        if runtime is None:
            runtime = self.runtimes[key] = Runtime(selector=Selector(reuse_regime=self.reuse_regime))
        return runtime

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
        runtime = self.runtime_for(slot.key)
        request = runtime.runnable_precision(make_request(q, k, mask, return_lse, self.precision), self._warn_once)
        misses, reused = runtime.misses, runtime.reused_selections
        with torch.no_grad():
            prepared = runtime.prepared_for(mask, request, None)
        built = runtime.misses != misses
        if built:
            counts = self.plan_counts.setdefault(slot.key, [0, 0])
            counts[0] += 1
            if counts[0] > 1 and runtime.reused_selections != reused:  # the layer's earlier decision served it
                counts[1] += 1
        cache.track(slot, (self.name, request, part), prepared, built)
        if prepared is None:  # no native plan for this request: the reference path
            runtime.no_plan(request, self._warn_once)
            return reference.attention(q, k, v, mask, scale, return_lse)
        return execute(prepared, q, k, v, scale, return_lse, request.precision)

    def _warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, stacklevel=5)

    def reset_counts(self) -> None:
        """Zero the counts of ``plan_report`` (the layers' decisions are kept)."""
        self.plan_counts.clear()

    def plan_report(self, keys: Callable[[Hashable], bool] = lambda key: True) -> dict:
        """Prepared plans and reused selections over the cache keys ``keys`` accepts: how many keys
        prepared a plan, how many prepared more than one, and how many of those reused their
        earlier selection for every plan after the first."""
        counts = [c for key, c in self.plan_counts.items() if keys(key)]
        repeated = [c for c in counts if c[0] > 1]
        return {
            "keys": len(counts),
            "plans_prepared": sum(c[0] for c in counts),
            "selections_reused": sum(c[1] for c in counts),
            "keys_with_several_plans": len(repeated),
            "keys_reusing_every_later_plan": sum(1 for c in repeated if c[1] == c[0] - 1),
        }


class AttentionTimer:
    """Sums the time spent in attention calls: CUDA events on a GPU (read at ``total_ms``), wall time
    on the CPU."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cpu_s = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def span(self, device: torch.device) -> Iterator[None]:
        self.calls += 1
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.cpu_s += time.perf_counter() - t0

    def total_ms(self) -> float:
        """Milliseconds in attention since the last ``reset`` (synchronizes with the GPU once)."""
        if self.events:
            torch.cuda.synchronize()
        return self.cpu_s * 1e3 + sum(start.elapsed_time(end) for start, end in self.events)


class TimedBackend:
    """A backend whose calls (planning included) are timed by an ``AttentionTimer``."""

    def __init__(self, inner: SparseAttentionBackend, timer: AttentionTimer):
        self.inner, self.timer, self.name = inner, timer, inner.name

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
        """The inner backend's ``attention`` (``q [B, Sq, H, D]``, ``k, v [B, Skv, H, D]``), timed."""
        kwargs = {} if part is None else {"part": part}  # backends without head parts take no ``part``
        with self.timer.span(q.device):
            return self.inner.attention(q, k, v, mask, slot=slot, cache=cache, return_lse=return_lse, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


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
