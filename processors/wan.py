"""Wan2.1 video self-attention (``attn1``) through Tessera.

Same projections, QK-norm and RoPE as diffusers' ``WanAttnProcessor`` (diffusers 0.42): Q/K/V from
``to_q/to_k/to_v`` (or fused ``to_qkv``), RMSNorm over all heads before the head split, RoPE on
interleaved pairs when ``rotary_emb`` is given, output ``flatten -> to_out[0] -> to_out[1]``. All of
these act per token, so the tokens are put in the sparsifier's tile order *before* the projections
(with the rotary tables in the same order) and the projected output is put back in raster order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers.models.transformers.transformer_wan import _get_qkv_projections

from tessera_diffusers.errors import InvalidArgumentError

from .context import ForwardContext, ModuleRoute

if TYPE_CHECKING:
    from .processor import TesseraProcessor


def apply_wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs ``(x[2i], x[2i+1])``.

    ``x [B, S, H, D]``; ``cos, sin [1, S, 1, D]`` (each angle repeated for both members of a pair)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos_pair = cos[..., 0::2]
    sin_pair = sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos_pair - x2 * sin_pair
    out[..., 1::2] = x1 * sin_pair + x2 * cos_pair
    return out.type_as(x)


def wan_self_attention(
    processor: TesseraProcessor,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    route: ModuleRoute,
    call: ForwardContext,
) -> torch.Tensor:
    """``hidden_states [B, S, C]`` (raster order, S = grid tokens) -> attention output ``[B, S, C]``."""
    layout = processor.layout_for(route, call.grid, hidden_states.shape[1])
    x = layout.to_layout(hidden_states)
    query, key, value = _get_qkv_projections(attn, x, None)
    query = attn.norm_q(query)
    key = attn.norm_k(key)
    query = query.unflatten(2, (attn.heads, -1))  # [B, S, H, D]
    key = key.unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    if rotary_emb is not None:
        cos, sin = processor.rotary_in_layout(rotary_emb, layout, token_dim=1)
        if cos.shape[1] != x.shape[1]:
            raise InvalidArgumentError(
                "rotary_emb", f"cos/sin over {x.shape[1]} tokens [1, S, 1, D]", f"shape {tuple(cos.shape)}"
            )
        query = apply_wan_rotary(query, cos, sin)
        key = apply_wan_rotary(key, cos, sin)

    mask, slot = processor.video_mask(route, call, layout, query, key)
    if mask is None:
        out = processor.dense_attention(query, key, value)
    else:
        out = processor.backend.attention(query, key, value, mask, slot=slot, cache=processor.cache)
    out = out.flatten(2, 3).type_as(query)
    out = attn.to_out[0](out)
    out = attn.to_out[1](out)
    return layout.to_raster(out)
