"""A benchmark problem (one mask at one attention shape), its random inputs, and the oracle check.

Every output whose time is reported is first compared with the exact fp32 oracle
(``reference.attention``) on a subset of heads: the error over rows that have keys must be at most
twice the error of a same-precision PyTorch run plus a small ``atol`` (the criterion of
``tessera_diffusers.testing``), and rows without keys must be exactly 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import reference
from ..corpus import CaseSpec
from ..errors import InvalidArgumentError
from ..mask import LogicalMask

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Absolute slack on top of twice the same-precision error, per dtype.
DEFAULT_ATOL = {torch.bfloat16: 2e-3, torch.float16: 1e-3, torch.float32: 1e-5}


def dtype_named(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidArgumentError("dtype", f"one of {sorted(DTYPES)}", repr(name))
    return DTYPES[name]


@dataclass(frozen=True, eq=False)
class Problem:
    """One mask at one attention shape ``q, k, v: [batch, seq, heads, head_dim]``."""

    name: str
    size: str  # size profile the case was built for ("n32k", "wan720p", "evaluation", "corpus", ...)
    family: str
    source: str
    mask: LogicalMask
    batch: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    case: CaseSpec | None = None
    info: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.mask.device

    @property
    def seq_q(self) -> int:
        return self.mask.seq_len_q

    @property
    def seq_kv(self) -> int:
        return self.mask.seq_len_kv

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def geometry(self) -> str:
        return self.mask.geometry_name

    @property
    def shape_key(self) -> tuple:
        """What a dense baseline's time depends on."""
        return (self.batch, self.seq_q, self.seq_kv, self.heads, self.head_dim, str(self.dtype), str(self.device))

    @property
    def key(self) -> str:
        return f"{self.size}:{self.name}"

    def effective_flops(self) -> float:
        """``4 * D * |E(M)|`` summed over batch and heads."""
        return self.mask.effective_flops(self.batch, self.heads, self.head_dim)

    def dense_flops(self) -> float:
        return 4.0 * self.head_dim * self.seq_q * self.seq_kv * self.batch * self.heads


def make_inputs(problem: Problem, n_sets: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``n_sets`` independent random ``(q, k, v)`` sets ``[B, S, H, D]`` in the problem's dtype
    (standard normal: never zero, never the same set twice)."""
    device = problem.device
    sets = []
    for i in range(n_sets):
        gen = torch.Generator(device=device).manual_seed(seed * 1009 + i)
        shape_q = (problem.batch, problem.seq_q, problem.heads, problem.head_dim)
        shape_kv = (problem.batch, problem.seq_kv, problem.heads, problem.head_dim)
        q = torch.randn(shape_q, generator=gen, device=device, dtype=torch.float32).to(problem.dtype)
        k = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.float32).to(problem.dtype)
        v = torch.randn(shape_kv, generator=gen, device=device, dtype=torch.float32).to(problem.dtype)
        sets.append((q, k, v))
    return sets


def check_heads(heads: int, count: int) -> list[int]:
    """Which heads the oracle check looks at: spread over the range, always the first and last."""
    if count <= 0 or count >= heads:
        return list(range(heads))
    if count == 1:
        return [0]
    return sorted({round(i * (heads - 1) / (count - 1)) for i in range(count)})


@dataclass(frozen=True)
class Check:
    """Outcome of one oracle comparison."""

    ok: bool  # within tolerance on rows with keys, finite, and exact zeros on rows without keys
    within_tolerance: bool  # the first condition alone (what a baseline needs to be timed)
    error: float
    twin_error: float
    tolerance: float
    empty_rows: int
    empty_rows_zero: bool
    heads: tuple[int, ...]

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "within_tolerance": self.within_tolerance,
            "max_abs_error": self.error,
            "twin_error": self.twin_error,
            "tolerance": self.tolerance,
            "empty_rows_checked": self.empty_rows,
            "empty_rows_zero": self.empty_rows_zero,
            "heads": list(self.heads),
        }


class OracleCheck:
    """The oracle's output on a subset of heads for one problem and one input set, computed on
    first use and reused for every backend of the problem."""

    def __init__(
        self,
        problem: Problem,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        heads: list[int],
        atol: float | None = None,
        dense: bool = False,
    ):
        self.problem = problem
        self.heads = heads
        self.inputs = inputs
        self.atol = DEFAULT_ATOL.get(problem.dtype, 1e-3) if atol is None else atol
        self.dense = dense
        self._ref: torch.Tensor | None = None
        self._twin_error = 0.0
        self._has_key: torch.Tensor | None = None

    def sub_mask(self) -> LogicalMask:
        p = self.problem
        if self.dense:
            return LogicalMask.dense(p.seq_q, p.seq_kv, 128, 128, device=p.device)
        mask = p.mask
        if mask.heads == 1:
            return mask
        index = torch.tensor(self.heads, device=mask.device)
        return LogicalMask(mask.blocks.index_select(1, index), mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv)

    def _compute(self) -> None:
        q, k, v = (t[:, :, self.heads] for t in self.inputs)
        mask = self.sub_mask()
        scale = self.problem.scale
        ref = reference.attention(q, k, v, mask, scale, out_dtype=torch.float32)
        twin = reference.attention(q, k, v, mask, scale, out_dtype=q.dtype, p_dtype=q.dtype)
        rows = mask.blocks.any(-1)  # [Bm, Hm, nQ]
        rows = rows.repeat_interleave(mask.block_q, dim=2)[:, :, : mask.seq_len_q]  # [Bm, Hm, Sq]
        has_key = rows.permute(0, 2, 1).expand(q.shape[0], -1, q.shape[2])  # [B, Sq, Hs]
        self._ref = ref
        self._has_key = has_key
        self._twin_error = max_error(twin.float(), ref, has_key)

    def compare(self, out: torch.Tensor) -> Check:
        """Compare a backend's full output ``[B, Sq, H, D]`` with the oracle on the checked heads."""
        if self._ref is None:
            self._compute()
        assert self._ref is not None and self._has_key is not None
        sub = out[:, :, self.heads].float()
        has_key = self._has_key
        keyed = sub[has_key]
        finite = bool(torch.isfinite(keyed).all())
        error = max_error(sub, self._ref, has_key) if finite else math.inf
        tolerance = 2 * self._twin_error + self.atol
        empty = ~has_key
        n_empty = int(empty.sum())
        empty_zero = n_empty == 0 or bool((sub[empty] == 0).all())
        within = finite and error <= tolerance
        return Check(within and empty_zero, within, error, self._twin_error, tolerance, n_empty, empty_zero,
                     tuple(self.heads))


    def agreement(self, out: torch.Tensor):
        """An 8-bit backend's full output ``[B, Sq, H, D]`` against the oracle on the checked heads
        (``quantized.agreement``: cosine and relative L2; rows without keys must be 0 in both)."""
        from ..quantized import agreement

        if self._ref is None:
            self._compute()
        return agreement(out[:, :, self.heads].float(), self._ref)


def max_error(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> float:
    """Largest ``|out - ref|`` over the ``rows [B, S, H]`` selected (0 if none)."""
    if not bool(rows.any()):
        return 0.0
    return float((out[rows] - ref[rows]).abs().max())
