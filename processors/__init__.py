"""Diffusers attention processors (installed as ``tessera_diffusers.processors``).

from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.sparsifiers import ssta_384, DenseWarmup

processor = TesseraProcessor(DenseWarmup(ssta_384(), steps=5), recompute_every=2)
processor.attach(pipe.transformer)      # WanTransformer3DModel or HunyuanVideo15Transformer3DModel
video = pipe(...).frames
print(processor.stats())
"""

from .backends import SparseAttentionBackend, TesseraBackend, merge_partials
from .context import ForwardContext, ModuleRoute, ProcessorHook, Route, TesseraHook
from .plan_cache import CacheSlot, StepCache
from .processor import TesseraProcessor

__all__ = [
    "CacheSlot",
    "ForwardContext",
    "ModuleRoute",
    "Route",
    "SparseAttentionBackend",
    "StepCache",
    "TesseraBackend",
    "TesseraHook",
    "ProcessorHook",
    "TesseraProcessor",
    "merge_partials",
]
