"""LogicalMask: *what* must be computed.

A logical mask is a block geometry ``(block_q, block_kv)``, the sequence lengths it covers and the
set of active ``(query-block, key-block)`` pairs per ``(batch, head)``. A batch or head dimension of
1 broadcasts. Sequence lengths need not be multiples of the blocks: the last block of each axis is
partial and covers only the tokens that exist.

The mask says nothing about how the GPU computes it; that is the physical plan's business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import MaskError, describe_tensor

MIN_BLOCK = 16
MAX_BLOCK = 512
BLOCK_ALIGNMENT = 16
# Token-level pictures and dense expansions above this many elements are refused (they are debug tools).
MAX_DENSE_ELEMENTS = 1 << 28


def check_block_size(name: str, value: int) -> int:
    """Validate one axis of a block geometry: a multiple of 16 in [16, 512]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MaskError(name, f"an int multiple of {BLOCK_ALIGNMENT} in [{MIN_BLOCK}, {MAX_BLOCK}]", repr(value))
    if value % BLOCK_ALIGNMENT or not MIN_BLOCK <= value <= MAX_BLOCK:
        raise MaskError(name, f"a multiple of {BLOCK_ALIGNMENT} in [{MIN_BLOCK}, {MAX_BLOCK}]", value)
    return value


def check_positive_int(name: str, value: int) -> int:
    """Validate a count (sequence length, batch, heads): a positive int, not a bool or a float."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MaskError(name, "a positive int", repr(value))
    return value


check_seq_len = check_positive_int


def check_index_tensor(name: str, value: torch.Tensor, expected: str) -> torch.Tensor:
    """Validate a block-index tensor: a torch tensor of an integer dtype (a float index would be
    truncated silently, a bool one read as 0/1)."""
    if not isinstance(value, torch.Tensor):
        raise MaskError(name, f"an integer torch.Tensor {expected}", describe_tensor(value))
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise MaskError(name, "an integer dtype (torch.int32 or torch.int64)", value.dtype)
    return value


def check_same_device(names: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise MaskError(names, "tensors on one device", f"{a.device} and {b.device}")


@dataclass(frozen=True, eq=False)
class LogicalMask:
    """Active block set over a ``(block_q, block_kv)`` grid.

    Attributes:
        blocks: ``[B|1, H|1, nQ, nKV]`` bool, ``nQ = ceil(seq_len_q / block_q)``, ``nKV`` likewise.
        block_q, block_kv: logical block geometry (multiples of 16 in [16, 512]; unequal allowed).
        seq_len_q, seq_len_kv: token counts the mask covers.

    Identity is the object: two masks with equal contents are different masks (plans are cached
    per mask object, so build a new mask when the pattern changes instead of mutating ``blocks``).
    """

    blocks: torch.Tensor  # [B|1, H|1, nQ, nKV] bool
    block_q: int
    block_kv: int
    seq_len_q: int
    seq_len_kv: int

    def __post_init__(self) -> None:
        check_block_size("block_q", self.block_q)
        check_block_size("block_kv", self.block_kv)
        check_seq_len("seq_len_q", self.seq_len_q)
        check_seq_len("seq_len_kv", self.seq_len_kv)
        blocks = self.blocks
        if not isinstance(blocks, torch.Tensor):
            raise MaskError("blocks", "a bool tensor [B|1, H|1, nQ, nKV]", describe_tensor(blocks))
        if blocks.dtype != torch.bool:
            raise MaskError("blocks", "dtype torch.bool", blocks.dtype)
        if blocks.dim() != 4:
            raise MaskError("blocks", "a 4-D tensor [B|1, H|1, nQ, nKV]", f"{blocks.dim()}-D shape {tuple(blocks.shape)}")
        expected = (self.num_blocks_q, self.num_blocks_kv)
        if tuple(blocks.shape[2:]) != expected:
            raise MaskError(
                "blocks",
                f"block grid (nQ, nKV) = {expected} = (ceil({self.seq_len_q}/{self.block_q}), "
                f"ceil({self.seq_len_kv}/{self.block_kv}))",
                f"shape {tuple(blocks.shape)}",
            )
        if blocks.shape[0] < 1 or blocks.shape[1] < 1:
            raise MaskError("blocks", "batch and head dims >= 1", f"shape {tuple(blocks.shape)}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_blocks(
        cls,
        blocks: torch.Tensor,
        block_q: int,
        block_kv: int | None = None,
        seq_len_q: int | None = None,
        seq_len_kv: int | None = None,
    ) -> LogicalMask:
        """Canonical constructor from a bool block tensor of rank 2 ``[nQ, nKV]``, 3 ``[H, nQ, nKV]``
        or 4 ``[B, H, nQ, nKV]``. Sequence lengths default to whole blocks."""
        if not isinstance(blocks, torch.Tensor):
            raise MaskError("blocks", "a bool tensor", describe_tensor(blocks))
        if blocks.dim() not in (2, 3, 4):
            raise MaskError("blocks", "rank 2, 3 or 4", f"rank {blocks.dim()}")
        while blocks.dim() < 4:
            blocks = blocks.unsqueeze(0)
        block_kv = block_q if block_kv is None else block_kv
        seq_len_q = blocks.shape[2] * block_q if seq_len_q is None else seq_len_q
        seq_len_kv = blocks.shape[3] * block_kv if seq_len_kv is None else seq_len_kv
        return cls(blocks, block_q, block_kv, seq_len_q, seq_len_kv)

    @classmethod
    def dense(
        cls,
        seq_len_q: int,
        seq_len_kv: int,
        block_q: int = 128,
        block_kv: int = 128,
        device: torch.device | str | None = None,
    ) -> LogicalMask:
        """All blocks active (full attention), broadcast over batch and heads."""
        n_q = math.ceil(check_seq_len("seq_len_q", seq_len_q) / check_block_size("block_q", block_q))
        n_kv = math.ceil(check_seq_len("seq_len_kv", seq_len_kv) / check_block_size("block_kv", block_kv))
        blocks = torch.ones(1, 1, n_q, n_kv, dtype=torch.bool, device=device)
        return cls(blocks, block_q, block_kv, seq_len_q, seq_len_kv)

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        block_q: int,
        block_kv: int,
        seq_len_q: int,
        seq_len_kv: int,
    ) -> LogicalMask:
        """From FlexAttention-style padded block lists.

        Args:
            kv_num_blocks: ``[B|1, H|1, nQ]`` int, active KV blocks per query-block row.
            kv_indices: ``[B|1, H|1, nQ, L]`` int, the first ``kv_num_blocks`` entries of each row
                are active KV block indices; the rest is ignored.
        """
        check_block_size("block_q", block_q)
        check_block_size("block_kv", block_kv)
        n_q = math.ceil(check_seq_len("seq_len_q", seq_len_q) / block_q)
        n_kv = math.ceil(check_seq_len("seq_len_kv", seq_len_kv) / block_kv)
        check_index_tensor("kv_num_blocks", kv_num_blocks, "[B|1, H|1, nQ]")
        check_index_tensor("kv_indices", kv_indices, "[B|1, H|1, nQ, L]")
        check_same_device("kv_num_blocks/kv_indices", kv_num_blocks, kv_indices)
        if kv_num_blocks.dim() != 3 or kv_indices.dim() != 4:
            raise MaskError(
                "kv_num_blocks/kv_indices",
                "ranks 3 [B, H, nQ] and 4 [B, H, nQ, L]",
                f"{describe_tensor(kv_num_blocks)} / {describe_tensor(kv_indices)}",
            )
        if tuple(kv_indices.shape[:3]) != tuple(kv_num_blocks.shape):
            raise MaskError("kv_indices", f"leading shape {tuple(kv_num_blocks.shape)}", tuple(kv_indices.shape))
        if kv_num_blocks.shape[2] != n_q:
            raise MaskError("kv_num_blocks", f"nQ = ceil({seq_len_q}/{block_q}) = {n_q} rows", tuple(kv_num_blocks.shape))
        b, h, n_q, width = kv_indices.shape
        counts = kv_num_blocks.to(torch.long)
        if bool(((counts < 0) | (counts > width)).any()):
            raise MaskError("kv_num_blocks", f"counts in [0, L = {width}]", "a count out of range")
        slot = torch.arange(width, device=kv_indices.device)
        valid = slot.view(1, 1, 1, -1) < counts.unsqueeze(-1)
        idx = kv_indices.to(torch.long)
        if bool(((idx < 0) | (idx >= n_kv))[valid].any()):
            raise MaskError("kv_indices", f"block indices in [0, {n_kv})", "an index out of range")
        blocks = torch.zeros(b, h, n_q, n_kv + 1, dtype=torch.bool, device=kv_indices.device)
        # Inactive slots scatter into a spare column that is dropped afterwards.
        blocks.scatter_(3, torch.where(valid, idx, n_kv), True)
        return cls(blocks[..., :n_kv].contiguous(), block_q, block_kv, seq_len_q, seq_len_kv)

    @classmethod
    def from_csr(
        cls,
        row_offsets: torch.Tensor,
        col_indices: torch.Tensor,
        *,
        batch: int,
        heads: int,
        block_q: int,
        block_kv: int,
        seq_len_q: int,
        seq_len_kv: int,
    ) -> LogicalMask:
        """From block-CSR over the flattened rows ``(b, h, q_block)``.

        Args:
            row_offsets: ``[batch * heads * nQ + 1]`` int, non-decreasing, starting at 0.
            col_indices: ``[row_offsets[-1]]`` int, KV block indices of each row.
        """
        n_q = math.ceil(check_seq_len("seq_len_q", seq_len_q) / check_block_size("block_q", block_q))
        n_kv = math.ceil(check_seq_len("seq_len_kv", seq_len_kv) / check_block_size("block_kv", block_kv))
        check_positive_int("batch", batch)
        check_positive_int("heads", heads)
        check_index_tensor("row_offsets", row_offsets, "[batch * heads * nQ + 1]")
        check_index_tensor("col_indices", col_indices, "[row_offsets[-1]]")
        check_same_device("row_offsets/col_indices", row_offsets, col_indices)
        rows = batch * heads * n_q
        if row_offsets.dim() != 1 or row_offsets.numel() != rows + 1:
            raise MaskError("row_offsets", f"1-D with batch*heads*nQ+1 = {rows + 1} entries", describe_tensor(row_offsets))
        offsets = row_offsets.to(torch.long)
        counts = offsets[1:] - offsets[:-1]
        if bool((counts < 0).any()) or int(offsets[0]) != 0:
            raise MaskError("row_offsets", "non-decreasing and starting at 0", "a decreasing or shifted sequence")
        nnz = int(offsets[-1])
        if col_indices.dim() != 1 or col_indices.numel() != nnz:
            raise MaskError("col_indices", f"1-D with row_offsets[-1] = {nnz} entries", describe_tensor(col_indices))
        cols = col_indices.to(torch.long)
        if nnz and bool(((cols < 0) | (cols >= n_kv)).any()):
            raise MaskError("col_indices", f"block indices in [0, {n_kv})", "an index out of range")
        row_of = torch.repeat_interleave(torch.arange(rows, device=cols.device), counts.to(cols.device))
        flat = torch.zeros(rows * n_kv, dtype=torch.bool, device=cols.device)
        flat[row_of * n_kv + cols] = True
        return cls(flat.view(batch, heads, n_q, n_kv), block_q, block_kv, seq_len_q, seq_len_kv)

    # ------------------------------------------------------------------ geometry
    @property
    def num_blocks_q(self) -> int:
        return math.ceil(self.seq_len_q / self.block_q)

    @property
    def num_blocks_kv(self) -> int:
        return math.ceil(self.seq_len_kv / self.block_kv)

    @property
    def batch(self) -> int:
        """Batch dimension of the block tensor (1 means broadcast)."""
        return self.blocks.shape[0]

    @property
    def heads(self) -> int:
        """Head dimension of the block tensor (1 means broadcast)."""
        return self.blocks.shape[1]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def geometry_name(self) -> str:
        return f"Q{self.block_q}K{self.block_kv}"

    def block_sizes_q(self) -> torch.Tensor:
        """Tokens per query block (the last one may be partial). ``[nQ]`` int64."""
        return block_sizes(self.seq_len_q, self.block_q, self.device)

    def block_sizes_kv(self) -> torch.Tensor:
        """Tokens per key block (the last one may be partial). ``[nKV]`` int64."""
        return block_sizes(self.seq_len_kv, self.block_kv, self.device)

    # ------------------------------------------------------------------ statistics
    def density(self) -> float:
        """Fraction of active blocks (host sync)."""
        return float(self.blocks.float().mean())

    def num_active_blocks(self) -> int:
        return int(self.blocks.sum())

    def interactions(self) -> torch.Tensor:
        """``|E(M)|`` per mask ``(b, h)``: active query-key token pairs, partial blocks counted
        exactly. ``[B|1, H|1]`` int64."""
        rows = self.block_sizes_q().to(torch.float64)
        cols = self.block_sizes_kv().to(torch.float64)
        per_row = self.blocks.to(torch.float64) @ cols  # [B, H, nQ]
        return (per_row @ rows).round().to(torch.int64)

    def effective_flops(self, batch: int, heads: int, head_dim: int) -> float:
        """``4 * D * |E(M)|`` summed over every (b, h) the mask broadcasts to."""
        per = self.interactions().to(torch.float64)
        scale = (batch // self.batch) * (heads // self.heads)
        return float(4.0 * head_dim * per.sum() * scale)

    # ------------------------------------------------------------------ views
    def expand(self, batch: int, heads: int) -> LogicalMask:
        """The same mask with explicit batch and head dims (no copy)."""
        self.check_broadcast(batch, heads)
        blocks = self.blocks.expand(batch, heads, -1, -1)
        return LogicalMask(blocks, self.block_q, self.block_kv, self.seq_len_q, self.seq_len_kv)

    def select_heads(self, start: int, stop: int) -> LogicalMask:
        """Heads ``[start, stop)`` (a broadcast head dim stays broadcast), e.g. one rank's heads."""
        if self.heads == 1:
            return self
        if not 0 <= start < stop <= self.heads:
            raise MaskError("heads", f"a range inside [0, {self.heads})", f"[{start}, {stop})")
        blocks = self.blocks[:, start:stop]
        return LogicalMask(blocks, self.block_q, self.block_kv, self.seq_len_q, self.seq_len_kv)

    def to(self, device: torch.device | str) -> LogicalMask:
        return LogicalMask(self.blocks.to(device), self.block_q, self.block_kv, self.seq_len_q, self.seq_len_kv)

    def check_broadcast(self, batch: int, heads: int) -> None:
        """Raise unless this mask broadcasts to ``batch`` x ``heads``."""
        if self.batch not in (1, batch):
            raise MaskError("mask batch dim", f"1 or {batch} (the batch of q)", self.batch)
        if self.heads not in (1, heads):
            raise MaskError("mask head dim", f"1 or {heads} (the heads of q)", self.heads)

    def to_dense(self, b: int = 0, h: int = 0) -> torch.Tensor:
        """Token-level ``[Sq, Skv]`` bool mask of one (b, h) — a debugging tool for small sizes."""
        if self.seq_len_q * self.seq_len_kv > MAX_DENSE_ELEMENTS:
            raise MaskError(
                "to_dense", f"at most {MAX_DENSE_ELEMENTS} token pairs", f"{self.seq_len_q}x{self.seq_len_kv}",
                hint="use blocks or interactions() at this size",
            )
        grid = self.blocks[b if self.batch > 1 else 0, h if self.heads > 1 else 0]
        dense = grid.repeat_interleave(self.block_q, 0).repeat_interleave(self.block_kv, 1)
        return dense[: self.seq_len_q, : self.seq_len_kv]

    def to_string(self, b: int = 0, h: int = 0, max_cells: int = 64) -> str:
        """ASCII picture of one (b, h): ``#`` all active, ``+`` some active, ``.`` none, with
        blocks pooled so the picture is at most ``max_cells`` wide and tall."""
        grid = self.blocks[b if self.batch > 1 else 0, h if self.heads > 1 else 0].float()
        n_q, n_kv = grid.shape
        fq, fk = max(1, math.ceil(n_q / max_cells)), max(1, math.ceil(n_kv / max_cells))
        pooled = torch.nn.functional.avg_pool2d(grid[None, None].cpu(), (fq, fk), ceil_mode=True)[0, 0]
        chars = [["#" if x >= 1.0 else "+" if x > 0 else "." for x in row.tolist()] for row in pooled]
        header = f"(b={b}, h={h}) {n_q}x{n_kv} blocks" + (f", 1 char = {fq}x{fk} blocks" if fq * fk > 1 else "")
        return "\n".join([header] + ["".join(r) for r in chars])

    def __repr__(self) -> str:
        summary = (
            f"LogicalMask({self.geometry_name}, seq=({self.seq_len_q}, {self.seq_len_kv}), "
            f"blocks=[{self.batch}, {self.heads}, {self.num_blocks_q}, {self.num_blocks_kv}], "
            f"device={self.device}"
        )
        if self.blocks.numel() <= 1 << 22:
            summary += f", density={self.density():.3f})"
            return summary + "\n" + self.to_string(max_cells=32)
        return summary + ")"


def block_sizes(seq_len: int, block: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Token count of each block along one axis; the last block may be partial. ``[ceil(S/B)]``."""
    n = math.ceil(seq_len / block)
    sizes = torch.full((n,), block, dtype=torch.int64, device=device)
    sizes[-1] = seq_len - (n - 1) * block
    return sizes
