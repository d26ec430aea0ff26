"""What an attention call needs to know besides its tensors: the latent grid, the layer, the
denoising step and the guidance branch — and how the processor learns them.

- **Layer and route.** ``attach`` builds a route table: ``blocks[i].attn1`` of Wan is "video
  self-attention of layer i", ``transformer_blocks[i].attn`` of HunyuanVideo-1.5 is "joint attention
  of layer i"; every other attention module keeps its stock processor. Installed with
  ``set_attn_processor`` alone, the processor recognises the route from the module class and the
  call, and numbers each transformer's layers in the order their modules are first called.
- **Latent grid.** ``attach``'s ``TesseraHook`` reads ``hidden_states [B, C, F, H, W]`` and the patch
  size before each forward; alone, the processor reads the grid off the 3-D rotary table both models
  hand every video attention call (``grid_from_rotary``, once per forward). Where neither is there,
  the call raises and says what to pass (``latent_grid=``).
- **Step and branch.** Diffusers pipelines open a ``cache_context`` around every denoiser call (name =
  guidance branch, "cond"/"uncond" for Wan or "pred_cond"/"pred_uncond" for HunyuanVideo-1.5;
  ``step_index`` where the pipeline gives it) and hand it to every stateful hook under the
  transformer. The processor is a module of the transformer once installed (diffusers registers a
  processor that is an ``nn.Module`` under each attention module), so its own ``ProcessorHook``
  receives the context with no ``attach``. Without ``step_index``, forwards are counted per branch;
  without any context, forwards are counted and split into ``branches`` alternating branches.
  Pipelines reset stateful hooks at the end of a run (``maybe_free_model_hooks``), which restarts
  the counts and drops the masks and plans of that video.
- **Several transformers, one processor.** A processor may serve several transformers at once (Wan2.2's
  ``transformer`` and ``transformer_2``, two pipelines given the same instance): each transformer
  gets a model index of its own (``ModuleRoute.model``), under which its layers are numbered, its
  steps counted (``ModelRun``) and its masks and plans kept. A reset reaches the processor through
  every transformer it is installed in, so it forgets only the run of the transformer being reset
  (``TesseraHook`` knows its transformer; ``ProcessorHook`` finds it on the call stack,
  ``running_transformer``); ``TesseraProcessor.reset()`` forgets every run.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from tessera_diffusers.errors import InvalidArgumentError, describe_tensor
from tessera_diffusers.mask import LogicalMask
from tessera_diffusers.parallel import Ulysses
from tessera_diffusers.sparsifiers.base import LatentGrid, Sparsifier
from tessera_diffusers.sparsifiers.layout import TileLayout

from .backends import SparseAttentionBackend
from .compat import (
    VIDEO_TRANSFORMERS,
    BaseState,
    HookRegistry,
    ModelHook,
    StateManager,
    cache_context_of,
    registry_module,
)
from .plan_cache import CacheSlot, StepCache

HOOK_NAME = "tessera_context"


class Route(str, Enum):
    """What the processor does with one attention module."""

    WAN_SELF = "wan_self_attention"  # sparse video self-attention (Wan attn1)
    HV15_JOINT = "hunyuan_video15_joint_attention"  # sparse video + dense text (HunyuanVideo-1.5)
    STOCK = "stock"  # handed to the stock processor (Wan attn2, the HunyuanVideo-1.5 refiner, ...)


@dataclass(frozen=True)
class ModuleRoute:
    route: Route
    model: int  # index of the transformer the module belongs to (``TesseraProcessor.model_index``)
    layer: int  # transformer block index (-1 for stock routes)


@dataclass(frozen=True)
class ForwardContext:
    """Where the denoising loop is, for one transformer forward."""

    model: int
    grid: LatentGrid | None
    step: int
    branch: str


class ProcessorLike(Protocol):
    """What the hooks here and the routes of wan.py, hunyuan_video15.py and ulysses.py use of the
    processor that hands itself to them (``processor.TesseraProcessor``, named so that they need
    not import processor.py back)."""

    backend: SparseAttentionBackend
    cache: StepCache
    branches: int
    ulysses: Ulysses | None

    def begin_forward(self, context: ForwardContext) -> None: ...

    def end_forward(self) -> None: ...

    def new_run(self, model: int | None = None) -> None: ...

    def run_ended(self, transformer: torch.nn.Module | None) -> None: ...

    def sparsifier_for(self, route: ModuleRoute | Route) -> Sparsifier: ...

    def layout_for(self, route: ModuleRoute, grid: LatentGrid | None, seq_video: int) -> TileLayout: ...

    def rotary_in_layout(self, rotary: tuple[torch.Tensor, torch.Tensor], layout: TileLayout, token_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def text_keys_for(self, attention_mask: torch.Tensor | None, batch: int, seq_text: int) -> Any: ...

    def video_mask(self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, q: torch.Tensor,
                   k: torch.Tensor) -> tuple[LogicalMask | None, CacheSlot]: ...

    def kept_video_slot(self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, batch: int, heads: int,
                        device: torch.device | str) -> CacheSlot | None: ...

    def sparsify(self, route: ModuleRoute, call: ForwardContext, layout: TileLayout, q: torch.Tensor,
                 k: torch.Tensor, rank_heads: int | None = None) -> LogicalMask | None: ...

    def keep_video_mask(self, route: ModuleRoute, call: ForwardContext, layout: TileLayout,
                        mask: LogicalMask | None, batch: int, heads: int, device: torch.device | str
                        ) -> tuple[LogicalMask | None, CacheSlot]: ...

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class HookState(BaseState):
    """Per-context state diffusers asks stateful hooks for (the Tessera hook keeps none)."""

    def reset(self, *args, **kwargs) -> None:
        pass


def patch_size_of(transformer: torch.nn.Module) -> tuple[int, int, int]:
    """``(pt, ph, pw)`` of a diffusers video transformer's patch embedding."""
    config = getattr(transformer, "config", None)
    patch = getattr(config, "patch_size", None)
    if hasattr(config, "patch_size_t"):  # HunyuanVideo-1.5: patch_size_t and a square patch_size
        return (int(config.patch_size_t), int(patch), int(patch))
    if isinstance(patch, (tuple, list)) and len(patch) == 3:  # Wan: (pt, ph, pw)
        return tuple(int(p) for p in patch)  # type: ignore[return-value]
    if isinstance(patch, int):
        return (1, patch, patch)
    raise InvalidArgumentError(
        "transformer", "a video transformer whose config has patch_size (and patch_size_t)", type(transformer).__name__
    )


def grid_from_rotary(rotary: tuple[torch.Tensor, torch.Tensor], seq: int) -> LatentGrid:
    """The latent grid behind a 3-D rotary table, for ``seq`` video tokens in raster order.

    Both video transformers build ``(cos, sin)`` from the latent grid with the channels of the
    frame, height and width axes in that order (Wan2.1: ``[1, S, 1, D]``; HunyuanVideo-1.5:
    ``[S, D]``). A channel of an axis equals token 0's value until that axis first moves off 0, which
    happens at the axis's raster stride (width 1, height ``W``, frames ``H * W``); the channels of an
    axis of size 1 never move. So the run of each axis's channels gives its stride, the strides give
    the grid, and the grid is checked against every token of the table. Raises ``InvalidArgumentError``
    when the table is not such a table (another model, or a sequence split for context parallelism)."""
    return derive_grid(rotary_table(rotary, seq), seq)[0]


class GridReader:
    """Reads the latent grid off each forward's rotary table: in full (``grid_from_rotary``) the first
    time a table shape comes, then by checking the remembered grid on the few tokens where its axes
    wrap (one small device read). Two grids of as many tokens (a portrait and a landscape video) differ
    on those tokens, so a changed grid is read in full again."""

    def __init__(self) -> None:
        self.known: dict[tuple, tuple[LatentGrid, list[int]]] = {}  # (S, channels, dtype, device) -> grid, strides

    def __call__(self, rotary: tuple[torch.Tensor, torch.Tensor], seq: int) -> LatentGrid:
        table = rotary_table(rotary, seq)
        key = (seq, table.shape[1], table.dtype, str(table.device))
        known = self.known.get(key)
        if known is not None and wraps_match(table, *known):
            return known[0]
        grid, strides = derive_grid(table, seq)
        self.known[key] = (grid, strides)
        return grid


def rotary_table(rotary: tuple[torch.Tensor, torch.Tensor], seq: int) -> torch.Tensor:
    """``[S, 2D]``: cos and sin side by side, one row per token; checked to cover ``seq`` tokens."""
    cos, sin = rotary if isinstance(rotary, (tuple, list)) and len(rotary) == 2 else (None, None)
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.shape != sin.shape:
        raise InvalidArgumentError("rotary embedding", "a (cos, sin) pair of equal shapes", _shape_of(rotary))
    table = torch.cat([cos, sin], -1).reshape(-1, cos.shape[-1] * 2)  # [S, 2D]
    if table.shape[0] != seq:
        raise InvalidArgumentError(
            "rotary embedding", f"a table over the call's {seq} video tokens", f"{table.shape[0]} tokens ({_shape_of(rotary)})"
        )
    return table


def derive_grid(table: torch.Tensor, seq: int) -> tuple[LatentGrid, list[int]]:
    """The grid of a rotary table ``[S, 2D]`` and each cos channel's stride (``seq``: never moves)."""
    moved = table != table[:1]  # [S, 2D]: where a channel differs from token 0
    first = torch.where(moved.any(0), moved.to(torch.uint8).argmax(0), seq).tolist()  # per channel; seq: never
    half = len(first) // 2  # cos and sin channels of one position move together
    strides = [min(a, b) for a, b in zip(first[:half], first[half:])]
    runs: list[int] = []
    for stride in strides:
        if not runs or runs[-1] != stride:
            runs.append(stride)
    grid = _grid_of_runs(runs, seq)
    if grid is None or not _table_matches_grid(table, strides, grid):
        raise InvalidArgumentError(
            "rotary embedding",
            "a 3-D rotary table of Wan2.1 or HunyuanVideo-1.5 over the whole video (the latent grid is read from it; "
            "otherwise call TesseraProcessor.attach(transformer) or pass latent_grid=(frames, height, width))",
            f"channel strides {runs} over {seq} tokens",
        )
    return grid, strides


def wraps_match(table: torch.Tensor, grid: LatentGrid, strides: list[int]) -> bool:
    """Whether the tokens where ``grid``'s width and height wrap (and the last one) move exactly the
    channels of their non-zero coordinates, as the table of ``grid`` would."""
    seq = table.shape[0]
    _, height, width = grid.as_tuple()
    tokens = sorted({t for t in (1, width - 1, width, height * width - 1, height * width, seq - 1) if 0 < t < seq})
    if not tokens:
        return True
    rows = table[torch.tensor([0, *tokens], device=table.device)]
    moved = (rows[1:] != rows[:1]).cpu().tolist()  # one small device read
    half = len(strides)
    axis_of = moving_axes(grid)
    for token, row in zip(tokens, moved):
        coords = (token // (height * width), (token // width) % height, token % width)
        for channel, stride in enumerate(strides):
            expected = stride in axis_of and coords[axis_of[stride]] != 0
            if (row[channel] or row[channel + half]) != expected:  # a small angle can leave cos at 1.0
                return False
    return True


def moving_axes(grid: LatentGrid) -> dict[int, int]:
    """Raster stride -> the axis (0 frames, 1 height, 2 width) of size > 1 whose channels first move
    there; axes of size 1 never move and have no entry."""
    frames, height, width = grid.as_tuple()
    axes: dict[int, int] = {}
    for axis, (stride, size) in enumerate(((height * width, frames), (width, height), (1, width))):
        if size > 1:
            axes.setdefault(stride, axis)
    return axes


def describe_argument(value: Any) -> str:
    """Short description of a call argument for error messages (a tensor, or a tuple of them)."""
    return describe_tensor(value) if isinstance(value, torch.Tensor) else _shape_of(value)


def _shape_of(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_shape_of(v) for v in value) + ")"
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _grid_of_runs(runs: list[int], seq: int) -> LatentGrid | None:
    """The grid of the channel runs of a (frames | height | width) table (``seq`` = never moves)."""
    never = seq
    moving = [r for r in runs if r != never]
    if any(a <= b for a, b in itertools.pairwise(moving)) or (moving and moving[-1] != 1) or len(runs) > 3:
        return None
    # Which axes the moving runs are: all three when there are three runs; with fewer, the runs of
    # size-1 axes merged, and their place (before, between or after) tells which axes they were.
    if len(runs) == 3:
        axes = [i for i, r in enumerate(runs) if r != never]
    elif runs == [never, 1]:
        axes = [2]  # frames and height of size 1
    elif runs == [1, never]:
        axes = [0]  # height and width of size 1
    elif runs == [never]:
        axes = []
    else:
        return None
    sizes = [1, 1, 1]
    outer = seq
    for axis, stride in zip(axes, moving):
        if outer % stride:
            return None
        sizes[axis] = outer // stride
        outer = stride
    if sizes[0] * sizes[1] * sizes[2] != seq:
        return None
    return LatentGrid(*sizes)


def _table_matches_grid(table: torch.Tensor, strides: list[int], grid: LatentGrid) -> bool:
    """Every token's channels of each axis equal those of the token at the same position on that
    axis alone (position x stride): the table is a function of the grid coordinates."""
    seq = table.shape[0]
    token = torch.arange(seq, device=table.device)
    axis_size = grid.as_tuple()
    axis_of = moving_axes(grid)
    half = table.shape[1] // 2
    for channel_stride in set(strides):
        if channel_stride == seq:
            continue
        axis = axis_of.get(channel_stride)
        if axis is None:
            return False
        channels = torch.tensor([c for c, s in enumerate(strides) if s == channel_stride], device=table.device)
        channels = torch.cat([channels, channels + half])
        position = (token // channel_stride) % axis_size[axis]
        if not torch.equal(table[:, channels], table[position * channel_stride][:, channels]):
            return False
    return True


def grid_from_latents(shape: torch.Size | tuple[int, ...], patch: tuple[int, int, int]) -> LatentGrid:
    """Latent grid of ``hidden_states [B, C, F, H, W]`` after a ``patch`` embedding."""
    if len(shape) != 5:
        raise InvalidArgumentError("hidden_states", "a [B, C, F, H, W] latent video", f"shape {tuple(shape)}")
    return LatentGrid(shape[2] // patch[0], shape[3] // patch[1], shape[4] // patch[2])


class StepCounter:
    """Step and guidance branch of each transformer forward (see the module docstring)."""

    def __init__(self) -> None:
        self.branch_forwards: dict[str, int] = {}
        self.forwards = 0

    def next(self, context: Any, branches: int) -> tuple[str, int]:
        """(branch, step) of the forward about to run, under the pipeline's ``context`` (or None).

        Forwards counted without a context before the first named ones (a context that could not
        reach the processor yet) belong to the branches first named after another branch: with
        branches taking turns, those are the ones that had run already."""
        if context is not None:
            branch = str(context.name)
            if branch in self.branch_forwards:
                count = self.branch_forwards[branch]
            else:
                count = self.forwards if self.branch_forwards else 0
            self.branch_forwards[branch] = count + 1
            step = getattr(context, "step_index", None)
            return branch, int(step) if step is not None else count
        count = self.forwards
        self.forwards += 1
        return f"branch{count % branches}", count // branches

    def reset(self) -> None:
        self.branch_forwards.clear()
        self.forwards = 0


@dataclass
class ModelRun:
    """One transformer's run in progress, from its first sparse call to its reset: the forwards
    counted without ``attach`` and the (branch, step) of its running forward."""

    counter: StepCounter = field(default_factory=StepCounter)
    where: tuple[str, int] = ("branch0", 0)


class TesseraHook(ModelHook):
    """``attach``'s hook on the transformer: the latent grid, step and guidance branch of every forward."""

    _is_stateful = True

    def __init__(self, processor: ProcessorLike, model: int, patch: tuple[int, int, int]):
        super().__init__()
        self.processor = processor
        self.model = model
        self.patch = patch
        self.state_manager = StateManager(HookState)  # receives the pipeline's cache_context
        self.counter = StepCounter()

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs) -> tuple[tuple[Any], dict[str, Any]]:
        if torch.compiler.is_compiling():
            # A compiled forward must not trace the step count (a guard per step, one graph per
            # step): its attention calls find step, branch and grid as the processor alone does
            # (the rotary table, the processor's own hook), each inside its opaque op (compiled.py).
            return args, kwargs
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        grid = grid_from_latents(hidden_states.shape, self.patch) if isinstance(hidden_states, torch.Tensor) else None
        branch, step = self.counter.next(cache_context_of(self.state_manager), self.processor.branches)
        self.processor.begin_forward(ForwardContext(self.model, grid, step, branch))
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if torch.compiler.is_compiling():
            return output
        self.processor.end_forward()
        return output

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.counter.reset()
        self.processor.new_run(self.model)  # this transformer's run only: others may share the processor
        return module


class ProcessorHook(ModelHook):
    """The processor's own stateful hook: receives the pipeline's ``cache_context`` and its end-of-run
    reset through the transformer the processor is installed in (no ``attach`` needed)."""

    _is_stateful = True

    def __init__(self, processor: ProcessorLike):
        super().__init__()
        self.processor = processor
        self.state_manager = StateManager(HookState)

    def context(self) -> Any:
        return cache_context_of(self.state_manager)

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        # ``module`` is the processor: the transformer being reset is the one on the call stack
        self.processor.run_ended(running_transformer())
        return module


def running_transformer() -> torch.nn.Module | None:
    """The Wan2.1 or HunyuanVideo-1.5 transformer on the call stack (the nearest one), if any: the one
    whose forward is running, or whose stateful hooks are being reset (``_reset_stateful_cache``, or
    its ``HookRegistry.reset_stateful_hooks``)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, HookRegistry):
            candidate = registry_module(candidate)
        if isinstance(candidate, VIDEO_TRANSFORMERS):
            return candidate
        frame = frame.f_back
    return None


class IdentityMemo:
    """Small memo keyed by the identity of a tensor (e.g. the rotary embedding every block of one
    forward shares): a value is reused only while that very tensor is alive."""

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self.entries: OrderedDict[Hashable, tuple[weakref.ref, Any]] = OrderedDict()

    def get(self, tensor: torch.Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
        full_key = (id(tensor), key)
        entry = self.entries.get(full_key)
        if entry is not None and entry[0]() is tensor:
            self.entries.move_to_end(full_key)
            return entry[1]
        value = make()
        self.entries[full_key] = (weakref.ref(tensor), value)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self.entries.clear()
