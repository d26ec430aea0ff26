"""Worker process of the two-process context-parallel tests (``tests/integration/test_parallel.py``); no tests here.

    python tests/integration/test_parallel_worker.py --rank R --world 2 --init tcp://127.0.0.1:PORT --out DIR [--cases raw,wan]

Every rank joins a gloo group on the loopback address, computes the single-process result itself
(no process group involved) and the context-parallel one, and writes ``DIR/rank<R>.json`` (one
section per case) with the errors and counters the test asserts on. Errors are the max absolute difference against
the single-process output (the rank's chunk of it).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def chunk(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    return x.chunk(world, dim)[rank]


# --------------------------------------------------------------------------- (a) the raw function
def case_raw(rank: int, world: int) -> dict:
    from tessera_diffusers import LogicalMask, Runtime, block_sparse_attention
    from tessera_diffusers.parallel import HeadChunkGather, Ulysses, ulysses_attention
    from tessera_diffusers.testing import random_mask

    ulysses = Ulysses()
    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, dim = 2, 200, 4, 16  # 200 tokens: partial last block of 32 and 48
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(3))
    masks = {  # seeded: the same masks on every rank; with empty rows and partial last blocks
        "per_head": random_mask(batch, heads, seq, seq, 32, 48, density=0.4, seed=1),
        "broadcast_heads": random_mask(batch, 1, seq, seq, 32, 32, density=0.3, seed=2),
        "per_head_batch1": random_mask(1, heads, seq, seq, 48, 32, density=0.5, seed=3),
    }
    report: dict = {"rank": rank, "ulysses": repr(ulysses)}
    runtime = Runtime()
    mine = (chunk(q, rank, world), chunk(k, rank, world), chunk(v, rank, world))
    for name, mask in masks.items():
        ref_out, ref_lse = block_sparse_attention(q, k, v, mask, return_lse=True)
        out, lse = ulysses_attention(*mine, mask, ulysses, return_lse=True, runtime=runtime)
        finite = torch.isfinite(chunk(ref_lse, rank, world, 2))
        report[name] = {
            "out_shape": list(out.shape),
            "lse_shape": list(lse.shape),
            "out_err": max_err(out, chunk(ref_out, rank, world)),
            "lse_err": max_err(lse[finite], chunk(ref_lse, rank, world, 2)[finite]),
            "lse_inf_match": bool(torch.equal(torch.isfinite(lse), finite)),
        }
        for chunks in (1, 2):  # all heads in one exchange; this rank's 2 heads pipelined one by one
            out = ulysses_attention(*mine, mask, Ulysses(chunks=chunks), runtime=runtime)
            report[name][f"chunks{chunks}_err"] = max_err(out, chunk(ref_out, rank, world))
    # This rank's heads given directly, and the plan of a sliced mask reused on a repeat call.
    start, stop = ulysses.head_range(heads)
    mask = masks["per_head"]
    local = LogicalMask(mask.blocks[:, start:stop].contiguous(), 32, 48, seq, seq)
    out_local = ulysses_attention(*mine, local, ulysses)
    report["local_heads_err"] = max_err(out_local, chunk(block_sparse_attention(q, k, v, mask), rank, world))
    repeat = Runtime()
    ulysses_attention(*mine, mask, ulysses, runtime=repeat)
    ulysses_attention(*mine, mask, ulysses, runtime=repeat)
    report["repeat_hits"], report["repeat_misses"] = repeat.hits, repeat.misses
    report["slice_is_memoized"] = ulysses.local_mask(mask, heads) is ulysses.local_mask(mask, heads)
    # All-to-all round trip and a mask with the wrong head count.
    x = torch.randn(batch, seq // world, heads, dim, generator=torch.Generator().manual_seed(10 + rank))
    report["round_trip_exact"] = bool(torch.equal(ulysses.gather_heads(ulysses.scatter_heads(x)[0]), x))
    back = HeadChunkGather(ulysses, 2)
    for c, pending in reversed(list(enumerate(ulysses.scatter_head_chunks(x, 2)))):  # any order back
        back.send(c, pending.wait())
    report["chunked_round_trip_exact"] = bool(torch.equal(back.result(), x))
    whole = ulysses.scatter_heads(x)[0]
    report["chunks_are_head_slices"] = all(
        torch.equal(pending.wait(), whole[:, :, c : c + 1]) for c, pending in enumerate(ulysses.scatter_head_chunks(x, 2))
    )
    report["head_chunks"] = [Ulysses(chunks=c).head_chunks(h) for c, h in ((4, 4), (4, 12), (3, 20), (1, 8))]
    errors = []
    back = HeadChunkGather(ulysses, 2)
    chunk0 = ulysses.scatter_head_chunks(x, 2)[0].wait()
    back.send(0, chunk0)
    for bad in (lambda: back.send(0, chunk0), lambda: back.send(1, chunk0[:, :, :0]), lambda: back.result(),
                lambda: Ulysses(chunks=0), lambda: ulysses.scatter_head_chunks(x, 3)):
        try:
            bad()
            errors.append(None)
        except Exception as err:  # noqa: BLE001 - the test checks the type and message
            errors.append(f"{type(err).__name__}: {err}")
    report["chunk_errors"] = errors
    # Uneven head chunks (weights): 3 heads per rank cut 1 + 2, attention and the round trip.
    heads6 = 3 * world
    q6, k6, v6 = (torch.randn(batch, seq, heads6, dim, generator=gen) for _ in range(3))
    mask6 = random_mask(batch, heads6, seq, seq, 32, 48, density=0.4, seed=5)
    uneven = Ulysses(chunks=(1, 2))
    out6 = ulysses_attention(*(chunk(t, rank, world) for t in (q6, k6, v6)), mask6, uneven, runtime=runtime)
    report["uneven_spans"] = [list(uneven.head_spans(heads6)), list(Ulysses(chunks=(1, 4, 4, 1)).head_spans(40))]
    report["uneven_err"] = max_err(out6, chunk(block_sparse_attention(q6, k6, v6, mask6), rank, world))
    x6 = torch.randn(batch, seq // world, heads6, dim, generator=torch.Generator().manual_seed(20 + rank))
    spans = uneven.head_spans(heads6)
    back = HeadChunkGather(uneven, spans)
    for c, pending in reversed(list(enumerate(uneven.scatter_head_chunks(x6, spans)))):
        back.send(c, pending.wait())
    report["uneven_round_trip_exact"] = bool(torch.equal(back.result(), x6))
    try:
        uneven.scatter_head_chunks(x6, [(0, 2), (1, 3)])
        report["overlapping_spans_error"] = None
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        report["overlapping_spans_error"] = f"{type(err).__name__}: {err}"
    try:
        ulysses.local_mask(random_mask(1, 3, seq, seq, 32, 32, seed=4), heads)
        report["wrong_heads_error"] = None
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        report["wrong_heads_error"] = f"{type(err).__name__}: {err}"
    return report


# --------------------------------------------------------------------------- (b) the tiny Wan transformer
def per_head_mask(heads: int, seed: int):
    """A static per-head mask over the 2 x 8 x 8 grid in (1, 4, 4) tile order (blocks of 16)."""
    from tessera_diffusers import LogicalMask

    gen = torch.Generator().manual_seed(seed)
    blocks = torch.rand(1, heads, 8, 8, generator=gen) < 0.4
    blocks |= torch.eye(8, dtype=torch.bool)  # no empty row
    return LogicalMask(blocks, 16, 16, 128, 128)


def sparsifiers(heads: int) -> dict:
    from tessera_diffusers.sparsifiers import DenseWarmup, SSTASparsifier, StaticSparsifier

    ssta = SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 1), top_k=3)
    return {
        "static_per_head": StaticSparsifier(per_head_mask(heads, seed=3), tile=(1, 4, 4)),
        "ssta": ssta,
        "warmup_then_ssta": DenseWarmup(ssta, steps=1),
    }


def forwards(model, steps: int) -> list[torch.Tensor]:
    from tessera_diffusers.processors.tiny import wan_transformer_inputs

    inputs = wan_transformer_inputs()  # grid 2 x 8 x 8 = 128 tokens
    with torch.no_grad():
        return [model(**inputs, return_dict=False)[0] for _ in range(steps)]


class HeadRecorder:
    """A sparsifier that records how many heads each call saw (a head-separable one runs per chunk)."""

    def __init__(self, inner):
        self.inner, self.heads = inner, set()
        self.head_separable = getattr(inner, "head_separable", False)

    def layout(self, grid):
        return self.inner.layout(grid)

    def __call__(self, q, k, **kwargs):
        self.heads.add(q.shape[2])
        return self.inner(q, k, **kwargs)


def case_wan(rank: int, world: int) -> dict:
    import diffusers.utils.logging as diffusers_logging
    from diffusers import ContextParallelConfig

    from tessera_diffusers.processors import TesseraProcessor
    from tessera_diffusers.processors.tiny import tiny_wan_transformer

    diffusers_logging.set_verbosity_error()
    heads, steps = 2, 3  # a static mask object lives on: its plans are prepared at step 0, reused after
    report: dict = {"rank": rank}
    dense = forwards(tiny_wan_transformer(), 1)[0]  # stock processors, one process
    for order in ("attach_first", "parallel_first"):
        for name, sparsifier in sparsifiers(heads).items():
            single = tiny_wan_transformer()
            single_processor = TesseraProcessor(sparsifier).attach(single)
            expected = forwards(single, steps)

            model = tiny_wan_transformer()
            config = ContextParallelConfig(ulysses_degree=world)
            if order == "attach_first":
                processor = TesseraProcessor(sparsifier).attach(model)
                model.enable_parallelism(config=config)
            else:
                model.enable_parallelism(config=config)
                processor = TesseraProcessor(sparsifier).attach(model)
            got = forwards(model, steps)
            stats, single_stats = processor.stats(), single_processor.stats()
            report[f"{order}/{name}"] = {
                "errs": [max_err(a, b) for a, b in zip(got, expected)],
                "vs_dense": [max_err(a, dense) for a in got],  # sparse steps must differ from dense
                "out_shape": list(got[0].shape),
                "ulysses": repr(processor.ulysses),
                "sparse_calls": [stats["sparse_calls"], single_stats["sparse_calls"]],
                "dense_calls": [stats["dense_calls"], single_stats["dense_calls"]],
                "plan_builds": [stats["cache"]["plan_builds"], single_stats["cache"]["plan_builds"]],
                "plan_reuses": [stats["cache"]["plan_reuses"], single_stats["cache"]["plan_reuses"]],
            }
    # 4 heads: this rank's 2 heads in 2 pipelined chunks; masks kept for 2 steps, so step 0 and 2
    # take the sparsifier's path (q, k whole, v in chunks) and step 1 the kept-mask path (interleaved).
    for name in ("ssta", "static_per_head", "warmup_then_ssta"):
        sparsifier = sparsifiers(4)[name]
        single = tiny_wan_transformer(heads=4)
        single_processor = TesseraProcessor(sparsifier, recompute_every=2).attach(single)
        expected = forwards(single, 3)
        model = tiny_wan_transformer(heads=4)
        recording = HeadRecorder(sparsifier)
        processor = TesseraProcessor(recording, recompute_every=2).attach(model)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        got = forwards(model, 3)
        stats, single_stats = processor.stats(), single_processor.stats()
        report[f"pipelined/{name}"] = {
            "errs": [max_err(a, b) for a, b in zip(got, expected)],
            "chunks": processor.ulysses.head_chunks(4),
            "masks_computed": [stats["masks_computed"], single_stats["masks_computed"]],
            "mask_reuses": [stats["cache"]["mask_reuses"], single_stats["cache"]["mask_reuses"]],
            "plan_builds": [stats["cache"]["plan_builds"], single_stats["cache"]["plan_builds"]],
            "sparse_calls": [stats["sparse_calls"], single_stats["sparse_calls"]],
            "dense_calls": [stats["dense_calls"], single_stats["dense_calls"]],
            "sparsifier_heads": sorted(recording.heads),  # heads per sparsifier call on this rank
        }
    # The stock processors under the same context parallelism agree as well (diffusers' own Ulysses).
    stock = tiny_wan_transformer()
    stock.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    report["stock_cp_err"] = max_err(forwards(stock, 1)[0], dense)
    # Detached after enable_parallelism: the stock processors get diffusers' Ulysses back.
    detached = tiny_wan_transformer()
    processor = TesseraProcessor(sparsifiers(heads)["ssta"]).attach(detached)
    detached.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    forwards(detached, 1)
    processor.detach(detached)
    report["detached_err"] = max_err(forwards(detached, 1)[0], dense)
    return report


# --------------------------------------------------------------------------- refusals
def case_refusals(rank: int, world: int) -> dict:
    import diffusers.utils.logging as diffusers_logging
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    from tessera_diffusers.processors import TesseraProcessor
    from tessera_diffusers.processors.tiny import tiny_hunyuan_video15_transformer, tiny_wan_transformer
    from tessera_diffusers.sparsifiers import all_active

    diffusers_logging.set_verbosity_error()
    report: dict = {"rank": rank}

    def error_of(fn) -> str | None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - the test checks the type and message
            return f"{type(err).__name__}: {err}"
        return None

    model = tiny_wan_transformer()
    TesseraProcessor(all_active((1, 4, 4))).attach(model)
    report["ring"] = error_of(lambda: model.enable_parallelism(config=ContextParallelConfig(ring_degree=world)))

    hv15 = tiny_hunyuan_video15_transformer()
    TesseraProcessor(all_active((1, 4, 4))).attach(hv15)
    plan = {
        "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }
    hv15.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world), cp_plan=plan)
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=gen),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 6, 16, generator=gen),
        "encoder_attention_mask": torch.ones(1, 6),
        "encoder_hidden_states_2": torch.randn(1, 4, 8, generator=gen),
        "encoder_attention_mask_2": torch.ones(1, 4),
        "image_embeds": torch.zeros(1, 3, 12),
    }
    with torch.no_grad():
        report["hv15"] = error_of(lambda: hv15(**inputs))
    return report


CASES = {"raw": case_raw, "wan": case_wan, "refusals": case_refusals}


def main() -> int:
    from tessera_diffusers.testing import rank_parser

    parser = rank_parser(__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {sorted(CASES)}")
    args = parser.parse_args()
    # diffusers derives the device as rank % torch.accelerator.device_count(), which is 0 on a
    # CPU-only torch (ZeroDivisionError); one "device" per process is what it means here.
    torch.accelerator.device_count = lambda: 1
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=args.init, rank=args.rank, world_size=args.world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        report = {case: CASES[case](args.rank, args.world) for case in args.cases.split(",")}
        (args.out / f"rank{args.rank}.json").write_text(json.dumps(report, indent=1))
        return 0
    except Exception:  # noqa: BLE001 - the traceback goes to stderr for the test to show
        traceback.print_exc()
        return 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
