"""The native kernel table, free of torch so the build (and the C++ generator) can read it.

Every compiled kernel variant comes from this table: ``csrc/build_native.py`` generates one
instantiation per row, ``catalog.py`` turns rows into ``KernelSpec``s, and the runtime checks the
loaded library's own list of names against it.
"""

from __future__ import annotations

from typing import NamedTuple


class TileConfig(NamedTuple):
    tile_q: int
    tile_kv: int
    warps: int  # each warp owns tile_q / warps query rows (16 or 32)


class KernelRow(NamedTuple):
    family: str  # "portable" | "hopper" | "hopper8" | "hopper8qk" (8-bit, QUANTIZED_FAMILIES)
    tile_q: int
    tile_kv: int
    head_dim: int
    dtype: str  # "bf16" | "fp16" (of q, k, v and the output; the 8-bit kernels read the quantized copies)
    stages: int
    warps: int
    arch: str  # lowest architecture: "sm80" | "sm90a"

    @property
    def name(self) -> str:
        return kernel_name(*self)


# Tiles of the portable (mma.sync + cp.async) family.
PORTABLE_TILES: tuple[TileConfig, ...] = (
    TileConfig(64, 64, 4),
    TileConfig(64, 128, 4),
    TileConfig(128, 64, 4),
    TileConfig(128, 64, 8),
    TileConfig(128, 128, 8),
)
HEAD_DIMS: tuple[int, ...] = (64, 128)
DTYPES: tuple[str, ...] = ("bf16", "fp16")
PORTABLE_STAGES: tuple[int, ...] = (2, 3)


def kernel_name(family: str, tile_q: int, tile_kv: int, head_dim: int, dtype: str, stages: int, warps: int, arch: str) -> str:
    """Deterministic name of one kernel variant (also the C symbol suffix)."""
    return f"{family}_t{tile_q}x{tile_kv}_d{head_dim}_{dtype}_s{stages}_w{warps}_{arch}"


# Tiles of the Hopper (sm90a, wgmma) family: one consumer warpgroup per 64 query rows (``warps``
# counts consumer warps; every variant adds one producer warpgroup). Stages: depth of the K and of
# the V ring (separate barriers, so K of tile i + 1 loads while V of tile i is still read).
# A 64 x 64 tile runs two CTAs per SM (one consumer warpgroup each), which only the 2-stage ring
# fits at D = 128; it gives Q64 geometries their own 64-row tiles at the SM's two-warpgroup rate.
HOPPER_TILES: tuple[TileConfig, ...] = (
    TileConfig(128, 128, 8),
    TileConfig(128, 64, 8),
    TileConfig(64, 128, 4),
    TileConfig(64, 64, 4),
)
HOPPER_STAGES: tuple[int, ...] = (2, 3)
HOPPER_TILE_STAGES: dict[tuple[int, int], tuple[int, ...]] = {(64, 64): (2,)}


def family_rows(family: str, tiles: tuple[TileConfig, ...], head_dims: tuple[int, ...], stages: tuple[int, ...],
                arch: str, tile_stages: dict[tuple[int, int], tuple[int, ...]] | None = None) -> tuple[KernelRow, ...]:
    """A family's variants in a fixed order: head dim, dtype, tile, stages (``tile_stages`` where it
    names the tile, else ``stages``)."""
    return tuple(
        KernelRow(family, t.tile_q, t.tile_kv, d, dt, st, t.warps, arch)
        for d in head_dims
        for dt in DTYPES
        for t in tiles
        for st in (tile_stages or {}).get((t.tile_q, t.tile_kv), stages)
    )


def portable_rows() -> tuple[KernelRow, ...]:
    """Every portable variant in a fixed order."""
    return family_rows("portable", PORTABLE_TILES, HEAD_DIMS, PORTABLE_STAGES, "sm80")


def hopper_rows() -> tuple[KernelRow, ...]:
    """Every Hopper variant in a fixed order (built only for sm90a targets)."""
    return family_rows("hopper", HOPPER_TILES, HEAD_DIMS, HOPPER_STAGES, "sm90a", HOPPER_TILE_STAGES)


def all_rows() -> tuple[KernelRow, ...]:
    return portable_rows() + hopper_rows()


# The 8-bit Hopper kernels (precision="int8", tessera_diffusers/quantized.py): Q K^T and P V on the
# int8 tensor cores, over the same plans and metadata as the 16-bit ones, at head_dim 128. Built
# beside the catalog (not in all_rows): their sources hash apart from the 16-bit kernels' and
# their plans are keyed by precision.
QUANTIZED_TILES: tuple[TileConfig, ...] = (TileConfig(128, 128, 8), TileConfig(64, 64, 4))
QUANTIZED_STAGES: tuple[int, ...] = (2, 3)
QUANTIZED_HEAD_DIM = 128


# The family of each P V format (quantized.py's ``pv``): "hopper8" runs P V as uint8 x uint8 ->
# int32, "hopper8qk" only Q K^T in 8 bits, P V in the inputs' 16-bit type with fp32 accumulation.
QUANTIZED_FAMILIES: dict[str, str] = {"int8": "hopper8", "bf16": "hopper8qk"}
# The format precision="int8" runs: INT8 Q K^T with a 16-bit P V measured as fast as the 8-bit P V
# on every family and with about half its error (docs/results.md, "8-bit attention").
DEFAULT_PV = "bf16"


def quantized_rows() -> tuple[KernelRow, ...]:
    """Every 8-bit Hopper variant in a fixed order (built only for sm90a targets)."""
    return tuple(row for family in QUANTIZED_FAMILIES.values()
                 for row in family_rows(family, QUANTIZED_TILES, (QUANTIZED_HEAD_DIM,), QUANTIZED_STAGES, "sm90a",
                                        HOPPER_TILE_STAGES))


def pv_format(row: KernelRow) -> str:
    """The P V format (a key of QUANTIZED_FAMILIES) of an 8-bit kernel row."""
    return next(pv for pv, family in QUANTIZED_FAMILIES.items() if family == row.family)


def quantized_variant(tile_q: int, tile_kv: int, head_dim: int, dtype: str, stages: int,
                      pv: str = DEFAULT_PV) -> KernelRow | None:
    """The 8-bit kernel with P V format ``pv`` that runs plans of a Hopper kernel of this shape
    (its stages where built, else the nearest), or None."""
    family = QUANTIZED_FAMILIES[pv]
    rows = [r for r in quantized_rows()
            if r.family == family and (r.tile_q, r.tile_kv, r.head_dim, r.dtype) == (tile_q, tile_kv, head_dim, dtype)]
    return min(rows, key=lambda r: (abs(r.stages - stages), r.stages)) if rows else None
