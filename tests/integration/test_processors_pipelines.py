"""Tiny WanPipeline and HunyuanVideo15Pipeline end to end with TesseraProcessor attached (CPU, no
download: local tiny VAEs and schedulers, prompt embeddings passed directly)."""

from __future__ import annotations

import torch

from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.processors.tiny import (
    hunyuan_video15_prompt_inputs,
    tiny_hunyuan_video15_pipeline,
    tiny_wan_pipeline,
    wan_prompt_inputs,
)
from tessera_diffusers.sparsifiers import DenseWarmup, LatentGrid, SSTASparsifier, all_active, tile_layout

STEPS = 3


class ContextLog(TesseraProcessor):
    """The processor, logging the (step, branch) of every forward the hook announces."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def begin_forward(self, context):
        self.log.append((context.step, context.branch))
        super().begin_forward(context)


class Recording:
    def __init__(self, inner):
        self.inner = inner
        self.seen = []

    def layout(self, grid):
        return self.inner.layout(grid)

    def __call__(self, q, k, *, layer, step, grid):
        self.seen.append((layer, step, grid))
        return self.inner(q, k, layer=layer, step=step, grid=grid)


def wan_call(pipe, output_type="latent", size=64):
    return pipe(
        **wan_prompt_inputs(),
        height=size,
        width=size,
        num_frames=5,
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        output_type=output_type,
        generator=torch.Generator().manual_seed(0),
    ).frames


def hv15_call(pipe, output_type="latent", size=64):
    return pipe(
        **hunyuan_video15_prompt_inputs(),
        height=size,
        width=size,
        num_frames=5,
        num_inference_steps=STEPS,
        output_type=output_type,
        generator=torch.Generator().manual_seed(0),
    ).frames


def test_wan_pipeline_all_active_equals_stock_and_sees_every_step():
    pipe = tiny_wan_pipeline()
    stock = wan_call(pipe)
    recorder = Recording(all_active((1, 4, 4)))
    processor = ContextLog(recorder).attach(pipe.transformer)
    torch.testing.assert_close(wan_call(pipe), stock, rtol=1e-5, atol=1e-5)
    grid = LatentGrid(2, 4, 4)  # 5 frames -> 2 latent frames; 64 px / 8 (VAE) / 2 (patch) = 4
    assert recorder.seen == [(layer, step, grid) for step in range(STEPS) for _ in range(2) for layer in range(2)]
    assert processor.log == [(step, branch) for step in range(STEPS) for branch in ("cond", "uncond")]
    assert not processor.cache.slots  # the pipeline's end-of-run reset dropped this video's masks


def test_wan_pipeline_sparse_decodes_a_video():
    pipe = tiny_wan_pipeline()
    sparsifier = DenseWarmup(SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 1), top_k=2), steps=1)
    processor = TesseraProcessor(sparsifier, recompute_every=2).attach(pipe.transformer)
    video = wan_call(pipe, output_type="np", size=128)  # grid 2 x 8 x 8: 8 tiles of 16 tokens
    assert video.shape == (1, 5, 128, 128, 3) and bool(torch.isfinite(torch.as_tensor(video)).all())
    assert processor.stats()["mean_mask_density"] == 0.25  # own tile + top-1 (halved from 2) of 8
    stats = processor.stats()
    assert stats["dense_calls"] == 2 * 2 and stats["sparse_calls"] == 2 * 2 * (STEPS - 1)
    assert stats["cache"]["mask_reuses"] == 2 * 2  # step 2 reuses step 1's masks


def test_hunyuan_video15_pipeline_all_active_equals_stock_and_sees_every_step():
    pipe = tiny_hunyuan_video15_pipeline()
    stock = hv15_call(pipe)
    recorder = Recording(all_active((1, 2, 4)))
    processor = ContextLog(recorder).attach(pipe.transformer)
    torch.testing.assert_close(hv15_call(pipe), stock, rtol=1e-5, atol=1e-5)
    grid = LatentGrid(2, 4, 4)  # 64 px / 16 (VAE), patch 1
    assert recorder.seen == [(layer, step, grid) for step in range(STEPS) for _ in range(2) for layer in range(2)]
    assert processor.log == [(step, branch) for step in range(STEPS) for branch in ("pred_cond", "pred_uncond")]
    assert processor.stats()["calls"]["stock"] == STEPS * 2  # the text refiner, once per forward


def test_hunyuan_video15_pipeline_sparse_decodes_a_video():
    pipe = tiny_hunyuan_video15_pipeline()
    sparsifier = SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 1), top_k=1, halve_top_k_at_frames=0)
    assert tile_layout(LatentGrid(2, 8, 8), (1, 4, 4)).aligned
    processor = TesseraProcessor(sparsifier).attach(pipe.transformer)
    video = hv15_call(pipe, output_type="np", size=128)  # grid 2 x 8 x 8: 8 tiles of 16 tokens
    assert video.shape == (1, 5, 128, 128, 3) and bool(torch.isfinite(torch.as_tensor(video)).all())
    assert processor.stats()["mean_mask_density"] == 0.25
