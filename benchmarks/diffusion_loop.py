"""The denoising loop at 720p token counts: dense cuDNN SDPA vs FlexAttention vs FlashInfer vs Tessera.

Real-architecture transformers with random weights (no download), bf16 on one GPU:

    Wan2.1-14B          40 heads x 128, 40 blocks, 21 x 45 x 80 = 75,600 video tokens
    HunyuanVideo-1.5    16 heads x 128, 54 blocks, 31 x 45 x 80 = 111,600 video + 1,985 text tokens

Only ``--layers`` blocks are built and only ``--steps`` steps (one guidance branch, or two with
``--cfg``) are run; the totals are also extrapolated linearly to the full model in a 50-step CFG loop
(``measured x full_layers / layers x 50 / steps x 2 / branches``) — stated in every report.

Every system runs the same processor (``TesseraProcessor``: token tiling, projections, RoPE, the
HunyuanVideo-1.5 text handling) and the same sparsifier (SSTA-style tile window + top-k, tuned to
``--density``); only the attention backend differs:

    dense       full attention, no mask (text padding dropped), diffusers' cuDNN SDPA backend
    flex        FlexAttention (torch.compile), BlockMask built from each new mask
    flashinfer  FlashInfer VariableBlockSparseAttentionWrapper, planned for each new mask
    tessera     Tessera's runtime, prepared plan per mask; a layer's new mask reuses the previous
                mask's plan-table regime (``Selector(reuse_regime=True)``)

Attention time = GPU time inside the backend calls (each system's own mask preprocessing and
planning included, whenever the mask changes); loop time = wall time of the whole loop (sparsifier,
permutations and the rest of the transformer included). Masks are computed live by the same
sparsifier in every system (identical at step 0; later steps follow each system's own trajectory,
so top-k picks may differ by bf16 noise; the density is the same).

    python benchmarks/diffusion_loop.py --out benchmarks/results/loop            # H200, ~5 min
    python benchmarks/diffusion_loop.py --out /tmp/loop --smoke                  # CPU, tiny models

Writes ``diffusion_loop.json``, ``diffusion_loop.md`` and ``diffusion_loop.png`` (with matplotlib)
under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import platform
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tessera_diffusers.processors import TesseraBackend, TesseraProcessor
from tessera_diffusers.runtime import Runtime
from tessera_diffusers.selector import Selector
from tessera_diffusers.processors.context import grid_from_latents, patch_size_of

from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.mask import LogicalMask
from tessera_diffusers.sparsifiers import LatentGrid, SSTASparsifier, tile_layout, top_k_for_block_density

FULL_STEPS = 50
FULL_BRANCHES = 2  # classifier-free guidance


# ============================================================================ models
@dataclass(frozen=True)
class ModelSpec:
    name: str
    label: str
    full_layers: int
    grid: LatentGrid
    heads: int
    head_dim: int


SPECS = {
    "wan": ModelSpec("wan", "Wan2.1-14B T2V 720p", 40, LatentGrid(21, 45, 80), 40, 128),
    "hv15": ModelSpec("hv15", "HunyuanVideo-1.5 720p", 54, LatentGrid(31, 45, 80), 16, 128),
}


def build_wan(layers: int, device: torch.device, dtype: torch.dtype, smoke: bool):
    """Wan2.1-14B blocks (or the tiny test model) and its forward inputs."""
    from diffusers import WanTransformer3DModel

    if smoke:
        from tessera_diffusers.processors.tiny import tiny_wan_transformer

        model = tiny_wan_transformer(num_layers=layers).to(device, dtype)
        latents = (1, 4, 3, 16, 16)
        text = torch.randn(1, 12, 16, device=device, dtype=dtype)
    else:
        with torch.device(device):
            model = WanTransformer3DModel(num_layers=layers)  # 14B configuration
        model = model.to(dtype).eval()
        latents = (1, 16, 21, 90, 160)  # 720p, 81 frames -> 21 x 45 x 80 tokens after (1, 2, 2) patches
        text = torch.randn(1, 512, 4096, device=device, dtype=dtype)
    return model, latents, {"encoder_hidden_states": text}


def build_hv15(layers: int, device: torch.device, dtype: torch.dtype, smoke: bool, qwen_valid: int):
    """HunyuanVideo-1.5 blocks (or the tiny test model) and its forward inputs (I2V-like: the image
    tokens are valid; ``qwen_valid`` of the 1,000 Qwen tokens and all 256 byT5 tokens valid)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    if smoke:
        from tessera_diffusers.processors.tiny import tiny_hunyuan_video15_transformer

        model = tiny_hunyuan_video15_transformer(num_layers=layers).to(device, dtype)
        latents, text_dims, lengths = (1, 4, 3, 8, 8), (16, 8, 12), (6, 4, 3)
        qwen_valid = min(qwen_valid, 4)
    else:
        with torch.device(device):
            model = HunyuanVideo15Transformer3DModel(num_layers=layers, target_size=720)
        model = model.to(dtype).eval()
        latents, text_dims, lengths = (1, 65, 31, 45, 80), (3584, 1472, 1152), (1000, 256, 729)
    inputs = {
        "encoder_hidden_states": torch.randn(1, lengths[0], text_dims[0], device=device, dtype=dtype),
        "encoder_attention_mask": (torch.arange(lengths[0], device=device) < qwen_valid).to(dtype)[None],
        "encoder_hidden_states_2": torch.randn(1, lengths[1], text_dims[1], device=device, dtype=dtype),
        "encoder_attention_mask_2": torch.ones(1, lengths[1], device=device, dtype=dtype),
        "image_embeds": torch.randn(1, lengths[2], text_dims[2], device=device, dtype=dtype),
    }
    return model, latents, inputs


# ============================================================================ timing
class Timer:
    """Sums the time of code spans: CUDA events on a GPU (read once at the end), wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.events: list = []
        self.cpu_s = 0.0
        self.count = 0

    @contextlib.contextmanager
    def span(self):
        self.count += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.cpu_s += time.perf_counter() - t0

    def total_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return float(sum(s.elapsed_time(e) for s, e in self.events))
        return self.cpu_s * 1e3


class TimedBackend:
    """Times every call of an attention backend (planning included)."""

    def __init__(self, inner, timer: Timer):
        self.inner, self.timer, self.name = inner, timer, inner.name

    def attention(self, q, k, v, mask, *, slot, cache, return_lse=False, part=None):
        with self.timer.span():
            return self.inner.attention(q, k, v, mask, slot=slot, cache=cache, return_lse=return_lse, part=part)


class TimedSparsifier:
    """Times mask computation."""

    def __init__(self, inner, timer: Timer):
        self.inner, self.timer = inner, timer

    def layout(self, grid):
        return self.inner.layout(grid)

    def __call__(self, q, k, *, layer, step, grid):
        with self.timer.span():
            return self.inner(q, k, layer=layer, step=step, grid=grid)


class AlwaysDense:
    """Full attention in raster order (no token permutation)."""

    def layout(self, grid):
        return tile_layout(grid, None)

    def __call__(self, q, k, *, layer, step, grid):
        return None


class TimedDenseProcessor(TesseraProcessor):
    """The processor with its dense attention timed (the dense system)."""

    def __init__(self, *args, timer: Timer, **kwargs):
        super().__init__(*args, **kwargs)
        self.timer = timer

    def dense_attention(self, q, k, v):
        with self.timer.span():
            return super().dense_attention(q, k, v)


# ============================================================================ other systems' backends
def reference_lse(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Natural-log lse ``[B, H, Sq]`` of full attention for ``q, k [B, S, H, D]`` (small sizes)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.logsumexp(scores, -1)


def lse_scale_of(run, device: torch.device, dtype: torch.dtype, head_dim: int) -> float:
    """1 if ``run(q, k, v) -> (out, lse)`` returns natural-log lse, ln 2 if it returns log2."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, head_dim, generator=gen).to(device, dtype) for _ in range(3))
    _, lse = run(q, k, v)
    want = reference_lse(q, k)
    for scale in (1.0, math.log(2.0)):
        if torch.allclose(lse.float() * scale, want, rtol=2e-2, atol=2e-2):
            return scale
    raise RuntimeError("could not identify the log base of the backend's lse")


def block_lists(mask: LogicalMask, batch: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention-style ``kv_num_blocks [B, H, nQ]`` and ``kv_indices [B, H, nQ, nKV]`` int32."""
    blocks = mask.blocks.expand(batch, heads, -1, -1)
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order.contiguous()


class FlexBackend:
    """FlexAttention with a ``BlockMask`` per Tessera mask: every active block is a *full* block, so
    the compiled kernel visits exactly the active blocks and evaluates no mask function. In eager
    mode (the CPU smoke run) FlexAttention ignores block sparsity, so a token-level mask_mod carries
    it there."""

    name = "flex"

    def __init__(self, compiled: bool):
        from torch.nn.attention import flex_attention as fa

        self.fa = fa
        self.compiled = compiled
        if compiled:
            # One compiled variant per call shape (HunyuanVideo-1.5 has four, plus calibration):
            # never let dynamo fall back to the eager path, which materializes S x S scores.
            for name in (
                "cache_size_limit",
                "recompile_limit",
                "accumulated_cache_size_limit",
                "accumulated_recompile_limit",
            ):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
            if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
                torch._dynamo.config.fail_on_recompile_limit_hit = True  # fail loudly rather than run eager
        self.fn = torch.compile(fa.flex_attention, dynamic=False) if compiled else fa.flex_attention
        self.has_aux = hasattr(fa, "AuxRequest")

    def block_mask(self, mask: LogicalMask, batch: int, heads: int):
        counts, order = block_lists(mask, batch, heads)
        mask_mod = None
        if not self.compiled:
            blocks = mask.blocks.expand(batch, heads, -1, -1)
            bq, bkv = mask.block_q, mask.block_kv

            def mask_mod(b, h, q_idx, kv_idx):
                return blocks[b, h, q_idx // bq, kv_idx // bkv]

        kwargs = {}
        if "compute_q_blocks" in inspect.signature(self.fa.BlockMask.from_kv_blocks).parameters:
            kwargs["compute_q_blocks"] = False  # forward only
        return self.fa.BlockMask.from_kv_blocks(
            torch.zeros_like(counts),
            order,
            counts,
            order,
            BLOCK_SIZE=(mask.block_q, mask.block_kv),
            mask_mod=mask_mod,
            seq_lengths=(mask.seq_len_q, mask.seq_len_kv),
            **kwargs,
        )

    def run(self, q, k, v, block_mask, kernel_options=None):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        with warnings.catch_warnings():
            if not self.compiled:  # the smoke run knowingly uses the unfused eager path
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return self.call(qh, kh, vh, block_mask, kernel_options)

    def call(self, qh, kh, vh, block_mask, kernel_options):
        if self.has_aux:
            out, aux = self.fn(
                qh,
                kh,
                vh,
                block_mask=block_mask,
                kernel_options=kernel_options,
                return_aux=self.fa.AuxRequest(lse=True),
            )
            lse = aux.lse
        else:
            out, lse = self.fn(qh, kh, vh, block_mask=block_mask, kernel_options=kernel_options, return_lse=True)
        return out.transpose(1, 2), lse.float()

    def attention(self, q, k, v, mask, *, slot, cache, return_lse=False, part=None):
        batch, _, heads, _ = q.shape

        def build():
            block_mask = self.block_mask(mask, batch, heads)
            return block_mask, 0

        block_mask = cache.plan(slot, (self.name, batch, heads, part), build)
        small = mask.block_q % 128 or mask.block_kv % 128
        options = {"BLOCK_M": 64, "BLOCK_N": 64} if small and self.compiled else None
        out, lse = self.run(q, k, v, block_mask, options)
        return (out, lse) if return_lse else out  # FlexAttention returns natural-log lse


class FlashInferBackend:
    """FlashInfer's ``VariableBlockSparseAttentionWrapper`` (per-head masks, exact partial blocks),
    one wrapper planned per mask; batch elements run one after another (masks must broadcast over
    the batch).

    FlashInfer sizes its plan buffers for LLM batches: before planning, the FA3 path's token-index
    buffers are grown to the mask's gathered key count, and a plan that reports a too-small int
    workspace is retried with a 4x larger one (a few times)."""

    name = "flashinfer"
    max_workspace_growth = 3

    def __init__(self, device: torch.device, backend: str = "auto", workspace_mb: int = 256):
        import flashinfer

        self.wrapper_class = getattr(flashinfer, "VariableBlockSparseAttentionWrapper", None) or getattr(
            flashinfer.sparse, "VariableBlockSparseAttentionWrapper"
        )
        self.backend = backend
        self.workspace = torch.empty(workspace_mb << 20, dtype=torch.uint8, device=device)
        self.lse_scale = 1.0

    def plan(self, mask: LogicalMask, heads: int, head_dim: int, dtype: torch.dtype):
        if mask.batch != 1:
            raise InvalidArgumentError("mask batch dim", "1 for the FlashInfer adapter", mask.batch)
        wrapper = self.wrapper_class(self.workspace, backend=self.backend)
        blocks = mask.blocks[0].expand(heads, -1, -1).contiguous()
        rows = mask.block_sizes_q().to(torch.int32).expand(heads, -1).contiguous()
        cols = mask.block_sizes_kv().to(torch.int32).expand(heads, -1).contiguous()
        gathered = int((blocks.to(torch.float64) @ cols[0].to(torch.float64)).sum())  # key tokens listed
        grow_buffer(wrapper, "_vector_sparse_indices_buffer", gathered + 1)
        grow_buffer(wrapper, "_vector_sparse_indptr_buffer", heads * rows.shape[1] + 2)
        for attempt in range(self.max_workspace_growth + 1):
            try:
                wrapper.plan(blocks, rows, cols, heads, heads, head_dim, q_data_type=dtype)
                return wrapper
            except RuntimeError as err:
                text = str(err).lower()
                if attempt == self.max_workspace_growth or ("workspace" not in text and "buffer" not in text):
                    raise
                current = wrapper._int_workspace_buffer
                bigger = torch.empty(4 * current.numel(), dtype=current.dtype, device=current.device)
                wrapper.reset_workspace_buffer(wrapper._float_workspace_buffer, bigger)
        return wrapper

    def run(self, wrapper, q, k, v):
        outs, lses = [], []
        for b in range(q.shape[0]):
            out, lse = wrapper.run(*(t[b].transpose(0, 1).contiguous() for t in (q, k, v)), return_lse=True)
            outs.append(out.transpose(0, 1))
            lses.append(lse)
        return torch.stack(outs), torch.stack(lses).float()

    def attention(self, q, k, v, mask, *, slot, cache, return_lse=False, part=None):
        heads, head_dim = q.shape[2], q.shape[3]
        wrapper = cache.plan(
            slot, (self.name, heads, head_dim, q.dtype, part), lambda: (self.plan(mask, heads, head_dim, q.dtype), 0)
        )
        out, lse = self.run(wrapper, q, k, v)
        return (out, lse * self.lse_scale) if return_lse else out  # lse in natural log, whatever FlashInfer's base

    def calibrate(self, device, dtype, head_dim):
        def run(q, k, v):
            mask = LogicalMask.dense(q.shape[1], k.shape[1], 128, 128, device=device)
            return self.run(self.plan(mask, q.shape[2], head_dim, dtype), q, k, v)

        self.lse_scale = lse_scale_of(run, device, dtype, head_dim)


def grow_buffer(owner, attribute: str, needed: int) -> None:
    """Replace ``owner.<attribute>`` (a FlashInfer index buffer) by a larger one if it is too small."""
    current = getattr(owner, attribute, None)
    if isinstance(current, torch.Tensor) and current.numel() < needed:
        setattr(owner, attribute, torch.empty(needed, dtype=current.dtype, device=current.device))


# ============================================================================ the loop
class Unavailable(Exception):
    """A system that cannot run on this machine (reported, not an error)."""


@dataclass
class SystemResult:
    system: str
    status: str = "ok"
    detail: str = ""
    attention_ms: float = float("nan")
    attention_calls: int = 0
    mask_ms: float = float("nan")
    loop_s: float = float("nan")
    mask_density: float = float("nan")
    cache: dict = field(default_factory=dict)
    final_latents: torch.Tensor | None = None


def sparsifier_for(spec: ModelSpec, grid: LatentGrid, density: float, window, native: bool, smoke: bool):
    """The SSTA-style sparsifier of the run: 6x8x8 tiles, ``window``, top-k tuned so that the block
    masks (what every backend computes) keep about ``density`` of the block pairs."""
    if smoke:
        return SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 1), top_k=4)
    if native and spec.name == "hv15":
        return SSTASparsifier()  # HunyuanVideo-1.5's own: 6x8x8 tiles, 3x3x3 window, top-k 64 (32 here)
    base = SSTASparsifier(tile=(6, 8, 8), window=window)
    top_k = top_k_for_block_density(base, grid, density)  # a structural property: a small CPU probe is enough
    return SSTASparsifier(tile=(6, 8, 8), window=window, top_k=top_k)


def denoise(model, latents0, inputs, steps: int, branches: tuple[str, ...], out_channels: int):
    """Euler steps of a flow-matching loop; HunyuanVideo-1.5 takes [latents | condition | mask]."""
    latents = latents0.clone()
    extra = None
    if model.config.in_channels != out_channels:  # HunyuanVideo-1.5: zero condition latents and mask
        shape = list(latents.shape)
        shape[1] = model.config.in_channels - out_channels
        extra = torch.zeros(shape, device=latents.device, dtype=latents.dtype)
    for step in range(steps):
        t = torch.full((latents.shape[0],), 1000.0 * (1.0 - step / steps), device=latents.device, dtype=latents.dtype)
        model_in = latents if extra is None else torch.cat([latents, extra], 1)
        preds = []
        for branch in branches:
            with model.cache_context(branch, step_index=step):
                preds.append(model(hidden_states=model_in, timestep=t, return_dict=False, **inputs)[0])
        velocity = preds[0] if len(preds) == 1 else preds[1] + 5.0 * (preds[0] - preds[1])
        latents = latents - velocity / steps
    return latents


def run_system(system: str, model, latents0, inputs, args, spec, device, dtype, sparsifier) -> SystemResult:
    result = SystemResult(system)
    attn_timer, mask_timer = Timer(device), Timer(device)
    head_dim = spec.head_dim if not args.smoke else (12 if spec.name == "wan" else 8)
    if system == "dense":
        processor = TimedDenseProcessor(AlwaysDense(), timer=attn_timer)
        if device.type == "cuda":
            processor._attention_backend = args.dense_backend
    else:
        if system == "tessera":
            # A loop's masks of one layer are alike from step to step: each new mask takes the
            # previous one's plan-table regime without a statistics read (no host sync per step).
            backend = TesseraBackend(Runtime(selector=Selector(reuse_regime=True)))
        elif system == "flex":
            backend = FlexBackend(compiled=device.type == "cuda")
        elif system == "flashinfer":
            if device.type != "cuda":
                raise Unavailable("FlashInfer needs a CUDA device")
            backend = FlashInferBackend(device, backend=args.flashinfer_backend)
            backend.calibrate(device, dtype, head_dim)
        else:
            raise InvalidArgumentError("--systems", "dense, flex, flashinfer or tessera", system)
        processor = TesseraProcessor(
            TimedSparsifier(sparsifier, mask_timer),
            backend=TimedBackend(backend, attn_timer),
            recompute_every=args.recompute_every,
        )
    processor.attach(model)
    branches = ("cond", "uncond") if args.cfg else ("cond",)
    out_channels = latents0.shape[1]
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            if system == "tessera" and device.type == "cuda":
                # Fail fast rather than time the reference oracle on a GPU.
                warnings.filterwarnings("error", message="tessera: no native plan")
            denoise(model, latents0, inputs, 1, branches, out_channels)  # warm-up: compile, JIT, caches
            processor.reset()
            model._reset_stateful_cache()
            attn_timer.reset()
            mask_timer.reset()
            sync(device)
            t0 = time.perf_counter()
            latents = denoise(model, latents0, inputs, args.steps, branches, out_channels)
            sync(device)
            result.loop_s = time.perf_counter() - t0
        result.attention_ms = attn_timer.total_ms()
        result.attention_calls = attn_timer.count
        result.mask_ms = mask_timer.total_ms() if system != "dense" else 0.0
        stats = processor.stats()
        result.mask_density = 1.0 if system == "dense" else stats["mean_mask_density"]
        result.cache = stats["cache"]
        result.final_latents = latents.float().cpu()
    finally:
        processor.detach(model)
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_dense_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The diffusers backend for the dense system: cuDNN SDPA when it runs here, else native SDPA."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q = torch.randn(1, 256, 2, 128, device=device, dtype=dtype)
    try:
        dispatch_attention_fn(q, q, q, backend=name)
        return name
    except Exception as err:  # noqa: BLE001 - any failure means "not usable here"
        print(f"[dense] backend {name} unusable ({type(err).__name__}: {err}); using native SDPA", flush=True)
        return "native"


def bench_model(spec: ModelSpec, args, device, dtype, deadline: float) -> dict:
    layers = args.layers
    if spec.name == "wan":
        model, latent_shape, inputs = build_wan(layers, device, dtype, args.smoke)
    else:
        model, latent_shape, inputs = build_hv15(layers, device, dtype, args.smoke, args.qwen_valid)
    grid = grid_from_latents(latent_shape, patch_size_of(model))
    sparsifier = sparsifier_for(spec, grid, args.density, tuple(args.window), args.native_ssta, args.smoke)
    gen = torch.Generator().manual_seed(0)
    out_channels = model.config.out_channels
    latents0 = torch.randn(latent_shape[0], out_channels, *latent_shape[2:], generator=gen).to(device, dtype)
    results = []
    for system in args.systems:
        if time.perf_counter() > deadline:
            results.append(SystemResult(system, "skipped", "time budget (--max-minutes) used up"))
            continue
        print(f"[{spec.name}] {system} ...", flush=True)
        try:
            result = run_system(system, model, latents0, inputs, args, spec, device, dtype, sparsifier)
        except Exception as err:  # noqa: BLE001 - a system that cannot run is reported, not fatal
            detail = f"{type(err).__name__}: {err}"
            print(f"[{spec.name}] {system} failed: {detail}", flush=True)
            if args.verbose:
                traceback.print_exc()
            status = "unavailable" if isinstance(err, (ImportError, Unavailable)) else "failed"
            result = SystemResult(system, status, detail[:500])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(result)
        if result.status == "ok":
            print(
                f"[{spec.name}] {system}: attention {result.attention_ms:.1f} ms, loop {result.loop_s:.2f} s, "
                f"density {result.mask_density:.3f}",
                flush=True,
            )
    del model
    return summarize(spec, grid, args, results, sparsifier)


def summarize(spec: ModelSpec, grid: LatentGrid, args, results: list[SystemResult], sparsifier) -> dict:
    branches = 2 if args.cfg else 1
    layers = args.layers
    full_layers = spec.full_layers if not args.smoke else layers
    factor = (full_layers / layers) * (FULL_STEPS / args.steps) * (FULL_BRANCHES / branches)
    by_name = {r.system: r for r in results}
    reference = by_name.get("tessera")
    rows = []
    for r in results:
        row = {
            "system": r.system,
            "status": r.status,
            "detail": r.detail,
            "attention_ms": r.attention_ms,
            "attention_calls": r.attention_calls,
            "mask_ms": r.mask_ms,
            "loop_s": r.loop_s,
            "mask_density": r.mask_density,
            "attention_full_s": r.attention_ms / 1e3 * factor,
            "loop_full_s": r.loop_s * factor,
            "cache": r.cache,
        }
        if reference is not None and reference.final_latents is not None and r.final_latents is not None:
            diff = (r.final_latents - reference.final_latents).norm() / reference.final_latents.norm().clamp_min(1e-12)
            row["final_latents_rel_diff_vs_tessera"] = float(diff)
        rows.append(row)
    ok = {r["system"]: r for r in rows if r["status"] == "ok"}
    summary = {}
    if "tessera" in ok:
        others = [ok[s]["attention_ms"] for s in ("flex", "flashinfer") if s in ok]
        if others:
            summary["tessera_attention_speedup_vs_best_sparse"] = min(others) / ok["tessera"]["attention_ms"]
        if "dense" in ok:
            summary["tessera_attention_speedup_vs_dense"] = ok["dense"]["attention_ms"] / ok["tessera"]["attention_ms"]
            summary["tessera_loop_speedup_vs_dense"] = ok["dense"]["loop_s"] / ok["tessera"]["loop_s"]
    return {
        "model": spec.name,
        "label": spec.label if not args.smoke else f"{spec.label} (smoke: tiny model)",
        "grid": str(grid),
        "video_tokens": grid.num_tokens,
        "layers_run": layers,
        "full_layers": full_layers,
        "steps_run": args.steps,
        "branches_run": branches,
        "extrapolation_factor": factor,
        "extrapolation": (
            f"measured x {full_layers}/{layers} layers x {FULL_STEPS}/{args.steps} steps x "
            f"{FULL_BRANCHES}/{branches} guidance branches (linear in layers, steps and branches)"
        ),
        "sparsifier": repr(sparsifier),
        "recompute_every": args.recompute_every,
        "systems": rows,
        "summary": summary,
    }


# ============================================================================ reports
def write_reports(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "diffusion_loop.json").write_text(json.dumps(report, indent=2, default=float))
    lines = [
        "# Diffusion loop: dense vs FlexAttention vs FlashInfer vs Tessera",
        "",
        f"Device: {report['device']}; torch {report['torch']}; dtype {report['dtype']}.",
        "Attention = GPU time inside the attention backend calls (mask preprocessing and planning included);",
        "loop = wall time of the whole denoising loop. Masks: the same sparsifier in every sparse system.",
        "",
    ]
    for model in report["models"]:
        lines += [
            f"## {model['label']}",
            "",
            f"Grid {model['grid']} = {model['video_tokens']:,} video tokens; {model['layers_run']} of "
            f"{model['full_layers']} layers, {model['steps_run']} steps, {model['branches_run']} branch(es); "
            f"sparsifier `{model['sparsifier']}`, mask recomputed every {model['recompute_every']} step(s).",
            f"Full-loop columns: {model['extrapolation']}.",
            "",
            "| system | status | mask density | attention (ms, measured) | loop (s, measured) "
            "| attention (s, full loop) | loop (s, full loop) | mask compute (ms) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in model["systems"]:
            if row["status"] != "ok":
                lines.append(f"| {row['system']} | {row['status']}: {row['detail'][:80]} | | | | | | |")
                continue
            lines.append(
                f"| {row['system']} | ok | {row['mask_density']:.3f} | {row['attention_ms']:.1f} | {row['loop_s']:.2f} "
                f"| {row['attention_full_s']:.1f} | {row['loop_full_s']:.1f} | {row['mask_ms']:.1f} |"
            )
        summary = model["summary"]
        lines.append("")
        if "tessera_attention_speedup_vs_best_sparse" in summary:
            lines.append(
                f"- Tessera attention vs the best of FlexAttention/FlashInfer: "
                f"**{summary['tessera_attention_speedup_vs_best_sparse']:.2f}x**"
            )
        if "tessera_attention_speedup_vs_dense" in summary:
            lines.append(f"- Tessera attention vs dense: **{summary['tessera_attention_speedup_vs_dense']:.2f}x**")
            lines.append(f"- Tessera loop vs dense: **{summary['tessera_loop_speedup_vs_dense']:.2f}x**")
        lines.append("")
    (out / "diffusion_loop.md").write_text("\n".join(lines))
    plot(out / "diffusion_loop.png", report)


def plot(path: Path, report: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    models = report["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        rows = [r for r in model["systems"] if r["status"] == "ok"]
        names = [r["system"] for r in rows]
        for row_index, (key, label) in enumerate([("attention_full_s", "attention (s)"), ("loop_full_s", "loop (s)")]):
            ax = axes[row_index][col]
            ax.bar(names, [r[key] for r in rows], color="tab:blue")
            ax.set_title(f"{model['model']}: {label}, full 50-step CFG loop (extrap.)", fontsize=9)
            ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ============================================================================ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON, markdown and plot")
    parser.add_argument("--models", default="wan,hv15", help="comma-separated: wan, hv15")
    parser.add_argument(
        "--systems",
        default="dense,tessera,flex,flashinfer",
        help="comma-separated, run in this order: dense, tessera, flex, flashinfer",
    )
    parser.add_argument("--steps", type=int, default=None, help="denoising steps run (default 50; smoke 2)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks built and run (default 2)")
    parser.add_argument("--cfg", action="store_true", help="run both guidance branches (default: one, extrapolated x2)")
    parser.add_argument("--density", type=float, default=0.10, help="target fraction of block pairs kept")
    parser.add_argument(
        "--window",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 3, 3],
        help="tile window t,h,w of the SSTA-style sparsifier (default 1,3,3)",
    )
    parser.add_argument(
        "--native-ssta",
        action="store_true",
        help="HunyuanVideo-1.5 with its own SSTA setting (3x3x3 window + top-k 32) instead of --density",
    )
    parser.add_argument("--recompute-every", type=int, default=1, help="steps between mask recomputations")
    parser.add_argument(
        "--qwen-valid", type=int, default=1000, help="valid Qwen text tokens of 1000 (HunyuanVideo-1.5)"
    )
    parser.add_argument(
        "--dense-backend", default="_native_cudnn", help="diffusers attention backend of the dense system"
    )
    parser.add_argument(
        "--flashinfer-backend", default="auto", choices=("auto", "fa2", "fa3"),
        help="backend of FlashInfer's VariableBlockSparseAttentionWrapper (auto: fa3 on Hopper)",
    )
    parser.add_argument("--max-minutes", type=float, default=7.0, help="skip systems not started by then")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (fp32): checks the harness")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [m for m in args.models if m not in SPECS]
    if unknown:
        parser.error(f"--models: expected wan and/or hv15, got {unknown}")
    args.steps = args.steps or (2 if args.smoke else FULL_STEPS)
    args.layers = args.layers or 2
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + 60.0 * args.max_minutes
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("diffusion_loop.py needs a CUDA device (use --smoke for the CPU check)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        args.dense_backend = check_dense_backend(args.dense_backend, device, dtype)
    torch.manual_seed(0)
    report = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or 'host'})",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "dtype": str(dtype),
        "dense_backend": args.dense_backend if device.type == "cuda" else "native",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "models": [],
    }
    for name in args.models:
        report["models"].append(bench_model(SPECS[name], args, device, dtype, deadline))
    report["wall_s"] = time.perf_counter() - start
    write_reports(args.out, report)
    print((args.out / "diffusion_loop.md").read_text(), flush=True)
    return report


if __name__ == "__main__":
    main()
