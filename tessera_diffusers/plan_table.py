"""The plan table: a versioned, per-architecture artifact that maps a request to a ranked plan list.

Built offline by ``tessera profile`` (``profile/compile.py``) from measured latencies ``L[case, plan]``
and shipped as package data (``data/plan_table_<arch>.json``). Lookup has three stages:

    request key   ``Request.key``: arch / geometry / head dim / dtype / layout   (exact match)
    bucket        (batch x heads, longer sequence length) cut at the schema's edges  (exact match)
    regime        a decision tree over mask statistics (``Stat``), plain thresholds  (one leaf)

Each leaf (a *performance regime*) holds plans ranked by geometric-mean latency over its profiled
cases, ending with the key's *base plan* (valid on every profiled case of the key). A bucket the
profiler never saw gives the base plan alone; a key it never saw gives nothing (the selector then
ranks with the cost model).

File format (JSON, no pickles)::

    {"format": "tessera-plan-table", "schema_version": 2, "sha256": <hex of the canonical body>,
     "table": {
       "arch": "sm90",
       "catalog": {"hash": <catalog.catalog_hash>, "kernels": [<KernelSpec dict>, ...]},
       "features": {"stats": ["density", ...], "buckets": {"batch_heads": [8, ...], "seq_len": [4096, ...]}},
       "plans": {<plan name>: <PhysicalPlan dict>, ...},
       "keys": {<request key>: {"base_plan": <name or null>, "cases": n,
                 "buckets": {"<i>,<j>": {"cases": n, "depth": d,
                     "tree": [{"stat": "density", "le": 0.07, "left": 1, "right": 2}, {"regime": 0}, ...],
                     "regimes": [{"rule": "density <= 0.07", "cases": n, "ranking": [[<plan>, <gm ms>], ...],
                                  "fit_regret": 1.004, "contenders": [<plan>, ...],
                                  "choice": "ranking" | "cost_model" | "calibrated" | "plan_rule",
                                  "plan_rule": <rule>, "calibration": [[<plan>, <scale>], ...],
                                  "schedules": [{"stat": "density", "le": 0.075, "below": <plan>,
                                                 "above": <plan>, "cases": [n_below, n_above]}]}]}}}},
       "provenance": {"built_at": ..., "cases": n, "records": [...],
                      "kernel_sources": [<the profiled libraries' manifest hashes>],
                      "grouping_sources": [<their grouping kernels'>], ...}}}

``provenance.kernel_sources`` lets the selector tell a table profiled on other kernel code than the
loaded library's (``sources_mismatch``): warned, still used.
``provenance.grouping_sources`` does the same for the grouping kernel, which only grouped plans run:
its hashes come from the records of the cases that timed grouped plans (the ``/reused`` keys).

A regime's *schedule rules* (possibly none) choose the task organization of one tile group — plans that
share geometry, KV layout and kernel tile (``tile_group``) and differ only in traversal, split-K,
persistence or pipeline depth — by one statistic: the chosen plan of that group becomes ``below`` when the mask's statistic is ``<= le``,
else ``above``. The compiler keeps a rule only where cross-validation says it beats one variant.
A regime's ``choice`` says how it picks the plan those rules start from: its ranking's first eligible
plan, the cost model's pick among its ``contenders``, the *calibrated* cost model's pick (each plan of
``calibration`` with its estimate times the plan's scale, the geometric mean of measured over estimated
latency on the regime's profiled cases), or its ``plan_rule`` — a rule of the same form between any
two plans (another tile too). The compiler chooses it by cross-validation. Every field above is
required; a table of another schema version is refused (compile it again from its records).

A tree node with ``"stat"`` sends a mask whose statistic is ``<= le`` to ``left``, else to ``right``;
node 0 is the root and children always come after their parent. The loader checks all of it (and the
checksum) and raises ``PlanTableError`` with what is wrong; it never guesses. Whatever a file holds
(other bytes than UTF-8, deep nesting, numbers out of range, a field of another type, more than
``MAX_TABLE_BYTES``, refused unread), loading it ends in a table or a ``PlanTableError``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from importlib import resources
from pathlib import Path
from stat import S_ISREG
from types import MappingProxyType
from typing import Any, BinaryIO

from . import config
from .catalog import catalog_hash
from .errors import PlanTableError
from .mask_state import Stat
from .plans import Family, KernelSpec, KvLayout, PhysicalPlan, QLayout, Request, TaskOrganization, Traversal

FORMAT = "tessera-plan-table"
SCHEMA_VERSION = 2
CONTENDER_REGRET = 1.03  # a plan within this of the best on one of a regime's cases contends there
CHOICES = ("ranking", "cost_model", "calibrated", "plan_rule")  # how a regime picks its plan (Regime.choice)
# Environment variable naming a table file to use instead of the shipped one of its architecture.
TABLE_ENV = config.PLAN_TABLE_ENV
STAT_NAMES: tuple[str, ...] = tuple(s.name.lower() for s in Stat)


# -- feature schema ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Buckets:
    """Request-dimension buckets: inclusive upper bounds of every bucket but the last, per dim.

    ``batch_heads`` buckets ``batch * heads``; ``seq_len`` buckets ``max(seq_len_q, seq_len_kv)``."""

    batch_heads: tuple[int, ...] = (8, 16, 32, 64)
    seq_len: tuple[int, ...] = (4096, 16384, 40960, 81920)

    def of(self, request: Request) -> tuple[int, int]:
        """Bucket indices ``(i_batch_heads, i_seq_len)`` of ``request``."""
        return (bisect_left(self.batch_heads, request.batch * request.heads),
                bisect_left(self.seq_len, max(request.seq_len_q, request.seq_len_kv)))

    def label(self, bucket: tuple[int, int]) -> str:
        """``"bh17-32/s16385-40960"`` for humans (explain, reports)."""
        return f"bh{span(self.batch_heads, bucket[0])}/s{span(self.seq_len, bucket[1])}"

    def to_dict(self) -> dict:
        return {"batch_heads": list(self.batch_heads), "seq_len": list(self.seq_len)}


def span(edges: tuple[int, ...], index: int) -> str:
    lo = 1 if index == 0 else edges[index - 1] + 1
    return f"{lo}+" if index >= len(edges) else f"{lo}-{edges[index]}"


@dataclass(frozen=True)
class FeatureSchema:
    """What a table's lookups read: the bucket edges and the mask statistics its trees may test."""

    stats: tuple[str, ...] = STAT_NAMES
    buckets: Buckets = Buckets()

    def to_dict(self) -> dict:
        return {"stats": list(self.stats), "buckets": self.buckets.to_dict()}


# -- trees and regimes ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TreeNode:
    """A split (``stat >= 0``: go ``left`` when ``stats[stat] <= threshold``) or a leaf (``regime``)."""

    stat: int = -1  # index into the Stat vector; -1 for a leaf
    threshold: float = 0.0
    left: int = -1
    right: int = -1
    regime: int = -1


@dataclass(frozen=True)
class RegimeTree:
    """Second-stage boundaries of one bucket, as plain thresholds; ``nodes[0]`` is the root."""

    nodes: tuple[TreeNode, ...]

    @property
    def stats_used(self) -> tuple[int, ...]:
        """Stat indices the tree tests (empty for a single regime: no statistic needed)."""
        return tuple(sorted({n.stat for n in self.nodes if n.stat >= 0}))

    def regime_of(self, stats: Sequence[float]) -> int:
        """Regime index of a mask with statistics ``stats`` (indexed by ``Stat``)."""
        node = self.nodes[0]
        while node.stat >= 0:
            node = self.nodes[node.left if stats[node.stat] <= node.threshold else node.right]
        return node.regime


@dataclass(frozen=True)
class RankedPlan:
    plan: str
    gm_ms: float | None  # geometric-mean kernel latency over the regime's profiled cases


def tile_group(plan: PhysicalPlan) -> tuple:
    """What plans that differ only in their task organization share: the logical geometry, the KV
    and query layouts and the kernel's tile (family, arch, dtype, head dim, tile shape, warps). The task
    organization is DESIGN section 4's: grouping and traversal, split-K, a persistent grid, and the
    pipeline depth (the kernel's stages), so 2- and 3-stage builds of one tile are one group."""
    k = plan.kernel
    return (plan.block_q, plan.block_kv, plan.kv_layout, plan.q_layout, k.family, k.arch, k.dtype, k.head_dim,
            k.tile_q, k.tile_kv, k.warps)


@dataclass(frozen=True)
class ScheduleRule:
    """The task organization of one tile group in one regime, by one mask statistic: ``below``
    when ``stats[stat] <= threshold``, else ``above`` (two plans of the same ``tile_group``)."""

    stat: int  # index into the Stat vector
    threshold: float
    below: str
    above: str
    cases: tuple[int, int]  # profiled cases on each side

    def choose(self, stats: Sequence[float]) -> str:
        return self.below if stats[self.stat] <= self.threshold else self.above

    def describe(self, stats: Sequence[float]) -> str:
        value = stats[self.stat]
        side = "<=" if value <= self.threshold else ">"
        return f"{STAT_NAMES[self.stat]} {value:.4g} {side} {self.threshold:.4g}: {self.choose(stats)}"


@dataclass(frozen=True)
class Regime:
    """A leaf of a bucket's tree: where one ranking of plans holds."""

    key: str
    bucket: str  # bucket label
    index: int
    rule: str  # the path's conditions, e.g. "density <= 0.07 and run_coverage > 0.4"
    cases: int  # profiled cases it was ranked on
    ranking: tuple[RankedPlan, ...]  # best first; the last one is the key's base plan
    # GM regret of the ranking's first plan over the regime's own cases.
    fit_regret: float = 1.0
    contenders: tuple[str, ...] = ()  # the plans within 3% of the best on one of its cases
    schedules: tuple[ScheduleRule, ...] = ()  # task organization of a tile group by a statistic
    # How the regime picks its plan (``CHOICES``), chosen by the compiler's cross-validation:
    # "ranking": the first eligible ranked plan; "cost_model": the cost model's pick among the
    # eligible ``contenders`` on this mask's statistics; "calibrated": the same over the plans of
    # ``calibration``, each estimate times its plan's scale; "plan_rule": ``plan_rule``'s plan (any
    # tile) by one statistic.
    choice: str = "ranking"
    plan_rule: ScheduleRule | None = None
    # (plan, scale) for choice "calibrated": the plan's measured / estimated latency (geometric mean
    # over the regime's profiled cases), what the cost model's estimate is multiplied by.
    calibration: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise PlanTableError(f"regime {self.index} of {self.key}: choice {self.choice!r} is not one of {CHOICES}")
        if (self.choice == "plan_rule") != (self.plan_rule is not None):
            raise PlanTableError(f"regime {self.index} of {self.key}: a plan rule goes with choice 'plan_rule' "
                                 f"and only with it (choice {self.choice!r}, plan rule {self.plan_rule})")
        if (self.choice == "calibrated") != bool(self.calibration):
            raise PlanTableError(f"regime {self.index} of {self.key}: a calibration goes with choice 'calibrated' "
                                 f"and only with it (choice {self.choice!r}, {len(self.calibration)} calibrated plans)")

    @property
    def name(self) -> str:
        return f"{self.key}|{self.bucket}|r{self.index}"


@dataclass(frozen=True)
class BucketTable:
    """One bucket of one key: its tree and regimes."""

    key: str
    bucket: tuple[int, int]
    label: str
    cases: int
    depth: int
    tree: RegimeTree
    regimes: tuple[Regime, ...]


@dataclass(frozen=True)
class KeyTable:
    """All buckets of one request key, and the base plan that ends every ranking."""

    key: str
    base_plan: str | None
    cases: int
    buckets: Mapping[tuple[int, int], BucketTable]


@dataclass(frozen=True)
class Lookup:
    """Where a request landed: a bucket with a tree, the key's base plan only, or nothing."""

    key_table: KeyTable | None
    bucket: BucketTable | None
    note: str  # what happened, for explain ("regime lookup", "bucket bh.. not profiled: base plan", ...)


# -- the table -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanTable:
    """A validated plan table of one architecture (build with ``from_dict`` / ``load_plan_table``)."""

    arch: str
    catalog_hash: str
    kernels: tuple[KernelSpec, ...]
    features: FeatureSchema
    plans: Mapping[str, PhysicalPlan]
    keys: Mapping[str, KeyTable]
    provenance: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def name(self) -> str:
        return f"plan_table_{self.arch}@{self.catalog_hash}"

    def lookup(self, request: Request) -> Lookup:
        """The key table and bucket of ``request`` (no mask statistics needed yet)."""
        key_table = self.keys.get(request.key)
        if key_table is None:
            return Lookup(None, None, f"key {request.key} not profiled")
        bucket = self.features.buckets.of(request)
        table = key_table.buckets.get(bucket)
        if table is None:
            label = self.features.buckets.label(bucket)
            return Lookup(key_table, None, f"bucket {label} not profiled for {request.key}: base plan")
        return Lookup(key_table, table, "regime lookup")

    def catalog_mismatch(self, kernels: tuple[KernelSpec, ...]) -> str | None:
        """Why this table cannot rank plans over ``kernels`` (the loaded catalog), or None. The answer
        for the last tuple object checked is kept: every fresh Selector passes the same one, and
        hashing it hashes each of its kernels."""
        last = self.__dict__.get("_last_catalog_check")
        if last is not None and last[0] is kernels:
            return last[1]
        have = catalog_hash(kernels)
        mismatch = None if have == self.catalog_hash else (
            f"plan table {self.name} was built against catalog {self.catalog_hash} "
            f"({len(self.kernels)} kernels), the loaded catalog is {have} ({len(kernels)} kernels); "
            "re-profile with `tessera profile` or rebuild the matching kernels")
        object.__setattr__(self, "_last_catalog_check", (kernels, mismatch))
        return mismatch

    def sources_mismatch(self, library: str | None, grouping: str | None = None) -> str | None:
        """Why this table's rankings may be stale for the loaded library, or None: the profile ran
        on kernels built from other sources (``provenance["kernel_sources"]``, the libraries'
        ``kernel_sources`` hashes) than ``library`` was, or its grouped plans ran another grouping
        kernel (``provenance["grouping_sources"]``, of the cases that timed grouped plans) than
        ``grouping``. The catalog hash cannot see this (it names tile shapes, not code). Unknown on
        either side (older tables and libraries): no note."""
        notes = [note for note in (self._sources_note("kernel_sources", library, "kernels"),
                                   self._sources_note("grouping_sources", grouping, "the grouped plans' grouping kernel"))
                 if note]
        if not notes:
            return None
        # The hashes cover the kernel sources, nvcc flags and tool versions: a library built from
        # the same sources with another nvcc, other flags or an arch list beyond the default one
        # differs too, and its kernels may time differently; say so rather than suggest the kernels
        # were edited. (A build of some of the default archs hashes as the default build.)
        advice = ("the kernel sources, nvcc flags (TESSERA_NVCC_FLAGS, a TESSERA_CUDA_ARCHS beyond 80;90) or "
                  "nvcc / CUTLASS versions differ; the table is still used, re-profile with `tessera profile` to fit "
                  "it to this library")
        return f"{'; '.join(notes)} ({advice})"

    def _sources_note(self, field: str, library: str | None, what: str) -> str | None:
        """``sources_mismatch``'s note on one provenance field, or None."""
        profiled = self.provenance.get(field)
        if not library or not profiled:
            return None
        profiled = sorted({profiled} if isinstance(profiled, str) else set(profiled))
        if profiled == [library]:
            return None
        if library in profiled:
            others = [h for h in profiled if h != library]
            return (f"part of plan table {self.name} was profiled on {what} built from other sources "
                    f"({', '.join(others)}) than the loaded library's ({library})")
        return (f"plan table {self.name} was profiled on {what} built from sources {', '.join(profiled)}, "
                f"the loaded library's from {library}: its rankings may be stale")

    def to_dict(self) -> dict:
        """The artifact (with format, schema version and checksum), ready for ``json.dump``."""
        body = {
            "arch": self.arch,
            "catalog": {"hash": self.catalog_hash, "kernels": [kernel_to_dict(k) for k in self.kernels]},
            "features": self.features.to_dict(),
            "plans": {name: plan_to_dict(p) for name, p in sorted(self.plans.items())},
            "keys": {key: key_table_to_dict(kt) for key, kt in sorted(self.keys.items())},
            "provenance": dict(self.provenance),
        }
        return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "sha256": body_digest(body), "table": body}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan table") -> PlanTable:
        """Validate and build a table from its artifact dict. Raises ``PlanTableError``."""
        return parse_table(data, source)


def body_digest(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# -- typed reads of the parsed JSON --------------------------------------------------------------
# JSON may hold any type anywhere. Each value is checked where it is read, so a malformed file fails
# with the field's path, what it holds and what was expected, never with a TypeError from the parser.

Fail = Callable[[str], Exception]  # what went wrong -> the exception to raise (it adds the file)
MISSING: Any = object()  # no default: the field is required


def shown(value: Any) -> str:
    """A JSON value as an error message names it: ``null``, ``a list``, ``-3 (an int)``, ``inf (a string)``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a bool)"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value == "":
        return "an empty string"
    kind = {str: "a string", int: "an int", float: "a number"}.get(type(value), type(value).__name__)
    text = str(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


def quoted(value: Any) -> str:
    """A scalar as Python writes it (``'direct'``, ``True``), a container by its kind (``a list``)."""
    return shown(value) if isinstance(value, (dict, list)) else repr(value)


def finite_number(value: Any) -> float | None:
    """``value`` as a float if it is a finite JSON number (an int or a float, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return number if math.isfinite(number) else None


def wrong(path: str, value: Any, expected: str, fail: Fail) -> Exception:
    return fail(f"{path} is {shown(value)}, expected {expected}")


def is_count(value: Any, minimum: int) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


class Fields:
    """One JSON object of a table file, read field by field with each type checked. ``path`` names
    the object in messages (``table.keys.<key>.buckets.2,2.regimes[0]``); ``fail`` adds the file.
    Paths are spelled out only when a check fails: a valid table loads at the speed of plain reads."""

    def __init__(self, data: Any, path: str, fail: Fail):
        if not isinstance(data, dict):
            raise wrong(path, data, "an object", fail)
        self.data: dict = data
        self.path = path
        self.fail = fail

    def where(self, key: str) -> str:
        return f"{self.path}.{key}"

    def get(self, key: str, default: Any = MISSING) -> Any:
        """The raw value of ``key``; a missing required field fails."""
        if key in self.data:
            return self.data[key]
        if default is MISSING:
            raise self.fail(f"{self.where(key)} is missing")
        return default

    def fields(self, key: str, default: Any = MISSING) -> Fields:
        return Fields(self.get(key, default), self.where(key), self.fail)

    def members(self, key: str) -> list[tuple[str, Any]]:
        """The ``(name, value)`` members of the object at ``key``."""
        return list(self.fields(key).data.items())

    def array(self, key: str, default: Any = MISSING) -> list:
        value = self.get(key, default)
        if not isinstance(value, list):
            raise wrong(self.where(key), value, "a list", self.fail)
        return value

    def records(self, key: str, default: Any = MISSING) -> list[Fields]:
        """The list of objects at ``key``."""
        path = self.where(key)
        return [Fields(item, f"{path}[{i}]", self.fail) for i, item in enumerate(self.array(key, default))]

    def text(self, key: str, default: Any = MISSING) -> Any:
        """A string; with a default, also the default where the field is missing (or null)."""
        value = self.get(key, default)
        if isinstance(value, str) or (default is not MISSING and value == default):
            return value
        raise wrong(self.where(key), value, "a string", self.fail)

    def texts(self, key: str, default: Any = MISSING) -> tuple[str, ...]:
        values = self.array(key, default)
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise wrong(f"{self.where(key)}[{i}]", value, "a string", self.fail)
        return tuple(values)

    def count(self, key: str, minimum: int = 0) -> int:
        value = self.get(key)
        if not is_count(value, minimum):
            raise wrong(self.where(key), value, f"an int >= {minimum}", self.fail)
        return value

    def counts(self, key: str, minimum: int = 0) -> tuple[int, ...]:
        values = self.array(key)
        for i, value in enumerate(values):
            if not is_count(value, minimum):
                raise wrong(f"{self.where(key)}[{i}]", value, f"an int >= {minimum}", self.fail)
        return tuple(values)

    def flag(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise wrong(self.where(key), value, "true or false", self.fail)
        return value

    def member(self, key: str, kind: type[Enum], default: Any = MISSING) -> Any:
        """A member of the string enum ``kind``, by value."""
        value = self.get(key, default)
        if isinstance(value, kind):  # the default
            return value
        if isinstance(value, str):
            try:
                return kind(value)
            except ValueError:
                pass
        raise wrong(self.where(key), value, f"one of {[m.value for m in kind]}", self.fail)


# -- serialization of plans ----------------------------------------------------------------------

def kernel_to_dict(k: KernelSpec) -> dict:
    return {"family": k.family.value, "tile_q": k.tile_q, "tile_kv": k.tile_kv, "head_dim": k.head_dim,
            "dtype": k.dtype, "stages": k.stages, "arch": k.arch, "warps": k.warps}


def kernel_from_dict(d: Any, path: str = "kernel", fail: Fail = PlanTableError) -> KernelSpec:
    """The inverse of ``kernel_to_dict``; a malformed record raises ``fail`` naming the field (``path``
    says where the record sits in its file)."""
    f = Fields(d, path, fail)
    return KernelSpec(f.member("family", Family), f.count("tile_q", 1), f.count("tile_kv", 1), f.count("head_dim", 1),
                      f.text("dtype"), f.count("stages", 1), f.text("arch"), f.count("warps", 1))


def plan_to_dict(p: PhysicalPlan) -> dict:
    """A plan as plain values (the inverse of ``plan_from_dict``; names are derived, never stored).
    ``q_layout`` is written for the grouped layout only, so natural plans read as they always did."""
    out = {"block_q": p.block_q, "block_kv": p.block_kv, "kv_layout": p.kv_layout.value,
           "traversal": p.tasks.traversal.value, "num_splits": p.tasks.num_splits,
           "persistent": p.tasks.persistent, "kernel": kernel_to_dict(p.kernel)}
    if p.q_layout is not QLayout.NATURAL:
        out["q_layout"] = p.q_layout.value
    return out


def plan_from_dict(d: Any, path: str = "plan", fail: Fail = PlanTableError) -> PhysicalPlan:
    """The inverse of ``plan_to_dict``; a malformed record raises ``fail`` naming the field."""
    f = Fields(d, path, fail)
    tasks = TaskOrganization(f.member("traversal", Traversal), f.count("num_splits", 1), f.flag("persistent"))
    return PhysicalPlan(f.count("block_q", 1), f.count("block_kv", 1), f.member("kv_layout", KvLayout), tasks,
                        kernel_from_dict(f.get("kernel"), f.where("kernel"), fail),
                        f.member("q_layout", QLayout, QLayout.NATURAL))


def key_table_to_dict(kt: KeyTable) -> dict:
    return {
        "base_plan": kt.base_plan,
        "cases": kt.cases,
        "buckets": {f"{b[0]},{b[1]}": bucket_to_dict(bt) for b, bt in sorted(kt.buckets.items())},
    }


def rule_to_dict(rule: ScheduleRule) -> dict:
    return {"stat": STAT_NAMES[rule.stat], "le": rule.threshold, "below": rule.below, "above": rule.above,
            "cases": list(rule.cases)}


def bucket_to_dict(bt: BucketTable) -> dict:
    nodes = []
    for n in bt.tree.nodes:
        if n.stat >= 0:
            nodes.append({"stat": STAT_NAMES[n.stat], "le": n.threshold, "left": n.left, "right": n.right})
        else:
            nodes.append({"regime": n.regime})
    regimes = []
    for r in bt.regimes:
        regime = {"rule": r.rule, "cases": r.cases, "ranking": [[rp.plan, rp.gm_ms] for rp in r.ranking],
                  "fit_regret": r.fit_regret, "contenders": list(r.contenders)}
        regime["schedules"] = [rule_to_dict(x) for x in r.schedules]
        regime["choice"] = r.choice
        if r.plan_rule is not None:
            regime["plan_rule"] = rule_to_dict(r.plan_rule)
        if r.calibration:
            regime["calibration"] = [[name, scale] for name, scale in r.calibration]
        regimes.append(regime)
    return {"cases": bt.cases, "depth": bt.depth, "tree": nodes, "regimes": regimes}


# -- validation ----------------------------------------------------------------------------------

# What building a table may still raise on input that no check below foresaw: reported as a
# malformed table, naming the file, rather than escaping to an attention call.
# ValueError covers UnicodeDecodeError; ArithmeticError covers OverflowError and ZeroDivisionError.
PARSE_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError)


def parse_table(data: Any, source: str) -> PlanTable:
    """Everything ``PlanTable.from_dict`` checks, with messages that say where and what."""

    def fail(what: str) -> PlanTableError:
        return PlanTableError(f"{source}: {what}")

    try:
        return check_and_build(data, fail)
    except PlanTableError:
        raise
    except PARSE_ERRORS as err:
        raise fail(f"malformed table ({type(err).__name__}: {err})") from err


def check_and_build(data: Any, fail: Fail) -> PlanTable:
    """The envelope (format, schema version, checksum), then the body."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise fail(f"not a Tessera plan table (expected \"format\": \"{FORMAT}\")")
    version = data.get("schema_version")
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise fail(f"schema version {shown(version)}, this Tessera reads version {SCHEMA_VERSION}; "
                   "re-run `tessera profile`")
    body = data.get("table")
    if not isinstance(body, dict):
        raise fail("no \"table\" object")
    try:
        digest = body_digest(body)
    except (TypeError, ValueError, RecursionError) as err:
        raise fail(f"table body is not canonical JSON ({type(err).__name__}: {err})") from err
    if digest != data.get("sha256"):
        raise fail("checksum mismatch: the file was edited or corrupted after it was built")
    return build_table(Fields(body, "table", fail), fail)


def build_table(body: Fields, fail: Fail) -> PlanTable:
    arch = body.text("arch")
    catalog = body.fields("catalog")
    kernels = tuple(kernel_from_dict(k, f"{catalog.where('kernels')}[{i}]", fail)
                    for i, k in enumerate(catalog.array("kernels")))
    built_against = catalog.text("hash")
    if catalog_hash(kernels) != built_against:
        raise fail(f"catalog hash {built_against} does not match its own kernel list")
    kernel_names = {k.name for k in kernels}

    feats = body.fields("features")
    stats = feats.texts("stats")
    unknown = [s for s in stats if s not in STAT_NAMES]
    if unknown:
        raise fail(f"feature schema names statistics this Tessera does not compute: {unknown} (known: {STAT_NAMES})")
    edges = feats.fields("buckets")
    buckets = Buckets(edges.counts("batch_heads", 1), edges.counts("seq_len", 1))
    for dim, values in (("batch_heads", buckets.batch_heads), ("seq_len", buckets.seq_len)):
        if list(values) != sorted(set(values)):
            raise fail(f"bucket edges {dim} = {list(values)} are not strictly increasing positive ints")
    schema = FeatureSchema(stats, buckets)

    plans: dict[str, PhysicalPlan] = {}
    for name, spec in body.members("plans"):
        plan = plan_from_dict(spec, body.where(f"plans.{name}"), fail)
        if plan.name != name:
            raise fail(f"plan {name!r} describes {plan.name!r} (plan naming changed: re-run `tessera profile`)")
        if plan.kernel.family is not Family.REFERENCE and plan.kernel.name not in kernel_names:
            raise fail(f"plan {name} uses kernel {plan.kernel.name}, which is not in the table's catalog")
        plans[name] = plan

    allowed_stats = {STAT_NAMES.index(s) for s in stats}
    keys: dict[str, KeyTable] = {}
    for key, raw in body.members("keys"):
        if not key.startswith(f"{arch}/"):
            raise fail(f"key {key!r} is not a key of architecture {arch}")
        kd = Fields(raw, body.where(f"keys.{key}"), fail)
        base = kd.get("base_plan")
        if base is not None and not isinstance(base, str):
            raise wrong(kd.where("base_plan"), base, "a plan name or null", fail)
        if base is not None and base not in plans:
            raise fail(f"{key}: base plan {base!r} is not in the table's plans")
        bucket_tables = {}
        for bucket_text, bd in kd.members("buckets"):
            bucket = bucket_of_text(bucket_text)
            if bucket is None or bucket[0] > len(buckets.batch_heads) or bucket[1] > len(buckets.seq_len):
                raise fail(f"{key}: bucket {bucket_text!r} is outside the schema's buckets")
            label = buckets.label(bucket)
            fields = Fields(bd, kd.where(f"buckets.{bucket_text}"), fail)
            bucket_tables[bucket] = build_bucket(key, bucket, label, fields, plans, base, allowed_stats,
                                                 lambda what, k=key, b=label: fail(f"{k} {b}: {what}"))
        keys[key] = KeyTable(key, base, kd.count("cases"), MappingProxyType(bucket_tables))
    provenance = body.fields("provenance", {})
    for sources in ("kernel_sources", "grouping_sources"):  # what PlanTable.sources_mismatch compares
        value = provenance.get(sources, None)
        if not (value is None or isinstance(value, str)
                or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
            raise fail(f"{provenance.where(sources)} is {shown(value)}, expected a hash or a list of hashes")
    return PlanTable(arch, built_against, kernels, schema, MappingProxyType(plans), MappingProxyType(keys),
                     MappingProxyType(dict(provenance.data)))


def bucket_of_text(text: str) -> tuple[int, int] | None:
    """``"2,3"`` -> ``(2, 3)``; None for anything else."""
    parts = text.split(",")  # indices are a digit or two: nine keep int() cheap and out-of-range honest
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def build_bucket(key: str, bucket: tuple[int, int], label: str, bd: Fields, plans: Mapping[str, PhysicalPlan],
                 base: str | None, allowed_stats: set[int], fail: Fail) -> BucketTable:
    regimes = []
    for index, rd in enumerate(bd.records("regimes")):
        ranking = []
        for j, entry in enumerate(rd.array("ranking")):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                raise fail(f"regime {index}: ranking entry {j} is {shown(entry)}, expected a [plan, latency] pair")
            name, gm = entry
            if name not in plans:
                raise fail(f"regime {index} ranks unknown plan {name!r}")
            latency = None if gm is None else finite_number(gm)
            if gm is not None and not (latency is not None and latency > 0):
                raise fail(f"regime {index}: latency {shown(gm)} of {name} is not a positive number")
            ranking.append(RankedPlan(name, latency))
        if not ranking:
            raise fail(f"regime {index} has an empty ranking")
        if base is not None and ranking[-1].plan != base:
            raise fail(f"regime {index} does not end with the key's base plan {base}")
        raw_regret = rd.get("fit_regret")
        fit_regret = finite_number(raw_regret)
        if fit_regret is None or fit_regret < 1.0:
            raise fail(f"regime {index}: fit_regret {shown(raw_regret)} is not a number >= 1")
        contenders = rd.texts("contenders")
        unknown = [c for c in contenders if c not in plans]
        if unknown:
            raise fail(f"regime {index} names unknown contender {unknown[0]!r}")
        schedules = tuple(build_schedule_rule(sd, plans, allowed_stats,
                                              lambda what, i=index, j=j: fail(f"regime {i} schedule rule {j}: {what}"))
                          for j, sd in enumerate(rd.records("schedules")))
        choice = rd.text("choice")
        if choice not in CHOICES:
            raise fail(f"regime {index}: choice {choice!r} is not one of {CHOICES}")
        plan_rule = None
        if "plan_rule" in rd.data:
            plan_rule = build_schedule_rule(rd.fields("plan_rule"), plans, allowed_stats,
                                            lambda what, i=index: fail(f"regime {i} plan rule: {what}"),
                                            same_tile=False)
        if (choice == "plan_rule") != (plan_rule is not None):
            raise fail(f"regime {index}: a plan rule goes with choice 'plan_rule' and only with it (choice {choice!r})")
        calibration = parse_calibration(rd.get("calibration", ()), plans, lambda what, i=index: fail(f"regime {i}: {what}"))
        if (choice == "calibrated") != bool(calibration):
            raise fail(f"regime {index}: a calibration goes with choice 'calibrated' and only with it "
                       f"(choice {choice!r}, {len(calibration)} calibrated plans)")
        regimes.append(Regime(key, label, index, rd.text("rule"), rd.count("cases"), tuple(ranking),
                              fit_regret, contenders, schedules, choice, plan_rule, calibration))
    nodes = []
    for i, nd in enumerate(bd.records("tree")):
        if "regime" in nd.data:
            r = nd.count("regime")
            if r >= len(regimes):
                raise fail(f"tree node {i} points at regime {r}, there are {len(regimes)}")
            nodes.append(TreeNode(regime=r))
        else:
            stat, threshold = stat_threshold(nd, allowed_stats, lambda what, i=i: fail(f"tree node {i} {what}"))
            nodes.append(TreeNode(stat, threshold, nd.count("left"), nd.count("right")))
    check_tree(nodes, len(regimes), fail)
    return BucketTable(key, bucket, label, bd.count("cases"), bd.count("depth"), RegimeTree(tuple(nodes)),
                       tuple(regimes))


def stat_threshold(d: Fields, allowed_stats: set[int], fail: Fail) -> tuple[int, float]:
    """The ``"stat"`` (an index into the Stat vector, one the schema allows) and the finite ``"le"``
    of a tree node or a schedule rule."""
    name = d.text("stat")
    stat = STAT_NAMES.index(name) if name in STAT_NAMES else -1
    if stat not in allowed_stats:
        raise fail(f"tests {name!r}, not in the feature schema")
    le = d.get("le")
    threshold = finite_number(le)
    if threshold is None:
        raise fail(f"has threshold {shown(le)}, expected a finite number")
    return stat, threshold


def build_schedule_rule(sd: Fields, plans: Mapping[str, PhysicalPlan], allowed_stats: set[int],
                        fail: Fail, same_tile: bool = True) -> ScheduleRule:
    """A schedule rule (``same_tile``: its two plans differ only in their task organization) or a
    regime's plan rule (any two plans)."""
    stat, threshold = stat_threshold(sd, allowed_stats, fail)
    below, above = sd.text("below"), sd.text("above")
    for name in (below, above):
        if name not in plans:
            raise fail(f"names unknown plan {name!r}")
    if below == above:
        raise fail(f"chooses {below} on both sides")
    if same_tile and tile_group(plans[below]) != tile_group(plans[above]):
        raise fail(f"{below} and {above} are not one tile group (they differ in more than their task organization)")
    cases = sd.counts("cases")
    if len(cases) != 2 or min(cases) < 1:
        raise fail(f"cases {list(cases)} is not two positive counts")
    return ScheduleRule(stat, threshold, below, above, (cases[0], cases[1]))


def parse_calibration(entries: Any, plans: Mapping[str, PhysicalPlan], fail: Fail) -> tuple[tuple[str, float], ...]:
    """A regime's ``calibration``: ``[[plan, scale], ...]``, known plans, each once, positive finite scales."""
    if not isinstance(entries, (list, tuple)):
        raise fail(f"calibration ({shown(entries)}) is not a list of [plan, scale] pairs")
    calibration: list[tuple[str, float]] = []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise fail(f"calibration entry ({shown(entry)}) is not a [plan, scale] pair")
        name, raw_scale = entry
        if not isinstance(name, str) or name not in plans:
            raise fail(f"calibration names unknown plan {quoted(name)}")
        if any(name == known for known, _ in calibration):
            raise fail(f"calibration names {name} twice")
        scale = finite_number(raw_scale)
        if scale is None or scale <= 0:
            raise fail(f"calibration scale {quoted(raw_scale)} of {name} is not a positive number")
        calibration.append((name, scale))
    return tuple(calibration)


def check_tree(nodes: list[TreeNode], n_regimes: int, fail: Fail) -> None:
    """Root at 0, children after their parent, every node reached once, every regime a leaf once."""
    if not nodes:
        raise fail("empty tree")
    parents = [0] * len(nodes)
    for i, n in enumerate(nodes):
        if n.stat >= 0:
            for child in (n.left, n.right):
                if not i < child < len(nodes):
                    raise fail(f"tree node {i} has child {child} (must come after it, below {len(nodes)})")
                parents[child] += 1
    if any(p != 1 for p in parents[1:]):
        raise fail("tree nodes are shared or unreachable")
    leaves = sorted(n.regime for n in nodes if n.stat < 0)
    if leaves != list(range(n_regimes)):
        raise fail(f"tree leaves {leaves} do not name each of the {n_regimes} regimes once")


# -- loading -------------------------------------------------------------------------------------

# A table file larger than this is refused unread (the shipped tables are about 100 KB).
MAX_TABLE_BYTES = 64 << 20
# Digits of the longest integer a table may hold: keeps JSON parsing linear whatever
# ``sys.set_int_max_str_digits`` allows (a table's ints are counts, sizes and timestamps).
MAX_INT_DIGITS = 64


def load_plan_table(path: str | Path) -> PlanTable:
    """Read and validate a table file. Raises ``PlanTableError`` (with the path) on any problem."""
    path = Path(path)
    text = read_table_text(path)
    try:
        data = json.loads(text, parse_int=json_int, parse_float=json_float, parse_constant=json_constant)
    except RecursionError as err:
        raise PlanTableError(f"{path}: corrupt plan table, JSON nested too deeply") from err
    except json.JSONDecodeError as err:
        raise PlanTableError(f"{path}: corrupt plan table, not JSON ({err})") from err
    except ValueError as err:  # from the number hooks below
        raise PlanTableError(f"{path}: corrupt plan table, {err}") from err
    return PlanTable.from_dict(data, source=str(path))


def read_table_text(path: Path) -> str:
    """The file's text, refused before it is read when it is not a regular file (a FIFO would block)
    or is larger than ``MAX_TABLE_BYTES``."""
    try:
        info = path.stat()
        if not S_ISREG(info.st_mode):
            raise PlanTableError(f"{path}: cannot read plan table (not a regular file)")
        if info.st_size > MAX_TABLE_BYTES:
            raise PlanTableError(f"{path}: plan table of {info.st_size} bytes, larger than MAX_TABLE_BYTES "
                                 f"({MAX_TABLE_BYTES} bytes); not read")
        with path.open("rb") as file:
            raw = read_at_most(file, MAX_TABLE_BYTES + 1)  # stat sizes can lie: /proc, a file that grew
    except OSError as err:
        raise PlanTableError(f"{path}: cannot read plan table ({err})") from err
    if len(raw) > MAX_TABLE_BYTES:
        raise PlanTableError(f"{path}: plan table larger than MAX_TABLE_BYTES ({MAX_TABLE_BYTES} bytes)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PlanTableError(f"{path}: corrupt plan table, not UTF-8 text ({err})") from err


def read_at_most(file: BinaryIO, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``file``, in chunks (one ``read(limit)`` would allocate ``limit`` bytes
    at once, whatever the file holds)."""
    parts: list[bytes] = []
    size = 0
    while size < limit:
        part = file.read(min(1 << 20, limit - size))
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)


# Number hooks of ``json.loads``: a table holds finite numbers and short ints only.

def json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of the float range")
    return value


def json_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


@dataclass(frozen=True)
class TableLoad:
    """Outcome of looking for the table of one architecture: a table, nothing, or why not."""

    table: PlanTable | None
    path: str | None
    error: str | None  # PlanTableError message when a table exists but cannot be used


@cache
def shipped_table_path(arch: str) -> Path:
    return Path(str(resources.files("tessera_diffusers").joinpath("data", f"plan_table_{arch}.json")))


def default_table(arch: str) -> TableLoad:
    """The table for ``arch``: ``$TESSERA_PLAN_TABLE`` when it names a table of that architecture,
    else the shipped ``data/plan_table_<arch>.json``; read once per path."""
    override = config.get("plan_table")
    if override:
        found = load_table_file(override)
        if found.table is None or found.table.arch == arch:
            return found
    return load_table_file(str(shipped_table_path(arch)))


def load_table_file(path: str) -> TableLoad:
    """``load_plan_table`` as a cached outcome: no file is not an error, a bad file is. Read again
    only when the file changes."""
    try:
        stamp = os.stat(path).st_mtime_ns
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return TableLoad(None, None, None)
    return load_table_version(path, stamp)


@cache
def load_table_version(path: str, mtime_ns: int) -> TableLoad:
    try:
        table = load_plan_table(path)
    except PlanTableError as err:
        return TableLoad(None, path, str(err))
    logging.getLogger(__name__).info("plan table %s: %s, %d request keys", path, table.name, len(table.keys))
    return TableLoad(table, path, None)
