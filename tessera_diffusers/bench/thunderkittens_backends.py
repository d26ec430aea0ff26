"""Two ThunderKittens (Hopper, sm_90a) block-sparse peers, isolated: nothing here runs unless the
peer's module imports. Neither is on PyPI for this torch; ``docs/development.md`` (Peers on the GPU
machine) says how they are built there into a directory put on ``PYTHONPATH``.

``vsa`` -- FastVideo's Video Sparse Attention kernel, ``fastvideo-kernel`` 0.3.5
(``csrc/attention/block_sparse_h100.cu``, bound as ``fastvideo_kernel._C.fastvideo_kernel_ops
.block_sparse_fwd``; ``fastvideo_kernel.block_sparse_attn`` dispatches to it on sm90):

- ``block_sparse_fwd(q, k, v, q2k_index, q2k_num, kv_block_sizes) -> (o, lse)``: q, k, v
  ``[1, H, S_pad, D]`` bf16 contiguous, batch 1 only, D 64 or 128 (the softmax scale is fixed at
  ``1/sqrt(D)``), ``S_pad`` a multiple of 64; 64 x 64 blocks (one 4x4x4 "cube" of tokens each);
  ``q2k_index [1, H, nQ, L]`` int32 the active KV blocks of every query block (ascending,
  ``map_to_index`` pads with -1), ``q2k_num [1, H, nQ]`` int32 their count, ``kv_block_sizes [nKV]``
  int32 the real tokens of each KV block: the kernel sets the scores of the columns past it to -inf,
  so a partial last block is exact once the sequence is zero-padded to whole blocks.
- Here: the batch is folded into the heads (``[1, B*H, S_pad, D]``: heads are independent); a mask
  over blocks that are multiples of 64 is split into its 64 x 64 blocks (the same token set); the
  preprocessing is VSA's own ``triton_kernels.index.map_to_index`` (what ``block_sparse_attn`` runs
  on a bool block map). A query block without any key block cannot be expressed: the kernel always
  processes the row's last listed entry (``q2k_index[num - 1]``, out of the row when ``num`` is 0), so
  such masks are refused.

``flex-block-attn`` -- HunyuanVideo-1.5's kernel (github.com/Tencent-Hunyuan/flex-block-attn at
``FBA_COMMIT``; no release):

- ``flex_block_attn._flex_block_attn_forward(q, k, v, q_block, kv_block, block_mask,
  small_block_mask, use_small_block_mode) -> (o, lse)`` (what ``flex_block_attn_func`` runs after
  its mask reduction): q, k, v ``[B, H, S, 128]`` bf16 contiguous (head_dim 128 only, scale
  ``1/sqrt(128)``), per-head bool masks ``[B, H, nQ, nKV]`` (or one ``[nQ, nKV]``), ``kv_block`` a
  multiple of 64, ``q_block`` a multiple of 16, one dividing the other, every sequence a multiple of
  its blocks (no masking inside a block: a partial last block cannot be expressed). The kernel
  walks ``block_mask`` in square ``kv_block x kv_block`` rows; with ``q_block < kv_block`` the
  wrapper ORs the query blocks of each such row into ``block_mask`` and passes the exact mask as
  ``small_block_mask`` (per-warp masking of 16-row slices). For ``q_block > kv_block`` the
  wrapper's reduction (over KV blocks) does not match the kernel's indexing (its own test
  leaves that case commented out); here the exact mask is repeated over the ``q_block / kv_block``
  square rows of each query block instead (same token set, no small-block mode).
- ``attn_forward`` synchronizes the device before and after its launch (``cudaDeviceSynchronize``):
  its kernel latency includes one host round trip. Rows of a query block without any key block
  come out NaN (0/0) without the small-block mode and 0 with it.

VSA's own masks: ``vsa_topk_blocks`` / ``vsa_topk_mask`` make the mask VSA selects from q and k
(mean-pooled 64-token cubes, ``q_c . k_c`` scores, top-k key cubes per query cube);
``write_vsa_topk_corpus(DIR)`` saves such masks on the corpus's synthetic q/k in VSA's cube token
order as the case family ``Q64K64-VSA`` for ``tessera bench --corpus DIR``.
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

VSA_BLOCK = 64
VSA_HEAD_DIMS = (64, 128)
VSA_PACKAGE = "fastvideo-kernel"
FBA_COMMIT = "f5bfc9ce10979734e4d0a22b77295f094c041b41"
FBA_HEAD_DIM = 128
FBA_KV_ALIGN = 64
FBA_Q_ALIGN = 16

VSA_NAME = "vsa"
FBA_NAME = "flex-block-attn"
# The modules each peer needs, for a cheap "is it installed" check (no import, no CUDA init).
PEER_MODULES = {VSA_NAME: "fastvideo_kernel", FBA_NAME: "flex_block_attn_cuda"}


def installed_peers() -> tuple[str, ...]:
    """Names of the peers whose modules can be found on ``sys.path`` (found, not yet imported)."""
    out = []
    for name, module in PEER_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            out.append(name)
    return tuple(out)


def distribution_version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version(name)
    except (ImportError, PackageNotFoundError):
        return None


def hopper_error() -> str | None:
    """Why the sm_90a kernels cannot run here, or None."""
    return sm90_error("its ThunderKittens kernel is built for sm_90a only")


def fold_heads(t: torch.Tensor, padded_len: int) -> torch.Tensor:
    """``(B, S, H, D)`` -> ``(1, B*H, padded_len, D)`` contiguous, zero rows past ``S`` (one copy)."""
    b, s, h, d = t.shape
    out = t.new_empty(b, h, padded_len, d)
    out[:, :, :s].copy_(t.permute(0, 2, 1, 3))
    if padded_len > s:
        out[:, :, s:].zero_()
    return out.view(1, b * h, padded_len, d)


def refine_blocks(blocks: torch.Tensor, block_q: int, block_kv: int, seq_q: int, seq_kv: int,
                  block: int = VSA_BLOCK) -> torch.Tensor:
    """A ``[.., nQ, nKV]`` block tensor over ``(block_q, block_kv)`` blocks (multiples of ``block``)
    as the same token set over ``block x block`` blocks: ``[.., ceil(seq_q/block), ceil(seq_kv/block)]``."""
    if block_q % block or block_kv % block:
        raise ValueError(f"blocks ({block_q}, {block_kv}) are not multiples of {block}")
    out = blocks.repeat_interleave(block_q // block, dim=-2).repeat_interleave(block_kv // block, dim=-1)
    return out[..., : math.ceil(seq_q / block), : math.ceil(seq_kv / block)]


def vsa_block_map(problem: Problem) -> torch.Tensor:
    """The problem's mask over 64 x 64 blocks with the batch folded into the heads:
    ``[1, B*H, ceil(Sq/64), ceil(Skv/64)]`` bool, contiguous."""
    return vsa_block_map_of(problem.mask, problem.batch, problem.heads)


def vsa_block_map_of(mask: LogicalMask, batch: int, heads: int) -> torch.Tensor:
    """``vsa_block_map`` of ``mask`` broadcast to ``batch`` x ``heads``."""
    blocks = refine_blocks(mask.blocks, mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv)
    full = blocks.expand(batch, heads, -1, -1)
    return full.reshape(1, batch * heads, full.shape[2], full.shape[3]).contiguous()


def vsa_fold(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
    """q ``[B, Sq, H, D]``, k, v ``[B, Skv, H, D]`` as VSA takes them: ``[1, B*H, S_pad, D]``, each
    sequence zero-padded to whole 64-token blocks."""
    pad_q = math.ceil(q.shape[1] / VSA_BLOCK) * VSA_BLOCK
    pad_kv = math.ceil(k.shape[1] / VSA_BLOCK) * VSA_BLOCK
    return fold_heads(q, pad_q), fold_heads(k, pad_kv), fold_heads(v, pad_kv)


def vsa_unfold(out: torch.Tensor, batch: int, heads: int, seq_q: int) -> torch.Tensor:
    """VSA's output ``[1, B*H, S_pad, D]`` as ``[B, Sq, H, D]`` (a view, padding rows dropped)."""
    return out.view(batch, heads, out.shape[2], out.shape[3])[:, :, :seq_q].permute(0, 2, 1, 3)


def vsa_kv_block_sizes(seq_kv: int, device: torch.device | str, block: int = VSA_BLOCK) -> torch.Tensor:
    """``[ceil(seq_kv/64)]`` int32: the real tokens of every KV block (the last one partial)."""
    n = math.ceil(seq_kv / block)
    sizes = torch.full((n,), block, dtype=torch.int32, device=device)
    sizes[-1] = seq_kv - (n - 1) * block
    return sizes


def vsa_block_indices(block_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What VSA's ``map_to_index`` makes of a ``[B, H, nQ, nKV]`` bool map, in plain torch:
    ``q2k_index [B, H, nQ, nKV]`` int32 (active KV blocks ascending, then -1) and ``q2k_num
    [B, H, nQ]`` int32. The backend runs VSA's own Triton version; this one documents the format and
    lets the CPU tests check it."""
    num = block_map.sum(-1, dtype=torch.int32)
    order = torch.argsort(block_map.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    slot = torch.arange(block_map.shape[-1], device=block_map.device)
    index = torch.where(slot < num.unsqueeze(-1), order, torch.full_like(order, -1))
    return index, num


def blocks_from_indices(index: torch.Tensor, num: torch.Tensor, n_kv: int) -> torch.Tensor:
    """The bool map ``[B, H, nQ, n_kv]`` that ``(q2k_index, q2k_num)`` lists (the inverse, for checks)."""
    width = index.shape[-1]
    valid = torch.arange(width, device=index.device) < num.to(torch.long).unsqueeze(-1)
    out = torch.zeros(*index.shape[:-1], n_kv + 1, dtype=torch.bool, device=index.device)
    out.scatter_(-1, torch.where(valid, index.to(torch.long), n_kv), True)
    return out[..., :n_kv]


def empty_query_blocks(mask: LogicalMask) -> int:
    """Query-block rows (over every ``(batch, head)`` of the mask) without any active key block."""
    return int((~mask.blocks.any(-1)).sum())


def import_vsa() -> tuple[Any, Any, str | None]:
    """``(fastvideo_kernel_ops, map_to_index, None)`` or ``(None, None, reason)``."""
    try:
        importlib.import_module("fastvideo_kernel")
        ops = importlib.import_module("fastvideo_kernel._C.fastvideo_kernel_ops")
        index = importlib.import_module("fastvideo_kernel.triton_kernels.index")
    except Exception as err:  # noqa: BLE001  (ImportError, or a broken extension raising anything)
        return None, None, f"fastvideo_kernel (VSA) not importable: {type(err).__name__}: {err}"
    if not hasattr(ops, "block_sparse_fwd"):
        return None, None, ("fastvideo_kernel_ops has no block_sparse_fwd: the extension was built without the "
                            "ThunderKittens Hopper kernels (FASTVIDEO_KERNEL_BUILD_TK)")
    return ops, index.map_to_index, None


class VsaBackend(Backend):
    """FastVideo's VSA block-sparse forward (ThunderKittens, sm_90a, 64 x 64 blocks)."""

    name = VSA_NAME
    kind = "sparse"

    def __init__(self) -> None:
        self._ops, self._map_to_index, self._error = import_vsa()
        if self._error is None:
            self._error = hopper_error()

    def unavailable(self) -> str | None:
        return self._error

    def unsupported(self, problem: Problem) -> str | None:
        return vsa_unsupported(problem)

    def prepare(self, problem: Problem) -> Any:
        block_map = vsa_block_map(problem)
        index, num = self._map_to_index(block_map)
        return index, num, vsa_kv_block_sizes(problem.seq_kv, problem.device)

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        return vsa_fold(q, k, v)

    def run(self, prepared: Any, inputs: Inputs) -> torch.Tensor:
        index, num, sizes = prepared
        return self._ops.block_sparse_fwd(*inputs, index, num, sizes)[0]

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        return vsa_unfold(out, problem.batch, problem.heads, problem.seq_q)

    def describe(self) -> dict:
        return {"vsa": distribution_version(VSA_PACKAGE), "vsa_kernel": "fastvideo_kernel_ops.block_sparse_fwd (sm90 TK)",
                "vsa_blocks": "64x64 (coarser masks split exactly)", "vsa_prepare": "map_to_index (Triton)",
                "vsa_layout": "batch folded into heads, sequence zero-padded to 64"}


def vsa_unsupported(problem: Problem, require_cuda: bool = True) -> str | None:
    """Why VSA's kernel cannot run ``problem`` exactly, or None (``require_cuda=False``: the
    geometry, dtype and mask alone, for CPU checks)."""
    mask = problem.mask
    if require_cuda and problem.device.type != "cuda":
        return "needs CUDA tensors"
    if problem.dtype != torch.bfloat16:
        return "VSA's Hopper kernel runs bf16 only"
    if problem.head_dim not in VSA_HEAD_DIMS:
        return f"VSA's Hopper kernel has head_dim {VSA_HEAD_DIMS[0]} and {VSA_HEAD_DIMS[1]} only, not {problem.head_dim}"
    if mask.block_q % VSA_BLOCK or mask.block_kv % VSA_BLOCK:
        return (f"VSA's kernel runs 64x64 blocks: Q{mask.block_q}K{mask.block_kv} is not made of them "
                "(block_q and block_kv must be multiples of 64)")
    empty = empty_query_blocks(mask)
    if empty:
        return (f"{empty} query block(s) have no key block: VSA's kernel always processes the row's last listed "
                "block (it has no empty-row case), so those rows cannot be 0")
    return None


def import_fba() -> tuple[Any, str | None]:
    """``(forward, None)`` with ``flex_block_attn._flex_block_attn_forward``, or ``(None, reason)``."""
    try:
        module = importlib.import_module("flex_block_attn")
        forward = module._flex_block_attn_forward
    except Exception as err:  # noqa: BLE001
        return None, f"flex_block_attn not importable: {type(err).__name__}: {err}"
    return forward, None


def fba_masks(blocks: torch.Tensor, block_q: int, block_kv: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(block_mask, small_block_mask, use_small_block_mode)`` for the kernel from a full
    ``[B, H, nQ, nKV]`` bool mask: ``block_mask`` over square ``block_kv`` rows (what the kernel
    walks), ``small_block_mask`` the exact mask when the kernel refines it per 16-row slice."""
    blocks = blocks.contiguous()
    if block_q == block_kv:
        return blocks, blocks, False
    if block_q < block_kv:  # flex_block_attn_func's reduction: OR of the query blocks of each square row
        ratio = block_kv // block_q
        b, h, n_q, n_kv = blocks.shape
        square = blocks.view(b, h, n_q // ratio, ratio, n_kv).any(-2).contiguous()
        return square, blocks, True
    square = blocks.repeat_interleave(block_q // block_kv, dim=-2).contiguous()  # each query block's square rows
    return square, square, False


def fba_token_mask(block_mask: torch.Tensor, small_mask: torch.Tensor, use_small: bool, block_q: int,
                   block_kv: int) -> torch.Tensor:
    """The token-level mask ``[B, H, Sq, Skv]`` the kernel computes from its arguments (its indexing,
    for checks): a token row attends a KV block when its square row has it and, in small-block mode,
    its query block has it too."""
    rows = block_mask.repeat_interleave(block_kv, dim=-2)
    if use_small:
        rows = rows & small_mask.repeat_interleave(block_q, dim=-2)
    return rows.repeat_interleave(block_kv, dim=-1)


class FlexBlockAttnBackend(Backend):
    """HunyuanVideo-1.5's flex-block-attn forward (ThunderKittens, sm_90a)."""

    name = FBA_NAME
    kind = "sparse"

    def __init__(self) -> None:
        self._forward, self._error = import_fba()
        if self._error is None:
            self._error = hopper_error()

    def unavailable(self) -> str | None:
        return self._error

    def unsupported(self, problem: Problem) -> str | None:
        return fba_unsupported(problem)

    def prepare(self, problem: Problem) -> Any:
        mask = problem.mask
        full = mask.blocks.expand(problem.batch, problem.heads, -1, -1)
        return fba_masks(full, mask.block_q, mask.block_kv) + (mask.block_q, mask.block_kv)

    def convert(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Inputs:
        return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))

    def run(self, prepared: Any, inputs: Inputs) -> torch.Tensor:
        block_mask, small_mask, use_small, block_q, block_kv = prepared
        return self._forward(*inputs, block_q, block_kv, block_mask, small_mask, use_small)[0]

    def to_bshd(self, out: torch.Tensor, problem: Problem) -> torch.Tensor:
        return out.transpose(1, 2)

    def describe(self) -> dict:
        return {"flex_block_attn": distribution_version("flex_block_attn"), "flex_block_attn_commit": FBA_COMMIT[:7],
                "fba_kernel": "flex_block_attn_cuda.attn_forward (sm90 TK)",
                "fba_note": "attn_forward synchronizes the device before and after its launch"}


def fba_unsupported(problem: Problem, require_cuda: bool = True) -> str | None:
    """Why flex-block-attn cannot run ``problem`` exactly, or None (``require_cuda=False``: the
    geometry and dtype alone, for CPU checks)."""
    mask = problem.mask
    bq, bkv = mask.block_q, mask.block_kv
    if require_cuda and problem.device.type != "cuda":
        return "needs CUDA tensors"
    if problem.dtype != torch.bfloat16:
        return "flex-block-attn runs bf16 only"
    if problem.head_dim != FBA_HEAD_DIM:
        return f"flex-block-attn has head_dim {FBA_HEAD_DIM} only, not {problem.head_dim}"
    if bkv % FBA_KV_ALIGN:
        return f"flex-block-attn needs KV blocks that are multiples of {FBA_KV_ALIGN}, not {bkv}"
    if bq % FBA_Q_ALIGN:
        return f"flex-block-attn needs query blocks that are multiples of {FBA_Q_ALIGN}, not {bq}"
    if bkv % bq and bq % bkv:
        return f"flex-block-attn needs one block size to divide the other, not Q{bq}K{bkv}"
    square = max(bq, bkv)
    if problem.seq_q % square or problem.seq_kv % bkv:
        return (f"sequence {problem.seq_q} is not a multiple of {square} (Q{bq}K{bkv}): flex-block-attn cannot mask "
                "keys inside a block, so a partial last block cannot be expressed")
    return None


def vsa_topk_blocks(q: torch.Tensor, k: torch.Tensor, top_k: int, block: int = VSA_BLOCK,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """VSA's own selection as a block tensor: mean-pool q and k over ``block``-token blocks (over
    their real tokens, as VSA's ``fused_block_mean`` divides by the block sizes: a partial last block,
    and with ``valid [S]`` bool the tokens it marks, e.g. a cube-tiled canvas without its padding),
    score every (query block, key block) by ``q_c . k_c / sqrt(D)`` and keep the ``top_k`` best key
    blocks of every query block, per batch element and head (as ``fused_topk_mask``).

    ``q [B, Sq, H, D]``, ``k [B, Skv, H, D]`` (the diffusers layout) -> ``[B, H, nQ, nKV]`` bool."""
    b, s_q, h, d = q.shape
    s_kv = k.shape[1]
    n_q, n_kv = math.ceil(s_q / block), math.ceil(s_kv / block)
    if not 1 <= top_k <= n_kv:
        raise ValueError(f"top_k must be in [1, {n_kv}], got {top_k}")

    def pooled(t: torch.Tensor, n: int) -> torch.Tensor:  # [B, S, H, D] -> [B, H, n, D] float32 means
        s = t.shape[1]
        weight = torch.zeros(n * block, dtype=torch.float32, device=t.device)
        weight[:s] = 1.0 if valid is None else valid[:s].to(torch.float32)
        padded = torch.zeros(b, n * block, h, d, dtype=torch.float32, device=t.device)
        padded[:, :s] = t.float() * weight[:s].view(1, s, 1, 1)
        counts = weight.view(n, block).sum(1).clamp_min(1.0)
        return (padded.view(b, n, block, h, d).sum(2) / counts.view(1, n, 1, 1)).permute(0, 2, 1, 3)

    scores = pooled(q, n_q) @ pooled(k, n_kv).transpose(-1, -2) / math.sqrt(d)  # [B, H, nQ, nKV]
    chosen = scores.topk(top_k, dim=-1).indices
    blocks = torch.zeros(b, h, n_q, n_kv, dtype=torch.bool, device=q.device)
    return blocks.scatter_(-1, chosen, True)


def vsa_topk_mask(q: torch.Tensor, k: torch.Tensor, top_k: int, block: int = VSA_BLOCK) -> LogicalMask:
    """``vsa_topk_blocks`` as a Tessera ``LogicalMask`` (``block x block`` blocks, partial last block)."""
    blocks = vsa_topk_blocks(q, k, top_k, block)
    return LogicalMask(blocks, block, block, q.shape[1], k.shape[1])


# VSA's cube: 4 x 4 x 4 latent tokens (frames, rows, columns) = one 64-token block.
VSA_TILE = (4, 4, 4)
VSA_FAMILY = "Q64K64-VSA"
VSA_SOURCE = "vsa_topk"


def vsa_topk_entries(grid: Any, heads: int, sparsity: float = 0.9, seeds: tuple[int, ...] = (0,),
                     device: torch.device | str = "cpu") -> list[Any]:
    """Masks VSA itself would select, as saved-corpus entries (``tessera bench --corpus DIR``): the
    grid in VSA's token order (4x4x4 cubes over the canvas zero-padded to whole cubes, so that a
    64-token block is one cube), q and k the corpus's smooth synthetic field through per-head
    projections (as the ``tessera_default`` source), and per query cube the
    ``ceil((1 - sparsity) * nKV)`` key cubes of highest pooled score (FastVideo's ``VSA_sparsity``
    rule), the same count in every row and head. Text-free grids only (VSA's cubes tile the video)."""
    from ..corpus import CorpusEntry, TokenLayout
    from ..corpus.cases import stable_seed
    from ..corpus.fields import draw_field, draw_projections, token_features

    if grid.text_tokens:
        raise ValueError(f"VSA cubes tile the video only; {grid.name} has {grid.text_tokens} text tokens")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    layout = TokenLayout(grid, tiled=True, tile=VSA_TILE)
    seq = layout.seq_len
    n_kv = seq // VSA_BLOCK
    top_k = max(1, math.ceil((1.0 - sparsity) * n_kv))
    valid = layout.real(device)
    entries = []
    for seed in seeds:
        scene = torch.Generator().manual_seed(stable_seed("scene", VSA_SOURCE, seed, grid.name, heads))
        feats = token_features(layout, draw_field(scene), device).float()  # [S, C], 0 on canvas padding
        wq, wk = draw_projections(scene, heads)
        q = torch.einsum("sc,hcd->shd", feats, wq.float().to(device)).unsqueeze(0)
        k = torch.einsum("sc,hcd->shd", feats, wk.float().to(device)).unsqueeze(0)
        blocks = vsa_topk_blocks(q, k, top_k, valid=valid)
        mask = LogicalMask(blocks, VSA_BLOCK, VSA_BLOCK, seq, seq)
        name = f"{VSA_FAMILY}/{VSA_SOURCE}/{grid.name}/h{heads}/s{seed}"
        info = {"name": name, "family": VSA_FAMILY, "source": VSA_SOURCE, "grid": grid.name, "seed": seed,
                "top_k": top_k, "sparsity": sparsity, "layout": "4x4x4 cubes, canvas zero-padded"}
        entries.append(CorpusEntry(None, mask, info))
    return entries


def write_vsa_topk_corpus(directory: Any, grids: tuple[str, ...] = ("bench32k",), heads: int = 24,
                          sparsity: float = 0.9, seeds: tuple[int, ...] = (0,)) -> Any:
    """Save ``vsa_topk_entries`` of every grid (names of ``corpus.grid_named``) as a corpus for
    ``tessera bench --corpus DIRECTORY``; returns the manifest path."""
    from ..corpus import grid_named, save_corpus

    entries = [e for g in grids for e in vsa_topk_entries(grid_named(g), heads, sparsity, seeds)]
    return save_corpus(directory, entries)


def thunderkittens_backends() -> list[Backend]:
    """Both peers (each reports its own unavailability)."""
    return [VsaBackend(), FlexBlockAttnBackend()]


__all__ = ["FBA_NAME", "VSA_NAME", "FlexBlockAttnBackend", "VsaBackend", "blocks_from_indices", "empty_query_blocks",
           "fba_masks", "fba_token_mask", "fba_unsupported", "fold_heads", "installed_peers", "refine_blocks",
           "thunderkittens_backends", "vsa_block_indices", "vsa_block_map", "vsa_kv_block_sizes", "vsa_topk_blocks",
           "vsa_topk_entries", "vsa_topk_mask", "vsa_unsupported", "write_vsa_topk_corpus"]
