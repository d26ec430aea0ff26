"""The one-liner ``transformer.set_attn_processor(TesseraProcessor())`` on tiny Wan2.1 and
HunyuanVideo-1.5 models and pipelines (CPU, fp32): it learns the latent grid, the step and the guidance
branch by itself, makes the same masks and outputs as ``attach()``, picks the per-model defaults,
keeps no mask it cannot reuse, survives activation checkpointing, and raises where it cannot know
the grid.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15RotaryPosEmbed
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from tessera_diffusers import InvalidArgumentError
from tessera_diffusers.processors import TesseraProcessor
from tessera_diffusers.processors.compat import cache_context, cached_child_registries, hook_registry_of
from tessera_diffusers.processors.context import GridReader, Route, grid_from_rotary
from tessera_diffusers.processors.processor import DEFAULT_WARMUP_STEPS, default_sparsifier
from tessera_diffusers.processors.tiny import (
    hunyuan_video15_prompt_inputs,
    tiny_hunyuan_video15_pipeline,
    tiny_hunyuan_video15_transformer,
    tiny_wan_pipeline,
    tiny_wan_transformer,
    wan_prompt_inputs,
)
from tessera_diffusers.sparsifiers import DenseWarmup, LatentGrid, SSTASparsifier

TOL = {"rtol": 1e-5, "atol": 1e-5}
GRIDS = [(3, 8, 6), (1, 8, 6), (3, 1, 6), (3, 8, 1), (1, 1, 6), (3, 1, 1), (1, 8, 1), (1, 1, 1), (21, 45, 80)]


# --------------------------------------------------------------------------- the grid from the rotary table
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_grid_is_read_off_both_models_rotary_tables(grid):
    frames, height, width = grid
    wan = WanRotaryPosEmbed(128, (1, 2, 2), 1024)
    cos_sin = wan(torch.empty(1, 16, frames, 2 * height, 2 * width))
    assert grid_from_rotary(cos_sin, frames * height * width) == LatentGrid(*grid)
    hv15 = HunyuanVideo15RotaryPosEmbed(1, 1, [16, 56, 56])
    cos_sin = hv15(torch.empty(1, 65, frames, height, width))
    assert grid_from_rotary(cos_sin, frames * height * width) == LatentGrid(*grid)


def test_the_grid_reader_follows_every_grid_of_as_many_tokens():
    # Remembered grids are checked where their axes wrap: a portrait after a landscape video (the
    # same token count) is read again, never taken for the last one.
    grids = [(f, h, w) for f in range(1, 7) for h in range(1, 25) for w in range(1, 25) if f * h * w == 144]
    wan = WanRotaryPosEmbed(128, (1, 2, 2), 1024)
    hv15 = HunyuanVideo15RotaryPosEmbed(1, 1, [16, 56, 56])
    for rope, scale in ((wan, 2), (hv15, 1)):
        reader = GridReader()
        for grid in grids + grids[::-1]:
            table = rope(torch.empty(1, 16, grid[0], grid[1] * scale, grid[2] * scale))
            assert reader(table, 144) == LatentGrid(*grid)


@pytest.mark.parametrize("grid", GRIDS[:-1], ids=lambda g: "x".join(map(str, g)))
def test_a_remembered_grid_is_confirmed_without_reading_the_whole_table(grid, monkeypatch):
    from tessera_diffusers.processors import context

    wan = WanRotaryPosEmbed(128, (1, 2, 2), 1024)
    table = wan(torch.empty(1, 16, grid[0], 2 * grid[1], 2 * grid[2]))
    reader = GridReader()
    reader(table, math.prod(grid))

    def full_read(*args):
        raise AssertionError("the whole table was read again")

    monkeypatch.setattr(context, "derive_grid", full_read)
    assert reader(table, math.prod(grid)) == LatentGrid(*grid)


def test_grid_reading_survives_a_bf16_table():
    wan = WanRotaryPosEmbed(128, (1, 2, 2), 1024).to(torch.bfloat16)  # model.to(bf16) converts the buffers
    cos_sin = wan(torch.empty(1, 16, 5, 18, 14))
    assert grid_from_rotary(cos_sin, 5 * 9 * 7) == LatentGrid(5, 9, 7)


def test_a_table_that_is_not_a_whole_video_raises():
    hv15 = HunyuanVideo15RotaryPosEmbed(1, 1, [16, 56, 56])
    cos, sin = hv15(torch.empty(1, 65, 3, 8, 6))
    with pytest.raises(InvalidArgumentError, match="rotary embedding"):
        grid_from_rotary((cos[:72], sin[:72]), 72)  # a context-parallel chunk of the sequence
    with pytest.raises(InvalidArgumentError, match="rotary embedding"):
        grid_from_rotary((torch.randn(144, 8), torch.randn(144, 8)), 144)
    with pytest.raises(InvalidArgumentError, match="over the call's 100 video tokens"):
        grid_from_rotary((cos, sin), 100)


# --------------------------------------------------------------------------- one-liner == attach
class MaskLog:
    """A sparsifier that records every mask it makes (with layer, step and grid)."""

    def __init__(self, inner):
        self.inner = inner
        self.seen: list[tuple] = []

    def layout(self, grid):
        return self.inner.layout(grid)

    def __call__(self, q, k, *, layer, step, grid):
        mask = self.inner(q, k, layer=layer, step=step, grid=grid)
        self.seen.append((layer, step, grid, None if mask is None else mask.blocks.clone()))
        return mask


def same_log(a: list[tuple], b: list[tuple]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x[:3] != y[:3] or (x[3] is None) != (y[3] is None):
            return False
        if x[3] is not None and not torch.equal(x[3], y[3]):
            return False
    return True


def sparse_sparsifier():
    return DenseWarmup(SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 3), top_k=1), steps=1)


def wan_forward(model, frames, size, image, seed):
    gen = torch.Generator().manual_seed(seed)
    kwargs = {
        "hidden_states": torch.randn(1, 4, frames, size, size, generator=gen),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 12, 16, generator=gen),
    }
    if image:
        kwargs["encoder_hidden_states_image"] = torch.randn(1, 4, 12, generator=gen)
    return model(**kwargs).sample


def hv15_forward(model, frames, size, image, seed):
    gen = torch.Generator().manual_seed(seed)
    return model(
        hidden_states=torch.randn(1, 4, frames, size, size, generator=gen),
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=gen),
        encoder_attention_mask=(torch.arange(6) < 4).long()[None],
        encoder_hidden_states_2=torch.randn(1, 4, 8, generator=gen),
        encoder_attention_mask_2=torch.ones(1, 4, dtype=torch.long),
        image_embeds=torch.randn(1, 3, 12, generator=gen) if image else torch.zeros(1, 3, 12),
    ).sample


def loop(model, forward, image, resolutions, with_step_index):
    """Two steps x (cond, uncond) per resolution, under the pipelines' cache_context."""
    outs = []
    with torch.no_grad():
        for frames, size in resolutions:
            for step in range(2):
                for branch in ("cond", "uncond"):
                    with cache_context(model, branch, step if with_step_index else None):
                        outs.append(forward(model, frames, size, image, seed=step))
            model._reset_stateful_cache()  # the end of a pipeline run
    return outs


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("model_name", ["wan", "hv15"])
def test_one_liner_and_attach_make_the_same_masks_and_outputs(model_name, image):
    if model_name == "wan":
        make, forward, resolutions, with_step_index = (
            lambda: tiny_wan_transformer(num_layers=2, image=image), wan_forward, [(3, 16), (2, 24)], True)
    else:
        make, forward, resolutions, with_step_index = (
            lambda: tiny_hunyuan_video15_transformer(num_layers=2), hv15_forward, [(3, 8), (2, 12)], False)
    explicit, plain = make(), make()
    attached_log, plain_log = MaskLog(sparse_sparsifier()), MaskLog(sparse_sparsifier())
    TesseraProcessor(attached_log).attach(explicit)
    plain.set_attn_processor(TesseraProcessor(plain_log))
    want = loop(explicit, forward, image, resolutions, with_step_index)
    got = loop(plain, forward, image, resolutions, with_step_index)
    assert same_log(attached_log.seen, plain_log.seen)
    steps = [(layer, step) for layer, step, _, blocks in plain_log.seen if blocks is not None]
    assert steps and all(step == 1 for _, step in steps)  # step 0 dense (warm-up), step 1 sparse
    assert any(not bool(blocks.all()) for *_, blocks in plain_log.seen if blocks is not None)  # really sparse
    assert {grid for _, _, grid, _ in plain_log.seen} == {
        LatentGrid(f, s // (2 if model_name == "wan" else 1), s // (2 if model_name == "wan" else 1))
        for f, s in resolutions
    }
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_one_liner_in_the_pipelines_sees_each_step_and_branch():
    steps = 3
    pipe = tiny_wan_pipeline()
    log = MaskLog(sparse_sparsifier())
    processor = TesseraProcessor(log)
    pipe.transformer.set_attn_processor(processor)
    pipe(**wan_prompt_inputs(), height=64, width=64, num_frames=5, num_inference_steps=steps, guidance_scale=5.0,
         output_type="latent", generator=torch.Generator().manual_seed(0))
    layers = pipe.transformer.config.num_layers
    assert [(layer, step) for layer, step, *_ in log.seen] == [
        (layer, step) for step in range(steps) for _ in ("cond", "uncond") for layer in range(layers)]
    assert processor.stats()["dense_calls"] == 2 * layers and processor.stats()["sparse_calls"] == 4 * layers

    pipe = tiny_hunyuan_video15_pipeline()
    log = MaskLog(sparse_sparsifier())
    pipe.transformer.set_attn_processor(TesseraProcessor(log))
    pipe(**hunyuan_video15_prompt_inputs(), height=64, width=64, num_frames=5, num_inference_steps=steps,
         output_type="latent", generator=torch.Generator().manual_seed(0))
    layers = pipe.transformer.config.num_layers
    branches = 2  # the pipeline's guider runs pred_cond and pred_uncond, named, without a step index
    assert [step for _, step, *_ in log.seen] == [step for step in range(steps) for _ in range(branches * layers)]


# --------------------------------------------------------------------------- defaults
def test_defaults_are_chosen_per_model_and_shown():
    wan, hv15 = default_sparsifier(Route.WAN_SELF), default_sparsifier(Route.HV15_JOINT)
    assert isinstance(wan, DenseWarmup) and wan.steps == DEFAULT_WARMUP_STEPS
    assert isinstance(hv15, DenseWarmup) and hv15.inner == SSTASparsifier()  # HunyuanVideo-1.5's own setting

    model = tiny_wan_transformer(num_layers=2)
    processor = TesseraProcessor()
    model.set_attn_processor(processor)
    with torch.no_grad():
        for step in range(DEFAULT_WARMUP_STEPS + 1):
            with cache_context(model, "cond", step):
                wan_forward(model, 12, 32, False, seed=0)  # a 12 x 16 x 16 grid: 8 of the default's tiles
    stats = processor.stats()
    assert set(stats["sparsifiers"]) == {"wan_self_attention"}
    assert repr(wan.inner) in stats["sparsifiers"]["wan_self_attention"]
    assert stats["dense_calls"] == 2 * DEFAULT_WARMUP_STEPS and stats["sparse_calls"] == 2
    assert 0 < stats["mean_mask_density"] < 1
    assert "wan_self_attention" in repr(processor)


def test_timing_and_plan_reuse_are_reported():
    model = tiny_wan_transformer(num_layers=2)
    processor = TesseraProcessor(sparse_sparsifier(), time_attention=True)
    model.set_attn_processor(processor)
    with torch.no_grad():
        for step in range(4):
            with cache_context(model, "cond", step):
                wan_forward(model, 3, 16, False, seed=step)
    stats = processor.stats()
    assert stats["attention_ms"] > 0 and stats["attention_calls"] == 2 * 4
    plans = stats["plans"]  # 2 layers x 3 sparse steps
    assert plans["keys"] == 2 and plans["plans_prepared"] == 6
    assert plans["keys_reusing_every_later_plan"] == plans["keys_with_several_plans"] == 2


# --------------------------------------------------------------------------- memory
def test_one_step_masks_are_not_kept_and_the_budget_follows_the_model():
    model = tiny_wan_transformer(num_layers=2)
    processor = TesseraProcessor(sparse_sparsifier())
    model.set_attn_processor(processor)
    with torch.no_grad():
        for step in range(3):
            with cache_context(model, "cond", step):
                wan_forward(model, 3, 16, False, seed=step)
    report = processor.stats()["cache"]
    assert report["slots"] == 0 and report["bytes"] == 0
    hidden_bytes = 1 * 3 * 8 * 8 * (2 * 12) * 4  # [B, S, C] fp32 of the first sparse call
    assert report["max_bytes"] == 2 * hidden_bytes


# --------------------------------------------------------------------------- training
@pytest.mark.parametrize("recompute_every", [1, 2])
@pytest.mark.parametrize("model_name", ["wan", "hv15"])
def test_gradient_checkpointing_gives_the_same_gradients(model_name, recompute_every):
    # The replay in the backward pass must save what the forward saved: masks are made outside
    # autograd, and a replayed call sees its forward's step (so a kept mask serves both alike).
    make = tiny_wan_transformer if model_name == "wan" else tiny_hunyuan_video15_transformer
    forward = wan_forward if model_name == "wan" else hv15_forward
    grads = []
    for checkpointing in (False, True):
        model = make(num_layers=2).train()
        sparsifier = SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 3), top_k=1)
        model.set_attn_processor(TesseraProcessor(sparsifier, recompute_every=recompute_every))
        if checkpointing:
            model.enable_gradient_checkpointing()
        out = forward(model, 3, 16 if model_name == "wan" else 8, False, seed=0)
        out.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


@contextlib.contextmanager
def told_of_a_late_install(model):
    """The processor's warning about a cache_context opened before it was installed, where the
    release caches a transformer's hook list (0.38.0); where it does not (each cache_context walks
    the module tree), the processor's hook is reached at once and nothing must be said."""
    message = "opened a cache_context before TesseraProcessor was installed"
    if cached_child_registries(hook_registry_of(model)) is not None:
        with pytest.warns(UserWarning, match=message):
            yield
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=f".*{message}")
            yield


def test_installed_after_a_cache_context_the_processor_says_so_and_then_sees_the_steps():
    model = tiny_wan_transformer(num_layers=1)
    with torch.no_grad(), cache_context(model, "cond", 0):
        wan_forward(model, 3, 16, False, seed=0)  # a dense run first: diffusers caches its hook list
    log = MaskLog(sparse_sparsifier())
    model.set_attn_processor(TesseraProcessor(log))
    with told_of_a_late_install(model):
        loop(model, wan_forward, False, [(3, 16)], with_step_index=True)
    # the first forward counted without context (step 0); from the next one on, the pipeline's steps
    assert [step for _, step, *_ in log.seen] == [0, 0, 1, 1]


def test_installed_after_a_pipeline_run_the_steps_of_both_branches_stay_right():
    # HunyuanVideo-1.5's pipeline names its branches but gives no step index: counted per branch.
    steps = 3
    pipe = tiny_hunyuan_video15_pipeline()
    call = {"height": 64, "width": 64, "num_frames": 5, "num_inference_steps": steps, "output_type": "latent"}
    pipe(**hunyuan_video15_prompt_inputs(), **call, generator=torch.Generator().manual_seed(0))  # stock first
    log = MaskLog(sparse_sparsifier())
    pipe.transformer.set_attn_processor(TesseraProcessor(log))
    with told_of_a_late_install(pipe.transformer):
        pipe(**hunyuan_video15_prompt_inputs(), **call, generator=torch.Generator().manual_seed(0))
    layers = pipe.transformer.config.num_layers
    assert [step for _, step, *_ in log.seen] == [step for step in range(steps) for _ in range(2 * layers)]


def test_the_warm_up_length_is_one_keyword():
    processor = TesseraProcessor(warmup_steps=3)
    assert processor.sparsifier_for(Route.WAN_SELF).steps == 3
    assert TesseraProcessor(warmup_steps=0).sparsifier_for(Route.HV15_JOINT) == SSTASparsifier()
    mine = SSTASparsifier(tile=(1, 4, 4))
    assert TesseraProcessor(mine, warmup_steps=2).sparsifier_for(Route.WAN_SELF) == DenseWarmup(mine, steps=2)
    assert TesseraProcessor(mine).sparsifier_for(Route.WAN_SELF) is mine
    with pytest.raises(InvalidArgumentError, match="warmup_steps"):
        TesseraProcessor(warmup_steps=-1)


def test_the_processor_signature_names_both_rotary_arguments():
    # The legacy Attention drops keyword arguments its processor's __call__ does not name.
    import inspect

    names = set(inspect.signature(TesseraProcessor().__call__).parameters)
    assert {"rotary_emb", "image_rotary_emb", "attention_mask", "encoder_hidden_states"} <= names


def test_the_8bit_one_liner_is_one_keyword_and_says_where_it_cannot_run():
    # On the CPU the 8-bit kernels cannot run: the processor warns once and gives the 16-bit result.
    models = [tiny_wan_transformer(num_layers=2) for _ in range(2)]
    processors = [TesseraProcessor(sparse_sparsifier()), TesseraProcessor(sparse_sparsifier(), precision="int8")]
    outs = []
    for model, processor in zip(models, processors):
        model.set_attn_processor(processor)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            for step in range(3):
                with cache_context(model, "cond", step):
                    outs.append(wan_forward(model, 3, 16, False, seed=step))
        unavailable = [w for w in caught if "int8" in str(w.message) and "unavailable" in str(w.message)]
        assert len(unavailable) == (1 if processor.backend.precision == "int8" else 0)
    for a, b in zip(outs[:3], outs[3:]):
        torch.testing.assert_close(a, b, **TOL)
    assert processors[1].stats()["precision"] == "int8" and processors[0].stats()["precision"] == "input"


def test_an_unknown_precision_or_one_beside_a_backend_is_refused():
    from tessera_diffusers.processors.backends import TesseraBackend

    with pytest.raises(InvalidArgumentError, match="precision.*one of"):
        TesseraProcessor(precision="fp8")
    with pytest.raises(InvalidArgumentError, match="precision.*one of"):
        TesseraBackend(precision="int4")
    with pytest.raises(InvalidArgumentError, match="precision.*backend is given"):
        TesseraProcessor(backend=TesseraBackend(), precision="int8")
    assert TesseraProcessor(backend=TesseraBackend(precision="int8")).backend.precision == "int8"
