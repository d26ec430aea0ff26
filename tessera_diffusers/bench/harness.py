"""The benchmark loop: every case x every backend, validated, timed, written as it goes.

For each case the mask is built on the device, ``input_sets`` random ``(q, k, v)`` sets are drawn,
and every backend is (1) prepared and run once, (2) checked against the oracle on a few heads,
(3) timed: kernel latency with CUDA events over rotated inputs, complete-request latency on the
host clock. A dense backend's time depends on the shape only, so it is measured once per shape and
shared by the cases of that shape. With ``--interleave`` a case's backends (its dense ones too) are
all validated first and then timed in turn, with the device kept busy (``interleaved_case``).
Records are appended to ``records.jsonl`` as they are made, so a run that is cut short keeps what it
measured (``--resume`` continues it, ``--report-only`` rebuilds the report).
"""

from __future__ import annotations

import gc
import json
import math
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..corpus import CaseSpec, iter_corpus
from ..kernel_table import DEFAULT_PV
from .backends import Backend, FlexAttentionBackend, FlexAttentionTuned, OracleBackend, SdpaBackend, Skip
from .config import BenchConfig, default_backends
from .flashinfer_backends import FlashInferBsr, FlashInferVariable
from .problem import OracleCheck, Problem, check_heads, dtype_named, make_inputs
from .sparge_backends import SPARGE_NAMES, SpargeBackend
from .tessera_backends import TesseraPlan, TesseraQuantized, TesseraSelected, candidate_plans
from .thunderkittens_backends import FBA_NAME, VSA_NAME, FlexBlockAttnBackend, VsaBackend
from .timing import INTERLEAVED_WARM_LAUNCHES, Timing, synchronize, time_interleaved, time_kernel, time_request

RECORDS_FILE = "records.jsonl"
ERROR_CHARS = 600
# A baseline's output only has to be near the oracle (a mis-built mask is off by far more); Tessera's
# must meet the strict criterion, including exact zeros on rows without keys.
BASELINE_SLACK = 4.0


def make_backend(name: str) -> Backend:
    """A baseline or Tessera backend by its ``--backends`` name (not ``tessera-plans``)."""
    if name == "sdpa-cudnn":
        return SdpaBackend("sdpa-cudnn", "CUDNN_ATTENTION")
    if name == "sdpa-fa2":
        return SdpaBackend("sdpa-fa2", "FLASH_ATTENTION")
    if name == "flex":
        return FlexAttentionBackend()
    if name == "flex-tuned":
        return FlexAttentionTuned()
    if name == "reference":
        return OracleBackend()
    if name == "tessera":
        return TesseraSelected()
    if name.startswith("tessera-int8"):
        return TesseraQuantized(kernel_only=name.endswith("-kernel"), pv="int8" if "int8pv" in name else DEFAULT_PV)
    if name.startswith("flashinfer-"):
        _, wrapper, backend = name.split("-")
        return FlashInferBsr(backend) if wrapper == "bsr" else FlashInferVariable(backend)
    if name == VSA_NAME:
        return VsaBackend()
    if name == FBA_NAME:
        return FlexBlockAttnBackend()
    if name in SPARGE_NAMES:
        return SpargeBackend(kernel_only=name.endswith("-kernel"))
    raise ValueError(f"unknown backend {name!r}")  # BenchConfig validated the names already


# Dense baselines first (they are the yardstick); FlashInfer, the ThunderKittens peers and SpargeAttn
# last (a CUDA error there would poison the context for everything measured after it).
ORDER = ("sdpa-cudnn", "sdpa-fa2", "tessera", "tessera-int8", "tessera-int8-kernel", "tessera-int8pv",
         "tessera-int8pv-kernel", "tessera-plans", "flex", "reference")


def ordered(names: Iterable[str]) -> list[str]:
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


@dataclass
class RunState:
    """Everything a run accumulates (explicit, no module globals)."""

    config: BenchConfig
    device: torch.device
    backends: list[Backend]
    unavailable: dict[str, str]
    records: list[dict]
    done: set[tuple[str, str]]
    dense_records: dict[tuple, dict]
    records_path: Path
    log: Callable[[str], None]


def base_record(problem: Problem, backend: Backend) -> dict:
    mask = problem.mask
    return {
        "case": problem.name,
        "size": problem.size,
        "family": problem.family,
        "source": problem.source,
        "geometry": problem.geometry,
        "backend": backend.name,
        "kind": backend.kind,
        "batch": problem.batch,
        "heads": problem.heads,
        "seq_len": problem.seq_q,
        "head_dim": problem.head_dim,
        "dtype": str(problem.dtype).replace("torch.", ""),
        "density": problem.info.get("density"),
        "grid": problem.info.get("grid"),
        "effective_gflop": problem.effective_flops() / 1e9,
        "dense_gflop": problem.dense_flops() / 1e9,
        "mask_blocks": list(mask.blocks.shape),
    }


def failure(record: dict, status: str, reason: str) -> dict:
    record["status"] = status
    record["reason"] = reason[:ERROR_CHARS]
    return record


@dataclass
class Held:
    """A validated backend, kept ready to be timed: its prepared state and converted inputs."""

    backend: Backend
    prepared: Any
    converted: list

    def run(self, index: int) -> object:
        return self.backend.run(self.prepared, self.converted[index])


def measure(state: RunState, backend: Backend, problem: Problem, inputs: list, oracle: OracleCheck) -> dict:
    """Validate and time one backend on one problem; never raises for a backend's own failure."""
    record, held = validate(state, backend, problem, inputs, oracle)
    return record if held is None else timed(state, record, held, problem, inputs)


def validate(state: RunState, backend: Backend, problem: Problem, inputs: list, oracle: OracleCheck,
             raise_oom: bool = False) -> tuple[dict, Held | None]:
    """Prepare ``backend``, run it once and compare with the oracle. Returns its record and, when the
    output is valid, the backend held ready for timing; otherwise the failure record and None (a
    backend's own failure is a result, never raised — but out-of-memory with ``raise_oom``)."""
    record = base_record(problem, backend)
    reason = backend.unsupported(problem)
    if reason:
        return failure(described(record, backend), "skipped", reason), None
    try:
        start = time.perf_counter()
        prepared = backend.prepare(problem)
        converted = [backend.convert(*s) for s in inputs]
        out = backend.run(prepared, converted[0])
        synchronize(problem.device)
        record["first_call_s"] = time.perf_counter() - start  # includes compilation / JIT
        if isinstance(backend, (TesseraSelected, TesseraQuantized)):
            record["selected_plan"] = backend.chosen_plan(prepared)
        if backend.kind == "quantized":  # held to the 8-bit budget against the oracle
            fit = oracle.agreement(backend.to_bshd(out, problem))
            del out
            record["check"] = {"cosine": fit.cosine, "relative_l2": fit.relative_l2, "ok": fit.within_budget()}
            if not fit.within_budget() and not backend.budget_gate:  # a peer: timed, its agreement on record
                record.setdefault("notes", []).append(
                    f"{backend.name}: outside the 8-bit budget (cosine {fit.cosine:.5f}, relative L2 "
                    f"{fit.relative_l2:.4f}), timed as a peer")
            elif not fit.within_budget():
                return failure(described(record, backend), "invalid",
                               f"outside the 8-bit budget: cosine {fit.cosine:.5f}, relative L2 {fit.relative_l2:.4f}"), None
            return record, Held(backend, prepared, converted)
        check = oracle.compare(backend.to_bshd(out, problem))
        del out
        record["check"] = check.to_dict()
        strict = backend.kind == "tessera"
        allowed = check.tolerance if strict else BASELINE_SLACK * check.tolerance
        if not check.error <= allowed:
            return failure(described(record, backend), "invalid",
                           f"output differs from the oracle: max error {check.error:.3g} > {allowed:.3g} allowed "
                           f"(twin error {check.twin_error:.3g})"), None
        if strict and not check.empty_rows_zero:
            return failure(described(record, backend), "invalid", "rows without keys are not 0"), None
        return record, Held(backend, prepared, converted)
    except torch.OutOfMemoryError:
        if raise_oom:
            raise
        return crashed(state, record, backend, problem), None
    except Skip as err:
        return failure(described(record, backend), "skipped", str(err)), None
    except Exception:  # noqa: BLE001  (a baseline's own failure is a result, not a crash of the run)
        return crashed(state, record, backend, problem), None


def timed(state: RunState, record: dict, held: Held, problem: Problem, inputs: list,
          kernel: Timing | None = None) -> dict:
    """``record`` of a validated backend completed with its timings: the kernel's (timed here after
    the warm-up, or ``kernel`` when it was timed in turn with the case's other backends), then the
    complete request's. Frees what ``held`` holds."""
    cfg = state.config
    backend = held.backend
    try:
        if kernel is None:
            kernel = time_kernel(held.run, len(held.converted), cfg.warmup, cfg.reps, problem.device, cfg.warmup_ms)
        held.converted = []  # free the converted copies before the request timing makes its own
        request = None
        reps = cfg.plan_request_reps if isinstance(backend, TesseraPlan) else cfg.request_reps
        if reps > 0:  # the validation run already warmed every code path: no warm-up needed
            n = len(inputs)
            request = time_request(lambda i: backend.request(problem, *inputs[i % n]), n, 0, reps, problem.device)
    except Skip as err:
        return failure(described(record, backend), "skipped", str(err))
    except Exception:  # noqa: BLE001  (a baseline's own failure is a result, not a crash of the run)
        return crashed(state, record, backend, problem)
    finally:
        held.converted, held.prepared = [], None
        if problem.device.type == "cuda":
            torch.cuda.empty_cache()
    work = problem.dense_flops() if backend.kind == "dense" else problem.effective_flops()
    record.setdefault("timing_method", "sequential")
    described(record, backend).update(
        status="ok",
        kernel_ms=kernel.median_ms,
        kernel=kernel.to_dict(),
        request_ms=request.median_ms if request else None,
        request=request.to_dict() if request else None,
        tflops=work / (kernel.median_ms * 1e-3) / 1e12,
    )
    return record


def described(record: dict, backend: Backend) -> dict:
    """``record`` with the backend's own description (after its run: it may note what the run had to
    change); a description key never renames the record's backend."""
    record.update(backend.describe())
    record["backend"] = backend.name
    return record


def crashed(state: RunState, record: dict, backend: Backend, problem: Problem) -> dict:
    """The failure record of the exception being handled (logged, traceback kept)."""
    err = sys.exc_info()[1]
    state.log(f"{backend.name} on {problem.name}: {type(err).__name__}: {err}")
    record["traceback"] = traceback.format_exc()[-2000:]
    if problem.device.type == "cuda":
        torch.cuda.empty_cache()
    return failure(described(record, backend), "failed", f"{type(err).__name__}: {err}")


def emit(state: RunState, record: dict) -> None:
    state.records.append(record)
    with open(state.records_path, "a") as f:
        f.write(json.dumps(record) + "\n")


def measure_dense(state: RunState, backend: Backend, problem: Problem, inputs: list) -> dict:
    """A dense baseline: measured on the first problem of each shape, copied to the others."""
    key = (backend.name,) + problem.shape_key
    if key not in state.dense_records:
        heads = check_heads(problem.heads, state.config.validate_heads)
        oracle = OracleCheck(problem, inputs[0], heads, state.config.atol, dense=True)
        state.dense_records[key] = measure(state, backend, problem, inputs, oracle)
        shared = False
    else:
        shared = True
    record = dict(state.dense_records[key])
    record.update(base_record(problem, backend))
    record["shared_with_shape"] = shared
    return record


def problem_for(size: str, case: CaseSpec, config: BenchConfig, device: torch.device) -> Problem:
    mask = case.build(device)
    info = {"density": mask.density(), "grid": case.grid.name, "seed": case.seed, "target_density": case.target_density()}
    return Problem(case.name, size, case.family, case.source, mask, config.batch, case.heads, config.head_dim,
                   dtype_named(config.dtype), case, info)


def problems(config: BenchConfig, device: torch.device) -> Iterable[tuple[str, Callable[[], Problem]]]:
    """``(key, build)`` per case; masks are built one at a time, when their turn comes."""
    if config.corpus_dir is not None:
        for entry in iter_corpus(config.corpus_dir, device):
            fam = entry.case.family if entry.case else str(entry.info.get("family", entry.mask.geometry_name))
            src = entry.case.source if entry.case else str(entry.info.get("source", "corpus"))
            heads = entry.mask.heads if entry.mask.heads > 1 else (config.heads or 1)
            info = {"density": entry.mask.density(), "grid": entry.case.grid.name if entry.case else None}
            problem = Problem(entry.name, "corpus", fam, src, entry.mask, config.batch, heads, config.head_dim,
                              dtype_named(config.dtype), entry.case, info)
            yield f"corpus:{entry.name}", (lambda p=problem: p)
        return
    for size, case in config.cases():
        yield f"{size}:{case.name}", (lambda s=size, c=case: problem_for(s, c, config, device))


def load_done(path: Path) -> tuple[list[dict], set[tuple[str, str]]]:
    records, done = [], set()
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                records.append(rec)
                done.add((f"{rec['size']}:{rec['case']}", rec["backend"]))
    return records, done


def run_benchmark(config: BenchConfig, log: Callable[[str], None] = print) -> tuple[list[dict], dict[str, str]]:
    """Measure every case of ``config`` with every backend. Returns the records (also appended to
    ``<out_dir>/records.jsonl``) and the backends that could not run at all, with the reason."""
    device = torch.device(config.device)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path = out_dir / RECORDS_FILE
    records, done = load_done(records_path) if config.resume else ([], set())
    if not config.resume and records_path.exists():
        records_path.unlink()
    names = ordered(config.backends or default_backends(config.mode, device.type))
    backends, unavailable = [], {}
    for name in names:
        if name == "tessera-plans":
            continue
        backend = make_backend(name)
        reason = backend.unavailable()
        if reason:
            unavailable[name] = reason
            log(f"skipping {name}: {reason}")
        else:
            backends.append(backend)
    state = RunState(config, device, backends, unavailable, records, done, {}, records_path, log)
    (out_dir / "unavailable.json").write_text(json.dumps(unavailable, indent=1))
    with_plans = "tessera-plans" in names
    cases = list(problems(config, device))
    bar = progress_bar(len(cases), config.progress)
    for key, build in cases:
        bar_describe(bar, key)
        try:
            problem = build()
        except Exception as err:  # noqa: BLE001  (one unbuildable case must not end the run)
            log(f"case {key} could not be built: {type(err).__name__}: {err}")
            bar_update(bar)
            continue
        run_case(state, problem, with_plans, bar)
        del problem
        gc.collect()
        bar_update(bar)
    bar_close(bar)
    return state.records, unavailable


def run_case(state: RunState, problem: Problem, with_plans: bool, bar: Any) -> None:
    cfg = state.config
    inputs = make_inputs(problem, cfg.input_sets, cfg.seed)
    heads = check_heads(problem.heads, cfg.validate_heads)
    oracle = OracleCheck(problem, inputs[0], heads, cfg.atol)
    case_backends: list[Backend] = []
    for backend in state.backends:
        case_backends.append(backend)
        if isinstance(backend, TesseraSelected) and with_plans:
            case_backends.extend(plan_backends(state, problem))
    if with_plans and not any(isinstance(b, TesseraSelected) for b in state.backends):
        case_backends = plan_backends(state, problem) + case_backends
    todo = [b for b in case_backends if (problem.key, b.name) not in state.done]
    if cfg.interleave:
        interleaved_case(state, problem, todo, inputs, oracle, bar)
        return
    for backend in todo:
        bar_postfix(bar, backend.name)
        if backend.kind == "dense":
            record = measure_dense(state, backend, problem, inputs)
        else:
            record = measure(state, backend, problem, inputs, oracle)
        emit(state, record)


def interleaved_case(state: RunState, problem: Problem, backends: list[Backend], inputs: list, oracle: OracleCheck,
                     bar: Any) -> None:
    """``--interleave``: every backend of the case is validated first (a dense one against its own
    oracle, on this case: no sharing across the cases of a shape), then the valid ones are timed in
    turn in one busy stretch of the device (``timing.time_interleaved``, at least
    ``INTERLEAVED_WARM_LAUNCHES`` warm-up launches). Timed one after another, a kernel that follows
    an idle gap runs at a higher clock than one under load, so a short sparse kernel timed right
    after its own setup can look a few percent faster beside a long dense one than it would in a
    loop. When the device runs out of memory for the next backend, the ones held so far are timed
    as a batch and freed, and that backend is validated again."""
    dense_oracle = None
    held: list[tuple[dict, Held]] = []
    for backend in backends:
        bar_postfix(bar, backend.name)
        check = oracle
        if backend.kind == "dense":
            if dense_oracle is None:
                heads = check_heads(problem.heads, state.config.validate_heads)
                dense_oracle = OracleCheck(problem, inputs[0], heads, state.config.atol, dense=True)
            check = dense_oracle
        while True:
            try:
                record, ready = validate(state, backend, problem, inputs, check, raise_oom=bool(held))
            except torch.OutOfMemoryError:
                time_held_batch(state, problem, inputs, held)  # make room, then try this backend again
                held = []
                continue
            break
        if ready is None:
            emit(state, record)
        else:
            held.append((record, ready))
    time_held_batch(state, problem, inputs, held)


def time_held_batch(state: RunState, problem: Problem, inputs: list, held: list[tuple[dict, Held]]) -> None:
    """Time validated backends in turn and record them (each record names the backends it was timed
    with); a failure of the batch is every backend's record."""
    if not held:
        return
    cfg = state.config
    rounds = max(cfg.warmup, math.ceil(INTERLEAVED_WARM_LAUNCHES / len(held)))
    names = [ready.backend.name for _, ready in held]
    try:
        timings = time_interleaved([ready.run for _, ready in held], len(inputs), rounds, cfg.reps, problem.device)
    except Exception:  # noqa: BLE001  (the batch fails as one: each backend gets the record)
        for record, ready in held:
            emit(state, crashed(state, record, ready.backend, problem))
            ready.converted, ready.prepared = [], None
        return
    for (record, ready), timing in zip(held, timings):
        record.update(timing_method="interleaved", timed_with=names)
        emit(state, timed(state, record, ready, problem, inputs, timing))


def plan_backends(state: RunState, problem: Problem) -> list[Backend]:
    plans, why_none = candidate_plans(problem, allow_executor=problem.device.type != "cuda")
    if not plans:
        state.log(f"no Tessera plans for {problem.name}: {why_none}")
    pattern = state.config.plan_filter
    if pattern is not None:
        plans = [p for p in plans if re.search(pattern, p.name)]
    return [TesseraPlan(p) for p in plans]


# -- progress bar (tqdm when installed and wanted) ---------------------------------------------------

def progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="case", dynamic_ncols=True)


def bar_describe(bar: Any, text: str) -> None:
    if bar is not None:
        bar.set_description(text[-60:])


def bar_postfix(bar: Any, text: str) -> None:
    if bar is not None:
        bar.set_postfix_str(text[-50:])


def bar_update(bar: Any) -> None:
    if bar is not None:
        bar.update(1)


def bar_close(bar: Any) -> None:
    if bar is not None:
        bar.close()
