"""Context parallelism (Ulysses) for Tessera: full sequence and a slice of the heads per rank.

Under Ulysses each of ``N`` ranks holds ``S / N`` tokens outside attention. Before attention one
all-to-all trades sequence for heads (every rank gets all ``S`` tokens of ``H / N`` heads), after it
a second all-to-all trades them back. Block-sparse attention is per head, so a rank runs Tessera
on its heads with its heads' slice of the mask (``LogicalMask.select_heads``; a broadcast head dim
stays broadcast) and its own prepared plan; the result is single-process attention (bit for bit
when both pick the same plan; a plan chosen for ``H / N`` heads may round differently).

Raw function (tokens in rank chunks of the mask's token order)::

    ulysses = Ulysses()                                   # the default process group
    out = ulysses_attention(q_chunk, k_chunk, v_chunk, mask, ulysses)   # [B, S/N, H, D] each

With diffusers (the documented way)::

    processor = TesseraProcessor(sparsifier).attach(pipe.transformer)
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))
    # (either order; torch.distributed initialised, one process per GPU, e.g. with torchrun)

How it composes with diffusers 0.42.1: ``enable_parallelism`` builds the ``("ring", "ulysses")``
device mesh, installs the model's ``_cp_plan`` hooks (Wan: ``blocks.0`` hidden states and the RoPE
tables split along the sequence, ``proj_out`` gathered) and hands its ``ParallelConfig`` to every
attention processor through ``processor._parallel_config``. ``TesseraProcessor`` receives it like
the stock processors do and, instead of asking ``dispatch_attention_fn`` for diffusers' own Ulysses
(``TemplatedUlyssesAttention``), runs the two all-to-alls itself on the group of diffusers'
``ulysses`` mesh dimension. Not registering a diffusers attention backend is deliberate:

- ``AttentionBackendName`` is a closed enum and the registry a process-global table; a Tessera
  backend would have to patch both;
- ``dispatch_attention_fn`` carries a dense ``attn_mask`` tensor, not a ``LogicalMask``, and its
  Ulysses template all-gathers masks along the key axis as dense ``[.., S_kv]`` tensors;
- the sparsifier needs the whole video after the all-to-all (tiles span the whole token grid, and
  the tile permutation needs every token), which happens *inside* the backend call there.

So the processor does: per-token projections, QK norms and RoPE on its ``S / N`` raster tokens (all
heads; the RoPE tables come split by the ``_cp_plan``), all-to-all to ``[B, S, H / N, D]``, tile
permutation, the sparsifier's mask for its heads (a mask over all heads is sliced), Tessera with the
step cache, inverse permutation, all-to-all back, output projection. Dense decisions (warm-up) run
through ``dispatch_attention_fn`` on the rank's heads without a parallel config.

Limits: ring attention (``ring_degree > 1``, also unified ring x Ulysses) and ``ulysses_anything``
are refused with a ``TesseraError`` — ring would need per-chunk masks merged by log-sum-exp;
HunyuanVideo-1.5 has no ``_cp_plan`` in diffusers 0.42.1 and its joint attention is refused under
context parallelism. Sparsifiers see the rank's heads only: per-head sparsifiers (SSTA, static,
dense warm-up) give exactly the single-process masks; a sparsifier whose decision couples heads
(``AdaptiveSparsifier`` chooses one block geometry from the mean over heads) decides per rank.
Inference only: the all-to-alls are not differentiable. On a CPU-only torch, diffusers 0.42.1's
``enable_parallelism`` fails with ``ZeroDivisionError`` (``rank % torch.accelerator.device_count()``
with no accelerator); the CPU tests and ``cp_scaling.py --smoke`` give it a count of 1 per process.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError, MaskError, TesseraError, describe_tensor
from .mask import LogicalMask
from .plans import PhysicalPlan
from .runtime import Runtime

if TYPE_CHECKING:
    from .processors import TesseraProcessor
    from .processors.context import ForwardContext, ModuleRoute


class ContextParallelError(TesseraError):
    """A context-parallel configuration or call Tessera cannot run (ring attention, uneven splits)."""


class Ulysses:
    """One rank's view of a Ulysses group, and the per-rank head slices of masks.

    Args:
        group: the process group of the Ulysses dimension (``None``: the default group).

    Rank ``r`` of ``N`` holds tokens ``[r * S/N, (r + 1) * S/N)`` outside attention and heads
    ``[r * H/N, (r + 1) * H/N)`` inside it. Slices of a mask are kept per source mask object, so
    the plan prepared for a slice is reused as long as the source mask lives.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError("torch.distributed is not initialised (call init_process_group first)")
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._slices: weakref.WeakKeyDictionary[LogicalMask, dict[tuple[int, int], LogicalMask]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_parallel_config(cls, config: Any) -> Ulysses | None:
        """The Ulysses group of a diffusers ``ParallelConfig`` / ``ContextParallelConfig`` (set up by
        ``enable_parallelism``); ``None`` without context parallelism. Raises ``ContextParallelError``
        for what Tessera cannot run (ring attention, ``ulysses_anything``)."""
        if config is None:
            return None
        cp = getattr(config, "context_parallel_config", config)
        if cp is None:
            return None
        ring = getattr(cp, "ring_degree", None)
        degree = getattr(cp, "ulysses_degree", None)
        if ring is None or degree is None:
            raise InvalidArgumentError(
                "parallel_config", "a diffusers ParallelConfig or ContextParallelConfig", type(config).__name__
            )
        if ring > 1:
            raise ContextParallelError(
                f"ContextParallelConfig.ring_degree: expected 1 (Ulysses only), got {ring}; ring attention would "
                "need per-chunk block masks merged by log-sum-exp, which Tessera does not implement — use "
                "ulysses_degree instead"
            )
        if getattr(cp, "ulysses_anything", False):
            raise ContextParallelError(
                "ContextParallelConfig.ulysses_anything: expected False, got True; Tessera's Ulysses needs equal "
                "sequence chunks and heads divisible by ulysses_degree"
            )
        mesh = getattr(cp, "_ulysses_mesh", None)
        if mesh is None:
            raise ContextParallelError(
                "ContextParallelConfig: expected a config set up by transformer.enable_parallelism(...) "
                "(it builds the device mesh), got one without a ulysses mesh"
            )
        ulysses = cls(mesh.get_group())
        if ulysses.degree != degree:
            raise ContextParallelError(
                f"ulysses mesh: expected {degree} ranks (ulysses_degree), got a group of {ulysses.degree}"
            )
        return ulysses

    # ------------------------------------------------------------------ heads
    def head_range(self, heads: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's heads out of ``heads``."""
        if heads % self.degree:
            raise InvalidArgumentError(
                "heads", f"a multiple of the Ulysses degree {self.degree}", heads, hint="pick another ulysses_degree"
            )
        per_rank = heads // self.degree
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def local_mask(self, mask: LogicalMask, heads: int) -> LogicalMask:
        """This rank's part of ``mask`` for an attention over ``heads`` heads.

        A head dim of 1 broadcasts and is returned as is; ``heads`` heads are sliced to this rank's
        (one slice object per source mask, contiguous so its bytes are its own); ``heads / N`` heads
        are taken to be this rank's already (a sparsifier that ran on this rank's q and k)."""
        if not isinstance(mask, LogicalMask):
            raise MaskError("mask", "a tessera_diffusers.LogicalMask", type(mask).__name__)
        start, stop = self.head_range(heads)
        if mask.heads == 1 or self.degree == 1 or (mask.heads == stop - start and mask.heads != heads):
            return mask
        if mask.heads != heads:
            raise MaskError(
                "mask head dim", f"1, {heads} (all heads) or {stop - start} (this rank's heads)", mask.heads
            )
        per_mask = self._slices.setdefault(mask, {})
        local = per_mask.get((start, stop))
        if local is None:
            view = mask.select_heads(start, stop)
            local = LogicalMask(view.blocks.contiguous(), view.block_q, view.block_kv, view.seq_len_q, view.seq_len_kv)
            per_mask[(start, stop)] = local
        return local

    # ------------------------------------------------------------------ all-to-all
    def scatter_heads(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Sequence chunks in, head slices out: each ``[B, S/N, H, D]`` -> ``[B, S, H/N, D]`` (the
        chunks of ranks ``0..N-1`` in order). The exchanges are issued together, then awaited."""
        return [pending.wait() for pending in self.scatter_heads_async(*tensors)]

    def scatter_heads_async(self, *tensors: torch.Tensor) -> list[PendingExchange]:
        """``scatter_heads`` without waiting: work queued before a ``wait()`` overlaps the transfer."""
        for i, t in enumerate(tensors):
            check_4d(f"tensors[{i}]", t)
            self.head_range(t.shape[2])
        return [self.exchange_async(t, scatter_dim=2, gather_dim=1) for t in tensors]

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``scatter_heads``: ``[B, S, H/N, D]`` -> ``[B, S/N, H, D]``."""
        check_4d("x", x)
        if x.shape[1] % self.degree:
            raise InvalidArgumentError("x", f"a sequence divisible by the Ulysses degree {self.degree}", x.shape[1])
        return self.exchange([x], scatter_dim=1, gather_dim=2)[0]

    def gather_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """Log-sum-exp back to sequence chunks: ``[B, H/N, S]`` -> ``[B, H, S/N]``."""
        if not isinstance(lse, torch.Tensor) or lse.dim() != 3 or lse.shape[2] % self.degree:
            raise InvalidArgumentError(
                "lse", f"a [B, H/N, S] tensor with S divisible by {self.degree}", describe_tensor(lse)
            )
        return self.exchange([lse], scatter_dim=2, gather_dim=1)[0]

    def exchange(self, tensors: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int) -> list[torch.Tensor]:
        """All-to-all: dim ``scatter_dim`` is cut into ``N`` equal pieces, piece ``j`` goes to rank
        ``j``; the pieces received are concatenated along ``gather_dim`` in rank order."""
        pending = [self.exchange_async(x, scatter_dim, gather_dim) for x in tensors]
        return [p.wait() for p in pending]

    def exchange_async(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> PendingExchange:
        """``exchange`` of one tensor, issued and not awaited."""
        if self.degree == 1:
            return PendingExchange(x, x, None, gather_dim)
        n = self.degree
        send = x.unflatten(scatter_dim, (n, x.shape[scatter_dim] // n)).movedim(scatter_dim, 0).contiguous()
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return PendingExchange(send, recv, work, gather_dim)

    def __repr__(self) -> str:
        return f"Ulysses(rank={self.rank}, degree={self.degree})"


@dataclass(eq=False)
class PendingExchange:
    """An all-to-all in flight (the send buffer is kept alive with it); ``wait()`` returns the
    received pieces concatenated along the gather dim (on a GPU the wait orders the current stream
    after the transfer and does not block the host)."""

    send: torch.Tensor  # [N, ...] piece j for rank j
    recv: torch.Tensor  # [N, ...] piece j from rank j
    work: Any  # torch.distributed Work, None without a transfer (degree 1)
    gather_dim: int

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return self.recv
        self.work.wait()
        # recv[j] is rank j's piece: [N, ...] -> N just before the gather dim, then merged into it.
        return self.recv.movedim(0, self.gather_dim).flatten(self.gather_dim, self.gather_dim + 1)


def check_4d(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise InvalidArgumentError(name, "a [B, S, H, D] tensor", describe_tensor(t))


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LogicalMask,
    ulysses: Ulysses,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    plan: PhysicalPlan | None = None,
    runtime: Runtime | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of a sequence split over a Ulysses group.

    Equal to ``block_sparse_attention`` on the concatenation of every rank's chunk.

    Args:
        q: ``[B, S/N, H, D]``, this rank's tokens ``[r * S/N, (r + 1) * S/N)`` of the mask's token
            order; k, v: ``[B, S_kv/N, H, D]`` likewise (``S_kv = S`` for self-attention).
        mask: ``LogicalMask`` over the whole ``(S, S_kv)`` with ``H`` heads (sliced to this rank's),
            1 head (broadcast) or ``H/N`` heads (this rank's already).
        ulysses: the group (``Ulysses(group)``).
        scale, return_lse, plan: as for ``block_sparse_attention``.
        runtime: a ``Runtime`` whose plan cache to use; pass one per rank to reuse prepared plans.

    Returns:
        out ``[B, S/N, H, D]`` (and, with ``return_lse``, lse ``[B, H, S/N]`` fp32).
    """
    check_4d("q", q)
    heads = q.shape[2]
    local = ulysses.local_mask(mask, heads)
    q_h, k_h, v_h = ulysses.scatter_heads(q, k, v)  # [B, S, H/N, D]
    runtime = runtime or Runtime()
    result = runtime.attention(q_h, k_h, v_h, local, scale=scale, return_lse=return_lse, plan=plan)
    if return_lse:
        out, lse = result
        return ulysses.gather_heads(out), ulysses.gather_lse(lse)
    return ulysses.gather_heads(result)


# ====================================================================== diffusers processors
def ulysses_processor_call(
    processor: TesseraProcessor,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
    route: ModuleRoute,
    call: ForwardContext,
) -> Any:
    """A sparse route of ``TesseraProcessor`` under context parallelism (``processor.ulysses`` set)."""
    from .processors.context import Route

    if route.route is Route.WAN_SELF:
        return ulysses_wan_self_attention(processor, attn, hidden_states, rotary_emb, route, call)
    raise ContextParallelError(
        f"{route.route.value}: context parallelism is supported for Wan2.1 video self-attention only; "
        "HunyuanVideo-1.5 has no _cp_plan in diffusers 0.42.1 and its joint video+text attention is not "
        "split by Tessera — run it without enable_parallelism"
    )


def ulysses_wan_self_attention(
    processor: TesseraProcessor,
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
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    from .processors.wan import apply_wan_rotary

    ulysses: Ulysses = processor.ulysses
    seq = hidden_states.shape[1] * ulysses.degree
    layout = processor.layout_for(call.grid, seq)
    query, key, value = _get_qkv_projections(attn, hidden_states, None)
    query = attn.norm_q(query)  # RMSNorm over all heads: per token, so on the local chunk as well
    key = attn.norm_k(key)
    query = query.unflatten(2, (attn.heads, -1))  # [B, S/N, H, D]
    key = key.unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
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

    pending = ulysses.scatter_heads_async(query, key, value)  # -> [B, S, H/N, D], raster order
    query, key = (layout.to_layout(p.wait()) for p in pending[:2])
    mask, slot = processor.video_mask(route, call, layout, query, key)  # this rank's heads; overlaps v's transfer
    value = layout.to_layout(pending[2].wait())
    if mask is None:
        out = processor.dense_attention(query, key, value)
    else:
        out = processor.backend.attention(query, key, value, mask, slot=slot, cache=processor.cache)
    out = ulysses.gather_heads(layout.to_raster(out))  # [B, S/N, H, D]
    out = out.flatten(2, 3).type_as(query)
    out = attn.to_out[0](out)
    return attn.to_out[1](out)
