"""The online path's knobs, in one place.

Each knob is set by an environment variable (all optional; the defaults are what the benchmarks
measure). ``current()`` reads them at each use, so a change takes effect at the next call; a value a
knob does not know is refused where it is used, with the variable's name.

| field | variable | default | effect |
|---|---|---|---|
| ``plan_table`` | ``TESSERA_PLAN_TABLE`` | the shipped table | a plan table file to use instead (of its architecture) |
| ``native_lib`` | ``TESSERA_NATIVE_LIB`` | the package's library | a kernel library to load instead: its ABI version and kernel names are checked, but loading runs its code |
| ``native_prepare`` | ``TESSERA_NATIVE_PREPARE`` | on | ``0``: launch metadata, mask statistics and query grouping from the torch code (the same bits) |
| ``group_queries`` | ``TESSERA_GROUP_QUERIES`` | the table decides | ``0``: never regroup the query blocks of a mask that comes back; ``1``: regroup every plan that can |
| ``ulysses_transport`` | ``TESSERA_ULYSSES_TRANSPORT`` | ``auto`` | how several GPUs exchange heads: ``copy_engine``, ``nccl`` or ``auto`` |

The build reads its own variables (``TESSERA_CUDA_ARCHS``, ``TESSERA_NVCC_FLAGS``, ``MAX_JOBS``;
``docs/development.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

PLAN_TABLE_ENV = "TESSERA_PLAN_TABLE"
NATIVE_LIB_ENV = "TESSERA_NATIVE_LIB"
NATIVE_PREPARE_ENV = "TESSERA_NATIVE_PREPARE"
GROUP_QUERIES_ENV = "TESSERA_GROUP_QUERIES"
ULYSSES_TRANSPORT_ENV = "TESSERA_ULYSSES_TRANSPORT"
VARIABLES = (PLAN_TABLE_ENV, NATIVE_LIB_ENV, NATIVE_PREPARE_ENV, GROUP_QUERIES_ENV, ULYSSES_TRANSPORT_ENV)


@dataclass(frozen=True)
class Config:
    """The knobs' values (the module docstring says what each does)."""

    plan_table: str | None = None
    native_lib: str | None = None
    native_prepare: bool = True
    group_queries: bool | None = None  # None: the plan table (or the rule) decides
    ulysses_transport: str = "auto"


def current() -> Config:
    """The knobs as the environment sets them now."""
    return from_environment(tuple(os.environ.get(name) for name in VARIABLES))


@lru_cache(maxsize=32)
def from_environment(values: tuple[str | None, ...]) -> Config:
    """The ``Config`` of the variables' values, in the order of ``VARIABLES`` (unset: None). An
    empty value counts as unset; ``TESSERA_GROUP_QUERIES`` other than ``0`` or ``1`` leaves the
    decision to the table."""
    table, lib, prepare, group, transport = (value or None for value in values)
    return Config(
        plan_table=table,
        native_lib=lib,
        native_prepare=prepare != "0",
        group_queries={"0": False, "1": True}.get(group or ""),
        ulysses_transport=transport or "auto",
    )
