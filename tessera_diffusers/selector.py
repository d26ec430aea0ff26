"""The only place that decides which plan runs a request.

Today: rank the catalog's plans for the request key with the analytic cost model and take the
first eligible one. The profiled plan table (regime lookup) slots in front of the cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .catalog import plans_for, portable_kernels
from .cost_model import estimate_ms
from .eligibility import rejection
from .errors import CatalogError
from .mask_state import MaskState
from .plans import PhysicalPlan, Request


@dataclass(frozen=True)
class Selection:
    """What the selector decided and why (for ``explain``)."""

    request: Request
    ranking: tuple[tuple[str, float], ...]  # (plan name, predicted ms), best first
    rejected: tuple[tuple[str, str], ...]  # (plan name, reason)
    chosen: PhysicalPlan | None

    def explain(self) -> str:
        lines = [f"request  {self.request.name}", "ranking (cost model, predicted ms):"]
        lines += [f"  {ms:9.3f}  {name}" for name, ms in self.ranking[:10]]
        if self.rejected:
            lines.append(f"rejected ({len(self.rejected)}):")
            lines += [f"  {name}: {why}" for name, why in self.rejected[:10]]
        lines.append(f"chosen   {self.chosen.name if self.chosen else 'reference oracle'}")
        return "\n".join(lines)


def native_candidates(request: Request, assume_native: bool = False) -> tuple[list[PhysicalPlan], str | None]:
    """Plans the loaded native library can run for ``request``, or the reason there are none.
    ``assume_native`` ranks the whole kernel table instead (to explain plans on another machine)."""
    if request.arch == "cpu":
        return [], "CPU tensors run on the reference path"
    if assume_native:
        return plans_for(request.block_q, request.block_kv, portable_kernels()), None
    from . import ops

    try:
        kernels = ops.available_kernels()
    except CatalogError as err:
        return [], f"native kernels unavailable ({err})"
    return plans_for(request.block_q, request.block_kv, kernels), None


def rank(request: Request, state: MaskState, assume_native: bool = False) -> Selection:
    """Rank every candidate plan of ``request`` with the cost model; eligibility reasons kept."""
    candidates, why_none = native_candidates(request, assume_native)
    if not candidates:
        return Selection(request, (), (("native", why_none or "no plans"),), None)
    stats = state.host_stats()
    rejected, scored = [], []
    for plan in candidates:
        reason = rejection(plan, request)
        if reason is not None:
            rejected.append((plan.name, reason))
        else:
            scored.append((estimate_ms(plan, request, stats), plan))
    scored.sort(key=lambda item: item[0])
    chosen = scored[0][1] if scored else None
    return Selection(request, tuple((p.name, ms) for ms, p in scored), tuple(rejected), chosen)


def select(request: Request, state: MaskState, warn: Callable[[str], None] | None = None) -> PhysicalPlan | None:
    """The plan to run ``request`` with, or None for the reference oracle (with a one-time warning
    on CUDA, where the oracle is slow)."""
    selection = rank(request, state)
    if selection.chosen is None and request.arch != "cpu" and warn is not None:
        reasons = "; ".join(f"{n}: {r}" for n, r in selection.rejected[:3])
        warn(f"tessera: no native plan for {request.key}, using the reference path ({reasons})")
    return selection.chosen
