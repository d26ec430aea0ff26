"""Context parallelism (Ulysses) for Tessera: full sequence and a slice of the heads per rank.

Under Ulysses each of ``N`` ranks holds ``S / N`` tokens outside attention. Before attention one
all-to-all trades sequence for heads (every rank gets all ``S`` tokens of ``H / N`` heads), after it
a second all-to-all trades them back. Block-sparse attention is per head, so a rank runs Tessera
on its heads with its heads' slice of the mask (``LogicalMask.select_heads``; a broadcast head dim
stays broadcast) and its own prepared plan; the result is single-process attention (bit for bit
when both pick the same plan; a plan chosen for ``H / N`` heads may round differently).

Raw function (tokens in rank chunks of the mask's token order)::

    ulysses = Ulysses()                                   # the default process group
    out = ulysses_attention(q_chunk, k_chunk, v_chunk, mask, ulysses)   # [B, S/N, H, D] each

With diffusers (the documented way)::

    processor = TesseraProcessor(sparsifier).attach(pipe.transformer)
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))
    # (either order; torch.distributed initialised, one process per GPU, e.g. with torchrun)

How it composes with diffusers 0.42.1: ``enable_parallelism`` builds the ``("ring", "ulysses")``
device mesh, installs the model's ``_cp_plan`` hooks (Wan: ``blocks.0`` hidden states and the RoPE
tables split along the sequence, ``proj_out`` gathered) and hands its ``ParallelConfig`` to every
attention processor through ``processor._parallel_config``. ``TesseraProcessor`` receives it like
the stock processors do and, instead of asking ``dispatch_attention_fn`` for diffusers' own Ulysses
(``TemplatedUlyssesAttention``), runs the two all-to-alls itself on the group of diffusers'
``ulysses`` mesh dimension. Not registering a diffusers attention backend is deliberate:

- ``AttentionBackendName`` is a closed enum and the registry a process-global table; a Tessera
  backend would have to patch both;
- ``dispatch_attention_fn`` carries a dense ``attn_mask`` tensor, not a ``LogicalMask``, and its
  Ulysses template all-gathers masks along the key axis as dense ``[.., S_kv]`` tensors;
- the sparsifier needs the whole video after the all-to-all (tiles span the whole token grid, and
  the tile permutation needs every token), which happens *inside* the backend call there.

The all-to-alls run on the copy engines where every rank is on one host with peer access
(``tessera_diffusers.peer_exchange``; no SM is taken from the attention kernels), NCCL's
``all_to_all_single`` elsewhere (``Ulysses(transport=...)``, ``TESSERA_ULYSSES_TRANSPORT``).

So the processor does (``tessera_diffusers.processors.ulysses``, on ``layout_attention`` here; this
module imports nothing of diffusers or the processors): per-token projections, QK norms and RoPE on
its ``S / N`` raster tokens (all heads; the RoPE tables come split by the ``_cp_plan``), all-to-all
to ``[B, S, H / N, D]``, tile permutation, the sparsifier's mask for its heads (a mask over all heads
is sliced), Tessera with the step cache, inverse permutation, all-to-all back, output projection.
Dense decisions (warm-up) run through ``dispatch_attention_fn`` on the rank's heads without a
parallel config.

Limits: ring attention (``ring_degree > 1``, also unified ring x Ulysses) and ``ulysses_anything``
are refused with a ``TesseraError`` — ring would need per-chunk masks merged by log-sum-exp;
HunyuanVideo-1.5 has no ``_cp_plan`` in diffusers 0.42.1 and its joint attention is refused under
context parallelism. Sparsifiers see the rank's heads only: per-head sparsifiers (SSTA, static,
dense warm-up) give exactly the single-process masks; a sparsifier whose decision couples heads
(``AdaptiveSparsifier`` chooses one block geometry from the mean over heads) decides per rank.
Inference only: the all-to-alls are not differentiable. On a CPU-only torch, diffusers 0.42.1's
``enable_parallelism`` fails with ``ZeroDivisionError`` (``rank % torch.accelerator.device_count()``
with no accelerator); the CPU tests and ``cp_scaling.py --smoke`` give it a count of 1 per process.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import config
from .errors import InvalidArgumentError, MaskError, TesseraError, describe_tensor
from .mask import LogicalMask
from .peer_exchange import CopyEngineAllToAll, PeerExchangeError, copy_engine_unavailable
from .plans import PhysicalPlan
from .runtime import Runtime

# Head chunks per rank of the pipelined exchange: two scaled best on 2 x H200 (docs/results.md,
# "Design decisions"). Each chunk's packing copies and token permutations are kernels, which cannot
# overlap a persistent attention kernel that holds every SM, so more chunks cost more.
DEFAULT_HEAD_CHUNKS = 2

# How the all-to-alls move: "copy_engine" (peer-mapped buffers pulled by the copy engines, one host;
# tessera_diffusers.peer_exchange), "nccl" (all_to_all_single) or "auto" (copy engines where every
# rank can use them, else NCCL). TESSERA_ULYSSES_TRANSPORT sets the default.
TRANSPORTS = ("auto", "copy_engine", "nccl")
TRANSPORT_ENV = config.ULYSSES_TRANSPORT_ENV


class ContextParallelError(TesseraError):
    """A context-parallel configuration or call Tessera cannot run (ring attention, uneven splits)."""


class Ulysses:
    """One rank's view of a Ulysses group, and the per-rank head slices of masks.

    Args:
        group: the process group of the Ulysses dimension (``None``: the default group).
        chunks: how a rank's heads are cut into pipelined chunks (``head_spans``): an int ``C``, the
            most equal chunks (1 exchanges all heads at once), or a sequence of positive weights,
            chunks of heads in those proportions (e.g. ``(1, 4, 4, 1)``: a small first chunk, whose
            transfer nothing hides, and a small last one, whose output travels after it).
        transport: how the all-to-alls move (``TRANSPORTS``): ``"copy_engine"`` (copy engines pulling
            from peer-mapped buffers, ranks of one host), ``"nccl"``, or ``"auto"`` (copy engines
            where every rank can use them, else NCCL; ``transport_note`` says why not). Default: the
            ``TESSERA_ULYSSES_TRANSPORT`` environment variable, else ``"auto"``.

    Rank ``r`` of ``N`` holds tokens ``[r * S/N, (r + 1) * S/N)`` outside attention and heads
    ``[r * H/N, (r + 1) * H/N)`` inside it. Slices of a mask are kept per source mask object, so
    the plan prepared for a slice is reused as long as the source mask lives.

    Pipelining: the rank's heads are cut into chunks (spans ``[start, stop)`` of its heads); chunk
    ``c`` of q, k and v travels in its own all-to-all, so attention of chunk ``c`` runs while chunk
    ``c + 1`` is in flight and the output of chunk ``c - 1`` travels back (``scatter_head_chunks``,
    ``HeadChunkGather``). Every chunk's attention is that of its heads alone, so the result is the
    unpipelined one.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        chunks: int | Sequence[int] = DEFAULT_HEAD_CHUNKS,
        transport: str | None = None,
    ):
        source = "transport" if transport is not None else TRANSPORT_ENV
        transport = transport if transport is not None else config.get("ulysses_transport")
        if transport not in TRANSPORTS:
            raise InvalidArgumentError(source, f"one of {', '.join(TRANSPORTS)}", repr(transport))
        chunks = check_chunks(chunks)
        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError("torch.distributed is not initialised (call init_process_group first)")
        self.group = group
        self.chunks = chunks
        self.transport = transport
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._pack_streams: dict[int, torch.cuda.Stream] = {}
        self._engines: dict[int, CopyEngineAllToAll | None] = {}
        self.transport_note: str | None = None  # why "auto" fell back to NCCL
        self._slices: weakref.WeakKeyDictionary[LogicalMask, dict[tuple[int, int], LogicalMask]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_parallel_config(
        cls, config: Any, chunks: int | Sequence[int] = DEFAULT_HEAD_CHUNKS, transport: str | None = None
    ) -> Ulysses | None:
        """The Ulysses group of a diffusers ``ParallelConfig`` / ``ContextParallelConfig`` (set up by
        ``enable_parallelism``); ``None`` without context parallelism. Raises ``ContextParallelError``
        for what Tessera cannot run (ring attention, ``ulysses_anything``)."""
        if config is None:
            return None
        cp = getattr(config, "context_parallel_config", config)
        if cp is None:
            return None
        ring = getattr(cp, "ring_degree", None)
        degree = getattr(cp, "ulysses_degree", None)
        if ring is None or degree is None:
            raise InvalidArgumentError(
                "parallel_config", "a diffusers ParallelConfig or ContextParallelConfig", type(config).__name__
            )
        if ring > 1:
            raise ContextParallelError(
                f"ContextParallelConfig.ring_degree: expected 1 (Ulysses only), got {ring}; ring attention would "
                "need per-chunk block masks merged by log-sum-exp, which Tessera does not implement — use "
                "ulysses_degree instead"
            )
        if getattr(cp, "ulysses_anything", False):
            raise ContextParallelError(
                "ContextParallelConfig.ulysses_anything: expected False, got True; Tessera's Ulysses needs equal "
                "sequence chunks and heads divisible by ulysses_degree"
            )
        mesh = getattr(cp, "_ulysses_mesh", None)
        if mesh is None:
            raise ContextParallelError(
                "ContextParallelConfig: expected a config set up by transformer.enable_parallelism(...) "
                "(it builds the device mesh), got one without a ulysses mesh"
            )
        ulysses = cls(mesh.get_group(), chunks, transport)
        if ulysses.degree != degree:
            raise ContextParallelError(
                f"ulysses mesh: expected {degree} ranks (ulysses_degree), got a group of {ulysses.degree}"
            )
        return ulysses

    # ------------------------------------------------------------------ heads
    def head_range(self, heads: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's heads out of ``heads``."""
        if heads % self.degree:
            raise InvalidArgumentError(
                "heads", f"a multiple of the Ulysses degree {self.degree}", heads, hint="pick another ulysses_degree"
            )
        per_rank = heads // self.degree
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def local_mask(self, mask: LogicalMask, heads: int) -> LogicalMask:
        """This rank's part of ``mask`` for an attention over ``heads`` heads.

        A head dim of 1 broadcasts and is returned as is; ``heads`` heads are sliced to this rank's
        (one slice object per source mask, contiguous so its bytes are its own); ``heads / N`` heads
        are taken to be this rank's already (a sparsifier that ran on this rank's q and k)."""
        if not isinstance(mask, LogicalMask):
            raise MaskError("mask", "a tessera_diffusers.LogicalMask", type(mask).__name__)
        start, stop = self.head_range(heads)
        if mask.heads == 1 or self.degree == 1 or (mask.heads == stop - start and mask.heads != heads):
            return mask
        if mask.heads != heads:
            raise MaskError(
                "mask head dim", f"1, {heads} (all heads) or {stop - start} (this rank's heads)", mask.heads
            )
        return self.head_slice(mask, start, stop)

    def head_slice(self, mask: LogicalMask, start: int, stop: int) -> LogicalMask:
        """Heads ``[start, stop)`` of ``mask`` as a mask of its own (contiguous, so its bytes are its
        own), one object per source mask and range: a plan prepared for it lives as long as the
        source. A broadcast head dim (1) is returned as is."""
        if mask.heads == 1 or (start, stop) == (0, mask.heads):
            return mask
        per_mask = self._slices.setdefault(mask, {})
        part = per_mask.get((start, stop))
        if part is None:
            view = mask.select_heads(start, stop)
            part = LogicalMask(view.blocks.contiguous(), view.block_q, view.block_kv, view.seq_len_q, view.seq_len_kv)
            per_mask[(start, stop)] = part
        return part

    def head_spans(self, heads: int) -> tuple[tuple[int, int], ...]:
        """The chunks this rank's ``heads / N`` heads of ``heads`` are pipelined in, as ``[start, stop)``
        of them: for an int ``chunks``, the largest divisor of ``heads / N`` that is at most
        ``chunks`` equal chunks; for weights, chunks in their proportions (rounded, at least one head
        each, fewer chunks where there are fewer heads than weights)."""
        start, stop = self.head_range(heads)
        local = stop - start
        if isinstance(self.chunks, int):
            count = max(c for c in range(1, min(self.chunks, local) + 1) if local % c == 0)
            return even_spans(local, count)
        total, bounds, acc = sum(self.chunks), [0], 0
        for w in self.chunks:
            acc += w
            bound = min(local, max(bounds[-1] + 1, round(acc * local / total)))
            if bound > bounds[-1]:
                bounds.append(bound)
        return tuple(itertools.pairwise(bounds))

    def head_chunks(self, heads: int) -> int:
        """How many chunks this rank's ``heads / N`` heads of ``heads`` are pipelined in (``head_spans``)."""
        return len(self.head_spans(heads))

    def spans(self, local_heads: int, chunks: int | Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """``chunks`` as spans of a rank's ``local_heads`` heads: ``C`` equal chunks (``C`` must divide
        them), or spans ``[start, stop)`` that cover them in order."""
        if isinstance(chunks, int) and not isinstance(chunks, bool):
            if chunks < 1 or local_heads < chunks or local_heads % chunks:
                raise InvalidArgumentError("chunks", f"a divisor of this rank's {local_heads} heads", chunks)
            return even_spans(local_heads, chunks)
        spans = tuple((int(a), int(b)) for a, b in chunks)
        if (
            not spans
            or spans[0][0] != 0
            or spans[-1][1] != local_heads
            or any(a >= b for a, b in spans)
            or any(spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1))
        ):
            raise InvalidArgumentError(
                "chunks", f"an int or spans [start, stop) covering this rank's {local_heads} heads in order", chunks
            )
        return spans

    def chunk_mask(self, local: LogicalMask, span: tuple[int, int]) -> LogicalMask:
        """The part of this rank's mask (``local``, ``H / N`` heads or 1) for the head chunk ``span``
        (``[start, stop)`` of the rank's heads)."""
        start, stop = span
        if local.heads == 1:
            return local
        if stop > local.heads:
            raise MaskError("mask head dim", f"at least the head chunk's end {stop}", local.heads)
        return self.head_slice(local, start, stop)

    # ------------------------------------------------------------------ all-to-all
    def scatter_heads(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Sequence chunks in, head slices out: each ``[B, S/N, H, D]`` -> ``[B, S, H/N, D]`` (the
        chunks of ranks ``0..N-1`` in order). The exchanges are issued together, then awaited."""
        return [pending.wait() for pending in self.scatter_heads_async(*tensors)]

    def scatter_heads_async(self, *tensors: torch.Tensor) -> list[PendingExchange]:
        """``scatter_heads`` without waiting: work queued before a ``wait()`` overlaps the transfer."""
        for i, t in enumerate(tensors):
            check_4d(f"tensors[{i}]", t)
            self.head_range(t.shape[2])
        return [self.exchange_async(t, scatter_dim=2, gather_dim=1) for t in tensors]

    def scatter_head_chunks(self, x: torch.Tensor, chunks: int | Sequence[tuple[int, int]]) -> list[PendingExchange]:
        """``x [B, S/N, H, D]`` -> one exchange per head chunk (``spans``: ``C`` equal chunks or spans
        ``[start, stop)`` of each rank's ``H/N`` heads), each arriving as ``[B, S, stop - start, D]``:
        this rank's heads of the chunk. Issued in chunk order; chunks of several tensors interleave
        when called chunk by chunk (``scatter_interleaved``)."""
        return [pending for (pending,) in self.scatter_interleaved((x,), chunks)]

    def scatter_interleaved(
        self, tensors: Sequence[torch.Tensor], chunks: int | Sequence[tuple[int, int]], defer_later: bool = False
    ) -> list[list[PendingExchange]]:
        """``scatter_head_chunks`` of several tensors, issued chunk by chunk (``q_0, k_0, v_0, q_1, ...``)
        so that chunk 0 of every tensor arrives first. Returns ``[chunk][tensor]``.

        ``defer_later``: the copy engines take chunks after the first when the caller waits for them,
        launches them (``PendingExchange.launch``) or calls ``flush()`` (made now, so they see the
        tensors as they are now): the host queues the first chunk's work sooner. The caller must
        wait for or flush every exchange."""
        spans = None
        for i, t in enumerate(tensors):
            check_4d(f"tensors[{i}]", t)
            start, stop = self.head_range(t.shape[2])
            spans = self.spans(stop - start, chunks)
        return [
            [self.exchange_heads(t, span, len(spans) == 1, defer=defer_later and c > 0) for t in tensors]
            for c, span in enumerate(spans or ())
        ]

    def flush(self) -> None:
        """Launch every deferred exchange (``scatter_interleaved(defer_later=True)``)."""
        for engine in self._engines.values():
            if engine is not None:
                engine.flush()

    def exchange_heads(
        self, x: torch.Tensor, span: tuple[int, int], whole: bool = False, defer: bool = False
    ) -> PendingExchange:
        """Heads ``span`` (``[start, stop)``) of every rank's heads of ``x [B, S/N, H, D]``, all-to-all'd
        to ``[B, S, stop - start, D]`` (``whole``: the span is all of a rank's heads; ``defer``: see
        ``scatter_interleaved``; NCCL exchanges are never deferred)."""
        if self.degree == 1 and whole:
            return PendingExchange(x, x, None, 1)
        n, heads = self.degree, x.shape[2]
        # [B, S/N, N, H/N, D] -> piece j = rank j's heads of the span -> [N, B, S/N, h, D]
        pieces = x.unflatten(2, (n, heads // n))[:, :, :, span[0] : span[1]].movedim(2, 0)
        engine = self.copy_engine(x.device)
        if engine is not None:  # packs and pulls on the engine's own streams
            return PendingExchange(pieces, *engine.all_to_all(pieces, defer=defer), 1)
        send = torch.empty(pieces.shape, dtype=x.dtype, device=x.device)  # on the caller's stream
        recv = torch.empty_like(send) if n > 1 else None
        side = self.pack_stream(x.device)
        if side is None:
            send.copy_(pieces)
            work = None if n == 1 else dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        else:
            # The packing copy (memory-bound) and the transfer on a side stream: they overlap the
            # attention kernels of earlier chunks instead of preceding them on the caller's stream.
            side.wait_stream(torch.cuda.current_stream(x.device))
            x.record_stream(side)  # x may be freed by the caller before the side stream reads it
            with torch.cuda.stream(side):
                send.copy_(pieces)
                work = None if n == 1 else dist.all_to_all_single(recv, send, group=self.group, async_op=True)
            if work is None:  # the caller's stream must see the copy (with a transfer, wait() orders it)
                torch.cuda.current_stream(x.device).wait_stream(side)
        if n == 1:
            return PendingExchange(send, send[0], None, 1)
        return PendingExchange(send, recv, work, 1)

    def pack_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of the pipelined exchanges on a CUDA device (None on the CPU)."""
        if device.type != "cuda":
            return None
        stream = self._pack_streams.get(device.index)
        if stream is None:
            stream = self._pack_streams[device.index] = torch.cuda.Stream(device)
        return stream

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``scatter_heads``: ``[B, S, H/N, D]`` -> ``[B, S/N, H, D]``."""
        check_4d("x", x)
        if x.shape[1] % self.degree:
            raise InvalidArgumentError("x", f"a sequence divisible by the Ulysses degree {self.degree}", x.shape[1])
        return self.exchange([x], scatter_dim=1, gather_dim=2)[0]

    def gather_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """Log-sum-exp back to sequence chunks: ``[B, H/N, S]`` -> ``[B, H, S/N]``."""
        if not isinstance(lse, torch.Tensor) or lse.dim() != 3 or lse.shape[2] % self.degree:
            raise InvalidArgumentError(
                "lse", f"a [B, H/N, S] tensor with S divisible by {self.degree}", describe_tensor(lse)
            )
        return self.exchange([lse], scatter_dim=2, gather_dim=1)[0]

    def exchange(self, tensors: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int) -> list[torch.Tensor]:
        """All-to-all: dim ``scatter_dim`` is cut into ``N`` equal pieces, piece ``j`` goes to rank
        ``j``; the pieces received are concatenated along ``gather_dim`` in rank order."""
        pending = [self.exchange_async(x, scatter_dim, gather_dim) for x in tensors]
        return [p.wait() for p in pending]

    def exchange_async(self, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> PendingExchange:
        """``exchange`` of one tensor, issued and not awaited."""
        if self.degree == 1:
            return PendingExchange(x, x, None, gather_dim)
        n = self.degree
        pieces = x.unflatten(scatter_dim, (n, x.shape[scatter_dim] // n)).movedim(scatter_dim, 0)
        return self.all_to_all(pieces, gather_dim)

    def all_to_all(self, pieces: torch.Tensor, gather_dim: int, into: torch.Tensor | None = None) -> PendingExchange:
        """Piece ``j`` of ``pieces [N, ...]`` to rank ``j`` (copy engines or NCCL), not awaited. ``into``
        (``[N, ...]``, any strides): where the copy engines may deliver the pieces directly
        (``PendingExchange.delivered``); NCCL receives into a buffer of its own."""
        engine = self.copy_engine(pieces.device)
        if engine is not None:
            return PendingExchange(pieces, *engine.all_to_all(pieces, out=into), gather_dim, into is not None)
        send = pieces.contiguous()
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        return PendingExchange(send, recv, work, gather_dim)

    def copy_engine(self, device: torch.device) -> CopyEngineAllToAll | None:
        """The copy-engine exchange of ``device`` (None: NCCL). Chosen at the first exchange on a
        device, by every rank together: ``"auto"`` takes it where every rank is on one host with peer
        access, ``"copy_engine"`` raises ``PeerExchangeError`` where it cannot run."""
        if self.transport == "copy_engine" and self.degree > 1 and device.type != "cuda":
            raise PeerExchangeError(f"transport='copy_engine': tensors on {device}, not a CUDA device")
        if self.transport == "nccl" or self.degree == 1 or device.type != "cuda":
            return None
        if device.index not in self._engines:
            reason = copy_engine_unavailable(self.group, device)
            if reason is not None and self.transport == "copy_engine":
                raise PeerExchangeError(f"transport='copy_engine' cannot run: {reason}")
            self.transport_note = reason
            self._engines[device.index] = None if reason else CopyEngineAllToAll(self.group, device)
        return self._engines[device.index]

    def transport_in_use(self, device: torch.device) -> str:
        """``"copy_engine"`` or ``"nccl"``: what exchanges on ``device`` use (decides it if not yet)."""
        return "nccl" if self.copy_engine(device) is None else "copy_engine"

    def __repr__(self) -> str:
        return f"Ulysses(rank={self.rank}, degree={self.degree})"


@dataclass(eq=False)
class PendingExchange:
    """An all-to-all in flight (the send buffer is kept alive with it); ``wait()`` returns the
    received pieces concatenated along the gather dim (on a GPU the wait orders the current stream
    after the transfer and does not block the host)."""

    send: torch.Tensor  # [N, ...] piece j for rank j
    recv: torch.Tensor  # [N, ...] piece j from rank j
    work: Any  # torch.distributed Work, None without a transfer (degree 1)
    gather_dim: int
    delivered: bool = False  # recv is the destination the caller asked for (``Ulysses.all_to_all(into=)``)

    def launch(self) -> None:
        """Queue a deferred copy-engine exchange now, and the ones made before it (a no-op otherwise)."""
        launch = getattr(self.work, "launch", None)
        if launch is not None:
            launch()

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return self.recv
        self.work.wait()
        # recv[j] is rank j's piece: [N, ...] -> N just before the gather dim, then merged into it.
        return self.recv.movedim(0, self.gather_dim).flatten(self.gather_dim, self.gather_dim + 1)


class HeadChunkGather:
    """The way back of a pipelined attention: each head chunk's output ``[B, S, h, D]`` is sent as
    soon as it is computed (``send``); ``result()`` waits for all and assembles ``[B, S/N, H, D]``
    (every rank's chunks in their head order), unpacking each chunk as soon as the next is sent."""

    def __init__(self, ulysses: Ulysses, chunks: int | Sequence[tuple[int, int]]):
        """``chunks``: as ``Ulysses.scatter_head_chunks`` takes them (``C`` equal chunks, or spans)."""
        self.ulysses, self.given = ulysses, chunks
        self.spans: tuple[tuple[int, int], ...] | None = None  # known at the first send (from its heads)
        self.chunks = chunks if isinstance(chunks, int) else len(chunks)
        self.out: torch.Tensor | None = None
        self.in_flight: list[tuple[int, PendingExchange]] = []
        self.sent: set[int] = set()

    def send(self, chunk: int, x: torch.Tensor) -> None:
        """Chunk ``chunk``'s output ``x [B, S, h, D]`` (tokens in rank-chunk order) on its way back."""
        check_4d("x", x)
        n, (b, seq, per_chunk, d) = self.ulysses.degree, x.shape
        if seq % n:
            raise InvalidArgumentError("x", f"a sequence divisible by the Ulysses degree {n}", seq)
        if not 0 <= chunk < self.chunks or chunk in self.sent:
            raise InvalidArgumentError("chunk", f"a chunk in [0, {self.chunks}) not sent yet", chunk)
        if self.spans is None:  # equal chunks: the rank's heads from this one's
            local = self.chunks * per_chunk if isinstance(self.given, int) else self.given[-1][1]
            self.spans = self.ulysses.spans(local, self.given)
        start, stop = self.spans[chunk]
        if self.out is None:
            self.out = x.new_empty(b, seq // n, n * self.spans[-1][1], d)
        if per_chunk != stop - start or self.out.shape[0] != b or self.out.shape[3] != d:
            raise InvalidArgumentError(
                "x", f"[{self.out.shape[0]}, {seq}, {stop - start}, {self.out.shape[3]}] (chunk {chunk}'s heads)",
                tuple(x.shape),
            )  # fmt: skip
        self.sent.add(chunk)
        self.unpack_ready()
        pieces = x.unflatten(1, (n, seq // n)).movedim(1, 0)  # contiguous at B = 1
        if n == 1:
            self.in_flight.append((chunk, PendingExchange(pieces, pieces, None, 0)))
            return
        # Copy engines deliver every rank's piece straight into its heads of the output.
        self.in_flight.append((chunk, self.ulysses.all_to_all(pieces, 0, into=self.target(chunk).movedim(2, 0))))

    def target(self, chunk: int) -> torch.Tensor:
        """``[B, S/N, N, h, D]``: the output's heads of chunk ``chunk``, for each rank ``j`` (out heads
        are ordered (rank j, head of its chunk))."""
        start, stop = self.spans[chunk]
        return self.out.unflatten(2, (self.ulysses.degree, -1))[:, :, :, start:stop]

    def unpack_ready(self, keep: int = 1) -> None:
        """Unpack all but the newest ``keep`` chunks in flight (their transfers were queued earlier)."""
        while len(self.in_flight) > keep:
            chunk, pending = self.in_flight.pop(0)
            if pending.work is not None:
                pending.work.wait()
            if not pending.delivered:  # recv[j] = rank j's heads of chunk c
                self.target(chunk).copy_(pending.recv.movedim(0, 2))

    def result(self) -> torch.Tensor:
        """``[B, S/N, H, D]`` once every chunk was sent."""
        if len(self.sent) != self.chunks:
            missing = sorted(set(range(self.chunks)) - self.sent)
            raise InvalidArgumentError("HeadChunkGather", f"all {self.chunks} chunks sent", f"chunks {missing} missing")
        self.unpack_ready(keep=0)
        return self.out


def even_spans(heads: int, count: int) -> tuple[tuple[int, int], ...]:
    """``count`` equal spans ``[start, stop)`` of ``heads`` heads (``count`` divides ``heads``)."""
    size = heads // count
    return tuple((c * size, (c + 1) * size) for c in range(count))


def check_chunks(chunks: Any) -> int | tuple[int, ...]:
    """``Ulysses``' ``chunks``: an int >= 1 or a non-empty sequence of positive int weights."""
    if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1:
        return chunks
    if (
        isinstance(chunks, (tuple, list))
        and chunks
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in chunks)
    ):
        return tuple(chunks)
    raise InvalidArgumentError("chunks", "an int >= 1 or a sequence of positive int weights", repr(chunks))


def check_4d(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise InvalidArgumentError(name, "a [B, S, H, D] tensor", describe_tensor(t))


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LogicalMask,
    ulysses: Ulysses,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    plan: PhysicalPlan | None = None,
    runtime: Runtime | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of a sequence split over a Ulysses group.

    Equal to ``block_sparse_attention`` on the concatenation of every rank's chunk.

    Args:
        q: ``[B, S/N, H, D]``, this rank's tokens ``[r * S/N, (r + 1) * S/N)`` of the mask's token
            order; k, v: ``[B, S_kv/N, H, D]`` likewise (``S_kv = S`` for self-attention).
        mask: ``LogicalMask`` over the whole ``(S, S_kv)`` with ``H`` heads (sliced to this rank's),
            1 head (broadcast) or ``H/N`` heads (this rank's already).
        ulysses: the group (``Ulysses(group)``).
        scale, return_lse, plan: as for ``block_sparse_attention``.
        runtime: a ``Runtime`` whose plan cache to use; pass one per rank to reuse prepared plans.

    Returns:
        out ``[B, S/N, H, D]`` (and, with ``return_lse``, lse ``[B, H, S/N]`` fp32).
    """
    check_4d("q", q)
    heads = q.shape[2]
    local = ulysses.local_mask(mask, heads)
    runtime = runtime or Runtime()
    if return_lse:  # one exchange of all heads (the log-sum-exp travels back with the output)
        q_h, k_h, v_h = ulysses.scatter_heads(q, k, v)  # [B, S, H/N, D]
        out, lse = runtime.attention(q_h, k_h, v_h, local, scale=scale, return_lse=True, plan=plan)
        return ulysses.gather_heads(out), ulysses.gather_lse(lse)

    def attend(chunk, q_c, k_c, v_c, mask_c):  # one head chunk, [B, S, H/(N C), D]
        return runtime.attention(q_c, k_c, v_c, mask_c, scale=scale, plan=plan)

    return layout_attention(ulysses, q, k, v, RASTER_ORDER, attend, mask=local)


class RasterOrder:
    """The token order of the sequence chunks itself (``layout_attention`` with no permutation)."""

    @staticmethod
    def to_layout(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def to_raster(x: torch.Tensor) -> torch.Tensor:
        return x


RASTER_ORDER = RasterOrder()


def layout_attention(
    ulysses: Ulysses,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Any,
    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, LogicalMask], torch.Tensor],
    *,
    mask: LogicalMask | None = None,
    make_mask: Callable[[torch.Tensor, torch.Tensor], LogicalMask | None] | None = None,
    keep: Callable[[LogicalMask | None], LogicalMask | None] | None = None,
    dense: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    separable: bool = False,
) -> torch.Tensor:
    """Attention of ``[B, S/N, H, D]`` raster chunks of q, k, v whose mask is over a token permutation
    (``layout.to_layout`` / ``to_raster``, e.g. a sparsifier's tile order), pipelined in head chunks.

    Args:
        attend: ``attend(chunk, q, k, v, mask) -> out``, ``[B, S, h, D]`` in layout order, for one
            head chunk of this rank's heads and its part of the mask.
        mask: the mask of this rank's heads (or all heads, or broadcast) when known before the
            exchange: q, k and v then travel chunk by chunk and chunk ``c`` is attended while ``c + 1``
            is in flight.
        make_mask: otherwise ``make_mask(q, k) -> LogicalMask | None`` on heads of this rank in layout
            order: on all of them (all of q and k travel first, v's chunks arrive while it runs) or,
            with ``separable`` (the sparsifier's ``head_separable``), on each head chunk as it arrives,
            the chunks' masks joined along the heads. None is a dense decision, served by
            ``dense(q, k, v)``.
        keep: ``keep(mask) -> mask``, called once with the new mask of this rank's heads before any
            attention (e.g. to store it); the identity if not given.

    Returns ``[B, S/N, H, D]`` raster chunks; outputs travel back per chunk."""
    heads = query.shape[2]
    spans = ulysses.head_spans(heads)
    keep = keep or (lambda m: m)
    if mask is not None:  # -> [B, S, h, D] per chunk, raster order; later chunks launched in the loop below
        incoming = ulysses.scatter_interleaved((query, key, value), spans, defer_later=True)
    elif make_mask is None:
        raise InvalidArgumentError("make_mask", "a callable when no mask is given", None)
    elif separable and len(spans) > 1:  # the sparsifier on each head chunk as it arrives
        incoming, masks = ulysses.scatter_interleaved((query, key, value), spans), []
        for parts in incoming:
            parts[:2] = (layout.to_layout(p.wait()) for p in parts[:2])
            masks.append(make_mask(*parts[:2]))
        mask = keep(join_head_chunks(masks, [stop - start for start, stop in spans]))
    else:
        q_all, k_all = ulysses.scatter_heads_async(query, key)
        incoming = [[None, None, v_c] for v_c in ulysses.scatter_head_chunks(value, spans)]
        q_all, k_all = layout.to_layout(q_all.wait()), layout.to_layout(k_all.wait())
        mask = keep(make_mask(q_all, k_all))  # overlaps v's transfer
        for (start, stop), parts in zip(spans, incoming):
            parts[:2] = q_all[:, :, start:stop], k_all[:, :, start:stop]
    if mask is None and dense is None:
        raise InvalidArgumentError("dense", "a callable for make_mask's dense decisions", None)
    local = None if mask is None else ulysses.local_mask(mask, heads)
    back = HeadChunkGather(ulysses, spans)
    for c, parts in enumerate(incoming):
        q_c, k_c, v_c = (p if isinstance(p, torch.Tensor) else layout.to_layout(p.wait()) for p in parts)
        # The next chunk's exchanges go out before this chunk's attention is queued: their packing
        # copies are kernels, which run before a kernel that holds every SM or after it, never beside
        # it; queued first, they leave the whole attention to the copy engines' pulls. (Exchanges
        # launch in the order they were made, so with more than 2 chunks the first output's exchange
        # takes the chunks after the next one with it, once the first attention is queued.)
        for p in incoming[c + 1] if c + 1 < len(incoming) else ():
            if isinstance(p, PendingExchange):
                p.launch()
        if local is None:  # a dense decision, chunk by chunk
            out = dense(q_c, k_c, v_c)
        else:
            out = attend(c, q_c, k_c, v_c, ulysses.chunk_mask(local, spans[c]))
        back.send(c, layout.to_raster(out))
    return back.result()


def join_head_chunks(masks: Sequence[LogicalMask | None], heads_per_chunk: int | Sequence[int]) -> LogicalMask | None:
    """One mask over the heads of consecutive head chunks from each chunk's mask (``heads_per_chunk``
    heads, one count for all chunks or one per chunk, or 1 each); None when every chunk's decision
    was dense."""
    if all(m is None for m in masks):
        return None
    if any(m is None for m in masks):
        raise ContextParallelError(
            "sparsifier: a dense decision (None) for some head chunks and a mask for others; a head_separable "
            "sparsifier must decide the same way for every head"
        )
    first = masks[0]
    if all(m is first for m in masks) and first.heads == 1:
        return first
    counts = [heads_per_chunk] * len(masks) if isinstance(heads_per_chunk, int) else list(heads_per_chunk)
    batch = max(m.batch for m in masks)
    blocks = []
    for i, (m, count) in enumerate(zip(masks, counts, strict=True)):
        if (
            m.heads not in (1, count)
            or m.geometry_name != first.geometry_name
            or (m.seq_len_q, m.seq_len_kv) != (first.seq_len_q, first.seq_len_kv)
        ):
            raise MaskError(
                f"sparsifier result of head chunk {i}",
                f"{first.geometry_name} over ({first.seq_len_q}, {first.seq_len_kv}) with 1 or {count} heads",
                f"{m.geometry_name} over ({m.seq_len_q}, {m.seq_len_kv}) with {m.heads} heads",
            )
        blocks.append(m.blocks.expand(batch, count, *m.blocks.shape[2:]))
    return LogicalMask(torch.cat(blocks, dim=1), first.block_q, first.block_kv, first.seq_len_q, first.seq_len_kv)
