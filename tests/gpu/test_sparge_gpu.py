"""The SpargeAttn peer on an sm90 GPU against the fp32 oracle, through both bench adapters. Its P V
runs in FP8 e4m3, so it is held to a loose bound that only a wrong block map or layout breaks
(relative L2 above 0.1; its quantization alone stays near 0.04). Skipped unless ``spas_sage_attn``
imports and the GPU is sm90; build it as ``docs/development.md`` (Peers on the GPU machine) says:

    PYTHONPATH=/tmp/sparge python -m pytest -q tests/gpu/test_sparge_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers.bench import sparge_backends as sp
from tessera_diffusers.bench.problem import OracleCheck, Problem, make_inputs
from tessera_diffusers.testing import random_mask, without_empty_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel_only", [False, True])
@pytest.mark.parametrize("block_q,block_kv,seq", [(128, 128, 4096), (384, 384, 4000), (64, 256, 3000)])
def test_sparge_matches_the_oracle_on_its_geometries(kernel_only, block_q, block_kv, seq) -> None:
    backend = sp.SpargeBackend(kernel_only=kernel_only)
    if backend.unavailable():
        pytest.skip(backend.unavailable())
    mask = without_empty_rows(random_mask(1, 4, seq, seq, block_q, block_kv, density=0.2, seed=seq, device="cuda"))
    problem = Problem("p", "gpu", mask.geometry_name, "random", mask, 2, 4, 128, torch.bfloat16)
    assert backend.unsupported(problem) is None
    inputs = make_inputs(problem, 1, seed=2)
    out = backend.to_bshd(backend.request(problem, *inputs[0]), problem)
    torch.cuda.synchronize()
    fit = OracleCheck(problem, inputs[0], list(range(problem.heads))).agreement(out)
    assert fit.relative_l2 < 0.1 and fit.cosine > 0.99, vars(fit)
