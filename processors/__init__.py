"""Diffusers attention processors (installed as ``tessera_diffusers.processors``).

from tessera_diffusers.processors import TesseraProcessor

processor = TesseraProcessor()                       # per-model defaults (see processor.py)
pipe.transformer.set_attn_processor(processor)       # Wan2.1 or HunyuanVideo-1.5, T2V or I2V
video = pipe(...).frames
print(processor, processor.stats())

# or a sparsifier of your own, and the explicit form (needed for context parallelism):
from tessera_diffusers.sparsifiers import DenseWarmup, spade_64
TesseraProcessor(DenseWarmup(spade_64(), steps=10), recompute_every=2).attach(pipe.transformer)
"""

from .backends import AttentionTimer, SparseAttentionBackend, TesseraBackend, TimedBackend, merge_partials
from .context import ForwardContext, ModuleRoute, ProcessorHook, Route, TesseraHook, grid_from_rotary
from .plan_cache import CacheSlot, StepCache
from .processor import TesseraProcessor

__all__ = [
    "AttentionTimer",
    "CacheSlot",
    "ForwardContext",
    "ModuleRoute",
    "ProcessorHook",
    "Route",
    "SparseAttentionBackend",
    "StepCache",
    "TesseraBackend",
    "TesseraHook",
    "TesseraProcessor",
    "TimedBackend",
    "grid_from_rotary",
    "merge_partials",
]
