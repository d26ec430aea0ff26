"""Which copies run beside a persistent Tessera attention kernel, and which wait for it to end.

    python benchmarks/copies_beside_attention.py [--out DIR] [--heads 10]

One GPU. A persistent attention kernel holds every SM until it ends, so a copy that the driver runs as
a kernel waits behind it, while a copy engine's copy runs beside it. The Ulysses exchange
(``tessera_diffusers.peer_exchange``) relies on the second. For each way of copying one Wan2.1 720p
head-chunk piece (37,800 tokens x 10 heads x 128, bf16, 96.8 MB), this times:
- the copy alone, on a high-priority side stream;
- the copy queued on that stream just after an attention call (Wan2.1 720p, SSTA masks at 10%,
  ``--heads`` heads) is queued on the main stream: when the copy ends and how long the attention
  takes, both from the attention's start.

A copy that ends in the attention's first half ran beside it; one that ends near or after the
attention's end waited for SMs (it ran in the kernel's tail or behind it). With a second GPU visible,
pulls from it (the exchange's peer copies) are timed the same way.
Rank-free; prints a table and writes ``copies_beside_attention.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

import torch

from tessera_diffusers.peer_exchange import copy_rows, copy_words, stream_memory_ops, words
from tessera_diffusers.runtime import Runtime
from tessera_diffusers.sparsifiers import LatentGrid, SSTASparsifier, top_k_for_block_density

GRID = LatentGrid(21, 45, 80)
HEADS_ALL, HEAD_DIM = 40, 128


# The batched copies of CUDA 12.8+ take CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE, a hint that the
# driver should use a copy engine. Their structures (cuda.h), for ctypes:
class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]  # fmt: skip


class Memcpy3DPointer(ctypes.Structure):
    _fields_ = [
        ("ptr", ctypes.c_uint64), ("rowLength", ctypes.c_size_t), ("layerHeight", ctypes.c_size_t),
        ("locHint", MemLocation),
    ]  # fmt: skip


class Memcpy3DOperand(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("ptr", Memcpy3DPointer)]  # the union's array member is as large


class Memcpy3DBatchOp(ctypes.Structure):
    _fields_ = [
        ("src", Memcpy3DOperand), ("dst", Memcpy3DOperand),
        ("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t),
        ("srcAccessOrder", ctypes.c_int), ("flags", ctypes.c_uint),
    ]  # fmt: skip


SRC_ACCESS_ORDER_STREAM, OPERAND_POINTER, PREFER_OVERLAP_WITH_COMPUTE = 0x1, 0x1, 0x1


def batched_copy(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` by ``cuMemcpyBatchAsync`` (contiguous) or ``cuMemcpy3DBatchAsync`` (rows),
    with the prefer-overlap hint."""
    driver = ctypes.CDLL("libcuda.so.1")
    rows = copy_rows(dst, src)
    if rows.height == 1:
        fn = driver.cuMemcpyBatchAsync_v2
        fn.restype = ctypes.c_int
        attrs = MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM, flags=PREFER_OVERLAP_WITH_COMPUTE)
        status = fn(
            (ctypes.c_uint64 * 1)(dst.data_ptr()), (ctypes.c_uint64 * 1)(src.data_ptr()),
            (ctypes.c_size_t * 1)(rows.width), ctypes.c_size_t(1), ctypes.byref(attrs),
            (ctypes.c_size_t * 1)(0), ctypes.c_size_t(1), ctypes.c_void_p(stream.cuda_stream),
        )  # fmt: skip
    else:
        fn = driver.cuMemcpy3DBatchAsync_v2
        fn.restype = ctypes.c_int
        op = Memcpy3DBatchOp(
            src=Memcpy3DOperand(OPERAND_POINTER, Memcpy3DPointer(src.data_ptr(), rows.src_pitch, 0)),
            dst=Memcpy3DOperand(OPERAND_POINTER, Memcpy3DPointer(dst.data_ptr(), rows.dst_pitch, 0)),
            width=rows.width, height=rows.height, depth=1,
            srcAccessOrder=SRC_ACCESS_ORDER_STREAM, flags=PREFER_OVERLAP_WITH_COMPUTE,
        )  # fmt: skip
        status = fn(ctypes.c_size_t(1), ctypes.byref(op), ctypes.c_ulonglong(0), ctypes.c_void_p(stream.cuda_stream))
    if status != 0:
        raise RuntimeError(f"batched copy failed with CUresult {status}")


def copies(device: torch.device) -> dict:
    """name -> (dst, src, how): the copies of one piece; ``how``: 'driver' (``cuMemcpyAsync`` /
    ``cuMemcpy2DAsync``), 'batched' (with the prefer-overlap hint), 'kernel' or 'words'."""
    tokens, per_chunk = GRID.num_tokens // 2, 10
    x = torch.randn(1, tokens, HEADS_ALL, HEAD_DIM, device=device, dtype=torch.bfloat16)
    piece = x[:, :, :per_chunk]  # rows of 10 x 128 at a pitch of 40 x 128 (a pack's source)
    flat = torch.randn(piece.shape, device=device, dtype=torch.bfloat16)
    flat2 = torch.empty_like(flat)
    out = torch.empty_like(x)
    unpack = out[:, :, :per_chunk]
    peer = {}
    if torch.cuda.device_count() > 1:  # a peer's piece, pulled as the exchange does
        remote = flat.to(torch.device("cuda", 1))
        flat2.copy_(remote)  # peer access on
        peer = {
            "peer pull (other GPU -> contiguous), cuMemcpyAsync": (flat2, remote, "driver"),
            "peer pull (other GPU -> strided), cuMemcpy2DAsync": (unpack, remote, "driver"),
        }
    table = {
        **peer,
        "contiguous, cuMemcpyAsync": (flat2, flat, "driver"),
        "contiguous, cuMemcpyBatchAsync (prefer overlap)": (flat2, flat, "batched"),
    }
    methods = {
        "driver": "cuMemcpy2DAsync",
        "batched": "cuMemcpy3DBatchAsync (prefer overlap)",
        "kernel": "Tensor.copy_",
        "words": "Tensor.copy_ of 8-byte words",
        "words16": "Tensor.copy_ of 16-byte words (copy_words)",
        "rows": "index_select(out=) / index_copy_ of rows",
    }
    for way, (dst, src) in {
        "pack (strided -> contiguous)": (flat, piece),
        "unpack (contiguous -> strided)": (unpack, flat),
    }.items():
        table.update({f"{way}, {label}": (dst, src, how) for how, label in methods.items()})
    return table


def copy_by_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` as a row gather (``index_select(out=)``) or scatter (``index_copy_``)."""
    rows = copy_rows(dst, src)
    row_words = rows.width // 8
    if dst.is_contiguous():  # gather strided rows of src into dst
        step = rows.src_pitch // rows.width
        base = src.view(torch.int64).as_strided(((rows.height - 1) * step + 1, row_words), (row_words, 1))
        index = torch.arange(rows.height, device=src.device) * step
        torch.index_select(base, 0, index, out=dst.view(torch.int64).view(rows.height, row_words))
    else:  # scatter src's rows into dst's strided rows
        step = rows.dst_pitch // rows.width
        base = dst.view(torch.int64).as_strided(((rows.height - 1) * step + 1, row_words), (row_words, 1))
        index = torch.arange(rows.height, device=dst.device) * step
        base.index_copy_(0, index, src.view(torch.int64).view(rows.height, row_words))


def issue(how: str, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
    if how == "driver":
        rows, ops = copy_rows(dst, src), stream_memory_ops()
        if rows.height == 1:
            ops.copy_1d(stream, dst, src, rows.width)
        else:
            ops.copy_2d(stream, dst, src, rows)
    elif how == "batched":
        batched_copy(stream, dst, src)
    elif how == "words":
        with torch.cuda.stream(stream):
            words(dst).copy_(words(src))
    elif how == "words16":
        with torch.cuda.stream(stream):
            copy_words(dst, src)
    elif how == "rows":
        with torch.cuda.stream(stream):
            copy_by_rows(dst, src)
    else:
        with torch.cuda.stream(stream):
            dst.copy_(src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--heads", type=int, default=10, help="heads of the attention call")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    base = SSTASparsifier(tile=(6, 8, 8), window=(1, 3, 3))
    sparsifier = SSTASparsifier(tile=(6, 8, 8), window=(1, 3, 3), top_k=top_k_for_block_density(base, GRID, 0.10))
    layout = sparsifier.layout(GRID)
    shape = (1, GRID.num_tokens, args.heads, HEAD_DIM)
    q, k, v = (layout.to_layout(torch.randn(shape, device=device).to(torch.bfloat16)) for _ in range(3))
    mask = sparsifier(q, k, layer=0, step=0, grid=GRID)
    runtime = Runtime()
    main_stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device, priority=-1)
    table = copies(device)

    def events(n):
        return [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    def attention_alone() -> float:
        a0, a1 = events(2)
        a0.record(main_stream)
        runtime.attention(q, k, v, mask)
        a1.record(main_stream)
        torch.cuda.synchronize(device)
        return a0.elapsed_time(a1)

    def copy_alone(dst, src, how) -> float:
        c0, c1 = events(2)
        c0.record(side)
        issue(how, side, dst, src)
        c1.record(side)
        torch.cuda.synchronize(device)
        return c0.elapsed_time(c1)

    def beside(dst, src, how) -> tuple[float, float]:
        a0, a1, c1 = events(3)
        a0.record(main_stream)
        runtime.attention(q, k, v, mask)
        a1.record(main_stream)
        side.wait_event(a0)
        issue(how, side, dst, src)
        c1.record(side)
        torch.cuda.synchronize(device)
        return a0.elapsed_time(a1), a0.elapsed_time(c1)

    with torch.inference_mode():
        for _ in range(3):
            attention_alone()
        attention_ms = statistics.median(attention_alone() for _ in range(args.reps))
        rows = []
        for name, (dst, src, how) in table.items():
            for _ in range(2):
                copy_alone(dst, src, how)
                beside(dst, src, how)
            dst.zero_()
            torch.cuda.synchronize(device)  # the copy runs on the side stream
            copy_alone(dst, src, how)
            correct = bool(torch.equal(dst, src.to(dst.device)))
            alone = statistics.median(copy_alone(dst, src, how) for _ in range(args.reps))
            pairs = [beside(dst, src, how) for _ in range(args.reps)]
            att = statistics.median(p[0] for p in pairs)
            done = statistics.median(p[1] for p in pairs)
            rows.append({
                "copy": name, "alone_ms": alone, "attention_ms": att, "copy_done_ms": done,
                "ran": "beside" if done < att / 2 else "behind", "correct": correct,
            })  # fmt: skip
    mb = table["contiguous, cuMemcpyAsync"][0].numel() * 2 / 1e6
    lines = [
        f"# Copies beside a persistent attention kernel ({torch.cuda.get_device_name(device)})",
        "",
        (
            f"Attention: Wan2.1 720p, {args.heads} heads, SSTA {mask.density():.3f} density, alone "
            f"{attention_ms:.3f} ms. Each copy moves {mb:.1f} MB on a high-priority side stream. Medians of {args.reps}."
        ),
        "",
        "| copy | alone (ms) | attention beside it (ms) | copy done at (ms) | ran | equal to the source |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['copy']} | {r['alone_ms']:.3f} | {r['attention_ms']:.3f} | {r['copy_done_ms']:.3f} | {r['ran']} | {r['correct']} |"
        for r in rows
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"attention_alone_ms": attention_ms, "heads": args.heads, "piece_mb": mb, "rows": rows}
        (args.out / "copies_beside_attention.json").write_text(json.dumps(report, indent=2))
        (args.out / "copies_beside_attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
