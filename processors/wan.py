"""Wan2.1 video self-attention (``attn1``) through Tessera.

Same projections, QK-norm and RoPE as diffusers' ``WanAttnProcessor`` (diffusers 0.36 - 0.42): Q/K/V from
``to_q/to_k/to_v`` (or fused ``to_qkv``), RMSNorm over all heads before the head split, RoPE on
interleaved pairs when ``rotary_emb`` is given, output ``flatten -> to_out[0] -> to_out[1]``. All of
these act per token, so the tokens are put in the sparsifier's tile order *before* the projections
(with the rotary tables in the same order) and the projected output is put back in raster order.
"""

from __future__ import annotations

import torch

from tessera_diffusers.errors import InvalidArgumentError

from .compat import wan_qkv_projections
from .context import ForwardContext, ModuleRoute, ProcessorLike, describe_argument


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


STOCK_HINT = (
    "to attend with it, give this module the stock processor: attn.set_processor(WanAttnProcessor()), "
    "from diffusers.models.transformers.transformer_wan"
)


def check_wan_self_attention_call(
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Refuse what the sparse route would otherwise ignore. It is video self-attention (``attn1``),
    every query over the keys of the sparsifier's block mask, with RoPE from ``rotary_emb``: Wan's
    own blocks call ``attn1(hidden_states, None, None, rotary_emb)``, so any other argument comes from
    a custom caller who expects it to count."""
    if encoder_hidden_states is not None:
        raise InvalidArgumentError(
            "encoder_hidden_states",
            "None: the sparse route runs Wan2.1 video self-attention (attn1), whose keys are the video "
            "tokens themselves (text cross-attention is attn2, which keeps its stock processor)",
            describe_argument(encoder_hidden_states),
            hint=STOCK_HINT,
        )
    if attention_mask is not None:
        raise InvalidArgumentError(
            "attention_mask",
            "None: the sparse route of Wan2.1 video self-attention (attn1) attends under the sparsifier's "
            "block mask only and takes no attention mask of its own",
            describe_argument(attention_mask),
            hint=STOCK_HINT,
        )
    if image_rotary_emb is not None:
        raise InvalidArgumentError(
            "image_rotary_emb",
            "None: Wan2.1 takes its rotary table as rotary_emb (cos, sin [1, S, 1, D])",
            describe_argument(image_rotary_emb),
            hint="pass it as rotary_emb, the argument WanAttention hands its processor",
        )


def wan_qkv_heads(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Wan's ``attn1`` projections and q/k RMS norms of ``x [B, S, C]`` (per token, so on any subset
    of tokens), split into heads: ``q, k, v [B, S, H, D]``."""
    query, key, value = wan_qkv_projections(attn, x, None)
    query = attn.norm_q(query)  # RMSNorm over all heads
    key = attn.norm_k(key)
    return tuple(t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))


def wan_self_attention(
    processor: ProcessorLike,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    route: ModuleRoute,
    call: ForwardContext,
) -> torch.Tensor:
    """``hidden_states [B, S, C]`` (raster order, S = grid tokens) -> attention output ``[B, S, C]``."""
    layout = processor.layout_for(route, call.grid, hidden_states.shape[1])
    x = layout.to_layout(hidden_states)
    query, key, value = wan_qkv_heads(attn, x)  # [B, S, H, D]
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
