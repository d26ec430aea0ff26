"""Budgeted block selection: how every source hits its density exactly.

A source scores every ``(query block, key block)`` pair of one head (higher = more wanted), marks
pairs that are always on (text rows and columns, sinks, a fixed window) and rows that are off (empty
rows). Selection then takes exactly ``budget`` blocks:

- ``"row"`` mode gives every row the same quota (water-filled above the row's forced blocks), like
  a top-k-per-query sparsifier or a clamped sliding window;
- ``"global"`` mode takes the best ``budget`` pairs of the whole head, so rows differ, like a
  threshold or top-p sparsifier.

Scores are rounded to a fixed grid and ties broken by a stable sort (then by index), so the choice
is a deterministic function of the scores on any device.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError

# Scores are rounded to multiples of 2^-32: far above float64 rounding noise, far below any real gap.
SCORE_QUANTUM = 2.0**-32
MODES = ("row", "global")


def quantize(score: torch.Tensor) -> torch.Tensor:
    """Round float64 scores to the ``SCORE_QUANTUM`` grid (keeps +-inf)."""
    return torch.round(score / SCORE_QUANTUM) * SCORE_QUANTUM


def hash_jitter(n_q: int, n_kv: int, salt: int, device: torch.device | str) -> torch.Tensor:
    """Deterministic pseudo-random values in ``[0, 1)`` per pair from integer hashing (identical on
    every device). ``[nQ, nKV]`` float64."""
    mask31 = (1 << 31) - 1
    i = torch.arange(n_q, device=device, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(n_kv, device=device, dtype=torch.int64).unsqueeze(0)
    h = (i * 0x9E3779B1 + j * 0x85EBCA77 + (salt & mask31)) & mask31
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & mask31
    h = ((h ^ (h >> 12)) * 0x297A2D39) & mask31
    h = h ^ (h >> 15)
    return (h & 0xFFFFF).to(torch.float64) / float(1 << 20)


def row_quotas(budget: int, floors: torch.Tensor, caps: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
    """Per-row block counts summing to ``budget`` (or to ``floors.sum()`` if that is larger):
    ``clamp(level, floor, cap)`` for the highest integer level that fits, then one more block for
    the first rows in ``priority`` order that can still grow.

    Args:
        floors, caps: ``[nQ]`` int64 (forced blocks of each row; most blocks it may get).
        priority: ``[nQ]`` int64, a permutation of rows (who gets the remainder first).
    """
    floors = torch.minimum(floors, caps)

    def filled(level: int) -> int:
        return int(torch.clamp(torch.full_like(floors, level), floors, caps).sum())

    lo, hi = 0, int(caps.max()) if caps.numel() else 0
    if filled(lo) >= budget:
        return floors.clone()
    while lo < hi:  # largest level with filled(level) <= budget
        mid = (lo + hi + 1) // 2
        if filled(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    quotas = torch.clamp(torch.full_like(floors, lo), floors, caps)
    remainder = budget - int(quotas.sum())
    if remainder > 0:
        can_grow = (floors <= lo) & (quotas < caps)
        grow_rows = priority[can_grow[priority]][:remainder]
        quotas[grow_rows] += 1
    return quotas


def select_blocks(
    score: torch.Tensor,
    budget: int,
    mode: str,
    *,
    forced: torch.Tensor | None = None,
    empty_rows: torch.Tensor | None = None,
    priority: torch.Tensor | None = None,
    row_min: int = 0,
) -> torch.Tensor:
    """Choose exactly ``budget`` blocks of one head (more only if the forced blocks need more).

    Args:
        score: ``[nQ, nKV]`` float64, higher is better.
        budget: number of active blocks wanted.
        mode: ``"row"`` (equal quotas per row) or ``"global"`` (best pairs of the head).
        forced: ``[nQ, nKV]`` bool, blocks that are always active (unless their row is empty).
        empty_rows: ``[nQ]`` bool, rows with no active block at all.
        priority: ``[nQ]`` int64 row permutation for the row-mode remainder (index order if None).
        row_min: global mode only: the best ``row_min`` blocks of every non-empty row are kept first
            (a top-p sparsifier keeps at least a few key blocks per query block).

    Returns:
        ``[nQ, nKV]`` bool.
    """
    if mode not in MODES:
        raise InvalidArgumentError("mode", f"one of {MODES}", repr(mode))
    n_q, n_kv = score.shape
    device = score.device
    forced = torch.zeros(n_q, n_kv, dtype=torch.bool, device=device) if forced is None else forced
    empty_rows = torch.zeros(n_q, dtype=torch.bool, device=device) if empty_rows is None else empty_rows
    forced = forced & ~empty_rows.unsqueeze(1)
    s = quantize(score.to(torch.float64))
    s = torch.where(forced, torch.full_like(s, torch.inf), s)
    s = torch.where(empty_rows.unsqueeze(1), torch.full_like(s, -torch.inf), s)

    if mode == "global" and row_min > 0:
        best = torch.sort(s, dim=1, descending=True, stable=True).indices[:, : min(row_min, n_kv)]
        keep = torch.zeros_like(forced).scatter_(1, best, True) & ~empty_rows.unsqueeze(1)
        s = torch.where(keep, torch.full_like(s, torch.inf), s)
        forced = forced | keep
    if mode == "global":
        allowed = int((~empty_rows).sum()) * n_kv
        take = min(max(budget, int(forced.sum())), allowed)
        order = torch.sort(s.flatten(), descending=True, stable=True).indices[:take]
        chosen = torch.zeros(n_q * n_kv, dtype=torch.bool, device=device)
        chosen[order] = True
        return chosen.view(n_q, n_kv)

    floors = forced.sum(1, dtype=torch.int64)
    caps = torch.where(empty_rows, torch.zeros_like(floors), torch.full_like(floors, n_kv))
    if priority is None:
        priority = torch.arange(n_q, device=device)
    quotas = row_quotas(budget, floors, caps, priority.to(device))
    order = torch.sort(s, dim=1, descending=True, stable=True).indices  # [nQ, nKV]
    take_sorted = torch.arange(n_kv, device=device).unsqueeze(0) < quotas.unsqueeze(1)
    return torch.zeros(n_q, n_kv, dtype=torch.bool, device=device).scatter_(1, order, take_sorted)


def head_budgets(targets: torch.Tensor, floors: torch.Tensor, area: int) -> list[int]:
    """Integer block budgets per head from target densities, raised to each head's forced floor
    and with the raise taken back from the other heads so the total stays on target.

    Args:
        targets: ``[H]`` float64 target densities.
        floors: ``[H]`` int64 forced blocks of each head.
        area: blocks per head (``nQ * nKV``).
    """
    wanted = targets.to(torch.float64) * area
    total = float(wanted.sum())
    floors_f = floors.to(torch.float64)
    budget = torch.maximum(wanted, floors_f)
    for _ in range(8):  # converges in a couple of rounds; bounded for safety
        excess = float(budget.sum()) - total
        free = budget > floors_f
        if excess <= 0.5 or not bool(free.any()):
            break
        room = (budget - floors_f)[free]
        budget[free] -= room * min(1.0, excess / float(room.sum()))
    return [round(b) for b in budget.tolist()]
