"""Tessera for diffusers: dynamic block-sparse attention for video diffusion transformers.

    from tessera_diffusers import LogicalMask, block_sparse_attention
    out = block_sparse_attention(q, k, v, mask)          # q, k, v: [B, S, H, D]

    pipe.transformer.set_attn_processor(TesseraProcessor())
"""

import logging

from .errors import (
    CatalogError,
    InvalidArgumentError,
    MaskError,
    NativeKernelError,
    PlanTableError,
    TesseraError,
)
from .mask import LogicalMask
from .mask_state import MaskState, Stat, build_mask_state
from .plans import Family, KernelSpec, KvLayout, PhysicalPlan, QLayout, Request, TaskOrganization, Traversal
from .prepare import PreparedPlan, prepare
from .runtime import Runtime, block_sparse_attention

__version__ = "0.1.0"

# Log records of every module go to the "tessera_diffusers" logger (silent unless the application
# configures logging); warnings are kept for what a user must act on.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "CatalogError",
    "Family",
    "InvalidArgumentError",
    "KernelSpec",
    "KvLayout",
    "LogicalMask",
    "MaskError",
    "MaskState",
    "NativeKernelError",
    "PhysicalPlan",
    "PlanTableError",
    "PreparedPlan",
    "QLayout",
    "Request",
    "Runtime",
    "Stat",
    "TaskOrganization",
    "TesseraError",
    "Traversal",
    "block_sparse_attention",
    "build_mask_state",
    "prepare",
]


def __getattr__(name: str):
    # The processors and the context-parallel path import diffusers; load them only when asked for.
    if name == "TesseraProcessor":
        from .processors import TesseraProcessor

        return TesseraProcessor
    if name in ("Ulysses", "ulysses_attention"):
        from . import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module 'tessera_diffusers' has no attribute {name!r}")
