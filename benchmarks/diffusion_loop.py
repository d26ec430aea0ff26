"""Full-depth denoising steps at 720p with Tessera installed as users install it, beside dense
attention and the other block-sparse kernels, in one run.

Real-architecture transformers with random weights (no download), bf16 on one GPU, every layer:

    Wan2.1-14B          40 heads x 128, 40 blocks, 21 x 45 x 80 = 75,600 video tokens
    HunyuanVideo-1.5    16 heads x 128, 54 blocks, 31 x 45 x 80 = 111,600 video + 1,985 text tokens

Systems (``--systems``, run one after another on the same model and the same latents):

    dense               Wan2.1: the stock processors; HunyuanVideo-1.5: full attention through the
                        processor with the text padding dropped (the stock one builds an S x S mask:
                        ``stock``); both on diffusers' cuDNN SDPA backend
    stock               the stock processors as they are (HunyuanVideo-1.5: its dense S x S mask)
    one-liner           ``transformer.set_attn_processor(TesseraProcessor())``, the README's line
    one-liner-int8      the same with ``TesseraProcessor(precision="int8")`` (the 8-bit kernels)
    attach              ``TesseraProcessor().attach(transformer)``
    tessera:<sp>        ``TesseraProcessor(<sp>)`` with a named sparsifier (``SPARSIFIERS``)
    flex:<sp>           the same processor and masks, FlexAttention (compiled, its fastest tiles)
    flashinfer:<sp>     the same, FlashInfer's VariableBlockSparseAttentionWrapper
    vsa:<sp>            the same, FastVideo's VSA kernel (masks over multiples of 64 x 64 blocks)
    <system>+compile    any of them, then ``transformer.compile_repeated_blocks(fullgraph=True)``
                        (inductor; compiled in the untimed forward)

Each system runs one untimed forward (compilation, autotuning) and then ``--steps`` denoising steps
from ``--first-step`` under the pipelines' ``cache_context`` (one guidance branch; ``--cfg`` for
two), so with the default ``--first-step`` (the processor's dense warm-up length) every measured
step of a sparse system is sparse. Reported per system: wall time of each measured step (the
transformer forwards of that step, to completion), peak GPU memory over the measured steps,
attention time (GPU time inside the attention calls, mask preparation and planning included, for
the processor-based systems), mean mask density, the processor's plan-reuse counts, the relative
L2 difference of the first measured step's output from dense's, and that of the latents after the
last measured step from the one-liner's (``one-liner-int8`` against the same loop in bf16).
Nothing is extrapolated unless ``--extrapolate`` is given; then the report adds a column labelled
as such (measured steps and layers scaled to 50 steps, two branches, every layer).

    python benchmarks/diffusion_loop.py --out benchmarks/results/loop                 # H200
    python benchmarks/diffusion_loop.py --out /tmp/loop --models wan --systems one-liner \
        --first-step 0 --steps 50                                                     # a true 50-step loop
    python benchmarks/diffusion_loop.py --out /tmp/loop --smoke                       # CPU, tiny models

Writes ``diffusion_loop.json``, ``diffusion_loop.md`` and ``diffusion_loop.png`` (with matplotlib)
under ``--out``.
"""

from __future__ import annotations

import argparse
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

from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.mask import LogicalMask
from tessera_diffusers.plans import INPUT_PRECISION
from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.processors.compat import CACHE_CONTEXT_TAKES_STEP, DIFFUSERS_VERSION, cache_context
from tessera_diffusers.processors.context import grid_from_latents, patch_size_of
from tessera_diffusers.processors.processor import DEFAULT_WARMUP_STEPS, WAN_DENSITY
from tessera_diffusers.sparsifiers import LatentGrid, spade_64, ssta_384, ssta_tuned, tile_layout

FULL_STEPS = 50
FULL_BRANCHES = 2  # classifier-free guidance
SPARSIFIERS = {
    "spade_64": lambda: spade_64(WAN_DENSITY),
    "ssta_tuned": lambda: ssta_tuned(WAN_DENSITY),
    "ssta_384": ssta_384,
}


# ============================================================================ models
@dataclass(frozen=True)
class ModelSpec:
    name: str
    label: str
    full_layers: int
    heads: int
    head_dim: int


SPECS = {
    "wan": ModelSpec("wan", "Wan2.1-14B T2V 720p, 81 frames", 40, 40, 128),
    "hv15": ModelSpec("hv15", "HunyuanVideo-1.5 720p, 121 frames", 54, 16, 128),
}


def build_wan(layers: int | None, device: torch.device, dtype: torch.dtype, smoke: bool):
    """Wan2.1-14B (``layers`` blocks, all by default) or the tiny test model, and its forward inputs."""
    from diffusers import WanTransformer3DModel

    if smoke:
        from tessera_diffusers.processors.tiny import tiny_wan_transformer

        model = tiny_wan_transformer(num_layers=layers or 2).to(device, dtype)
        latents = (1, 4, 3, 16, 16)
        text = torch.randn(1, 12, 16, device=device, dtype=dtype)
    else:
        kwargs = {} if layers is None else {"num_layers": layers}
        model = construct(lambda: WanTransformer3DModel(**kwargs), device, dtype)  # the 14B configuration
        latents = (1, 16, 21, 90, 160)  # 720p, 81 frames -> 21 x 45 x 80 tokens after (1, 2, 2) patches
        text = torch.randn(1, 512, 4096, device=device, dtype=dtype)
    return model, latents, {"encoder_hidden_states": text}


def build_hv15(layers: int | None, device: torch.device, dtype: torch.dtype, smoke: bool, qwen_valid: int):
    """HunyuanVideo-1.5 (``layers`` blocks, all by default) or the tiny test model, and its forward
    inputs (I2V-like: the image tokens are valid; ``qwen_valid`` of the 1,000 Qwen tokens and all 256
    byT5 tokens valid)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    if smoke:
        from tessera_diffusers.processors.tiny import tiny_hunyuan_video15_transformer

        model = tiny_hunyuan_video15_transformer(num_layers=layers or 2).to(device, dtype)
        latents, text_dims, lengths = (1, 4, 3, 8, 8), (16, 8, 12), (6, 4, 3)
        qwen_valid = min(qwen_valid, 4)
    else:
        kwargs = {"target_size": 720} if layers is None else {"num_layers": layers, "target_size": 720}
        model = construct(lambda: HunyuanVideo15Transformer3DModel(**kwargs), device, dtype)
        latents, text_dims, lengths = (1, 65, 31, 45, 80), (3584, 1472, 1152), (1000, 256, 729)
    inputs = {
        "encoder_hidden_states": torch.randn(1, lengths[0], text_dims[0], device=device, dtype=dtype),
        "encoder_attention_mask": (torch.arange(lengths[0], device=device) < qwen_valid).to(dtype)[None],
        "encoder_hidden_states_2": torch.randn(1, lengths[1], text_dims[1], device=device, dtype=dtype),
        "encoder_attention_mask_2": torch.ones(1, lengths[1], device=device, dtype=dtype),
        "image_embeds": torch.randn(1, lengths[2], text_dims[2], device=device, dtype=dtype),
    }
    return model, latents, inputs


def construct(make, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A model built directly on ``device`` in ``dtype`` (random weights, no full-precision copy)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = make()
    finally:
        torch.set_default_dtype(previous)
    return model.to(device, dtype).eval()


# ============================================================================ other systems' backends
def reference_lse(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Natural-log lse ``[B, H, Sq]`` of full attention for ``q, k [B, S, H, D]`` (small sizes)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.logsumexp(scores, -1)


def lse_scale_of(run, device: torch.device, dtype: torch.dtype, head_dim: int) -> float:
    """The factor that turns the lse of ``run(q, k, v) -> (out, lse)`` into the natural log-sum-exp:
    1 (natural), ln 2 (log2), or -1/sqrt(D) (VSA's kernel returns -sqrt(D) times the natural lse)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, head_dim, generator=gen).to(device, dtype) for _ in range(3))
    _, lse = run(q, k, v)
    want = reference_lse(q, k)
    for scale in (1.0, math.log(2.0), -1.0 / math.sqrt(head_dim)):
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
        out, lse = self.run(q, k, v, block_mask, flex_options(mask) if self.compiled else None)
        return (out, lse) if return_lse else out  # FlexAttention returns natural-log lse


def flex_options(mask: LogicalMask) -> dict:
    """FlexAttention's kernel options for a geometry: tiles matched to the blocks (64 rows for blocks
    that are not multiples of 128), 4 warps for 64-row tiles and 8 for 128, 3 pipeline stages (its
    fastest configuration on these masks; the defaults run the 64-row families about 1.9x slower)."""
    rows = 64 if mask.block_q % 128 else 128
    cols = 64 if mask.block_kv % 128 else 128
    return {"BLOCK_M": rows, "BLOCK_N": cols, "num_warps": 4 if rows == 64 else 8, "num_stages": 3}


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

        self.wrapper_class = getattr(flashinfer, "VariableBlockSparseAttentionWrapper", None) or flashinfer.sparse.VariableBlockSparseAttentionWrapper
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


class VsaBackend:
    """FastVideo's VSA block-sparse kernel (ThunderKittens, sm_90a, 64 x 64 blocks): a mask over
    blocks that are multiples of 64 is split exactly into 64 x 64 blocks, whose index lists VSA's
    own ``map_to_index`` builds once per mask (kept in the step cache); q, k, v are folded to
    ``[1, B*H, S_pad, D]`` with the sequence zero-padded to whole blocks (the kernel masks the
    partial last KV block). VSA cannot express a query block without keys: such a mask is refused
    (one host read per mask checks it)."""

    name = "vsa"

    def __init__(self):
        from tessera_diffusers.bench.thunderkittens_backends import import_vsa

        self.ops, self.map_to_index, error = import_vsa()
        if error is not None:
            raise Unavailable(error)
        self.lse_scale = None  # set by ``calibrate`` at the first call that returns an lse

    def plan(self, mask: LogicalMask, batch: int, heads: int):
        from tessera_diffusers.bench.thunderkittens_backends import (
            empty_query_blocks,
            vsa_block_map_of,
            vsa_kv_block_sizes,
        )

        empty = empty_query_blocks(mask)
        if empty:
            raise InvalidArgumentError("mask", "every query block with a key block (VSA has no empty rows)",
                                       f"{empty} empty query-block rows")
        index, num = self.map_to_index(vsa_block_map_of(mask, batch, heads))
        return index, num, vsa_kv_block_sizes(mask.seq_len_kv, mask.blocks.device)

    def run(self, prepared, q, k, v):
        from tessera_diffusers.bench.thunderkittens_backends import vsa_fold, vsa_unfold

        batch, seq_q, heads, _ = q.shape
        out, lse = self.ops.block_sparse_fwd(*vsa_fold(q, k, v), *prepared)
        return vsa_unfold(out, batch, heads, seq_q), lse.reshape(batch, heads, -1)[..., :seq_q].float()

    def attention(self, q, k, v, mask, *, slot, cache, return_lse=False, part=None):
        prepared = cache.plan(slot, (self.name, q.shape[0], q.shape[2], part),
                              lambda: (self.plan(mask, q.shape[0], q.shape[2]), 0))
        out, lse = self.run(prepared, q, k, v)
        if not return_lse:
            return out
        if self.lse_scale is None:
            self.calibrate(q.device, q.dtype, q.shape[3])
        return out, lse * self.lse_scale

    def calibrate(self, device, dtype, head_dim):
        """The log base of VSA's lse, asked at the first call that needs one."""
        def run(q, k, v):
            mask = LogicalMask.dense(q.shape[1], k.shape[1], 64, 64, device=device)
            return self.run(self.plan(mask, q.shape[0], q.shape[2]), q, k, v)

        self.lse_scale = lse_scale_of(run, device, dtype, head_dim)


def grow_buffer(owner, attribute: str, needed: int) -> None:
    """Replace ``owner.<attribute>`` (a FlashInfer index buffer) by a larger one if it is too small."""
    current = getattr(owner, attribute, None)
    if isinstance(current, torch.Tensor) and current.numel() < needed:
        setattr(owner, attribute, torch.empty(needed, dtype=current.dtype, device=current.device))


# ============================================================================ the systems
class Unavailable(Exception):
    """A system that cannot run on this machine (reported, not an error)."""


class AlwaysDense:
    """Full attention in raster order (no token permutation)."""

    def layout(self, grid):
        return tile_layout(grid, None)

    def __call__(self, q, k, *, layer, step, grid):
        return None

    def __repr__(self) -> str:
        return "AlwaysDense()"


@dataclass
class SystemResult:
    system: str
    status: str = "ok"
    detail: str = ""
    step_s: list[float] = field(default_factory=list)
    peak_gib: float = float("nan")
    attention_ms: float = float("nan")
    attention_calls: int = 0
    mask_density: float = float("nan")
    sparsifier: str = ""
    stats: dict = field(default_factory=dict)
    first_output: torch.Tensor | None = None
    final_latents: torch.Tensor | None = None

    @property
    def steady_s(self) -> float:
        """Mean step time after the first measured step (which also pays first-call costs)."""
        rest = self.step_s[1:] or self.step_s
        return sum(rest) / len(rest) if rest else float("nan")


def install(system: str, model, args, device: torch.device):
    """Install ``system`` on ``model`` as a user would; returns (processor or None, uninstall). A
    ``+compile`` suffix then compiles the transformer as diffusers recommends,
    ``compile_repeated_blocks(fullgraph=True)`` (inductor, default mode), undone by the uninstall."""
    base, plus, suffix = system.partition("+")
    if plus:
        if suffix != "compile":
            raise InvalidArgumentError("--systems", "a system, optionally with the suffix +compile", system)
        processor, uninstall = install(base, model, args, device)
        torch._dynamo.reset()
        model.compile_repeated_blocks(fullgraph=True)

        def uncompile():
            for module in model.modules():
                module._compiled_call_impl = None
            torch._dynamo.reset()
            uninstall()

        return processor, uncompile
    originals = model.attn_processors
    kind, _, name = system.partition(":")

    def restore():
        model.set_attn_processor(originals)

    if kind == "stock" or (kind == "dense" and isinstance(model, wan_class())):
        if device.type == "cuda" and args.dense_backend != "native":
            model.set_attention_backend(args.dense_backend)
        return None, lambda: (restore(), model.reset_attention_backend() if device.type == "cuda" else None)
    if kind == "dense":
        processor = TesseraProcessor(AlwaysDense(), time_attention=True)
        processor._attention_backend = args.dense_backend if device.type == "cuda" else None
        model.set_attn_processor(processor)
        return processor, restore
    if kind in ("one-liner", "one-liner-int8"):
        precision = "int8" if kind == "one-liner-int8" else INPUT_PRECISION
        processor = TesseraProcessor(time_attention=True, precision=precision)
        model.set_attn_processor(processor)
        return processor, restore
    if kind == "attach":
        processor = TesseraProcessor(time_attention=True).attach(model)
        return processor, lambda: processor.detach(model)
    if name not in SPARSIFIERS:
        raise InvalidArgumentError("--systems", f"<system>:<sparsifier> with a sparsifier of {sorted(SPARSIFIERS)}", system)
    sparsifier = SPARSIFIERS[name]()
    if kind == "tessera":
        backend = None
    elif kind == "flex":
        backend = FlexBackend(compiled=device.type == "cuda")
    elif kind == "flashinfer":
        if device.type != "cuda":
            raise Unavailable("FlashInfer needs a CUDA device")
        backend = FlashInferBackend(device, backend=args.flashinfer_backend)
        backend.calibrate(device, torch.bfloat16, 128)
    elif kind == "vsa":
        if device.type != "cuda":
            raise Unavailable("VSA needs a CUDA device")
        backend = VsaBackend()
    else:
        raise InvalidArgumentError("--systems", "dense, stock, one-liner, one-liner-int8, attach or "
                                   "<tessera|flex|flashinfer|vsa>:<sparsifier>", system)
    processor = TesseraProcessor(sparsifier, backend=backend, time_attention=True)
    processor._attention_backend = args.dense_backend if device.type == "cuda" else None
    model.set_attn_processor(processor)
    return processor, restore


def wan_class():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


def denoise_step(model, latents, extra, inputs, step: int, steps_total: int, branches: tuple[str, ...]):
    """One Euler step of a flow-matching loop (HunyuanVideo-1.5 takes [latents | condition | mask])."""
    t = torch.full((latents.shape[0],), 1000.0 * (1.0 - step / steps_total), device=latents.device,
                   dtype=latents.dtype)
    model_in = latents if extra is None else torch.cat([latents, extra], 1)
    preds = []
    for branch in branches:
        with cache_context(model, branch, step, num_inference_steps=steps_total):
            preds.append(model(hidden_states=model_in, timestep=t, return_dict=False, **inputs)[0])
    velocity = preds[0] if len(preds) == 1 else preds[1] + 5.0 * (preds[0] - preds[1])
    return latents - velocity / steps_total, preds[0]


def run_system(system: str, model, latents0, extra, inputs, args, device) -> SystemResult:
    result = SystemResult(system)
    branches = ("cond", "uncond") if args.cfg else ("cond",)
    steps_total = max(FULL_STEPS, args.first_step + args.steps)
    processor, uninstall = install(system, model, args, device)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            if processor is not None and device.type == "cuda":
                # Fail fast rather than time the reference oracle on a GPU.
                warnings.filterwarnings("error", message="tessera: no native plan")
            if args.warmup:
                denoise_step(model, latents0, extra, inputs, max(args.first_step - 1, 0), steps_total, branches)
            if processor is not None:
                processor.reset()
            model._reset_stateful_cache()  # a new run, as a pipeline starts it
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            latents = latents0
            for i in range(args.steps):
                start = time.perf_counter()
                latents, output = denoise_step(model, latents, extra, inputs, args.first_step + i, steps_total, branches)
                sync(device)
                result.step_s.append(time.perf_counter() - start)
                if i == 0:
                    result.first_output = output.float().cpu()
                if args.progress:
                    print(f"    step {args.first_step + i}: {result.step_s[-1]:.2f} s", flush=True)
            result.final_latents = latents.float().cpu()
            if device.type == "cuda":
                result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
        if processor is not None:
            stats = processor.stats()
            result.stats = {key: value for key, value in stats.items() if key != "calls"}
            result.attention_ms = stats["attention_ms"]
            result.attention_calls = stats["attention_calls"]
            result.mask_density = stats["mean_mask_density"]
            result.sparsifier = ", ".join(f"{k}: {v}" for k, v in stats["sparsifiers"].items())
    finally:
        uninstall()
        model._reset_stateful_cache()
    return result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_dense_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The diffusers backend for dense attention: cuDNN SDPA when it runs here, else native SDPA."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q = torch.randn(1, 256, 2, 128, device=device, dtype=dtype)
    try:
        dispatch_attention_fn(q, q, q, backend=name)
        return name
    except Exception as err:  # noqa: BLE001 - any failure means "not usable here"
        print(f"[dense] backend {name} unusable ({type(err).__name__}: {err}); using native SDPA", flush=True)
        return "native"


def bench_model(spec: ModelSpec, args, device, dtype, deadline: float) -> dict:
    start = time.perf_counter()
    if spec.name == "wan":
        model, latent_shape, inputs = build_wan(args.layers, device, dtype, args.smoke)
    else:
        model, latent_shape, inputs = build_hv15(args.layers, device, dtype, args.smoke, args.qwen_valid)
    build_s = time.perf_counter() - start
    layers = len(getattr(model, "blocks", None) or model.transformer_blocks)
    grid = grid_from_latents(latent_shape, patch_size_of(model))
    print(f"[{spec.name}] {layers} layers, grid {grid}, built in {build_s:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    out_channels = model.config.out_channels
    latents0 = torch.randn(latent_shape[0], out_channels, *latent_shape[2:], generator=gen).to(device, dtype)
    extra = None
    if model.config.in_channels != out_channels:  # HunyuanVideo-1.5: zero condition latents and mask
        shape = list(latents0.shape)
        shape[1] = model.config.in_channels - out_channels
        extra = torch.zeros(shape, device=device, dtype=dtype)
    results = []
    for system in args.systems:
        if time.perf_counter() > deadline:
            results.append(SystemResult(system, "skipped", "time budget (--max-minutes) used up"))
            continue
        print(f"[{spec.name}] {system} ...", flush=True)
        try:
            result = run_system(system, model, latents0, extra, inputs, args, device)
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
                f"[{spec.name}] {system}: steps {' '.join(f'{s:.2f}' for s in result.step_s)} s, "
                f"peak {result.peak_gib:.1f} GiB, attention {result.attention_ms:.0f} ms, "
                f"density {result.mask_density:.3f}",
                flush=True,
            )
    del model
    return summarize(spec, grid, layers, args, results)


def summarize(spec: ModelSpec, grid: LatentGrid, layers: int, args, results: list[SystemResult]) -> dict:
    branches = 2 if args.cfg else 1
    full_layers = spec.full_layers if not args.smoke else layers
    by_name = {r.system: r for r in results}
    dense = by_name.get("dense")
    one_liner = by_name.get("one-liner")
    rows = []
    for r in results:
        row = {
            "system": r.system,
            "status": r.status,
            "detail": r.detail,
            "sparsifier": r.sparsifier,
            "step_s": r.step_s,
            "first_step_s": r.step_s[0] if r.step_s else float("nan"),
            "steady_step_s": r.steady_s,
            "total_s": sum(r.step_s) if r.step_s else float("nan"),
            "peak_gib": r.peak_gib,
            "attention_ms": r.attention_ms,
            "attention_calls": r.attention_calls,
            "mask_density": 1.0 if r.system in ("dense", "stock") else r.mask_density,
            "stats": r.stats,
        }
        if dense is not None and dense.status == "ok" and r.status == "ok":
            row["steady_vs_dense"] = r.steady_s / dense.steady_s
            row["peak_vs_dense"] = r.peak_gib / dense.peak_gib if dense.peak_gib == dense.peak_gib else float("nan")
            if dense.first_output is not None and r.first_output is not None:
                diff = (r.first_output - dense.first_output).norm() / dense.first_output.norm().clamp_min(1e-12)
                row["output_rel_diff_vs_dense"] = float(diff)
        if one_liner is not None and one_liner.final_latents is not None and r.final_latents is not None:
            want = one_liner.final_latents
            row["final_latents_rel_diff_vs_one_liner"] = float((r.final_latents - want).norm() / want.norm().clamp_min(1e-12))
        if args.extrapolate:
            row["extrapolated_50_step_cfg_s"] = (
                r.steady_s * (full_layers / layers) * (FULL_BRANCHES / branches) * FULL_STEPS
            )
        rows.append(row)
    return {
        "model": spec.name,
        "label": spec.label if not args.smoke else f"{spec.label} (smoke: tiny model)",
        "grid": str(grid),
        "video_tokens": grid.num_tokens,
        "layers_run": layers,
        "full_layers": full_layers,
        "first_step": args.first_step,
        "steps_run": args.steps,
        "branches_run": branches,
        "extrapolated": bool(args.extrapolate),
        "systems": rows,
    }


# ============================================================================ reports
def write_reports(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "diffusion_loop.json").write_text(json.dumps(report, indent=2, default=float))
    lines = [
        "# Denoising steps at full depth: Tessera as installed by users, dense and other kernels",
        "",
        (f"Device: {report['device']}; torch {report['torch']}; dtype {report['dtype']}; dense backend "
         f"`{report['dense_backend']}`."),
        "Step = wall time of one denoising step's transformer forwards, to completion. Attention = GPU time",
        "inside the attention calls (mask preparation and planning included). Steady = mean over the",
        "measured steps after the first (which pays first-call selection and compilation).",
        "",
    ]
    for model in report["models"]:
        lines += [
            f"## {model['label']}",
            "",
            f"Grid {model['grid']} = {model['video_tokens']:,} video tokens; {model['layers_run']} of "
            f"{model['full_layers']} layers; steps {model['first_step']}..{model['first_step'] + model['steps_run'] - 1}"
            f" measured, {model['branches_run']} guidance branch(es)."
            + (" The last column is extrapolated (50 steps, 2 branches, every layer), not measured." if model["extrapolated"] else ""),
            "",
            "| system | status | mask density | first step (s) | steady step (s) | steady vs dense | total (s) "
            "| peak (GiB) | peak vs dense | attention (ms) | plans: selections reused | out diff vs dense "
            "| final latents diff vs one-liner |" + (" extrapolated 50-step CFG (s) |" if model["extrapolated"] else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if model["extrapolated"] else ""),
        ]
        for row in model["systems"]:
            if row["status"] != "ok":
                lines.append(f"| {row['system']} | {row['status']}: {row['detail'][:90]} |" + " |" * (11 + model["extrapolated"]))
                continue
            plans = row["stats"].get("plans", {})
            reuse = (f"{plans.get('selections_reused', 0)}/{plans.get('plans_prepared', 0)} "
                     f"({plans.get('keys_reusing_every_later_plan', 0)}/{plans.get('keys_with_several_plans', 0)} layers)"
                     if plans else "")
            cells = [
                row["system"], "ok", f"{row['mask_density']:.3f}", f"{row['first_step_s']:.2f}",
                f"{row['steady_step_s']:.2f}", f"{row.get('steady_vs_dense', float('nan')):.3f}", f"{row['total_s']:.1f}",
                f"{row['peak_gib']:.1f}", f"{row.get('peak_vs_dense', float('nan')):.3f}", f"{row['attention_ms']:.0f}",
                reuse, f"{row.get('output_rel_diff_vs_dense', float('nan')):.3f}",
                f"{row.get('final_latents_rel_diff_vs_one_liner', float('nan')):.4f}",
            ]
            if model["extrapolated"]:
                cells.append(f"{row['extrapolated_50_step_cfg_s']:.0f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        sparsifiers = {row["system"]: row["sparsifier"] for row in model["systems"] if row.get("sparsifier")}
        lines += [f"- `{name}`: {value}" for name, value in sparsifiers.items()]
        lines.append("")
    (out / "diffusion_loop.md").write_text("\n".join(lines))
    plot(out / "diffusion_loop.png", report)


def plot(path: Path, report: dict) -> None:
    """Steady step time per system (top) and every measured step's time (bottom), per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    models = report["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        rows = [r for r in model["systems"] if r["status"] == "ok"]
        ax = axes[0][col]
        ax.bar([r["system"] for r in rows], [r["steady_step_s"] for r in rows], color="tab:blue")
        ax.set_ylabel("steady step (s, measured)")
        ax.set_title(f"{model['model']}: {model['layers_run']} layers, grid {model['grid']}", fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
        ax = axes[1][col]
        for r in rows:
            steps = range(model["first_step"], model["first_step"] + len(r["step_s"]))
            ax.plot(list(steps), r["step_s"], marker=".", label=r["system"])
        ax.set_xlabel("denoising step")
        ax.set_ylabel("step time (s)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
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
        default="dense,one-liner,attach",
        help="comma-separated, run in this order: dense, stock, one-liner, one-liner-int8, attach, tessera:<sp>, "
        f"flex:<sp>, flashinfer:<sp>, vsa:<sp> with <sp> one of {', '.join(SPARSIFIERS)}; a suffix +compile compiles the "
        "transformer's blocks (compile_repeated_blocks(fullgraph=True)) after installing the system",
    )
    parser.add_argument("--steps", type=int, default=None, help="denoising steps measured (default 3; smoke 2)")
    parser.add_argument(
        "--first-step", type=int, default=None,
        help=f"step index of the first measured step (default {DEFAULT_WARMUP_STEPS}: the default warm-up's end)",
    )
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="no untimed forward first")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks built (default: all)")
    parser.add_argument("--cfg", action="store_true", help="run both guidance branches (default: one)")
    parser.add_argument("--extrapolate", action="store_true",
                        help="add a column scaling the measured steps to a full 50-step CFG loop (labelled)")
    parser.add_argument(
        "--qwen-valid", type=int, default=1000, help="valid Qwen text tokens of 1000 (HunyuanVideo-1.5)"
    )
    parser.add_argument("--dense-backend", default="_native_cudnn", help="diffusers attention backend for dense attention")
    parser.add_argument(
        "--flashinfer-backend", default="auto", choices=("auto", "fa2", "fa3"),
        help="backend of FlashInfer's VariableBlockSparseAttentionWrapper (auto: fa3 on Hopper)",
    )
    parser.add_argument("--max-minutes", type=float, default=9.0, help="skip systems not started by then")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (fp32): checks the harness")
    parser.add_argument("--progress", action="store_true", help="print every step's time")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [m for m in args.models if m not in SPECS]
    if unknown:
        parser.error(f"--models: expected wan and/or hv15, got {unknown}")
    args.steps = args.steps or (2 if args.smoke else 3)
    if args.first_step is None:
        args.first_step = 0 if args.smoke else DEFAULT_WARMUP_STEPS
    if args.first_step > 0 and not CACHE_CONTEXT_TAKES_STEP:
        parser.error(f"--first-step {args.first_step}: diffusers {DIFFUSERS_VERSION}'s cache_context takes no step_index "
                     "(0.41.0 does), so the processor would count this run's steps from 0; use --first-step 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + 60.0 * args.max_minutes
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.dense_backend = "native"
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
        "dense_backend": args.dense_backend,
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
