"""The oracle: exact block-masked attention in fp32, chunked so that long sequences fit in memory.

Row i of the output is ``softmax(q_i K^T * scale restricted to E(M)) V``. A query row with no
active key gives output 0 and log-sum-exp -inf, never NaN. Every plan and kernel is checked
against this function.

Non-finite scores follow dense attention row by row: an active score of -inf weighs 0 (a row whose
active scores are all -inf is an empty row: 0 and -inf); a +inf active score makes the softmax
inf/inf, so the row is NaN and its log-sum-exp +inf; a NaN active score (NaN in q or in an active
key) gives NaN and NaN.

The oracle is for problems that fit in host memory: a request whose working set would pass
``MAX_REFERENCE_BYTES`` is refused before anything is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from .errors import InvalidArgumentError
from .mask import LogicalMask

# Scores computed per chunk are bounded to about this many fp32 elements (64 MiB).
CHUNK_SCORE_ELEMENTS = 1 << 24
# Requests whose working set (outputs + one chunk's score-sized temporaries) passes this are refused.
MAX_REFERENCE_BYTES = 16 << 30
# Score-sized tensors live at once at a chunk's peak: four fp32 (scores, masked scores, shifted
# scores, probabilities) and two bool (the token mask and its negation).
CHUNK_BYTES_PER_SCORE = 4 * 4 + 2 * 1
GIB = float(1 << 30)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LogicalMask,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    out_dtype: torch.dtype | None = None,
    p_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact masked attention.

    Args:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Skv, H, D]`` (any float dtype; math in fp32).
        mask: logical mask covering ``(Sq, Skv)``, broadcast over batch/heads.
        scale: softmax scale, ``1/sqrt(D)`` by default.
        return_lse: also return the log-sum-exp of each row (natural log, fp32).
        out_dtype: dtype of the output (``q.dtype`` by default).
        p_dtype: if given, probabilities are rounded to this dtype before the PV product and the
            output to ``out_dtype`` — the precision of a tensor-core kernel, used by the tests as the
            "same-precision PyTorch run".

    Returns:
        out ``[B, Sq, H, D]`` and, with ``return_lse``, lse ``[B, H, Sq]`` fp32.
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_kv = k.shape[1]
    check_working_set(reference_bytes(q, k, mask, out_dtype, p_dtype), q, k)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = torch.zeros(batch, seq_q, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seq_q), -math.inf, dtype=torch.float32, device=q.device)

    for b, h, r0, r1, token_ids, token_mask in row_chunks(mask, batch, heads, seq_kv):
        qh = q[b, r0:r1, h].to(torch.float32)
        kh = k[b, token_ids, h].to(torch.float32)
        scores = (qh @ kh.T) * scale
        scores = scores.masked_fill(~token_mask, -math.inf)
        row_max = scores.amax(-1, keepdim=True)  # NaN if any active score is NaN
        has_key = torch.isfinite(row_max)
        p = torch.exp(scores - torch.where(has_key, row_max, torch.zeros_like(row_max)))
        denom = p.sum(-1, keepdim=True)
        if p_dtype is not None:
            p = p.to(p_dtype).to(torch.float32)
        o = (p @ v[b, token_ids, h].to(torch.float32)) / torch.where(has_key, denom, torch.ones_like(denom))
        # Max -inf: no active key, 0. Max +inf or NaN: the softmax is undefined, NaN.
        empty = row_max == -math.inf
        settled = torch.where(empty, torch.zeros_like(o), torch.full_like(o, math.nan))
        out[b, r0:r1, h] = torch.where(has_key, o, settled)
        lse[b, h, r0:r1] = torch.where(has_key, row_max + torch.log(denom), row_max).squeeze(-1)
    out = out.to(out_dtype or q.dtype)
    return (out, lse) if return_lse else out


def reference_bytes(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: LogicalMask,
    out_dtype: torch.dtype | None = None,
    p_dtype: torch.dtype | None = None,
) -> int:
    """Peak bytes ``attention`` allocates for this request: the fp32 output and lse, the output
    cast, one head's fp32 q/k/v and gathered k/v, and one query chunk's score-sized temporaries."""
    batch, seq_q, heads, head_dim = (int(d) for d in q.shape)
    seq_kv = int(k.shape[1])
    out_elements = batch * seq_q * heads * head_dim
    out_bytes = out_elements * 4 + batch * heads * seq_q * 4
    out_dtype = out_dtype or q.dtype
    if out_dtype != torch.float32:
        out_bytes += out_elements * out_dtype.itemsize
    head_bytes = (seq_q + 4 * seq_kv) * head_dim * 4 + seq_kv * 8  # q, k, v, k/v gathered; token ids
    rows_per_chunk = max(1, CHUNK_SCORE_ELEMENTS // max(1, seq_kv) // mask.block_q)
    chunk_scores = min(rows_per_chunk * mask.block_q, seq_q) * seq_kv
    per_score = CHUNK_BYTES_PER_SCORE
    if p_dtype is not None:
        per_score += p_dtype.itemsize + 4
    return out_bytes + head_bytes + chunk_scores * per_score


def check_working_set(need: int, q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse a request whose reference working set passes ``MAX_REFERENCE_BYTES``."""
    if need <= MAX_REFERENCE_BYTES:
        return
    raise InvalidArgumentError(
        "q, k",
        f"a request whose fp32 reference needs at most {MAX_REFERENCE_BYTES / GIB:.1f} GiB (MAX_REFERENCE_BYTES)",
        f"{need / GIB:,.1f} GiB for q {tuple(q.shape)}, k {tuple(k.shape)}",
        hint="the reference path is an fp32 oracle for small problems; use a native plan on CUDA",
    )


def row_chunks(mask: LogicalMask, batch: int, heads: int,
               seq_kv: int) -> Iterator[tuple[int, int, int, int, torch.Tensor, torch.Tensor]]:
    """The oracle's walk over a request: per (b, h), chunks of query blocks whose scores against
    ``seq_kv`` keys fit ``CHUNK_SCORE_ELEMENTS``, as ``(b, h, r0, r1, tokens, token_mask)``: query
    rows ``r0:r1``, the keys any of them needs (``[T]`` int64, partial last block respected) and
    which of those each row sees (``[r1 - r0, T]`` bool). Chunks that see no key are skipped."""
    bq, bkv = mask.block_q, mask.block_kv
    kv_sizes = mask.block_sizes_kv()
    rows_per_chunk = max(1, CHUNK_SCORE_ELEMENTS // max(1, seq_kv) // bq)
    for b in range(batch):
        for h in range(heads):
            grid = mask.blocks[b if mask.batch > 1 else 0, h if mask.heads > 1 else 0]  # [nQ, nKV]
            for i0 in range(0, mask.num_blocks_q, rows_per_chunk):
                i1 = min(i0 + rows_per_chunk, mask.num_blocks_q)
                r0, r1 = i0 * bq, min(i1 * bq, mask.seq_len_q)
                active = grid[i0:i1]  # [c, nKV]
                cols = torch.nonzero(active.any(0)).flatten()  # KV blocks any row of the chunk needs
                if cols.numel() == 0:
                    continue
                token_mask = active[:, cols].repeat_interleave(bq, 0)[: r1 - r0]
                yield b, h, r0, r1, block_token_ids(cols, bkv, kv_sizes), token_mask.repeat_interleave(kv_sizes[cols], 1)


def block_token_ids(cols: torch.Tensor, block: int, sizes: torch.Tensor) -> torch.Tensor:
    """Token indices of the blocks ``cols`` along one axis (partial last block respected)."""
    lengths = sizes[cols]
    starts = cols * block
    offsets = torch.arange(int(lengths.sum()), device=cols.device)
    first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.repeat_interleave(starts, lengths) + offsets - first


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Plain dense attention in fp32 for ``(B, S, H, D)`` tensors (small sizes; tests)."""
    batch, seq_q, heads, head_dim = (int(d) for d in q.shape)
    seq_kv = int(k.shape[1])
    scores = batch * heads * seq_q * seq_kv  # the dense scores and their softmax, fp32
    check_working_set(2 * scores * 4 + (2 * seq_q + 2 * seq_kv) * batch * heads * head_dim * 4, q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())
