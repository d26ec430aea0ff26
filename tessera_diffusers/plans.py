"""Physical plans ``P = <g_Q, g_KV, sigma, e>``: *how* the GPU computes a logical mask.

- ``g_Q``, ``g_KV``: the mapping of each axis, fixed by the physical tile size against the logical
  block size — direct (tile == block), coarsened (tile covers several blocks), refined (block split
  into several tiles), or, on the KV axis, packed (active blocks of a query tile gathered into
  dense tiles). Ratios per axis are independent. A coarsened query axis may take its blocks in
  the natural order or *grouped*: each head's query blocks regrouped by their key sets, so that a
  tile's blocks share most of their key blocks (``QLayout``, ``regroup.py``).
- ``sigma``: the task organization — traversal order, split-K count, persistent grid.
- ``e``: the native implementation (a ``KernelSpec`` of the catalog).

All of these are frozen dataclasses with a deterministic ``.name``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum

import torch

from .errors import InvalidArgumentError
from .kernel_table import kernel_name

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
# Membership of one physical tile is one 64-bit word: bit (a * slots + s) says whether query unit a
# may see KV slot s.
MEMBERSHIP_BITS = 64


class Family(str, Enum):
    """Which implementation family realizes a plan."""

    REFERENCE = "reference"  # the PyTorch plan executor (any device)
    PORTABLE = "portable"  # mma.sync + cp.async, sm80 and newer
    HOPPER = "hopper"  # TMA + wgmma, sm90a only


class KvLayout(str, Enum):
    """How the KV tiles of one query tile are formed."""

    CONTIGUOUS = "contiguous"  # aligned ranges of tokens (direct / coarsened / refined)
    PACKED = "packed"  # active KV units of the query tile gathered into dense tiles


class QLayout(str, Enum):
    """Which query blocks form a query tile (a coarsened query axis only)."""

    NATURAL = "natural"  # query tile t holds the blocks t * g .. t * g + g - 1 (g blocks per tile)
    GROUPED = "grouped"  # each head's blocks regrouped by their key sets first (regroup.py)


class Traversal(str, Enum):
    """Order in which query tiles are handed to CTAs."""

    ROW_MAJOR = "row_major"
    LONGEST_FIRST = "longest_first"  # rows with most KV tiles first (LPT balancing)


class AxisMapping(str, Enum):
    """Name of the mapping of one axis (derived from block and tile sizes, never stored)."""

    DIRECT = "direct"
    COARSENED = "coarsened"
    GROUPED = "grouped"  # (query axis) coarsened over blocks regrouped by key set
    REFINED = "refined"
    REGRIDDED = "regridded"  # neither divides the other; membership works at their gcd
    PACKED = "packed"


def axis_mapping(block: int, tile: int, packed: bool = False) -> AxisMapping:
    if packed and tile > block:
        return AxisMapping.PACKED
    if tile == block:
        return AxisMapping.DIRECT
    if tile % block == 0:
        return AxisMapping.COARSENED
    if block % tile == 0:
        return AxisMapping.REFINED
    return AxisMapping.REGRIDDED


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel variant of the native catalog."""

    family: Family
    tile_q: int  # query rows per CTA tile
    tile_kv: int  # key columns per KV tile
    head_dim: int
    dtype: str  # "bf16" | "fp16"
    stages: int  # shared-memory pipeline depth for K/V
    arch: str  # lowest architecture it runs on: "sm80", "sm90a", or "any" for the reference
    warps: int = 4

    @property
    def name(self) -> str:
        return kernel_name(self.family.value, self.tile_q, self.tile_kv, self.head_dim, self.dtype, self.stages,
                           self.warps, self.arch)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA: the Q tile and K/V tiles per pipeline stage (16-bit)."""
        return (self.tile_q + 2 * self.stages * self.tile_kv) * self.head_dim * 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return NAME_DTYPES[self.dtype]


@dataclass(frozen=True)
class TaskOrganization:
    """sigma: how tiles become CTA tasks."""

    traversal: Traversal = Traversal.LONGEST_FIRST
    num_splits: int = 1  # split-K parts per query tile (1: no split)
    persistent: bool = False  # fixed grid pulling tasks instead of one CTA per task

    def __post_init__(self) -> None:
        if not isinstance(self.traversal, Traversal):
            raise InvalidArgumentError("traversal", f"one of {[t.name for t in Traversal]}", repr(self.traversal))
        if isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int) or self.num_splits < 1:
            raise InvalidArgumentError("num_splits", "an int >= 1 (split-K parts per query tile)", repr(self.num_splits))
        if not isinstance(self.persistent, bool):
            raise InvalidArgumentError("persistent", "a bool", repr(self.persistent))

    @property
    def name(self) -> str:
        parts = ["lpt" if self.traversal is Traversal.LONGEST_FIRST else "rowmajor"]
        if self.num_splits > 1:
            parts.append(f"split{self.num_splits}")
        if self.persistent:
            parts.append("persistent")
        return "-".join(parts)


@dataclass(frozen=True)
class PhysicalPlan:
    """A complete physical plan for one logical geometry."""

    block_q: int
    block_kv: int
    kv_layout: KvLayout
    tasks: TaskOrganization
    kernel: KernelSpec
    q_layout: QLayout = QLayout.NATURAL

    @property
    def tile_q(self) -> int:
        return self.kernel.tile_q

    @property
    def tile_kv(self) -> int:
        return self.kernel.tile_kv

    @property
    def q_mapping(self) -> AxisMapping:
        if self.q_layout is QLayout.GROUPED:
            return AxisMapping.GROUPED
        return axis_mapping(self.block_q, self.tile_q)

    @property
    def can_group_queries(self) -> bool:
        """Whether a query tile covers several whole blocks, so that the grouped layout applies."""
        return self.tile_q > self.block_q and self.tile_q % self.block_q == 0

    def grouped(self) -> PhysicalPlan:
        """This plan with the grouped query layout (``can_group_queries`` must hold)."""
        return dataclasses.replace(self, q_layout=QLayout.GROUPED)

    @property
    def groups_in_kernel(self) -> bool:
        """Whether the grouped layout of this plan runs in its kernel: a Hopper plan whose query
        tile covers several blocks (the portable family maps rows too, but is not ranked grouped)."""
        return self.can_group_queries and self.kernel.family is Family.HOPPER

    @property
    def kv_mapping(self) -> AxisMapping:
        return axis_mapping(self.block_kv, self.tile_kv, self.kv_layout is KvLayout.PACKED)

    @property
    def q_unit(self) -> int:
        """Rows of the membership grid: the largest size dividing both block and tile."""
        return math.gcd(self.block_q, self.tile_q)

    @property
    def kv_unit(self) -> int:
        """Columns of one KV slot: the largest size dividing both block and tile."""
        return math.gcd(self.block_kv, self.tile_kv)

    @property
    def q_units_per_tile(self) -> int:
        return self.tile_q // self.q_unit

    @property
    def slots_per_tile(self) -> int:
        return self.tile_kv // self.kv_unit

    @property
    def mapping_name(self) -> str:
        q, kv = self.q_mapping.value, self.kv_mapping.value
        return q if q == kv else f"{q}-{kv}"

    @property
    def name(self) -> str:
        k = self.kernel
        return (
            f"{self.mapping_name}_q{self.tile_q}k{self.tile_kv}_from_q{self.block_q}k{self.block_kv}"
            f"_d{k.head_dim}_{k.dtype}_{k.arch}_{k.family.value}_s{k.stages}w{k.warps}_{self.tasks.name}"
        )


def with_grouped_layouts(plans: list[PhysicalPlan]) -> list[PhysicalPlan]:
    """``plans``, then the grouped query layout of each whose kernel groups (``groups_in_kernel``):
    the plans of a mask that comes back."""
    return [*plans, *(p.grouped() for p in plans if p.q_layout is QLayout.NATURAL and p.groups_in_kernel)]


# Precisions a request may ask for: the inputs' own (the default) or the 8-bit kernels.
INPUT_PRECISION = "input"
PRECISIONS = (INPUT_PRECISION, "int8")

# The plan table key of a mask that comes back is the request key with this suffix.
REUSED_KEY_SUFFIX = "/reused"


@dataclass(frozen=True)
class Request:
    """What the selector and eligibility see of one attention call (hashable, no tensors)."""

    batch: int
    heads: int
    seq_len_q: int
    seq_len_kv: int
    head_dim: int
    dtype: str  # "bf16" | "fp16" | "fp32"
    block_q: int
    block_kv: int
    arch: str  # "sm80", "sm86", "sm89", "sm90", "sm120", or "cpu"
    return_lse: bool = False
    # A mask that comes back (its plan re-prepared once, ``Runtime.regrouped``): the grouped query
    # layout is among its plans, and the plan table ranks it under its own key (``/reused``).
    reused_mask: bool = False
    # "input": the kernels compute in q's dtype (bf16 or fp16); "int8": the 8-bit kernels
    # (quantized.py), which run the plans of the 16-bit request (``Selector.quantized``).
    precision: str = INPUT_PRECISION

    @property
    def key(self) -> str:
        """The request key of the plan table (an 8-bit request adds ``/int8``)."""
        key = f"{self.arch}/Q{self.block_q}K{self.block_kv}/d{self.head_dim}/{self.dtype}/bshd"
        if self.precision != INPUT_PRECISION:
            key += f"/{self.precision}"
        return key + REUSED_KEY_SUFFIX if self.reused_mask else key

    @property
    def name(self) -> str:
        return (
            f"{self.key} B={self.batch} H={self.heads} Sq={self.seq_len_q} Skv={self.seq_len_kv}"
        )


def arch_number(arch: str) -> int:
    """``"sm90a"`` -> 90; ``"cpu"`` -> 0."""
    digits = "".join(ch for ch in arch if ch.isdigit())
    return int(digits) if digits else 0
