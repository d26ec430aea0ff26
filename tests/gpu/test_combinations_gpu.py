"""The one-liner on CUDA beside what users combine it with where the GPU matters: a pipeline's
``enable_model_cpu_offload``, group offloading with CUDA streams, and transformers quantized by the
backends diffusers supports (torchao, bitsandbytes). Each must run the native plans and give what
the same model gives without the combination (offloading: identical; quantization: against the same
quantized model through the reference oracle)."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from tessera_diffusers.processors import TesseraBackend, TesseraProcessor
from tessera_diffusers.runtime import Runtime
from tessera_diffusers.selector import Selector
from tessera_diffusers.sparsifiers import DenseWarmup, spade_64

from .test_one_liner_gpu import steps, wan_model

pytestmark = pytest.mark.gpu


def sparse_one_liner(model: torch.nn.Module) -> TesseraProcessor:
    processor = TesseraProcessor(DenseWarmup(spade_64(), steps=1))
    model.set_attn_processor(processor)
    return processor


@contextlib.contextmanager
def native_only():
    """A fallback to the reference path is an error here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tessera: no native plan")
        yield


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def wan_pipeline(transformer: WanTransformer3DModel) -> WanPipeline:
    """A pipeline around the head-dim-128 test transformer (16 latent channels), prompt embeddings
    given, latents returned (the tiny VAE only sets the scale factors)."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def pipeline_latents(pipe: WanPipeline) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randn(1, 32, 64, generator=gen).to("cuda", torch.bfloat16)  # the pipeline moves no given embeds
    negative = torch.randn(1, 32, 64, generator=gen).to("cuda", torch.bfloat16)
    return pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, height=512, width=512, num_frames=13,
                num_inference_steps=3, guidance_scale=5.0, output_type="latent",
                generator=torch.Generator("cuda").manual_seed(0)).frames  # 4 x 32 x 32 tokens


def test_enable_model_cpu_offload_gives_the_resident_pipelines_latents():
    pytest.importorskip("accelerate")
    transformer, _ = wan_model()
    pipe = wan_pipeline(transformer).to("cuda")
    with native_only():
        sparse_one_liner(pipe.transformer)
        resident = pipeline_latents(pipe)
        pipe.to("cpu")
        processor = sparse_one_liner(pipe.transformer)
        pipe.enable_model_cpu_offload(device="cuda")
        offloaded = pipeline_latents(pipe)
    assert torch.equal(offloaded.cpu(), resident.cpu())
    assert processor.stats()["sparse_calls"] > 0 and pipe.transformer.device.type == "cpu"  # moved back


@pytest.mark.parametrize("use_stream", [False, True])
def test_group_offloading_on_cuda_gives_the_resident_outputs(use_stream):
    model, inputs = wan_model()
    with native_only():
        sparse_one_liner(model)
        resident = steps(model, inputs)
        model.to("cpu")
        processor = sparse_one_liner(model)
        model.enable_group_offload(onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream)
        offloaded = steps(model, inputs)
    for a, b in zip(offloaded, resident):
        assert torch.equal(a, b)
    assert processor.stats()["plans"]["keys_reusing_every_later_plan"] == 2


def quantized_wan(tmp_path, config) -> tuple[torch.nn.Module, dict]:
    model, inputs = wan_model()
    model.to("cpu", torch.float32).save_pretrained(tmp_path / "wan")
    quantized = WanTransformer3DModel.from_pretrained(tmp_path / "wan", quantization_config=config,
                                                      torch_dtype=torch.bfloat16)
    if next(quantized.parameters()).device.type != "cuda":  # bitsandbytes loads onto the GPU itself
        quantized = quantized.to("cuda")
    return quantized, inputs


def torchao_int8_weight_only():
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


QUANTIZATIONS = {
    "torchao_int8_weight_only": torchao_int8_weight_only,
    "bitsandbytes_8bit": lambda: __import__("diffusers").BitsAndBytesConfig(load_in_8bit=True),
    "bitsandbytes_nf4": lambda: __import__("diffusers").BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(QUANTIZATIONS))
def test_a_quantized_transformer_runs_the_native_plans(tmp_path, name):
    pytest.importorskip("torchao" if name.startswith("torchao") else "bitsandbytes")
    model, inputs = quantized_wan(tmp_path, QUANTIZATIONS[name]())
    with native_only():
        processor = sparse_one_liner(model)
        native = steps(model, inputs)
    oracle = TesseraBackend(Runtime(selector=Selector(table=None, kernels=())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.set_attn_processor(TesseraProcessor(DenseWarmup(spade_64(), steps=1), backend=oracle))
        reference = steps(model, inputs)
    assert processor.stats()["sparse_calls"] > 0
    for got, want in zip(native[1:], reference[1:]):  # the sparse steps
        assert relative(got, want) < 2e-2
