"""Shared fixtures and the `gpu` marker: GPU tests run only with CUDA and the native library."""

from __future__ import annotations

import pytest
import torch


def native_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from tessera_diffusers import library

    return library.native_available()


def pytest_collection_modifyitems(config, items):
    if native_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and the native kernel library")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
