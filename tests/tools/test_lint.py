"""The code lints clean under the ruff the test extras pin (``pyproject.toml``): the package, the
processors, the tests, the benchmarks, the examples and the native build script."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINTED = ("tessera_diffusers", "processors", "tests", "benchmarks", "examples", "csrc/build_native.py")


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e \".[test]\" installs it)")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED], check=False, cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
