"""Shared pieces of the examples: device choice, sparsifier presets, saving a video."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from tessera_diffusers.sparsifiers import DenseWarmup, LatentGrid, SSTASparsifier, ssta_384, top_k_for_block_density


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def add_common_arguments(parser: argparse.ArgumentParser, frames: int, steps: int) -> None:
    parser.add_argument("--out", type=Path, required=True, help="output .mp4")
    parser.add_argument("--random-weights", action="store_true", help="real architecture, random weights, offline")
    parser.add_argument("--layers", type=int, default=None, help="with --random-weights: transformer blocks to build")
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--frames", type=int, default=frames)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--dense-steps", type=int, default=None, help="dense warm-up steps before sparse attention")
    parser.add_argument("--recompute-every", type=int, default=1, help="steps between mask recomputations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--dense", action="store_true", help="stock attention (no Tessera), for comparison")


def tuned_ssta(grid: LatentGrid, density: float, window=(1, 3, 3)) -> SSTASparsifier:
    """SSTA-style tile window + top-k over 6x8x8 tiles, with top-k set for a block density of about
    ``density`` on ``grid``."""
    base = SSTASparsifier(window=window)
    return SSTASparsifier(window=window, top_k=top_k_for_block_density(base, grid, density))


def hunyuan_native() -> SSTASparsifier:
    return ssta_384()


def with_warmup(sparsifier, dense_steps: int):
    return DenseWarmup(sparsifier, steps=dense_steps) if dense_steps else sparsifier


def save_video(frames, path: Path, fps: int) -> Path:
    """Write ``frames`` (a list of HxWx3 float arrays in [0, 1], or PIL images) as an mp4 with
    diffusers' ``export_to_video``; without a video writer (imageio + imageio-ffmpeg, or OpenCV)
    the frames are saved as PNGs in ``<path stem>_frames/`` instead."""
    from diffusers.utils import export_to_video

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        export_to_video(frames, str(path), fps=fps)
        return path
    except (ImportError, ModuleNotFoundError, AttributeError) as err:
        from PIL import Image

        folder = path.with_name(path.stem + "_frames")
        folder.mkdir(parents=True, exist_ok=True)
        for i, frame in enumerate(frames):
            image = (
                frame
                if isinstance(frame, Image.Image)
                else Image.fromarray((np.clip(frame, 0, 1) * 255).astype(np.uint8))
            )
            image.save(folder / f"{i:04d}.png")
        print(f"no video writer ({type(err).__name__}: {err}); wrote {len(frames)} PNG frames to {folder}")
        return folder


def generate_and_save(pipe, processor, args: argparse.Namespace, fps: int, **pipe_kwargs) -> Path:
    """Run the pipeline with ``pipe_kwargs``, write the video to ``args.out`` and print a summary
    (with the processor's statistics when Tessera is attached)."""
    import time

    start = time.perf_counter()
    frames = pipe(
        **pipe_kwargs,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),
    ).frames[0]
    elapsed = time.perf_counter() - start
    written = save_video(list(frames), args.out, fps=fps)
    print(f"{len(frames)} frames in {elapsed:.1f} s -> {written}")
    if processor is not None:
        stats = processor.stats()
        print(
            f"sparse calls {stats['sparse_calls']}, dense calls {stats['dense_calls']}, "
            f"mean mask density {stats['mean_mask_density']:.3f}, "
            f"cache peak {stats['cache']['peak_bytes'] / 2**20:.1f} MiB"
        )
    return written
