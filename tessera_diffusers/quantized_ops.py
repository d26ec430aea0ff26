"""The native 8-bit path (``precision="int8"``): the quantization pass and the 8-bit Hopper kernels.

The arithmetic is ``quantized.py``'s (its twin is the CPU oracle of these kernels). A request runs
as: ``quantize`` (one pass over q, k and, for an 8-bit P V, v: int8 copies, scales per token
(Q), per 16-token chunk (K) and per channel (V), the means and the log-sum-exp shift), then the 8-bit kernel of the P V format
(``kernel_table.QUANTIZED_FAMILIES``; ``DEFAULT_PV`` for precision="int8") over a prepared plan of
the 16-bit catalog whose tile it has (``catalog.quantized_kernel``): the same metadata, tasks and
split-K merge. The quantized tensors are the kernels' own layouts
(``csrc/include/tessera/quantized/params.h``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import ops
from .catalog import quantized_kernel
from .errors import CatalogError, InvalidArgumentError, describe_tensor
from .kernel_table import DEFAULT_PV, QUANTIZED_FAMILIES, QUANTIZED_HEAD_DIM, quantized_rows
from .library import (
    DTYPE_CODES,
    QuantizedLibrary,
    TesseraQuantizedParams,
    TesseraQuantizeParams,
    current_stream_handle,
    quantized_library,
)
from .prepared import PreparedPlan

SEQ_ALIGN = 128  # TESSERA_QUANTIZED_ALIGN: k8, k_scale and v8 hold Skv rounded up to it (zeros past Skv)
CHUNK = 16  # tokens per v8 chunk
SEGMENT_TOKENS = 512  # tokens per partial of the channel statistics
MAX_GRID_Y = 65535


def chunk_token(j: int) -> int:
    """The token of a 16-token chunk that byte ``j`` of a v8 chunk row holds (TESSERA_V_CHUNK_TOKEN)."""
    return 8 * ((j & 3) >> 1) + 2 * (j >> 2) + (j & 1)


@dataclass(frozen=True)
class QuantizedTensors:
    """One request's q, k, v as the 8-bit kernels read them (layouts of quantized/params.h)."""

    q8: torch.Tensor  # [B, H, Sq, D] int8
    q_scale: torch.Tensor  # [B, H, Sq] fp32
    k8: torch.Tensor  # [B, H, Skv_pad, D] int8 of k - k_mean
    k_scale: torch.Tensor  # [B, H, Skv_pad] fp32
    v8: torch.Tensor | None  # [B, H, Skv_pad / 16, D, 16] uint8: int8 of v - v_mean plus 128, tokens in chunk
    # order (None for a 16-bit P V, as v_scale and v_mean)
    v_scale: torch.Tensor | None  # [B, H, D] fp32
    v_mean: torch.Tensor | None  # [B, H, D] fp32
    k_mean: torch.Tensor  # [B, H, D] fp32
    lse_shift: torch.Tensor  # [B, H, Sq] fp32
    seq_kv: int

    @property
    def seq_kv_padded(self) -> int:
        return self.k8.shape[2]

    def v_tokens(self) -> torch.Tensor:
        """v8 back in token order and as int8, ``[B, Skv, H, D]`` (the twin's layout; for tests)."""
        batch, heads, chunks, head_dim, _ = self.v8.shape
        order = torch.tensor([chunk_token(j) for j in range(CHUNK)], device=self.v8.device)
        natural = torch.empty(self.v8.shape, dtype=torch.int8, device=self.v8.device)
        natural[..., order] = (self.v8.to(torch.int16) - 128).to(torch.int8)
        return natural.permute(0, 2, 4, 1, 3).reshape(batch, chunks * CHUNK, heads, head_dim)[:, : self.seq_kv]


def check_pv(pv: str) -> None:
    """Refuse a P V format the 8-bit kernels do not have (``InvalidArgumentError`` naming ``pv``)."""
    if pv not in QUANTIZED_FAMILIES:
        raise InvalidArgumentError("pv", f"one of {tuple(QUANTIZED_FAMILIES)}", repr(pv))


def require_library() -> QuantizedLibrary:
    """The library's 8-bit part, or ``CatalogError`` naming how to build it."""
    lib = quantized_library()
    if lib is None:
        raise CatalogError("the native library has no 8-bit kernels (precision=\"int8\"): build it with an sm90 "
                           "target (TESSERA_CUDA_ARCHS=\"80;90\"), or use the 16-bit path")
    return lib


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse q, k, v ``[B, S, H, D]`` the 8-bit path cannot read: CUDA bf16 or fp16, D = 128, last dim contiguous."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in DTYPE_CODES or t.dim() != 4 or t.shape[-1] != QUANTIZED_HEAD_DIM or t.device.type != "cuda":
            raise InvalidArgumentError(name, f"a CUDA bf16 or fp16 tensor [B, S, H, {QUANTIZED_HEAD_DIM}] for the 8-bit "
                                       "kernels", describe_tensor(t))
        if t.stride(-1) != 1:
            raise InvalidArgumentError(name, "a contiguous last dim (stride 1)", f"strides {tuple(t.stride())}")


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pv: str = DEFAULT_PV) -> QuantizedTensors:
    """The quantization pass on the GPU: q ``[B, Sq, H, D]``, k, v ``[B, Skv, H, D]`` (bf16 or fp16,
    D = 128) -> ``QuantizedTensors`` for the kernels of P V format ``pv`` (V is quantized only for
    ``pv="int8"``; four launches on the current stream, no sync)."""
    check_pv(pv)
    check_inputs(q, k, v)
    lib = require_library().lib
    q, k, v = (ops.with_aligned_loads(t) for t in (q, k, v))  # rows read 16 bytes per lane from 16-byte starts
    batch, seq_q, heads, head_dim = q.shape
    seq_kv = k.shape[1]
    padded = -(-seq_kv // SEQ_ALIGN) * SEQ_ALIGN
    segments = max(1, min(-(-seq_kv // SEGMENT_TOKENS), MAX_GRID_Y))
    device = q.device
    f32 = {"dtype": torch.float32, "device": device}
    with_v = pv == "int8"
    x = QuantizedTensors(
        q8=torch.empty(batch, heads, seq_q, head_dim, dtype=torch.int8, device=device),
        q_scale=torch.empty(batch, heads, seq_q, **f32),
        k8=torch.empty(batch, heads, padded, head_dim, dtype=torch.int8, device=device),
        k_scale=torch.empty(batch, heads, padded, **f32),
        v8=torch.empty(batch, heads, padded // CHUNK, head_dim, CHUNK, dtype=torch.uint8, device=device) if with_v
        else None,
        v_scale=torch.empty(batch, heads, head_dim, **f32) if with_v else None,
        v_mean=torch.empty(batch, heads, head_dim, **f32) if with_v else None,
        k_mean=torch.empty(batch, heads, head_dim, **f32),
        lse_shift=torch.empty(batch, heads, seq_q, **f32),
        seq_kv=seq_kv,
    )
    partials = torch.empty(batch, heads, segments, 4, head_dim, **f32)
    p = TesseraQuantizeParams()
    p.q, p.k, p.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    for field, t in ((p.q_stride, q), (p.k_stride, k), (p.v_stride, v)):
        for i in range(3):
            field[i] = t.stride(i)
    p.batch, p.heads, p.seq_q, p.seq_kv, p.seq_kv_padded = batch, heads, seq_q, seq_kv, padded
    p.head_dim, p.dtype, p.segments, p.scale = head_dim, DTYPE_CODES[q.dtype], segments, scale
    p.q8, p.q_scale, p.k8, p.k_scale = x.q8.data_ptr(), x.q_scale.data_ptr(), x.k8.data_ptr(), x.k_scale.data_ptr()
    if with_v:
        p.v8, p.v_scale, p.v_mean = x.v8.data_ptr(), x.v_scale.data_ptr(), x.v_mean.data_ptr()
    p.k_mean, p.lse_shift, p.partials = x.k_mean.data_ptr(), x.lse_shift.data_ptr(), partials.data_ptr()
    with torch.cuda.device(device):
        lib.check(lib.handle.tessera_quantize(ctypes.byref(p), ctypes.c_void_p(current_stream_handle(device))),
                  "quantization")
    return x


def run_quantized(prepared: PreparedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  return_lse: bool, quantized: QuantizedTensors | None = None, pv: str = DEFAULT_PV
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """8-bit attention over ``prepared`` (a plan whose kernel has an 8-bit variant, ``catalog.quantized_kernel``):
    q ``[B, Sq, H, D]``, k, v ``[B, Skv, H, D]`` -> out ``[B, Sq, H, D]`` in q's dtype (and lse
    ``[B, H, Sq]`` fp32). ``quantized``: the pass's result for these q, k, v, if already made.
    ``pv``: the P V format (``kernel_table.QUANTIZED_FAMILIES``): "int8" reads the pass's v8,
    "bf16" (INT8 Q K^T only) reads v itself in its 16-bit type."""
    check_pv(pv)
    spec = prepared.plan.kernel
    row = quantized_kernel(spec, pv)
    if row is None:
        raise InvalidArgumentError("plan", "a plan of a Hopper kernel with an 8-bit variant (tiles "
                                   f"{sorted({(r.tile_q, r.tile_kv) for r in quantized_rows()})}, head_dim "
                                   f"{QUANTIZED_HEAD_DIM})", prepared.plan.name)
    qlib = require_library()
    kid = qlib.kernel_ids.get(row.name)
    if kid is None:
        hint = ("" if pv == DEFAULT_PV else
                f"; a build compiles the P V formats TESSERA_PV_FORMATS names (by default {DEFAULT_PV!r} only): "
                f"rebuild with TESSERA_PV_FORMATS={DEFAULT_PV},{pv} for this one")
        raise CatalogError(f"8-bit kernel {row.name} is not in the loaded library {qlib.lib.path}{hint}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise InvalidArgumentError("q, k, v", "tensors that do not require grad (the 8-bit kernels compute the "
                                   "forward pass only)", "requires_grad=True")
    check_inputs(q, k, v)
    prepared.check_call(q, k, v)
    config = ops.check_launch(q, k, v, spec, prepared.metadata, prepared.launch_config())
    x = quantized if quantized is not None else quantize(q, k, v, scale, pv)
    if pv == "int8" and x.v8 is None:
        raise InvalidArgumentError("quantized", "the pass's tensors with v8 (quantize(..., pv=\"int8\"))",
                                   "tensors without v8")
    v_read = x.v8 if pv == "int8" else ops.with_aligned_loads(v)  # a 16-bit V goes through TMA: 16-byte steps
    out, lse, workspace, _ = ops.output_buffers(q, config.num_splits, return_lse)
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    template = ops.unbound_template(spec.name, tuple(config), tuple(q.shape), k.shape[1],
                                    tuple(prepared.tile_counts.shape[:2]), (q.stride(), k.stride(), v_read.stride(),
                                                                            out.stride()),
                                    q.dtype, device_index, scale).bind(prepared.metadata)
    attn, merge = template.fill(x.q8, x.k8, v_read, out, lse, workspace)
    if config.persistent:  # static striding over a grid of the 8-bit kernel's resident CTAs
        ctas = max(1, qlib.lib.handle.tessera_quantized_kernel_ctas_per_sm(kid))
        attn.grid_size = ctas * torch.cuda.get_device_properties(device_index).multi_processor_count
    params = TesseraQuantizedParams()
    params.attn = attn
    params.q_scale, params.k_scale = x.q_scale.data_ptr(), x.k_scale.data_ptr()
    if x.v8 is not None:
        params.v_scale, params.v_mean = x.v_scale.data_ptr(), x.v_mean.data_ptr()
    params.lse_shift = x.lse_shift.data_ptr()
    params.seq_kv_padded = x.seq_kv_padded
    lib = qlib.lib
    with torch.cuda.device(q.device):
        stream = ctypes.c_void_p(current_stream_handle(q.device))
        lib.check(lib.handle.tessera_quantized_attention_forward(kid, ctypes.byref(params), stream), "8-bit attention")
        if merge is not None:
            lib.check(lib.handle.tessera_split_merge(ctypes.byref(merge), stream), "split-K merge")
    return (out, lse) if return_lse else out
