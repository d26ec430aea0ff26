"""Timing per DESIGN section 9.

Kernel latency: CUDA events around each call on the current stream, ``warmup`` untimed calls, then
the median of ``reps`` timed calls, each on the next of several input sets (so L2 cannot hold the
operands between calls). Complete-request latency: the host monotonic clock from the call to the
synchronized end, including every mask-dependent step. On a CPU device both use the host clock.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError

# Interleaved timing: untimed launches at least, before kernels are timed in turn, so that every
# sample is taken with the GPU under sustained load (about 150 ms of 3-ms kernels; docs/results.md)
INTERLEAVED_WARM_LAUNCHES = 48
# How time_interleaved orders a round's launches ("shuffled": a seeded permutation per round). Records
# without it (before 2026-11-30's second profile) started each round one kernel later ("rotated").
INTERLEAVED_ROUND_ORDER = "shuffled"


@dataclass(frozen=True)
class Timing:
    """Samples of one measurement in milliseconds."""

    samples_ms: tuple[float, ...]
    timer: str  # "cuda_events" | "host_monotonic"

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "samples_ms": list(self.samples_ms), "timer": self.timer}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_counts(warmup: int, reps: int) -> None:
    if warmup < 0:
        raise InvalidArgumentError("warmup", "a non-negative int", warmup)
    if reps < 1:
        raise InvalidArgumentError("reps", "a positive int", reps)


def time_kernel(run: Callable[[int], object], n_sets: int, warmup: int, reps: int, device: torch.device,
                warmup_ms: float = 0.0) -> Timing:
    """Median latency of ``run(set_index)``; call ``i`` uses input set ``i % n_sets``. With
    ``warmup_ms`` the warm-up goes on, after the ``warmup`` calls, until the calls have kept the
    device busy that long, so the samples are taken under sustained load (a kernel timed right after
    an idle gap can run several percent faster than in a loop)."""
    check_counts(warmup, reps)
    if warmup_ms < 0:
        raise InvalidArgumentError("warmup_ms", "a non-negative number of milliseconds", warmup_ms)
    for i in range(warmup):
        run(i % n_sets)
    first = warmup + (warm_for(run, n_sets, warmup, warmup_ms, device) if warmup_ms > 0 else 0)
    if device.type != "cuda":
        samples = []
        for i in range(reps):
            start = time.perf_counter_ns()
            run((first + i) % n_sets)
            samples.append((time.perf_counter_ns() - start) / 1e6)
        return Timing(tuple(samples), "host_monotonic")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    synchronize(device)
    for i in range(reps):
        starts[i].record()
        run((first + i) % n_sets)
        ends[i].record()
    synchronize(device)
    return Timing(tuple(float(s.elapsed_time(e)) for s, e in zip(starts, ends)), "cuda_events")


def warm_for(run: Callable[[int], object], n_sets: int, start: int, warmup_ms: float, device: torch.device) -> int:
    """Call ``run`` (input sets rotating from ``start``) in growing batches until the batches have
    taken ``warmup_ms`` in all (device time on CUDA, host time elsewhere). Returns the calls made."""
    calls, batch, spent = 0, 1, 0.0

    def one_batch() -> None:
        for i in range(batch):
            run((start + calls + i) % n_sets)

    while spent < warmup_ms:
        spent += elapsed_ms(one_batch, device)
        calls += batch
        batch = min(2 * batch, 64)
    return calls


def elapsed_ms(block: Callable[[], object], device: torch.device) -> float:
    """Milliseconds ``block()`` takes: CUDA events around it on the current stream (waited for), or
    the host clock on other devices."""
    if device.type != "cuda":
        start = time.perf_counter_ns()
        block()
        return (time.perf_counter_ns() - start) / 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    block()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end))


def time_interleaved(runs: list[Callable[[int], object]], n_sets: int, warmup: int, reps: int,
                     device: torch.device, between: Callable[[], object] | None = None) -> list[Timing]:
    """Latencies of several kernels timed in turn: ``warmup`` untimed rounds of every ``runs[j](set)``
    back to back, then ``reps`` timed rounds, each in its own order (a permutation drawn from a
    generator seeded by the round: the same in every run). On CUDA every launch is queued without a
    host sync until the end, so the GPU stays busy from the first warm-up to the last sample and
    every kernel is timed in the same sustained state; timed one after another, a kernel that
    follows an idle gap can run faster than one under load (up to 12% on the H200, as a higher clock
    after idle would). Sample ``r`` of every kernel uses input set
    ``(warmup + r) % n_sets``. ``between()``, when given, is launched before every kernel (warm-up
    and timed) outside its timed span: other work, such as the projections that run between the
    attention calls of a model, so that each kernel is timed in that context.

    Rounds are shuffled: with a fixed rotation a kernel nearly always follows the same one, and what
    that one leaves behind (L2 contents, power draw) would bias every sample alike."""
    check_counts(warmup, reps)
    if not runs:
        return []
    for w in range(warmup):
        for run in runs:
            if between is not None:
                between()
            run(w % n_sets)
    n = len(runs)
    order = [(r, j) for r in range(reps) for j in random.Random(r).sample(range(n), n)]  # (round, kernel)
    if device.type != "cuda":
        host = [[0.0] * reps for _ in range(n)]
        for r, j in order:
            if between is not None:
                between()
            start = time.perf_counter_ns()
            runs[j]((warmup + r) % n_sets)
            host[j][r] = (time.perf_counter_ns() - start) / 1e6
        return [Timing(tuple(samples), "host_monotonic") for samples in host]
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in range(n)]
    for r, j in order:  # queued without a host sync: the device stays busy from launch to launch
        if between is not None:
            between()
        start, end = events[j][r]
        start.record()
        runs[j]((warmup + r) % n_sets)
        end.record()
    synchronize(device)
    return [Timing(tuple(float(s.elapsed_time(e)) for s, e in pairs), "cuda_events") for pairs in events]


def gemm_context(size: int, device: torch.device) -> Callable[[], object]:
    """A dense ``size x size x size`` GEMM (bf16 on CUDA, fp32 elsewhere) on preallocated operands,
    to launch between timed kernels (``time_interleaved(between=...)``): the projections that run
    between the attention calls of a model, which set the clock and the L2 contents a kernel meets."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgumentError("size", "a positive int (the GEMM's n)", repr(size))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device).to(dtype)
    b = torch.randn(size, size, generator=gen, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)  # [n, n]
    return lambda: torch.mm(a, b, out=out)


def time_request(request: Callable[[int], object], n_sets: int, warmup: int, reps: int, device: torch.device) -> Timing:
    """Median host latency of a complete request ``request(set_index)``, synchronized at both ends."""
    check_counts(warmup, reps)
    for i in range(warmup):
        request(i % n_sets)
    samples = []
    for i in range(reps):
        synchronize(device)
        start = time.perf_counter_ns()
        request((warmup + i) % n_sets)
        synchronize(device)
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return Timing(tuple(samples), "host_monotonic")
