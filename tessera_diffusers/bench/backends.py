"""Baselines in one protocol: dense SDPA (cuDNN, FlashAttention-2), FlexAttention, the oracle.

A backend is used in three steps, and the split decides what each latency includes:

    prepared = backend.prepare(problem)            # mask-dependent preprocessing (BlockMask, plan())
    inputs   = backend.convert(q, k, v)            # layout change from the diffusers (B, S, H, D)
    out      = backend.run(prepared, inputs)       # the kernel(s): timed with CUDA events

Kernel latency times ``run`` alone on pre-converted, rotated inputs. Complete-request latency times
``request`` (by default all three steps) from the call to the synchronized end. ``to_bshd`` maps an
output back to ``[B, S, H, D]`` for the oracle check (untimed).

A backend that cannot run at all says why in ``unavailable()``; one that cannot run a problem says
why in ``unsupported(problem)`` or raises ``Skip`` from ``prepare``. Nothing is ever faked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .. import reference
from .problem import Problem
from .timing import time_kernel

Inputs = tuple[torch.Tensor, ...]


class Skip(Exception):
    """A backend cannot run this problem (the message says why); not an error of the harness."""


class Backend:
    """Base class; see the module docstring for the protocol."""

    name: str = "backend"
    kind: str = "sparse"  # "dense" (ignores the mask: timed once per shape), "sparse", "tessera", "quantized"
    # A "quantized" backend outside the 8-bit budget is invalid (not timed) unless this is False (peers).
    budget_gate: bool = True

    def unavailable(self) -> str | None:
        return None

    def unsupported(self, problem: Problem) -> str | None:
        return None

    def prepare(self, problem: Problem) -> Any:
        return None

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        return (q, k, v)

    def run(self, prepared: Any, inputs: Inputs) -> torch.Tensor:
        raise NotImplementedError

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        return out

    def request(self, problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One complete request from the caller's ``(B, S, H, D)`` tensors and the logical mask."""
        return self.run(self.prepare(problem), self.convert(q, k, v))

    def describe(self) -> dict:
        """Static facts for the report (settings, versions)."""
        return {}


def sm90_error(why: str) -> str | None:
    """Why a peer's sm90-only kernel cannot run here (``why``: what ties it to sm90), or None."""
    if not torch.cuda.is_available():
        return "needs CUDA (an sm90 Hopper GPU)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"{why}; this GPU is sm{major}{minor}"
    return None


def to_heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
    """``(B, S, H, D)`` -> ``(B, H, S, D)`` views (no copy), the layout SDPA and FlexAttention take."""
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


class OracleBackend(Backend):
    """``reference.attention``: the exact fp32 oracle (slow; the CPU smoke run's baseline)."""

    name = "reference"
    kind = "sparse"

    def prepare(self, problem: Problem) -> Any:
        return problem

    def run(self, prepared: Problem, inputs: Inputs) -> torch.Tensor:
        q, k, v = inputs
        return reference.attention(q, k, v, prepared.mask, prepared.scale)


class SdpaBackend(Backend):
    """Dense ``scaled_dot_product_attention`` pinned to one backend (the whole S x S matrix)."""

    kind = "dense"

    def __init__(self, name: str, backend_name: str):
        self.name = name
        self.backend_name = backend_name  # "CUDNN_ATTENTION" | "FLASH_ATTENTION"
        self._error: str | None = None
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self._backend = getattr(SDPBackend, backend_name)
            self._sdpa_kernel = sdpa_kernel
        except (ImportError, AttributeError) as err:
            self._error = f"torch {torch.__version__} has no SDPBackend.{backend_name}: {err}"

    def unavailable(self) -> str | None:
        if self._error:
            return self._error
        if not torch.cuda.is_available():
            return "needs CUDA"
        return None

    def unsupported(self, problem: Problem) -> str | None:
        if problem.device.type != "cuda":
            return "needs CUDA tensors"
        if problem.dtype not in (torch.bfloat16, torch.float16):
            return f"{self.backend_name} runs bf16/fp16 only"
        return None

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        return to_heads_first(q, k, v)

    def prepare(self, problem: Problem) -> Any:
        return problem.scale

    def run(self, prepared: float, inputs: Inputs) -> torch.Tensor:
        with self._sdpa_kernel([self._backend]):
            return torch.nn.functional.scaled_dot_product_attention(*inputs, scale=prepared)

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        return out.transpose(1, 2)

    def describe(self) -> dict:
        return {"sdpa_backend": self.backend_name}


def flex_tile(block: int, largest: int) -> int:
    """The largest power-of-two Triton tile <= ``largest`` that divides ``block`` (at least 16)."""
    tile = largest
    while tile > 16 and block % tile:
        tile //= 2
    return tile


def flex_kernel_options(block_q: int, block_kv: int) -> dict:
    """Forward kernel options matched to the logical geometry: ``BLOCK_M`` divides ``block_q``,
    ``BLOCK_N`` divides ``block_kv`` (FlexAttention requires both), as large as the H100 default
    (128 x 64 for D = 128) allows."""
    block_m = flex_tile(block_q, 128)
    block_n = flex_tile(block_kv, 64)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 8 if block_m >= 128 else 4, "num_stages": 3}


def flex_candidate_options(block_q: int, block_kv: int) -> list[dict]:
    """The forward kernel options ``flex-tuned`` times per geometry and shape: the matched tiles
    (``flex_kernel_options``) with 4 and 8 warps and 2 and 3 stages, and the larger ``BLOCK_N`` of
    128 where it divides ``block_kv`` (8 warps, 3 stages). The first is ``flex``'s own choice."""
    matched = flex_kernel_options(block_q, block_kv)
    out = [matched]
    for warps in (4, 8):
        for stages in (2, 3):
            option = {**matched, "num_warps": warps, "num_stages": stages}
            if option not in out:
                out.append(option)
    wide = flex_tile(block_kv, 128)
    if wide != matched["BLOCK_N"]:
        out.append({**matched, "BLOCK_N": wide, "num_warps": 8, "num_stages": 3})
    return out


def fastest_option(candidates: list[dict], time_ms: Callable[[dict], float]) -> tuple[dict, list[tuple[dict, float | str]]]:
    """The candidate with the lowest ``time_ms``, and every candidate's time (or why it failed:
    a Triton configuration that does not fit shared memory is an error of that candidate only)."""
    tried: list[tuple[dict, float | str]] = []
    for option in candidates:
        try:
            tried.append((option, float(time_ms(option))))
        except Exception as err:  # noqa: BLE001 - compile / resource errors rule out this candidate
            tried.append((option, f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"))
    timed = [(t, i) for i, (_, t) in enumerate(tried) if isinstance(t, float)]
    if not timed:
        raise Skip(f"no FlexAttention configuration ran: {tried[0][1]}")
    return tried[min(timed)[1]][0], tried


def kv_block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's ``kv_num_blocks [B, H, nQ]`` and ``kv_indices [B, H, nQ, nKV]`` (active
    columns first, ascending) of a bool block tensor ``[B, H, nQ, nKV]``."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


class FlexAttentionBackend(Backend):
    """``torch.nn.attention.flex_attention`` compiled with ``torch.compile``; the logical mask as a
    ``BlockMask.from_kv_blocks`` with ``BLOCK_SIZE = (B_Q, B_KV)``, every active block a *full*
    block (no ``mask_mod`` work inside it; the kernel still masks the partial last block), per-head
    masks, kernel ``BLOCK_M/BLOCK_N`` matched to the geometry."""

    name = "flex"
    kind = "sparse"

    def __init__(self, kernel_options: dict | None = None, recompile_limit: int = 256):
        self._error: str | None = None
        self._fixed_options = kernel_options
        self._recompile_limit = recompile_limit
        self._compiled: Any = None
        try:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention
        except ImportError as err:
            self._error = f"torch {torch.__version__} has no FlexAttention: {err}"
            return
        self._flex_attention = flex_attention
        self._block_mask_cls = BlockMask
        params = inspect.signature(BlockMask.from_kv_blocks).parameters
        # Forward-only: the transposed (q-block) lists are only needed for the backward pass.
        self._from_kv_extra = {"compute_q_blocks": False} if "compute_q_blocks" in params else {}
        self._has_seq_lengths = "seq_lengths" in params

    def compiled(self) -> Any:
        """The compiled ``flex_attention``, made on first use.

        One compiled callable serves every geometry and each (geometry, shape) is one more graph, so
        this raises dynamo's per-function recompile limit (never lowers it) and makes hitting it an
        error instead of a silent fall back to eager, which would materialize S x S scores. These are
        process-wide torch settings: the benchmark process owns them."""
        if self._compiled is None:
            dynamo_config = torch._dynamo.config
            limit = self._recompile_limit
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(dynamo_config, name):
                    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))
                    break
            if hasattr(dynamo_config, "accumulated_recompile_limit"):
                dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * limit)
            if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
                dynamo_config.fail_on_recompile_limit_hit = True
            self._compiled = torch.compile(self._flex_attention, dynamic=False)
        return self._compiled

    def unavailable(self) -> str | None:
        if self._error:
            return self._error
        if not torch.cuda.is_available():
            return "benchmarked on CUDA only (Triton kernels)"
        return None

    def unsupported(self, problem: Problem) -> str | None:
        if problem.device.type != "cuda":
            return "needs CUDA tensors"
        return None

    def kernel_options(self, problem: Problem, block_mask: Any = None) -> dict:
        if self._fixed_options is not None:
            return dict(self._fixed_options)
        return flex_kernel_options(problem.mask.block_q, problem.mask.block_kv)

    def block_mask(self, problem: Problem) -> Any:
        """The FlexAttention ``BlockMask`` of the problem's logical mask (the baseline's preprocessing)."""
        mask = problem.mask
        counts, indices = kv_block_lists(mask.blocks)
        kwargs = dict(self._from_kv_extra)
        if self._has_seq_lengths:
            kwargs["seq_lengths"] = (mask.seq_len_q, mask.seq_len_kv)
        return self._block_mask_cls.from_kv_blocks(
            torch.zeros_like(counts),
            torch.zeros_like(indices),
            counts,
            indices,
            BLOCK_SIZE=(mask.block_q, mask.block_kv),
            **kwargs,
        )

    def prepare(self, problem: Problem) -> Any:
        block_mask = self.block_mask(problem)
        return block_mask, self.kernel_options(problem, block_mask), problem.scale

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        return to_heads_first(q, k, v)

    def run(self, prepared: Any, inputs: Inputs) -> torch.Tensor:
        block_mask, options, scale = prepared
        return self.compiled()(*inputs, block_mask=block_mask, scale=scale, kernel_options=options)

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        return out.transpose(1, 2)

    def describe(self) -> dict:
        return {"kernel_options": "matched to the geometry" if self._fixed_options is None else self._fixed_options,
                "blocks_as": "full blocks (no mask_mod)", "compile": "torch.compile(dynamic=False)"}


class FlexAttentionTuned(FlexAttentionBackend):
    """``flex`` at the fastest forward configuration found per geometry and shape: at the first
    request of each, every ``flex_candidate_options`` entry is compiled and timed on random inputs of
    the problem's shape with its block mask (CUDA events, median of 5 after 2 warm-ups), once, like
    an autotuner (the first call's time, reported apart, includes it); later requests pay a lookup.
    ``describe`` lists what was tried and chosen."""

    name = "flex-tuned"

    def __init__(self, recompile_limit: int = 512):
        super().__init__(recompile_limit=recompile_limit)
        self.choices: dict[tuple, dict] = {}
        self.tried: dict[str, list] = {}

    def kernel_options(self, problem: Problem, block_mask: Any = None) -> dict:
        mask = problem.mask
        key = (mask.block_q, mask.block_kv, problem.batch, problem.heads, problem.seq_q, problem.seq_kv,
               problem.head_dim, problem.dtype)
        if key not in self.choices:
            block_mask = self.block_mask(problem) if block_mask is None else block_mask
            chosen, tried = fastest_option(flex_candidate_options(mask.block_q, mask.block_kv),
                                           lambda option: self.time_options(problem, block_mask, option))
            self.choices[key] = chosen
            self.tried[f"Q{mask.block_q}K{mask.block_kv} H{problem.heads} S{problem.seq_q}"] = [
                {**option, "ms": t} for option, t in tried]
        return dict(self.choices[key])

    def time_options(self, problem: Problem, block_mask: Any, options: dict) -> float:
        """Median milliseconds of the compiled kernel with ``options`` on random inputs of the problem."""
        gen = torch.Generator(device=problem.device).manual_seed(0)
        q, k, v = (torch.randn(problem.batch, problem.heads, n, problem.head_dim, generator=gen,
                               device=problem.device).to(problem.dtype)
                   for n in (problem.seq_q, problem.seq_kv, problem.seq_kv))

        def run(_: int) -> torch.Tensor:
            return self.compiled()(q, k, v, block_mask=block_mask, scale=problem.scale, kernel_options=options)

        return time_kernel(run, 1, 2, 5, problem.device).median_ms

    def describe(self) -> dict:
        return {"kernel_options": "fastest of flex_candidate_options per geometry and shape (timed once)",
                "tried": self.tried, "blocks_as": "full blocks (no mask_mod)", "compile": "torch.compile(dynamic=False)"}

