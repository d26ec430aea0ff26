"""Wan2.1 text-to-video at 720p with Tessera's sparse video self-attention.

Real checkpoint (a local diffusers-format folder, e.g. Wan2.1-T2V-14B-Diffusers; nothing is downloaded):

    python examples/wan21_t2v_720p.py --model /models/Wan2.1-T2V-14B-Diffusers \
        --prompt "A cat walks on the grass, realistic" --out wan.mp4

Offline, real architecture with random weights (text embeddings random too):

    python examples/wan21_t2v_720p.py --random-weights --layers 4 --out wan_random.mp4
    python examples/wan21_t2v_720p.py --random-weights --layers 1 --height 128 --width 128 \
        --frames 9 --steps 2 --out /tmp/wan_small.mp4            # a quick CPU check

Attention: 21 x 45 x 80 = 75,600 video tokens at 720p / 81 frames; masks from the SSTA-style
sparsifier (6 x 8 x 8 tiles, 1 x 3 x 3 tile window + top-k) tuned to ``--density``, after
``--dense-steps`` dense warm-up steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_arguments, generate_and_save, pick_device, tuned_ssta, with_warmup  # noqa: E402
from tessera_diffusers.processors import TesseraProcessor  # noqa: E402

from tessera_diffusers.sparsifiers import LatentGrid  # noqa: E402

NEGATIVE = "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality"


def random_pipeline(layers: int, device: torch.device, dtype: torch.dtype):
    """WanPipeline with the 14B transformer architecture (``layers`` blocks) and the Wan2.1 VAE,
    random weights, no text encoder (embeddings are passed directly)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    with torch.device(device):
        transformer = WanTransformer3DModel(num_layers=layers)
        vae = AutoencoderKLWan()
    return WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae.to(torch.float32).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=transformer.to(dtype).eval(),
    )


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="local diffusers-format Wan2.1 T2V checkpoint")
    parser.add_argument("--prompt", default="A red fox runs through fresh snow in a pine forest, cinematic")
    parser.add_argument("--density", type=float, default=0.10, help="fraction of tile pairs kept")
    parser.add_argument("--guidance", type=float, default=5.0)
    add_common_arguments(parser, frames=81, steps=50)
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense_steps = 10 if args.dense_steps is None else args.dense_steps

    if args.random_weights:
        pipe = random_pipeline(args.layers or 40, device, dtype)
        gen = torch.Generator().manual_seed(args.seed)
        embeds = {
            "prompt_embeds": torch.randn(1, 512, 4096, generator=gen).to(device, dtype),
            "negative_prompt_embeds": torch.randn(1, 512, 4096, generator=gen).to(device, dtype),
        }
    else:
        if args.model is None or not args.model.is_dir():
            parser.error("--model must be a local checkpoint folder (or use --random-weights)")
        from diffusers import AutoencoderKLWan, WanPipeline

        vae = AutoencoderKLWan.from_pretrained(
            args.model, subfolder="vae", torch_dtype=torch.float32, local_files_only=True
        )
        pipe = WanPipeline.from_pretrained(args.model, vae=vae, torch_dtype=dtype, local_files_only=True)
        pipe.to(device)
        embeds = {"prompt": args.prompt, "negative_prompt": NEGATIVE}

    p_t, p_h, p_w = pipe.transformer.config.patch_size
    grid = LatentGrid(
        (args.frames - 1) // pipe.vae_scale_factor_temporal + 1,
        args.height // pipe.vae_scale_factor_spatial // p_h,
        args.width // pipe.vae_scale_factor_spatial // p_w,
    )
    processor = None
    if not args.dense:
        sparsifier = with_warmup(tuned_ssta(grid, args.density), dense_steps)
        processor = TesseraProcessor(sparsifier, recompute_every=args.recompute_every).attach(pipe.transformer)
    print(
        f"latent grid {grid} = {grid.num_tokens:,} video tokens; {pipe.transformer.config.num_layers} blocks; "
        f"{'dense' if processor is None else processor.sparsifier}"
    )

    return generate_and_save(
        pipe, processor, args, fps=16, **embeds, height=args.height, width=args.width,
        guidance_scale=args.guidance,
    )


if __name__ == "__main__":
    main()
