r"""HunyuanVideo-1.5 text-to-video (image-to-video with --image) with Tessera's sparse joint attention.

    python examples/hunyuanvideo15.py --model hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v \
        --prompt "A cat walks on the grass, realistic" --out hv15.mp4
    python examples/hunyuanvideo15.py --model /models/HunyuanVideo-1.5-Diffusers-720p_i2v \
        --image first_frame.png --offload model --out hv15_i2v.mp4
    python examples/hunyuanvideo15.py --random-weights --layers 4 --compare-dense --out hv15_random.mp4
    python examples/hunyuanvideo15.py --tiny --steps 3 --warmup-steps 1 --sparsifier spade_64 \
        --out /tmp/hv15.mp4                                                             # quick CPU check

The first takes the checkpoint from the Hugging Face hub, the second a local diffusers folder
(image-to-video: the size follows the image at the checkpoint's resolution); the third builds the
8.3B architecture with random weights (4 of its 54 blocks) and random text embeddings, offline, and
compares with stock attention; the last runs a tiny model on the CPU: one dense warm-up step, then
two steps of sparse attention. The model's own tiles (6 x 8 x 8 tokens) cover the tiny video whole,
so the quick check names ``spade_64`` (64-token blocks) to make sparse masks at that size.

Tessera is installed as the README says, ``pipe.transformer.set_attn_processor(TesseraProcessor())``:
HunyuanVideo-1.5's own SSTA scheme (3 x 3 x 3 tile window + top-k tiles, text dense) after 10 dense
steps, unless ``--sparsifier`` or ``--warmup-steps`` say otherwise. At 720p and 121 frames the joint
attention covers 31 x 45 x 80 = 111,600 video tokens and up to 1,985 text tokens.
"""

from __future__ import annotations

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

T2V, I2V = "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"
REAL, TINY = Size(720, 1280, 121), Size(256, 256, 5)  # tiny: 2 x 16 x 16 tokens
FPS = 24


def load_checkpoint(model: str, image_to_video: bool, dtype: torch.dtype):
    """The pipeline from a hub id or folder, the VAE decoding in tiles (diffusers' recommendation)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    pipe = (HunyuanVideo15ImageToVideoPipeline if image_to_video else HunyuanVideo15Pipeline).from_pretrained(
        model, torch_dtype=dtype
    )
    pipe.vae.enable_tiling()
    return pipe


def random_pipeline(layers: int, image_to_video: bool, device: torch.device, dtype: torch.dtype):
    """The T2V or I2V pipeline with the 8.3B transformer architecture (``layers`` blocks) and the
    HunyuanVideo-1.5 VAE, all random; no text encoders (the prompt embeddings are random too)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )

    with torch.device(device):
        task = "i2v" if image_to_video else "t2v"
        transformer = HunyuanVideo15Transformer3DModel(num_layers=layers, target_size=720, task_type=task)
        vae = AutoencoderKLHunyuanVideo15()
    vae.enable_tiling()
    parts = {
        "text_encoder": None, "tokenizer": None, "text_encoder_2": None, "tokenizer_2": None,
        "transformer": cast_like_pretrained(transformer, dtype), "vae": cast_like_pretrained(vae, dtype),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0), "guider": ClassifierFreeGuidance(guidance_scale=6.0),
    }
    if not image_to_video:
        return HunyuanVideo15Pipeline(**parts)
    return HunyuanVideo15ImageToVideoPipeline(**parts, **random_image_encoder(device, dtype))


def random_image_encoder(device: torch.device, dtype: torch.dtype) -> dict:
    """A SigLIP-so400m-shaped image encoder with 2 random blocks: 27 x 27 = 729 image tokens, as
    the I2V transformer expects."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(
        hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=384, patch_size=14,
        num_hidden_layers=2,
    )
    with torch.device(device):
        encoder = SiglipVisionModel(config).to(dtype).eval()
    return {"image_encoder": encoder, "feature_extractor": SiglipImageProcessor(size={"height": 384, "width": 384})}


def random_prompt(seed: int, device: torch.device, dtype: torch.dtype, valid: int = 120) -> dict:
    """Embeddings for both text encoders (1,000 Qwen2.5-VL tokens with ``valid`` valid, 256 byT5
    tokens, none valid: no glyph text), positive and negative."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for side in ("", "negative_"):
        out[f"{side}prompt_embeds"] = torch.randn(1, 1000, 3584, generator=gen).to(device, dtype)
        out[f"{side}prompt_embeds_mask"] = (torch.arange(1000) < valid).to(device, dtype)[None]
        out[f"{side}prompt_embeds_2"] = torch.zeros(1, 256, 1472, device=device, dtype=dtype)
        out[f"{side}prompt_embeds_mask_2"] = torch.zeros(1, 256, device=device, dtype=dtype)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser(__doc__, prompt="The camera slowly pushes in while leaves drift in the wind",
                          out="hunyuanvideo15.mp4")
    args = parse_args(parser, argv, REAL, TINY)
    build_on = args.device if args.offload == "none" else torch.device("cpu")
    image_to_video = args.image is not None
    if args.tiny:
        from tessera_diffusers.processors.tiny import hunyuan_video15_prompt_inputs, tiny_hunyuan_video15_pipeline

        pipe = tiny_hunyuan_video15_pipeline(num_layers=args.layers or 2)
        inputs = {name: value.to(args.device) for name, value in hunyuan_video15_prompt_inputs().items()}
    elif args.random_weights:
        pipe = random_pipeline(args.layers or 54, image_to_video, build_on, args.dtype)
        pipe.target_size = min(args.height, args.width)  # I2V sizes follow the image at this resolution
        inputs = random_prompt(args.seed, args.device, args.dtype)
    else:
        image_to_video = checkpoint_class(parser, args.model, (T2V, I2V)) == I2V
        check_task(parser, image_to_video, args.image, args.model)
        pipe, inputs = load_checkpoint(args.model, image_to_video, args.dtype), {"prompt": args.prompt}
    if image_to_video:
        from PIL import Image

        inputs["image"] = Image.open(args.image).convert("RGB")
    else:
        inputs.update(height=args.height, width=args.width)
    return run_example(pipe, args, Route.HV15_JOINT, inputs, FPS)


if __name__ == "__main__":
    main()
