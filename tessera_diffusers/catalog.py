"""What the native library contains, per architecture, and the plan space built on it.

The kernel variants come from one table (``kernel_table.py``, torch-free so the build reads it):
``csrc/build_native.py`` generates the C++ instantiations from it, the build writes a manifest of
what it compiled, and the runtime checks the loaded library against the table (``ops.py``).
"""

from __future__ import annotations

import hashlib
from functools import cache

from .kernel_table import DEFAULT_PV, KernelRow, all_rows, hopper_rows, portable_rows, quantized_variant
from .plans import Family, KernelSpec, KvLayout, PhysicalPlan, TaskOrganization, Traversal

# Task organizations the plan space offers for every kernel.
TASK_ORGANIZATIONS: tuple[TaskOrganization, ...] = (
    TaskOrganization(Traversal.LONGEST_FIRST, 1),
    TaskOrganization(Traversal.ROW_MAJOR, 1),
    TaskOrganization(Traversal.LONGEST_FIRST, 2),
    TaskOrganization(Traversal.LONGEST_FIRST, 4),
    TaskOrganization(Traversal.LONGEST_FIRST, 1, persistent=True),
)


def kernel_spec_from_row(row: KernelRow) -> KernelSpec:
    return KernelSpec(Family(row.family), row.tile_q, row.tile_kv, row.head_dim, row.dtype, row.stages, row.arch, row.warps)


@cache
def portable_kernels() -> tuple[KernelSpec, ...]:
    """Every portable kernel variant, in the kernel table's order (the generated C++ follows it)."""
    return tuple(kernel_spec_from_row(row) for row in portable_rows())


@cache
def hopper_kernels() -> tuple[KernelSpec, ...]:
    """Every Hopper (sm90a, wgmma) kernel variant, in the kernel table's order."""
    return tuple(kernel_spec_from_row(row) for row in hopper_rows())


@cache
def all_kernels() -> tuple[KernelSpec, ...]:
    """Every kernel of the table (what a full sm80 + sm90a build contains)."""
    return tuple(kernel_spec_from_row(row) for row in all_rows())


def quantized_kernel(spec: KernelSpec, pv: str = DEFAULT_PV) -> KernelRow | None:
    """The 8-bit kernel with P V format ``pv`` (``kernel_table.QUANTIZED_FAMILIES``) that runs plans
    of the 16-bit kernel ``spec`` (a Hopper kernel of a tile the 8-bit kernels have), or None."""
    if spec.family is not Family.HOPPER:
        return None
    return quantized_variant(spec.tile_q, spec.tile_kv, spec.head_dim, spec.dtype, spec.stages, pv)


def base_kernel(row: KernelRow) -> KernelSpec:
    """The 16-bit Hopper kernel whose plans the 8-bit kernel ``row`` runs (``quantized_kernel``'s
    inverse)."""
    key = (row.tile_q, row.tile_kv, row.head_dim, row.dtype, row.stages)
    return next(k for k in hopper_kernels() if (k.tile_q, k.tile_kv, k.head_dim, k.dtype, k.stages) == key)


def reference_kernel(head_dim: int, dtype: str, tile_q: int = 64, tile_kv: int = 64) -> KernelSpec:
    """The PyTorch executor as a 'kernel' (any device, any tile)."""
    return KernelSpec(Family.REFERENCE, tile_q, tile_kv, head_dim, dtype, 1, "any", 1)


def catalog_hash(kernels: tuple[KernelSpec, ...]) -> str:
    """Deterministic hash of a kernel list (what a plan table is built against)."""
    return hash_kernel_tuple(tuple(kernels))


@cache
def hash_kernel_tuple(kernels: tuple[KernelSpec, ...]) -> str:
    # Cached: every new Selector checks its table against the same catalog tuple.
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
