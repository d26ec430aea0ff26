"""What an attention call needs to know besides its tensors: the latent grid, the layer, the
denoising step and the guidance branch — and how the processor learns them.

Mechanism (documented in ``TesseraProcessor.attach``):

- **Layer and route** come from a route table built when the processor is attached: the module
  ``blocks[i].attn1`` of Wan is "video self-attention of layer i", ``transformer_blocks[i].attn`` of
  HunyuanVideo-1.5 is "joint attention of layer i"; every other attention module keeps its stock
  processor. Without ``attach`` the route is recognised from the module class and the call, and
  layers are numbered in the order their modules are first called.
- **Latent grid, step and branch** come from ``TesseraHook``, a diffusers ``ModelHook`` on the
  transformer's forward: before each forward it reads ``hidden_states [B, C, F, H, W]`` and the
  patch size (grid = ``F/pt x H/ph x W/pw``), and the ``cache_context`` diffusers pipelines open
  around every denoiser call (name = guidance branch, e.g. "cond"/"uncond" for Wan or
  "pred_cond"/"pred_uncond" for HunyuanVideo-1.5; ``step_index`` when the pipeline gives it).
  Without ``step_index`` the hook counts forwards per branch; without any context it counts
  forwards and splits them into ``branches`` alternating branches (call parity). Pipelines reset
  stateful hooks at the end of a run (``maybe_free_model_hooks``), which restarts the counts and
  drops the masks and plans of that video.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from diffusers.hooks.hooks import BaseState, ModelHook, StateManager

from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.sparsifiers.base import LatentGrid

if TYPE_CHECKING:
    from .processor import TesseraProcessor

HOOK_NAME = "tessera_context"


class Route(str, Enum):
    """What the processor does with one attention module."""

    WAN_SELF = "wan_self_attention"  # sparse video self-attention (Wan attn1)
    HV15_JOINT = "hunyuan_video15_joint_attention"  # sparse video + dense text (HunyuanVideo-1.5)
    STOCK = "stock"  # handed to the stock processor (Wan attn2, the HunyuanVideo-1.5 refiner, ...)


@dataclass(frozen=True)
class ModuleRoute:
    route: Route
    model: int  # index of the attached transformer (0 when not attached)
    layer: int  # transformer block index (-1 for stock routes)


@dataclass(frozen=True)
class ForwardContext:
    """Where the denoising loop is, for one transformer forward."""

    model: int
    grid: LatentGrid | None
    step: int
    branch: str


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


def grid_from_latents(shape: torch.Size | tuple[int, ...], patch: tuple[int, int, int]) -> LatentGrid:
    """Latent grid of ``hidden_states [B, C, F, H, W]`` after a ``patch`` embedding."""
    if len(shape) != 5:
        raise InvalidArgumentError("hidden_states", "a [B, C, F, H, W] latent video", f"shape {tuple(shape)}")
    return LatentGrid(shape[2] // patch[0], shape[3] // patch[1], shape[4] // patch[2])


class TesseraHook(ModelHook):
    """Tells the processor the latent grid, step and guidance branch of every transformer forward."""

    _is_stateful = True

    def __init__(self, processor: TesseraProcessor, model: int, patch: tuple[int, int, int]):
        super().__init__()
        self.processor = processor
        self.model = model
        self.patch = patch
        self.state_manager = StateManager(HookState)  # receives the pipeline's cache_context
        self.branch_forwards: dict[str, int] = {}
        self.forwards = 0

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs) -> tuple[tuple[Any], dict[str, Any]]:
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        grid = grid_from_latents(hidden_states.shape, self.patch) if isinstance(hidden_states, torch.Tensor) else None
        branch, step = self.where(current_context(self.state_manager))
        self.processor.begin_forward(ForwardContext(self.model, grid, step, branch))
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        self.processor.end_forward()
        return output

    def where(self, context: Any) -> tuple[str, int]:
        """(branch, step) of the forward about to run."""
        if context is not None:
            branch = str(context.name)
            count = self.branch_forwards.get(branch, 0)
            self.branch_forwards[branch] = count + 1
            step = getattr(context, "step_index", None)
            return branch, int(step) if step is not None else count
        branches = self.processor.branches
        count = self.forwards
        self.forwards += 1
        return f"branch{count % branches}", count // branches

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.branch_forwards.clear()
        self.forwards = 0
        self.processor.new_run()
        return module


def current_context(manager: StateManager) -> Any:
    """The ``CacheContext`` a pipeline opened around this call, or None."""
    try:
        return manager.context
    except ValueError:  # diffusers raises when no cache_context is open
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
