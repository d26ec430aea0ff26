"""The native attention kernels, exposed to PyTorch as ``torch.library`` custom ops, and their launch.

The library (its C ABI and loader: ``library.py``) is loaded with ctypes on first use. The ops have
fake kernels, so ``torch.compile`` traces through them, and the launch path does no host sync, so it
can be captured in a CUDA graph (pass ``out``/``lse``/``workspace`` to also avoid allocation).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache

import torch

from .catalog import kernel_spec_from_row
from .errors import CatalogError, InvalidArgumentError, describe_tensor
from .kernel_table import all_rows

# NativeLibrary, available_kernels, kernel_sources, library_path, load_library and native_available
# are importable from here too.
from .library import (  # noqa: F401
    DTYPE_CODES,
    NativeLibrary,
    TesseraAttnParams,
    TesseraMergeParams,
    available_kernels,
    current_stream_handle,
    kernel_sources,
    library_path,
    load_library,
    native_available,
)
from .plans import MEMBERSHIP_BITS, Family, KernelSpec, PhysicalPlan
from .prepared import LaunchConfig, PreparedPlan, WorkspaceLayout

LOG2E = 1.4426950408889634


def aligned(t: torch.Tensor) -> bool:
    """cp.async moves 16-byte chunks: base and (b, s, h) strides must be 16-byte aligned."""
    elems = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(st % elems == 0 for st in t.stride()[:3])


def with_aligned_loads(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a fresh contiguous copy where its base or strides break ``aligned`` (a contiguous
    view at an odd storage offset too, which ``contiguous()`` would hand back unchanged)."""
    return t if aligned(t) else t.clone(memory_format=torch.contiguous_format)


def fill_strides(field, strides: tuple[int, ...]) -> None:
    for i in range(3):
        field[i] = strides[i]


@torch.library.custom_op("tessera::sparse_attention_fwd", mutates_args=(), device_types="cuda")
def sparse_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile_counts: torch.Tensor,
    tile_slots: torch.Tensor,
    tile_member: torch.Tensor,
    q_order: torch.Tensor,
    kernel: str,
    config: list[int],
    scale: float,
    q_units: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional op: returns (out ``[B, Sq, H, D]``, lse ``[B, H, Sq]`` fp32).

    ``kernel`` is a catalog kernel name; ``config``: the fields of ``LaunchConfig`` in order (a
    list, the type a custom op takes; ``PreparedPlan.launch_config``); ``q_units``: the
    grouped query layout's units (``PreparedPlan.q_units``), None for the natural layout.

    Shapes, dtypes, devices and the config are checked against each other and the kernel's limits
    (``check_launch``); the metadata's values are trusted: build them with ``prepare``."""
    spec = kernel_spec_named(kernel)
    config = check_launch(q, k, v, spec, (tile_counts, tile_slots, tile_member, q_order, q_units), config)
    q, k, v = (with_aligned_loads(t) for t in (q, k, v))
    out, lse, workspace, _ = output_buffers(q, config.num_splits, True)
    launch(q, k, v, tile_counts, tile_slots, tile_member, q_order, kernel, config, scale, out, lse, workspace,
           q_units)
    return out, lse


@cache
def kernel_spec_named(name: str) -> KernelSpec:
    """The catalog's ``KernelSpec`` of a kernel name (``InvalidArgumentError`` for an unknown one)."""
    row = next((row for row in all_rows() if row.name == name), None)
    if row is None:
        raise InvalidArgumentError("kernel", "a kernel name of the catalog", repr(name))
    return kernel_spec_from_row(row)


METADATA_DTYPES = (("tile_counts", torch.int32), ("tile_slots", torch.int32), ("tile_member", torch.int64),
                   ("q_order", torch.int32), ("q_units", torch.int32))
MIN_UNIT = 16  # the smallest query unit and KV slot (blocks and tiles are multiples of 16)


def check_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: KernelSpec,
                 metadata: tuple[torch.Tensor | None, ...], config: Sequence[int]) -> LaunchConfig:
    """Refuse, before any launch, a call whose tensors the kernel would read past: q ``[B, Sq, H, D]``
    and k, v ``[B, Skv, H, D]`` of the kernel's dtype and head_dim on one CUDA device, and metadata
    ``(tile_counts, tile_slots, tile_member, q_order, q_units)`` shaped as ``config`` (the fields of
    ``LaunchConfig``) says for this q, within the kernel's slot and membership limits. Returns the
    config as a ``LaunchConfig``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InvalidArgumentError(name, "a 4-D tensor [B, S, H, D]", describe_tensor(t))
        if t.dtype != spec.torch_dtype or t.shape[-1] != spec.head_dim:
            raise InvalidArgumentError(name, f"dtype {spec.dtype} and head_dim {spec.head_dim} for {spec.name}",
                                       f"{t.dtype}, head_dim {t.shape[-1]}")
        if t.device != q.device:
            raise InvalidArgumentError(name, f"a tensor on {q.device} (the device of q)", str(t.device))
        if t.stride(-1) != 1:
            raise InvalidArgumentError(name, "a contiguous last dim (stride 1)", f"strides {tuple(t.stride())}")
    if k.shape != v.shape:
        raise InvalidArgumentError("v", f"the shape of k {tuple(k.shape)}", tuple(v.shape))
    batch, seq_q, heads, _ = q.shape
    if (k.shape[0], k.shape[2]) != (batch, heads):
        raise InvalidArgumentError("k", f"batch {batch} and heads {heads} (those of q)", tuple(k.shape))
    if len(config) != len(LaunchConfig._fields) or not all(isinstance(c, int) for c in config):
        raise InvalidArgumentError("config", f"{len(LaunchConfig._fields)} ints {list(LaunchConfig._fields)}",
                                   repr(config))
    config = LaunchConfig(*config)
    num_q_tiles, capacity, slots, q_unit_log2, kv_unit_log2, num_splits, persistent = config
    if not (MIN_UNIT.bit_length() - 1 <= kv_unit_log2 < 16 and (1 << kv_unit_log2) * slots == spec.tile_kv):
        raise InvalidArgumentError("config", f"slots x 2^kv_unit_log2 = tile_kv {spec.tile_kv} with a KV unit of at "
                                   f"least {MIN_UNIT} tokens", f"slots {slots}, kv_unit_log2 {kv_unit_log2}")
    q_unit = 1 << q_unit_log2 if 0 <= q_unit_log2 < 16 else 0
    if q_unit < MIN_UNIT or spec.tile_q % q_unit or (spec.tile_q // q_unit) * slots > MEMBERSHIP_BITS:
        raise InvalidArgumentError("config", f"a query unit dividing tile_q {spec.tile_q}, at least {MIN_UNIT} rows, "
                                   f"with (tile_q / q_unit) x slots <= {MEMBERSHIP_BITS}",
                                   f"q_unit_log2 {q_unit_log2}, slots {slots}")
    if num_splits < 1 or persistent not in (0, 1) or capacity < 0:
        raise InvalidArgumentError("config", "num_splits >= 1, persistent 0 or 1, capacity >= 0",
                                   f"num_splits {num_splits}, persistent {persistent}, capacity {capacity}")
    expected_tiles = -(-seq_q // spec.tile_q)
    if num_q_tiles != expected_tiles:
        raise InvalidArgumentError("config", f"num_q_tiles ceil(Sq / tile_q) = {expected_tiles} for Sq {seq_q}",
                                   num_q_tiles)
    tile_counts = metadata[0]
    if not isinstance(tile_counts, torch.Tensor) or tile_counts.dim() != 3:
        raise InvalidArgumentError("tile_counts", "a 3-D tensor [Bm, Hm, nQT]", describe_tensor(tile_counts))
    mask_batch, mask_heads = tile_counts.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise InvalidArgumentError("metadata", f"prepared for a mask of batch 1 or {batch} and heads 1 or {heads} "
                                   "(those of q)", f"mask dims ({mask_batch}, {mask_heads})",
                                   hint="prepare the plan with the mask of this call")
    lead = (mask_batch, mask_heads, num_q_tiles)
    shapes = (lead, lead + (capacity, slots), lead + (capacity,), lead,
              (mask_batch, mask_heads, num_q_tiles * (spec.tile_q // q_unit)))
    for (name, dtype), t, shape in zip(METADATA_DTYPES, metadata, shapes):
        if t is None and name == "q_units":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise InvalidArgumentError(name, f"{dtype} {list(shape)} ({config}, q {tuple(q.shape)})",
                                       describe_tensor(t))
        if t.device != q.device or not t.is_contiguous():
            raise InvalidArgumentError(name, f"a contiguous tensor on {q.device}", f"{t.device}, strides {t.stride()}")
    return config


def output_buffers(q: torch.Tensor, num_splits: int, with_lse: bool, task_counter: bool = False):
    """``(out [B, Sq, H, D], lse [B, H, Sq] fp32 or None, split-K workspace or None, task counter
    address or None)`` for a launch; ``task_counter``: a dynamically scheduled one
    (``output_with_counter``)."""
    batch, seq_q, heads, _ = q.shape
    out, counter = output_with_counter(q) if task_counter else (torch.empty(q.shape, dtype=q.dtype, device=q.device), None)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device) if with_lse else None
    workspace = WorkspaceLayout.of(num_splits, *q.shape).allocate(q.device) if num_splits > 1 else None
    return out, lse, workspace, counter


# Bytes after the output that hold the task counter of a dynamically scheduled launch.
TASK_COUNTER_BYTES = 16


def output_with_counter(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The output ``[B, Sq, H, D]`` of a dynamically scheduled launch and the address of its task
    counter: one allocation, the counter in the 16 bytes after the output. The counter belongs to
    this launch alone (the caching allocator hands the block to no one else until ``out`` is
    freed and the stream has passed the launch), so launches on any streams never share one."""
    numel = q.numel()
    flat = torch.empty(numel + TASK_COUNTER_BYTES // q.element_size(), dtype=q.dtype, device=q.device)
    return flat[:numel].view(q.shape), flat.data_ptr() + numel * q.element_size()


@sparse_attention_fwd.register_fake
def _(q, k, v, tile_counts, tile_slots, tile_member, q_order, kernel, config, scale, q_units=None):
    batch, seq_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


@dataclass(frozen=True)
class LaunchTemplate:
    """Everything of a launch fixed by the plan's kernel and launch config and by the shapes,
    strides, dtype and scale of the call (``launch_template``): built once per such key in the
    process — so the next mask of a request finds it — then bound to one prepared plan's metadata
    (``bind``) and completed with the tensor pointers per call (``fill``)."""

    kernel_id: int
    params: TesseraAttnParams
    merge: TesseraMergeParams | None  # split-K merge (num_splits > 1)

    def bind(self, metadata: tuple[torch.Tensor, ...]) -> LaunchTemplate:
        """A copy with the metadata pointers of (tile_counts, tile_slots, tile_member, q_order, q_units)
        (``PreparedPlan.metadata``; q_units None: the natural query layout)."""
        p = TesseraAttnParams.from_buffer_copy(self.params)
        tile_counts, tile_slots, tile_member, q_order, q_units = metadata
        p.tile_counts, p.tile_slots = tile_counts.data_ptr(), tile_slots.data_ptr()
        p.tile_member, p.q_order = tile_member.data_ptr(), q_order.data_ptr()
        p.q_units = q_units.data_ptr() if q_units is not None else None
        return LaunchTemplate(self.kernel_id, p, self.merge)

    def fill(self, q, k, v, out, lse, workspace, task_counter: int | None = None
             ) -> tuple[TesseraAttnParams, TesseraMergeParams | None]:
        """Params of one launch; ``task_counter``: the address of this launch's own counter
        (``output_with_counter``) for dynamic scheduling of a persistent grid, None for static."""
        p = TesseraAttnParams.from_buffer_copy(self.params)
        p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        p.lse = lse.data_ptr() if lse is not None else None
        p.task_counter = task_counter
        m = None
        if self.merge is not None:
            assert workspace is not None  # internal: callers size it from PreparedPlan.workspace()
            p.o_partial, p.lse_partial = workspace[0].data_ptr(), workspace[1].data_ptr()
            m = TesseraMergeParams.from_buffer_copy(self.merge)
            m.o_partial, m.lse_partial, m.o = p.o_partial, p.lse_partial, p.o
            m.lse = p.lse
        return p, m


def launch_template(q: torch.Tensor, k: torch.Tensor, metadata: tuple[torch.Tensor, ...], kernel: str,
                    config: Sequence[int], scale: float, strides: tuple[tuple[int, ...], ...]) -> LaunchTemplate:
    """The fixed part of a launch (see ``LaunchTemplate``), bound to ``metadata`` = (tile_counts,
    tile_slots, tile_member, q_order, q_units); ``strides`` = the (b, s, h) strides of q, k, v and the output."""
    key = (kernel, tuple(config), tuple(q.shape), k.shape[1], tuple(metadata[0].shape[:2]), strides,
           q.dtype, q.device.index or 0, scale)
    return unbound_template(*key).bind(metadata)


@lru_cache(maxsize=512)
def unbound_template(kernel: str, config: tuple[int, ...], q_shape: tuple[int, ...], seq_kv: int,
                     mask_dims: tuple[int, int], strides: tuple[tuple[int, ...], ...], dtype: torch.dtype,
                     device_index: int, scale: float) -> LaunchTemplate:
    """``launch_template`` without the metadata pointers, cached per process (a pure function of its
    arguments and the loaded library)."""
    lib = load_library()
    batch, seq_q, heads, head_dim = q_shape
    config = LaunchConfig(*config)
    kid = lib.kernel_ids.get(kernel)
    if kid is None:
        raise CatalogError(f"kernel {kernel} is not in the loaded library {lib.path}")
    grid_size = 0
    if config.persistent:
        grid_size = ctas_per_sm(kid, device_index) * torch.cuda.get_device_properties(device_index).multi_processor_count
    out_strides = strides[3]
    p = TesseraAttnParams()
    for field_, st in zip((p.q_stride, p.k_stride, p.v_stride, p.o_stride), strides):
        fill_strides(field_, st)
    p.batch, p.heads, p.seq_q, p.seq_kv = batch, heads, seq_q, seq_kv
    p.mask_batch, p.mask_heads = mask_dims
    p.num_q_tiles, p.capacity, p.slots = config.num_q_tiles, config.capacity, config.slots
    p.q_unit_log2, p.kv_unit_log2 = config.q_unit_log2, config.kv_unit_log2
    p.num_splits, p.grid_size = config.num_splits, grid_size
    p.scale_log2 = scale * LOG2E
    m = None
    if config.num_splits > 1:
        m = TesseraMergeParams()
        fill_strides(m.o_stride, out_strides)
        m.batch, m.heads, m.seq_q, m.head_dim, m.num_splits = batch, heads, seq_q, head_dim, config.num_splits
        m.dtype = DTYPE_CODES[dtype]
    return LaunchTemplate(kid, p, m)


def launch_filled(template: LaunchTemplate, p: TesseraAttnParams, m: TesseraMergeParams | None,
                  device: torch.device) -> None:
    """Launch the attention kernel (and the split-K merge) of completed params on the current stream."""
    lib = load_library()
    stream = ctypes.c_void_p(current_stream_handle(device))
    lib.check(lib.handle.tessera_attention_forward(template.kernel_id, ctypes.byref(p), stream), "attention")
    if m is not None:
        lib.check(lib.handle.tessera_split_merge(ctypes.byref(m), stream), "split-K merge")


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile_counts: torch.Tensor,
    tile_slots: torch.Tensor,
    tile_member: torch.Tensor,
    q_order: torch.Tensor,
    kernel: str,
    config: Sequence[int],
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
    q_units: torch.Tensor | None = None,
) -> None:
    """Launch the attention kernel (and the split-K merge) on the current stream; no sync, no
    allocation. q, k, v must be 16-byte aligned (``aligned``); out/lse/workspace sized by the caller;
    ``q_units``: the grouped query layout's units, None for the natural layout."""
    template = launch_template(q, k, (tile_counts, tile_slots, tile_member, q_order, q_units), kernel, config, scale,
                               (q.stride(), k.stride(), v.stride(), out.stride()))
    p, m = template.fill(q, k, v, out, lse, workspace)
    launch_filled(template, p, m, q.device)


@cache
def ctas_per_sm(kernel: int, device_index: int) -> int:
    with torch.cuda.device(device_index):
        return max(1, load_library().handle.tessera_kernel_ctas_per_sm(kernel))


def run_native(
    prepared: PreparedPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run ``prepared`` with its native kernel.

    Eager calls on real tensors take the direct path: the launch template of (prepared plan, shapes,
    strides, scale) is built once and kept on the prepared plan, so a call allocates the output and
    fills five pointers. Under ``torch.compile`` (or on fake / subclass tensors) the call goes through
    the ``tessera::sparse_attention_fwd`` custom op, which the compiler can trace."""
    spec = prepared.plan.kernel
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise InvalidArgumentError(
            "q, k, v", "tensors that do not require grad (the native kernels compute the forward pass only)",
            "requires_grad=True", hint="call under torch.no_grad() or torch.inference_mode(); gradients are "
            "computed on the CPU reference path only")
    if q.dtype != spec.torch_dtype or q.shape[-1] != spec.head_dim:
        raise InvalidArgumentError("q", f"dtype {spec.dtype} and head_dim {spec.head_dim} for {spec.name}",
                                   f"{q.dtype}, head_dim {q.shape[-1]}")
    if torch.compiler.is_compiling() or not all(type(t) is torch.Tensor for t in (q, k, v)):
        prepared.check_call(q, k, v)
        out, lse = torch.ops.tessera.sparse_attention_fwd(
            q, k, v, prepared.tile_counts, prepared.tile_slots, prepared.tile_member, prepared.q_order,
            spec.name, list(prepared.launch_config()), scale, prepared.q_units,
        )
        return (out, lse) if return_lse else out
    return run_direct(prepared, q, k, v, scale, return_lse)


def dynamic_schedule(plan: PhysicalPlan) -> bool:
    """Whether an eager launch of ``plan`` takes its tasks from a counter: persistent grids of the
    Hopper family (the portable family and traced calls stride statically)."""
    return plan.tasks.persistent and plan.kernel.family is Family.HOPPER


def run_direct(prepared, q, k, v, scale, return_lse):
    """``run_native``'s eager path (same contract): cached template, output allocation, one launch."""
    q, k, v = (with_aligned_loads(t) for t in (q, k, v))
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, scale)
    templates = prepared.launch_state.templates
    template = templates.get(key)
    if template is None:  # what a template fixes is checked once per such key
        prepared.check_call(q, k, v)
        check_launch(q, k, v, prepared.plan.kernel, prepared.metadata, prepared.launch_config())
    deferred = prepared.compaction_pending
    if deferred and torch.cuda.is_current_stream_capturing():
        prepared.pin()  # the graph replays these metadata pointers: they must never be replaced
    out, lse, workspace, counter = output_buffers(q, prepared.plan.tasks.num_splits, return_lse,
                                                  dynamic_schedule(prepared.plan))
    if template is None:
        template = templates[key] = launch_template(
            q, k, prepared.metadata, prepared.plan.kernel.name, prepared.launch_config(), scale,
            (q.stride(), k.stride(), v.stride(), out.stride()),
        )
    p, m = template.fill(q, k, v, out, lse, workspace, counter)
    launch_filled(template, p, m, q.device)
    if deferred:
        prepared.after_launch()
    return (out, lse) if return_lse else out
