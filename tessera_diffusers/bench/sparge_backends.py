"""SpargeAttn's quantized block-sparse kernel (thu-ml/SpargeAttn; sm90: INT8 Q K^T, FP8 e4m3 P V
with fp32 accumulation), isolated: nothing here runs unless ``spas_sage_attn`` imports. It is not on
PyPI; ``docs/development.md`` (Peers on the GPU machine) says how it is built there.

Written against SpargeAttn at ``SPARGE_COMMIT`` (``spas_sage_attn/core.py``,
``block_sparse_sage2_attn_cuda``: the entry point that takes a caller's block mask instead of
predicting one):

- ``block_sparse_sage2_attn_cuda(q, k, v, mask_id, scale=..., tensor_layout="NHD")``: bf16 q, k,
  ``[B, S, H, D]`` with D 64 or 128; ``mask_id [B, H, ceil(Sq/64), ceil(Skv/128)]`` bool on sm90
  (64-row query blocks, 128-column key blocks). Per call it quantizes Q per 64 rows and K (less its
  mean over the sequence) per 128 tokens to int8 (Triton), builds its block list from the mask
  (Triton), casts V to fp16, transposes and quantizes it per channel to e4m3, then runs the kernel,
  which also skips the P V product of a block whose scores lie more than ``pvthreshd`` (50, in the
  exponent) below the row's maximum.
- A query block without any key block is never written (the kernel returns early into
  ``torch.empty``), so such masks are refused.

``spargeattn`` times that complete call; ``spargeattn-kernel`` the kernel alone
(``qk_int8_sv_f8_accum_f32_block_sparse_attn_inst_buf_fuse_v_scale_with_pv_threshold_sm90``, what
the call runs on sm90) on inputs quantized and a block list built beforehand by the same functions.
Both are held up to the 8-bit budget (``quantized.MIN_COSINE`` / ``MAX_RELATIVE_L2``) and timed
whether or not they meet it: the record carries the agreement.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

import torch

from ..mask import LogicalMask
from .backends import Backend, Inputs, sm90_error
from .problem import Problem

SPARGE_COMMIT = "bfd980b"
SPARGE_MODULE = "spas_sage_attn"
SPARGE_NAME = "spargeattn"
SPARGE_KERNEL_NAME = "spargeattn-kernel"
SPARGE_NAMES = (SPARGE_NAME, SPARGE_KERNEL_NAME)
SPARGE_BLOCK_Q = 64  # sm90: CTA_Q
SPARGE_BLOCK_KV = 128  # sm90: CTA_K
SPARGE_HEAD_DIMS = (64, 128)
SPARGE_PV_THRESHOLD = 50.0  # the entry point's default
SPARGE_V_SCALE_MAX = 2.25  # the entry point's argument to its V quantization


def installed() -> tuple[str, ...]:
    """Both names when ``spas_sage_attn`` can be found on ``sys.path`` (found, not imported), else ()."""
    try:
        found = importlib.util.find_spec(SPARGE_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    return SPARGE_NAMES if found else ()


def sparge_block_map(mask: LogicalMask, batch: int, heads: int) -> torch.Tensor:
    """The mask over SpargeAttn's sm90 blocks, ``[B, H, ceil(Sq/64), ceil(Skv/128)]`` bool,
    contiguous: the same token set when ``block_q`` is a multiple of 64 and ``block_kv`` of 128."""
    if mask.block_q % SPARGE_BLOCK_Q or mask.block_kv % SPARGE_BLOCK_KV:
        raise ValueError(f"Q{mask.block_q}K{mask.block_kv} is not made of {SPARGE_BLOCK_Q}x{SPARGE_BLOCK_KV} blocks")
    blocks = mask.blocks.repeat_interleave(mask.block_q // SPARGE_BLOCK_Q, dim=-2)
    blocks = blocks.repeat_interleave(mask.block_kv // SPARGE_BLOCK_KV, dim=-1)
    blocks = blocks[..., : math.ceil(mask.seq_len_q / SPARGE_BLOCK_Q), : math.ceil(mask.seq_len_kv / SPARGE_BLOCK_KV)]
    return blocks.expand(batch, heads, -1, -1).contiguous()


def sparge_unsupported(problem: Problem, require_cuda: bool = True) -> str | None:
    """Why SpargeAttn's sm90 kernel cannot run ``problem`` exactly, or None (``require_cuda=False``:
    the geometry, dtype and mask alone, for CPU checks)."""
    mask = problem.mask
    if require_cuda and problem.device.type != "cuda":
        return "needs CUDA tensors"
    if problem.dtype != torch.bfloat16:
        return "this adapter runs SpargeAttn on bf16 inputs only"
    if problem.head_dim not in SPARGE_HEAD_DIMS:
        return f"SpargeAttn has head_dim {SPARGE_HEAD_DIMS[0]} and {SPARGE_HEAD_DIMS[1]} only, not {problem.head_dim}"
    if problem.seq_q < SPARGE_BLOCK_KV:
        return f"SpargeAttn needs at least {SPARGE_BLOCK_KV} query tokens, not {problem.seq_q}"
    if mask.block_q % SPARGE_BLOCK_Q or mask.block_kv % SPARGE_BLOCK_KV:
        return (f"SpargeAttn's sm90 kernel runs {SPARGE_BLOCK_Q}x{SPARGE_BLOCK_KV} blocks: Q{mask.block_q}K{mask.block_kv} "
                f"is not made of them (block_q must be a multiple of {SPARGE_BLOCK_Q}, block_kv of {SPARGE_BLOCK_KV})")
    empty = int((~mask.blocks.any(-1)).sum())
    if empty:
        return (f"{empty} query block(s) have no key block: SpargeAttn's kernel leaves such rows unwritten "
                "(its output is torch.empty), so they cannot be 0")
    return None


def import_sparge() -> tuple[dict[str, Any] | None, str | None]:
    """SpargeAttn's entry point and the functions it runs on sm90, or None and the reason."""
    try:
        core = importlib.import_module(f"{SPARGE_MODULE}.core")
        utils = importlib.import_module(f"{SPARGE_MODULE}.utils")
        qattn = importlib.import_module(f"{SPARGE_MODULE}._qattn")
        fused = importlib.import_module(f"{SPARGE_MODULE}._fused")
        parts = {
            "call": core.block_sparse_sage2_attn_cuda,
            "qk_quant": utils.get_vanilla_qk_quant,
            "lut": utils.block_map_lut_triton,
            "v_transpose": fused.transpose_pad_permute_cuda,
            "v_quant": fused.scale_fuse_quant_cuda,
            "kernel": qattn.qk_int8_sv_f8_accum_f32_block_sparse_attn_inst_buf_fuse_v_scale_with_pv_threshold_sm90,
        }
    except Exception as err:  # noqa: BLE001  (ImportError, or a broken extension raising anything)
        return None, f"{SPARGE_MODULE} (SpargeAttn) not importable: {type(err).__name__}: {err}"
    return parts, None


class SpargeBackend(Backend):
    """SpargeAttn on a caller's block mask: the complete call, or (``kernel_only``) its sm90 kernel."""

    kind = "quantized"
    budget_gate = False  # a peer: its agreement is recorded, and it is timed either way

    def __init__(self, kernel_only: bool = False) -> None:
        self.kernel_only = kernel_only
        self.name = SPARGE_KERNEL_NAME if kernel_only else SPARGE_NAME
        self._parts, self._error = import_sparge()
        if self._error is None:
            self._error = sm90_error("this adapter runs SpargeAttn's sm90 kernel")

    def unavailable(self) -> str | None:
        return self._error

    def unsupported(self, problem: Problem) -> str | None:
        return sparge_unsupported(problem)

    def prepare(self, problem: Problem) -> Any:
        block_map = sparge_block_map(problem.mask, problem.batch, problem.heads)
        if not self.kernel_only:
            return block_map, problem.scale
        lut, valid = self._parts["lut"](block_map)
        threshold = torch.full((problem.heads,), SPARGE_PV_THRESHOLD, device=block_map.device)
        return lut, valid, threshold, problem.scale

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        if not self.kernel_only:
            return (q, k, v)
        # What the entry point does before its kernel, on heads-first copies.
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        q_int8, q_scale, k_int8, k_scale = self._parts["qk_quant"](q, k, k.mean(dim=-2, keepdim=True),
                                                                   SPARGE_BLOCK_Q, SPARGE_BLOCK_KV)
        v = v.to(torch.float16)
        b, h, s_kv, d = v.shape
        padded = math.ceil(s_kv / SPARGE_BLOCK_KV) * SPARGE_BLOCK_KV
        v_t = torch.empty((b, h, d, padded), dtype=v.dtype, device=v.device)
        self._parts["v_transpose"](v, v_t, 1)
        v_fp8 = torch.empty(v_t.shape, dtype=torch.float8_e4m3fn, device=v.device)
        v_scale = torch.empty((b, h, d), dtype=torch.float32, device=v.device)
        self._parts["v_quant"](v_t, v_fp8, v_scale, s_kv, SPARGE_V_SCALE_MAX, 1)
        return q_int8, k_int8, v_fp8, q_scale, k_scale, v_scale

    def run(self, prepared: Any, inputs: Inputs) -> torch.Tensor:
        if not self.kernel_only:
            block_map, scale = prepared
            q, k, v = inputs
            return self._parts["call"](q, k, v, mask_id=block_map, scale=scale, tensor_layout="NHD",
                                       output_dtype=torch.bfloat16)
        lut, valid, threshold, scale = prepared
        q_int8, k_int8, v_fp8, q_scale, k_scale, v_scale = inputs
        out = torch.empty(q_int8.shape, dtype=torch.bfloat16, device=q_int8.device)
        self._parts["kernel"](q_int8, k_int8, v_fp8, out, lut, valid, threshold, q_scale, k_scale, v_scale,
                              1, 0, 1, scale, 0)
        return out

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        return out if not self.kernel_only else out.transpose(1, 2)

    def describe(self) -> dict:
        return {"spargeattn_commit": SPARGE_COMMIT, "sparge_blocks": f"{SPARGE_BLOCK_Q}x{SPARGE_BLOCK_KV} (sm90)",
                "sparge_formats": "int8 Q K^T (Q per 64 rows, K less its mean per 128 tokens), e4m3 P V per V channel",
                "sparge_pv_threshold": SPARGE_PV_THRESHOLD}


__all__ = ["SPARGE_NAMES", "SpargeBackend", "import_sparge", "installed", "sparge_block_map", "sparge_unsupported"]
