"""Copy engine against NCCL for the bytes of one Ulysses head chunk, alone and beside compute.

    torchrun --nproc-per-node 2 benchmarks/peer_copy_probe.py [--mb 96.8] [--out DIR]

Two ranks on one host. Each moves one piece (default 96.8 MB: 37,800 tokens x 10 heads x 128 x bf16,
a Wan2.1 720p head chunk) to the other:
- NCCL: ``all_to_all_single`` of ``[2, piece]``;
- copy engine: the piece staged in a symmetric-memory buffer (CUDA backend, multicast off), pulled by
  the peer with ``copy_`` (``cudaMemcpyAsync`` over NVLink), between two symmetric-memory barriers.
Then a chain of ten 8192^3 bf16 matrix products alone, and beside eight exchanges of each kind on a
side stream. Rank 0 prints the table and writes ``peer_copy_probe.json`` under ``--out``.
"""

from __future__ import annotations

import os

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def timed(fn, rank: int, reps: int) -> float:
    """Mean ms of ``fn`` over ``reps`` after three untimed calls, ranks aligned first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=37_800 * 10 * 128 * 2 / 1e6, help="piece size in MB")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    n = int(args.mb * 1e6 / 2)
    send = torch.randn(world, n, device=device).to(torch.bfloat16)
    recv = torch.empty_like(send)
    nccl_ms = timed(lambda: dist.all_to_all_single(recv, send), rank, 20)

    staging = symm_mem.empty(world, n, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(staging, dist.group.WORLD)
    staging.copy_(send)
    peer = 1 - rank
    remote = handle.get_buffer(peer, (world, n), torch.bfloat16)
    pulled = torch.empty_like(send)

    def pull() -> None:
        handle.barrier(channel=0)
        pulled[peer].copy_(remote[rank])
        handle.barrier(channel=0)

    copy_ms = timed(pull, rank, 20)
    torch.cuda.synchronize()
    same = torch.equal(pulled[peer], recv[peer])

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)

    def compute() -> None:
        for _ in range(10):
            a @ b

    side = torch.cuda.Stream()

    def beside(kind: str):
        def fn() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(8):
                    dist.all_to_all_single(recv, send) if kind == "nccl" else pull()
            compute()
            torch.cuda.current_stream().wait_stream(side)

        return fn

    compute_ms = timed(compute, rank, 5)
    with_nccl_ms, with_copy_ms = timed(beside("nccl"), rank, 5), timed(beside("copy"), rank, 5)
    report = {
        "piece_mb": n * 2 / 1e6,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "nccl_ms": nccl_ms,
        "nccl_gb_s_each_way": n * 2 / nccl_ms / 1e6,
        "copy_engine_ms": copy_ms,
        "copy_engine_gb_s_each_way": n * 2 / copy_ms / 1e6,
        "copy_engine_equals_nccl": same,
        "products_alone_ms": compute_ms,
        "products_beside_8_nccl_ms": with_nccl_ms,
        "products_beside_8_copy_engine_ms": with_copy_ms,
    }
    if rank == 0:
        for key, value in report.items():
            print(f"{key:34} {value:.3f}" if isinstance(value, float) else f"{key:34} {value}", flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "peer_copy_probe.json").write_text(json.dumps(report, indent=1))
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
