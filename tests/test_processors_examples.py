"""The default job and the diffusion-loop benchmark harness run on the CPU (smoke mode)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_default_job_cpu_summary():
    summary = load("examples/default_job.py").main(["--device", "cpu", "--steps", "3"])
    assert summary["all_active_max_abs_diff_vs_stock"] < 1e-4
    assert 0.0 < summary["sparse_mean_mask_density"] < 1.0
    assert summary["dense_calls"] == 2 * 2 and summary["sparse_calls"] == 2 * 2 * 2
    assert summary["mask_reuses"] == 2 * 2  # recompute every 2 steps: step 2 reuses step 1


def test_diffusion_loop_smoke(tmp_path):
    report = load("benchmarks/diffusion_loop.py").main(["--out", str(tmp_path), "--smoke"])
    assert (tmp_path / "diffusion_loop.json").exists() and (tmp_path / "diffusion_loop.md").exists()
    on_disk = json.loads((tmp_path / "diffusion_loop.json").read_text())
    assert [m["model"] for m in on_disk["models"]] == ["wan", "hv15"]
    for model in report["models"]:
        rows = {row["system"]: row for row in model["systems"]}
        assert rows["flashinfer"]["status"] == "unavailable"
        for name in ("dense", "tessera", "flex"):
            row = rows[name]
            assert row["status"] == "ok", row["detail"]
            assert row["attention_ms"] > 0 and row["loop_s"] > 0 and row["attention_calls"] > 0
            assert math.isclose(row["attention_full_s"], row["attention_ms"] / 1e3 * model["extrapolation_factor"])
        # FlexAttention and Tessera compute the same masked attention (fp32 on the CPU).
        assert rows["flex"]["final_latents_rel_diff_vs_tessera"] < 1e-4
        assert rows["tessera"]["mask_density"] == rows["flex"]["mask_density"] < 1.0
        assert "tessera_attention_speedup_vs_best_sparse" in model["summary"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "diffusion_loop.png").exists()


def test_diffusion_loop_rejects_unknown_models(tmp_path):
    with pytest.raises(SystemExit):
        load("benchmarks/diffusion_loop.py").parse_args(["--out", str(tmp_path), "--models", "sora"])
