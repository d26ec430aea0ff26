"""The SpargeAttn peer on the CPU: its block map checked against the logical mask token by token,
both adapters end to end with SpargeAttn's functions replaced by fp32 emulations of what they read,
what it refuses, its registration, and the harness timing a peer outside the 8-bit budget while
refusing Tessera's own 8-bit path there."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tessera_diffusers import LogicalMask, reference
from tessera_diffusers.bench import harness
from tessera_diffusers.bench import sparge_backends as sp
from tessera_diffusers.bench.backends import Backend
from tessera_diffusers.bench.config import BACKEND_NAMES, BenchConfig, default_backends
from tessera_diffusers.bench.problem import OracleCheck, Problem, make_inputs
from tessera_diffusers.testing import random_mask, without_empty_rows


def problem_of(mask: LogicalMask, batch: int = 1, heads: int | None = None, head_dim: int = 64,
               dtype: torch.dtype = torch.bfloat16) -> Problem:
    return Problem("p", "test", mask.geometry_name, "random", mask, batch, heads or mask.heads, head_dim, dtype)


def token_mask(blocks: torch.Tensor, block_q: int, block_kv: int, seq_q: int, seq_kv: int) -> torch.Tensor:
    tok = blocks.repeat_interleave(block_q, -2).repeat_interleave(block_kv, -1)
    return tok[..., :seq_q, :seq_kv]


@pytest.mark.parametrize("block_q,block_kv,seq", [(128, 128, 1000), (384, 384, 1152), (64, 256, 900)])
def test_block_map_is_the_same_token_set(block_q, block_kv, seq) -> None:
    mask = random_mask(1, 3, seq, seq, block_q, block_kv, density=0.4, seed=block_q + seq)
    blocks = sp.sparge_block_map(mask, batch=2, heads=3)
    assert blocks.shape == (2, 3, math.ceil(seq / 64), math.ceil(seq / 128)) and blocks.is_contiguous()
    got = token_mask(blocks, sp.SPARGE_BLOCK_Q, sp.SPARGE_BLOCK_KV, seq, seq)
    want = token_mask(mask.blocks, block_q, block_kv, seq, seq).expand(2, 3, -1, -1)
    assert torch.equal(got, want)


def test_what_it_refuses() -> None:
    ok = without_empty_rows(random_mask(1, 2, 512, 512, 128, 128, density=0.3, seed=1))
    assert sp.sparge_unsupported(problem_of(ok), require_cuda=False) is None
    assert sp.sparge_unsupported(problem_of(ok)) == "needs CUDA tensors"
    assert "bf16" in sp.sparge_unsupported(problem_of(ok, dtype=torch.float16), require_cuda=False)
    assert "head_dim 64 and 128 only, not 96" in sp.sparge_unsupported(problem_of(ok, head_dim=96), require_cuda=False)
    q64k64 = without_empty_rows(random_mask(1, 2, 512, 512, 64, 64, density=0.3, seed=2))
    assert "64x128 blocks: Q64K64" in sp.sparge_unsupported(problem_of(q64k64), require_cuda=False)
    blocks = ok.blocks.clone()
    blocks[:, 1, 2] = False
    empty = LogicalMask(blocks, 128, 128, 512, 512)
    assert "1 query block(s) have no key block" in sp.sparge_unsupported(problem_of(empty), require_cuda=False)
    with pytest.raises(ValueError):
        sp.sparge_block_map(q64k64, 1, 2)


def emulated_parts() -> dict:
    """SpargeAttn's functions as fp32 emulations of what each reads and writes (no quantization):
    a wrong layout, block map or block list in the adapters changes the result."""

    def attend(q, k, v, blocks, scale):  # q, k, v [B, H, S, D]; blocks over 64 x 128
        tok = token_mask(blocks, sp.SPARGE_BLOCK_Q, sp.SPARGE_BLOCK_KV, q.shape[2], k.shape[2])
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        return torch.softmax(scores.masked_fill(~tok, float("-inf")), -1) @ v.float()

    def call(q, k, v, mask_id, scale, tensor_layout, output_dtype):
        assert tensor_layout == "NHD" and mask_id.dtype == torch.bool
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask_id, scale)
        return out.to(output_dtype).transpose(1, 2)

    def qk_quant(q, k, km, block_q, block_kv):
        assert (block_q, block_kv) == (sp.SPARGE_BLOCK_Q, sp.SPARGE_BLOCK_KV) and km.shape[-2] == 1
        return q, torch.ones(1), k - km, torch.ones(1)  # K less its mean: softmax is unchanged

    def lut(block_map):  # the block list, here the map itself
        return block_map.clone(), block_map.sum(-1, dtype=torch.int32)

    def v_transpose(v, v_t, layout):
        assert layout == 1
        v_t.zero_()
        v_t[..., : v.shape[2]] = v.transpose(-1, -2)

    def v_quant(v_t, v_fp8, v_scale, kv_len, scale_max, layout):
        v_fp8.copy_(v_t.float())  # the emulation keeps fp32 values in a float8 buffer's place
        v_scale.fill_(1.0)

    def kernel(q, k, v_t, out, blocks, valid, threshold, q_scale, k_scale, v_scale, layout, causal, gran, scale,
               count):
        assert (layout, causal, gran, count) == (1, 0, 1, 0) and torch.equal(valid, blocks.sum(-1, dtype=torch.int32))
        assert threshold.shape == (q.shape[1],)
        out.copy_(attend(q, k, v_t[..., : k.shape[2]].transpose(-1, -2), blocks, scale))

    return {"call": call, "qk_quant": qk_quant, "lut": lut, "v_transpose": v_transpose, "v_quant": v_quant,
            "kernel": kernel}


@pytest.mark.parametrize("kernel_only", [False, True])
def test_adapters_end_to_end_with_emulated_functions(kernel_only, monkeypatch) -> None:
    monkeypatch.setattr(torch, "float8_e4m3fn", torch.float32)  # the emulation's V buffer holds fp32
    backend = sp.SpargeBackend(kernel_only=kernel_only)
    backend._parts = emulated_parts()
    mask = without_empty_rows(random_mask(1, 2, 640, 640, 128, 256, density=0.35, seed=3))
    problem = problem_of(mask, batch=2, head_dim=64, dtype=torch.float32)
    q, k, v = make_inputs(problem, 1, seed=4)[0]
    out = backend.to_bshd(backend.request(problem, q, k, v), problem)
    want = reference.attention(q, k, v, mask, problem.scale, out_dtype=torch.float32)
    assert out.shape == want.shape
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), want, atol=4e-3, rtol=8e-3)  # bf16 rounding


def test_registered_and_unavailable_without_its_module(monkeypatch) -> None:
    assert set(sp.SPARGE_NAMES) <= set(BACKEND_NAMES)
    call, kernel = harness.make_backend("spargeattn"), harness.make_backend("spargeattn-kernel")
    assert isinstance(call, sp.SpargeBackend) and not call.kernel_only and call.name == "spargeattn"
    assert isinstance(kernel, sp.SpargeBackend) and kernel.kernel_only and kernel.name == "spargeattn-kernel"
    assert call.kind == "quantized" and not call.budget_gate
    if not sp.installed():
        assert "spas_sage_attn (SpargeAttn) not importable" in call.unavailable()
    assert call.describe()["spargeattn_commit"] == sp.SPARGE_COMMIT
    monkeypatch.setattr(sp, "installed", lambda: ())
    assert "spargeattn" not in default_backends("bench", "cuda")
    monkeypatch.setattr(sp, "installed", lambda: sp.SPARGE_NAMES)
    assert default_backends("bench", "cuda")[-2:] == sp.SPARGE_NAMES


class NoisyQuantized(Backend):
    """An 8-bit backend whose output is the oracle's plus 10% noise (outside the budget)."""

    kind = "quantized"

    def __init__(self, gate: bool):
        self.name = "noisy"
        self.budget_gate = gate

    def prepare(self, problem: Problem):
        return problem

    def run(self, problem: Problem, inputs):
        q, k, v = inputs
        out = reference.attention(q, k, v, problem.mask, problem.scale, out_dtype=torch.float32)
        gen = torch.Generator().manual_seed(0)
        return out + 0.1 * out.std() * torch.randn(out.shape, generator=gen)


@pytest.mark.parametrize("gate", [True, False])
def test_harness_times_a_peer_outside_the_budget_and_refuses_its_own(gate, tmp_path: Path) -> None:
    mask = without_empty_rows(random_mask(1, 2, 256, 256, 64, 64, density=0.5, seed=5))
    problem = problem_of(mask, head_dim=32, dtype=torch.float32)
    inputs = make_inputs(problem, 1, seed=6)
    config = BenchConfig(out_dir=tmp_path, device="cpu", backends=("reference",), warmup=0, reps=1, input_sets=1,
                         request_reps=1, plots=False, progress=False)
    state = harness.RunState(config, torch.device("cpu"), [], {}, [], set(), {}, tmp_path / "r.jsonl", lambda m: None)
    record, held = harness.validate(state, NoisyQuantized(gate), problem, inputs, OracleCheck(problem, inputs[0], [0, 1]))
    assert record["check"]["ok"] is False and record["check"]["relative_l2"] > 0.05
    if gate:
        assert held is None and record["status"] == "invalid" and "outside the 8-bit budget" in record["reason"]
    else:
        assert held is not None and "timed as a peer" in record["notes"][0]


def test_the_report_lists_every_8bit_records_agreement() -> None:
    from tessera_diffusers.bench.report import quantized_table

    records = [
        {"case": "c1", "backend": "tessera-int8", "kind": "quantized",
         "check": {"cosine": 0.99987, "relative_l2": 0.0163, "ok": True}},
        {"case": "c1", "backend": "spargeattn", "kind": "quantized",
         "check": {"cosine": 0.99924, "relative_l2": 0.0389, "ok": False}},
        {"case": "c1", "backend": "tessera", "kind": "tessera", "check": {"ok": True, "max_abs_error": 1e-3}},
        {"case": "c2", "backend": "spargeattn", "kind": "quantized", "status": "skipped"},
    ]
    lines = quantized_table(records)
    assert lines[0].startswith("## 8-bit agreement") and "relative L2 <= 0.03" in lines[0]
    assert "| c1 | tessera-int8 | 0.99987 | 0.0163 | yes |" in lines
    assert "| c1 | spargeattn | 0.99924 | 0.0389 | no |" in lines
    assert len([x for x in lines if x.startswith("| c1")]) == 2
    assert quantized_table(records[2:]) == []
