r"""Wan2.1 text-to-video (image-to-video with an I2V checkpoint) with Tessera's sparse video attention.

    python examples/wan21.py --model Wan-AI/Wan2.1-T2V-14B-Diffusers \
        --prompt "A cat walks on the grass, realistic" --out wan.mp4
    python examples/wan21.py --model /models/Wan2.1-I2V-14B-720P-Diffusers --image first_frame.png \
        --offload group --out wan_i2v.mp4
    python examples/wan21.py --random-weights --layers 4 --compare-dense --out wan_random.mp4
    python examples/wan21.py --tiny --steps 3 --warmup-steps 1 --out /tmp/wan.mp4      # quick CPU check

The first takes the checkpoint from the Hugging Face hub, the second a local diffusers folder; the
third builds the 14B architecture with random weights (4 of its 40 blocks) and random text
embeddings, offline, and compares with stock attention; the last runs a tiny model on the CPU
(128 x 512 pixels, 21 frames): one dense warm-up step, then two steps of sparse attention.

Tessera is installed as the README says, ``pipe.transformer.set_attn_processor(TesseraProcessor())``:
Wan2.1's default masks (~10 % block density) after 10 dense steps, unless ``--sparsifier`` or
``--warmup-steps`` say otherwise. At 720p and 81 frames the video self-attention covers
21 x 45 x 80 = 75,600 tokens.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from tessera_diffusers.processors.context import Route

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Size,
    build_parser,
    cast_like_pretrained,
    check_task,
    checkpoint_class,
    parse_args,
    run_example,
)

T2V, I2V = "WanPipeline", "WanImageToVideoPipeline"
NEGATIVE = "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality"
REAL, TINY = Size(720, 1280, 81), Size(128, 512, 21)  # tiny: 6 x 8 x 32 tokens, 4 of the default's tiles
FPS = 16


def load_checkpoint(model: str, image_to_video: bool, dtype: torch.dtype, height: int):
    """The pipeline from a hub id or folder, with the VAE (and I2V image encoder) in float32 as
    diffusers' Wan documentation recommends."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline

    parts = {"vae": AutoencoderKLWan.from_pretrained(model, subfolder="vae", torch_dtype=torch.float32)}
    if image_to_video:
        from transformers import CLIPVisionModel

        parts["image_encoder"] = CLIPVisionModel.from_pretrained(
            model, subfolder="image_encoder", torch_dtype=torch.float32
        )
    pipe = (WanImageToVideoPipeline if image_to_video else WanPipeline).from_pretrained(
        model, torch_dtype=dtype, **parts
    )
    if isinstance(pipe.scheduler, UniPCMultistepScheduler):  # Wan's flow shift: 5 for 720p, 3 below
        shift = 5.0 if height >= 720 else 3.0
        pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=shift)
    return pipe


def random_pipeline(layers: int, device: torch.device, dtype: torch.dtype):
    """WanPipeline with the 14B transformer architecture (``layers`` blocks) and the Wan2.1 VAE,
    random weights, no text encoder (the prompt embeddings are random too)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    with torch.device(device):
        transformer = cast_like_pretrained(WanTransformer3DModel(num_layers=layers), dtype)
        vae = AutoencoderKLWan().eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer)


def random_prompt(seed: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Prompt embeddings shaped like UMT5's (512 tokens x 4096), positive and negative."""
    gen = torch.Generator().manual_seed(seed)
    return {f"{side}prompt_embeds": torch.randn(1, 512, 4096, generator=gen).to(device, dtype)
            for side in ("", "negative_")}


def image_inputs(pipe, path: Path, height: int, width: int) -> dict:
    """The first frame, resized to the image's aspect ratio at about ``height x width`` pixels."""
    from PIL import Image

    image = Image.open(path).convert("RGB")
    step = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]
    area, aspect = height * width, image.height / image.width
    height = round(math.sqrt(area * aspect)) // step * step
    width = round(math.sqrt(area / aspect)) // step * step
    return {"image": image.resize((width, height)), "height": height, "width": width}


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser(__doc__, prompt="A red fox runs through fresh snow in a pine forest",
                          out="wan21.mp4")
    args = parse_args(parser, argv, REAL, TINY)
    build_on = args.device if args.offload == "none" else torch.device("cpu")
    if args.tiny:
        from tessera_diffusers.processors.tiny import tiny_wan_pipeline, wan_prompt_inputs

        pipe, inputs = tiny_wan_pipeline(num_layers=args.layers or 2), wan_prompt_inputs()
        inputs = {name: value.to(args.device) for name, value in inputs.items()}
    elif args.random_weights:
        check_task(parser, False, args.image, "--random-weights (the text-to-video architecture)")
        pipe = random_pipeline(args.layers or 40, build_on, args.dtype)
        inputs = random_prompt(args.seed, args.device, args.dtype)
    else:
        image_to_video = checkpoint_class(parser, args.model, (T2V, I2V)) == I2V
        check_task(parser, image_to_video, args.image, args.model)
        pipe = load_checkpoint(args.model, image_to_video, args.dtype, args.height)
        inputs = {"prompt": args.prompt, "negative_prompt": NEGATIVE}
    if args.image is not None:
        inputs.update(image_inputs(pipe, args.image, args.height, args.width))
    else:
        inputs.update(height=args.height, width=args.width)
    return run_example(pipe, args, Route.WAN_SELF, inputs, FPS)


if __name__ == "__main__":
    main()
