"""The plan of a mask that comes back, from the plan table's ``/reused`` key (``Request.reused_mask``,
``Selector.reused_plan``): keys, plan records, the profiler's cases, the compiled key and the
Runtime's once-per-mask re-preparation, on the CPU with executor plans."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tessera_diffusers import KvLayout, PhysicalPlan, QLayout, Runtime, TaskOrganization, build_mask_state, prepare
from tessera_diffusers.catalog import hopper_kernels, plans_for, reference_kernel
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.plan_table import plan_from_dict, plan_to_dict, tile_group
from tessera_diffusers.plans import Request, with_grouped_layouts
from tessera_diffusers.profile.compile import CompileOptions, compile_table
from tessera_diffusers.profile.synthetic import synthetic_profile
from tessera_diffusers.selector import GROUP_QUERIES_ENV, Selector, reused_mask_plan
from tessera_diffusers.testing import check_against_reference, interleaved_mask, random_qkv

CPU_REQUEST = Request(1, 2, 400, 400, 32, "fp32", 16, 16, "cpu")
NATURAL = PhysicalPlan(16, 16, KvLayout.PACKED, TaskOrganization(), reference_kernel(32, "fp32", 64, 64))
OTHER = PhysicalPlan(16, 16, KvLayout.CONTIGUOUS, TaskOrganization(), reference_kernel(32, "fp32", 32, 32))
GROUPED = NATURAL.grouped()


@pytest.fixture(autouse=True)
def no_group_override(monkeypatch):
    monkeypatch.delenv(GROUP_QUERIES_ENV, raising=False)


def test_reused_requests_have_their_own_key():
    reused = dataclasses.replace(CPU_REQUEST, reused_mask=True)
    assert CPU_REQUEST.key == "cpu/Q16K16/d32/fp32/bshd"
    assert reused.key == CPU_REQUEST.key + "/reused" and reused != CPU_REQUEST


def test_plan_records_keep_the_query_layout():
    assert "q_layout" not in plan_to_dict(NATURAL)  # natural records read as before
    assert json.loads(json.dumps(plan_to_dict(GROUPED)))["q_layout"] == "grouped"
    assert plan_from_dict(plan_to_dict(GROUPED)) == GROUPED and plan_from_dict(plan_to_dict(NATURAL)) == NATURAL
    assert tile_group(GROUPED) != tile_group(NATURAL)  # schedule rules never swap layouts


def test_with_grouped_layouts_adds_the_hopper_plans_that_group():
    plans = plans_for(16, 16, hopper_kernels())
    both = with_grouped_layouts(plans)
    grouped = both[len(plans):]
    assert both[:len(plans)] == plans and grouped
    assert all(p.q_layout is QLayout.GROUPED and p.tile_q > 16 for p in grouped)
    assert len(grouped) == sum(1 for p in plans if p.can_group_queries)
    assert with_grouped_layouts([NATURAL]) == [NATURAL]  # the executor's plans are not ranked grouped
    assert with_grouped_layouts(plans_for(128, 128, hopper_kernels())) == plans_for(128, 128, hopper_kernels())


def cpu_table(reused_best: PhysicalPlan | None):
    """A CPU table: ``NATURAL`` wins the natural key; on the ``/reused`` key (when ``reused_best``)
    that plan wins, the others slower."""
    plans = [NATURAL, OTHER, GROUPED]
    requests = [CPU_REQUEST] + ([dataclasses.replace(CPU_REQUEST, reused_mask=True)] if reused_best else [])

    def latency(plan, request, stats, rng):
        if not request.reused_mask:
            return None if plan.q_layout is QLayout.GROUPED else (1.0 if plan == NATURAL else 2.0)
        return 0.5 if plan == reused_best else 1.5

    table, _ = compile_table(synthetic_profile("cpu", (), plans, requests, latency, 8), CompileOptions(min_leaf=32))
    return table


def cpu_mask(seed: int):
    """A CPU mask whose query blocks are worth grouping (``testing.interleaved_mask``)."""
    return interleaved_mask(1, 2, 400, 400, 16, 16, seed=seed)


def step_cache_plans(backend, mask, q, k, v, calls: int = 3) -> list:
    """The plan the processors' backend keeps for ``mask`` (in its ``Runtime``) after each of
    ``calls`` calls through ``backend`` (``TesseraBackend``), each output checked against the
    oracle and the step cache slot's bytes against the kept plan's."""
    from tessera_diffusers.processors.plan_cache import StepCache, tensor_nbytes

    cache = StepCache()
    slot = cache.store_mask("layer", mask, 0, "signature")
    plans = []
    for _ in range(calls):
        out = backend.attention(q, k, v, mask, slot=slot, cache=cache)
        (entry,) = backend.runtime_for(slot.key)._cache.values()
        kept = entry.prepared
        plans.append(kept.plan)
        ((ref, nbytes),) = slot.tracked.values()
        assert ref() is kept and slot.plan_bytes == nbytes == tensor_nbytes(kept)
        assert check_against_reference(out, None, q, k, v, mask).ok()
    assert cache.stats.plan_builds == 1 and cache.stats.plan_reuses == calls - 1
    return plans


def test_compiled_table_keeps_the_layouts_apart():
    table = cpu_table(GROUPED)
    reused = dataclasses.replace(CPU_REQUEST, reused_mask=True)
    assert table.keys[CPU_REQUEST.key].base_plan == NATURAL.name
    assert table.keys[reused.key].base_plan == GROUPED.name
    assert table.plans[GROUPED.name] == GROUPED


@pytest.mark.parametrize("reused_best", [GROUPED, OTHER, NATURAL])
def test_selector_takes_the_reused_key(reused_best):
    selector = Selector(table=cpu_table(reused_best))
    state = build_mask_state(cpu_mask(0))
    assert selector.select(CPU_REQUEST, state) == NATURAL  # a mask's first request: natural plans only
    chosen = selector.reused_plan(NATURAL, CPU_REQUEST, state)
    assert chosen == reused_best
    if reused_best == NATURAL:
        assert chosen is NATURAL  # the same plan: nothing to re-prepare


def test_selector_without_a_reused_key_keeps_the_rule(monkeypatch):
    selector = Selector(table=cpu_table(None))
    state = build_mask_state(cpu_mask(0))
    assert selector.reused_plan(NATURAL, CPU_REQUEST, state) is reused_mask_plan(NATURAL, CPU_REQUEST) is NATURAL
    hopper = next(p for p in plans_for(16, 16, hopper_kernels()) if p.can_group_queries)
    sm90 = dataclasses.replace(CPU_REQUEST, arch="sm90", heads=24, seq_len_q=32768, seq_len_kv=32768, head_dim=128,
                               dtype=hopper.kernel.dtype)
    no_table = Selector(table=None, kernels=hopper_kernels())
    assert no_table.reused_plan(hopper, sm90, state) == hopper.grouped()  # the rule: Hopper, small blocks
    monkeypatch.setenv(GROUP_QUERIES_ENV, "0")  # the override beats a table too
    assert Selector(table=cpu_table(GROUPED)).reused_plan(NATURAL, CPU_REQUEST, state) is NATURAL


def test_selection_regret_judges_what_the_runtime_runs_for_a_reused_mask():
    """benchmarks/selection_regret.py on a ``--reused-masks`` record: the plan the runtime re-prepares
    the mask in (``Selector.reused_plan`` after the natural selection), so a table without the
    ``/reused`` key is judged by its rule, not by a lookup of a key it does not have."""
    spec = importlib.util.spec_from_file_location("tessera_bench_selection_regret",
                                                  Path(__file__).parents[2] / "benchmarks" / "selection_regret.py")
    regret = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regret)
    state = build_mask_state(cpu_mask(0))
    reused = dataclasses.replace(CPU_REQUEST, reused_mask=True)
    assert regret.deployed_choice(Selector(table=cpu_table(GROUPED)), reused, state) == GROUPED
    assert regret.deployed_choice(Selector(table=cpu_table(OTHER)), reused, state) == OTHER
    assert regret.deployed_choice(Selector(table=cpu_table(None)), reused, state) == NATURAL  # the rule
    assert regret.deployed_choice(Selector(table=cpu_table(GROUPED)), CPU_REQUEST, state) == NATURAL


def test_reused_choice_is_eligible_for_the_request():
    selector = Selector(table=cpu_table(GROUPED))
    state = build_mask_state(cpu_mask(0))
    chosen = selector.reused_plan(NATURAL, CPU_REQUEST, state)
    assert rejection(chosen, CPU_REQUEST) is None


@pytest.mark.parametrize("reused_best", [GROUPED, OTHER])
def test_runtime_reprepares_a_reused_mask_once_in_the_table_plan(reused_best):
    runtime = Runtime(selector=Selector(table=cpu_table(reused_best)))
    mask = cpu_mask(3)
    q, k, v = random_qkv(1, 400, 400, 2, 32, torch.float32, "cpu", seed=3)
    plans = []
    for _ in range(4):
        out = runtime.attention(q, k, v, mask, scale=0.2)
        assert check_against_reference(out, None, q, k, v, mask, 0.2).ok()
        plans.append(runtime._cache[next(iter(runtime._cache))].prepared.plan)
    assert plans == [NATURAL, reused_best, reused_best, reused_best]
    assert runtime.regroupings == 1


def test_runtime_keeps_the_plan_when_the_table_says_so():
    runtime = Runtime(selector=Selector(table=cpu_table(NATURAL)))
    mask = cpu_mask(4)
    q, k, v = random_qkv(1, 400, 400, 2, 32, torch.float32, "cpu", seed=4)
    first = runtime.prepared_for(mask, CPU_REQUEST, None)
    assert runtime.prepared_for(mask, CPU_REQUEST, None) is first and runtime.regroupings == 0
    assert check_against_reference(runtime.attention(q, k, v, mask), None, q, k, v, mask).ok()


def test_profiler_cases_of_reused_masks(tmp_path):
    """A smoke profile with ``reused_masks``: its cases are keyed apart, its requests carry the
    flag, and the compiled table has the ``/reused`` key only."""
    from tessera_diffusers.profile.compile import load_profile
    from tessera_diffusers.profile.config import smoke_config
    from tessera_diffusers.profile.runner import case_key, run_profile

    config = smoke_config(tmp_path, families=("Q32K16",), reused_masks=True, progress=False)
    summary = run_profile(config, log=lambda line: None)
    assert summary.cases_done == summary.cases_total > 0 and summary.stopped is None
    size, case = config.cases()[0]
    assert case_key(size, case, config).endswith(":reused")
    profile = load_profile([summary.records_path])
    keys = {c.request.key for c in profile.cases}
    assert len(keys) == 1 and next(iter(keys)).endswith("/Q32K16/d64/bf16/bshd/reused")
    assert all(c.request.reused_mask for c in profile.cases)
    table, _ = compile_table(profile, CompileOptions(min_leaf=1))
    assert list(table.keys) == list(keys)


@pytest.mark.gpu
def test_processors_take_the_shipped_reused_plan_on_hopper():
    """The diffusers processors' step cache on the native kernels with the shipped table: a Q16K16
    mask's first call runs a natural plan, the calls after it the table's ``/reused`` plan (grouped),
    re-prepared once; every output equal to the oracle (the output of the grouped plan included)."""
    from tessera_diffusers import ops
    from tessera_diffusers.processors.backends import TesseraBackend
    from tessera_diffusers.testing import random_mask

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    try:
        ops.load_library()
    except Exception as err:  # noqa: BLE001 - any load failure skips
        pytest.skip(f"native library not loadable: {err}")
    device = torch.device("cuda")
    mask = random_mask(1, 4, 4096, 4096, 16, 16, density=0.1, seed=5, device=device)
    q, k, v = random_qkv(1, 4096, 4096, 4, 128, torch.bfloat16, device, seed=5)
    backend = TesseraBackend(Runtime())
    plans = step_cache_plans(backend, mask, q, k, v)
    assert plans[0].q_layout is QLayout.NATURAL
    assert plans[1] == plans[2] and plans[1].q_layout is QLayout.GROUPED
    assert backend.runtime.regroupings == 1


def test_explain_cli_names_the_plan_of_a_mask_that_comes_back(capsys):
    """``tessera explain`` ends with the plan a reused mask gets, and where it comes from: the shipped
    table's ``/reused`` key on Q16K16 (a grouped plan) and on Q64K64, the rule on Q128K128 (no such
    key)."""
    from tessera_diffusers import cli

    assert cli.main(["explain", "--geometry", "Q16K16", "--seq", "4096", "--heads", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("a mask that comes back: grouped-") and "Q16K16/d128/bf16/bshd/reused key" in last
    assert cli.main(["explain", "--geometry", "Q64K64", "--seq", "4096", "--heads", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("(the table's sm90/Q64K64/d128/bf16/bshd/reused key)")
    assert cli.main(["explain", "--geometry", "Q128K128", "--seq", "4096", "--heads", "2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("(the rule)")


def test_processors_backend_regroups_a_reused_mask(monkeypatch):
    """The diffusers processors' backend keeps plans in its Runtime: a reused mask's plan is
    re-prepared once, the step cache counts its bytes, outputs equal to the oracle."""
    from tessera_diffusers.processors.backends import TesseraBackend

    monkeypatch.setenv(GROUP_QUERIES_ENV, "1")
    q, k, v = random_qkv(1, 400, 400, 2, 32, torch.float32, "cpu", seed=10)

    class ForcedRuntime(Runtime):
        def plan_request(self, state, request, forced):
            return prepare(forced or NATURAL, state)

    backend = TesseraBackend(ForcedRuntime())
    plans = step_cache_plans(backend, cpu_mask(10), q, k, v)
    assert [p.q_layout for p in plans] == [QLayout.NATURAL, QLayout.GROUPED, QLayout.GROUPED]
    assert backend.runtime.regroupings == 1
