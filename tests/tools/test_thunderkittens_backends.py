"""The ThunderKittens peers (VSA, flex-block-attn) on the CPU: their mask conversions checked against
the logical mask (round trips, and end to end through each adapter with the peer's kernel replaced
by an fp32 emulation of what the kernel reads), what each refuses, and their registration."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from tessera_diffusers import LogicalMask, reference
from tessera_diffusers.bench import cli
from tessera_diffusers.bench import thunderkittens_backends as tk
from tessera_diffusers.bench.config import BACKEND_NAMES, BenchConfig, default_backends
from tessera_diffusers.bench.harness import make_backend, run_benchmark
from tessera_diffusers.bench.problem import Problem
from tessera_diffusers.bench.report import environment, header_lines, peer_versions
from tessera_diffusers.testing import random_mask, without_empty_rows


def problem_of(mask: LogicalMask, batch: int = 1, heads: int | None = None, head_dim: int = 128,
               dtype: torch.dtype = torch.bfloat16) -> Problem:
    heads = heads or mask.heads
    return Problem("p", "test", mask.geometry_name, "random", mask, batch, heads, head_dim, dtype)


def token_mask(mask: LogicalMask, batch: int, heads: int) -> torch.Tensor:
    """``[B, H, Sq, Skv]`` bool token-level mask of a logical mask (broadcast expanded)."""
    tok = mask.blocks.repeat_interleave(mask.block_q, 2).repeat_interleave(mask.block_kv, 3)
    return tok[..., : mask.seq_len_q, : mask.seq_len_kv].expand(batch, heads, -1, -1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """fp32 attention over ``[.., S, D]`` tensors with a bool token mask (rows without keys: NaN)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~tok, float("-inf"))
    return torch.softmax(scores, -1) @ v.float()


def emulated_vsa_fwd(q, k, v, index, num, sizes):
    """What VSA's ``block_sparse_fwd`` computes from its arguments: every 64-row query block attends
    the first ``num`` listed KV blocks, the columns of block ``j`` below ``sizes[j]``."""
    n_kv = sizes.numel()
    blocks = tk.blocks_from_indices(index, num, n_kv)  # [1, BH, nQ, nKV]
    cols = torch.arange(tk.VSA_BLOCK).unsqueeze(0) < sizes.unsqueeze(1)  # [nKV, 64]
    tok = blocks.repeat_interleave(tk.VSA_BLOCK, 2).repeat_interleave(tk.VSA_BLOCK, 3) & cols.reshape(1, 1, 1, -1)
    return masked_attention(q, k, v, tok), None


def emulated_fba_fwd(q, k, v, block_q, block_kv, block_mask, small_mask, use_small):
    tok = tk.fba_token_mask(block_mask, small_mask, use_small, block_q, block_kv)
    out = masked_attention(q, k, v, tok)
    if use_small:  # the kernel's small-block mode writes 0 for rows without keys
        out = torch.nan_to_num(out, nan=0.0)
    return out, None


@pytest.fixture
def fake_vsa(monkeypatch):
    ops = type("Ops", (), {"block_sparse_fwd": staticmethod(emulated_vsa_fwd)})
    monkeypatch.setattr(tk, "import_vsa", lambda: (ops, tk.vsa_block_indices, None))
    monkeypatch.setattr(tk, "hopper_error", lambda: None)
    return tk.VsaBackend()


@pytest.fixture
def fake_fba(monkeypatch):
    monkeypatch.setattr(tk, "import_fba", lambda: (emulated_fba_fwd, None))
    monkeypatch.setattr(tk, "hopper_error", lambda: None)
    return tk.FlexBlockAttnBackend()


def random_inputs(batch: int, seq: int, heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(3))


# ------------------------------------------------------------------ VSA conversions


def loop_indices(block_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """map_to_index as its Triton kernel writes it, one row at a time."""
    b, h, n_q, n_kv = block_map.shape
    index = torch.full((b, h, n_q, n_kv), -1, dtype=torch.int32)
    num = torch.zeros(b, h, n_q, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for qi in range(n_q):
                cols = torch.nonzero(block_map[bi, hi, qi]).flatten()
                index[bi, hi, qi, : cols.numel()] = cols.to(torch.int32)
                num[bi, hi, qi] = cols.numel()
    return index, num


def test_vsa_indices_match_map_to_index_and_round_trip() -> None:
    block_map = random_mask(2, 3, 640, 704, 64, 64, density=0.3, seed=1).blocks  # with empty rows
    index, num = tk.vsa_block_indices(block_map)
    want_index, want_num = loop_indices(block_map)
    assert index.dtype == num.dtype == torch.int32
    assert torch.equal(index, want_index) and torch.equal(num, want_num)
    assert torch.equal(tk.blocks_from_indices(index, num, block_map.shape[-1]), block_map)


@pytest.mark.parametrize("geometry", [(64, 64), (128, 128), (128, 64), (64, 192), (384, 384)])
@pytest.mark.parametrize("seq", [768, 700])  # whole blocks; partial last blocks
def test_vsa_block_map_is_the_logical_token_set(geometry, seq) -> None:
    block_q, block_kv = geometry
    mask = random_mask(1, 3, seq, seq, block_q, block_kv, density=0.4, seed=seq + block_q)
    problem = problem_of(mask, batch=2)
    folded = tk.vsa_block_map(problem)
    n = math.ceil(seq / 64)
    assert folded.shape == (1, 2 * 3, n, n) and folded.is_contiguous()
    sizes = tk.vsa_kv_block_sizes(seq, "cpu")
    assert sizes.dtype == torch.int32 and int(sizes.sum()) == seq and int(sizes[-1]) == seq - 64 * (n - 1)
    tok = folded.repeat_interleave(64, 2).repeat_interleave(64, 3)[..., :seq, :seq]
    assert torch.equal(tok.view(2, 3, seq, seq), token_mask(mask, 2, 3))


def test_fold_heads_pads_with_zeros_and_to_bshd_inverts_it() -> None:
    q = torch.randn(2, 200, 3, 16)
    folded = tk.fold_heads(q, 256)
    assert folded.shape == (1, 6, 256, 16) and folded.is_contiguous()
    assert bool((folded[:, :, 200:] == 0).all())
    backend = tk.VsaBackend()  # no fastvideo_kernel here: unavailable, its layout helpers still work
    problem = problem_of(LogicalMask.dense(200, 200, 64, 64), batch=2, heads=3, head_dim=16)
    assert torch.equal(backend.to_bshd(folded, problem), q)


@pytest.mark.parametrize("geometry,batch,seq", [((64, 64), 1, 640), ((64, 64), 2, 600), ((128, 128), 1, 700),
                                                 ((128, 64), 2, 520), ((64, 192), 1, 576)])
def test_vsa_adapter_end_to_end_with_an_emulated_kernel(fake_vsa, geometry, batch, seq) -> None:
    block_q, block_kv = geometry
    mask = without_empty_rows(random_mask(batch, 2, seq, seq, block_q, block_kv, density=0.35, seed=seq))
    assert tk.empty_query_blocks(mask) == 0
    problem = problem_of(mask, batch=batch, head_dim=32, dtype=torch.float32)
    assert tk.vsa_unsupported(problem, require_cuda=False) == "VSA's Hopper kernel runs bf16 only"
    q, k, v = random_inputs(batch, seq, 2, 32, seed=seq)
    out = fake_vsa.to_bshd(fake_vsa.run(fake_vsa.prepare(problem), fake_vsa.convert(q, k, v)), problem)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference.attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert fake_vsa.request(problem, q, k, v).shape == (1, batch * 2, math.ceil(seq / 64) * 64, 32)


# ------------------------------------------------------------------ flex-block-attn conversions


@pytest.mark.parametrize("geometry", [(64, 64), (384, 384), (64, 128), (16, 64), (32, 384), (128, 64), (256, 64)])
def test_fba_masks_are_the_logical_token_set(geometry) -> None:
    block_q, block_kv = geometry
    seq = 768
    mask = random_mask(2, 3, seq, seq, block_q, block_kv, density=0.3, seed=block_q * 7 + block_kv)
    full = mask.blocks.expand(2, 3, -1, -1)
    square, small, use_small = tk.fba_masks(full, block_q, block_kv)
    assert use_small == (block_q < block_kv)
    assert square.shape == (2, 3, seq // block_kv, seq // block_kv) and square.is_contiguous()
    assert small.is_contiguous() and small.dim() == 4
    tok = tk.fba_token_mask(square, small, use_small, block_q, block_kv)
    assert torch.equal(tok, token_mask(mask, 2, 3))


@pytest.mark.parametrize("geometry,batch", [((64, 64), 2), ((64, 128), 1), ((16, 64), 1), ((128, 64), 2)])
def test_fba_adapter_end_to_end_with_an_emulated_kernel(fake_fba, geometry, batch) -> None:
    block_q, block_kv = geometry
    seq = 512
    mask = random_mask(1, 2, seq, seq, block_q, block_kv, density=0.35, seed=block_q + block_kv)  # empty rows
    problem = problem_of(mask, batch=batch, dtype=torch.bfloat16)
    assert tk.fba_unsupported(problem, require_cuda=False) is None
    q, k, v = random_inputs(batch, seq, 2, 128, seed=3)
    out = fake_fba.to_bshd(fake_fba.run(fake_fba.prepare(problem), fake_fba.convert(q, k, v)), problem)
    ref = reference.attention(q, k, v, mask)
    rows = token_mask(mask, batch, 2).any(-1).permute(0, 2, 1)  # [B, S, H] rows with keys
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ what each refuses


def test_vsa_unsupported_names_the_reason() -> None:
    ok = without_empty_rows(random_mask(1, 2, 700, 700, 128, 128, seed=2))
    assert tk.vsa_unsupported(problem_of(ok), require_cuda=False) is None  # split into 64x64, padded
    assert tk.vsa_unsupported(problem_of(ok)) == "needs CUDA tensors"
    assert tk.vsa_unsupported(problem_of(ok, head_dim=64), require_cuda=False) is None
    assert "head_dim 64 and 128 only, not 96" in tk.vsa_unsupported(problem_of(ok, head_dim=96), require_cuda=False)
    assert "bf16 only" in tk.vsa_unsupported(problem_of(ok, dtype=torch.float16), require_cuda=False)
    for geometry in ((32, 16), (64, 32), (96, 64)):
        small = random_mask(1, 2, 768, 768, *geometry, seed=1)
        reason = tk.vsa_unsupported(problem_of(small), require_cuda=False)
        assert "64x64 blocks" in reason and f"Q{geometry[0]}K{geometry[1]}" in reason
    empty = random_mask(1, 2, 640, 640, 64, 64, empty_rows=True, seed=4)
    n_empty = int((~empty.blocks.any(-1)).sum())
    assert n_empty > 0
    assert tk.vsa_unsupported(problem_of(empty), require_cuda=False).startswith(f"{n_empty} query block(s) have no key")


def test_fba_unsupported_names_the_reason() -> None:
    def reason(geometry, seq=768, **kw):
        mask = random_mask(1, 1, seq, seq, *geometry, seed=0)
        return tk.fba_unsupported(problem_of(mask, **kw), require_cuda=False)

    assert reason((64, 64)) is None and reason((384, 384)) is None and reason((64, 128)) is None
    assert reason((128, 64)) is None and reason((16, 64)) is None
    assert tk.fba_unsupported(problem_of(random_mask(1, 1, 768, 768, 64, 64))) == "needs CUDA tensors"
    assert "multiples of 64, not 32" in reason((32, 32))
    assert "multiples of 64, not 16" in reason((32, 16))
    assert "one block size to divide the other, not Q192K128" in reason((192, 128))
    assert "head_dim 128 only, not 64" in reason((64, 64), head_dim=64)
    assert "bf16 only" in reason((64, 64), dtype=torch.float16)
    assert "partial last block" in reason((64, 64), seq=700)
    assert "not a multiple of 128" in reason((64, 128), seq=576)  # whole 64-blocks, not whole 128-blocks


# ------------------------------------------------------------------ VSA's own top-k selection


def test_vsa_topk_blocks_pool_score_and_select_per_row() -> None:
    batch, seq, heads, dim, top_k = 2, 150, 3, 8, 2  # 3 blocks, the last one of 22 tokens
    q, k, _ = random_inputs(batch, seq, heads, dim, seed=5)
    blocks = tk.vsa_topk_blocks(q, k, top_k)
    assert blocks.shape == (batch, heads, 3, 3) and bool((blocks.sum(-1) == top_k).all())
    bounds = [(0, 64), (64, 128), (128, 150)]
    for b in range(batch):
        for h in range(heads):
            qc = torch.stack([q[b, s:e, h].mean(0) for s, e in bounds])
            kc = torch.stack([k[b, s:e, h].mean(0) for s, e in bounds])
            scores = qc @ kc.T / math.sqrt(dim)
            want = torch.zeros(3, 3, dtype=torch.bool)
            want.scatter_(1, scores.argsort(1, descending=True)[:, :top_k], True)
            assert torch.equal(blocks[b, h], want)
    mask = tk.vsa_topk_mask(q, k, top_k)
    assert (mask.block_q, mask.block_kv, mask.seq_len_q, mask.seq_len_kv) == (64, 64, seq, seq)
    assert tk.vsa_unsupported(problem_of(mask, batch=batch, head_dim=128), require_cuda=False) is None
    with pytest.raises(ValueError):
        tk.vsa_topk_blocks(q, k, 4)


# ------------------------------------------------------------------ registration


def test_peers_are_registered_and_unavailable_without_their_modules(tmp_path) -> None:
    assert {"vsa", "flex-block-attn"} <= set(BACKEND_NAMES)
    vsa, fba = make_backend("vsa"), make_backend("flex-block-attn")
    assert isinstance(vsa, tk.VsaBackend) and vsa.name == "vsa"
    assert isinstance(fba, tk.FlexBlockAttnBackend) and fba.name == "flex-block-attn"
    if "vsa" not in tk.installed_peers():
        assert "fastvideo_kernel (VSA) not importable" in vsa.unavailable()
    if "flex-block-attn" not in tk.installed_peers():
        assert "flex_block_attn not importable" in fba.unavailable()
    assert vsa.describe()["vsa_blocks"].startswith("64x64") and fba.describe()["flex_block_attn_commit"] == "f5bfc9c"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "o"), "--device", "cpu", "--backends",
                              "sdpa-fa2,vsa,flex-block-attn"])
    assert cli.config_from_args(args).backends == ("sdpa-fa2", "vsa", "flex-block-attn")


def test_peers_join_the_default_backends_only_when_installed(monkeypatch) -> None:
    monkeypatch.setattr(tk, "installed_peers", lambda: ())
    assert not {"vsa", "flex-block-attn"} & set(default_backends("bench", "cuda"))
    monkeypatch.setattr(tk, "installed_peers", lambda: ("vsa", "flex-block-attn"))
    assert default_backends("bench", "cuda")[-2:] == ("vsa", "flex-block-attn")
    assert "vsa" not in default_backends("kernels", "cuda") and "vsa" not in default_backends("bench", "cpu")


def test_a_run_with_the_peers_reports_them_unavailable(tmp_path) -> None:
    if tk.installed_peers():
        pytest.skip("a peer is installed here")
    config = BenchConfig(out_dir=tmp_path, sizes=("smoke",), families=("Q64K64",), head_dim=64, device="cpu",
                         backends=("reference", "vsa", "flex-block-attn"), warmup=0, reps=1, input_sets=1,
                         request_reps=1, plots=False, progress=False)
    records, unavailable = run_benchmark(config, log=lambda m: None)
    assert set(unavailable) == {"vsa", "flex-block-attn"}
    assert json.loads((tmp_path / "unavailable.json").read_text()) == unavailable
    assert {r["backend"] for r in records} == {"reference"}


def test_report_names_installed_peer_versions() -> None:
    env = environment(torch.device("cpu"))
    assert "fastvideo_kernel" in env and "flex_block_attn" in env
    assert peer_versions({"fastvideo_kernel": "0.3.5", "flex_block_attn": None}) == ", fastvideo-kernel (VSA) 0.3.5"
    env.update(fastvideo_kernel="0.3.5", flex_block_attn="0.1")
    lines = header_lines(env, BenchConfig(out_dir="."))
    assert any(line.endswith("fastvideo-kernel (VSA) 0.3.5, flex-block-attn 0.1") for line in lines)


def test_vsa_topk_corpus_runs_in_the_harness(tmp_path) -> None:
    from tessera_diffusers.corpus import LatentGrid, TokenLayout, load_corpus, save_corpus

    grid = LatentGrid("vsa-test", 6, 8, 7)  # canvas 8 x 8 x 8 in 4x4x4 cubes: 8 blocks, 336 real tokens
    entries = tk.vsa_topk_entries(grid, heads=2, sparsity=0.75, seeds=(0, 1))
    assert [e.info["top_k"] for e in entries] == [2, 2] and entries[0].name == "Q64K64-VSA/vsa_topk/vsa-test/h2/s0"
    for entry in entries:
        mask = entry.mask
        assert (mask.block_q, mask.block_kv, mask.seq_len_q) == (64, 64, 512)
        assert mask.blocks.shape == (1, 2, 8, 8) and bool((mask.blocks.sum(-1) == 2).all())
    assert not torch.equal(entries[0].mask.blocks, entries[1].mask.blocks)
    assert torch.equal(tk.vsa_topk_entries(grid, 2, 0.75, (0,))[0].mask.blocks, entries[0].mask.blocks)
    real = TokenLayout(grid, tiled=True, tile=tk.VSA_TILE).real("cpu")
    assert int(real.sum()) == 336 and int(real.view(8, 64).sum(1).min()) > 0  # every cube holds real tokens
    with pytest.raises(ValueError, match="text tokens"):
        tk.vsa_topk_entries(LatentGrid("t", 4, 8, 8, text_tokens=10), heads=1)
    save_corpus(tmp_path / "corpus", entries)
    loaded = load_corpus(tmp_path / "corpus")
    assert [e.info["family"] for e in loaded] == ["Q64K64-VSA"] * 2
    config = BenchConfig(out_dir=tmp_path / "out", corpus_dir=tmp_path / "corpus", head_dim=16, device="cpu",
                         backends=("reference", "vsa"), warmup=0, reps=1, input_sets=1, request_reps=1, plots=False,
                         progress=False)
    records, _ = run_benchmark(config, log=lambda m: None)
    ref = [r for r in records if r["backend"] == "reference"]
    assert len(ref) == 2 and all(r["status"] == "ok" and r["family"] == "Q64K64-VSA" for r in ref)


def test_vsa_topk_pooling_skips_padding_tokens() -> None:
    q, k, _ = random_inputs(1, 128, 1, 4, seed=9)
    valid = torch.ones(128, dtype=torch.bool)
    valid[100:] = False  # the tail of the second block is canvas padding
    k_pad = k.clone()
    k_pad[:, 100:] = 50.0  # whatever sits there must not count
    same = tk.vsa_topk_blocks(q, k_pad, 1, valid=valid)
    want = tk.vsa_topk_blocks(q[:, :100], k[:, :100], 1)  # the same blocks, the second one partial
    assert torch.equal(same, want)
