"""HunyuanVideo-1.5 image-to-video at 720p with Tessera's sparse joint attention.

Real checkpoint (a local diffusers-format folder of the 720p I2V model; nothing is downloaded):

    python examples/hunyuanvideo15_i2v_720p.py --model /models/HunyuanVideo-1.5-Diffusers-720p_i2v \
        --image first_frame.png --prompt "The camera slowly pushes in" --out hv15.mp4

Offline, real architecture with random weights (random text embeddings, a random SigLIP image
encoder with ``--image-encoder-layers`` blocks):

    python examples/hunyuanvideo15_i2v_720p.py --random-weights --layers 4 --out hv15_random.mp4
    python examples/hunyuanvideo15_i2v_720p.py --random-weights --layers 1 --height 128 --width 128 \
        --frames 5 --steps 2 --out /tmp/hv15_small.mp4            # a quick CPU check

Attention: 31 x 45 x 80 = 111,600 video tokens + up to 1,985 text tokens at 720p / 121 frames.
The default sparsifier is HunyuanVideo-1.5's own scheme (6 x 8 x 8 tiles, 3 x 3 x 3 window + top-k
32 for <= 31 latent frames); video queries see every valid text key, text queries see every valid
key, text padding is masked with the 1-D mask.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_arguments, generate_and_save, hunyuan_native, pick_device, tuned_ssta, with_warmup  # noqa: E402
from tessera_diffusers.processors import TesseraProcessor  # noqa: E402

from tessera_diffusers.sparsifiers import LatentGrid  # noqa: E402

QWEN_TOKENS, BYT5_TOKENS = 1000, 256


def random_pipeline(layers: int, image_encoder_layers: int, device: torch.device, dtype: torch.dtype):
    """The I2V pipeline with the 8.3B transformer architecture (``layers`` blocks), the
    HunyuanVideo-1.5 VAE and a SigLIP-so400m-shaped image encoder, all random; no text encoders."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    siglip = SiglipVisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_attention_heads=16,
        image_size=384,
        patch_size=14,
        num_hidden_layers=image_encoder_layers,
    )  # 27 x 27 = 729 image tokens, as the transformer expects
    with torch.device(device):
        transformer = HunyuanVideo15Transformer3DModel(num_layers=layers, target_size=720, task_type="i2v")
        vae = AutoencoderKLHunyuanVideo15()
        image_encoder = SiglipVisionModel(siglip)
    vae.enable_tiling()
    return HunyuanVideo15ImageToVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=transformer.to(dtype).eval(),
        vae=vae.to(dtype).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
        image_encoder=image_encoder.to(dtype).eval(),
        feature_extractor=SiglipImageProcessor(size={"height": 384, "width": 384}),
    )


def random_embeddings(device: torch.device, dtype: torch.dtype, seed: int, valid: int = 120) -> dict:
    """Prompt embeddings for both text encoders with ``valid`` valid Qwen tokens (padding after)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for prefix in ("", "negative_"):
        out[f"{prefix}prompt_embeds"] = torch.randn(1, QWEN_TOKENS, 3584, generator=gen).to(device, dtype)
        out[f"{prefix}prompt_embeds_mask"] = (torch.arange(QWEN_TOKENS) < valid).to(device, dtype)[None]
        out[f"{prefix}prompt_embeds_2"] = torch.zeros(1, BYT5_TOKENS, 1472).to(device, dtype)
        out[f"{prefix}prompt_embeds_mask_2"] = torch.zeros(1, BYT5_TOKENS).to(device, dtype)  # no glyph text
    return out


def first_frame(path: Path | None, height: int, width: int):
    from PIL import Image

    if path is not None:
        return Image.open(path).convert("RGB")
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), 0.5 + 0.5 * np.sin(x / 40.0)], -1)
    return Image.fromarray((rgb * 255).astype(np.uint8))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="local diffusers-format HunyuanVideo-1.5 I2V checkpoint"
    )
    parser.add_argument("--image", type=Path, default=None, help="first frame (default: a synthetic gradient)")
    parser.add_argument("--prompt", default="The camera slowly pushes in while leaves drift in the wind")
    parser.add_argument(
        "--density",
        type=float,
        default=None,
        help="tune the top-k to keep this fraction of tile pairs (default: the model's own setting)",
    )
    parser.add_argument("--image-encoder-layers", type=int, default=2, help="with --random-weights")
    add_common_arguments(parser, frames=121, steps=50)
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense_steps = 0 if args.dense_steps is None else args.dense_steps

    if args.random_weights:
        pipe = random_pipeline(args.layers or 54, args.image_encoder_layers, device, dtype)
        inputs = random_embeddings(device, dtype, args.seed)
        pipe.target_size = min(args.height, args.width)  # 720 at 720p; smaller for quick checks
    else:
        if args.model is None or not args.model.is_dir():
            parser.error("--model must be a local checkpoint folder (or use --random-weights)")
        from diffusers import HunyuanVideo15ImageToVideoPipeline

        pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(args.model, torch_dtype=dtype, local_files_only=True)
        pipe.to(device)
        pipe.vae.enable_tiling()
        inputs = {"prompt": args.prompt}

    image = first_frame(args.image, args.height, args.width)
    height, width = pipe.video_processor.calculate_default_height_width(
        height=image.size[1], width=image.size[0], target_size=pipe.target_size
    )
    grid = LatentGrid(
        (args.frames - 1) // pipe.vae_scale_factor_temporal + 1,
        height // pipe.vae_scale_factor_spatial,
        width // pipe.vae_scale_factor_spatial,
    )
    processor = None
    if not args.dense:
        sparsifier = hunyuan_native() if args.density is None else tuned_ssta(grid, args.density, window=(3, 3, 3))
        processor = TesseraProcessor(with_warmup(sparsifier, dense_steps), recompute_every=args.recompute_every)
        processor.attach(pipe.transformer)
    print(
        f"{height}x{width}, latent grid {grid} = {grid.num_tokens:,} video tokens; "
        f"{pipe.transformer.config.num_layers} blocks; {'dense' if processor is None else processor.sparsifier}"
    )

    return generate_and_save(pipe, processor, args, fps=24, image=image, **inputs)


if __name__ == "__main__":
    main()
