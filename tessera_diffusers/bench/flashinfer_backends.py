"""FlashInfer block-sparse baselines, isolated: nothing here runs unless ``flashinfer`` imports.

Written against FlashInfer 0.7.4 (``flashinfer/sparse.py`` of the 0.7.4 wheel); 0.3.1 (tag v0.3.1)
still works, and where the two differ it is said below and read off the wrapper, not the version:

- ``BlockSparseAttentionWrapper(workspace, backend)``: one BSR pattern for all heads of a call, so
  per-head masks are *folded into rows*: every ``(batch, head)`` becomes its own band of query rows
  and key rows of a single-head problem (q ``[B*H*Sq, 1, D]``, k, v ``[B*H*Skv, 1, D]``), and the
  BSR has ``B*H*nQ`` block rows. ``plan(indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads,
  head_dim, ...)`` then ``run(q, k, v)``. Keys must fill whole blocks (``N // C``), so a partial last
  block (a sequence that is not a multiple of the block sizes) cannot be expressed exactly:
  reported as unsupported. The KV side is a paged cache with page size ``C`` and the BSR's block
  indices as page indices. With ``fa3``, 0.3.1 expands those block indices into one int32 offset
  per key token inside every ``run()`` (``block_sparse_indices_to_vector_sparse_offsets`` into
  fixed ``_vector_sparse_*`` buffers); 0.7.4 hands the page indices to the SM90 paged kernel as
  they are (no per-token list, no such buffers).
- ``VariableBlockSparseAttentionWrapper(workspace, backend)``: a mask per KV head,
  ``plan(block_mask_map [H, MB, NB], block_row_sz [H, MB], block_col_sz [H, NB], num_qo_heads,
  num_kv_heads, head_dim, ...)`` then ``run(q [H, S, D], k, v)``; block sizes are free, so partial
  last blocks are exact. Pages of one token, on both versions: ``plan()`` lists every selected key
  token (int32), so that list must fit int32. The output dtype is the query's. One batch element
  per call; q, k, v are handed over contiguous in ``(H, S, D)`` (the copy is part of the complete
  request, not of the kernel). 0.7.4's ``plan()`` synchronizes the device.

Both take ``backend="fa2"`` or ``"fa3"`` (Hopper; 0.7.4 also has ``"auto"``, ``"cake"`` and
sm100/sm120 VSA backends, not used here). Each ``(dtype, head_dim)`` is a JIT module built with nvcc
on first use (0.7.4: ``fa2`` one module, ``fa3`` one ``..._sm90`` module; BSR and variable wrappers
share them). Internal buffers sized for LLM serving (32,768 rows in ``_kv_lens_buffer``, 8 MiB of
int workspace; on 0.3.1 also 128M vector-sparse indices) are grown when a video problem needs more
(0.7.4 grows ``_kv_lens_buffer`` itself); that is noted in the results. Each variant's ``plan()``
(with its host syncs and copies) is part of its complete-request latency; the fold (a copy of q, k,
v into the folded layout) is too, but not of its kernel latency.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import torch

from .backends import Backend, Inputs
from .problem import Problem

WORKSPACE_BYTES = 256 * 1024 * 1024
BACKENDS = ("fa2", "fa3")
INT32_MAX = 2**31 - 1
MAX_WORKSPACE_GROWTH = 3


def import_flashinfer() -> tuple[Any, str | None]:
    """The ``flashinfer`` module, or None and the reason it cannot be used."""
    try:
        import flashinfer
        from flashinfer import sparse  # noqa: F401
    except Exception as err:  # noqa: BLE001  (ImportError, or a broken CUDA/JIT setup raising anything)
        return None, f"flashinfer not importable: {type(err).__name__}: {err}"
    return flashinfer, None


def flashinfer_version() -> str | None:
    """The version of the ``flashinfer`` that imports (its ``__version__``, else the installed
    distribution's), or None when it does not import."""
    module, _ = import_flashinfer()
    if module is None:
        return None
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("flashinfer-python")
    except Exception:  # noqa: BLE001  (not installed as a distribution, e.g. a bare PYTHONPATH copy)
        return "unknown"


def call_with_supported(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature knows (versions differ in extras)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


def folded_bsr(blocks: torch.Tensor, batch: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BSR of the head-folded single-head problem: block row ``(b * H + h) * nQ + i`` holds block
    columns ``(b * H + h) * nKV + j`` for the active ``(i, j)`` of mask ``(b, h)``.

    ``blocks [Bm|B, Hm|H, nQ, nKV]`` bool -> ``indptr [B*H*nQ + 1]``, ``indices [nnz]`` int32."""
    full = blocks.expand(batch, heads, -1, -1)
    n_kv = full.shape[-1]
    counts = full.sum(-1, dtype=torch.int32).reshape(-1)
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=blocks.device)
    indptr[1:] = torch.cumsum(counts, 0, dtype=torch.int32)
    b, h, _, j = torch.nonzero(full, as_tuple=True)  # row-major: sorted by (b, h, i, j)
    indices = ((b * heads + h) * n_kv + j).to(torch.int32)
    return indptr, indices


def bsr_plan_args(problem: Problem) -> tuple:
    """The positional arguments of ``BlockSparseAttentionWrapper.plan`` for the head-folded problem:
    ``(indptr, indices, M, N, R, C, num_qo_heads=1, num_kv_heads=1, head_dim)`` with
    ``M = B*H*Sq`` query rows and ``N = B*H*Skv`` keys (whole blocks: see ``unsupported``)."""
    mask = problem.mask
    indptr, indices = folded_bsr(mask.blocks, problem.batch, problem.heads)
    bh = problem.batch * problem.heads
    return (indptr, indices, bh * problem.seq_q, bh * problem.seq_kv, mask.block_q, mask.block_kv, 1, 1,
            problem.head_dim)


def variable_block_sizes(problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_mask_map [H, nQ, nKV]`` bool, ``block_row_sz [H, nQ]``, ``block_col_sz [H, nKV]``
    int32 (last block partial) of a batch-1 problem."""
    mask = problem.mask
    heads = problem.heads
    blocks = mask.blocks[0].expand(heads, -1, -1).contiguous()
    rows = mask.block_sizes_q().to(torch.int32).unsqueeze(0).expand(heads, -1).contiguous()
    cols = mask.block_sizes_kv().to(torch.int32).unsqueeze(0).expand(heads, -1).contiguous()
    return blocks, rows, cols


def gathered_key_tokens(problem: Problem) -> int:
    """Key tokens listed over all block rows of all heads (the length of a token-level index list)."""
    mask = problem.mask
    per_row = mask.blocks.to(torch.float64) @ mask.block_sizes_kv().to(torch.float64)  # [Bm, Hm, nQ]
    scale = (problem.batch // mask.batch) * (problem.heads // mask.heads)
    return int(per_row.sum().item()) * scale


def plan_growing_workspace(backend: FlashInferBase, plan: Callable[[], None]) -> None:
    """Call ``plan()``; when FlashInfer reports a workspace too small (they are sized for LLM
    batches), quadruple that workspace and retry, a few times at most. The scheduler's message
    ("Buffer overflow when allocating memory for <name> ...") names the allocation: the split-KV
    partial outputs (``..._tmp_v``, ``..._tmp_s``) live in the float workspace, the rest of the plan
    in the int workspace."""
    for attempt in range(MAX_WORKSPACE_GROWTH + 1):
        try:
            plan()
            return
        except RuntimeError as err:
            text = str(err).lower()
            if attempt == MAX_WORKSPACE_GROWTH or ("workspace" not in text and "buffer" not in text):
                raise
            if workspace_of_overflow(text) == "float":
                backend.grow_float_workspace()
            else:
                backend.grow_int_workspace()


def workspace_of_overflow(message: str) -> str:
    """``"float"`` when FlashInfer's overflow message names a split-KV partial-output buffer
    (``tmp_v`` / ``tmp_s``, carved from the float workspace), else ``"int"``."""
    return "float" if re.search(r"allocating memory for \S*tmp_[vs]\b", message.lower()) else "int"


def grow_int_buffer(owner: Any, attribute: str, needed: int, device: torch.device, notes: list[str]) -> None:
    """Replace ``owner.<attribute>`` (an int32 buffer) by a larger one when ``needed`` exceeds it."""
    current = getattr(owner, attribute, None)
    if current is None or current.numel() >= needed:
        return
    setattr(owner, attribute, torch.empty(needed, dtype=current.dtype, device=device))
    notes.append(f"grew {attribute} from {current.numel()} to {needed} entries")


class FlashInferBase(Backend):
    kind = "sparse"
    wrapper_name = ""

    def __init__(self, backend: str):
        self.backend = backend
        self.notes: list[str] = []
        self._wrapper: Any = None
        self._module, self._error = import_flashinfer()
        if self._module is None:
            return
        if not torch.cuda.is_available():
            self._error = "needs CUDA"
            return
        cls = getattr(self._module.sparse, self.wrapper_name, None)
        if cls is None:
            self._error = f"flashinfer {flashinfer_version()} has no sparse.{self.wrapper_name}"
            return
        if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
            self._error = "the fa3 backend needs an sm90 (Hopper) GPU"
            return
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        try:
            self._wrapper = cls(workspace, backend=backend)
        except Exception as err:  # noqa: BLE001  (any construction failure makes the variant unavailable)
            self._error = f"{self.wrapper_name}(backend={backend!r}) failed: {type(err).__name__}: {err}"

    def unavailable(self) -> str | None:
        return self._error

    def unsupported(self, problem: Problem) -> str | None:
        if problem.device.type != "cuda":
            return "needs CUDA tensors"
        if problem.dtype not in (torch.bfloat16, torch.float16):
            return "bf16/fp16 only"
        if self.token_indexed() and gathered_key_tokens(problem) > INT32_MAX:
            return "its token-level int32 index list would overflow at this size"
        return None

    def token_indexed(self) -> bool:
        """Whether this variant expands block lists into one int32 entry per key token."""
        return self.vector_sparse()

    def vector_sparse(self) -> bool:
        """Whether the wrapper expands block indices into per-token offsets in fixed buffers
        (FlashInfer 0.3.1 with ``fa3``; 0.7.4 has no such buffers)."""
        return self.backend == "fa3" and getattr(self._wrapper, "_vector_sparse_indices_buffer", None) is not None

    def grow_vector_sparse(self, indptr_entries: int, index_entries: int, device: torch.device) -> None:
        """Grow the fixed token-offset buffers of the vector-sparse path (0.3.1 ``fa3``) to fit."""
        if not self.vector_sparse():
            return
        w = self._wrapper
        indices_buf = getattr(w, "_vector_sparse_indices_buffer", None)
        indptr_buf = getattr(w, "_vector_sparse_indptr_buffer", None)
        if indices_buf is None or indptr_buf is None:
            return
        # FlashInfer requires strictly more room than needed (it checks with <=).
        need_indices = index_entries + 1
        need_indptr = indptr_entries + 1
        if indices_buf.numel() >= need_indices and indptr_buf.numel() >= need_indptr:
            return
        new_indices = indices_buf if indices_buf.numel() >= need_indices else torch.empty(
            need_indices, dtype=torch.int32, device=device)
        new_indptr = indptr_buf if indptr_buf.numel() >= need_indptr else torch.empty(
            need_indptr, dtype=torch.int32, device=device)
        w._vector_sparse_indices_buffer = new_indices
        w._vector_sparse_indptr_buffer = new_indptr
        self.notes.append(f"grew vector-sparse buffers to {need_indices} indices / {need_indptr} indptr entries")

    def grow_int_workspace(self) -> None:
        """Quadruple the wrapper's int workspace (plan metadata) through its public reset call."""
        w = self._wrapper
        current = w._int_workspace_buffer
        bigger = torch.empty(4 * current.numel(), dtype=current.dtype, device=current.device)
        w.reset_workspace_buffer(w._float_workspace_buffer, bigger)
        self.notes.append(f"grew the int workspace to {bigger.numel() >> 20} MiB")

    def grow_float_workspace(self) -> None:
        """Quadruple the wrapper's float workspace (split-KV partial outputs) through its public reset call."""
        w = self._wrapper
        current = w._float_workspace_buffer
        bigger = torch.empty(4 * current.numel(), dtype=current.dtype, device=current.device)
        w.reset_workspace_buffer(bigger, w._int_workspace_buffer)
        self.notes.append(f"grew the float workspace to {bigger.numel() >> 20} MiB")

    def describe(self) -> dict:
        # "fi_backend", not "backend": the harness's record already names the variant under "backend"
        # (a "backend" key here once overwrote it, merging the BSR and variable-block records).
        return {"flashinfer": flashinfer_version(), "wrapper": self.wrapper_name, "fi_backend": self.backend,
                "notes": sorted(set(self.notes))}


class FlashInferBsr(FlashInferBase):
    """``BlockSparseAttentionWrapper`` with heads folded into rows (fixed ``R x C`` blocks)."""

    wrapper_name = "BlockSparseAttentionWrapper"

    def __init__(self, backend: str):
        self.name = f"flashinfer-bsr-{backend}"
        super().__init__(backend)

    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)
        if reason:
            return reason
        mask = problem.mask
        if problem.seq_q % mask.block_q or problem.seq_kv % mask.block_kv:
            return (
                f"sequence {problem.seq_q} is not a multiple of the blocks ({mask.block_q}, {mask.block_kv}): "
                "folded heads would share a partial block and the BSR wrapper needs N // C whole blocks"
            )
        return None

    def prepare(self, problem: Problem) -> Any:
        mask = problem.mask
        args = bsr_plan_args(problem)
        indptr, indices = args[0], args[1]
        rows = indptr.numel() - 1
        grow_int_buffer(self._wrapper, "_kv_lens_buffer", rows, problem.device, self.notes)
        self.grow_vector_sparse(rows + 1, indices.numel() * mask.block_kv, problem.device)
        plan_growing_workspace(self, lambda: call_with_supported(
            self._wrapper.plan,
            *args,
            sm_scale=problem.scale,
            q_data_type=problem.dtype,
            kv_data_type=problem.dtype,
            o_data_type=problem.dtype,
        ))
        return self._wrapper

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        def fold(t: torch.Tensor) -> torch.Tensor:  # (B, S, H, D) -> (B*H*S, 1, D), a copy
            b, s, h, d = t.shape
            return t.permute(0, 2, 1, 3).reshape(b * h * s, 1, d)

        return (fold(q), fold(k), fold(v))

    def run(self, prepared: Any, inputs: Inputs) -> torch.Tensor:
        return prepared.run(*inputs)

    def describe(self) -> dict:
        out = super().describe()
        if self.vector_sparse():
            # FlashInfer's own run(), timed as it is: the index conversion and the kernel
            out["run_includes"] = ("block_sparse_indices_to_vector_sparse_offsets (block -> per-token K/V offsets, "
                                   "every call) + the SM90 paged kernel")
        return out

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        b, h, s, d = problem.batch, problem.heads, problem.seq_q, problem.head_dim
        return out.reshape(b, h, s, d).permute(0, 2, 1, 3)


class FlashInferVariable(FlashInferBase):
    """``VariableBlockSparseAttentionWrapper``: one mask per head, partial last blocks exact."""

    wrapper_name = "VariableBlockSparseAttentionWrapper"

    def __init__(self, backend: str):
        self.name = f"flashinfer-var-{backend}"
        super().__init__(backend)

    def unsupported(self, problem: Problem) -> str | None:
        reason = super().unsupported(problem)
        if reason:
            return reason
        if problem.batch != 1:
            return "the variable-block wrapper has no batch dimension (batch 1 only here)"
        if not bool(problem.mask.blocks.any()):
            # plan() expands the selection with torch.arange(cumsum[-1]): an empty selection raises
            return "no active block: the variable-block plan() cannot expand an empty selection"
        try:
            import einops  # noqa: F401  (its run() rearranges with einops)
        except ImportError:
            return "VariableBlockSparseAttentionWrapper.run needs einops, which is not installed"
        return None

    def token_indexed(self) -> bool:
        return True  # page size 1: every key token is one index entry

    def prepare(self, problem: Problem) -> Any:
        blocks, rows, cols = variable_block_sizes(problem)
        heads, n_q = rows.shape
        grow_int_buffer(self._wrapper, "_kv_lens_buffer", heads * n_q, problem.device, self.notes)
        self.grow_vector_sparse(heads * n_q + 1, gathered_key_tokens(problem), problem.device)
        plan_growing_workspace(self, lambda: call_with_supported(
            self._wrapper.plan,
            blocks,
            rows,
            cols,
            heads,
            heads,
            problem.head_dim,
            sm_scale=problem.scale,
            q_data_type=problem.dtype,
            kv_data_type=problem.dtype,
        ))
        return self._wrapper

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        # (H, S, D) contiguous: run() then reshapes without copying, so its time is the kernel's
        return tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v))

    def run(self, prepared: Any, inputs: Inputs) -> torch.Tensor:
        return prepared.run(*inputs)

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        return out.transpose(0, 1).unsqueeze(0)


def flashinfer_backends() -> list[Backend]:
    """Every FlashInfer variant (each reports its own unavailability)."""
    out: list[Backend] = []
    for backend in BACKENDS:
        out.append(FlashInferBsr(backend))
        out.append(FlashInferVariable(backend))
    return out


__all__ = ["FlashInferBsr", "FlashInferVariable", "bsr_plan_args", "flashinfer_backends", "flashinfer_version",
           "folded_bsr", "gathered_key_tokens", "import_flashinfer", "variable_block_sizes", "workspace_of_overflow"]
