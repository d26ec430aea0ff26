"""The public facade: plan once, run many.

``block_sparse_attention`` is the one-call API. ``Runtime`` is the explicit object that keeps the
prepared-plan cache (per mask object) for callers that repeat requests, like a diffusion loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

import torch

from . import reference
from .eligibility import rejection
from .errors import CatalogError, InvalidArgumentError
from .executor import run_prepared
from .kernel_table import QUANTIZED_HEAD_DIM
from .mask import LogicalMask
from .mask_state import MaskState, build_mask_state
from .plans import DTYPE_NAMES, INPUT_PRECISION, PRECISIONS, Family, PhysicalPlan, Request
from .prepare import PreparedPlan, prepare
from .selector import Selection, Selector, has_quantized_variant
from .validation import check_inputs

log = logging.getLogger(__name__)


def device_arch(device: torch.device) -> str:
    """``"sm90"`` etc. for a CUDA device, ``"cpu"`` otherwise."""
    if device.type != "cuda":
        return "cpu"
    return cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@cache
def cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def make_request(q: torch.Tensor, k: torch.Tensor, mask: LogicalMask, return_lse: bool,
                 precision: str = INPUT_PRECISION) -> Request:
    if precision not in PRECISIONS:
        raise InvalidArgumentError("precision", f"one of {PRECISIONS}", repr(precision))
    batch, seq_q, heads, head_dim = q.shape
    return Request(
        batch=batch,
        heads=heads,
        seq_len_q=seq_q,
        seq_len_kv=k.shape[1],
        head_dim=head_dim,
        dtype=DTYPE_NAMES.get(q.dtype, "fp32"),
        block_q=mask.block_q,
        block_kv=mask.block_kv,
        arch=device_arch(q.device),
        return_lse=return_lse,
        precision=precision,
    )


def execute(
    prepared: PreparedPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    return_lse: bool,
    precision: str = INPUT_PRECISION,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run a prepared plan with the implementation its kernel names."""
    if precision == "int8":
        from . import quantized_ops

        return quantized_ops.run_quantized(prepared, q, k, v, scale, return_lse)
    if prepared.plan.kernel.family is Family.REFERENCE:
        prepared.check_call(q, k, v)
        return run_prepared(prepared, q, k, v, scale, return_lse)
    from . import ops  # the native library is loaded on first native use only

    return ops.run_native(prepared, q, k, v, scale, return_lse)


def tracing_or_capturing() -> bool:
    """Whether ``torch.compile`` traces or a CUDA graph captures on the current stream: no new
    metadata may be prepared then."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class CacheEntry(NamedTuple):
    """One prepared plan of ``Runtime``'s cache: the mask it was prepared for (a weak reference:
    the entry leaves with its mask) and the version of the mask's block tensor then."""

    mask: weakref.ref
    version: int | None
    prepared: PreparedPlan | None


def blocks_version(mask: LogicalMask) -> int | None:
    """The version counter of ``mask.blocks``, which every in-place write advances; None for a
    tensor made under ``torch.inference_mode`` (it keeps no counter, and outside that mode it
    cannot be written in place)."""
    try:
        return mask.blocks._version
    except RuntimeError:
        return None


@dataclass
class Runtime:
    """The owner of prepared plans: selection, preparation, the one cache of prepared plans and
    what happens to a plan when its mask comes back (one per pipeline, or per layer in the
    diffusers processors).

    An exact repeat of a request — the same mask object, unchanged, and the same shapes — skips
    selection and preparation; a mask whose ``blocks`` were written in place since is prepared
    again. Entries (and their device metadata) are dropped when their mask object dies: they hold
    the mask weakly (the prepared plan refers to a view of it, not to the mask itself). A new mask
    goes through ``selector`` (plan table regime lookup, or the cost model), whose own cache skips
    the ranking scan for a regime it has seen. A mask that comes back is re-prepared once in the
    plan ``Selector.reused_plan`` names (the grouped query layout of small query blocks on Hopper:
    its grouping, 0.2-0.3 ms once per mask at 32k tokens, is paid back by the calls after), and a
    worst-case plan takes its compact metadata once the count has reached the host (``reuse``).

    Safe to share between threads: the cache and the selection run under one lock (the launches
    do not)."""

    max_entries: int = 256
    _cache: dict = field(default_factory=dict, repr=False)
    warned: set = field(default_factory=set, repr=False)
    hits: int = 0
    misses: int = 0
    regroupings: int = 0  # masks re-prepared in another plan (the grouped query layout) when they came back
    reused_selections: int = 0  # misses whose selection ran no ranking scan and read no statistics
    selector: Selector = field(default_factory=Selector)
    # Prepared plans whose reuse plan is decided (Runtime.regrouped): nothing to decide again.
    _reuse_decided: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __getstate__(self) -> dict:  # a copy (``copy.deepcopy`` of a model holding one) gets its own lock
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def prepared_for(self, mask: LogicalMask, request: Request, plan: PhysicalPlan | None) -> PreparedPlan | None:
        """The plan to run for ``(mask, request)``; None means the reference oracle. A miss selects
        and prepares; a hit returns the kept plan as ``reuse`` leaves it."""
        key = (id(mask), request, plan)
        version = blocks_version(mask)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and entry.mask() is mask and entry.version == version:
                self.hits += 1
                if entry.prepared is None:
                    return None
                prepared = self.reuse(entry.prepared, request, decide_plan=plan is None)
                if prepared is not entry.prepared:
                    self._cache[key] = entry._replace(prepared=prepared)
                return prepared
            self.misses += 1
            # The state holds a view of the mask (same blocks tensor), so the cache keeps the user's
            # mask object alive no longer than the user does.
            state = build_mask_state(dataclasses.replace(mask))
            scans = self.selector.scans
            prepared = self.plan_request(state, request, plan)
            if plan is None and self.selector.scans == scans and not state.statistics_read:
                self.reused_selections += 1
            while len(self._cache) >= self.max_entries:
                self._cache.pop(next(iter(self._cache)), None)
            self._cache[key] = CacheEntry(weakref.ref(mask, self._forget(key)), version, prepared)
            return prepared

    def reuse(self, prepared: PreparedPlan, request: Request, decide_plan: bool = True) -> PreparedPlan:
        """The plan a mask that came back runs: ``prepared`` trimmed to its compact metadata once
        the deferred count has reached the host (``PreparedPlan.compacted``), then, unless the plan
        was forced (``decide_plan`` False), re-prepared in the plan ``Selector.reused_plan`` names
        (``regrouped``). A new object where either applies, to be kept instead of ``prepared``."""
        with self._lock:
            compact = prepared.compacted()
            if compact is not None:
                if prepared in self._reuse_decided:
                    self._reuse_decided.add(compact)
                prepared = compact
            return self.regrouped(prepared, request) if decide_plan else prepared

    def _forget(self, key: tuple) -> Callable[[weakref.ref], None]:
        """The callback that drops entry ``key`` when its mask dies (in whichever thread drops the
        last reference: under the lock, like every other change of the cache)."""
        cache, lock = self._cache, self._lock

        def forget(_: weakref.ref) -> None:
            with lock:
                cache.pop(key, None)

        return forget

    def regrouped(self, prepared: PreparedPlan, request: Request) -> PreparedPlan:
        """``prepared`` re-prepared in the plan ``Selector.reused_plan`` names for a mask that came
        back (the grouped query layout, or another natural plan); as is where that is the same plan,
        where its tensors must stay (a CUDA graph or a compiled graph holds them:
        ``PreparedPlan.pin``) and while a capture or compilation is under way. Decided once per
        prepared plan: later calls return it at once."""
        with self._lock:
            if prepared in self._reuse_decided or prepared.pinned or tracing_or_capturing():
                return prepared
            plan = self.selector.reused_plan(prepared.plan, request, prepared.state, warn=self._warn_once)
            if plan != prepared.plan:
                self.regroupings += 1
                log.debug("a mask came back: re-prepared in %s (was %s)", plan.name, prepared.plan.name)
                prepared = prepare(plan, prepared.state)
            self._reuse_decided.add(prepared)
            return prepared

    def plan_request(self, state: MaskState, request: Request, plan: PhysicalPlan | None) -> PreparedPlan | None:
        if plan is not None:
            reason = rejection(plan, request)
            if reason is None and request.precision == "int8" and not has_quantized_variant(plan):
                reason = "its kernel has no 8-bit variant"
            if reason is not None:
                raise InvalidArgumentError("plan", f"a plan that can serve {request.key}", f"{plan.name} ({reason})")
            return prepare(plan, state)
        if request.precision == "int8":
            chosen = self.selector.quantized(request, state, warn=self._warn_once).chosen
        else:
            chosen = self.selector.select(request, state, warn=self._warn_once)
        return None if chosen is None else prepare(chosen, state)

    def _warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, stacklevel=4)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: LogicalMask,
        *,
        scale: float | None = None,
        return_lse: bool = False,
        plan: PhysicalPlan | None = None,
        check_finite: bool = False,
        precision: str = INPUT_PRECISION,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See ``block_sparse_attention``."""
        scale = check_inputs(q, k, v, mask, scale, check_finite)
        request = self.runnable_precision(make_request(q, k, mask, return_lse, precision))
        prepared = self.prepared_for(mask, request, plan)
        if prepared is None:
            self.no_plan(request)
            return reference.attention(q, k, v, mask, scale, return_lse)
        return execute(prepared, q, k, v, scale, return_lse, request.precision)

    def runnable_precision(self, request: Request, warn: Callable[[str], None] | None = None) -> Request:
        """``request``, or where its precision cannot run here (``quantized_unavailable``) the same
        request in the inputs' precision, said through ``warn`` (default: once per Runtime)."""
        if request.precision == "int8":
            why = quantized_unavailable(request)
            if why is not None:
                (warn or self._warn_once)(f"precision=\"int8\" unavailable for {request.key} ({why}): "
                                          f"running the {request.dtype} kernels instead")
                return dataclasses.replace(request, precision=INPUT_PRECISION)
        return request

    def no_plan(self, request: Request, warn: Callable[[str], None] | None = None) -> None:
        """Say (through ``warn``, default once per Runtime) that an 8-bit request found no plan and
        runs on the reference oracle."""
        if request.precision == "int8":
            (warn or self._warn_once)(f"precision=\"int8\": no plan of {request.key} has an 8-bit kernel; "
                                      "running the reference oracle")

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    # -- explain (issue 6): how a request would be planned ----------------------------------------

    def explain(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: LogicalMask,
        *,
        return_lse: bool = False,
        precision: str = INPUT_PRECISION,
        file=None,
    ) -> Selection:
        """Print (to ``file``, default stdout) and return how ``attention(q, k, v, mask,
        precision=precision)`` would be planned: the regime, its ranking, every rejected plan with its
        reason, and the chosen plan (with its 8-bit kernel for ``"int8"``). ``q [B, Sq, H, D]``,
        ``k, v [B, Skv, H, D]``. Prepares and runs nothing."""
        import sys

        check_inputs(q, k, v, mask, None)
        selection = self.selector.rank(make_request(q, k, mask, return_lse, precision), build_mask_state(mask),
                                       warn=self._warn_once)
        print(selection.explain(), file=file or sys.stdout)
        return selection


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LogicalMask,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    plan: PhysicalPlan | None = None,
    runtime: Runtime | None = None,
    check_finite: bool = False,
    precision: str = INPUT_PRECISION,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention: row i is ``softmax(q_i K^T * scale over E(mask)) V``.

    Args:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Skv, H, D]``; bf16 or fp16 (fp32 on the reference path),
            last dim contiguous, other strides free.
        mask: ``LogicalMask`` over ``(Sq, Skv)``, broadcast over batch/heads.
        scale: softmax scale (``1/sqrt(D)`` by default).
        return_lse: also return the natural log-sum-exp per row, ``[B, H, Sq]`` fp32.
        plan: force a physical plan (otherwise the selector chooses; the reference oracle serves
            requests no native plan can).
        runtime: a ``Runtime`` whose prepared-plan cache to use (a fresh one otherwise).
        check_finite: raise on NaN/inf inputs (one host sync). Without it, non-finite inputs
            propagate as in dense attention: a NaN in an active key's row poisons that query row.
            On the native path a non-finite V of a key outside a row's active blocks can reach the
            row too, when the plan's KV tile holds that key for another row (its weight 0 times NaN).
        precision: ``"input"`` (default): computed in q's dtype. ``"int8"``: Q K^T on the 8-bit
            tensor cores (``quantized.py``: Q scaled per token, K per 16-token chunk after K smoothing), P V in q's
            dtype with fp32 accumulation, on Hopper with head_dim 128 and finite inputs; within
            cosine 0.999 and relative L2 0.03 of the fp32 result (about 0.01 on random inputs).
            Elsewhere it warns once and runs the 16-bit path.

    Returns:
        out ``[B, Sq, H, D]`` in the dtype of q; rows with no active key are 0 (lse -inf).
    """
    runtime = runtime or Runtime()
    return runtime.attention(q, k, v, mask, scale=scale, return_lse=return_lse, plan=plan, check_finite=check_finite,
                             precision=precision)


def quantized_unavailable(request: Request) -> str | None:
    """Why the 8-bit kernels cannot serve ``request``, or None."""
    if request.arch != "sm90":
        return f"the 8-bit kernels need sm90, not {request.arch}"
    if request.head_dim != QUANTIZED_HEAD_DIM or request.dtype not in ("bf16", "fp16"):
        return f"the 8-bit kernels take bf16 or fp16 with head_dim {QUANTIZED_HEAD_DIM}"
    from .library import quantized_library

    try:
        if quantized_library() is None:
            return "this build of the native library has no 8-bit kernels"
    except CatalogError as err:
        return str(err)
    return None
