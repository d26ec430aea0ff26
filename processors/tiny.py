"""Tiny random-weight Wan2.1 and HunyuanVideo-1.5 models and pipelines, built locally (no download).

For tests, examples and smoke runs on the CPU. The constructor arguments follow diffusers' own
tests of these models; nothing here is meant to produce a meaningful video.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLWan,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    WanPipeline,
    WanTransformer3DModel,
)

TEXT_DIM = 16


def tiny_wan_transformer(
    num_layers: int = 2, image: bool = False, seed: int = 0, heads: int = 2
) -> WanTransformer3DModel:
    """``heads`` heads x 12, ``num_layers`` blocks; ``image=True`` adds the I2V image cross-attention."""
    torch.manual_seed(seed)
    extra = {"image_dim": 12, "added_kv_proj_dim": 24} if image else {}
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        **extra,
    ).eval()


def tiny_hunyuan_video15_transformer(
    num_layers: int = 2, in_channels: int = 4, seed: int = 0
) -> HunyuanVideo15Transformer3DModel:
    """2 heads x 8, ``num_layers`` blocks, one refiner block; text dims 16 (Qwen) and 8 (byT5)."""
    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(
        in_channels=in_channels,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=num_layers,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=8,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=16,
        task_type="t2v",
    ).eval()


def tiny_wan_pipeline(num_layers: int = 2, seed: int = 0) -> WanPipeline:
    """WanPipeline with the tiny transformer, a tiny Wan VAE (4 latent channels), no text encoder."""
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()
    return WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_transformer(num_layers, seed=seed),
    )


def tiny_hunyuan_video15_pipeline(num_layers: int = 2, seed: int = 0) -> HunyuanVideo15Pipeline:
    """HunyuanVideo15Pipeline with the tiny transformer (latents + condition + mask channels =
    9 inputs), a tiny VAE (4 latent channels), CFG guider, no text encoders."""
    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(32, 32, 32, 32, 32), layers_per_block=1)
    return HunyuanVideo15Pipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=tiny_hunyuan_video15_transformer(num_layers, in_channels=9, seed=seed),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def wan_transformer_inputs(frames: int = 2, size: int = 16, batch: int = 1, text: int = 12, seed: int = 0) -> dict:
    """Forward inputs of ``tiny_wan_transformer``: latents ``[B, 4, frames, size, size]`` (a
    ``frames x size/2 x size/2`` token grid), timestep 500, text ``[B, text, 16]``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, frames, size, size, generator=gen),
        "timestep": torch.tensor([500] * batch),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=gen),
    }


def hunyuan_video15_transformer_inputs(
    batch: int = 1, frames: int = 2, size: int = 8, image: bool = False, seed: int = 0, valid=(3,), valid_2=(2,)
) -> dict:
    """Forward inputs of ``tiny_hunyuan_video15_transformer``: latents ``[B, 4, frames, size, size]``,
    timestep 500, 6 Qwen and 4 byT5 text tokens of which the first ``valid`` / ``valid_2`` (one
    count, or one per batch element) are valid, image embeddings ``[B, 3, 12]`` (zeros unless ``image``)."""
    gen = torch.Generator().manual_seed(seed)
    valid = list(valid) * batch if len(valid) == 1 else list(valid)
    valid_2 = list(valid_2) * batch if len(valid_2) == 1 else list(valid_2)
    return {
        "hidden_states": torch.randn(batch, 4, frames, size, size, generator=gen),
        "timestep": torch.tensor([500.0] * batch),
        "encoder_hidden_states": torch.randn(batch, 6, TEXT_DIM, generator=gen),
        "encoder_attention_mask": torch.stack([(torch.arange(6) < n).long() for n in valid]),
        "encoder_hidden_states_2": torch.randn(batch, 4, 8, generator=gen),
        "encoder_attention_mask_2": torch.stack([(torch.arange(4) < n).long() for n in valid_2]),
        "image_embeds": torch.randn(batch, 3, 12, generator=gen) if image else torch.zeros(batch, 3, 12),
    }


def wan_prompt_inputs(batch: int = 1, text_tokens: int = 12, seed: int = 0) -> dict:
    """``prompt_embeds`` / ``negative_prompt_embeds`` for the tiny Wan pipeline."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "prompt_embeds": torch.randn(batch, text_tokens, TEXT_DIM, generator=gen),
        "negative_prompt_embeds": torch.randn(batch, text_tokens, TEXT_DIM, generator=gen),
    }


def hunyuan_video15_prompt_inputs(batch: int = 1, valid: int = 3, valid_2: int = 2, seed: int = 0) -> dict:
    """Prompt embeddings and 1-D masks (6 Qwen tokens, 4 byT5 tokens; the first ``valid`` /
    ``valid_2`` valid) for the tiny HunyuanVideo-1.5 pipeline, positive and negative."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(6) < valid).float().expand(batch, 6).clone()
    mask_2 = (torch.arange(4) < valid_2).float().expand(batch, 4).clone()
    inputs = {}
    for prefix in ("", "negative_"):
        inputs[f"{prefix}prompt_embeds"] = torch.randn(batch, 6, TEXT_DIM, generator=gen)
        inputs[f"{prefix}prompt_embeds_mask"] = mask
        inputs[f"{prefix}prompt_embeds_2"] = torch.randn(batch, 4, 8, generator=gen)
        inputs[f"{prefix}prompt_embeds_mask_2"] = mask_2
    return inputs
