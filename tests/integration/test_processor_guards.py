"""Hostile-input guards of TesseraProcessor (CPU, tiny random-weight transformers).

- one processor shared by two transformers keeps each transformer's run apart: the end-of-run
  reset of one never drops the masks, step count or reuse of the other, and the outputs equal those
  of one processor per transformer; ``processor.reset()`` still clears everything;
- the sparse self-attention routes refuse arguments they cannot honour (an ``attention_mask``, an
  ``encoder_hidden_states`` given to Wan self-attention, ...) instead of ignoring them, while the
  transformers' own forwards and the stock routes (Wan cross-attention) work as before.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from tessera_diffusers import InvalidArgumentError, LogicalMask
from tessera_diffusers.processors import ForwardContext, TesseraProcessor
from tessera_diffusers.processors.compat import cache_context
from tessera_diffusers.processors.tiny import tiny_hunyuan_video15_transformer, tiny_wan_transformer
from tessera_diffusers.sparsifiers import LatentGrid, all_active, tile_layout

TOL = {"rtol": 1e-5, "atol": 1e-5}
TILE = (1, 4, 4)


# --------------------------------------------------------------------------- helpers
class StepSeeded:
    """Sparsifier whose mask is a random tile mask seeded by (layer, step): a recomputed mask differs
    from a reused one, so a dropped mask shows in the output. Logs (layer, step) of every call."""

    def __init__(self, tile=TILE):
        self.tile = tile
        self.seen: list[tuple[int, int]] = []

    def layout(self, grid):
        return tile_layout(grid, self.tile)

    def __call__(self, q, k, *, layer, step, grid):
        self.seen.append((layer, step))
        layout = self.layout(grid)
        n = layout.num_blocks
        gen = torch.Generator().manual_seed(1000 * layer + step)
        blocks = torch.rand(1, q.shape[2], n, n, generator=gen) < 0.4
        blocks |= torch.eye(n, dtype=torch.bool)
        return LogicalMask(blocks, layout.block, layout.block, grid.num_tokens, grid.num_tokens)


def wan_forward(model, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return model(
        hidden_states=torch.randn(1, 4, 2, 16, 16, generator=gen),  # grid 2 x 8 x 8
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 12, 16, generator=gen),
    ).sample


def hv15_forward(model, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return model(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=gen),  # grid 2 x 8 x 8
        timestep=torch.tensor([500.0]),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=gen),
        encoder_attention_mask=(torch.arange(6) < 4).long()[None],
        encoder_hidden_states_2=torch.randn(1, 4, 8, generator=gen),
        encoder_attention_mask_2=torch.ones(1, 4, dtype=torch.long),
        image_embeds=torch.zeros(1, 3, 12),
    ).sample


MODELS = {
    # Wan: the pipeline's step index in the cache_context; HunyuanVideo-1.5: named branches, steps counted
    "wan": (tiny_wan_transformer, wan_forward, True),
    "hv15": (tiny_hunyuan_video15_transformer, hv15_forward, False),
}

# A's run of two steps ends (its pipeline's reset) between B's step 0 and step 1, where B reuses
# its step-0 masks; A then runs again while B goes on, and ends once more after B's last reuse.
SCHEDULE = [
    ("A", 0),
    ("B", 0),
    ("A", 1),
    ("A", "reset"),
    ("B", 1),
    ("A", 0),
    ("B", 2),
    ("A", 1),
    ("B", 3),
    ("A", "reset"),
]


def install(processor: TesseraProcessor, model: torch.nn.Module, how: str) -> None:
    if how == "attach":
        processor.attach(model)
    else:
        model.set_attn_processor(processor)


def play(models: dict, forward, with_step_index: bool, after=None) -> list[torch.Tensor]:
    """Run SCHEDULE (cond and uncond per step); ``after(event)`` is called after each event."""
    outs = []
    with torch.no_grad():
        for name, step in SCHEDULE:
            model = models[name]
            if step == "reset":
                model._reset_stateful_cache()  # what a pipeline does at the end of its run
            else:
                for branch in ("cond", "uncond"):
                    with cache_context(model, branch, step if with_step_index else None):
                        outs.append(forward(model, seed=10 * step + (name == "B")))
            if after is not None:
                after((name, step))
    return outs


def model_of(processor: TesseraProcessor, model: torch.nn.Module) -> int | None:
    """The index under which ``processor`` keeps ``model``'s masks (the model of its first sparse
    layer); None before the processor has seen a call of it."""
    first = model.blocks[0].attn1 if hasattr(model, "blocks") else model.transformer_blocks[0].attn
    route = processor.routes.get(first)
    return None if route is None else route.model


def kept_masks(processor: TesseraProcessor, model: int | None) -> dict:
    """(layer, branch) -> (step computed, mask blocks) of the masks kept for one model."""
    if model is None:
        return {}
    return {
        key[1:]: (slot.step, slot.mask.blocks.clone())
        for key, slot in processor.cache.slots.items()
        if isinstance(key, tuple) and key[0] == model and slot.mask is not None
    }


def same_masks(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][0] == b[k][0] and torch.equal(a[k][1], b[k][1]) for k in a)


# --------------------------------------------------------------------------- finding 1: shared processor
@pytest.mark.parametrize("how", ["attach", "set_attn_processor"])
@pytest.mark.parametrize("model_name", ["wan", "hv15"])
def test_a_reset_of_one_transformer_keeps_the_run_of_another_sharing_the_processor(model_name, how):
    make, forward, with_step_index = MODELS[model_name]

    # Reference: one processor per transformer, the same schedule.
    ref_log = StepSeeded()
    ref_models = {"A": make(num_layers=2, seed=0), "B": make(num_layers=2, seed=1)}
    ref_processors = {name: TesseraProcessor(ref_log, recompute_every=2) for name in ref_models}
    for name, model in ref_models.items():
        install(ref_processors[name], model, how)
    ref_b_masks = []
    ref_b = ref_processors["B"]
    want = play(
        ref_models,
        forward,
        with_step_index,
        after=lambda event: ref_b_masks.append(kept_masks(ref_b, model_of(ref_b, ref_models["B"]))),
    )

    # One processor shared by both transformers.
    log = StepSeeded()
    models = {"A": make(num_layers=2, seed=0), "B": make(num_layers=2, seed=1)}
    processor = TesseraProcessor(log, recompute_every=2)
    for model in models.values():
        install(processor, model, how)
    b_masks, a_masks = [], []

    def snapshot(event):
        b_masks.append(kept_masks(processor, model_of(processor, models["B"])))
        a_masks.append(kept_masks(processor, model_of(processor, models["A"])))

    got = play(models, forward, with_step_index, after=snapshot)

    # B's kept masks after every event (A's resets included) are those of B's own processor ...
    assert all(same_masks(g, w) for g, w in zip(b_masks, ref_b_masks)) and len(b_masks) == len(ref_b_masks)
    assert b_masks[SCHEDULE.index(("A", "reset"))]  # ... and A's reset left them in place
    assert not a_masks[SCHEDULE.index(("A", "reset"))]  # while A's own masks went
    # ... so the sparsifier was asked exactly what two processors ask it (B reused its masks) ...
    assert log.seen == ref_log.seen
    # ... and every output is the one of its own processor.
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert model_of(processor, models["A"]) != model_of(processor, models["B"])

    # stats() reports the totals of both transformers.
    stats, ref_stats = processor.stats(), [p.stats() for p in ref_processors.values()]
    for name in ("sparse_calls", "dense_calls", "masks_computed"):
        assert stats[name] == sum(s[name] for s in ref_stats), name
    for name in ("mask_computes", "mask_reuses"):
        assert stats["cache"][name] == sum(s["cache"][name] for s in ref_stats), name
    assert stats["cache"]["mask_reuses"] > 0

    # The user's reset still forgets everything.
    processor.reset()
    assert not processor.cache.slots
    assert processor.stats()["sparse_calls"] == 0 and processor.stats()["cache"]["mask_reuses"] == 0


def test_a_reset_of_one_transformer_restarts_only_its_own_step_count():
    # Counted steps (no step index in the cache_context), the one-liner on two transformers.
    log = StepSeeded()
    a, b = tiny_wan_transformer(num_layers=1, seed=0), tiny_wan_transformer(num_layers=1, seed=1)
    processor = TesseraProcessor(log)
    a.set_attn_processor(processor)
    b.set_attn_processor(processor)
    with torch.no_grad():
        for model in (a, b, a, b):
            with model.cache_context("cond"):
                wan_forward(model, seed=0)
        a._reset_stateful_cache()
        for model in (a, b):
            with model.cache_context("cond"):
                wan_forward(model, seed=0)
    # (layer, step): A 0, B 0, A 1, B 1, then A's new run at step 0 and B's step 2; layers per transformer
    assert log.seen == [(0, 0), (0, 0), (0, 1), (0, 1), (0, 0), (0, 2)]


# --------------------------------------------------------------------------- finding 2: refused arguments
def wan_attn1_call():
    model = tiny_wan_transformer(num_layers=1)
    processor = TesseraProcessor(all_active(TILE)).attach(model)
    grid = LatentGrid(2, 8, 8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, grid.num_tokens, 24, generator=gen)
    rotary = model.rope(torch.zeros(1, 4, 2, 16, 16))
    processor.begin_forward(ForwardContext(model_of(processor, model), grid, 0, "cond"))
    return model, processor, x, rotary


@pytest.mark.parametrize("argument", ["attention_mask", "encoder_hidden_states", "image_rotary_emb"])
def test_wan_sparse_self_attention_refuses_what_it_would_ignore(argument):
    model, processor, x, rotary = wan_attn1_call()
    attn = model.blocks[0].attn1
    values = {
        "attention_mask": torch.ones(1, 1, x.shape[1], x.shape[1], dtype=torch.bool),
        "encoder_hidden_states": torch.randn(1, 12, 24),
        "image_rotary_emb": rotary,
    }
    kwargs = {"rotary_emb": rotary, argument: values[argument]}
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match=argument) as info:
        processor(attn, x, **kwargs)
    message = str(info.value)
    hint = "pass it as rotary_emb" if argument == "image_rotary_emb" else "stock processor"
    assert "expected None" in message and "got" in message and hint in message
    assert processor.sparse_calls == 0 and processor.dense_calls == 0  # refused before any work
    with torch.no_grad():  # None is what the transformer passes: accepted
        processor(attn, x, None, None, rotary)
    assert processor.sparse_calls == 1


def test_wan_cross_attention_keeps_its_mask_and_text():
    model, processor, x, _ = wan_attn1_call()
    attn = model.blocks[0].attn2
    text = torch.randn(1, 12, 24)
    mask = torch.rand(1, 1, x.shape[1], 12) < 0.5
    mask[..., 0] = True
    with torch.no_grad():
        got = processor(attn, x, text, mask, None)
        want = WanAttnProcessor()(attn, x, text, mask, None)
        unmasked = WanAttnProcessor()(attn, x, text, None, None)
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.allclose(got, unmasked)  # the mask did reach the stock processor


def test_wan_transformer_forward_still_equals_stock():
    model = tiny_wan_transformer(num_layers=2)
    with torch.no_grad():
        stock = wan_forward(model, seed=3)
        TesseraProcessor(all_active(TILE)).attach(model)
        torch.testing.assert_close(wan_forward(model, seed=3), stock, **TOL)
    plain = tiny_wan_transformer(num_layers=2)
    plain.set_attn_processor(TesseraProcessor(all_active(TILE)))
    with torch.no_grad():
        torch.testing.assert_close(wan_forward(plain, seed=3), stock, **TOL)


@pytest.mark.parametrize("argument", ["attention_mask", "rotary_emb"])
def test_hunyuan_video15_sparse_route_refuses_what_it_would_ignore(argument):
    model = tiny_hunyuan_video15_transformer(num_layers=1)
    processor = TesseraProcessor(all_active(TILE)).attach(model)
    attn = model.transformer_blocks[0].attn
    grid = LatentGrid(2, 8, 8)
    x = torch.randn(1, grid.num_tokens, 16)
    rotary = model.rope(torch.zeros(1, 4, 2, 8, 8))
    processor.begin_forward(ForwardContext(model_of(processor, model), grid, 0, "cond"))
    # video only (no text): a mask would have nothing to mask but video tokens, which the route ignores
    kwargs = {"image_rotary_emb": rotary}
    kwargs[argument] = torch.ones(1, grid.num_tokens, dtype=torch.bool) if argument == "attention_mask" else rotary
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match=argument) as info:
        processor(attn, x, **kwargs)
    hint = "pass it as image_rotary_emb" if argument == "rotary_emb" else "stock processor"
    assert "expected None" in str(info.value) and hint in str(info.value)


def test_hunyuan_video15_joint_route_keeps_its_text_mask():
    model = tiny_hunyuan_video15_transformer(num_layers=1)
    attn = model.transformer_blocks[0].attn
    assert isinstance(attn, Attention)
    grid = LatentGrid(2, 8, 8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, grid.num_tokens, 16, generator=gen)
    text = torch.randn(1, 5, 16, generator=gen)
    text_mask = (torch.arange(5) < 3)[None]
    rotary = model.rope(torch.zeros(1, 4, 2, 8, 8))
    with torch.no_grad():
        want = HunyuanVideo15AttnProcessor2_0()(
            attn, x, encoder_hidden_states=text, attention_mask=text_mask, image_rotary_emb=rotary
        )
        processor = TesseraProcessor(all_active(TILE)).attach(model)
        processor.begin_forward(ForwardContext(model_of(processor, model), grid, 0, "cond"))
        got = processor(attn, x, encoder_hidden_states=text, attention_mask=text_mask, image_rotary_emb=rotary)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    with torch.no_grad():  # and a whole forward still equals the stock one
        torch.testing.assert_close(hv15_forward(model, seed=1), stock_hv15(seed=1), **TOL)


def stock_hv15(seed: int) -> torch.Tensor:
    with torch.no_grad():
        return hv15_forward(tiny_hunyuan_video15_transformer(num_layers=1), seed=seed)


def test_one_processor_serves_eight_threads_each_running_its_own_transformer():
    """8 threads x 500 processor calls through one processor, each thread denoising its own attached
    transformer (dense warm-up, then masks kept for two steps): no exception, the step cache within its
    bound, and every thread's outputs equal to the same transformer's run alone."""
    from tessera_diffusers.sparsifiers import DenseWarmup, SSTASparsifier
    from tessera_diffusers.testing import run_in_threads

    threads, forwards = 8, 125  # 2 layers x (self + cross attention) = 4 processor calls per forward

    def sparsifier():
        return DenseWarmup(SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 1), top_k=1), steps=1)

    def inputs(index: int, step: int) -> dict:
        gen = torch.Generator().manual_seed(1000 * index + step)
        return {"hidden_states": torch.randn(1, 4, 2, 16, 16, generator=gen), "timestep": torch.tensor([500]),
                "encoder_hidden_states": torch.randn(1, 12, 16, generator=gen)}

    def run(model, index: int) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(**inputs(index, step)).sample for step in range(forwards)]

    alone = []
    for index in range(threads):
        model = tiny_wan_transformer(num_layers=2)
        TesseraProcessor(sparsifier(), recompute_every=2).attach(model)
        alone.append(run(model, index))

    shared = TesseraProcessor(sparsifier(), recompute_every=2, cache_bytes=64 * 1024)
    models = [tiny_wan_transformer(num_layers=2) for _ in range(threads)]
    for model in models:
        shared.attach(model)
    together, cache_bytes = [None] * threads, []

    def worker(index: int) -> None:
        together[index] = run(models[index], index)
        cache_bytes.append(shared.cache.report()["bytes"])

    errors = run_in_threads(worker, threads, switch_interval=1e-5)  # switch threads often
    assert not errors, errors[:3]
    for index in range(threads):
        for step, (got, want) in enumerate(zip(together[index], alone[index], strict=True)):
            assert torch.equal(got, want), f"thread {index} step {step}"
    stats = shared.stats()
    assert sum(stats["calls"].values()) == threads * forwards * 4
    assert stats["sparse_calls"] == threads * (forwards - 1) * 2
    assert max(cache_bytes) <= 64 * 1024
