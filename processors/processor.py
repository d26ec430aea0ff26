"""TesseraProcessor: one diffusers attention processor for a whole video transformer.

    pipe.transformer.set_attn_processor(TesseraProcessor())
    video = pipe(...).frames

Video self-attention — Wan2.1 ``attn1``, HunyuanVideo-1.5 joint attention — runs through Tessera
with the sparsifier's masks; every other attention call (Wan cross-attention incl. I2V image
tokens, the HunyuanVideo-1.5 text refiner) goes to the stock processor, untouched.

The one line is enough: the processor reads each forward's latent grid off the rotary table the
models hand it, and receives the pipeline's step and guidance branch through its own diffusers hook
(see ``context.py``). ``attach(transformer)`` is the explicit form with identical results: it also
numbers layers by block index, reads the grid from the latents, and is required for context
parallelism (``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))``, before or after
``attach``; see ``tessera_diffusers.parallel``).

Defaults, per model (``TesseraProcessor()`` with no sparsifier):

    HunyuanVideo-1.5   its own SSTA setting: 6 x 8 x 8 tiles, 3 x 3 x 3 window + top-k 64 (32 for
                       <= 31 latent frames), text dense
    Wan2.1             SSTA-style 6 x 8 x 8 tiles, 1 x 3 x 3 window + top-k chosen per grid for
                       ~10 % block density (``WAN_DEFAULT``; ``spade_64`` one argument away)

both after ``DEFAULT_WARMUP_STEPS`` dense steps. Masks are recomputed every step
(``recompute_every``); each layer keeps its plan-table decision from its first sparse step on.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
import weakref
from typing import Any

import torch

from tessera_diffusers.errors import InvalidArgumentError, MaskError
from tessera_diffusers.mask import LogicalMask
from tessera_diffusers.parallel import Ulysses
from tessera_diffusers.plans import INPUT_PRECISION, PRECISIONS
from tessera_diffusers.sparsifiers.adaptive import spade_64
from tessera_diffusers.sparsifiers.base import LatentGrid, Sparsifier
from tessera_diffusers.sparsifiers.layout import TileLayout
from tessera_diffusers.sparsifiers.ssta import ssta_384, ssta_tuned
from tessera_diffusers.sparsifiers.warmup import DenseWarmup

from .backends import AttentionTimer, SparseAttentionBackend, TesseraBackend, TimedBackend
from .compat import (
    VIDEO_TRANSFORMERS,
    Attention,
    AttnProcessor2_0,
    HookRegistry,
    HunyuanVideo15AttnProcessor2_0,
    WanAttention,
    WanAttnProcessor,
    cached_child_registries,
    default_processor_cls,
    dispatch_attention_fn,
    hand_attention_backend,
    hand_parallel_config,
    hook_registry_of,
    invalidate_child_registries,
    parallel_config_of,
)
from .compiled import CompiledCalls, register, returns_pair, traced_call
from .context import (
    HOOK_NAME,
    ForwardContext,
    GridReader,
    IdentityMemo,
    ModelRun,
    ModuleRoute,
    ProcessorHook,
    Route,
    TesseraHook,
    patch_size_of,
    running_transformer,
)
from .hunyuan_video15 import TextKeys, check_joint_attention_call, hunyuan_video15_joint_attention, text_keys
from .plan_cache import CacheSlot, CacheStats, StepCache
from .ulysses import ulysses_processor_call
from .wan import check_wan_self_attention_call, wan_self_attention

# Denoising steps kept dense before the sparse masks start: 20 % of the 50 steps both pipelines run
# by default. Sparse video attention keeps the first, layout-forming steps dense; the number is a
# trade between fidelity and speed (each dense step costs a full attention pass).
DEFAULT_WARMUP_STEPS = 10
# Block density of Wan2.1's default masks.
WAN_DENSITY = 0.10
# Wan2.1's default sparsifier: "ssta_tuned" (6 x 8 x 8 tiles, 1 x 3 x 3 window + top-k at the budget),
# which ran the full-depth 720p step faster than "spade_64" (input-adaptive, 64 x 64 blocks, heads
# sharing the budget) at the same density (docs/results.md). The other is one argument away:
# TesseraProcessor(DenseWarmup(spade_64(), steps=DEFAULT_WARMUP_STEPS)).
WAN_DEFAULT = "ssta_tuned"
# Kept masks and plans are bounded by this many times the bytes of one sparse call's hidden states
# (Wan2.1-14B at 720p: 2 x 774 MB; HunyuanVideo-1.5 at 720p: 2 x 457 MB), unless cache_bytes says.
CACHE_SCALE = 2
CONTEXT_HOOK_NAME = "tessera_processor_context"


def default_sparsifier(route: Route, warmup_steps: int = DEFAULT_WARMUP_STEPS) -> Sparsifier:
    """The sparsifier ``TesseraProcessor()`` uses for a route when none is given."""
    if route is Route.HV15_JOINT:
        inner = ssta_384()
    elif WAN_DEFAULT == "spade_64":
        inner = spade_64(WAN_DENSITY)
    else:
        inner = ssta_tuned(WAN_DENSITY)
    return DenseWarmup(inner, steps=warmup_steps) if warmup_steps else inner


class TesseraProcessor(torch.nn.Module):
    r"""Diffusers attention processor routing video self-attention through Tessera.

    It is an ``nn.Module`` without parameters so that, once installed, it is part of the transformer:
    the pipeline's ``cache_context`` and end-of-run reset reach its hook (see ``context.py``). One
    instance may serve several transformers (Wan2.2's ``transformer`` and ``transformer_2``, two
    pipelines): each keeps its own layers, steps, masks and plans, one's end of run leaves the
    others' alone, and ``stats()`` reports their totals. Threads may share it, each running its own
    transformer (one processor call at a time under its lock; ``attach``'s forward context is per
    thread); two threads in one transformer at once are two runs diffusers itself cannot tell apart.

    Args:
        sparsifier: makes the video masks; None: the per-model default (``default_sparsifier``).
        recompute_every: a layer's mask is recomputed every this many steps and reused in between
            (with its prepared plan); 1 keeps no mask past its call.
        cache_bytes: bound on the memory of kept masks and plans; None: ``CACHE_SCALE`` times the
            bytes of the first sparse call's hidden states (reported by ``stats()``).
        backend: the block-sparse attention implementation (default ``TesseraBackend()``: a
            plan-table decision per layer, reused from its first sparse step on).
        latent_grid: ``(frames, height, width)`` in tokens; None: read from the rotary embedding or
            given by ``attach``.
        branches: guidance branches per step when the pipeline opens no ``cache_context``
            (forwards alternate between them).
        share_branch_masks: compute a layer's mask on the first guidance branch of a step and
            reuse it for the others.
        time_attention: time every attention call (sparse and dense; CUDA events on a GPU), reported
            as ``stats()["attention_ms"]``.
        warmup_steps: dense denoising steps before the masks start: the defaults' number
            (``DEFAULT_WARMUP_STEPS``) when None; with a sparsifier given, None adds none.
        precision: ``"input"`` (default): sparse attention in the model's dtype. ``"int8"``: on
            the 8-bit kernels (``block_sparse_attention``'s ``precision``; Hopper, head dim 128;
            elsewhere the 16-bit path with a warning). Dense calls (the warm-up steps, text
            attention) stay in the model's dtype. For the default backend; a ``backend`` given
            carries its own.
    """

    _attention_backend = None  # set by diffusers' ``set_attention_backend`` (compat.py); used for dense calls

    def __init__(
        self,
        sparsifier: Sparsifier | None = None,
        *,
        recompute_every: int = 1,
        cache_bytes: int | None = None,
        backend: SparseAttentionBackend | None = None,
        latent_grid: LatentGrid | tuple[int, int, int] | None = None,
        branches: int = 1,
        share_branch_masks: bool = False,
        time_attention: bool = False,
        warmup_steps: int | None = None,
        precision: str = INPUT_PRECISION,
    ):
        super().__init__()
        if precision not in PRECISIONS:
            raise InvalidArgumentError("precision", f"one of {PRECISIONS}", repr(precision))
        if backend is not None and precision != INPUT_PRECISION:
            raise InvalidArgumentError("precision", f"{INPUT_PRECISION!r} when a backend is given (set the "
                                       "precision on the backend, e.g. TesseraBackend(precision=...))",
                                       repr(precision))
        if sparsifier is not None and (not callable(sparsifier) or not hasattr(sparsifier, "layout")):
            raise InvalidArgumentError("sparsifier", "a sparsifier (layout() and __call__)", type(sparsifier).__name__)
        if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
            raise InvalidArgumentError("branches", "an int >= 1", repr(branches))
        if warmup_steps is not None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
                                         or warmup_steps < 0):
            raise InvalidArgumentError("warmup_steps", "None or an int >= 0", repr(warmup_steps))
        self.warmup_steps = warmup_steps
        if sparsifier is not None and warmup_steps:
            sparsifier = DenseWarmup(sparsifier, steps=warmup_steps)
        self.sparsifier = sparsifier
        self.defaults: dict[Route, Sparsifier] = {}  # per-model defaults, chosen at a route's first call
        self.share_branch_masks = bool(share_branch_masks)
        keep = isinstance(recompute_every, int) and recompute_every > 1 or self.share_branch_masks
        self.cache = StepCache(recompute_every, cache_bytes, keep_masks=keep)
        self.timer = AttentionTimer() if time_attention else None
        backend = backend if backend is not None else TesseraBackend(precision=precision)
        self.backend = backend if self.timer is None else TimedBackend(backend, self.timer)
        self.latent_grid = None if latent_grid is None else LatentGrid.of(latent_grid)
        self.branches = branches

        self.routes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> ModuleRoute
        self.stock: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> original processor
        self.default_stock: dict[type, Any] = {}  # stock processors for modules never attached
        self.models: list[torch.nn.Module] = []
        # Each transformer served (attached or not) has a model index of its own: its masks, plans and
        # step count are kept apart, so that one transformer's end of run leaves another's alone.
        self.model_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transformer -> model index
        self.loose_model: int | None = None  # the index of calls made outside any known transformer
        self.model_count = 0
        self.runs: dict[int, ModelRun] = {}  # model index -> its run in progress (from its first sparse call)
        self._lock = threading.RLock()  # one processor call, run reset or hook event at a time
        self._forward = threading.local()  # attach's context of the forward running in each thread
        self.last_context: dict[ModuleRoute, ForwardContext] = {}  # for recomputation in backward
        self.refreshed: weakref.WeakSet = weakref.WeakSet()  # transformers whose hook cache was checked
        self.memo = IdentityMemo()
        self.grids = GridReader()
        self.calls = {route: 0 for route in Route}
        self.sparse_calls = 0
        self.dense_calls = 0
        self.density_sum: torch.Tensor | None = None  # sum of the densities of computed masks (on device)
        self.masks_computed = 0
        self.warned: set[str] = set()
        self._parallel = None  # diffusers' ParallelConfig (context parallelism), see ``_parallel_config``
        self.ulysses: Ulysses | None = None
        self.hook = ProcessorHook(self)
        HookRegistry.check_if_exists_or_initialize(self).register_hook(self.hook, CONTEXT_HOOK_NAME)
        self.compile_key = register(self)  # how compiled graphs reach this processor (compiled.py)
        self.compiled = CompiledCalls()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"], state["_forward"]
        return state

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.deepcopy, pickle) is a processor of its own: its own lock and per-thread
        # context, and a key of its own, so that compiled graphs do not reach it under the original's
        super().__setstate__(state)
        self._lock = threading.RLock()
        self._forward = threading.local()
        self.compile_key = register(self)
        self.compiled = CompiledCalls()

    @property
    def active(self) -> ForwardContext | None:
        """``attach``'s context of the forward running in this thread (its hook sets it), or None."""
        return getattr(self._forward, "context", None)

    @active.setter
    def active(self, context: ForwardContext | None) -> None:
        self._forward.context = context

    # ------------------------------------------------------------------ installation
    def attach(self, transformer: torch.nn.Module) -> TesseraProcessor:
        """Install on ``transformer`` (``WanTransformer3DModel`` or ``HunyuanVideo15Transformer3DModel``):
        ``set_attn_processor(self)`` plus a forward hook that tells the processor the latent grid,
        denoising step and guidance branch of every forward, and layer numbers by block index.
        Returns ``self``."""
        if any(model is transformer for model in self.models):
            return self
        if not isinstance(transformer, VIDEO_TRANSFORMERS):
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
        model = self.model_index(transformer)
        originals = transformer.attn_processors  # name -> processor, before replacement
        for name, original in originals.items():
            module = transformer.get_submodule(name[: -len(".processor")])
            if original is not self:
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
        invalidate_child_registries(registry)  # cache_context reaches the processor's hook too
        self.models.append(transformer)
        if parallel_config_of(transformer) is not None:  # enable_parallelism ran before attach
            self._parallel_config = parallel_config_of(transformer)
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
        parallel = parallel_config_of(transformer)
        if parallel is not None and parallel.context_parallel_config is not None:
            for original in originals.values():  # as enable_parallelism would have handed it to them
                hand_parallel_config(original, parallel)
        transformer.set_attn_processor(originals)
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.remove_hook(HOOK_NAME, recurse=False)
        invalidate_child_registries(registry)
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

    # ------------------------------------------------------------------ forward context (hooks)
    def begin_forward(self, context: ForwardContext) -> None:
        self.active = context

    def end_forward(self) -> None:
        self.active = None

    def model_index(self, transformer: torch.nn.Module | None) -> int:
        """The index under which ``transformer``'s layers, steps, masks and plans are kept (the same
        for the processor's lifetime); calls made outside any Wan2.1 or HunyuanVideo-1.5 forward
        (``None``) share one."""
        if transformer is None:
            if self.loose_model is None:
                self.loose_model = self.new_model_index()
            return self.loose_model
        index = self.model_ids.get(transformer)
        if index is None:
            index = self.model_ids[transformer] = self.new_model_index()
        return index

    def new_model_index(self) -> int:
        self.model_count += 1
        return self.model_count - 1

    def new_run(self, model: int | None = None) -> None:
        """Forget the masks, plans and step count of one transformer's run (``model``: its index), or
        of every run (None): a new video. The hooks call it when a pipeline's run ends; the helper
        masks shared by every transformer (dense text parts) go with the last run in progress."""
        with self._lock:
            self.memo.clear()  # derived from live tensors only: a cache, not run state
            if model is not None:
                alive = {*self.model_ids.values(), self.loose_model}
                ended = {model, *(m for m in self.runs if m not in alive)}  # and the runs of collected transformers
                for index in ended:
                    self.runs.pop(index, None)
                    self.cache.clear(index)
                self.last_context = {route: call for route, call in self.last_context.items() if route.model not in ended}
                if self.active is not None and self.active.model in ended:
                    self.active = None
                if self.runs:  # another transformer is mid-run: its masks, plans and counts stay
                    return
            self.runs.clear()
            self.cache.clear()
            self.last_context.clear()
            self.active = None

    def run_ended(self, transformer: torch.nn.Module | None) -> None:
        """A reset of ``transformer``'s stateful hooks reached the processor (the end of its pipeline
        run): forget that transformer's run; every run when it cannot be told (None)."""
        with self._lock:
            if transformer is None:
                self.new_run()
                return
            model = self.model_ids.get(transformer, self.loose_model)
            if model is not None:
                self.new_run(model)

    def reset(self) -> None:
        """``new_run`` of every transformer's run and zero every counter of ``stats()``."""
        with self._lock:
            self.new_run()
            self.cache.stats = CacheStats()
            self.calls = {route: 0 for route in Route}
            self.sparse_calls = 0
            self.dense_calls = 0
            self.density_sum = None
            self.masks_computed = 0
            if self.timer is not None:
                self.timer.reset()
            if self.tessera_backend is not None:
                self.tessera_backend.reset_counts()

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
        keyword the signature does not name — hence both ``rotary_emb`` and ``image_rotary_emb``.
        Inside ``torch.compile`` the call becomes one opaque op that runs ``eager_call`` (compiled.py)."""
        if torch.compiler.is_compiling():
            return traced_call(
                self.compile_key, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                image_rotary_emb,
            )
        return self.eager_call(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, image_rotary_emb)

    @torch.compiler.disable  # masks and plans are data-dependent host decisions, never traced
    def eager_call(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """The processor call, outside any compiled graph; one at a time (threads may share a processor)."""
        with self._lock:
            route = self.route_of(attn, encoder_hidden_states)
            if route.route is Route.WAN_SELF:  # the sparse routes refuse what they would otherwise ignore
                check_wan_self_attention_call(encoder_hidden_states, attention_mask, image_rotary_emb)
            elif route.route is Route.HV15_JOINT:
                check_joint_attention_call(encoder_hidden_states, attention_mask, rotary_emb)
            recomputing = in_backward()  # activation checkpointing replays this call in the backward pass
            if not recomputing:
                self.calls[route.route] += 1
            if route.route is Route.STOCK:
                return self.call_stock(
                    attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, image_rotary_emb
                )
            rotary = rotary_emb if route.route is Route.WAN_SELF else image_rotary_emb
            call = self.context_for(route, hidden_states.shape[1], rotary, recomputing)
            if self.cache.max_bytes is None:
                self.cache.max_bytes = CACHE_SCALE * hidden_states.numel() * hidden_states.element_size()
            if self.ulysses is not None:  # context parallelism: ulysses.py
                return ulysses_processor_call(self, attn, hidden_states, rotary_emb, route, call)
            if route.route is Route.WAN_SELF:
                return wan_self_attention(self, attn, hidden_states, rotary_emb, route, call)
            return hunyuan_video15_joint_attention(
                self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, route, call
            )

    def call_stock(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, image_rotary_emb):
        processor = self.stock.get(attn) or self.stock_processor_for(attn)
        hand_attention_backend(processor, self._attention_backend)
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
            cls = default_processor_cls(attn) or AttnProcessor2_0
        if cls not in self.default_stock:
            self.default_stock[cls] = cls()
        return self.default_stock[cls]

    # ------------------------------------------------------------------ routes and context
    def served_attention_modules(self) -> list[torch.nn.Module]:
        """The attention modules this processor is installed on, in the transformers it knows: those
        attached, the one whose forward is running, and every module it has routed."""
        transformers = [*self.models, running_transformer()]
        modules = [m for t in transformers if t is not None for m in t.modules()]
        modules += list(self.routes.keys())
        return [m for m in modules if getattr(m, "processor", None) is self]

    def route_of(self, attn: torch.nn.Module, encoder_hidden_states: torch.Tensor | None) -> ModuleRoute:
        route = self.routes.get(attn)
        if route is not None:
            return route
        # Not attached: recognise the call, number the transformer's layers in first-call order.
        if isinstance(attn, WanAttention) and encoder_hidden_states is None and not attn.is_cross_attention:
            kind = Route.WAN_SELF
        elif returns_pair(attn, encoder_hidden_states):  # joint attention (HunyuanVideo-1.5)
            kind = Route.HV15_JOINT
        else:
            kind = Route.STOCK
        model = self.model_index(running_transformer())
        layer = -1
        if kind is not Route.STOCK:
            layer = sum(1 for r in self.routes.values() if r.route is kind and r.model == model)
        route = ModuleRoute(kind, model, layer)
        self.routes[attn] = route
        return route

    def context_for(
        self,
        route: ModuleRoute,
        seq_video: int,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        recomputing: bool = False,
    ) -> ForwardContext:
        """The forward context of a sparse call: ``attach``'s, or the processor's own (the grid from
        ``latent_grid`` or the rotary table; step and branch from its hook). A call recomputed in
        the backward pass (activation checkpointing) gets the context of its forward."""
        run = self.runs.get(route.model)
        if run is None:
            run = self.runs[route.model] = ModelRun()
        if self.active is not None and self.active.model == route.model:
            return self.active
        if recomputing and route in self.last_context:
            return self.last_context[route]
        if route.layer == 0:  # the transformer's first sparse layer starts its forward
            context = self.hook.context()
            if context is None:
                self.reach_pipeline_context()
            run.where = run.counter.next(context, self.branches)
        grid = self.latent_grid
        if grid is None and rotary is not None and self.ulysses is None:
            grid = self.memo.get(rotary[0], ("grid", seq_video), lambda: self.grids(rotary, seq_video))
        branch, step = run.where
        call = ForwardContext(route.model, grid, step, branch)
        self.last_context[route] = call
        return call

    def reach_pipeline_context(self) -> None:
        """Make the pipeline's ``cache_context`` reach this processor's hook when it cannot yet.

        diffusers caches, per transformer, the hooks its ``cache_context`` visits; a transformer that
        opened one before the processor was installed does not know the processor's hook. Found
        through the call stack (the transformer whose forward is running), its cache is refreshed
        once: the next forwards carry their step and branch (this one counts as a forward without
        context, and the user is told)."""
        transformer = running_transformer()
        if transformer is None or transformer in self.refreshed:
            return
        self.refreshed.add(transformer)
        registry = hook_registry_of(transformer)
        cached = None if registry is None else cached_child_registries(registry)
        if cached is None or any(child is hook_registry_of(self) for child in cached):
            return  # nothing cached (each cache_context walks the tree), or the processor's hook is in it
        invalidate_child_registries(registry)
        self.warn_once(
            "tessera: this transformer opened a cache_context before TesseraProcessor was installed; the pipeline's "
            "step and guidance branch reach the processor from the next forward on, and this forward counts as the "
            "run's first (TesseraProcessor().attach(transformer) needs no such catch-up)"
        )

    def sparsifier_for(self, route: ModuleRoute | Route) -> Sparsifier:
        """The sparsifier of a route: the one given, or the model's default."""
        if self.sparsifier is not None:
            return self.sparsifier
        kind = route.route if isinstance(route, ModuleRoute) else route
        chosen = self.defaults.get(kind)
        if chosen is None:
            steps = DEFAULT_WARMUP_STEPS if self.warmup_steps is None else self.warmup_steps
            chosen = self.defaults[kind] = default_sparsifier(kind, steps)
        return chosen

    def layout_for(self, route: ModuleRoute, grid: LatentGrid | None, seq_video: int) -> TileLayout:
        """The sparsifier's token layout for this call's video tokens."""
        if grid is None:
            raise InvalidArgumentError(
                "latent grid",
                "the video's (frames, height, width) in tokens: read from the rotary embedding of Wan2.1 or "
                "HunyuanVideo-1.5, given by TesseraProcessor.attach(transformer), or passed as "
                "TesseraProcessor(latent_grid=(frames, height, width))",
                f"none of them for a call over {seq_video} video tokens",
            )
        if grid.num_tokens != seq_video:
            raise InvalidArgumentError(
                "hidden_states", f"{grid.num_tokens} video tokens (latent grid {grid})", f"{seq_video} tokens"
            )
        return self.sparsifier_for(route).layout(grid)

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
        over ``h`` heads or broadcast, computed outside autograd (a mask is an index set). Under
        Ulysses, when q holds this rank's ``rank_heads`` heads (q's heads by default), a mask over
        every rank's heads is cut to this rank's; the mask of a head chunk (fewer heads) is returned
        as it came."""
        with torch.no_grad():
            mask = self.sparsifier_for(route)(q, k, layer=route.layer, step=call.step, grid=layout.grid)
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
        with contextlib.nullcontext() if self.timer is None else self.timer.span(q.device):
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
    def chosen_sparsifiers(self) -> dict[str, str]:
        """The sparsifier of every sparse route seen so far (the given one, or the model's default)."""
        if self.sparsifier is not None:
            return {"all": repr(self.sparsifier)}
        return {route.value: repr(sparsifier) for route, sparsifier in self.defaults.items()}

    def stats(self) -> dict:
        """What the processor chose and did: the sparsifier per model route, calls per route,
        sparse/dense decisions, the mean block density of the masks it made (one host sync), the
        sparse calls' precision, the layers' reuse of their plan-table decisions, the attention
        time (with ``time_attention``) and the step cache's reuse and memory (bytes)."""
        density = math.nan if self.density_sum is None else float(self.density_sum) / self.masks_computed
        report = {
            "sparsifiers": self.chosen_sparsifiers(),
            "calls": {route.value: n for route, n in self.calls.items()},
            "sparse_calls": self.sparse_calls,
            "dense_calls": self.dense_calls,
            "masks_computed": self.masks_computed,
            "mean_mask_density": density,
        }
        if self.tessera_backend is not None:
            report["precision"] = self.tessera_backend.precision
            report["plans"] = self.tessera_backend.plan_report(keys=lambda key: isinstance(key, tuple) and key[:1] != ("dense",))
        if self.timer is not None:
            report["attention_ms"] = self.timer.total_ms()
            report["attention_calls"] = self.timer.calls
        report["cache"] = self.cache.report()
        return report

    @property
    def tessera_backend(self) -> TesseraBackend | None:
        """The ``TesseraBackend`` behind ``backend`` (timed or not), or None for another backend."""
        backend = self.backend.inner if isinstance(self.backend, TimedBackend) else self.backend
        return backend if isinstance(backend, TesseraBackend) else None

    def warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, stacklevel=3)

    def __repr__(self) -> str:
        if self.sparsifier is not None:
            sparsifier = repr(self.sparsifier)
        else:
            chosen = ", ".join(f"{route.value}: {s!r}" for route, s in self.defaults.items())
            sparsifier = f"per-model default ({chosen or 'chosen at the first call'})"
        budget = "auto" if self.cache.max_bytes is None else f"{self.cache.max_bytes / 2**20:.1f} MiB"
        return (
            f"TesseraProcessor(sparsifier={sparsifier}, backend={self.backend.name}, "
            f"recompute_every={self.cache.recompute_every}, cache_bytes={budget}, attached={len(self.models)})"
        )


def in_backward() -> bool:
    """Whether this runs inside the autograd engine's backward pass (a checkpointed forward replayed)."""
    return torch._C._current_graph_task_id() != -1


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
