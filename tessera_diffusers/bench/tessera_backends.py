"""Tessera rows: the plan the selector picks, and (for regret and the kernel study) every eligible
catalog plan forced one at a time.

Kernel latency runs ``runtime.execute`` on a prepared plan. Complete-request latency calls a fresh
``Runtime().attention`` (input checks, mask state, selection, preparation, execution), so nothing
is cached between requests.
"""

from __future__ import annotations

import dataclasses

import torch

from ..catalog import reference_kernel
from ..eligibility import rejection
from ..errors import CatalogError
from ..kernel_table import DEFAULT_PV
from ..mask_state import build_mask_state
from ..plans import DTYPE_NAMES, KvLayout, PhysicalPlan, Request, TaskOrganization, with_grouped_layouts
from ..prepare import PreparedPlan, prepare
from ..runtime import Runtime, device_arch, execute
from ..selector import Selector, native_candidates
from .backends import Backend, Inputs, Skip
from .problem import Problem


def request_of(problem: Problem) -> Request:
    """The selector's view of a problem (no tensors needed)."""
    return Request(
        batch=problem.batch,
        heads=problem.heads,
        seq_len_q=problem.seq_q,
        seq_len_kv=problem.seq_kv,
        head_dim=problem.head_dim,
        dtype=DTYPE_NAMES.get(problem.dtype, "fp32"),
        block_q=problem.mask.block_q,
        block_kv=problem.mask.block_kv,
        arch=device_arch(problem.device),
        return_lse=False,
    )


def executor_plans(problem: Problem) -> list[PhysicalPlan]:
    """PyTorch-executor plans (the reference kernel family) for a device without native kernels:
    the direct mapping, and a coarsened one where two blocks fit one membership word."""
    mask = problem.mask
    dtype = DTYPE_NAMES.get(problem.dtype, "fp32")
    tiles = [(mask.block_q, mask.block_kv), (mask.block_q, 2 * mask.block_kv)]
    plans = []
    for tile_q, tile_kv in tiles:
        kernel = reference_kernel(problem.head_dim, dtype, tile_q, tile_kv)
        plans.append(PhysicalPlan(mask.block_q, mask.block_kv, KvLayout.CONTIGUOUS, TaskOrganization(), kernel))
    request = request_of(problem)
    return [p for p in plans if rejection(p, request) is None]


def candidate_plans(problem: Problem, allow_executor: bool) -> tuple[list[PhysicalPlan], str | None]:
    """Eligible native plans for the problem, each Hopper one also in the grouped query layout where
    its query tile covers several blocks (``plans.with_grouped_layouts``); on a
    device without native kernels, the executor plans when ``allow_executor`` (the CPU smoke run),
    else none and the reason."""
    request = request_of(problem)
    plans, why_none = native_candidates(request)
    eligible = [p for p in plans if rejection(p, request) is None]
    if eligible:
        return with_grouped_layouts(eligible), None
    if allow_executor:
        return executor_plans(problem), None
    if plans:
        return [], "no catalog plan is eligible: " + "; ".join(
            f"{p.name}: {rejection(p, request)}" for p in plans[:3])
    return [], why_none or "the catalog has no plan for this geometry"


class TesseraSelected(Backend):
    """The plan the selector chooses (plan table or cost model), through the public runtime. Kernel
    latency runs the mask many times, so it times the plan of a mask that comes back
    (``Selector.reused_plan``: the plan table's ``/reused`` key, or the grouped layout's rule); a complete
    request is a mask's first (a fresh ``Runtime``), in the selected plan itself."""

    name = "tessera"
    kind = "tessera"

    def prepare(self, problem: Problem) -> tuple[PreparedPlan, float]:
        state = build_mask_state(problem.mask)
        request = request_of(problem)
        selector = Selector()
        try:
            selection = selector.rank(request, state)
        except CatalogError as err:
            raise Skip(f"native kernels unavailable: {err}") from err
        if selection.chosen is None:
            reasons = "; ".join(f"{n}: {r}" for n, r in selection.rejected[:3]) or "no plan"
            raise Skip(f"the selector chose no native plan ({reasons})")
        return prepare(selector.reused_plan(selection.chosen, request, state), state), problem.scale

    def run(self, prepared: tuple[PreparedPlan, float], inputs: Inputs) -> torch.Tensor:
        plan, scale = prepared
        return execute(plan, *inputs, scale, False)

    def request(self, problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return Runtime().attention(q, k, v, problem.mask, scale=problem.scale)

    @staticmethod
    def chosen_plan(prepared: tuple[PreparedPlan, float]) -> str:
        return prepared[0].plan.name


class TesseraPlan(Backend):
    """One catalog plan forced (``block_sparse_attention(..., plan=plan)``)."""

    kind = "tessera"

    def __init__(self, plan: PhysicalPlan):
        self.plan = plan
        self.name = f"tessera:{plan.name}"

    def prepare(self, problem: Problem) -> tuple[PreparedPlan, float]:
        return prepare(self.plan, build_mask_state(problem.mask)), problem.scale

    def run(self, prepared: tuple[PreparedPlan, float], inputs: Inputs) -> torch.Tensor:
        plan, scale = prepared
        return execute(plan, *inputs, scale, False)

    def request(self, problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return Runtime().attention(q, k, v, problem.mask, scale=problem.scale, plan=self.plan)

    def describe(self) -> dict:
        plan = self.plan
        return {
            "plan": plan.name,
            "mapping": plan.mapping_name,
            "tile": [plan.tile_q, plan.tile_kv],
            "kv_layout": plan.kv_layout.value,
            "tasks": plan.tasks.name,
            "kernel": plan.kernel.name,
        }


class TesseraQuantized(Backend):
    """The 8-bit path (``precision="int8"``): the plan ``Selector.quantized`` picks, run by its 8-bit
    kernel. ``tessera-int8`` times what a call does on a prepared plan, the quantization pass and
    the kernel; ``tessera-int8-kernel`` the kernel alone, on inputs quantized beforehand. Both run
    the mask many times, so they time the plan of a mask that comes back (``Selector.reused_plan``,
    as ``tessera``); a complete request is a mask's first, in the selected plan itself. Its output
    is held to the 8-bit budget (``quantized.MIN_COSINE``, ``MAX_RELATIVE_L2``), not the 16-bit one.
    For comparison, ``pv="int8"`` (``tessera-int8pv``, ``tessera-int8pv-kernel``) runs the same plan
    on the kernels with an 8-bit P V (the product's P V format is ``kernel_table.DEFAULT_PV``); its
    request is what a call with that format would do: the selection, the plan's preparation, the
    quantization pass and the kernel."""

    kind = "quantized"

    def __init__(self, kernel_only: bool = False, pv: str = DEFAULT_PV):
        self.kernel_only = kernel_only
        self.pv = pv
        self.name = ("tessera-int8" if pv == DEFAULT_PV else "tessera-int8pv") + ("-kernel" if kernel_only else "")

    def unavailable(self) -> str | None:
        """Why this build cannot run the 8-bit kernels of ``pv`` at all (once per run, in
        ``unavailable.json``), or None."""
        from ..library import quantized_library

        if not torch.cuda.is_available():
            return "needs CUDA"
        try:
            library = quantized_library()
        except CatalogError as err:
            return f"native kernels unavailable: {err}"
        if library is None:
            return "this build of the library has no 8-bit kernels (they need an sm90 target and the CuTe headers)"
        if not library.has_pv_format(self.pv):
            return f"this build has no 8-bit kernels with P V format {self.pv!r} (built with TESSERA_PV_FORMATS)"
        return None

    def prepare(self, problem: Problem) -> tuple[PreparedPlan, float]:
        return self.prepared_plan(problem, reused=True), problem.scale

    @staticmethod
    def prepared_plan(problem: Problem, reused: bool = False) -> PreparedPlan:
        """The plan ``Selector.quantized`` picks for ``problem``, prepared; with ``reused``, the plan
        its mask runs when it comes back (``Selector.reused_plan``)."""
        state = build_mask_state(problem.mask)
        request = dataclasses.replace(request_of(problem), precision="int8")
        selector = Selector()
        chosen = selector.quantized(request, state).chosen
        if chosen is None:
            raise Skip("no plan of this request has an 8-bit kernel")
        return prepare(selector.reused_plan(chosen, request, state) if reused else chosen, state)

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        if not self.kernel_only:
            return (q, k, v)
        from ..quantized_ops import quantize

        return (q, k, v, quantize(q, k, v, 1.0 / q.shape[-1] ** 0.5, self.pv))

    def run(self, prepared: tuple[PreparedPlan, float], inputs: Inputs) -> torch.Tensor:
        from ..quantized_ops import run_quantized

        plan, scale = prepared
        q, k, v = inputs[:3]
        return run_quantized(plan, q, k, v, scale, False, quantized=inputs[3] if self.kernel_only else None,
                             pv=self.pv)

    def request(self, problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.pv == DEFAULT_PV:
            return Runtime().attention(q, k, v, problem.mask, scale=problem.scale, precision="int8")
        from ..quantized_ops import run_quantized

        return run_quantized(self.prepared_plan(problem), q, k, v, problem.scale, False, pv=self.pv)

    @staticmethod
    def chosen_plan(prepared: tuple[PreparedPlan, float]) -> str:
        return prepared[0].plan.name
