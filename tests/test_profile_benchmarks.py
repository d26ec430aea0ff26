"""The two issue-6 benchmark scripts on the CPU: the dispatch micro-benchmark (selection step only,
synthetic compiler-built table) and the A0/A1/A2 ablation in its smoke configuration."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"tessera_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dispatch_overhead_reports_percentiles(tmp_path):
    out = tmp_path / "dispatch.json"
    load("dispatch_overhead").main(["--iters", "300", "--warmup", "20", "--masks", "8", "--seq", "8192",
                                    "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"regime hit", "new regime", "new request", "cost model"}
    for row in rows.values():
        assert 0 < row["p50_us"] <= row["p95_us"] <= row["p99_us"]
    assert rows["regime hit"]["p50_us"] < rows["cost model"]["p50_us"]  # the cache skips the ranking


def test_ablation_smoke(tmp_path):
    rc = load("ablation").main(["--out", str(tmp_path), "--smoke", "--families", "Q64K64", "--cases-per-family", "1",
                                "--cold-reps", "1", "--reps", "1"])
    assert rc == 0
    payload = json.loads((tmp_path / "ablation.json").read_text())
    (row,) = payload["rows"]
    systems = row["systems"]
    assert set(systems) == {"A0 direct", "A1 search", "A2 tessera"}
    assert all(s["status"] == "ok" and s["check"]["ok"] for s in systems.values())
    assert systems["A0 direct"]["plan"].startswith("direct_q64k64_from_q64k64")
    assert systems["A2 tessera"]["plan"] == "reference oracle"  # no table and no native kernels on a CPU
    assert "| A1 search |" in (tmp_path / "ablation.md").read_text()
