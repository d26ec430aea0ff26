"""TesseraProcessor under torch.compile: each attention call is one opaque op (processors/compiled.py).

Tiny pipelines on the CPU: the compiled transformer (``compile_repeated_blocks(fullgraph=True)``,
``torch.compile(transformer)``) must give the eager run's latents, let the sparsifier see the same
(layer, step, grid) calls, compile each repeated block once (a recompile is an error here), and
refuse what it cannot do with a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.processors.compiled import marker_of
from tessera_diffusers.processors.tiny import (
    hunyuan_video15_prompt_inputs,
    tiny_hunyuan_video15_pipeline,
    tiny_wan_pipeline,
    tiny_wan_transformer,
    wan_prompt_inputs,
    wan_transformer_inputs,
)
from tessera_diffusers.sparsifiers import DenseWarmup, SSTASparsifier

from .test_processors_pipelines import Recording  # the sparsifier wrapper that logs (layer, step, grid)

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    yield
    torch._dynamo.reset()


def wan_run(pipe):
    return pipe(**wan_prompt_inputs(), height=128, width=128, num_frames=5, num_inference_steps=STEPS,
                guidance_scale=5.0, output_type="latent", generator=torch.Generator().manual_seed(0)).frames


def hv15_run(pipe):
    return pipe(**hunyuan_video15_prompt_inputs(), height=128, width=128, num_frames=5, num_inference_steps=STEPS,
                output_type="latent", generator=torch.Generator().manual_seed(0)).frames


MODELS = {
    # model: (pipeline, run, sparsifier tile, whole-model fullgraph: HunyuanVideo-1.5's own forward
    # branches on its image embeddings' values, which no fullgraph trace of the whole model allows)
    "wan": (tiny_wan_pipeline, wan_run, (1, 4, 4), True),
    "hv15": (tiny_hunyuan_video15_pipeline, hv15_run, (1, 4, 4), False),
}


def sparse_processor(tile):
    sparsifier = Recording(DenseWarmup(SSTASparsifier(tile=tile, window=(1, 1, 1), top_k=2), steps=1))
    processor = TesseraProcessor(sparsifier)
    return processor, sparsifier


def install(pipe, processor, attach: bool):
    if attach:
        processor.attach(pipe.transformer)
    else:
        pipe.transformer.set_attn_processor(processor)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("how", ["repeated_blocks", "whole", "repeated_blocks_attached"])
def test_the_compiled_pipeline_gives_the_eager_latents(model, how):
    make, run, tile, whole_fullgraph = MODELS[model]
    attach = how.endswith("attached")
    pipe = make()
    processor, eager_seen = sparse_processor(tile)
    install(pipe, processor, attach)
    eager = run(pipe)
    eager_stats = processor.stats()

    pipe = make()
    processor, compiled_seen = sparse_processor(tile)
    install(pipe, processor, attach)
    if how == "whole":
        pipe.transformer = torch.compile(pipe.transformer, fullgraph=whole_fullgraph, backend="eager")
    else:
        pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    compiled = run(pipe)

    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert compiled_seen.seen == eager_seen.seen and len(eager_seen.seen) == 2 * 2 * STEPS  # layers x branches x steps
    stats = processor.stats()
    assert stats["sparse_calls"] == eager_stats["sparse_calls"] > 0
    assert stats["calls"] == eager_stats["calls"]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_inductor_compiles_the_blocks_once_and_matches_eager(model):
    """The real backend: inductor's fused kernels around the opaque op, one graph per block class."""
    make, run, tile, _ = MODELS[model]
    pipe = make()
    processor, _ = sparse_processor(tile)
    pipe.transformer.set_attn_processor(processor)
    eager = run(pipe)
    pipe = make()
    processor, _ = sparse_processor(tile)
    pipe.transformer.set_attn_processor(processor)
    pipe.transformer.compile_repeated_blocks(fullgraph=True)
    compiled = run(pipe)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    block_classes = len(pipe.transformer._repeated_blocks)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= block_classes


def test_every_block_shares_one_graph_and_the_op_reaches_each_module():
    transformer = tiny_wan_transformer(num_layers=4)
    processor = TesseraProcessor(DenseWarmup(SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 1), top_k=2), steps=0))
    transformer.set_attn_processor(processor)
    transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    with torch.no_grad():
        transformer(**wan_transformer_inputs(frames=2, size=16))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    routed = {module for module in processor.routes}
    assert {block.attn1 for block in transformer.blocks} <= routed  # each layer found through its marker
    assert [processor.routes[block.attn1].layer for block in transformer.blocks] == [0, 1, 2, 3]


def test_backward_through_the_compiled_processor_is_refused():
    transformer = tiny_wan_transformer(num_layers=1)
    transformer.set_attn_processor(TesseraProcessor(warmup_steps=0))
    transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    out = transformer(**wan_transformer_inputs(frames=2, size=16)).sample
    with pytest.raises(InvalidArgumentError, match="backward"):
        out.sum().backward()


def test_a_copied_processor_is_reached_under_its_own_key():
    processor = TesseraProcessor()
    clone = copy.deepcopy(processor)
    assert clone.compile_key != processor.compile_key
    transformer = tiny_wan_transformer(num_layers=1)
    transformer.set_attn_processor(clone)
    transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    with torch.no_grad():
        transformer(**wan_transformer_inputs(frames=2, size=16))
    assert clone.stats()["calls"]["wan_self_attention"] == 1 and processor.stats()["calls"]["wan_self_attention"] == 0


def test_the_op_refuses_a_module_the_processor_does_not_serve():
    processor = TesseraProcessor()
    stranger = tiny_wan_transformer(num_layers=1).blocks[0].attn1  # keeps its stock processor
    x = torch.randn(1, 8, 24)
    with pytest.raises(InvalidArgumentError, match="installed on"):
        torch.ops.tessera.processor_call(processor.compile_key, marker_of(stranger), x, None, None, None, None, 0, False)
