"""The online path's knobs, in one place.

Each knob is set by an environment variable (all optional; the defaults are what the benchmarks
measure). ``current()`` (every knob) and ``get(field)`` (one) read them at each use, so a change
takes effect at the next call; a value a knob does not know is refused where it is used, with the
variable's name.

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


def parse_group_queries(value: str | None) -> bool | None:
    return {"0": False, "1": True}.get(value or "")  # anything else: the table (or the rule) decides


# field -> (its variable, the field's value from the variable's; unset and empty alike)
FIELDS = {
    "plan_table": (PLAN_TABLE_ENV, lambda value: value or None),
    "native_lib": (NATIVE_LIB_ENV, lambda value: value or None),
    "native_prepare": (NATIVE_PREPARE_ENV, lambda value: value != "0"),
    "group_queries": (GROUP_QUERIES_ENV, parse_group_queries),
    "ulysses_transport": (ULYSSES_TRANSPORT_ENV, lambda value: value or "auto"),
}


def get(field: str) -> str | bool | None:
    """One knob as the environment sets it now, reading its variable only (the readers on a
    request's path call this: one environment lookup, not five)."""
    variable, parse = FIELDS[field]
    return parse(os.environ.get(variable))


def current() -> Config:
    """Every knob as the environment sets it now."""
    return Config(**{field: get(field) for field in FIELDS})
