"""``benchmarks/cp_scaling.py --smoke`` under torchrun with two CPU processes (gloo, 127.0.0.1):
the harness runs end to end, reports both parts and finds the N-process outputs equal to the
1-process ones (fp32 on the CPU)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tessera_diffusers
from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.testing import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cp_scaling.py"
PACKAGE_ROOT = Path(tessera_diffusers.__file__).resolve().parents[1]
PROCESSORS_ROOT = Path(sys.modules[TesseraProcessor.__module__].__file__).resolve().parents[1]
TIMEOUT_S = 150

pytestmark = pytest.mark.skipif(
    PROCESSORS_ROOT != PACKAGE_ROOT,
    reason=f"mixed install: tessera_diffusers from {PACKAGE_ROOT} but its processors from {PROCESSORS_ROOT} "
    "(a stale editable install; run pip install -e . in the checkout under test)",
)


def test_cp_scaling_smoke(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["NCCL_NVLS_ENABLE"] = "1"  # the script must force multicast off whatever the environment says
    env["NVSHMEM_DISABLE_NVLS"] = "0"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(SCRIPT), "--smoke", "--timeline", "--chunks", "2,1:3", "--out", str(tmp_path),
    ]  # fmt: skip
    # A session of its own, so that torchrun and its workers can be ended together on a timeout.
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"cp_scaling.py --smoke did not finish within {TIMEOUT_S} s")
    assert proc.returncode == 0, stderr[-4000:]
    report = json.loads((tmp_path / "cp_scaling.json").read_text())
    markdown = (tmp_path / "cp_scaling.md").read_text()

    assert report["environment"]["world"] == 2 and report["environment"]["backend"] == "gloo"
    assert report["environment"]["forced_env"] == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    attention, transformer = report["attention"], report["transformer"]
    for row in (attention["mask_reused"], attention["mask_recomputed"], attention["kernel"], transformer["forward"]):
        assert row["world"] == 2
        assert math.isfinite(row["efficiency"]) and row["efficiency"] > 0
        assert row["tn_min_ms"] <= row["tn_ms"]
        assert row["efficiency"] == pytest.approx(row["t1_ms"] / (2 * row["tn_ms"]))
    # both requested transports ran; on the CPU "auto" is the torch.distributed collective (gloo)
    assert set(attention["outputs"]) == {"auto", "nccl"}
    assert {run["transport"] for run in attention["runs"].values()} == {"nccl"}
    assert set(attention["all_to_all_ms"]) == {"nccl"}
    for diff in attention["outputs"].values():
        assert diff["max_abs_diff"] <= 1e-5 and diff["rel_l2"] <= 1e-6
    for forward in (transformer["forward"], transformer["forward_nccl"]):
        assert forward["max_abs_diff"] <= 1e-5 and forward["rel_l2"] <= 1e-6
    assert 0 < attention["mask_density"] < 1
    # equal chunks (the headline) and weights 1:3 of a rank's 4 heads, both in the table
    assert [run["heads_per_chunk"] for run in attention["runs"].values()][:2] == [[2, 2], [1, 3]]
    assert "2 head chunks, " in markdown and "2 head chunks (1/3 heads)" in markdown
    # the timeline: every mark of each chunk count's call, in order
    assert {tuple(t["heads_per_chunk"]) for t in attention["timeline"].values()} == {
        tuple(r["heads_per_chunk"]) for r in attention["runs"].values()
    }
    for timeline in attention["timeline"].values():
        rows, chunks = timeline["marks"], timeline["chunks"]
        marks = [r["mark"] for r in rows]
        assert marks[0] == "start" and marks[-1] == "end"
        assert sum(m.startswith("attention") and m.endswith("done") for m in marks) == chunks
        assert sum(m.startswith("input") for m in marks) == 3 * chunks  # q, k, v permuted per chunk
        times = [r["host_ms"] for r in rows]
        assert times == sorted(times)
    assert "Timeline of one N-GPU attention call" in markdown
    assert transformer["processor"]["sparse_calls"] > 0
    assert "| attention, mask reused" in markdown and "efficiency" in markdown
