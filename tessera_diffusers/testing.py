"""Helpers for tests and checks: random masks with the awkward cases, the accuracy criterion, and
the launcher of multi-process tests.

The criterion: a kernel's max error against the fp32 oracle must be at most twice the error of a
same-precision PyTorch run (the oracle with probabilities and output rounded to the kernel's dtype)
plus a small absolute tolerance; log-sum-exp must match to fp32 accuracy, -inf exactly.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import reference
from .catalog import TASK_ORGANIZATIONS, all_kernels, plans_for
from .eligibility import membership_fits, packing_has_room
from .mask import LogicalMask
from .plans import KernelSpec, KvLayout, PhysicalPlan, Request, TaskOrganization, Traversal

# Geometries every plan family is checked on: the corpus's seven, HunyuanVideo's 384, an odd pair.
TEST_GEOMETRIES: tuple[tuple[int, int], ...] = (
    (16, 16),
    (32, 16),
    (32, 32),
    (64, 32),
    (64, 64),
    (128, 64),
    (128, 128),
    (384, 384),
    (48, 80),
)


def random_mask(
    batch: int,
    heads: int,
    seq_q: int,
    seq_kv: int,
    block_q: int,
    block_kv: int,
    density: float = 0.3,
    empty_rows: bool = True,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> LogicalMask:
    """A per-(b, h) random mask made of short runs (like video windows), with a few empty rows
    and the partial last blocks that ``seq_q, seq_kv`` imply."""
    gen = torch.Generator().manual_seed(seed)
    n_q, n_kv = math.ceil(seq_q / block_q), math.ceil(seq_kv / block_kv)
    starts = torch.rand(batch, heads, n_q, n_kv, generator=gen) < density / 2
    grow = torch.rand(batch, heads, n_q, n_kv, generator=gen) < 0.5
    blocks = starts.clone()
    blocks[..., 1:] |= starts[..., :-1] & grow[..., 1:]  # runs of length 1-2
    blocks[..., -1] |= torch.rand(batch, heads, n_q, generator=gen) < 0.5  # partial last KV block
    if empty_rows and n_q > 2:
        blocks[:, :, 1] = False
        blocks[..., -1, :] &= torch.rand(batch, heads, 1, generator=gen) < 0.5
    return LogicalMask(blocks.to(device), block_q, block_kv, seq_q, seq_kv)


def without_empty_rows(mask: LogicalMask) -> LogicalMask:
    """``mask`` with one more active block in every query-block row (``blocks [.., nQ, nKV]``: row i
    also gets key block ``i * nKV // nQ``), so that no row is empty: for peers that cannot express
    rows without keys."""
    blocks = mask.blocks.clone()
    n_q, n_kv = blocks.shape[-2:]
    rows = torch.arange(n_q, device=blocks.device)
    blocks[..., rows, rows * n_kv // n_q] = True
    return LogicalMask(blocks, mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv)


def interleaved_mask(batch: int, heads: int, seq_q: int, seq_kv: int, block_q: int, block_kv: int, seed: int = 0,
                     device: torch.device | str = "cpu") -> LogicalMask:
    """Query block i sees the key blocks of pattern i % 3 (plus a few random ones): consecutive
    blocks share little, blocks three apart share everything, so the grouped query layout has work
    to do. Row 1 is empty; the last blocks are partial when the lengths are not block multiples."""
    gen = torch.Generator().manual_seed(seed)
    n_q, n_kv = math.ceil(seq_q / block_q), math.ceil(seq_kv / block_kv)
    patterns = torch.rand(batch, heads, 3, n_kv, generator=gen) < 0.25
    blocks = patterns[:, :, torch.arange(n_q) % 3] | (torch.rand(batch, heads, n_q, n_kv, generator=gen) < 0.03)
    blocks[:, :, 1] = False
    return LogicalMask(blocks.to(device), block_q, block_kv, seq_q, seq_kv)


def banded_mask(heads: int, seq: int, block_q: int, block_kv: int, density: float = 0.1,
                device: torch.device | str = "cpu") -> LogicalMask:
    """A band of KV blocks around the diagonal covering about ``density`` of the mask, the same for
    every head (long runs, neighbouring rows alike: a sliding window's shape)."""
    n_q, n_kv = math.ceil(seq / block_q), math.ceil(seq / block_kv)
    width = max(1, round(density * n_kv))
    centre = torch.arange(n_q).unsqueeze(1) * n_kv // n_q
    band = (torch.arange(n_kv).unsqueeze(0) - centre).abs() <= width // 2
    return LogicalMask(band.expand(1, heads, n_q, n_kv).to(device), block_q, block_kv, seq, seq)


def random_qkv(
    batch: int, seq_q: int, seq_kv: int, heads: int, head_dim: int, dtype: torch.dtype, device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (never zero) q ``[B, Sq, H, D]``, k, v ``[B, Skv, H, D]``; k, v as strided views of a
    fused buffer, like a diffusers ``to_qkv`` projection."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, head_dim, generator=gen, device=device).to(dtype)
    kv = torch.randn(batch, seq_kv, 2, heads, head_dim, generator=gen, device=device).to(dtype)
    return q, kv[:, :, 0], kv[:, :, 1]


@dataclass(frozen=True)
class Accuracy:
    error: float  # max |out - oracle|
    twin_error: float  # max |same-precision run - oracle|
    lse_error: float  # max |lse - oracle lse| over finite entries
    lse_inf_match: bool  # -inf exactly where the oracle has -inf

    def ok(self, atol: float = 2e-3, lse_atol: float = 1e-3) -> bool:
        return self.error <= 2 * self.twin_error + atol and self.lse_error <= lse_atol and self.lse_inf_match

    def __str__(self) -> str:
        return (
            f"err {self.error:.2e} (twin {self.twin_error:.2e}), lse err {self.lse_error:.2e}, "
            f"-inf match {self.lse_inf_match}"
        )


def check_against_reference(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LogicalMask,
    scale: float | None = None,
) -> Accuracy:
    """Compare a kernel's output (and lse) with the fp32 oracle and the same-precision twin."""
    ref, ref_lse = reference.attention(q, k, v, mask, scale, True, out_dtype=torch.float32)
    twin = reference.attention(q, k, v, mask, scale, out_dtype=q.dtype, p_dtype=q.dtype)
    if not bool(torch.isfinite(out).all()):
        return Accuracy(math.inf, float((twin.float() - ref).abs().max()), math.inf, False)
    error = float((out.float() - ref).abs().max())
    twin_error = float((twin.float() - ref).abs().max())
    if lse is None:
        return Accuracy(error, twin_error, 0.0, True)
    finite = torch.isfinite(ref_lse)
    inf_match = bool(torch.equal(finite, torch.isfinite(lse))) and bool((lse[~finite] == -math.inf).all())
    lse_error = float((lse[finite] - ref_lse[finite]).abs().max()) if bool(finite.any()) else 0.0
    return Accuracy(error, twin_error, lse_error, inf_match)


def plans_to_check(kernel: KernelSpec, block_q: int, block_kv: int, splits: Sequence[int] = (1, 3)):
    """The plans a kernel's GPU test runs on one geometry: each KV layout with each of ``splits``
    and a persistent grid with 3 splits (the Hopper family takes its tasks from a counter there:
    ``ops.dynamic_schedule``); each also in the grouped query layout where a query tile covers
    several blocks."""
    layouts = [KvLayout.CONTIGUOUS] + ([KvLayout.PACKED] if kernel.tile_kv > block_kv else [])
    for layout in layouts:
        tasks = [TaskOrganization(Traversal.LONGEST_FIRST, n) for n in splits]
        for org in tasks + [TaskOrganization(Traversal.LONGEST_FIRST, 3, persistent=True)]:
            plan = PhysicalPlan(block_q, block_kv, layout, org, kernel)
            yield plan
            if plan.can_group_queries:
                yield plan.grouped()


def device_request(q: torch.Tensor, k: torch.Tensor, mask: LogicalMask, plan: PhysicalPlan) -> Request:
    """The request of q ``[B, Sq, H, D]``, k ``[B, Skv, H, D]`` on their CUDA device for ``plan``'s dtype."""
    major, minor = torch.cuda.get_device_capability(q.device)
    return Request(q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.shape[3], plan.kernel.dtype,
                   mask.block_q, mask.block_kv, f"sm{major}{minor}", True)


def metadata_plans(block_q: int, block_kv: int) -> list[PhysicalPlan]:
    """One catalog plan per metadata shape of a geometry: every (tile_q, tile_kv, layout,
    traversal) that the membership and packing predicates let through (dtype, head dim, stages and
    splits do not change what ``prepare`` builds)."""
    plans: dict[tuple, PhysicalPlan] = {}
    for plan in plans_for(block_q, block_kv, all_kernels(), TASK_ORGANIZATIONS):
        if membership_fits(plan, None) is None and packing_has_room(plan, None) is None:
            plans.setdefault((plan.tile_q, plan.tile_kv, plan.kv_layout, plan.tasks.traversal), plan)
    return list(plans.values())


def metadata_difference(got, want) -> str | None:
    """The first difference between two ``PreparedPlan``s' metadata (capacity, then each tensor's
    dtype, shape, contiguity and values, exactly), or None when they are identical."""
    for name in ("num_q_tiles", "capacity"):
        if getattr(got, name) != getattr(want, name):
            return f"{name} {getattr(got, name)} != {getattr(want, name)}"
    if (got.q_units is None) != (want.q_units is None):
        return f"q_units {'set' if got.q_units is not None else 'None'}, expected the other"
    names = ("tile_counts", "tile_slots", "tile_member", "q_order") + (("q_units",) if got.q_units is not None else ())
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if (a.dtype, a.shape) != (b.dtype, b.shape) or not a.is_contiguous():
            return f"{name}: {a.dtype} {tuple(a.shape)} contiguous={a.is_contiguous()}, expected {b.dtype} {tuple(b.shape)}"
        if not torch.equal(a, b):
            where = torch.nonzero(a != b)[0].tolist()
            return f"{name} differs first at {where}: {a[tuple(where)].item()} != {b[tuple(where)].item()}"
    return None


# ---------------------------------------------------------------------------- multi-process tests
def run_in_threads(work: Callable[[int], None], threads: int, switch_interval: float | None = None) -> list[str]:
    """Run ``work(index)`` in ``threads`` threads at once and wait for all; returns one message per
    thread that raised (``"thread 3: KeyError(...)"``), empty when none did. ``switch_interval``
    (seconds) makes the interpreter switch threads that often meanwhile (``sys.setswitchinterval``)."""
    errors: list[str] = []

    def guarded(index: int) -> None:
        try:
            work(index)
        except Exception as err:  # noqa: BLE001 - any exception is the finding
            errors.append(f"thread {index}: {err!r}")

    interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        workers = [threading.Thread(target=guarded, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    return errors


def with_pythonpath_first(env: dict[str, str], directory: str) -> dict[str, str]:
    """A copy of ``env`` with ``directory`` first on ``PYTHONPATH`` (its entries kept after it)."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([directory] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The command line of a ``run_ranks`` worker: ``--rank``, ``--world``, ``--init`` (what
    ``run_ranks`` passes) and ``--out`` (the directory of its ``rank<R>.json``); add the rest."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="tcp://127.0.0.1:PORT")
    parser.add_argument("--out", type=Path, required=True)
    return parser


def run_ranks(
    script: Path, world: int, args: Sequence[str], *, env: dict[str, str], timeout: float
) -> list[subprocess.CompletedProcess]:
    """Run ``python script --rank R --world N --init tcp://127.0.0.1:PORT *args`` for every rank at
    once (``env``, with this checkout first on ``PYTHONPATH``); every process is killed and
    ``TimeoutError`` raised if they outlive ``timeout`` seconds together."""
    env = with_pythonpath_first(env, str(Path(__file__).resolve().parents[1]))
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "--rank", str(r), "--world", str(world), "--init", init, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        raise TimeoutError(f"{Path(script).name}: {world} ranks did not finish within {timeout} s") from None
    return results
