"""The oracle: exact block-masked attention in fp32, chunked so that long sequences fit in memory.

Row i of the output is ``softmax(q_i K^T * scale restricted to E(M)) V``. A query row with no
active key gives output 0 and log-sum-exp -inf, never NaN. Every plan and kernel is checked
against this function.
"""

from __future__ import annotations

import math

import torch

from .mask import LogicalMask

# Scores computed per chunk are bounded to about this many fp32 elements (64 MiB).
CHUNK_SCORE_ELEMENTS = 1 << 24


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
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = torch.zeros(batch, seq_q, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seq_q), -math.inf, dtype=torch.float32, device=q.device)

    bq, bkv = mask.block_q, mask.block_kv
    kv_sizes = mask.block_sizes_kv()
    rows_per_chunk = max(1, CHUNK_SCORE_ELEMENTS // max(1, seq_kv) // bq)
    for b in range(batch):
        for h in range(heads):
            grid = mask.blocks[b if mask.batch > 1 else 0, h if mask.heads > 1 else 0]  # [nQ, nKV]
            qh = q[b, :, h].to(torch.float32)
            kh = k[b, :, h].to(torch.float32)
            vh = v[b, :, h].to(torch.float32)
            for i0 in range(0, mask.num_blocks_q, rows_per_chunk):
                i1 = min(i0 + rows_per_chunk, mask.num_blocks_q)
                r0, r1 = i0 * bq, min(i1 * bq, seq_q)
                active = grid[i0:i1]  # [c, nKV]
                cols = torch.nonzero(active.any(0)).flatten()  # KV blocks any row of the chunk needs
                if cols.numel() == 0:
                    continue
                token_ids = block_token_ids(cols, bkv, kv_sizes)
                token_mask = active[:, cols].repeat_interleave(bq, 0)[: r1 - r0]
                token_mask = token_mask.repeat_interleave(kv_sizes[cols], 1)  # [rows, tokens]
                scores = (qh[r0:r1] @ kh[token_ids].T) * scale
                scores = scores.masked_fill(~token_mask, -math.inf)
                row_max = scores.amax(-1, keepdim=True)
                has_key = torch.isfinite(row_max)
                p = torch.exp(scores - torch.where(has_key, row_max, torch.zeros_like(row_max)))
                denom = p.sum(-1, keepdim=True)
                if p_dtype is not None:
                    p = p.to(p_dtype).to(torch.float32)
                o = (p @ vh[token_ids]) / torch.where(has_key, denom, torch.ones_like(denom))
                out[b, r0:r1, h] = o
                lse[b, h, r0:r1] = torch.where(has_key, row_max + torch.log(denom), row_max).squeeze(-1)
    out = out.to(out_dtype or q.dtype)
    return (out, lse) if return_lse else out


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
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())
