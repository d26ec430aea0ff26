"""The ThunderKittens peers on an sm90 GPU against the fp32 oracle, through their bench adapters,
with the harness's own criterion (a baseline's error within ``BASELINE_SLACK`` times the oracle
tolerance on rows with keys). Skipped unless the peer imports and the GPU is sm90; build them as
``docs/development.md`` (Peers on the GPU machine) says and put their directory on ``PYTHONPATH``:

    PYTHONPATH=/tmp/peersite python -m pytest -q tests/gpu/test_thunderkittens_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers import LogicalMask
from tessera_diffusers.bench import thunderkittens_backends as tk
from tessera_diffusers.bench.harness import BASELINE_SLACK
from tessera_diffusers.bench.problem import OracleCheck, Problem, make_inputs
from tessera_diffusers.testing import random_mask, without_empty_rows


def backend_or_skip(cls):
    backend = cls()
    reason = backend.unavailable()
    if reason:
        pytest.skip(reason)
    return backend


def problem_of(mask: LogicalMask, batch: int, heads: int, head_dim: int) -> Problem:
    return Problem("p", "gpu", mask.geometry_name, "random", mask, batch, heads, head_dim, torch.bfloat16)


def check(backend, problem: Problem) -> None:
    assert backend.unsupported(problem) is None
    inputs = make_inputs(problem, 1, seed=1)
    out = backend.request(problem, *inputs[0])
    torch.cuda.synchronize()
    oracle = OracleCheck(problem, inputs[0], list(range(problem.heads)))
    result = oracle.compare(backend.to_bshd(out, problem))
    assert result.error <= BASELINE_SLACK * result.tolerance, result.to_dict()


@pytest.mark.parametrize("geometry,seq,batch,head_dim", [((64, 64), 1024, 1, 128), ((64, 64), 1000, 2, 128),
                                                         ((64, 64), 1000, 1, 64), ((128, 128), 1100, 1, 128),
                                                         ((384, 384), 2304, 1, 128)])
def test_vsa_matches_the_oracle(geometry, seq, batch, head_dim) -> None:
    backend = backend_or_skip(tk.VsaBackend)
    mask = without_empty_rows(random_mask(1, 3, seq, seq, *geometry, density=0.3, seed=seq, device="cuda"))
    problem = problem_of(mask, batch, 3, head_dim)
    index, num = backend._map_to_index(tk.vsa_block_map(problem))  # VSA's own Triton preprocessing
    want_index, want_num = tk.vsa_block_indices(tk.vsa_block_map(problem))
    assert torch.equal(num, want_num) and torch.equal(index, want_index)
    check(backend, problem)


def test_vsa_refuses_empty_rows() -> None:
    backend = backend_or_skip(tk.VsaBackend)
    mask = random_mask(1, 2, 640, 640, 64, 64, empty_rows=True, seed=0, device="cuda")
    assert "no key block" in backend.unsupported(problem_of(mask, 1, 2, 128))


@pytest.mark.parametrize("geometry,seq,batch", [((64, 64), 1024, 2), ((384, 384), 2304, 1), ((128, 128), 1024, 1),
                                                ((64, 128), 1024, 1), ((16, 64), 768, 1), ((64, 384), 2304, 1),
                                                ((128, 64), 1024, 2)])
def test_fba_matches_the_oracle(geometry, seq, batch) -> None:
    backend = backend_or_skip(tk.FlexBlockAttnBackend)
    mask = random_mask(1, 3, seq, seq, *geometry, density=0.3, seed=seq, device="cuda")  # empty rows too
    check(backend, problem_of(mask, batch, 3, 128))
