"""The default job and the diffusion-loop benchmark harness run on the CPU (smoke mode)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from tessera_diffusers.processors.compat import CACHE_CONTEXT_TAKES_STEP

ROOT = Path(__file__).resolve().parents[2]


def load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_default_job_cpu_summary():
    from tessera_diffusers.demo import cpu_job

    summary = cpu_job(steps=3)
    assert summary["all_active_max_abs_diff_vs_stock"] < 1e-4
    assert 0.0 < summary["sparse_mean_mask_density"] < 1.0
    assert summary["dense_calls"] == 2 * 2 and summary["sparse_calls"] == 2 * 2 * 2
    assert summary["mask_reuses"] == 2 * 2  # recompute every 2 steps: step 2 reuses step 1


def test_diffusion_loop_smoke(tmp_path):
    if not CACHE_CONTEXT_TAKES_STEP:
        pytest.skip("the loop measures from step 10 through cache_context(step_index=...), diffusers >= 0.41.0")
    systems = "dense,one-liner,attach,tessera:spade_64,flex:spade_64,flashinfer:spade_64"
    argv = ["--out", str(tmp_path), "--smoke", "--systems", systems, "--first-step", "10", "--steps", "2"]
    report = load("benchmarks/diffusion_loop.py").main(argv)
    assert (tmp_path / "diffusion_loop.json").exists() and (tmp_path / "diffusion_loop.md").exists()
    on_disk = json.loads((tmp_path / "diffusion_loop.json").read_text())
    assert [m["model"] for m in on_disk["models"]] == ["wan", "hv15"]
    for model in report["models"]:
        assert model["layers_run"] == model["full_layers"] and not model["extrapolated"]
        rows = {row["system"]: row for row in model["systems"]}
        assert rows["flashinfer:spade_64"]["status"] == "unavailable"
        for name in ("dense", "one-liner", "attach", "tessera:spade_64", "flex:spade_64"):
            row = rows[name]
            assert row["status"] == "ok", row["detail"]
            assert len(row["step_s"]) == 2 and all(t > 0 for t in row["step_s"])
            assert "extrapolated_50_step_cfg_s" not in row
        for name in ("one-liner", "attach", "tessera:spade_64", "flex:spade_64"):
            assert rows[name]["attention_ms"] > 0 and rows[name]["attention_calls"] > 0
        # The one-liner and attach() make the same masks; FlexAttention computes the same masked
        # attention as Tessera (fp32 on the CPU): the same departure from dense.
        assert 0 < rows["one-liner"]["mask_density"] == rows["attach"]["mask_density"] <= 1
        assert rows["one-liner"]["output_rel_diff_vs_dense"] == rows["attach"]["output_rel_diff_vs_dense"]
        # The defaults' 6 x 8 x 8 tiles cover the tiny grids whole; 64-token blocks do not.
        assert rows["tessera:spade_64"]["mask_density"] < 1 and rows["tessera:spade_64"]["output_rel_diff_vs_dense"] > 0
        assert math.isclose(rows["flex:spade_64"]["output_rel_diff_vs_dense"],
                            rows["tessera:spade_64"]["output_rel_diff_vs_dense"], rel_tol=1e-3, abs_tol=1e-5)
        assert rows["one-liner"]["stats"]["plans"]["keys_reusing_every_later_plan"] == model["layers_run"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "diffusion_loop.png").exists()


def test_diffusion_loop_extrapolates_only_when_asked_and_says_so(tmp_path):
    argv = ["--out", str(tmp_path), "--smoke", "--models", "wan", "--systems", "dense", "--steps", "2", "--extrapolate"]
    report = load("benchmarks/diffusion_loop.py").main(argv)
    row = report["models"][0]["systems"][0]
    assert row["extrapolated_50_step_cfg_s"] > row["steady_step_s"]
    assert "extrapolated" in (tmp_path / "diffusion_loop.md").read_text()


def test_diffusion_loop_rejects_unknown_models(tmp_path):
    with pytest.raises(SystemExit):
        load("benchmarks/diffusion_loop.py").parse_args(["--out", str(tmp_path), "--models", "sora"])


class FakeVariableBlockSparseWrapper:
    """FlashInfer's documented ``VariableBlockSparseAttentionWrapper`` contract, computed densely on
    the CPU: ``plan(block_mask_map [H, MB, NB], block_row_sz [H, MB], block_col_sz [H, NB], ...)``,
    ``run(q [H, S, D], k, v, return_lse=True) -> (out [H, S, D], lse [H, S] in log2)``."""

    def __init__(self, workspace, backend="auto"):
        self.workspace = workspace
        self._vector_sparse_indices_buffer = torch.empty(4, dtype=torch.int32)  # grown by the adapter

    def plan(self, block_mask_map, block_row_sz, block_col_sz, num_qo_heads, num_kv_heads, head_dim, **kwargs):
        assert block_mask_map.dtype == torch.bool and block_mask_map.shape[0] == num_kv_heads
        assert block_row_sz.dtype == torch.int32 and block_row_sz.shape == block_mask_map.shape[:2]
        assert block_col_sz.dtype == torch.int32 and block_col_sz.shape == (num_kv_heads, block_mask_map.shape[2])
        needed = int((block_mask_map.double() @ block_col_sz[0].double()).sum())
        assert self._vector_sparse_indices_buffer.numel() > needed
        rows = [torch.repeat_interleave(m, r, 0) for m, r in zip(block_mask_map, block_row_sz)]
        self.token_mask = torch.stack([torch.repeat_interleave(m, c, 1) for m, c in zip(rows, block_col_sz)])

    def run(self, q, k, v, return_lse=False):
        scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~self.token_mask, -math.inf)
        lse = torch.logsumexp(scores, -1)
        out = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0) @ v.double()
        return out.to(q.dtype), (lse / math.log(2.0)).float()


def test_flashinfer_adapter_follows_the_documented_contract(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.VariableBlockSparseAttentionWrapper = FakeVariableBlockSparseWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    bench = load("benchmarks/diffusion_loop.py")
    from tessera_diffusers import reference
    from tessera_diffusers.processors import StepCache
    from tessera_diffusers.processors.plan_cache import CacheSlot
    from tessera_diffusers.testing import random_mask

    backend = bench.FlashInferBackend(torch.device("cpu"), workspace_mb=1)
    backend.calibrate(torch.device("cpu"), torch.float32, 16)
    assert math.isclose(backend.lse_scale, math.log(2.0))
    mask = random_mask(1, 3, 200, 150, 32, 48, density=0.4)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 200, 3, 16, generator=gen)
    k, v = torch.randn(2, 150, 3, 16, generator=gen), torch.randn(2, 150, 3, 16, generator=gen)
    cache = StepCache()
    slot = CacheSlot("k", mask, 0, "k")
    out, lse = backend.attention(q, k, v, mask, slot=slot, cache=cache, return_lse=True)
    want, want_lse = reference.attention(q, k, v, mask, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    backend.attention(q, k, v, mask, slot=slot, cache=cache)
    assert cache.stats.plan_builds == 1 and cache.stats.plan_reuses == 1


def test_flex_adapter_equals_the_reference():
    bench = load("benchmarks/diffusion_loop.py")
    from tessera_diffusers import reference
    from tessera_diffusers.processors import StepCache
    from tessera_diffusers.processors.plan_cache import CacheSlot
    from tessera_diffusers.testing import random_mask

    backend = bench.FlexBackend(compiled=False)
    mask = random_mask(1, 2, 200, 150, 32, 48, density=0.4)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 200, 2, 16, generator=gen)
    k, v = torch.randn(1, 150, 2, 16, generator=gen), torch.randn(1, 150, 2, 16, generator=gen)
    out, lse = backend.attention(q, k, v, mask, slot=CacheSlot("k", mask, 0, "k"), cache=StepCache(), return_lse=True)
    want, want_lse = reference.attention(q, k, v, mask, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    assert torch.all(~torch.isfinite(lse[~finite]))


def test_tessera_demo_command_runs(capsys):
    from tessera_diffusers.cli import main

    assert main(["demo", "--device", "cpu", "--steps", "2"]) == 0
    assert "all-active Tessera vs stock" in capsys.readouterr().out
