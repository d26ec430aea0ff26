"""``TesseraProcessor``'s sparse routes under context parallelism (Ulysses), on top of the
diffusers-free exchanges and pipelined attention of ``tessera_diffusers.parallel``.

``enable_parallelism`` hands the processor diffusers' ``ParallelConfig``; the processor then keeps a
``Ulysses`` group (``processor.ulysses``) and sends each sparse route here: the per-token
projections, norms and RoPE run on the rank's ``S / N`` tokens, the attention of its heads through
``parallel.layout_attention`` (all-to-alls, tile permutation, sparsifier, step cache, backend).
"""

from __future__ import annotations

from typing import Any

import torch

from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.parallel import ContextParallelError, Ulysses, layout_attention

from .context import ForwardContext, ModuleRoute, ProcessorLike, Route
from .wan import apply_wan_rotary, wan_qkv_heads


def ulysses_processor_call(
    processor: ProcessorLike,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    route: ModuleRoute,
    call: ForwardContext,
) -> Any:
    """A sparse route of ``TesseraProcessor`` under context parallelism (``processor.ulysses`` set)."""
    if route.route is Route.WAN_SELF:
        return ulysses_wan_self_attention(processor, attn, hidden_states, rotary_emb, route, call)
    raise ContextParallelError(
        f"{route.route.value}: context parallelism is supported for Wan2.1 video self-attention only; "
        "HunyuanVideo-1.5 has no _cp_plan in diffusers 0.42.1 and its joint video+text attention is not "
        "split by Tessera — run it without enable_parallelism"
    )


def ulysses_wan_self_attention(
    processor: ProcessorLike,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    route: ModuleRoute,
    call: ForwardContext,
) -> torch.Tensor:
    """Wan2.1 ``attn1`` on this rank's raster chunk of tokens.

    ``hidden_states [B, S/N, C]`` (rank chunk of the raster order, as Wan's ``_cp_plan`` splits it),
    ``rotary_emb`` cos/sin ``[1, S/N, 1, D]`` (split alike) -> ``[B, S/N, C]``. Same projections,
    norms, RoPE and output projection as ``processors.wan.wan_self_attention``; the token permutation
    into the sparsifier's tile order happens after the all-to-all, on the whole sequence."""
    ulysses: Ulysses = processor.ulysses
    seq = hidden_states.shape[1] * ulysses.degree
    layout = processor.layout_for(route, call.grid, seq)
    query, key, value = wan_qkv_heads(attn, hidden_states)  # [B, S/N, H, D]: per token, so on the local chunk
    if rotary_emb is not None:
        cos, sin = rotary_emb
        if cos.shape[1] != hidden_states.shape[1]:
            raise InvalidArgumentError(
                "rotary_emb",
                f"cos/sin over this rank's {hidden_states.shape[1]} tokens [1, S/N, 1, D] (split by the _cp_plan)",
                f"shape {tuple(cos.shape)}",
            )
        query = apply_wan_rotary(query, cos, sin)
        key = apply_wan_rotary(key, cos, sin)

    out = pipelined_video_attention(processor, query, key, value, layout, route, call)  # [B, S/N, H, D]
    out = out.flatten(2, 3).type_as(query)
    out = attn.to_out[0](out)
    return attn.to_out[1](out)


def pipelined_video_attention(
    processor: ProcessorLike,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Any,
    route: ModuleRoute,
    call: ForwardContext,
) -> torch.Tensor:
    """``TesseraProcessor``'s video attention on ``[B, S/N, H, D]`` raster chunks (``layout_attention``
    with the step cache's mask, the sparsifier and the processor's backend)."""
    ulysses: Ulysses = processor.ulysses
    batch, heads = query.shape[0], query.shape[2] // ulysses.degree
    slot = processor.kept_video_slot(route, call, layout, batch, heads, query.device)
    spans = ulysses.head_spans(query.shape[2])

    def make_mask(q, k):  # on this rank's heads, or on a head chunk of them (head_separable)
        return processor.sparsify(route, call, layout, q, k, heads)

    def keep(mask):
        nonlocal slot
        mask, slot = processor.keep_video_mask(route, call, layout, mask, batch, heads, query.device)
        return mask

    def attend(chunk, q, k, v, mask):
        # backends written before head parts take no ``part``: it is only passed when there are parts
        part = {} if len(spans) == 1 else {"part": spans[chunk]}
        return processor.backend.attention(q, k, v, mask, slot=slot, cache=processor.cache, **part)

    return layout_attention(
        ulysses, query, key, value, layout, attend,
        mask=None if slot is None else slot.mask, make_mask=make_mask, keep=keep, dense=processor.dense_attention,
        separable=bool(getattr(processor.sparsifier_for(route), "head_separable", False)),
    )  # fmt: skip
