"""All-to-all by the GPUs' copy engines, for the ranks of one host (Ulysses' exchange without NCCL).

NCCL moves an all-to-all with kernels: its copies compete for the SMs that Tessera's persistent
attention kernels hold, while copy engines leave them alone (on 2 x H200 the exchange was faster
and attention scaled better over copy engines; docs/results.md, "Design decisions").

Every rank stages the pieces it sends in a peer-mapped buffer (PyTorch symmetric memory, CUDA
backend, multicast off); each peer pulls its piece with a copy. Ranks signal each other with stream
memory operations (``cuStreamWriteValue32`` into the peer's buffer, ``cuStreamWaitValue32`` on
one's own), so no SM waits on a peer. Per exchange ``seq``, with ``R = STAGING_SLOTS`` areas:

    pack stream      wait done[j] >= seq - R  ->  pack piece j into area seq % R  ->  ready[me] = seq on j
                     ->  own piece into the output
    transfer stream  wait ready[j] >= seq  ->  pull my piece from j's area seq % R  ->  done[me] = seq on j

Only the pulls run on the copy engines. The driver runs copies within one GPU as kernels, even
batched ones asked to overlap compute (measured on an H200, ``docs/results.md``: a
packing copy queued beside a persistent attention kernel ended with the kernel, a pull from the
peer 0.4-0.5 ms after the kernel started). So the packing and own-piece copies are kernels that run before an
attention kernel or after it, never beside it; ``copy_words`` makes them fast (16-byte words: 0.071 ms
for a 96.8 MB piece against 0.134-0.139 ms for 2-byte elements), and the caller launches an exchange before
the attention it should overlap (``layout_attention``). The pulls (``cudaMemcpyAsync``, or
``cuMemcpy2DAsync`` into a head slice of ``[B, S, H, D]``: rows of ``h * D`` elements at a pitch
of ``H * D``) run beside the attention: no kernel is queued on the transfer stream, where it would
wait for the SMs and hold up the pulls behind it.

The areas let a rank pack the exchanges issued together (q, k and v of every head chunk) while its
peers still pull the first ones; ``done`` keeps it from overwriting an area before every peer has
read it. The signal words live in a header at the start of the symmetric buffer, one per peer and
kind, each written by one rank only. The buffer holds ``R`` areas of ``N - 1`` pieces (for Wan2.1
720p on 2 GPUs in 2 head chunks, 4 x 96.8 MB).

A peer that never arrives leaves the streams waiting (as a NCCL collective would); the exchange is
for inference in lockstep ranks, like the rest of ``tessera_diffusers.parallel``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError, TesseraError, describe_tensor

# PyTorch symmetric memory must never create NVLink multicast objects for this exchange (a program
# that uses multicast can take a shared host's GPUs out of service); the exchange needs none.
MULTICAST_OFF_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"

HEADER_BYTES = 4096  # the signal words: ready[j] at word j, done[j] at word MAX_RANKS + j
MAX_RANKS = 512
STAGING_ALIGN = 16 << 20  # staging areas grow in steps of 16 MiB
STAGING_SLOTS = 4  # staging areas in turn: q, k and v of a head chunk are packed while the last is pulled
MIN_ROW_BYTES = 512  # shorter rows go to a copy kernel (a copy engine moves short rows slowly)

# cuStreamWaitValue32 flags (cuda.h): wait until (int32)(*addr - value) >= 0
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # with a memory fence before the write


class PeerExchangeError(TesseraError):
    """The copy-engine exchange cannot run here (no CUDA driver entry, ranks on several hosts, no P2P)."""


class Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` (cuda.h), for ``cuMemcpy2DAsync``."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]  # fmt: skip


CU_MEMORYTYPE_UNIFIED = 0x04


@dataclass(frozen=True)
class Rows:
    """A strided copy as ``height`` rows of ``width`` contiguous bytes (what a copy engine takes)."""

    height: int
    width: int  # bytes per row
    src_pitch: int  # bytes from one row to the next
    dst_pitch: int


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> Rows | None:
    """``dst.copy_(src)`` (same shape and dtype) as rows of contiguous bytes, or None where the
    strides of either do not reduce to one row dimension over one contiguous block."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        return None
    dims = [i for i, size in enumerate(dst.shape) if size != 1]
    sizes = [dst.shape[i] for i in dims]
    if not sizes:
        return Rows(1, dst.element_size(), dst.element_size(), dst.element_size())
    split = max(contiguous_from(sizes, [t.stride(i) for i in dims]) for t in (dst, src))
    width = math.prod(sizes[split:]) * dst.element_size()
    if split == 0:
        return Rows(1, width, width, width)
    pitches = []
    for t in (src, dst):
        strides = [t.stride(i) for i in dims]
        if any(strides[i] != strides[i + 1] * sizes[i + 1] for i in range(split - 1)):
            return None  # the rows are not evenly spaced
        pitches.append(strides[split - 1] * t.element_size())
    return Rows(math.prod(sizes[:split]), width, *pitches)


def contiguous_from(sizes: list[int], strides: list[int]) -> int:
    """The first dim from which ``sizes`` / ``strides`` are contiguous (``len(sizes)`` if the last is not)."""
    expected, first = 1, len(sizes)
    for i in range(len(sizes) - 1, -1, -1):
        if strides[i] != expected:
            break
        expected *= sizes[i]
        first = i
    return first


@dataclass(frozen=True)
class StreamMemoryOps:
    """The CUDA driver's stream memory operations and 2D copies, through ctypes (no CUDA Python package)."""

    wait_value32: Any
    write_value32: Any
    memcpy: Any
    memcpy_2d: Any

    def wait(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """``stream`` waits until the uint32 at ``address`` is at least ``value`` (wrapping)."""
        check_driver(
            "cuStreamWaitValue32",
            self.wait_value32(stream.cuda_stream, address, value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ),
        )

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """``stream`` writes ``value`` to the uint32 at ``address`` once its earlier work is done."""
        check_driver(
            "cuStreamWriteValue32",
            self.write_value32(stream.cuda_stream, address, value & 0xFFFFFFFF, CU_STREAM_WRITE_VALUE_DEFAULT),
        )

    def copy_1d(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
        """``nbytes`` from ``src`` to ``dst`` (contiguous) on ``stream`` by a copy engine."""
        check_driver("cuMemcpyAsync", self.memcpy(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream))

    def copy_2d(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, rows: Rows) -> None:
        """``dst.copy_(src)`` on ``stream`` by a copy engine, as ``rows`` (``copy_rows(dst, src)``)."""
        params = Memcpy2D(
            srcMemoryType=CU_MEMORYTYPE_UNIFIED, srcDevice=src.data_ptr(), srcPitch=rows.src_pitch,
            dstMemoryType=CU_MEMORYTYPE_UNIFIED, dstDevice=dst.data_ptr(), dstPitch=rows.dst_pitch,
            WidthInBytes=rows.width, Height=rows.height,
        )  # fmt: skip
        check_driver("cuMemcpy2DAsync", self.memcpy_2d(ctypes.byref(params), stream.cuda_stream))


def check_driver(call: str, status: int) -> None:
    """Raise ``PeerExchangeError`` for a driver ``call`` that returned a nonzero ``CUresult``."""
    if status != 0:
        raise PeerExchangeError(f"{call} failed with CUresult {status}")


@functools.cache
def stream_memory_ops() -> StreamMemoryOps:
    """The driver's ``cuStreamWaitValue32_v2``, ``cuStreamWriteValue32_v2``, ``cuMemcpyAsync`` and
    ``cuMemcpy2DAsync_v2`` (``PeerExchangeError`` if absent)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        wait, write = driver.cuStreamWaitValue32_v2, driver.cuStreamWriteValue32_v2
        memcpy, memcpy_2d = driver.cuMemcpyAsync, driver.cuMemcpy2DAsync_v2
    except (OSError, AttributeError) as error:
        raise PeerExchangeError(f"the CUDA driver's stream memory operations are not available: {error}") from None
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    memcpy_2d.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]
    memcpy.restype = memcpy_2d.restype = ctypes.c_int
    return StreamMemoryOps(wait, write, memcpy, memcpy_2d)


def copy_engine_unavailable(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why the copy-engine exchange cannot run on ``group`` from ``device`` (None: it can).

    A collective: every rank of the group calls it, and every rank gets the same answer (the first
    rank's reason if any rank has one), so that all of them pick the same transport."""
    reason = local_reason(device, dist.get_world_size(group))
    mine = (socket.gethostname(), device.index if device.type == "cuda" else -1, reason)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    hosts = {host for host, _, _ in everyone}
    if len(hosts) > 1:
        return f"ranks on {len(hosts)} hosts ({', '.join(sorted(hosts))}); copy engines reach the GPUs of one host"
    for rank, (_, _, why) in enumerate(everyone):
        if why is not None:
            return f"rank {rank}: {why}"
    if reason is None:  # every rank checks its own device against every peer's
        peers = [index for _, index, _ in everyone if index != device.index]
        blocked = [p for p in peers if not torch.cuda.can_device_access_peer(device.index, p)]
        if blocked:
            reason = f"cuda:{device.index} has no peer access to cuda:{blocked}"
    reasons: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    return next((f"rank {rank}: {why}" for rank, why in enumerate(reasons) if why is not None), None)


def local_reason(device: torch.device, degree: int) -> str | None:
    """This rank's reason the copy-engine exchange cannot run (no GPU, multicast not off, too many
    ranks, no symmetric memory or driver entries), or None; ``copy_engine_unavailable`` joins them."""
    if device.type != "cuda":
        return f"tensors on {device}, not a CUDA device"
    if os.environ.get(MULTICAST_OFF_ENV, "1") != "1":
        return f"{MULTICAST_OFF_ENV}={os.environ[MULTICAST_OFF_ENV]!r}: symmetric memory would create multicast objects"
    if degree > MAX_RANKS:
        return f"more than {MAX_RANKS} ranks"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        stream_memory_ops()
    except (ImportError, PeerExchangeError) as error:
        return str(error)
    return None


class CopyEngineAllToAll:
    """All-to-all of ``[N, ...]`` pieces over one host's copy engines (see the module docstring).

    Args:
        group: the process group (``None``: the default group); every rank calls ``all_to_all`` with
            pieces of the same shape and dtype, in the same order.
        device: this rank's CUDA device.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        if device.type != "cuda":
            raise InvalidArgumentError("device", "a CUDA device", device)
        os.environ.setdefault(MULTICAST_OFF_ENV, "1")
        if os.environ[MULTICAST_OFF_ENV] != "1":
            raise PeerExchangeError(f"{MULTICAST_OFF_ENV} must be 1 for the copy-engine exchange")
        self.group = group if group is not None else dist.group.WORLD
        self.device = device
        self.rank = dist.get_rank(group)
        self.degree = dist.get_world_size(group)
        self.ops = stream_memory_ops()
        # High priority: the packing copies (kernels) and a pull that falls back to a kernel (rows
        # under MIN_ROW_BYTES) go before attention blocks queued on other streams.
        self.pack_stream = torch.cuda.Stream(device, priority=-1)
        self.transfer_stream = torch.cuda.Stream(device, priority=-1)
        self.area_bytes = 0  # one staging area: a piece for every peer
        self.buffer: torch.Tensor | None = None  # [HEADER_BYTES + STAGING_SLOTS * area_bytes] uint8, symmetric
        self.handle: Any = None
        self.header_ptrs: list[int] = []
        self.views: dict[tuple, torch.Tensor] = {}  # staging views by (rank, area, slot, shape, dtype)
        self.rows: dict[tuple, Rows | None] = {}  # copy_rows by (shape, dst strides, src strides, dtype)
        self.pending: list[Exchange] = []  # made, not launched (``defer``), in sequence order
        self.seq = 0

    # ------------------------------------------------------------------ staging
    def reserve(self, piece_bytes: int) -> None:
        """Staging areas of at least ``(N - 1) * piece_bytes`` (a collective when they grow)."""
        need = (self.degree - 1) * piece_bytes
        if need <= self.area_bytes:
            return
        import torch.distributed._symmetric_memory as symm_mem

        self.flush()  # the deferred exchanges use the old buffer (every rank grows at the same exchange)
        if self.buffer is not None:  # every pull from and into the old buffer finished everywhere
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group, device_ids=[self.device.index])
            torch.cuda.synchronize(self.device)
        area = -(-need // STAGING_ALIGN) * STAGING_ALIGN
        self.buffer = self.handle = None
        self.views = {}
        buffer = symm_mem.empty(HEADER_BYTES + STAGING_SLOTS * area, dtype=torch.uint8, device=self.device)
        buffer[:HEADER_BYTES].zero_()
        torch.cuda.synchronize(self.device)
        handle = symm_mem.rendezvous(buffer, self.group)
        # Every address below comes from the handle's views, which place each rank's buffer in this
        # process; this rank's own view must be the tensor allocated above.
        headers = [handle.get_buffer(r, (HEADER_BYTES // 4,), torch.int32, 0) for r in range(self.degree)]
        if headers[self.rank].data_ptr() != buffer.data_ptr():
            raise PeerExchangeError(
                f"symmetric memory: this rank's buffer at {headers[self.rank].data_ptr():#x}, allocated at "
                f"{buffer.data_ptr():#x}"
            )
        dist.barrier(group=self.group, device_ids=[self.device.index])  # every header zeroed
        self.buffer, self.handle, self.area_bytes, self.seq = buffer, handle, area, 0
        self.header_ptrs = [h.data_ptr() for h in headers]

    def word(self, rank: int, index: int) -> int:
        """Address (in this process) of signal word ``index`` in ``rank``'s buffer."""
        return self.header_ptrs[rank] + 4 * index

    def staging(self, rank: int, area: int, slot: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """``rank``'s staging area ``area``, piece slot ``slot`` (a peer's buffer is peer-mapped). The
        views are kept: making one costs the host tens of microseconds, and every exchange needs two."""
        key = (rank, area, slot, tuple(shape), dtype)
        view = self.views.get(key)
        if view is None:
            piece_bytes = shape.numel() * dtype.itemsize
            offset = HEADER_BYTES + area * self.area_bytes + slot * piece_bytes
            view = self.views[key] = self.handle.get_buffer(rank, tuple(shape), dtype, offset // dtype.itemsize)
        return view

    # ------------------------------------------------------------------ exchange
    def all_to_all(
        self, pieces: torch.Tensor, out: torch.Tensor | None = None, defer: bool = False
    ) -> tuple[torch.Tensor, CopyEngineWork]:
        """``pieces [N, ...]`` (piece ``j`` for rank ``j``, any strides) -> ``(recv, work)``: ``recv [N, ...]``
        holds rank ``j``'s piece for this rank at ``j`` once ``work.wait()`` ordered the current stream.

        Args:
            out: where to receive (``[N, ...]``, any strides, e.g. a slice of a larger tensor), else a
                new contiguous tensor.
            defer: prepare the exchange now (its inputs are fenced on the current stream as they are
                now) and queue its copies later: at ``flush()``, at the launch of a later exchange, or
                at ``work.wait()``. The host then reaches the caller's next kernels sooner; exchanges
                still launch in the order they were made, the same on every rank.
        """
        if pieces.device != self.device or pieces.shape[0] != self.degree:
            raise InvalidArgumentError(
                "pieces", f"[{self.degree}, ...] on {self.device}", f"{tuple(pieces.shape)} on {pieces.device}"
            )
        if out is not None and (out.shape != pieces.shape or out.dtype != pieces.dtype or out.device != self.device):
            raise InvalidArgumentError(
                "out", f"{tuple(pieces.shape)} {pieces.dtype} on {self.device}", describe_tensor(out)
            )
        self.reserve(pieces.shape[1:].numel() * pieces.dtype.itemsize)
        self.seq += 1
        recv = out if out is not None else torch.empty(pieces.shape, dtype=pieces.dtype, device=self.device)
        fence = torch.cuda.Event()
        fence.record(torch.cuda.current_stream(self.device))  # pieces written, recv's memory last used
        exchange = Exchange(self.seq, pieces, recv, fence, torch.cuda.Event(), torch.cuda.Event())
        self.pending.append(exchange)
        if not defer:
            self.flush()
        return recv, CopyEngineWork(self, exchange)

    def flush(self, through: int | None = None) -> None:
        """Queue the copies of every deferred exchange (up to sequence number ``through``), in order."""
        while self.pending and (through is None or self.pending[0].seq <= through):
            self.launch(self.pending.pop(0))

    def launch(self, exchange: Exchange) -> None:
        """Queue one exchange's copies and signals on the engine's streams. Host time matters (q, k
        and v of the next head chunk go out just before each attention is queued; one launch took
        80-240 us of host time on the device hosts), so the signals and pulls are driver calls with
        explicit streams and the packing copies are entered on their stream once."""
        pack, transfer = self.pack_stream, self.transfer_stream
        pieces, recv, seq = exchange.pieces, exchange.recv, exchange.seq
        piece_shape, dtype = pieces.shape[1:], pieces.dtype
        area, me, n = seq % STAGING_SLOTS, self.rank, self.degree
        peers = [(me + step) % n for step in range(1, n)]
        pack.wait_event(exchange.fence)
        transfer.wait_event(exchange.fence)
        for j in peers:  # every peer has pulled area `area` of exchange seq - STAGING_SLOTS
            self.ops.wait(pack, self.word(me, MAX_RANKS + j), seq - STAGING_SLOTS)
        caller = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(pack)
        try:
            for j in peers:
                copy_words(self.staging(me, area, slot(j, me), piece_shape, dtype), pieces[j])
            for j in peers:
                self.ops.write(pack, self.word(j, me), seq)
            copy_words(recv[me], pieces[me])  # the own piece, while the peers pull theirs
        finally:
            torch.cuda.set_stream(caller)
        exchange.own.record(pack)
        for j in peers:
            self.ops.wait(transfer, self.word(me, j), seq)
            self.pull(transfer, recv[j], self.staging(j, area, slot(me, j), piece_shape, dtype))
            self.ops.write(transfer, self.word(j, MAX_RANKS + me), seq)
        exchange.pulled.record(transfer)
        pieces.record_stream(pack)
        recv.record_stream(pack)
        recv.record_stream(transfer)

    def pull(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` from a peer's buffer on ``stream``, by a copy engine wherever the strides
        allow: an SM kernel on the transfer stream would wait behind an attention kernel that holds
        every SM (and hold up the pulls queued after it)."""
        key = (dst.shape, dst.stride(), src.stride(), dst.dtype)
        rows = self.rows.get(key, False)
        if rows is False:
            rows = self.rows[key] = copy_rows(dst, src)
        if rows is not None and rows.height == 1:  # one row: both contiguous
            self.ops.copy_1d(stream, dst, src, rows.width)
        elif rows is not None and rows.width >= MIN_ROW_BYTES:
            self.ops.copy_2d(stream, dst, src, rows)
        else:  # a copy kernel
            with torch.cuda.stream(stream):
                dst.copy_(src)


def copy_words(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` within this GPU on the current stream, as 16- or 8-byte words where the
    layouts allow (the bits are moved, never converted).

    The driver runs copies within one GPU as kernels (not on a copy engine, even when asked to
    overlap compute), so they wait for the SMs like any kernel; what is left to choose is a fast
    one. A 96.8 MB head-chunk piece on an H200, packed
    from rows at a pitch of 4 rows, two runs: 2-byte elements (``Tensor.copy_``, ``cuMemcpy2DAsync``)
    0.134-0.153 ms, 8-byte words 0.072-0.084 ms, 16-byte words 0.071-0.076 ms; a contiguous copy
    0.062-0.064 ms."""
    for dtype in (torch.complex128, torch.int64):  # complex128: 16 bytes the copy kernel moves whole
        wide = words(dst, dtype), words(src, dtype)
        if wide[0] is not None and wide[1] is not None:
            wide[0].copy_(wide[1])
            return
    dst.copy_(src)


def words(t: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor | None:
    """``t`` viewed as words of ``dtype`` (its last dim contiguous, every stride and the offset whole
    words), or None."""
    if t.dim() == 0 or t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % dtype.itemsize:
        return None
    try:
        return t.view(dtype)
    except RuntimeError:  # a stride or the storage offset is not a whole number of words
        return None


def slot(receiver: int, sender: int) -> int:
    """The staging slot of ``receiver``'s piece in ``sender``'s buffer (no slot for itself)."""
    return receiver - (receiver > sender)


@dataclass(eq=False)
class Exchange:
    """One all-to-all of ``CopyEngineAllToAll``: made (fenced, numbered) at once, launched in order."""

    seq: int
    pieces: torch.Tensor  # [N, ...] piece j for rank j
    recv: torch.Tensor  # [N, ...] piece j from rank j
    fence: torch.cuda.Event  # the caller's stream when it was made
    own: torch.cuda.Event  # recorded at launch: the own piece copied
    pulled: torch.cuda.Event  # recorded at launch: every peer's piece pulled


@dataclass(eq=False)
class CopyEngineWork:
    """A copy-engine exchange in flight: ``wait()`` launches it if it was deferred and orders the
    current stream after it (no host wait)."""

    engine: CopyEngineAllToAll
    exchange: Exchange

    def launch(self) -> None:
        """Queue this exchange's copies now (and those of the exchanges made before it)."""
        self.engine.flush(through=self.exchange.seq)

    def wait(self) -> bool:
        self.launch()
        stream = torch.cuda.current_stream(self.engine.device)
        stream.wait_event(self.exchange.own)
        stream.wait_event(self.exchange.pulled)
        return True
