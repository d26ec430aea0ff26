"""What the native library contains, per architecture: the one table instantiations come from.

``csrc/generate.py`` turns ``PORTABLE_KERNELS`` into the C++ instantiation list; the build writes a
manifest of what it compiled, and the runtime checks the loaded library against this table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache

from .plans import Family, KernelSpec, KvLayout, PhysicalPlan, TaskOrganization, Traversal


@dataclass(frozen=True)
class TileConfig:
    tile_q: int
    tile_kv: int
    warps: int  # each warp owns tile_q / warps query rows (16 or 32)


# Tiles of the portable (mma.sync + cp.async) family.
PORTABLE_TILES: tuple[TileConfig, ...] = (
    TileConfig(64, 64, 4),
    TileConfig(64, 128, 4),
    TileConfig(128, 64, 4),
    TileConfig(128, 128, 8),
)
HEAD_DIMS: tuple[int, ...] = (64, 128)
DTYPES: tuple[str, ...] = ("bf16", "fp16")
PORTABLE_STAGES: tuple[int, ...] = (2, 3)

# Task organizations the plan space offers for every kernel.
TASK_ORGANIZATIONS: tuple[TaskOrganization, ...] = (
    TaskOrganization(Traversal.LONGEST_FIRST, 1),
    TaskOrganization(Traversal.ROW_MAJOR, 1),
    TaskOrganization(Traversal.LONGEST_FIRST, 2),
    TaskOrganization(Traversal.LONGEST_FIRST, 4),
)


@cache
def portable_kernels() -> tuple[KernelSpec, ...]:
    """Every portable kernel variant, in a fixed order (the generated C++ follows it)."""
    return tuple(
        KernelSpec(Family.PORTABLE, t.tile_q, t.tile_kv, d, dt, st, "sm80", t.warps)
        for d in HEAD_DIMS
        for dt in DTYPES
        for t in PORTABLE_TILES
        for st in PORTABLE_STAGES
    )


def reference_kernel(head_dim: int, dtype: str, tile_q: int = 64, tile_kv: int = 64) -> KernelSpec:
    """The PyTorch executor as a 'kernel' (any device, any tile)."""
    return KernelSpec(Family.REFERENCE, tile_q, tile_kv, head_dim, dtype, 1, "any", 1)


def catalog_hash(kernels: tuple[KernelSpec, ...]) -> str:
    """Deterministic hash of a kernel list (what a plan table is built against)."""
    return hashlib.sha256("\n".join(k.name for k in kernels).encode()).hexdigest()[:16]


def plans_for(
    block_q: int,
    block_kv: int,
    kernels: tuple[KernelSpec, ...],
    tasks: tuple[TaskOrganization, ...] = TASK_ORGANIZATIONS,
) -> list[PhysicalPlan]:
    """Every plan of ``kernels`` x layouts x task organizations for one logical geometry.

    Packed layouts are offered only where a KV tile holds more than one block."""
    plans = []
    for kernel in kernels:
        layouts = [KvLayout.CONTIGUOUS]
        if kernel.tile_kv > block_kv:
            layouts.append(KvLayout.PACKED)
        for layout in layouts:
            for org in tasks:
                plans.append(PhysicalPlan(block_q, block_kv, layout, org, kernel))
    return plans
