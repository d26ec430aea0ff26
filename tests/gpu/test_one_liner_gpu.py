"""The one-liner on CUDA with the native kernels (head dim 128, bf16): the same outputs as
``attach()``, native plans only, every layer reusing its plan-table decision, and the output of the
native path against the reference oracle's through the same processor."""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel, WanTransformer3DModel

from tessera_diffusers.processors import TesseraBackend, TesseraProcessor
from tessera_diffusers.runtime import Runtime
from tessera_diffusers.selector import Selector
from tessera_diffusers.sparsifiers import DenseWarmup, spade_64, ssta_384

pytestmark = pytest.mark.gpu
STEPS = 3


def on_gpu(model: torch.nn.Module, inputs: dict) -> tuple[torch.nn.Module, dict]:
    """The model and its inputs in bf16 on the GPU."""
    return model.to("cuda", torch.bfloat16).eval(), {k: v.to("cuda", torch.bfloat16) for k, v in inputs.items()}


def wan_model() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=64, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 4, 64, 64, generator=gen),  # 4 x 32 x 32 = 4,096 tokens
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 32, 64, generator=gen),
    }
    return on_gpu(model, inputs)


def hv15_model() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=128, num_layers=2,
        num_refiner_layers=1, mlp_ratio=1.0, patch_size=1, patch_size_t=1, text_embed_dim=64,
        text_embed_2_dim=32, image_embed_dim=48, rope_axes_dim=(16, 56, 56), target_size=64, task_type="t2v",
    )
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 16, 12, 64, 64, generator=gen),  # 12 x 64 x 64 = 49,152 tokens
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 24, 64, generator=gen),
        "encoder_attention_mask": (torch.arange(24) < 17).float()[None],
        "encoder_hidden_states_2": torch.randn(1, 8, 32, generator=gen),
        "encoder_attention_mask_2": torch.ones(1, 8),
        "image_embeds": torch.zeros(1, 9, 48),
    }
    return on_gpu(model, inputs)


def steps(model, inputs) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for step in range(STEPS):
            with model.cache_context("cond", step_index=step):
                outs.append(model(**inputs).sample.float())
    model._reset_stateful_cache()
    return outs


@pytest.mark.parametrize("name", ["wan", "hv15"])
def test_one_liner_runs_native_plans_like_attach_and_the_oracle(name):
    make = wan_model if name == "wan" else hv15_model
    sparsifier = DenseWarmup(spade_64() if name == "wan" else ssta_384(), steps=1)
    model, inputs = make()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tessera: no native plan")
        processor = TesseraProcessor(sparsifier)
        model.set_attn_processor(processor)
        one_liner = steps(model, inputs)
        stats = processor.stats()
        attached = TesseraProcessor(sparsifier).attach(model)
        via_attach = steps(model, inputs)
    for a, b in zip(one_liner, via_attach):
        assert torch.equal(a, b)
    assert stats["sparse_calls"] == 2 * (STEPS - 1) and 0 < stats["mean_mask_density"] < 1
    plans = stats["plans"]
    assert plans["keys_with_several_plans"] == plans["keys_reusing_every_later_plan"] == 2

    attached.detach(model)
    oracle = TesseraBackend(Runtime(selector=Selector(table=None, kernels=())))  # no native plan: the oracle
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.set_attn_processor(TesseraProcessor(sparsifier, backend=oracle))
        reference = steps(model, inputs)
    for got, want in zip(one_liner[1:], reference[1:]):  # the sparse steps
        err = (got - want).norm() / want.norm()
        assert err < 2e-2, float(err)


@pytest.mark.parametrize("name", ["wan", "hv15"])
def test_the_compiled_one_liner_runs_the_same_native_plans(name):
    """``compile_repeated_blocks(fullgraph=True)`` with inductor around the processor's opaque op:
    the eager one-liner's outputs (inductor's fused norms and activations round differently in bf16,
    hence a tolerance), native plans only, one graph per block class."""
    import torch._dynamo

    make = wan_model if name == "wan" else hv15_model
    sparsifier = DenseWarmup(spade_64() if name == "wan" else ssta_384(), steps=1)
    model, inputs = make()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tessera: no native plan")
        model.set_attn_processor(TesseraProcessor(sparsifier))
        eager = steps(model, inputs)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        processor = TesseraProcessor(sparsifier)
        model.set_attn_processor(processor)
        model.compile_repeated_blocks(fullgraph=True)
        try:
            compiled = steps(model, inputs)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        finally:
            for module in model.modules():
                module._compiled_call_impl = None
            torch._dynamo.reset()
    for got, want in zip(compiled, eager):
        err = (got - want).norm() / want.norm()
        assert err < 2e-2, float(err)
    stats = processor.stats()
    assert stats["sparse_calls"] == 2 * (STEPS - 1)
    assert stats["plans"]["keys_reusing_every_later_plan"] == 2
    assert graphs <= len(model._repeated_blocks)


@pytest.mark.parametrize("name", ["wan", "hv15"])
def test_the_8bit_one_liner_runs_the_8bit_kernels_within_the_budget(name):
    """``TesseraProcessor(precision="int8")`` on sm90: the 8-bit kernels on every sparse call (no
    fallback warning), each sparse step's output close to the bf16 one-liner's and to the oracle's
    through the same processor (the model's output, after every layer's 8-bit attention)."""
    from tessera_diffusers.library import quantized_library

    if torch.cuda.get_device_capability() != (9, 0) or quantized_library() is None:
        pytest.skip("the 8-bit kernels need sm90 and a library built with them")
    make = wan_model if name == "wan" else hv15_model
    sparsifier = DenseWarmup(spade_64() if name == "wan" else ssta_384(), steps=1)
    model, inputs = make()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tessera: no native plan")
        warnings.filterwarnings("error", message=".*int8")
        model.set_attn_processor(TesseraProcessor(sparsifier))
        bf16 = steps(model, inputs)
        processor = TesseraProcessor(sparsifier, precision="int8")
        model.set_attn_processor(processor)
        int8 = steps(model, inputs)
    oracle = TesseraBackend(Runtime(selector=Selector(table=None, kernels=())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.set_attn_processor(TesseraProcessor(sparsifier, backend=oracle))
        reference = steps(model, inputs)
    assert processor.stats()["precision"] == "int8" and processor.stats()["sparse_calls"] == 2 * (STEPS - 1)
    assert torch.equal(int8[0], bf16[0])  # the dense warm-up step is the same computation
    for got, fast, want in zip(int8[1:], bf16[1:], reference[1:]):
        assert bool(torch.isfinite(got).all())
        assert float((got - fast).norm() / fast.norm()) < 3e-2
        assert float((got - want).norm() / want.norm()) < 3e-2
