"""The processor beside the diffusers hooks and adapters users combine it with, on tiny models on the CPU.

Caching hooks (FirstBlockCache, TaylorSeer, MagCache) skip whole transformer blocks on some steps,
so the processor is not called for them; group offloading wraps every block in hooks that move its
weights. With masks that keep every block (Tessera's reference path then computes exact attention)
each combination must give the stock processors' outputs under the same hook, step for step, and the
processor's own step count (dense warm-up, then sparse) must follow the steps, not the calls. A LoRA
adapter (peft) wraps the attention projections the processor calls.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig
from peft import LoraConfig

from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.processors.tiny import (
    hunyuan_video15_transformer_inputs,
    tiny_hunyuan_video15_transformer,
    tiny_wan_transformer,
    wan_transformer_inputs,
)
from tessera_diffusers.sparsifiers import DenseWarmup, all_active, ssta_64

STEPS = 4
CACHES = {
    # Thresholds far above any change between steps: the skip decisions do not hinge on rounding.
    "first_block_cache": lambda: FirstBlockCacheConfig(threshold=10.0),
    "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1),
    "mag_cache": lambda: MagCacheConfig(threshold=10.0, max_skip_steps=2, retention_ratio=0.25,
                                        num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS),
}


MODELS = {"wan": (tiny_wan_transformer, wan_transformer_inputs),
          "hv15": (tiny_hunyuan_video15_transformer, hunyuan_video15_transformer_inputs)}


def denoise(model, inputs: dict, steps: int = STEPS) -> list[torch.Tensor]:
    """One guidance branch of ``steps`` steps (timesteps falling), each output kept."""
    outs = []
    for step in range(steps):
        with torch.no_grad(), model.cache_context("cond"):
            outs.append(model(**{**inputs, "timestep": torch.tensor([900.0 - 100 * step])}).sample)
    return outs


def pair(model_name: str):
    """Two identical tiny transformers (3 blocks): stock processors, and Tessera with masks that
    keep every block."""
    make, inputs = MODELS[model_name]
    stock, tessera = make(num_layers=3), make(num_layers=3)
    processor = TesseraProcessor(all_active((1, 4, 4))).attach(tessera)
    return stock, tessera, processor, inputs()


def assert_same_steps(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (step, float((a - b).abs().max()))


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("cache", sorted(CACHES))
def test_caching_hooks_skip_blocks_as_with_the_stock_processors(model_name, cache):
    stock, tessera, processor, inputs = pair(model_name)
    try:
        stock.enable_cache(CACHES[cache]())
    except ValueError as stock_error:  # a block class this diffusers release does not register for the cache
        with pytest.raises(ValueError) as error:
            tessera.enable_cache(CACHES[cache]())
        assert str(error.value) == str(stock_error)  # the same refusal, nothing of Tessera's in the way
        return
    tessera.enable_cache(CACHES[cache]())
    expected = denoise(stock, inputs)
    got = denoise(tessera, inputs)
    assert_same_steps(expected, got)
    calls = sum(processor.stats()["calls"].values()) - processor.stats()["calls"]["stock"]
    assert 0 < processor.stats()["sparse_calls"] == calls <= STEPS * 3
    if cache != "taylorseer":  # these skip whole blocks (TaylorSeer predicts outputs inside them)
        assert calls < STEPS * 3, processor.stats()


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_group_offloading_gives_the_stock_outputs(model_name, offload_type):
    stock, tessera, _, inputs = pair(model_name)
    for model in (stock, tessera):
        model.enable_group_offload(onload_device=torch.device("cpu"), offload_type=offload_type,
                                   **({"num_blocks_per_group": 1} if offload_type == "block_level" else {}))
    assert_same_steps(denoise(stock, inputs, 2), denoise(tessera, inputs, 2))


def test_dense_warmup_counts_steps_when_a_cache_skips_blocks():
    """FirstBlockCache with a high threshold runs all 3 blocks at step 0 and only the first block
    after it: a 2-step dense warm-up is steps 0 and 1 (3 + 1 dense calls), then 1 sparse call per step."""
    model = tiny_wan_transformer(num_layers=3)
    processor = TesseraProcessor(DenseWarmup(ssta_64(), steps=2)).attach(model)
    model.enable_cache(FirstBlockCacheConfig(threshold=10.0))
    outs = denoise(model, wan_transformer_inputs())
    stats = processor.stats()
    assert (stats["dense_calls"], stats["sparse_calls"]) == (3 + 1, 1 + 1), stats
    assert all(torch.isfinite(out).all() for out in outs)


def test_sparse_masks_are_unchanged_by_group_offloading():
    """Real sparse masks (SSTA-style, 64-token tiles): offloading moves weights only, so the outputs
    equal the same processor's without it."""
    outs = []
    for offload in (False, True):
        model = tiny_wan_transformer(num_layers=2)
        TesseraProcessor(ssta_64()).attach(model)
        if offload:
            model.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level",
                                       num_blocks_per_group=1)
        outs.append(denoise(model, wan_transformer_inputs(), 2))
    assert_same_steps(*outs)


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_a_lora_adapter_on_the_attention_projections_applies_as_with_the_stock_processors(model_name):
    make, inputs = MODELS[model_name]
    outs = []
    for with_tessera in (False, True):
        model = make(num_layers=2)
        torch.manual_seed(1)  # the same random LoRA weights in both models (B not zero: the adapter acts)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                     init_lora_weights=False))
        if with_tessera:
            TesseraProcessor(all_active((1, 4, 4))).attach(model)
        outs.append(denoise(model, inputs(), 1))
    assert_same_steps(*outs)
    base = denoise(make(num_layers=2), inputs(), 1)
    assert (outs[1][0] - base[0]).abs().max() > 1e-3  # the adapter changed the output
