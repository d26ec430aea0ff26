"""The copy-engine all-to-all (``tessera_diffusers.peer_exchange``) on two GPUs of one host.

Runs ``tests/gpu/peer_exchange_worker.py`` as two NCCL ranks (cuda:0, cuda:1) and checks what each
delivered against what it had to deliver (every rank draws every rank's inputs from one seed):
scatters in 1, 2 and 4 head chunks (also with later chunks deferred and awaited last first), the
chunked gather and the log-sum-exp exchange in bf16 and fp32,
forty exchanges in flight at once while the staging grows, and ``ulysses_attention`` against the
fp32 oracle with copy engines and with NCCL (bit-identical outputs). Skipped below two GPUs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tessera_diffusers.testing import run_ranks

WORKER = Path(__file__).with_name("peer_exchange_worker.py")
WORLD = 2
TIMEOUT_S = 300
BF16_TOL = 2e-2  # |out - fp32 oracle| of a bf16 kernel on unit-variance inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices"
    ),
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("peer_exchange")
    try:
        results = run_ranks(WORKER, WORLD, ["--out", str(out)], env=dict(os.environ), timeout=TIMEOUT_S)
    except TimeoutError as error:
        pytest.fail(str(error))
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} failed:\n{(result.stdout + result.stderr)[-4000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("rank", range(WORLD))
def test_exchanges_deliver_exactly(reports, rank):
    report = reports[rank]["exchanges"]
    assert "error" not in report, report.get("error")
    assert len(report) == 2 * 2 * 3 - 2  # 2 dtypes x 2 shapes x chunks 1, 2, 4 (4 does not divide 2 heads)
    for key, got in report.items():
        assert got["copy_engine"]["in_use"] == "copy_engine", key
        assert got["nccl"]["in_use"] == "nccl", key
        for transport, checks in got.items():
            assert all(checks[c] for c in ("scatter", "deferred", "gather", "lse")), (key, transport, checks)


@pytest.mark.parametrize("rank", range(WORLD))
def test_exchanges_in_flight_together(reports, rank):
    report = reports[rank]["stress"]
    assert "error" not in report, report.get("error")
    assert report["exchanges"] == 40 and report["wrong"] == []
    assert report["seq"] >= 1 and report["area_mib"] >= 16


@pytest.mark.parametrize("rank", range(WORLD))
def test_ulysses_attention_over_copy_engines(reports, rank):
    report = reports[rank]["attention"]
    assert "error" not in report, report.get("error")
    for key in ("copy_engine_c1_err", "copy_engine_c2_err", "nccl_c1_err", "nccl_c2_err"):
        assert report[key] < BF16_TOL, (key, report[key])
    assert report["same_as_nccl"]
