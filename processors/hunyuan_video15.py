"""HunyuanVideo-1.5 joint attention (``transformer_blocks[i].attn``) through Tessera.

Tokens are ``[video | text]``; the 1-D text mask (valid tokens, padding) comes in
``attention_mask [B, St]``. Projections, per-head RMSNorm, RoPE on video only and the output
projections are those of diffusers' ``HunyuanVideo15AttnProcessor2_0``. The attention itself is
split so that no ``S x S`` mask is ever built:

    video queries: sparse over video keys (the sparsifier's mask)  (+)  dense over valid text keys
    text queries (valid ones): dense over video keys  (+)  dense over valid text keys
    padded text queries: 0 (the stock processor's masked rows are 0 as well)

``(+)`` is the exact log-sum-exp merge of the two partial softmaxes. Valid text tokens are taken
by slicing when every sample has the same valid prefix (the transformer puts valid tokens first),
and by gathering per sample otherwise. Full attention (a ``None`` mask) runs one dense call over
``[video | valid text]`` per group of samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera_diffusers.errors import InvalidArgumentError, describe_tensor
from tessera_diffusers.mask import LogicalMask

from .backends import dense_lse_attention, merge_partials
from .compat import apply_rotary_emb
from .context import ForwardContext, ModuleRoute, ProcessorLike, describe_argument
from .plan_cache import CacheSlot


@dataclass(frozen=True)
class TextKeys:
    """Which text tokens are valid: a common prefix of ``length`` tokens for every sample, or the
    valid indices of each sample."""

    length: int | None
    indices: tuple[torch.Tensor, ...] | None  # per sample [n_b] int64


def text_keys(attention_mask: torch.Tensor | None, batch: int, seq_text: int) -> TextKeys:
    """Valid text tokens of a ``[B, St]`` mask (one host sync; the processor memoizes it per mask
    tensor, i.e. once per transformer forward)."""
    if attention_mask is None:
        return TextKeys(seq_text, None)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, seq_text):
        raise InvalidArgumentError(
            "attention_mask",
            f"a 1-D text mask per sample [B, St] = [{batch}, {seq_text}]",
            describe_tensor(attention_mask),
        )
    valid = attention_mask.bool()
    counts = valid.sum(1).tolist()
    if len(set(counts)) == 1 and bool(valid[:, : counts[0]].all()):
        return TextKeys(int(counts[0]), None)
    return TextKeys(None, tuple(torch.nonzero(valid[b]).flatten() for b in range(batch)))


def check_joint_attention_call(
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Refuse what the sparse joint route would otherwise ignore. Its only mask is the 1-D text mask
    ``attention_mask [B, St]`` beside ``encoder_hidden_states`` (checked by ``text_keys``); the
    transformer's blocks always pass both, with RoPE as ``image_rotary_emb``."""
    if attention_mask is not None and encoder_hidden_states is None:
        raise InvalidArgumentError(
            "attention_mask",
            "None when encoder_hidden_states is None: the sparse HunyuanVideo-1.5 route takes a 1-D mask "
            "over the text tokens [B, St] only, and video tokens attend under the sparsifier's block mask",
            describe_argument(attention_mask),
            hint="to attend with it, give this module the stock processor: "
            "attn.set_processor(HunyuanVideo15AttnProcessor2_0())",
        )
    if rotary_emb is not None:
        raise InvalidArgumentError(
            "rotary_emb",
            "None: HunyuanVideo-1.5 takes its rotary table as image_rotary_emb (cos, sin [Sv, D])",
            describe_argument(rotary_emb),
            hint="pass it as image_rotary_emb, the argument the model's blocks hand their processor",
        )


def project(attn: torch.nn.Module, states: torch.Tensor, added: bool) -> tuple[torch.Tensor, ...]:
    """Q, K, V ``[B, S, H, D]`` with their per-head norms (video projections or the added text ones)."""
    if added:
        q, k, v = attn.add_q_proj(states), attn.add_k_proj(states), attn.add_v_proj(states)
        norm_q, norm_k = attn.norm_added_q, attn.norm_added_k
    else:
        q, k, v = attn.to_q(states), attn.to_k(states), attn.to_v(states)
        norm_q, norm_k = attn.norm_q, attn.norm_k
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
    if norm_q is not None:
        q = norm_q(q)
    if norm_k is not None:
        k = norm_k(k)
    return q, k, v


def hunyuan_video15_joint_attention(
    processor: ProcessorLike,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    route: ModuleRoute,
    call: ForwardContext,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden_states [B, Sv, C]``, ``encoder_hidden_states [B, St, C]`` -> (video ``[B, Sv, C]``,
    text ``[B, St, C]``), like the stock processor."""
    layout = processor.layout_for(route, call.grid, hidden_states.shape[1])
    x = layout.to_layout(hidden_states)
    q_v, k_v, v_v = project(attn, x, added=False)
    if image_rotary_emb is not None:
        rope = processor.rotary_in_layout(image_rotary_emb, layout, token_dim=0)
        q_v = apply_rotary_emb(q_v, rope, sequence_dim=1)
        k_v = apply_rotary_emb(k_v, rope, sequence_dim=1)

    mask, slot = processor.video_mask(route, call, layout, q_v, k_v)
    if encoder_hidden_states is None:
        out_v = video_only(processor, q_v, k_v, v_v, mask, slot)
        out_t = None
    else:
        q_t, k_t, v_t = project(attn, encoder_hidden_states, added=True)
        keys = processor.text_keys_for(attention_mask, q_t.shape[0], q_t.shape[1])
        if mask is None:
            out_v, out_t = dense_joint(processor, (q_v, k_v, v_v), (q_t, k_t, v_t), keys)
        else:
            out_v, out_t = sparse_joint(processor, (q_v, k_v, v_v), (q_t, k_t, v_t), keys, mask, slot)

    out_v = out_v.flatten(2, 3).to(q_v.dtype)
    if getattr(attn, "to_out", None) is not None:
        out_v = attn.to_out[0](out_v)
        out_v = attn.to_out[1](out_v)
    out_v = layout.to_raster(out_v)
    if out_t is not None:
        out_t = out_t.flatten(2, 3).to(q_v.dtype)
        if getattr(attn, "to_add_out", None) is not None:
            out_t = attn.to_add_out(out_t)
    return out_v, out_t


def video_only(
    processor: ProcessorLike,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LogicalMask | None,
    slot: CacheSlot,
) -> torch.Tensor:
    if mask is None:
        return processor.dense_attention(q, k, v)
    return processor.backend.attention(q, k, v, mask, slot=slot, cache=processor.cache)


def sparse_joint(
    processor: ProcessorLike,
    video: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    text: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    keys: TextKeys,
    mask: LogicalMask,
    slot: CacheSlot,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse video self-attention merged with dense text parts (see the module docstring)."""
    q_v, k_v, v_v = video
    q_t, k_t, v_t = text
    out_vv, lse_vv = processor.backend.attention(q_v, k_v, v_v, mask, slot=slot, cache=processor.cache, return_lse=True)
    out_t = torch.zeros_like(q_t)
    if keys.length is not None:
        n = keys.length
        if n == 0:
            return out_vv, out_t
        out_v, out_t[:, :n] = with_text(processor, video, out_vv, lse_vv, (q_t[:, :n], k_t[:, :n], v_t[:, :n]))
        return out_v, out_t
    out_v = out_vv.clone()
    for b, idx in enumerate(keys.indices):
        if idx.numel() == 0:  # no valid text: video rows keep the video-only result
            continue
        rows = slice(b, b + 1)
        sample_video = (q_v[rows], k_v[rows], v_v[rows])
        sample_text = (q_t[rows][:, idx], k_t[rows][:, idx], v_t[rows][:, idx])
        out_v[rows], merged_t = with_text(processor, sample_video, out_vv[rows], lse_vv[rows], sample_text)
        out_t[b, idx] = merged_t[0]
    return out_v, out_t


def with_text(
    processor: ProcessorLike,
    video: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out_vv: torch.Tensor,
    lse_vv: torch.Tensor,
    valid_text: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the text parts to a video-only result. ``valid_text`` holds only valid tokens.

    Returns (video rows ``[B, Sv, H, D]``, valid text rows ``[B, n, H, D]``)."""
    q_v, k_v, v_v = video
    q_t, k_t, v_t = valid_text
    backend, cache = processor.backend, processor.cache
    o_vt, l_vt = dense_lse_attention(backend, cache, q_v, k_t, v_t)  # video queries, text keys
    out_v, _ = merge_partials(out_vv, lse_vv, o_vt, l_vt)
    o_tv, l_tv = dense_lse_attention(backend, cache, q_t, k_v, v_v)  # text queries, video keys
    o_tt, l_tt = dense_lse_attention(backend, cache, q_t, k_t, v_t)  # text queries, text keys
    out_t, _ = merge_partials(o_tv, l_tv, o_tt, l_tt)
    return out_v, out_t


def dense_joint(
    processor: ProcessorLike,
    video: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    text: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    keys: TextKeys,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention over ``[video | valid text]`` without any mask tensor (padding dropped)."""
    q_v, k_v, v_v = video
    q_t, k_t, v_t = text
    seq_v = q_v.shape[1]
    out_t = torch.zeros_like(q_t)
    if keys.length is not None:
        groups = [(slice(None), slice(0, keys.length))]
    else:
        groups = [(slice(b, b + 1), idx) for b, idx in enumerate(keys.indices)]
    out_v = torch.empty_like(q_v)
    for rows, cols in groups:
        q = torch.cat([q_v[rows], q_t[rows][:, cols]], 1)
        k = torch.cat([k_v[rows], k_t[rows][:, cols]], 1)
        v = torch.cat([v_v[rows], v_t[rows][:, cols]], 1)
        out = processor.dense_attention(q, k, v)
        out_v[rows] = out[:, :seq_v]
        if keys.length is not None:
            out_t[:, cols] = out[:, seq_v:]
        else:
            out_t[rows, cols] = out[0, seq_v:]
    return out_v, out_t
