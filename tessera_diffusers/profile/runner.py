"""The offline profiler: every eligible plan of every profiling case, validated, then timed.

For each case (``ProfileConfig.cases()``): build the mask on the device, its ``MaskState`` and
statistics, ``input_sets`` random ``(q, k, v)`` sets, and the fp32 oracle on ``validate_heads``
heads (computed once per case, shared by its plans). Then for each eligible plan, fastest predicted
first (after ``contenders_after`` cases of a request key, optionally only its contenders): prepare
it, run it once and compare with the oracle (the criterion of
``tessera_diffusers.testing``: at most twice the error of a same-precision PyTorch run plus a small
atol, exact zeros on rows without keys), then time it — CUDA events, median of ``reps`` after
``warmup`` runs, rotating the input sets so L2 cannot hold them (``bench.timing``). A plan whose
first timed run is already ``abandon_factor`` x slower than the case's best keeps that one sample.
That is the ``interleave=False`` (``--sequential``) method. By default (``interleave``) the case's
plans are all validated first and then timed in turn, in one busy stretch of the GPU (no plan
abandoned): timed one by one between validations, a plan's time depended on its place in the order
by up to +-10% (as the GPU's clock after each idle gap would make it), and a repeat run disagreed on
the fastest plan. With ``context_gemm`` a dense GEMM runs before every timed launch (a model's
projections between attention calls); on the H200 it did not change relative plan times, nor did
the batch a plan shares (``docs/results.md``), so it is off by default.

On a device without native kernels (the CPU smoke run) the plans are PyTorch-executor plans
(reference family); tests can also inject the timing function. Every result is appended to
``profile.jsonl`` at once (``records.py``): a rerun skips every (case, plan) already there.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..bench.problem import OracleCheck, Problem, check_heads, dtype_named, make_inputs
from ..bench.tessera_backends import request_of
from ..bench.timing import (
    INTERLEAVED_ROUND_ORDER,
    INTERLEAVED_WARM_LAUNCHES,
    Timing,
    gemm_context,
    synchronize,
    time_interleaved,
    time_kernel,
)
from ..catalog import catalog_hash, plans_for, reference_kernel
from ..corpus import CaseSpec
from ..cost_model import estimate_ms
from ..eligibility import rejection
from ..errors import InvalidArgumentError, NativeKernelError
from ..mask_state import MaskState, build_mask_state
from ..plan_table import kernel_to_dict, plan_to_dict
from ..plans import KernelSpec, KvLayout, PhysicalPlan, Request, TaskOrganization, with_grouped_layouts
from ..prepare import PreparedPlan, prepare
from ..runtime import execute
from ..selector import library_kernel_sources
from .config import ProfileConfig
from .records import RECORDS_FILE, Progress, append_record, load_progress, request_to_dict

ERROR_CHARS = 600
# Query-tile heights, in block rows, whose row-union ratio a case record keeps: 128-row tiles over
# 16-token blocks are 8 rows, 64-row tiles over 32-token blocks 2.
ROW_UNION_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class Trial:
    """One validated plan on one case, ready to time: ``run(i)`` executes it on input set ``i``."""

    plan: PhysicalPlan
    prepared: PreparedPlan
    request: Request
    run: Callable[[int], object]
    n_sets: int
    device: torch.device
    best_ms: float | None  # fastest valid median of this case so far


@dataclass(frozen=True)
class Measured:
    timing: Timing
    abandoned: bool = False


Measure = Callable[[Trial], Measured]


@dataclass(frozen=True)
class KernelTimer:
    """The default ``Measure``: one probe run, then warm-ups + median of reps unless hopeless."""

    warmup: int
    reps: int
    abandon_factor: float

    def __call__(self, trial: Trial) -> Measured:
        probe = time_kernel(trial.run, trial.n_sets, 0, 1, trial.device)
        if self.abandon_factor and trial.best_ms is not None and probe.median_ms > self.abandon_factor * trial.best_ms:
            return Measured(probe, abandoned=True)
        return Measured(time_kernel(trial.run, trial.n_sets, self.warmup, self.reps, trial.device))


@dataclass(frozen=True)
class ProfileSummary:
    records_path: Path
    cases_total: int
    cases_done: int  # complete cases in the records file, earlier runs included
    cases_new: int  # completed by this run
    plans_measured: int  # (case, plan) records written by this run
    stopped: str | None  # why the run ended early ("time budget", a CUDA error), None when complete
    elapsed_s: float

    def __str__(self) -> str:
        end = f"stopped early: {self.stopped}" if self.stopped else "complete"
        return (f"{self.cases_done}/{self.cases_total} cases profiled ({self.cases_new} new, {self.plans_measured} "
                f"plan measurements) in {self.elapsed_s:.0f} s, {end}; records in {self.records_path}")


def profiling_kernels(device: torch.device) -> tuple[KernelSpec, ...]:
    """The native catalog the profiler ranks: the loaded library on CUDA (``CatalogError`` if
    missing), none elsewhere (the PyTorch executor's plans are used instead)."""
    if device.type != "cuda":
        return ()
    from .. import ops

    return ops.available_kernels()


def executor_plans(request: Request) -> list[PhysicalPlan]:
    """Reference-family plans for a device without native kernels: direct and two-block-coarsened
    KV tiles, each without and with a two-way split (the executor honours tiles and splits)."""
    plans = []
    for tile_kv in (request.block_kv, 2 * request.block_kv):
        kernel = reference_kernel(request.head_dim, request.dtype, request.block_q, tile_kv)
        for tasks in (TaskOrganization(), TaskOrganization(num_splits=2)):
            plans.append(PhysicalPlan(request.block_q, request.block_kv, KvLayout.CONTIGUOUS, tasks, kernel))
    return plans


def case_plans(request: Request, kernels: tuple[KernelSpec, ...],
               plan_filter: str | None) -> tuple[list[PhysicalPlan], dict[str, str]]:
    """Eligible plans of one case (catalog plans, or executor plans without a catalog; for a reused
    mask also their grouped query layout) and the reasons of the rejected ones."""
    space = plans_for(request.block_q, request.block_kv, kernels) if kernels else executor_plans(request)
    if request.reused_mask:
        space = with_grouped_layouts(space)
    eligible, rejected = [], {}
    for plan in space:
        reason = rejection(plan, request)
        if reason is not None:
            rejected[plan.name] = reason
        elif plan_filter is None or re.search(plan_filter, plan.name):
            eligible.append(plan)
    return eligible, rejected


def fatal_device_error(err: BaseException) -> bool:
    """A CUDA error poisons the context: every later launch would fail too."""
    text = str(err)
    return isinstance(err, NativeKernelError) or "CUDA error" in text or "illegal memory access" in text


class Bars:
    """Two tqdm bars (cases, plans of the current case), or plain log lines without tqdm."""

    def __init__(self, total: int, enabled: bool, log: Callable[[str], None]):
        self.log = log
        self.cases = self.plans = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.cases = tqdm(total=total, unit="case", dynamic_ncols=True, position=0)
            self.plans = tqdm(total=0, unit="plan", dynamic_ncols=True, position=1, leave=False)

    def start_case(self, name: str, n_plans: int) -> None:
        if self.cases is not None:
            self.cases.set_description(name[-50:])
            self.plans.reset(total=n_plans)

    def plan_done(self, text: str) -> None:
        if self.plans is not None:
            self.plans.set_postfix_str(text[-40:])
            self.plans.update(1)

    def case_done(self, line: str, skipped: bool = False) -> None:
        if self.cases is not None:
            self.cases.update(1)
        elif not skipped:
            self.log(line)

    def close(self) -> None:
        for bar in (self.plans, self.cases):
            if bar is not None:
                bar.close()


def build_problem(size: str, case: CaseSpec, config: ProfileConfig, device: torch.device) -> Problem:
    mask = case.build(device)
    info = {"density": mask.density(), "grid": case.grid.name, "seed": case.seed}
    return Problem(case.name, size, case.family, case.source, mask, config.batch, case.heads, config.head_dim,
                   dtype_named(config.dtype), case, info)


def case_key(size: str, case: CaseSpec, config: ProfileConfig) -> str:
    """What a case record is keyed by: the case at one size, dtype, head dim and batch (and
    ``:reused`` for a mask that comes back)."""
    key = f"{size}:{case.name}:{config.dtype}:d{config.head_dim}:b{config.batch}"
    return f"{key}:reused" if config.reused_masks else key


def validate_plan(key: str, plan: PhysicalPlan, problem: Problem, state: MaskState, inputs: list,
                  oracle: OracleCheck) -> tuple[dict, PreparedPlan | None, Callable[[int], object] | None]:
    """Prepare one plan, run it once and compare with the oracle: its record so far and, when the
    output is valid, the prepared plan and ``run(i)`` on input set ``i`` (None and None otherwise:
    the record says why)."""
    record: dict = {"type": "plan", "case": key, "plan": plan.name}
    start = time.perf_counter()
    prepared = prepare(plan, state)
    scale = problem.scale

    def run(i: int) -> object:
        return execute(prepared, *inputs[i % len(inputs)], scale, False)

    out = run(0)
    synchronize(problem.device)
    record["first_call_ms"] = (time.perf_counter() - start) * 1e3
    check = oracle.compare(out)
    del out
    record["check"] = check.to_dict()
    if not check.ok:
        why = "rows without keys are not 0" if check.within_tolerance else (
            f"max error {check.error:.3g} > {check.tolerance:.3g} allowed (twin error {check.twin_error:.3g})")
        return {**record, "status": "invalid", "reason": f"output differs from the oracle: {why}"}, None, None
    return record, prepared, run


def failed_record(key: str, plan: PhysicalPlan, err: BaseException) -> tuple[dict, BaseException | None]:
    """The record of a plan that raised, and the error again when it is fatal to the device."""
    record = {"type": "plan", "case": key, "plan": plan.name, "status": "failed",
              "reason": f"{type(err).__name__}: {err}"[:ERROR_CHARS]}
    return record, (err if fatal_device_error(err) else None)


def interleaved_case(key: str, plans: Sequence[PhysicalPlan], problem: Problem, state: MaskState, inputs: list,
                     oracle: OracleCheck, config: ProfileConfig, out_of_time: Callable[[], bool],
                     finish: Callable[..., str | None], between: Callable[[], object] | None = None) -> str | None:
    """Interleaved timing (the default): validate every plan of the case, then time the valid ones
    in turn in one busy stretch of the GPU (``bench.timing.time_interleaved``), at least
    ``INTERLEAVED_WARM_LAUNCHES`` warm-up launches first. No plan is abandoned. The validated plans
    keep their prepared metadata until they are timed: when the device runs out of memory for the
    next one, the plans validated so far are timed as one batch and freed, and that plan is tried
    again (out of memory alone, it is a failure). Returns why the run must stop, or None."""
    valid: list = []
    for plan in plans:
        if out_of_time():
            return "time budget"
        while True:
            try:
                record, _, run = validate_plan(key, plan, problem, state, inputs, oracle)
                fatal = None
            except torch.OutOfMemoryError as err:
                if valid:  # make room: time what is validated, then try this plan again
                    stopped = time_batch(key, valid, len(inputs), config, problem.device, finish, between)
                    valid = []
                    if problem.device.type == "cuda":
                        torch.cuda.empty_cache()
                    if stopped is not None:
                        return stopped
                    continue
                (record, fatal), run = failed_record(key, plan, err), None
            except Exception as err:  # noqa: BLE001  (a plan's failure is a result)
                (record, fatal), run = failed_record(key, plan, err), None
            break
        if run is None:
            stopped = finish(key, plan, record, fatal)
            if stopped is not None:
                return stopped
        else:
            valid.append((plan, record, run))
    return time_batch(key, valid, len(inputs), config, problem.device, finish, between)


def time_batch(key: str, valid: list, n_sets: int, config: ProfileConfig, device: torch.device,
               finish: Callable[..., str | None], between: Callable[[], object] | None = None) -> str | None:
    """Time validated ``(plan, record, run)`` triples in turn (``between()`` before every launch:
    the run's context GEMM) and record them; a failure of the batch is every plan's record.
    Returns why the run must stop, or None."""
    if not valid:
        return None
    rounds = max(config.warmup, math.ceil(INTERLEAVED_WARM_LAUNCHES / len(valid)))
    try:
        timings = time_interleaved([run for *_, run in valid], n_sets, rounds, config.reps, device, between)
    except Exception as err:  # noqa: BLE001  (the batch fails as one: each plan gets the record)
        for plan, *_ in valid:
            record, fatal = failed_record(key, plan, err)
            stopped = finish(key, plan, record, fatal)
            if stopped is not None:
                return stopped
        return None
    for (plan, record, _), timing in zip(valid, timings):
        finish(key, plan, timed_record(record, timing, interleaved=True, context=config.context))
    return None


def timed_record(record: dict, timing: Timing, abandoned: bool = False, interleaved: bool = False,
                 context: str | None = None) -> dict:
    """A validated plan's record completed with its timing (median, samples, timer, how it was timed)."""
    out = {**record, "status": "ok", "latency_ms": timing.median_ms, "samples_ms": list(timing.samples_ms),
           "timer": timing.timer, "abandoned": abandoned}
    if interleaved:
        out["interleaved"] = True
        out["round_order"] = INTERLEAVED_ROUND_ORDER
    if context:
        out["context"] = context
    return out


def measure_plan(key: str, plan: PhysicalPlan, problem: Problem, state: MaskState, inputs: list, oracle: OracleCheck,
                 request: Request, best_ms: float | None, measure: Measure) -> dict:
    """Validate then time one plan; a plan's own failure is a record, not an exception (the caller
    records it and stops on a fatal device error)."""
    record, prepared, run = validate_plan(key, plan, problem, state, inputs, oracle)
    if prepared is None or run is None:
        return record
    measured = measure(Trial(plan, prepared, request, run, len(inputs), problem.device, best_ms))
    return timed_record(record, measured.timing, measured.abandoned)


def run_profile(config: ProfileConfig, *, measure: Measure | None = None,
                log: Callable[[str], None] = print) -> ProfileSummary:
    """Profile every case of ``config`` (see the module docstring). Returns what was done; the
    records are in ``<out_dir>/profile.jsonl``."""
    if measure is not None and config.interleave:
        raise InvalidArgumentError("measure", "no per-plan timer when the config interleaves (interleave=False)",
                                   type(measure).__name__)
    started = time.monotonic()
    deadline = None if config.minutes is None else started + 60.0 * config.minutes
    device = torch.device(config.device)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RECORDS_FILE
    if not config.resume and path.exists():
        path.unlink()
    progress = load_progress(path) if config.resume else Progress()
    if progress.bad_lines:
        log(f"{path}: skipped {progress.bad_lines} unreadable line(s) (a run cut short mid-write)")
    method = config.timing_method
    if progress.methods - {method}:
        log(f"{path} holds {'/'.join(sorted(progress.methods - {method}))} timings and this run times {method}: "
            "their times are not comparable, profile into a new --out (or pass --fresh, or match the method)")
    kernels = profiling_kernels(device)
    cuda = device.type == "cuda"
    catalog = {"catalog_hash": catalog_hash(kernels), "kernel_sources": library_kernel_sources(cuda),
               "grouping_sources": library_kernel_sources(cuda, "grouping_sources")}
    others = progress.catalogs - {catalog["catalog_hash"]}
    if others:
        log(f"{path} holds measurements of other kernel catalogs {sorted(others)}: plans measured then count as "
            "done; after rebuilding the kernels profile into a new --out (or pass --fresh)")
    append_record(path, {"type": "catalog", **catalog, "kernels": [kernel_to_dict(k) for k in kernels]})
    measure = measure or KernelTimer(config.warmup, config.reps, config.abandon_factor)
    context = gemm_context(config.context_gemm, device) if config.context_gemm else None  # one for the run
    cases = config.cases()
    bars = Bars(len(cases), config.progress, log)
    stopped, new_cases, new_plans = None, 0, 0

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    def finish(key: str, plan: PhysicalPlan, record: dict, fatal: BaseException | None = None) -> str | None:
        """Append one plan's record; the reason to stop when the CUDA context is gone."""
        nonlocal new_plans
        if plan.name not in progress.specs:  # each plan's spec once per records file
            record["spec"] = plan_to_dict(plan)
            progress.specs.add(plan.name)
        append_record(path, record)
        new_plans += 1
        progress.done_plans.add((key, plan.name))
        if fatal is not None:  # every later launch would fail too
            return f"device error on {plan.name} ({type(fatal).__name__}: {fatal})"[:ERROR_CHARS]
        if record["status"] == "ok":
            progress.record_ok(key, plan.name, record["latency_ms"])
        bars.plan_done(f"{record['status']} {plan.name}")
        return None

    try:
        for index, (size, case) in enumerate(cases):
            key = case_key(size, case, config)
            if key in progress.done_cases:
                bars.case_done("", skipped=True)
                continue
            if out_of_time():
                stopped = "time budget"
                break
            try:
                problem = build_problem(size, case, config, device)
            except Exception as err:  # noqa: BLE001  (one unbuildable case must not end the run)
                log(f"case {key} could not be built ({type(err).__name__}: {err}); skipped")
                bars.case_done("", skipped=True)
                continue
            request = dataclasses.replace(request_of(problem), reused_mask=config.reused_masks)
            plans, rejected = case_plans(request, kernels, config.plan_filter)
            state = build_mask_state(problem.mask)
            stats = state.host_stats()
            # The query-axis waste of coarsened tiles (the cost model's measured input), kept with
            # the case so that an offline pass can rebuild the model's estimates without the mask.
            row_unions = {str(r): v for r, v in state.row_union_ratios(ROW_UNION_SIZES).items()}
            plans.sort(key=lambda p: estimate_ms(p, request, stats))  # a good best-so-far early
            group = f"{size}|{request.key}"
            pruned = 0
            if config.contenders_after and len(progress.groups.get(group, ())) >= config.contenders_after:
                contenders, seen = progress.contenders(group, config.contender_regret)
                kept = [p for p in plans if p.name in contenders or p.name not in seen]
                pruned, plans = len(plans) - len(kept), kept
            todo = [p for p in plans if (key, p.name) not in progress.done_plans]
            bars.start_case(key, len(todo))
            inputs = make_inputs(problem, config.input_sets, config.seed)
            oracle = OracleCheck(problem, inputs[0], check_heads(problem.heads, config.validate_heads), config.atol)
            if config.interleave:
                stopped = interleaved_case(key, todo, problem, state, inputs, oracle, config, out_of_time, finish,
                                           context)
            else:
                for plan in todo:
                    if out_of_time():
                        stopped = "time budget"
                        break
                    fatal = None
                    try:
                        record = measure_plan(key, plan, problem, state, inputs, oracle, request,
                                              progress.best_ms.get(key), measure)
                    except Exception as err:  # noqa: BLE001  (a plan's failure is a result)
                        record, fatal = failed_record(key, plan, err)
                    stopped = finish(key, plan, record, fatal)
                    if stopped is not None:
                        break
            if stopped is None:
                ok = sum(1 for p in plans if (key, p.name) in progress.done_plans)
                append_record(path, {**case_record(key, size, case, problem, request, stats, plans, rejected, device,
                                                   catalog), "row_unions": row_unions, "pruned": pruned,
                                     "split": config.split})
                progress.done_cases.add(key)
                progress.groups.setdefault(group, []).append(key)
                new_cases += 1
                best = progress.best_ms.get(key)
                left = "" if deadline is None else f", {max(0.0, deadline - time.monotonic()):.0f} s left"
                bars.case_done(f"[{index + 1}/{len(cases)}] {key}: {ok} plans, best "
                               f"{'-' if best is None else f'{best:.3f}'} ms{left}")
            del problem, inputs, oracle, state
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if stopped is not None:
                break
    finally:
        bars.close()
    return ProfileSummary(path, len(cases), len(progress.done_cases), new_cases, new_plans, stopped,
                          time.monotonic() - started)


def case_record(key: str, size: str, case: CaseSpec, problem: Problem, request: Request, stats: dict,
                plans: Sequence[PhysicalPlan], rejected: dict, device: torch.device, catalog: dict) -> dict:
    return {
        "type": "case",
        "case": key,
        "size": size,
        "spec": case.to_dict(),
        "family": case.family,
        "source": case.source,
        "group": case.source,  # cross-validation keeps one source in one fold
        "density": problem.info.get("density"),
        "request": request_to_dict(request),
        "key": request.key,
        "arch": request.arch,
        "stats": stats,
        "plans": len(plans),
        "rejected": rejected,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        **catalog,
    }
