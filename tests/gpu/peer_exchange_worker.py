"""Worker process of the two-GPU exchange tests (``tests/gpu/test_peer_exchange_gpu.py``); no tests here.

    python tests/gpu/peer_exchange_worker.py --rank R --world 2 --init tcp://127.0.0.1:PORT --out DIR

Rank ``R`` joins a NCCL group on ``cuda:R``. Every rank draws every rank's inputs from one seed, so
it knows what each exchange must deliver without any transport; it writes ``DIR/rank<R>.json`` with,
per case, whether the copy-engine exchange and NCCL delivered exactly that.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import torch
import torch.distributed as dist


def full_inputs(seed: int, batch: int, seq: int, heads: int, dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The whole ``[B, S, H, D]`` tensor every rank's chunk comes from (identical on every rank)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(batch, seq, heads, dim, generator=gen, device=device).to(dtype)


def case_exchanges(rank: int, world: int, device: torch.device) -> dict:
    """Scatter (every chunk count), gather and log-sum-exp exchanges against their known results."""
    from tessera_diffusers.parallel import HeadChunkGather, Ulysses

    report: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        for batch, seq, heads, dim in ((1, 600, 8, 64), (2, 200, 4, 128)):
            x = full_inputs(seq + heads, batch, seq, heads, dim, dtype, device)
            mine = x.chunk(world, 1)[rank].contiguous()
            h0, h1 = rank * heads // world, (rank + 1) * heads // world
            for chunks in (1, 2, 4):
                per_rank = heads // world
                if per_rank % chunks:
                    continue
                key = f"{str(dtype).split('.')[-1]}_b{batch}_s{seq}_h{heads}_d{dim}_c{chunks}"
                per_chunk = per_rank // chunks
                got = {}
                for transport in ("copy_engine", "nccl"):
                    ulysses = Ulysses(chunks=chunks, transport=transport)
                    incoming = ulysses.scatter_head_chunks(mine, chunks)
                    received = [p.wait() for p in incoming]
                    ok_in = all(
                        torch.equal(r, x[:, :, h0 + c * per_chunk : h0 + (c + 1) * per_chunk])
                        for c, r in enumerate(received)
                    )
                    back = HeadChunkGather(ulysses, chunks)
                    for c, r in enumerate(received):
                        back.send(c, r * 2)
                    ok_back = torch.equal(back.result(), mine * 2)
                    # later chunks deferred, waited for last chunk first (launched in order regardless)
                    deferred = ulysses.scatter_interleaved((mine, mine * 3), chunks, defer_later=True)
                    ok_deferred = all(
                        torch.equal(pending.wait(), factor * x[:, :, h0 + c * per_chunk : h0 + (c + 1) * per_chunk])
                        for c, parts in reversed(list(enumerate(deferred)))
                        for pending, factor in zip(parts, (1, 3), strict=True)
                    )
                    lse = x[:, :, h0:h1, 0].float().transpose(1, 2).contiguous()  # [B, H/N, S]
                    ok_lse = torch.equal(
                        ulysses.gather_lse(lse), x.chunk(world, 1)[rank][..., 0].float().transpose(1, 2)
                    )
                    got[transport] = {
                        "deferred": ok_deferred,
                        "scatter": ok_in,
                        "gather": ok_back,
                        "lse": ok_lse,
                        "in_use": ulysses.transport_in_use(device),
                    }
                report[key] = got
    return report


def case_stress(rank: int, world: int, device: torch.device) -> dict:
    """Forty exchanges in flight at once (many more than the staging slots; the staging grows in the
    first six; copy-engine rows and copy kernels alternate), with matrix products queued between them
    on the caller's stream, waited for only at the end."""
    from tessera_diffusers.parallel import Ulysses

    ulysses = Ulysses(chunks=1, transport="copy_engine")
    a = torch.randn(2048, 2048, device=device)
    pending, expected = [], []
    for i in range(40):
        seq = (64, 256, 1024)[i % 3] if i >= 6 else 64 * (i + 1)  # grows in the first six
        dim = 128 if i % 2 else 32  # rows of 512 bytes go to the copy engines, of 128 to a copy kernel
        x = full_inputs(1000 + i, 1, seq, 4, dim, torch.bfloat16, device)
        mine = x.chunk(world, 1)[rank].contiguous()
        pending.append(ulysses.scatter_heads_async(mine)[0])
        expected.append(x[:, :, rank * 2 : rank * 2 + 2])
        del mine, x  # freed on the caller's stream while the exchange may still read it
        for _ in range(i % 4):
            a = (a @ a).clamp_(-1, 1)
    results = [p.wait() for p in pending]
    bad = [i for i, (r, e) in enumerate(zip(results, expected, strict=True)) if not torch.equal(r, e)]
    engine = ulysses.copy_engine(device)
    return {"exchanges": len(results), "wrong": bad, "seq": engine.seq, "area_mib": engine.area_bytes >> 20}


def case_attention(rank: int, world: int, device: torch.device) -> dict:
    """``ulysses_attention`` over copy engines and over NCCL against one GPU on the whole sequence."""
    from tessera_diffusers import Runtime, reference
    from tessera_diffusers.parallel import Ulysses, ulysses_attention
    from tessera_diffusers.testing import random_mask

    batch, seq, heads, dim = 1, 1000, 8, 128  # partial last blocks of 64; empty rows in the mask
    q, k, v = (full_inputs(s, batch, seq, heads, dim, torch.bfloat16, device) for s in (1, 2, 3))
    mask = random_mask(batch, heads, seq, seq, 64, 64, density=0.3, seed=4, device=device)
    oracle = reference.attention(q, k, v, mask, out_dtype=torch.float32).chunk(world, 1)[rank]  # fp32
    mine = [t.chunk(world, 1)[rank].contiguous() for t in (q, k, v)]
    report = {}
    outs = {}
    for transport in ("copy_engine", "nccl"):
        for chunks in (1, 2):
            out = ulysses_attention(*mine, mask, Ulysses(chunks=chunks, transport=transport), runtime=Runtime())
            outs[(transport, chunks)] = out
            report[f"{transport}_c{chunks}_err"] = float((out.float() - oracle).abs().max())
    report["same_as_nccl"] = all(torch.equal(outs[("copy_engine", c)], outs[("nccl", c)]) for c in (1, 2))
    return report


CASES = {"exchanges": case_exchanges, "stress": case_stress, "attention": case_attention}


def main() -> None:
    from tessera_diffusers.testing import rank_parser

    args = rank_parser(__doc__.split("\n")[0]).parse_args()
    device = torch.device("cuda", args.rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=args.init, rank=args.rank, world_size=args.world,
        timeout=datetime.timedelta(seconds=120), device_id=device,
    )  # fmt: skip
    report: dict = {"rank": args.rank}
    try:
        for name, case in CASES.items():
            try:
                report[name] = case(args.rank, args.world, device)
            except Exception:  # noqa: BLE001 - reported to the test, which shows the traceback
                report[name] = {"error": traceback.format_exc()}
            torch.cuda.synchronize(device)
            dist.barrier(device_ids=[device.index])
    finally:
        (args.out / f"rank{args.rank}.json").write_text(json.dumps(report, indent=1))
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
