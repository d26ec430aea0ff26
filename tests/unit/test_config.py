"""The online knobs: one Config, set by the environment, read at each use."""

from __future__ import annotations

import pytest

from tessera_diffusers import config
from tessera_diffusers.library import library_path, native_path_enabled
from tessera_diffusers.selector import reused_mask_plan


@pytest.fixture
def clean_env(monkeypatch):
    for name in config.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_defaults_are_what_the_benchmarks_measure(clean_env):
    assert config.current() == config.Config(plan_table=None, native_lib=None, native_prepare=True,
                                             group_queries=None, ulysses_transport="auto")


@pytest.mark.parametrize(
    "variable, value, field, expected",
    [
        ("TESSERA_PLAN_TABLE", "/tmp/t.json", "plan_table", "/tmp/t.json"),
        ("TESSERA_NATIVE_LIB", "/tmp/lib.so", "native_lib", "/tmp/lib.so"),
        ("TESSERA_NATIVE_PREPARE", "0", "native_prepare", False),
        ("TESSERA_NATIVE_PREPARE", "1", "native_prepare", True),
        ("TESSERA_GROUP_QUERIES", "0", "group_queries", False),
        ("TESSERA_GROUP_QUERIES", "1", "group_queries", True),
        ("TESSERA_GROUP_QUERIES", "yes", "group_queries", None),
        ("TESSERA_ULYSSES_TRANSPORT", "nccl", "ulysses_transport", "nccl"),
        ("TESSERA_PLAN_TABLE", "", "plan_table", None),
    ],
)
def test_each_variable_sets_its_field(clean_env, variable, value, field, expected):
    clean_env.setenv(variable, value)
    assert getattr(config.current(), field) == expected == config.get(field)
    others = {f: v for f, v in vars(config.Config()).items() if f != field}
    assert {f: v for f, v in vars(config.current()).items() if f != field} == others


def test_a_change_takes_effect_at_the_next_use(clean_env):
    """The readers go through ``config.get``: the library path, the native-preparation switch
    and the grouping rule follow the environment from one call to the next."""
    import torch

    from tessera_diffusers.catalog import hopper_kernels, plans_for
    from tessera_diffusers.plans import Request

    clean_env.setenv("TESSERA_NATIVE_LIB", "/nowhere/libtessera_kernels.so")
    assert library_path() == "/nowhere/libtessera_kernels.so"
    clean_env.delenv("TESSERA_NATIVE_LIB")
    assert library_path().endswith("libtessera_kernels.so") and "/nowhere/" not in library_path()
    assert not native_path_enabled(torch.device("cpu"))
    request = Request(1, 2, 4096, 4096, 128, "bf16", 16, 16, "sm90")
    plan = next(p for p in plans_for(16, 16, hopper_kernels()) if p.can_group_queries)
    assert reused_mask_plan(plan, request).q_layout.value == "grouped"
    clean_env.setenv("TESSERA_GROUP_QUERIES", "0")
    assert reused_mask_plan(plan, request) == plan
