"""The native kernel library's C ABI (``csrc/include/tessera/params.h``) and its one loader.

The library is a torch-free shared object with a plain C ABI, loaded with ctypes: one build serves
every Python and PyTorch version. This module holds every ctypes mirror of a params.h struct, the
signatures of the C entry points, and ``load_library``, which opens the library once per process
and checks it against the kernel table and its manifest. Two optional parts are looked up on top of
it: the launch preparation and mask statistics (``native_library``) and the query-grouping kernel
(``grouping_library``); a mirror whose size differs from the library's struct raises
``CatalogError`` rather than let a stale build fill tensors through a wrong layout.

What launches through the ABI lives above it: the mask statistics (``mask_counts.py``), the
launch preparation (``native_prepare.py``), the query grouping (``regroup.py``) and attention
(``ops.py``). Loading nothing at import, this module sits below all of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
from dataclasses import dataclass
from functools import cache

import torch

from . import config
from .catalog import kernel_spec_from_row
from .errors import CatalogError, InvalidArgumentError, NativeKernelError
from .kernel_table import all_rows, pv_format, quantized_rows
from .plans import KernelSpec

log = logging.getLogger(__name__)
LIBRARY_FILE = "libtessera_kernels.so"
ABI_VERSION = 5  # TESSERA_ABI_VERSION
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}  # TesseraMergeParams.dtype
NATIVE_PREPARE_ENV = config.NATIVE_PREPARE_ENV  # "0": preparation, statistics and grouping in torch
MAX_UNION_GROUPS = 4  # TESSERA_MAX_UNION_GROUPS


class TesseraAttnParams(ctypes.Structure):
    """Mirror of ``TesseraAttnParams`` in params.h, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("o_partial", ctypes.c_void_p),
        ("lse_partial", ctypes.c_void_p),
        ("q_stride", ctypes.c_int64 * 3),
        ("k_stride", ctypes.c_int64 * 3),
        ("v_stride", ctypes.c_int64 * 3),
        ("o_stride", ctypes.c_int64 * 3),
        ("batch", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("seq_q", ctypes.c_int32),
        ("seq_kv", ctypes.c_int32),
        ("mask_batch", ctypes.c_int32),
        ("mask_heads", ctypes.c_int32),
        ("num_q_tiles", ctypes.c_int32),
        ("capacity", ctypes.c_int32),
        ("slots", ctypes.c_int32),
        ("q_unit_log2", ctypes.c_int32),
        ("kv_unit_log2", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("grid_size", ctypes.c_int32),
        ("tile_counts", ctypes.c_void_p),
        ("tile_slots", ctypes.c_void_p),
        ("tile_member", ctypes.c_void_p),
        ("q_order", ctypes.c_void_p),
        ("scale_log2", ctypes.c_float),
        ("task_counter", ctypes.c_void_p),
        ("q_units", ctypes.c_void_p),
    ]


class TesseraQuantizedParams(ctypes.Structure):
    """Mirror of ``TesseraQuantizedParams`` in quantized/params.h (the 8-bit kernels' launch)."""

    _fields_ = [
        ("attn", TesseraAttnParams),
        ("q_scale", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
        ("v_mean", ctypes.c_void_p),
        ("lse_shift", ctypes.c_void_p),
        ("seq_kv_padded", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class TesseraQuantizeParams(ctypes.Structure):
    """Mirror of ``TesseraQuantizeParams`` in quantized/params.h (the quantization pass)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("q_stride", ctypes.c_int64 * 3),
        ("k_stride", ctypes.c_int64 * 3),
        ("v_stride", ctypes.c_int64 * 3),
        ("batch", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("seq_q", ctypes.c_int32),
        ("seq_kv", ctypes.c_int32),
        ("seq_kv_padded", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("segments", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        ("q8", ctypes.c_void_p),
        ("q_scale", ctypes.c_void_p),
        ("k8", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),
        ("v8", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
        ("v_mean", ctypes.c_void_p),
        ("k_mean", ctypes.c_void_p),
        ("lse_shift", ctypes.c_void_p),
        ("partials", ctypes.c_void_p),
    ]


class TesseraMergeParams(ctypes.Structure):
    """Mirror of ``TesseraMergeParams`` in params.h."""

    _fields_ = [
        ("o_partial", ctypes.c_void_p),
        ("lse_partial", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("o_stride", ctypes.c_int64 * 3),
        ("batch", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("seq_q", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
    ]


class TesseraBlockMask(ctypes.Structure):
    """Mirror of ``TesseraBlockMask`` in params.h."""

    _fields_ = [
        ("blocks", ctypes.c_void_p),
        ("stride", ctypes.c_int64 * 4),
        ("batch", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("cols", ctypes.c_int32),
    ]


class TesseraPrepareParams(ctypes.Structure):
    """Mirror of ``TesseraPrepareParams`` in params.h, field for field."""

    _fields_ = [
        ("mask", TesseraBlockMask),
        ("block_q", ctypes.c_int32),
        ("block_kv", ctypes.c_int32),
        ("seq_q", ctypes.c_int32),
        ("seq_kv", ctypes.c_int32),
        ("tile_q", ctypes.c_int32),
        ("tile_kv", ctypes.c_int32),
        ("q_unit", ctypes.c_int32),
        ("kv_unit", ctypes.c_int32),
        ("packed", ctypes.c_int32),
        ("longest_first", ctypes.c_int32),
        ("num_q_tiles", ctypes.c_int32),
        ("capacity", ctypes.c_int32),
        ("tile_counts", ctypes.c_void_p),
        ("tile_slots", ctypes.c_void_p),
        ("tile_member", ctypes.c_void_p),
        ("q_order", ctypes.c_void_p),
        ("max_count", ctypes.c_void_p),
    ]


class TesseraMaskCountsParams(ctypes.Structure):
    """Mirror of ``TesseraMaskCountsParams`` in params.h."""

    _fields_ = [
        ("mask", TesseraBlockMask),
        ("num_groups", ctypes.c_int32),
        ("group_rows", ctypes.c_int32 * MAX_UNION_GROUPS),
        ("counts", ctypes.c_void_p),
        ("row_counts", ctypes.c_void_p),
    ]


class TesseraGroupParams(ctypes.Structure):
    """Mirror of ``TesseraGroupParams`` in params.h."""

    _fields_ = [
        ("mask", TesseraBlockMask),
        ("group", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("num_slots", ctypes.c_int32),
        ("segment", ctypes.c_int32),
        ("q_units", ctypes.c_void_p),
        ("key_blocks", ctypes.c_void_p),
        ("segment_key_blocks", ctypes.c_void_p),
    ]


# TesseraStruct values of params.h: each mirror is checked against the library's size of its struct
# (tessera_struct_bytes): the launch and merge parameters at load, the optional parts' before first use.
STRUCT_IDS = {TesseraAttnParams: 0, TesseraMergeParams: 1, TesseraBlockMask: 2, TesseraPrepareParams: 3,
              TesseraMaskCountsParams: 4, TesseraGroupParams: 5}

# The C entry points the package calls (csrc/kernels/library.cu): those every library has, checked
# at load, then those of each optional part.
ENTRY_POINTS = ("tessera_abi_version", "tessera_num_kernels", "tessera_kernel_name", "tessera_error_string",
                "tessera_attention_forward", "tessera_split_merge")
PREPARE_FUNCTIONS = ("tessera_struct_bytes", "tessera_prepare_counts", "tessera_prepare_fill", "tessera_mask_counts")
GROUPING_FUNCTIONS = ("tessera_group_query_blocks",)
QUANTIZED_FUNCTIONS = ("tessera_quantized_num_kernels", "tessera_quantized_kernel_name",
                       "tessera_quantized_kernel_ctas_per_sm", "tessera_quantized_struct_bytes", "tessera_quantize",
                       "tessera_quantized_attention_forward")
QUANTIZED_STRUCT_IDS = {TesseraQuantizedParams: 0, TesseraQuantizeParams: 1}  # TesseraQuantizedStruct
# argtypes of the entry points that take more than ints (every one returns an int unless typed here).
ARGTYPES = {
    "tessera_attention_forward": [ctypes.c_int, ctypes.POINTER(TesseraAttnParams), ctypes.c_void_p],
    "tessera_split_merge": [ctypes.POINTER(TesseraMergeParams), ctypes.c_void_p],
    "tessera_struct_bytes": [ctypes.c_int],
    "tessera_prepare_counts": [ctypes.POINTER(TesseraPrepareParams), ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p],
    "tessera_prepare_fill": [ctypes.POINTER(TesseraPrepareParams), ctypes.c_void_p],
    "tessera_mask_counts": [ctypes.POINTER(TesseraMaskCountsParams), ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p],
    "tessera_group_query_blocks": [ctypes.POINTER(TesseraGroupParams), ctypes.c_void_p],
    "tessera_quantized_struct_bytes": [ctypes.c_int],
    "tessera_quantize": [ctypes.POINTER(TesseraQuantizeParams), ctypes.c_void_p],
    "tessera_quantized_attention_forward": [ctypes.c_int, ctypes.POINTER(TesseraQuantizedParams), ctypes.c_void_p],
}
RESTYPES = {"tessera_kernel_name": ctypes.c_char_p, "tessera_error_string": ctypes.c_char_p,
            "tessera_quantized_kernel_name": ctypes.c_char_p}


@dataclass(frozen=True)
class NativeLibrary:
    """The loaded library and its kernels by name."""

    path: str
    handle: ctypes.CDLL
    kernel_ids: dict  # name -> id
    manifest: dict

    def check(self, code: int, what: str) -> None:
        if code != 0:
            message = self.handle.tessera_error_string(code).decode()
            raise NativeKernelError(f"{what} failed: CUDA error {code} ({message})")

    def exports(self, names: tuple[str, ...]) -> bool:
        """Whether the library has every C function of ``names``."""
        return all(hasattr(self.handle, name) for name in names)


def library_path() -> str:
    override = config.get("native_lib")
    if override:
        return override
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native", LIBRARY_FILE)


@cache
def load_library() -> NativeLibrary:
    """Load and check the native library once per process, its entry points typed (the optional
    ones it has too). Raises ``CatalogError``."""
    path = library_path()
    if not os.path.isfile(path):
        raise CatalogError(
            f"native library not found at {path}: `pip install .` builds it where nvcc is available and a GPU "
            "is visible (or with TESSERA_CUDA_ARCHS=\"80;90\" set); in a source checkout `tessera build` builds it"
        )
    try:
        handle = ctypes.CDLL(path)
    except OSError as err:
        raise CatalogError(f"cannot load {path}: {err}") from err
    missing = [name for name in ENTRY_POINTS if not hasattr(handle, name)]
    if missing:
        raise CatalogError(f"{path} is not a Tessera kernel library (no {missing[0]}); unset TESSERA_NATIVE_LIB "
                           "or point it at a build of csrc/build_native.py")
    for name, restype in RESTYPES.items():
        if hasattr(handle, name):
            getattr(handle, name).restype = restype
    for name, argtypes in ARGTYPES.items():
        if hasattr(handle, name):
            getattr(handle, name).argtypes = argtypes
    if handle.tessera_abi_version() != ABI_VERSION:
        raise CatalogError(f"{path}: ABI version {handle.tessera_abi_version()}, expected {ABI_VERSION}; rebuild it")
    names = [handle.tessera_kernel_name(i).decode() for i in range(handle.tessera_num_kernels())]
    known = {row.name for row in all_rows()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CatalogError(f"{path} holds kernels the kernel table does not know ({unknown[:3]}...); rebuild it")
    manifest_path = os.path.join(os.path.dirname(path), "manifest.json")
    manifest = {}
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("kernels") != names:
            raise CatalogError(f"{manifest_path} does not list the kernels of {path}; rebuild the library")
    lib = NativeLibrary(path, handle, {n: i for i, n in enumerate(names)}, manifest)
    if lib.exports(("tessera_struct_bytes",)):
        check_mirrors(lib, (TesseraAttnParams, TesseraMergeParams))
    log.info("native library %s: %d kernels, kernel sources %s", path, len(names), manifest.get("kernel_sources"))
    return lib


def check_mirrors(lib: NativeLibrary, structs: tuple[type[ctypes.Structure], ...]) -> None:
    """Raise ``CatalogError`` unless each mirror of ``structs`` has the size of the library's struct."""
    for struct in structs:
        native_bytes = lib.handle.tessera_struct_bytes(STRUCT_IDS[struct])
        if native_bytes != ctypes.sizeof(struct):
            raise CatalogError(f"{lib.path}: {struct.__name__} has {native_bytes} bytes, its mirror in "
                               f"library.py {ctypes.sizeof(struct)}; rebuild the library")


@cache
def native_library() -> NativeLibrary | None:
    """The kernel library where it has the preparation and mask-statistics functions, else None (no
    build, or one without them). Raises ``CatalogError`` if a mirror's size differs from the library's."""
    try:
        lib = load_library()
    except CatalogError:
        return None
    if not lib.exports(PREPARE_FUNCTIONS):
        return None
    check_mirrors(lib, (TesseraBlockMask, TesseraPrepareParams, TesseraMaskCountsParams))
    return lib


@cache
def grouping_library() -> NativeLibrary | None:
    """``native_library()`` where it also has ``tessera_group_query_blocks``, else None. Raises
    ``CatalogError`` if the struct's mirror differs in size from the library's."""
    lib = native_library()
    if lib is None or not lib.exports(GROUPING_FUNCTIONS):
        return None
    check_mirrors(lib, (TesseraGroupParams,))
    return lib


@dataclass(frozen=True)
class QuantizedLibrary:
    """The 8-bit part of the loaded library: its kernels by name."""

    lib: NativeLibrary
    kernel_ids: dict  # name -> id of tessera_quantized_attention_forward

    def has_pv_format(self, pv: str) -> bool:
        """Whether the build compiled 8-bit kernels with P V format ``pv`` (``TESSERA_PV_FORMATS``)."""
        return any(pv_format(row) == pv for row in quantized_rows() if row.name in self.kernel_ids)


@cache
def quantized_library() -> QuantizedLibrary | None:
    """The 8-bit kernels and quantization pass of the loaded library, or None (no library, or one
    built without an sm90 target). Raises ``CatalogError`` if a mirror differs in size from the
    library's struct, or the library holds 8-bit kernels the kernel table does not know."""
    try:
        lib = load_library()
    except CatalogError:
        return None
    if not lib.exports(QUANTIZED_FUNCTIONS):
        return None
    handle = lib.handle
    for struct, which in QUANTIZED_STRUCT_IDS.items():
        if handle.tessera_quantized_struct_bytes(which) != ctypes.sizeof(struct):
            raise CatalogError(f"{lib.path}: {struct.__name__} has {handle.tessera_quantized_struct_bytes(which)} "
                               f"bytes, its mirror in library.py {ctypes.sizeof(struct)}; rebuild the library")
    names = [handle.tessera_quantized_kernel_name(i).decode() for i in range(handle.tessera_quantized_num_kernels())]
    known = {row.name for row in quantized_rows()}
    if any(n not in known for n in names):
        raise CatalogError(f"{lib.path} holds 8-bit kernels the kernel table does not know; rebuild it")
    return QuantizedLibrary(lib, {n: i for i, n in enumerate(names)})


def native_path_enabled(device: torch.device) -> bool:
    """Whether tensors on ``device`` are prepared natively: CUDA, a library with the preparation
    functions, and ``TESSERA_NATIVE_PREPARE`` not ``"0"``."""
    return device.type == "cuda" and config.get("native_prepare") and native_library() is not None


def require_library(device: torch.device, library: NativeLibrary | None) -> NativeLibrary:
    """``library`` if given (an emulation in the CPU tests), else the native one for a CUDA ``device``."""
    if library is not None:
        return library
    if device.type != "cuda":
        raise InvalidArgumentError("mask.blocks", "a CUDA tensor for the native path", f"device {device}")
    lib = native_library()
    if lib is None:
        raise CatalogError("the native library with tessera_prepare_* is not loaded: build it with "
                           "`python csrc/build_native.py`, or set TESSERA_NATIVE_PREPARE=0")
    return lib


def available_kernels() -> tuple[KernelSpec, ...]:
    """KernelSpecs of every kernel the loaded library holds (``CatalogError`` if none)."""
    lib = load_library()
    rows = {row.name: row for row in all_rows()}
    return tuple(kernel_spec_from_row(rows[name]) for name in lib.kernel_ids)


SOURCE_HASHES = ("kernel_sources", "grouping_sources")  # the manifest's source hashes


def kernel_sources(part: str = "kernel_sources") -> str | None:
    """A source hash of the loaded library's manifest (``csrc/build_native.py``): ``kernel_sources``
    (the attention kernels and what the natural plans run) or ``grouping_sources`` (the grouping
    kernel), or None when no library loads or its manifest predates that hash."""
    if part not in SOURCE_HASHES:
        raise InvalidArgumentError("part", f"one of {SOURCE_HASHES}", repr(part))
    try:
        return load_library().manifest.get(part)
    except CatalogError:
        return None


def native_available() -> bool:
    try:
        load_library()
    except CatalogError:
        return False
    return torch.cuda.is_available()


# ---------------------------------------------------------------------- arguments of the calls
def block_mask_struct(blocks: torch.Tensor) -> TesseraBlockMask:
    """The struct of a ``[Bm, Hm, nQ, nKV]`` bool block tensor."""
    return mask_struct(tuple(blocks.shape), blocks.stride(), blocks.data_ptr())


def mask_struct(shape: tuple[int, ...], strides: tuple[int, ...], pointer: int = 0) -> TesseraBlockMask:
    """The struct of a block tensor of ``shape`` ``[Bm, Hm, nQ, nKV]`` and element ``strides`` at
    ``pointer`` (0: filled in later, as ``native_prepare.params_template`` leaves it)."""
    m = TesseraBlockMask()
    m.blocks = pointer
    for d, stride in enumerate(strides):
        m.stride[d] = stride
    m.batch, m.heads, m.rows, m.cols = shape
    return m


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (what ``torch.cuda.current_stream(device)
    .cuda_stream`` gives, without building a Stream object on every launch)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def stream_handle(device: torch.device) -> int:
    """The current stream of ``device`` (0, the legacy stream, off CUDA: only an emulated library
    sees it)."""
    return current_stream_handle(device) if device.type == "cuda" else 0


def on_device(device: torch.device):
    """Make ``device`` current for the launches (the library launches on the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
