"""``tessera demo``, the README's main job: Tessera's sparse attention inside a video diffusion model.
What it does and prints: ``DESCRIPTION``."""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from .cli_common import CommandLineParser, positive_int, run_command
from .errors import CatalogError, InvalidArgumentError

DESCRIPTION = """\
Run Tessera's sparse attention inside a video diffusion model and print a short summary; writes
nothing to disk.

Without a GPU (or --device cpu; about 10 s): a tiny random-weight Wan2.1 pipeline, built locally
without a download, denoises the same noise three times: with the stock attention, with Tessera
and an all-active mask (must match the stock result), and with a sparse SSTA-style mask after one
dense warm-up step. The summary says how far each Tessera run is from the stock one and how often
masks and plans were reused. It checks correctness: the CPU runs the PyTorch reference path, whose
times say nothing about GPU speed, so none are printed.

With a CUDA GPU (or --device cuda; under a minute): one real-size Wan2.1-14B self-attention at
720p (40 heads x 128, 75,600 tokens, bf16) with a ~10% SSTA-style mask, timed with Tessera
(first call with planning, then warm calls) and with dense cuDNN SDPA, and Tessera's rows checked
against the exact masked-attention oracle on a few query blocks. Needs the native kernel library
(`pip install .` builds it when nvcc is available).

    tessera demo
    tessera demo --device cpu --steps 4
"""


def cpu_job(steps: int = 6) -> dict:
    """Tiny Wan2.1 pipeline: stock vs Tessera all-active vs Tessera sparse. Returns the summary."""
    from .processors import TesseraProcessor  # imports diffusers: only the jobs need it
    from .processors.tiny import tiny_wan_pipeline, wan_prompt_inputs
    from .sparsifiers import DenseWarmup, LatentGrid, SSTASparsifier, all_active

    pipe = tiny_wan_pipeline(num_layers=2)
    kwargs = {"height": 128, "width": 128, "num_frames": 9, "num_inference_steps": steps, "guidance_scale": 5.0,
              "output_type": "latent"}

    def generate() -> torch.Tensor:
        return pipe(**wan_prompt_inputs(), generator=torch.Generator().manual_seed(0), **kwargs).frames

    stock = generate()
    exact = TesseraProcessor(all_active((1, 4, 4))).attach(pipe.transformer)
    same = generate()
    exact.detach(pipe.transformer)

    sparsifier = DenseWarmup(SSTASparsifier(tile=(1, 4, 4), window=(1, 3, 3), top_k=4), steps=1)
    processor = TesseraProcessor(sparsifier, recompute_every=2).attach(pipe.transformer)
    sparse = generate()
    stats = processor.stats()
    grid = LatentGrid(3, 8, 8)  # 9 frames -> 3 latent frames; 128 px / 8 (VAE) / 2 (patch)
    summary = {
        "device": "cpu",
        "model": "tiny random Wan2.1 (2 blocks, 2 heads x 12)",
        "latent_grid": str(grid),
        "video_tokens": grid.num_tokens,
        "steps": steps,
        "guidance_branches": 2,
        "all_active_max_abs_diff_vs_stock": float((same - stock).abs().max()),
        "sparse_rel_diff_vs_stock": float((sparse - stock).norm() / stock.norm()),
        "sparse_mean_mask_density": stats["mean_mask_density"],
        "sparse_calls": stats["sparse_calls"],
        "dense_calls": stats["dense_calls"],
        "mask_computes": stats["cache"]["mask_computes"],
        "mask_reuses": stats["cache"]["mask_reuses"],
        "plan_builds": stats["cache"]["plan_builds"],
        "plan_reuses": stats["cache"]["plan_reuses"],
        "cache_peak_bytes": stats["cache"]["peak_bytes"],
    }
    print(
        f"Tessera default job (CPU): tiny Wan2.1, latent grid {grid} = {grid.num_tokens} tokens, "
        f"{steps} steps x 2 branches\n"
        f"  all-active Tessera vs stock: max |diff| = {summary['all_active_max_abs_diff_vs_stock']:.2e} "
        "(exact path)\n"
        f"  sparse Tessera vs stock:     rel diff  = {summary['sparse_rel_diff_vs_stock']:.3f} at mean mask density "
        f"{summary['sparse_mean_mask_density']:.2f} (1 dense warm-up step)\n"
        f"  calls: {summary['sparse_calls']} sparse, {summary['dense_calls']} dense; "
        f"masks computed {summary['mask_computes']}, "
        f"reused {summary['mask_reuses']}; plans built {summary['plan_builds']}, reused {summary['plan_reuses']}; "
        f"cache peak {summary['cache_peak_bytes']} bytes\n"
        "  (a correctness check: the CPU runs the PyTorch reference path, whose times say nothing about GPU "
        "speed; tessera demo --device cuda and tessera bench measure that)"
    )
    return summary


def gpu_job(density: float = 0.10, iters: int = 5) -> dict:
    """Real-size Wan2.1-14B self-attention at 720p: Tessera vs dense cuDNN SDPA, plus an oracle check."""
    from . import LogicalMask, Runtime, block_sparse_attention, reference
    from .sparsifiers import LatentGrid, SSTASparsifier, top_k_for_block_density

    device = torch.device("cuda")
    grid = LatentGrid(21, 45, 80)
    heads, head_dim = 40, 128
    base = SSTASparsifier(window=(1, 3, 3))
    top_k = top_k_for_block_density(base, grid, density)
    sparsifier = SSTASparsifier(window=(1, 3, 3), top_k=top_k)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, grid.num_tokens, heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
        for _ in range(3)
    )
    mask = sparsifier(q, k, layer=0, step=0, grid=grid)
    runtime = Runtime()

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    def dense():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = block_sparse_attention(q, k, v, mask, runtime=runtime)  # first call: state, selection, preparation
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    fallback = [str(w.message) for w in caught if "no native plan" in str(w.message)]
    if fallback:  # the reference oracle ran: timing it would only measure the oracle
        raise CatalogError(f"no native Tessera kernel for this request ({fallback[0]}); build the kernel "
                           "library with nvcc available (pip install ., or tessera build in a source checkout)")
    tessera_ms = timed(lambda: block_sparse_attention(q, k, v, mask, runtime=runtime))
    dense_ms = timed(dense)

    rows = torch.tensor([0, mask.num_blocks_q // 3, 2 * mask.num_blocks_q // 3, mask.num_blocks_q - 1], device=device)
    sub_blocks = mask.blocks.index_select(2, rows)
    token_rows = torch.cat(
        [
            torch.arange(r * mask.block_q, min((r + 1) * mask.block_q, mask.seq_len_q), device=device)
            for r in rows.tolist()
        ]
    )
    sub_mask = LogicalMask(sub_blocks.contiguous(), mask.block_q, mask.block_kv, token_rows.numel(), mask.seq_len_kv)
    want = reference.attention(q[:, token_rows], k, v, sub_mask)
    error = float((out[:, token_rows].float() - want.float()).abs().max())
    summary = {
        "device": torch.cuda.get_device_name(device),
        "shape": f"1 x {grid.num_tokens} x {heads} x {head_dim} bf16 (Wan2.1-14B, 720p)",
        "mask_density": mask.density(),
        "tessera_first_call_ms": first_ms,
        "tessera_ms": tessera_ms,
        "dense_cudnn_ms": dense_ms,
        "speedup_vs_dense": dense_ms / tessera_ms,
        "max_abs_error_vs_oracle_on_4_query_blocks": error,
    }
    print(
        f"Tessera default job (GPU, {summary['device']}): Wan2.1-14B self-attention at 720p, {summary['shape']}\n"
        f"  mask density {summary['mask_density']:.3f} (SSTA-style, 6x8x8 tiles)\n"
        f"  Tessera {tessera_ms:.2f} ms (first call with planning {first_ms:.1f} ms) "
        f"vs dense cuDNN SDPA {dense_ms:.2f} ms: "
        f"{summary['speedup_vs_dense']:.2f}x\n"
        f"  max |error| vs the exact oracle on 4 query blocks: {error:.2e}"
    )
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tessera demo``."""
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: the real-size attention job when CUDA is available, else the tiny CPU job",
    )
    parser.add_argument("--steps", type=positive_int, default=6, help="CPU job: denoising steps (default 6)")


def run(args: argparse.Namespace) -> int:
    """The CPU or the GPU job, as ``--device`` says."""
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError("--device", "cpu or auto", "cuda", hint="no CUDA device is visible here")
        gpu_job()
    else:
        cpu_job(args.steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(prog="tessera demo", description=DESCRIPTION)
    add_arguments(parser)
    return run_command("tessera demo", run, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
