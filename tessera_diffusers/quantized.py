"""8-bit attention: the quantization 8-bit Hopper kernels are to apply, and their CPU twin.

Hopper's 8-bit tensor cores (INT8 and FP8) run at twice the bf16 rate. Per ``(batch, head)``:

- ``Q K^T`` in INT8, Q with a scale per token and K with one per chunk of ``K_CHUNK`` tokens (from
  token 0; ``k_scale`` holds it for each of the chunk's tokens): a score is ``(q8_i . k8_j) *
  q_scale_i * k_scale_j * scale``; the integer product is exact (``D * 127^2 < 2^24``) and the
  scales are a row and a column factor of the score tile, independent of the physical plan (every
  slot of an 8-bit plan is whole chunks, so a kernel takes one K factor per chunk, not per key).
  K loses its mean over tokens first (``k_mean``): a channel offset shared by every key shifts a
  row's scores by a constant, which the softmax ignores, but it would set every chunk's scale and
  crush its other channels. The log-sum-exp gets the shift back (``lse_shift``).
- ``P V`` in INT8 (``pv="int8"``): the probabilities of a row within one KV tile of
  ``kv_tile`` keys are unsigned 8-bit numbers of the tile's own maximum,
  ``p8 = round(255 * p / max_tile p)``; V is signed 8-bit with a scale per channel, after losing its
  mean over tokens (added back after normalising, since each row's weights sum to 1). The product of
  one tile is an exact int32 sum; it is scaled by ``max_tile p / 255`` into the fp32 output. In a
  kernel, ``max_tile p = exp(m_tile - m_running)`` comes from the online softmax's own tile maximum,
  so the rounding of P does not depend on the order the tiles run in.
- ``pv="fp8"``, for comparison: P times 448 and V per channel in FP8 e4m3 (3 mantissa bits).
- ``pv="bf16"``, what ``precision="int8"`` runs (``kernel_table.DEFAULT_PV``, the default here): P
  and V in bf16 (INT8 Q K^T only; a P V product the tensor cores accumulate in fp32 at the 16-bit
  rate; a kernel keeps V in the inputs' 16-bit type). Its kernels measured as fast as INT8 P V's
  with about half the error (``docs/results.md``).

The row sums add up the rounded probabilities for int8 (the weights the product applies: they sum
to 1, so V's mean comes back exactly), the probabilities before rounding for fp8 and bf16. Measured on
random inputs (``docs/results.md``), INT8 P V errs a little under half as much as FP8 P V, bf16 P V
about a quarter. ``attention`` is the twin: the same arithmetic with the softmax in one pass, its
KV tiles ``kv_tile`` consecutive keys of the key blocks a chunk of query blocks needs (a kernel's
are its plan's KV tiles). Empty rows give 0 and -inf as in ``reference.attention``. Inputs must be
finite (a +inf or NaN in K or V would reach every row through the means and the channel scales).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError
from .kernel_table import DEFAULT_PV
from .mask import LogicalMask
from .reference import row_chunks
from .validation import check_inputs

INT8_MAX = 127.0
K_CHUNK = 16  # tokens sharing a K scale (TESSERA_QUANTIZED_K_CHUNK; a kernel slot is whole chunks)
UINT8_MAX = 255.0
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
PV_FORMATS = ("int8", "fp8", "bf16")

# What an 8-bit result should meet against the fp32 oracle, over a whole request.
MIN_COSINE = 0.999
MAX_RELATIVE_L2 = 0.03


@dataclass(frozen=True)
class QuantizedInputs:
    """q, k, v of one request as the 8-bit kernels read them."""

    q: torch.Tensor  # [B, Sq, H, D] int8
    q_scale: torch.Tensor  # [B, Sq, H] fp32
    k: torch.Tensor  # [B, Skv, H, D] int8, of k - k_mean
    k_scale: torch.Tensor  # [B, Skv, H] fp32, one value per chunk of K_CHUNK tokens
    k_mean: torch.Tensor  # [B, H, D] fp32 (zeros without smoothing)
    v: torch.Tensor  # [B, Skv, H, D] int8 of v - v_mean, float8_e4m3fn of v, or bf16 v
    v_scale: torch.Tensor  # [B, H, D] fp32
    v_mean: torch.Tensor  # [B, H, D] fp32 (zeros for fp8 and bf16)
    lse_shift: torch.Tensor  # [B, H, Sq] fp32: scale * q_i . k_mean, added back to the log-sum-exp
    scale: float

    @property
    def pv(self) -> str:
        return {torch.int8: "int8", torch.bfloat16: "bf16"}.get(self.v.dtype, "fp8")


def per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [B, S, H, D] fp32 as int8 with a scale per (b, s, h) [B, S, H]; a zero token keeps scale 1."""
    return per_chunk_int8(x, 1)


def per_chunk_int8(x: torch.Tensor, chunk: int = K_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [B, S, H, D] fp32 as int8 with one scale per ``chunk`` tokens (from token 0, the last
    chunk possibly partial) and (b, h), returned per token [B, S, H]; a zero chunk keeps scale 1."""
    batch, seq, heads, _ = x.shape
    pad = -seq % chunk
    amax = torch.nn.functional.pad(x.abs().amax(-1), (0, 0, 0, pad)).view(batch, -1, chunk, heads).amax(2)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).repeat_interleave(chunk, 1)[:, :seq]
    return torch.round(x / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def per_channel(x: torch.Tensor, top: float) -> torch.Tensor:
    """The scale per (b, h, channel) of ``x`` [B, S, H, D] that maps its largest magnitude to ``top``."""
    amax = x.abs().amax(1)
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pv: str = DEFAULT_PV,
             smooth_k: bool = True) -> QuantizedInputs:
    """Quantize a checked request's q ``[B, Sq, H, D]``, k and v ``[B, Skv, H, D]``
    (``smooth_k=False`` keeps K's mean in, to measure what it is worth)."""
    if pv not in PV_FORMATS:
        raise InvalidArgumentError("pv", f"one of {PV_FORMATS}", repr(pv))
    qf, kf, vf = q.float(), k.float(), v.float()
    k_mean = kf.mean(1) if smooth_k else torch.zeros_like(kf[:, 0])  # [B, H, D]
    q8, q_scale = per_token_int8(qf)
    k8, k_scale = per_chunk_int8(kf - k_mean.unsqueeze(1))
    if pv == "int8":
        v_mean = vf.mean(1)
        centred = vf - v_mean.unsqueeze(1)
        v_scale = per_channel(centred, INT8_MAX)
        v8 = torch.round(centred / v_scale.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif pv == "fp8":
        v_mean = torch.zeros_like(vf[:, 0])
        v_scale = per_channel(vf, E4M3_MAX)
        v8 = (vf / v_scale.unsqueeze(1)).to(torch.float8_e4m3fn)
    else:
        v_mean, v_scale = torch.zeros_like(vf[:, 0]), torch.ones_like(vf[:, 0])
        v8 = vf.to(torch.bfloat16)
    lse_shift = torch.einsum("bshd,bhd->bhs", qf, k_mean) * scale
    return QuantizedInputs(q8, q_scale, k8, k_scale, k_mean, v8, v_scale, v_mean, lse_shift, scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: LogicalMask, scale: float | None = None,
              return_lse: bool = False, pv: str = DEFAULT_PV, kv_tile: int = 128,
              smooth_k: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-masked 8-bit attention as the 8-bit kernels compute it (module docstring), in q's dtype.

    q ``[B, Sq, H, D]``, k, v ``[B, Skv, H, D]``, finite; ``kv_tile`` keys share a P scale. Returns
    out ``[B, Sq, H, D]`` and, with ``return_lse``, lse ``[B, H, Sq]`` fp32."""
    scale = check_inputs(q, k, v, mask, scale, check_finite=True)
    if isinstance(kv_tile, bool) or not isinstance(kv_tile, int) or kv_tile < 1:
        raise InvalidArgumentError("kv_tile", "a positive int (keys per P scale)", repr(kv_tile))
    out, lse = run(quantize(q, k, v, scale, pv, smooth_k), mask, kv_tile)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def rounded_probabilities(p: torch.Tensor, pv: str, kv_tile: int) -> torch.Tensor:
    """``p`` [rows, keys] in [0, 1] as the P operand holds it, in units of the output's scale: for
    int8, ``round(255 * p / tile max) * tile max / 255`` per row and tile of ``kv_tile`` keys."""
    if pv == "fp8":
        return (p * E4M3_MAX).to(torch.float8_e4m3fn).float() / E4M3_MAX
    if pv == "bf16":
        return p.to(torch.bfloat16).float()
    rows, keys = p.shape
    pad = -keys % kv_tile
    tiles = torch.nn.functional.pad(p, (0, pad)).view(rows, -1, kv_tile)
    top = tiles.amax(-1, keepdim=True)
    # The bytes relative to the tile's maximum, then one step's value: a maximum so small that a
    # step underflows (top / 255 == 0) gives 0 like the kernel's step, never 0 / 0.
    steps = torch.round(UINT8_MAX * tiles / torch.where(top > 0, top, torch.ones_like(top)))
    return (steps * (top / UINT8_MAX)).view(rows, -1)[:, :keys]


def run(x: QuantizedInputs, mask: LogicalMask, kv_tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin on quantized inputs: out ``[B, Sq, H, D]`` and lse ``[B, H, Sq]``, both fp32."""
    batch, seq_q, heads, head_dim = x.q.shape
    seq_kv = x.k.shape[1]
    out = torch.zeros(batch, seq_q, heads, head_dim, dtype=torch.float32, device=x.q.device)
    lse = torch.full((batch, heads, seq_q), -math.inf, dtype=torch.float32, device=x.q.device)
    for b, h, r0, r1, tokens, token_mask in row_chunks(mask, batch, heads, seq_kv):
        q8, k8 = x.q[b, r0:r1, h].float(), x.k[b, tokens, h].float()  # integers, exact in fp32
        scores = (q8 @ k8.T) * (x.q_scale[b, r0:r1, h, None] * x.k_scale[b, tokens, h] * x.scale)
        scores = scores.masked_fill(~token_mask, -math.inf)
        row_max = scores.amax(-1, keepdim=True)
        has_key = row_max > -math.inf
        p = torch.exp(scores - torch.where(has_key, row_max, torch.zeros_like(row_max)))
        rounded = rounded_probabilities(p, x.pv, kv_tile)
        sums = (rounded if x.pv == "int8" else p).sum(-1, keepdim=True)
        denom = torch.where(has_key, sums, torch.ones_like(row_max))
        pv = rounded @ x.v[b, tokens, h].float()
        o = pv * x.v_scale[b, h] / denom + x.v_mean[b, h]
        out[b, r0:r1, h] = torch.where(has_key, o, torch.zeros_like(o))
        row_lse = torch.where(has_key, row_max + torch.log(denom), row_max).squeeze(-1)
        lse[b, h, r0:r1] = row_lse + x.lse_shift[b, h, r0:r1]
    return out, lse


@dataclass(frozen=True)
class Agreement:
    """An 8-bit output against the fp32 oracle (empty rows are 0 in both)."""

    cosine: float
    relative_l2: float

    def within_budget(self) -> bool:
        return self.cosine >= MIN_COSINE and self.relative_l2 <= MAX_RELATIVE_L2


def agreement(out: torch.Tensor, oracle: torch.Tensor) -> Agreement:
    """Cosine similarity and relative L2 error of ``out`` against ``oracle`` (both [B, S, H, D])."""
    a, b = out.double().flatten(), oracle.double().flatten()  # fp64 sums: millions of elements
    cosine = float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))
    return Agreement(cosine, float((a - b).norm() / b.norm().clamp_min(1e-300)))
