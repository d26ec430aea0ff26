"""Input checks of the public entry points; each failure names the argument, expected and received."""

from __future__ import annotations

import math

import torch

from .errors import InvalidArgumentError, MaskError, describe_tensor
from .mask import LogicalMask

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int above 0 (not a bool), else ``InvalidArgumentError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(name, "a positive int", repr(value))
    return value


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LogicalMask,
    scale: float | None,
    check_finite: bool = False,
) -> float:
    """Validate an attention call; returns the softmax scale to use.

    ``q [B, Sq, H, D]``, ``k, v [B, Skv, H, D]``; last dim contiguous; one dtype and device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(name, "a torch.Tensor [B, S, H, D]", describe_tensor(t))
        if t.dim() != 4:
            raise InvalidArgumentError(name, "rank 4 (B, S, H, D)", f"rank {t.dim()} shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise InvalidArgumentError(name, "dtype bfloat16 or float16 (float32 on the reference path)", t.dtype)
        if t.numel() == 0:
            raise InvalidArgumentError(name, "a non-empty tensor", f"shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise InvalidArgumentError(name, "a contiguous last (head_dim) dimension, stride 1", f"stride {t.stride()}")
    if not isinstance(mask, LogicalMask):
        raise MaskError("mask", "a tessera_diffusers.LogicalMask", type(mask).__name__)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise InvalidArgumentError("k/v", f"the dtype of q ({q.dtype})", f"k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device or mask.device != q.device:
        raise InvalidArgumentError(
            "k/v/mask", f"the device of q ({q.device})", f"k {k.device}, v {v.device}, mask {mask.device}"
        )
    batch, seq_q, heads, head_dim = q.shape
    if k.shape != v.shape:
        raise InvalidArgumentError("v", f"the shape of k {tuple(k.shape)}", tuple(v.shape))
    if k.shape[0] != batch or k.shape[2] != heads or k.shape[3] != head_dim:
        raise InvalidArgumentError(
            "k", f"(B, Skv, H, D) with B={batch}, H={heads}, D={head_dim} from q", tuple(k.shape)
        )
    if head_dim > MAX_HEAD_DIM or head_dim % 8 and q.is_cuda:
        raise InvalidArgumentError("q", f"head_dim <= {MAX_HEAD_DIM} (a multiple of 8 on CUDA)", head_dim)
    seq_kv = k.shape[1]
    if (mask.seq_len_q, mask.seq_len_kv) != (seq_q, seq_kv):
        raise MaskError(
            "mask",
            f"sequence lengths (Sq, Skv) = ({seq_q}, {seq_kv}) from q and k",
            f"({mask.seq_len_q}, {mask.seq_len_kv}) for geometry {mask.geometry_name}",
        )
    mask.check_broadcast(batch, heads)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise InvalidArgumentError("scale", "a finite positive float or None", repr(scale))
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise InvalidArgumentError(name, "finite values (check_finite=True)", "NaN or inf")
    return float(scale)
