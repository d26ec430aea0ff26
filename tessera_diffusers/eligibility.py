"""Named eligibility predicates: ``(plan, request) -> reason string or None``.

A predicate never raises; the selector collects every reason so a user sees why no plan fit.
"""

from __future__ import annotations

from collections.abc import Callable

from .plans import MEMBERSHIP_BITS, Family, KvLayout, PhysicalPlan, QLayout, Request, arch_number

Predicate = Callable[[PhysicalPlan, Request], "str | None"]


def geometry_matches(plan: PhysicalPlan, req: Request) -> str | None:
    if (plan.block_q, plan.block_kv) != (req.block_q, req.block_kv):
        return f"plan is for Q{plan.block_q}K{plan.block_kv}, request is Q{req.block_q}K{req.block_kv}"
    return None


def head_dim_matches(plan: PhysicalPlan, req: Request) -> str | None:
    if plan.kernel.head_dim != req.head_dim:
        return f"kernel head_dim {plan.kernel.head_dim} != {req.head_dim}"
    return None


def dtype_matches(plan: PhysicalPlan, req: Request) -> str | None:
    if plan.kernel.family is Family.REFERENCE:
        return None
    if plan.kernel.dtype != req.dtype:
        return f"kernel dtype {plan.kernel.dtype} != {req.dtype}"
    return None


def arch_supported(plan: PhysicalPlan, req: Request) -> str | None:
    family = plan.kernel.family
    if family is Family.REFERENCE:
        return None
    if req.arch == "cpu":
        return "native kernels need a CUDA device"
    have = arch_number(req.arch)
    if family is Family.PORTABLE and have < 80:
        return f"portable kernels need sm80 or newer, device is {req.arch}"
    if family is Family.HOPPER and have != 90:
        return f"Hopper kernels need sm90 (H100/H200), device is {req.arch}"
    return None


# Largest dynamic shared memory one CTA may use, by compute capability (bytes).
MAX_SMEM_PER_CTA = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def fits_shared_memory(plan: PhysicalPlan, req: Request) -> str | None:
    if plan.kernel.family is Family.REFERENCE or req.arch == "cpu":
        return None
    limit = MAX_SMEM_PER_CTA.get(arch_number(req.arch), 101376)
    need = plan.kernel.smem_bytes + 1024  # + static tile metadata
    if need > limit:
        return f"needs {need} bytes of shared memory per CTA, {req.arch} allows {limit}"
    return None


def membership_fits(plan: PhysicalPlan, req: Request) -> str | None:
    bits = plan.q_units_per_tile * plan.slots_per_tile
    if bits > MEMBERSHIP_BITS:
        return f"membership needs {bits} bits per tile, at most {MEMBERSHIP_BITS}"
    return None


def packing_has_room(plan: PhysicalPlan, req: Request) -> str | None:
    if plan.kv_layout is KvLayout.PACKED and plan.slots_per_tile < 2:
        return "packing needs at least two KV blocks per tile (use the contiguous layout)"
    return None


def grouping_applies(plan: PhysicalPlan, req: Request) -> str | None:
    if plan.q_layout is QLayout.GROUPED and not plan.can_group_queries:
        return f"the grouped query layout needs tiles of several whole blocks, tile_q {plan.tile_q} over block_q {plan.block_q}"
    return None


def splits_are_useful(plan: PhysicalPlan, req: Request) -> str | None:
    ns = plan.tasks.num_splits
    if ns < 1:
        return f"num_splits {ns} < 1"
    max_tiles = -(-req.seq_len_kv // plan.tile_kv) * (plan.tile_kv // plan.kv_unit)
    if ns > max_tiles:
        return f"num_splits {ns} exceeds the most KV tiles a row can have ({max_tiles})"
    return None


PREDICATES: tuple[Predicate, ...] = (
    geometry_matches,
    head_dim_matches,
    dtype_matches,
    arch_supported,
    fits_shared_memory,
    membership_fits,
    packing_has_room,
    grouping_applies,
    splits_are_useful,
)


def rejection(plan: PhysicalPlan, req: Request, extra: tuple[Predicate, ...] = ()) -> str | None:
    """First reason ``plan`` cannot serve ``req``, or None if it is eligible."""
    for predicate in PREDICATES + extra:
        reason = predicate(plan, req)
        if reason is not None:
            return f"{predicate.__name__}: {reason}"
    return None
