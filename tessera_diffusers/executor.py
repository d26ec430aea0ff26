"""The plan executor in PyTorch: runs any PreparedPlan tile by tile from its metadata only.

It is the CPU twin of the CUDA kernels: the same tiles, the same membership masking, the same
online softmax and the same split-K partial states and merge. Query tiles are processed together
(vectorized), KV tile positions one after another. In the grouped query layout a tile's rows are
gathered from their tokens first and its outputs scattered back, as the kernels do.

Non-finite values follow the oracle (``reference.attention``) exactly, row by row: a row whose
active scores are all -inf (or that has no active key) gives 0 and lse -inf; a row with a +inf
active score gives NaN and lse +inf (the softmax is inf/inf, as in dense attention); a NaN active
score (a NaN in q or in an active key) gives NaN and lse NaN. Columns past ``Skv`` read zeros, as
the kernels' zero-filled loads do.
"""

from __future__ import annotations

import math

import torch

from .prepared import PreparedPlan, query_rows

NEG_INF = -math.inf


def run_prepared(
    prepared: PreparedPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Execute ``prepared`` on ``q [B, Sq, H, D]``, ``k, v [B, Skv, H, D]``.

    Returns out ``[B, Sq, H, D]`` in ``q.dtype`` (and lse ``[B, H, Sq]`` fp32)."""
    batch, seq_q, heads, head_dim = q.shape
    ns = prepared.plan.tasks.num_splits
    o_parts = torch.zeros(ns, batch, heads, seq_q, head_dim, dtype=torch.float32, device=q.device)
    lse_parts = torch.full((ns, batch, heads, seq_q), NEG_INF, dtype=torch.float32, device=q.device)
    mask = prepared.mask
    grouped = prepared.q_units is not None
    if grouped:  # token row of each tile row, -1 for none (the kernels' query_row)
        rows = query_rows(prepared.q_units, prepared.plan.q_unit, seq_q)  # [Bm, Hm, nQT * tile_q]
    for b in range(batch):
        for h in range(heads):
            mb, mh = (b if mask.batch > 1 else 0), (h if mask.heads > 1 else 0)
            qh = q[b, :, h]
            if grouped:
                valid = rows[mb, mh] >= 0
                token = rows[mb, mh][valid]
                qh = q.new_zeros(rows.shape[-1], head_dim)
                qh[valid] = q[b, token, h]
            for split in range(ns):
                o, lse = run_head(prepared, qh, k[b, :, h], v[b, :, h], scale, mb, mh, split)
                if grouped:  # tile rows back to their tokens
                    o, lse = o[valid], lse[valid]
                    o_parts[split, b, h, token] = o
                    lse_parts[split, b, h, token] = lse
                else:
                    o_parts[split, b, h] = o
                    lse_parts[split, b, h] = lse
    out, lse = merge_splits(o_parts, lse_parts)  # [B, H, Sq, D], [B, H, Sq]
    out = out.transpose(1, 2).to(q.dtype)
    return (out, lse) if return_lse else out


def run_head(
    prepared: PreparedPlan,
    q: torch.Tensor,  # [Sq, D]
    k: torch.Tensor,  # [Skv, D]
    v: torch.Tensor,  # [Skv, D]
    scale: float,
    mb: int,
    mh: int,
    split: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (b, h, split) over all query tiles: normalized partial output ``[Sq, D]`` fp32 and its
    log-sum-exp ``[Sq]`` fp32 (0 and -inf where the split saw no key)."""
    plan = prepared.plan
    tq, tk, q_unit, kv_unit = plan.tile_q, plan.tile_kv, plan.q_unit, plan.kv_unit
    n_slots = plan.slots_per_tile
    seq_q, head_dim = q.shape
    seq_kv = k.shape[0]
    n_qt = prepared.num_q_tiles
    device = q.device

    q_pad = torch.zeros(n_qt * tq, head_dim, dtype=torch.float32, device=device)
    q_pad[:seq_q] = q.float()
    q_tiles = q_pad.view(n_qt, tq, head_dim)
    # Row seq_kv is a zero row: slot columns past the sequence read it (the kernels zero-fill them).
    zero_row = torch.zeros(1, head_dim, dtype=torch.float32, device=device)
    kf, vf = torch.cat([k.float(), zero_row]), torch.cat([v.float(), zero_row])  # [Skv + 1, D]

    counts = prepared.tile_counts[mb, mh].to(torch.int64)  # [nQT]
    per = (counts + plan.tasks.num_splits - 1) // plan.tasks.num_splits
    begin = torch.clamp(split * per, max=counts)
    end = torch.clamp(begin + per, max=counts)

    m = torch.full((n_qt, tq), NEG_INF, dtype=torch.float32, device=device)
    l = torch.zeros(n_qt, tq, dtype=torch.float32, device=device)
    acc = torch.zeros(n_qt, tq, head_dim, dtype=torch.float32, device=device)
    row_unit = torch.arange(tq, device=device) // q_unit  # [tq]
    col_slot = torch.arange(tk, device=device) // kv_unit  # [tk]
    bit = (row_unit.view(tq, 1) * n_slots + col_slot.view(1, tk)).to(torch.int64)  # [tq, tk]
    col_offset = torch.arange(tk, device=device) % kv_unit

    for pos in range(prepared.capacity):
        live = (begin <= pos) & (pos < end)  # [nQT]
        if not bool(live.any()):
            continue
        slot_start = prepared.tile_slots[mb, mh, :, pos].to(torch.int64)  # [nQT, S]
        tokens = slot_start[:, col_slot] + col_offset  # [nQT, tk]
        col_ok = (slot_start[:, col_slot] >= 0) & (tokens < seq_kv)
        tokens = torch.where(col_ok, tokens, torch.full_like(tokens, seq_kv))
        member = prepared.tile_member[mb, mh, :, pos]  # [nQT] int64
        allowed = ((member.view(-1, 1, 1) >> bit) & 1).bool() & col_ok.unsqueeze(1) & live.view(-1, 1, 1)

        scores = torch.einsum("tqd,tkd->tqk", q_tiles, kf[tokens]) * scale
        scores = scores.masked_fill(~allowed, NEG_INF)
        # NaN propagates through the running max; rows whose max is not finite are settled below.
        m_new = torch.maximum(m, scores.amax(-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(scores - safe.unsqueeze(-1))
        alpha = torch.exp(m - safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("tqk,tkd->tqd", p, vf[tokens])
        m = m_new

    # A finite max means an ordinary row (then l >= 1: its max term is exp(0)).
    has_key = torch.isfinite(m)
    out = torch.where(has_key.unsqueeze(-1), acc / l.clamp_min(1e-30).unsqueeze(-1), non_finite_rows(m, acc))
    lse = torch.where(has_key, m + torch.log(l.clamp_min(1e-30)), m)
    return out.reshape(n_qt * tq, head_dim)[:seq_q], lse.reshape(-1)[:seq_q]


def non_finite_rows(row_max: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Output of rows whose max score is not finite, shaped ``like`` (``row_max`` + a D axis):
    0 where the max is -inf (no active key), NaN where it is +inf or NaN (softmax undefined)."""
    empty = (row_max == NEG_INF).unsqueeze(-1)
    return torch.where(empty, torch.zeros_like(like), torch.full_like(like, math.nan))


def merge_splits(o_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split-K partial states. ``o_parts [ns, ..., D]`` normalized partial outputs,
    ``lse_parts [ns, ...]``; returns ``out [..., D]`` and ``lse [...]`` (0 / -inf for empty rows;
    NaN / +inf where a part saw a +inf score, NaN / NaN where one saw a NaN score)."""
    lse_max = lse_parts.amax(0)  # NaN if any part is NaN
    finite = torch.isfinite(lse_max)
    safe = torch.where(finite, lse_max, torch.zeros_like(lse_max))
    w = torch.exp(lse_parts - safe)  # [ns, ...]; exp(-inf) = 0 for empty parts
    total = w.sum(0)
    out = (w.unsqueeze(-1) * o_parts).sum(0) / torch.where(finite, total, torch.ones_like(total)).unsqueeze(-1)
    lse = torch.where(finite, safe + torch.log(torch.where(finite, total, torch.ones_like(total))), lse_max)
    return torch.where(finite.unsqueeze(-1), out, non_finite_rows(lse_max, out)), lse
