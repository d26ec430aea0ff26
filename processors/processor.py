"""TesseraProcessor: one diffusers attention processor for a whole video transformer.

    processor = TesseraProcessor(sparsifier=ssta_384())
    processor.attach(pipe.transformer)   # = set_attn_processor(processor) + the context hook
    video = pipe(...).frames

Video self-attention — Wan2.1 ``attn1``, HunyuanVideo-1.5 joint attention — runs through Tessera
with the sparsifier's masks; every other attention call (Wan cross-attention incl. I2V image
tokens, the HunyuanVideo-1.5 text refiner) goes to the stock processor, untouched.

``pipe.transformer.set_attn_processor(TesseraProcessor(...))`` alone also works: routes are then
recognised per call and layers numbered by first call; the latent grid must then be given
(``latent_grid=``), otherwise the video is treated as one row of tokens (1-D blocks, with a
warning). ``attach`` is the documented way: it knows the grid, step and guidance branch of every
forward (see ``context.py``).

Multi-GPU: with diffusers' ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))``
(before or after ``attach``) the processor runs Ulysses itself; see ``tessera_diffusers.parallel``.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch
from diffusers.hooks.hooks import HookRegistry
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15AttnProcessor2_0,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, WanTransformer3DModel

from tessera_diffusers.errors import InvalidArgumentError, MaskError
from tessera_diffusers.mask import LogicalMask
from tessera_diffusers.parallel import Ulysses, ulysses_processor_call
from tessera_diffusers.sparsifiers.base import LatentGrid
from tessera_diffusers.sparsifiers.layout import TileLayout
from tessera_diffusers.sparsifiers.ssta import ssta_384

from .backends import SparseAttentionBackend, TesseraBackend
from .context import (
    HOOK_NAME,
    ForwardContext,
    IdentityMemo,
    ModuleRoute,
    Route,
    TesseraHook,
    patch_size_of,
)
from .hunyuan_video15 import TextKeys, hunyuan_video15_joint_attention, text_keys
from .plan_cache import DEFAULT_MAX_BYTES, CacheSlot, CacheStats, StepCache
from .wan import wan_self_attention


class TesseraProcessor:
    """Diffusers attention processor routing video self-attention through Tessera.

    Args:
        sparsifier: makes the video masks (default: HunyuanVideo-1.5's SSTA scheme, ``ssta_384()``).
        recompute_every: a layer's mask is recomputed every this many steps and reused in between
            (with its prepared plan).
        cache_bytes: bound on the memory of kept masks and plans (reported by ``stats()``).
        backend: the block-sparse attention implementation (default ``TesseraBackend()``).
        latent_grid: ``(frames, height, width)`` in tokens, for use without ``attach``.
        branches: guidance branches per step when the pipeline opens no ``cache_context``
            (forwards alternate between them).
        share_branch_masks: compute a layer's mask on the first guidance branch of a step and
            reuse it for the others.
    """

    _attention_backend = None  # set by diffusers' ``set_attention_backend``; used for dense calls

    def __init__(
        self,
        sparsifier=None,
        *,
        recompute_every: int = 1,
        cache_bytes: int = DEFAULT_MAX_BYTES,
        backend: SparseAttentionBackend | None = None,
        latent_grid: LatentGrid | tuple[int, int, int] | None = None,
        branches: int = 1,
        share_branch_masks: bool = False,
    ):
        if sparsifier is not None and (not callable(sparsifier) or not hasattr(sparsifier, "layout")):
            raise InvalidArgumentError("sparsifier", "a sparsifier (layout() and __call__)", type(sparsifier).__name__)
        if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
            raise InvalidArgumentError("branches", "an int >= 1", repr(branches))
        self.sparsifier = sparsifier if sparsifier is not None else ssta_384()
        self.cache = StepCache(recompute_every, cache_bytes)
        self.backend = backend if backend is not None else TesseraBackend()
        self.latent_grid = None if latent_grid is None else LatentGrid.of(latent_grid)
        self.branches = branches
        self.share_branch_masks = bool(share_branch_masks)

        self.routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> ModuleRoute
        self.stock: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> original processor
        self.default_stock: dict[type, Any] = {}  # stock processors for modules never attached
        self.models: list[torch.nn.Module] = []
        self.active: ForwardContext | None = None
        self.memo = IdentityMemo()
        self.calls = {route: 0 for route in Route}
        self.sparse_calls = 0
        self.dense_calls = 0
        self.density_sum: torch.Tensor | None = None  # sum of the densities of computed masks (on device)
        self.masks_computed = 0
        self.unattached_forwards = -1  # forward counter without the hook (call-order fallback)
        self.warned: set[str] = set()
        self._parallel = None  # diffusers' ParallelConfig (context parallelism), see ``_parallel_config``
        self.ulysses: Ulysses | None = None

    # ------------------------------------------------------------------ installation
    def attach(self, transformer: torch.nn.Module) -> TesseraProcessor:
        """Install on ``transformer`` (``WanTransformer3DModel`` or ``HunyuanVideo15Transformer3DModel``):
        ``set_attn_processor(self)`` plus a forward hook that tells the processor the latent grid,
        denoising step and guidance branch of every forward. Returns ``self``."""
        if any(model is transformer for model in self.models):
            return self
        if not isinstance(transformer, (WanTransformer3DModel, HunyuanVideo15Transformer3DModel)):
            raise InvalidArgumentError(
                "transformer", "a WanTransformer3DModel or HunyuanVideo15Transformer3DModel", type(transformer).__name__
            )
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        if registry.get_hook(HOOK_NAME) is not None:
            raise InvalidArgumentError(
                "transformer",
                "a transformer without another TesseraProcessor attached (detach that one first)",
                type(transformer).__name__,
            )
        model = len(self.models)
        originals = transformer.attn_processors  # name -> processor, before replacement
        for name, original in originals.items():
            module = transformer.get_submodule(name[: -len(".processor")])
            self.stock[module] = original
        for layer, block in enumerate(getattr(transformer, "blocks", [])):  # Wan
            self.routes[block.attn1] = ModuleRoute(Route.WAN_SELF, model, layer)
            self.routes[block.attn2] = ModuleRoute(Route.STOCK, model, -1)
        for layer, block in enumerate(getattr(transformer, "transformer_blocks", [])):  # HunyuanVideo-1.5
            self.routes[block.attn] = ModuleRoute(Route.HV15_JOINT, model, layer)
        for name in originals:
            module = transformer.get_submodule(name[: -len(".processor")])
            self.routes.setdefault(module, ModuleRoute(Route.STOCK, model, -1))
        transformer.set_attn_processor(self)
        registry.register_hook(TesseraHook(self, model, patch_size_of(transformer)), HOOK_NAME)
        self.models.append(transformer)
        if getattr(transformer, "_parallel_config", None) is not None:  # enable_parallelism ran before attach
            self._parallel_config = transformer._parallel_config
        return self

    def detach(self, transformer: torch.nn.Module) -> None:
        """Restore the processors ``transformer`` had before ``attach`` and remove the hook."""
        if not any(model is transformer for model in self.models):
            raise InvalidArgumentError(
                "transformer", "a transformer this processor is attached to", type(transformer).__name__
            )
        originals = {}
        for name in transformer.attn_processors:
            module = transformer.get_submodule(name[: -len(".processor")])
            originals[name] = self.stock.get(module) or self.stock_processor_for(module)
            self.routes.pop(module, None)
            self.stock.pop(module, None)
        parallel = getattr(transformer, "_parallel_config", None)
        if parallel is not None and parallel.context_parallel_config is not None:
            for original in originals.values():  # as enable_parallelism would have handed it to them
                if hasattr(original, "_parallel_config"):
                    original._parallel_config = parallel
        transformer.set_attn_processor(originals)
        HookRegistry.check_if_exists_or_initialize(transformer).remove_hook(HOOK_NAME, recurse=False)
        self.models = [m for m in self.models if m is not transformer]

    # ------------------------------------------------------------------ context parallelism
    @property
    def _parallel_config(self):
        """diffusers' ``ParallelConfig``, handed to every attention processor by
        ``enable_parallelism``; with context parallelism the processor runs Ulysses itself
        (``tessera_diffusers.parallel``). Ring attention is refused here, at ``enable_parallelism``."""
        return self._parallel

    @_parallel_config.setter
    def _parallel_config(self, config) -> None:
        if config is self._parallel:
            return
        self.ulysses = Ulysses.from_parallel_config(config)
        self._parallel = config

    # ------------------------------------------------------------------ forward context (hook)
    def begin_forward(self, context: ForwardContext) -> None:
        self.active = context

    def end_forward(self) -> None:
        self.active = None

    def new_run(self) -> None:
        """Forget masks and plans (a new video); called by the hook when a pipeline run ends."""
        self.cache.clear()
        self.memo.clear()
        self.unattached_forwards = -1
        self.active = None

    def reset(self) -> None:
        """``new_run`` and zero every counter of ``stats()``."""
        self.new_run()
        self.cache.stats = CacheStats()
        self.calls = {route: 0 for route in Route}
        self.sparse_calls = 0
        self.dense_calls = 0
        self.density_sum = None
        self.masks_computed = 0

    # ------------------------------------------------------------------ the processor call
    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Wan calls ``(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)``
        positionally; the legacy ``Attention`` of HunyuanVideo-1.5 passes keywords and drops any
        keyword the signature does not name — hence both ``rotary_emb`` and ``image_rotary_emb``."""
        route = self.route_of(attn, encoder_hidden_states)
        self.calls[route.route] += 1
        if route.route is Route.STOCK:
            return self.call_stock(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, image_rotary_emb
            )
        call = self.context_for(route, hidden_states.shape[1])
        if self.ulysses is not None:  # context parallelism: tessera_diffusers.parallel
            return ulysses_processor_call(self, attn, hidden_states, rotary_emb, route, call)
        if route.route is Route.WAN_SELF:
            return wan_self_attention(self, attn, hidden_states, rotary_emb, route, call)
        return hunyuan_video15_joint_attention(
            self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, route, call
        )

    def call_stock(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, image_rotary_emb):
        processor = self.stock.get(attn) or self.stock_processor_for(attn)
        if self._attention_backend is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = self._attention_backend
        if isinstance(attn, WanAttention):
            return processor(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        kwargs = {}
        if image_rotary_emb is not None:
            kwargs["image_rotary_emb"] = image_rotary_emb
        return processor(
            attn, hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask, **kwargs
        )

    def stock_processor_for(self, attn: torch.nn.Module) -> Any:
        """The stock processor class of a module (one shared instance per class)."""
        if isinstance(attn, WanAttention):
            cls = WanAttnProcessor
        elif isinstance(attn, Attention) and getattr(attn, "add_q_proj", None) is not None:
            cls = HunyuanVideo15AttnProcessor2_0
        else:
            cls = getattr(type(attn), "_default_processor_cls", None) or AttnProcessor2_0
        if cls not in self.default_stock:
            self.default_stock[cls] = cls()
        return self.default_stock[cls]

    # ------------------------------------------------------------------ routes and context
    def route_of(self, attn: torch.nn.Module, encoder_hidden_states: torch.Tensor | None) -> ModuleRoute:
        route = self.routes.get(attn)
        if route is not None:
            return route
        # Not attached: recognise the call, number layers in first-call order.
        if isinstance(attn, WanAttention) and encoder_hidden_states is None and not attn.is_cross_attention:
            kind = Route.WAN_SELF
        elif (
            isinstance(attn, Attention)
            and encoder_hidden_states is not None
            and getattr(attn, "add_q_proj", None) is not None
        ):
            kind = Route.HV15_JOINT
        else:
            kind = Route.STOCK
        layer = sum(1 for r in self.routes.values() if r.route is kind) if kind is not Route.STOCK else -1
        route = ModuleRoute(kind, 0, layer)
        self.routes[attn] = route
        return route

    def context_for(self, route: ModuleRoute, seq_video: int) -> ForwardContext:
        """The forward context of a sparse call (hook-provided, or the call-order fallback)."""
        if self.active is not None and self.active.model == route.model:
            return self.active
        if route.layer == 0:  # the first layer starts a new forward
            self.unattached_forwards += 1
        forwards = max(self.unattached_forwards, 0)
        grid = self.latent_grid
        return ForwardContext(route.model, grid, forwards // self.branches, f"branch{forwards % self.branches}")

    def layout_for(self, grid: LatentGrid | None, seq_video: int) -> TileLayout:
        """The sparsifier's token layout for this call's video tokens."""
        if grid is None:
            grid = LatentGrid(1, 1, seq_video)
            self.warn_once(
                "tessera: the latent grid is unknown (call TesseraProcessor.attach(transformer) or pass "
                "latent_grid=...); video tokens are treated as one row"
            )
        if grid.num_tokens != seq_video:
            raise InvalidArgumentError(
                "hidden_states", f"{grid.num_tokens} video tokens (latent grid {grid})", f"{seq_video} tokens"
            )
        return self.sparsifier.layout(grid)

    def rotary_in_layout(self, rotary: tuple[torch.Tensor, torch.Tensor], layout: TileLayout, token_dim: int):
        """The rotary tables ``(cos, sin)`` reordered like the tokens (once per forward)."""
        cos, sin = rotary
        return self.memo.get(
            cos,
            ("rope", layout, token_dim, id(sin)),
            lambda: (layout.to_layout(cos, token_dim), layout.to_layout(sin, token_dim)),
        )

    def text_keys_for(self, attention_mask: torch.Tensor | None, batch: int, seq_text: int) -> TextKeys:
        if attention_mask is None:
            return TextKeys(seq_text, None)
        return self.memo.get(
            attention_mask, ("text", batch, seq_text), lambda: text_keys(attention_mask, batch, seq_text)
        )

    # ------------------------------------------------------------------ masks
    def video_mask(
        self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[LogicalMask | None, CacheSlot]:
        """The layer's mask for this step: kept from an earlier step, or made by the sparsifier.

        ``q, k [B, S, H, D]`` in layout order."""
        slot = self.kept_video_slot(route, call, layout, q.shape[0], q.shape[2], q.device)
        return self.new_video_mask(route, call, layout, q, k) if slot is None else (slot.mask, slot)

    def kept_video_slot(
        self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, batch: int, heads: int,
        device: torch.device | str,
    ) -> CacheSlot | None:
        """The slot of a mask kept for this step and these ``batch x heads`` (counted as a sparse
        call), or None when the sparsifier must run (``new_video_mask``)."""
        slot = self.cache.kept_mask(self.mask_key(route, call), call.step, mask_signature(layout, batch, heads, device))
        if slot is not None:
            self.sparse_calls += 1
        return slot

    def new_video_mask(
        self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[LogicalMask | None, CacheSlot]:
        """The sparsifier's mask for this step (None: a dense decision), stored in the step cache."""
        mask = self.sparsify(route, call, layout, q, k)
        return self.keep_video_mask(route, call, layout, mask, q.shape[0], q.shape[2], q.device)

    def sparsify(
        self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, q: torch.Tensor, k: torch.Tensor,
        rank_heads: int | None = None,
    ) -> LogicalMask | None:
        """The sparsifier's mask for ``q, k [B, S, h, D]`` in layout order (None: a dense decision),
        over ``h`` heads or broadcast. Under Ulysses, when q holds this
        rank's ``rank_heads`` heads (q's heads by default), a mask over every rank's heads is cut to
        this rank's; the mask of a head chunk (fewer heads) is returned as it came."""
        mask = self.sparsifier(q, k, layer=route.layer, step=call.step, grid=layout.grid)
        if mask is None or self.ulysses is None or q.shape[2] != (rank_heads or q.shape[2]):
            return mask
        return self.ulysses.local_mask(mask, q.shape[2] * self.ulysses.degree)

    def keep_video_mask(
        self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, mask: LogicalMask | None,
        batch: int, heads: int, device: torch.device | str,
    ) -> tuple[LogicalMask | None, CacheSlot]:
        """Check a new mask for ``batch x heads`` and store it in the step cache (see ``new_video_mask``)."""
        if mask is not None:
            check_video_mask(mask, batch, heads, layout)
            self.record_density(mask)
        signature = mask_signature(layout, batch, heads, device)
        slot = self.cache.store_mask(self.mask_key(route, call), mask, call.step, signature)
        if slot.mask is None:
            self.dense_calls += 1
        else:
            self.sparse_calls += 1
        return slot.mask, slot

    def mask_key(self, route: ModuleRoute, call: ForwardContext) -> tuple:
        return (route.model, route.layer, "*" if self.share_branch_masks else call.branch)

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Full attention without a mask tensor for ``q, k, v [B, S, H, D]`` (the dense decisions of
        a sparsifier), through diffusers' dispatcher and the backend set with
        ``set_attention_backend`` (if any)."""
        return dispatch_attention_fn(
            q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )

    def record_density(self, mask: LogicalMask) -> None:
        density = mask.blocks.float().mean()  # stays on the device: no sync in the loop
        if self.density_sum is None or self.density_sum.device != density.device:
            self.density_sum = density
        else:
            self.density_sum = self.density_sum + density
        self.masks_computed += 1

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        """Calls per route, sparse/dense decisions, the mean block density of the masks the sparsifier
        made (one host sync), cache reuse and memory (bytes)."""
        density = math.nan if self.density_sum is None else float(self.density_sum) / self.masks_computed
        return {
            "calls": {route.value: n for route, n in self.calls.items()},
            "sparse_calls": self.sparse_calls,
            "dense_calls": self.dense_calls,
            "masks_computed": self.masks_computed,
            "mean_mask_density": density,
            "cache": self.cache.report(),
        }

    def warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, stacklevel=3)

    def __repr__(self) -> str:
        return (
            f"TesseraProcessor(sparsifier={self.sparsifier!r}, backend={self.backend.name}, "
            f"recompute_every={self.cache.recompute_every}, attached={len(self.models)})"
        )


def mask_signature(layout: TileLayout, batch: int, heads: int, device: torch.device | str) -> tuple:
    """What a kept video mask is valid for: its token order, batch, heads and device."""
    return (layout, batch, heads, str(device))


def check_video_mask(mask: LogicalMask, batch: int, heads: int, layout: TileLayout) -> None:
    """Raise unless a sparsifier's mask covers the call's video tokens and broadcasts to (B, H)."""
    if not isinstance(mask, LogicalMask):
        raise MaskError("sparsifier result", "a LogicalMask or None", type(mask).__name__)
    seq = layout.num_tokens
    if (mask.seq_len_q, mask.seq_len_kv) != (seq, seq):
        raise MaskError(
            "sparsifier result", f"a mask over ({seq}, {seq}) video tokens", (mask.seq_len_q, mask.seq_len_kv)
        )
    mask.check_broadcast(batch, heads)
