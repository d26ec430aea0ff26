"""Every diffusers API the processors touch that is private or changed between releases, in one place.

Supported: diffusers >= ``MIN_DIFFUSERS`` (0.36.0, pyproject.toml's lower bound), the first release
with both transformers (HunyuanVideo-1.5 arrived in 0.36.0), through the fallbacks below; checked on
0.36.0, 0.38.0, 0.40.0 and up to 0.42.1 (``tests/integration/diffusers_versions.py`` runs the processor
tests under any list of releases). Older than 0.36.0, importing the processors raises ``DiffusersVersionError``.
The rest of ``processors/`` imports diffusers only through this module, except ``tiny.py``, which
builds test pipelines from diffusers' public top-level names.

Each name carries what the processors use it for and the first release that has it. Where a release
with both transformers lacks one, the helper below gives that release's equivalent
(``cache_context_of``, ``invalidate_child_registries``, ``cached_child_registries``).

Two attribute names are a protocol rather than an import: diffusers hands settings to every processor
that has the attribute, so ``TesseraProcessor`` defines them itself:

- ``_attention_backend`` (0.35.0): ``ModelMixin.set_attention_backend`` sets it on each processor; the
  processor uses it for its dense calls and hands it on to the stock processors (``hand_attention_backend``).
- ``_parallel_config`` (0.36.0): ``ModelMixin.enable_parallelism`` sets it on each processor and on the
  transformer (``parallel_config_of``); the processor runs Ulysses from it (``tessera_diffusers.parallel``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import __version__ as DIFFUSERS_VERSION

from tessera_diffusers.errors import TesseraError

MIN_DIFFUSERS = "0.36.0"  # the first release with both transformers (pyproject.toml's lower bound)


class DiffusersVersionError(TesseraError, ImportError):
    """The installed diffusers lacks what a processor feature needs."""

    def __init__(self, feature: str, needed: str, missing: str):
        super().__init__(
            f"{feature}: expected diffusers >= {needed}, got diffusers {DIFFUSERS_VERSION} (no {missing}); "
            f"upgrade with: pip install -U 'diffusers>={needed}'"
        )


try:
    from diffusers.models.transformers.transformer_hunyuan_video15 import (
        HunyuanVideo15AttnProcessor2_0,  # HunyuanVideo-1.5's stock processor: text refiner, stock calls (0.36.0)
        HunyuanVideo15Transformer3DModel,  # attach's model check, layer routes, the call-stack lookup (0.36.0)
    )
except ImportError as error:
    raise DiffusersVersionError(
        "tessera_diffusers.processors", MIN_DIFFUSERS, "diffusers.models.transformers.transformer_hunyuan_video15"
    ) from error

from diffusers.hooks.hooks import (
    BaseState,  # the per-context state a StateManager builds (the Tessera hooks keep none) (0.35.0)
    HookRegistry,  # a module's hooks (register_hook, get_hook, remove_hook, reset_stateful_hooks) (0.33.0)
    ModelHook,  # base of attach's and the processor's hooks; _is_stateful lets cache_context reach them (0.33.0)
    StateManager,  # where diffusers puts the pipeline's cache_context for a stateful hook (0.35.0)
)
from diffusers.models.attention_dispatch import (
    dispatch_attention_fn,  # full attention without a mask tensor, through set_attention_backend's backend (0.35.0)
)
from diffusers.models.attention_processor import (
    Attention,  # the legacy module of HunyuanVideo-1.5's joint attention: route recognition (<= 0.32)
    AttnProcessor2_0,  # stock processor of a module that declares no default processor class (<= 0.32)
)
from diffusers.models.cache_utils import (
    CacheMixin,  # cache_context, as the pipelines open it (0.33.0); with the step's fields (0.41.0)
)
from diffusers.models.embeddings import (
    apply_rotary_emb,  # RoPE on HunyuanVideo-1.5's video Q/K as its stock processor applies it (sequence_dim: 0.35.0)
)
from diffusers.models.transformers.transformer_wan import (
    WanAttention,  # Wan2.1's attention module (is_cross_attention, norm_q/k, to_out): route recognition (0.35.0)
    WanAttnProcessor,  # Wan2.1's stock processor: cross-attention attn2 (text, I2V image tokens) (0.35.0)
    WanTransformer3DModel,  # attach's model check, layer routes, the call-stack lookup (0.33.0)
)
from diffusers.models.transformers.transformer_wan import (
    _get_qkv_projections as wan_qkv_projections,  # Wan2.1's Q/K/V (or fused to_qkv) as stock makes them (0.35.0)
)

# Whether ``cache_context`` takes the step (``step_index=...``, 0.41.0) besides the branch name.
CACHE_CONTEXT_TAKES_STEP = any(
    p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(CacheMixin.cache_context).parameters.values()
)

# Both video transformers: the classes ``running_transformer`` looks for on the call stack.
VIDEO_TRANSFORMERS = (WanTransformer3DModel, HunyuanVideo15Transformer3DModel)


@dataclass(frozen=True)
class NamedCacheContext:
    """The cache context of releases before 0.41.0, which hand a stateful hook the context's name only
    (no ``step_index``: the processor then counts forwards per branch)."""

    name: str
    step_index: int | None = None


def cache_context_of(manager: StateManager) -> Any:
    """The cache context a pipeline opened around this call (``name``, ``step_index``), or None.

    ``StateManager.context``, a ``CacheContext`` with the step (0.41.0; raises ValueError outside any
    context); before that ``StateManager._current_context``, the name alone (0.35.0 - 0.40.0)."""
    if isinstance(getattr(type(manager), "context", None), property):
        try:
            return manager.context
        except ValueError:
            return None
    name = getattr(manager, "_current_context", None)
    return None if name is None else NamedCacheContext(name)


def cache_context(model: torch.nn.Module, name: str, step_index: int | None = None, **step_info: Any):
    """``model.cache_context(name, step_index=..., ...)`` where the release takes the step (0.41.0),
    else ``model.cache_context(name)``, as the pipelines of 0.36.0 - 0.40.0 open it (the processor
    then counts the steps itself). For loops written outside a pipeline: tests, benchmarks."""
    if step_index is None or not CACHE_CONTEXT_TAKES_STEP:
        return model.cache_context(name)
    return model.cache_context(name, step_index=step_index, **step_info)


def hook_registry_of(module: torch.nn.Module) -> HookRegistry | None:
    """The hook registry diffusers keeps on a module (``module._diffusers_hook``, 0.33.0), without
    creating one."""
    return getattr(module, "_diffusers_hook", None)


def registry_module(registry: HookRegistry) -> torch.nn.Module | None:
    """The module a hook registry belongs to (``HookRegistry._module_ref``, 0.33.0): tells which
    transformer's stateful hooks are being reset."""
    return getattr(registry, "_module_ref", None)


def cached_child_registries(registry: HookRegistry) -> list[HookRegistry] | None:
    """The child registries a transformer's cache_context visits, as cached by diffusers
    (``HookRegistry._child_registries_cache``, 0.38.0); None when nothing is cached, which before
    0.38.0 is always (each cache_context walks the module tree)."""
    return getattr(registry, "_child_registries_cache", None)


def invalidate_child_registries(registry: HookRegistry) -> None:
    """Make the next cache_context of ``registry``'s module find hooks registered below it since.

    ``HookRegistry.invalidate_child_registries_cache`` (0.41.0); on 0.38.0 - 0.40.0, which cache the
    list without that method, the same: clear every registry's cache in the module tree; before 0.38.0
    there is no cache to clear."""
    method = getattr(registry, "invalidate_child_registries_cache", None)
    if method is not None:
        method()
        return
    module = registry_module(registry)
    if module is None:
        return
    for child in getattr(module, "_orig_mod", module).modules():  # a torch.compile'd module wraps the model
        child_registry = hook_registry_of(getattr(child, "_orig_mod", child))
        if child_registry is not None and hasattr(child_registry, "_child_registries_cache"):
            child_registry._child_registries_cache = None


def parallel_config_of(module: torch.nn.Module) -> Any:
    """The ``ParallelConfig`` ``enable_parallelism`` left on a transformer (``ModelMixin._parallel_config``,
    0.36.0), or None."""
    return getattr(module, "_parallel_config", None)


def hand_parallel_config(processor: Any, config: Any) -> None:
    """Give a processor the parallel config as ``enable_parallelism`` does: to those with the attribute."""
    if hasattr(processor, "_parallel_config"):
        processor._parallel_config = config


def hand_attention_backend(processor: Any, backend: Any) -> None:
    """Give a processor the attention backend as ``set_attention_backend`` does: to those with the attribute."""
    if backend is not None and hasattr(processor, "_attention_backend"):
        processor._attention_backend = backend


def default_processor_cls(module: torch.nn.Module) -> type | None:
    """The stock processor class an ``AttentionModuleMixin`` module declares
    (``_default_processor_cls``, 0.35.0), or None."""
    return getattr(type(module), "_default_processor_cls", None)


__all__ = [
    "DIFFUSERS_VERSION",
    "MIN_DIFFUSERS",
    "VIDEO_TRANSFORMERS",
    "Attention",
    "AttnProcessor2_0",
    "BaseState",
    "DiffusersVersionError",
    "HookRegistry",
    "HunyuanVideo15AttnProcessor2_0",
    "HunyuanVideo15Transformer3DModel",
    "ModelHook",
    "NamedCacheContext",
    "StateManager",
    "WanAttention",
    "WanAttnProcessor",
    "WanTransformer3DModel",
    "apply_rotary_emb",
    "cache_context_of",
    "cached_child_registries",
    "default_processor_cls",
    "dispatch_attention_fn",
    "hand_attention_backend",
    "hand_parallel_config",
    "hook_registry_of",
    "invalidate_child_registries",
    "parallel_config_of",
    "registry_module",
    "wan_qkv_projections",
]
