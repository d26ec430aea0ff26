"""processors/compat.py, the one place the processors reach diffusers' private API, against the
installed diffusers; and (slow) the processor tests under the oldest supported release."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tessera_diffusers.errors import TesseraError
from tessera_diffusers.processors import TesseraProcessor, compat
from tessera_diffusers.processors.tiny import tiny_wan_transformer

ROOT = Path(__file__).resolve().parents[2]


def declared_lower_bound() -> str:
    match = re.search(r'"diffusers\s*>=\s*([0-9][0-9A-Za-z.]*)', (ROOT / "pyproject.toml").read_text())
    assert match is not None, "pyproject.toml: expected a dependency 'diffusers>=X'"
    return match.group(1)


@pytest.mark.parametrize("name", compat.__all__)
def test_every_name_compat_exports_resolves(name):
    assert getattr(compat, name) is not None


def test_the_declared_lower_bound_is_compats():
    assert declared_lower_bound() == compat.MIN_DIFFUSERS
    assert "<" not in re.search(r'"diffusers[^"]*"', (ROOT / "pyproject.toml").read_text()).group(0)


def test_a_diffusers_without_hunyuan_video15_is_refused_with_the_release_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers.models.transformers.transformer_hunyuan_video15", None)
    spec = importlib.util.spec_from_file_location("compat_without_hv15", compat.__file__)
    with pytest.raises(ImportError, match=f"expected diffusers >= {compat.MIN_DIFFUSERS}") as raised:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))  # a fresh copy of compat.py
    assert isinstance(raised.value, TesseraError) and type(raised.value).__name__ == "DiffusersVersionError"


def test_the_cache_context_reaches_a_hook_as_name_and_step():
    model = tiny_wan_transformer(num_layers=1)
    manager = compat.StateManager(compat.BaseState)
    hook = compat.ModelHook()
    hook._is_stateful = True
    hook.state_manager = manager
    compat.HookRegistry.check_if_exists_or_initialize(model.blocks[0]).register_hook(hook, "compat_probe")
    compat.invalidate_child_registries(compat.HookRegistry.check_if_exists_or_initialize(model))
    assert compat.cache_context_of(manager) is None
    with model.cache_context("cond"):
        context = compat.cache_context_of(manager)
        assert context.name == "cond" and context.step_index is None
    assert compat.cache_context_of(manager) is None


def test_a_hook_registered_after_a_cache_context_is_reached_once_invalidated():
    model = tiny_wan_transformer(num_layers=1)
    registry = compat.HookRegistry.check_if_exists_or_initialize(model)
    with model.cache_context("cond"):  # releases that cache the child registries build the cache here
        pass
    processor = TesseraProcessor()
    model.set_attn_processor(processor)
    compat.invalidate_child_registries(registry)
    assert compat.cached_child_registries(registry) is None
    with model.cache_context("uncond"):
        assert processor.hook.context().name == "uncond"
    cached = compat.cached_child_registries(registry)
    assert cached is None or any(child is compat.hook_registry_of(processor) for child in cached)


def test_registry_and_stock_processor_lookups():
    model = tiny_wan_transformer(num_layers=1)
    registry = compat.HookRegistry.check_if_exists_or_initialize(model)
    assert compat.hook_registry_of(model) is registry
    assert compat.registry_module(registry) is model
    assert compat.default_processor_cls(model.blocks[0].attn1) is compat.WanAttnProcessor
    assert compat.parallel_config_of(model) is None
    stock = compat.WanAttnProcessor()
    compat.hand_attention_backend(stock, "native")
    assert stock._attention_backend == "native"
    assert isinstance(model, compat.VIDEO_TRANSFORMERS)


def test_wan_projections_match_the_modules():
    model = tiny_wan_transformer(num_layers=1)
    attn = model.blocks[0].attn1
    x = torch.randn(1, 5, attn.to_q.in_features)  # [B, S, C]
    q, k, v = compat.wan_qkv_projections(attn, x, None)
    for got, proj in ((q, attn.to_q), (k, attn.to_k), (v, attn.to_v)):
        torch.testing.assert_close(got, proj(x))


def pypi_reachable(version: str) -> str | None:
    """None when ``pip download diffusers==version`` works within a short timeout, else why not."""
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--timeout", "10", "-d", folder]
        try:
            proc = subprocess.run(
                [*cmd, f"diffusers=={version}"], capture_output=True, text=True, timeout=90, check=False
            )
        except subprocess.TimeoutExpired:
            return "pip download timed out"
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["pip download failed"])[-1]


@pytest.mark.slow
def test_the_processor_tests_pass_under_the_oldest_supported_diffusers():
    # About 3-4 minutes on 2 cores: a venv, diffusers and its unmet requirements, the processor tests.
    oldest = declared_lower_bound()
    why_not = pypi_reachable(oldest)
    if why_not is not None:
        pytest.skip(f"PyPI unreachable, cannot install diffusers=={oldest}: {why_not}")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "integration" / "diffusers_versions.py"), oldest],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )
    print(proc.stdout, f"({time.perf_counter() - start:.0f}s)")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"diffusers {oldest}: ok" in proc.stdout
