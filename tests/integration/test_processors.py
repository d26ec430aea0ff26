"""TesseraProcessor on tiny random-weight Wan2.1 and HunyuanVideo-1.5 transformers (CPU, fp32).

- all-active masks: the whole transformer equals the stock processors;
- sparse masks: every attention call equals masked attention computed from the *stock* processor
  (its projections, norms and RoPE) with the token mask applied inside its attention call;
- cross-attention and the text refiner stay on their stock processors;
- layer / step / branch / grid reach the sparsifier; masks and plans are reused per cadence; the
  cache stays within its byte bound.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from diffusers.models.transformers import transformer_hunyuan_video15, transformer_wan

from tessera_diffusers import InvalidArgumentError, LogicalMask, MaskError
from tessera_diffusers.processors import ForwardContext, TesseraProcessor
from tessera_diffusers.processors.compat import cache_context
from tessera_diffusers.processors.tiny import hunyuan_video15_transformer_inputs as hv15_inputs
from tessera_diffusers.processors.tiny import tiny_hunyuan_video15_transformer, tiny_wan_transformer
from tessera_diffusers.processors.tiny import wan_transformer_inputs as wan_inputs
from tessera_diffusers.sparsifiers import (
    AdaptiveSparsifier,
    DenseWarmup,
    LatentGrid,
    SSTASparsifier,
    StaticSparsifier,
    all_active,
    tile_layout,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


# --------------------------------------------------------------------------- all-active == stock
@pytest.mark.parametrize("tile", [None, (1, 4, 4), (2, 8, 8), (1, 3, 5)], ids=str)
def test_wan_all_active_equals_stock(tile):
    model = tiny_wan_transformer()
    inputs = wan_inputs(frames=3, size=16)  # grid 3 x 8 x 8: partial tiles for (2, 8, 8) and (1, 3, 5)
    stock = run(model, inputs)
    processor = TesseraProcessor(all_active(tile)).attach(model)
    torch.testing.assert_close(run(model, inputs), stock, **TOL)
    assert processor.sparse_calls == 2 and processor.calls[processor.routes[model.blocks[0].attn1].route] == 2


def test_wan_i2v_all_active_equals_stock():
    model = tiny_wan_transformer(image=True)
    inputs = wan_inputs(text=512)  # the stock processor assumes 512 text tokens after the image ones
    inputs["encoder_hidden_states_image"] = torch.randn(1, 5, 12)
    stock = run(model, inputs)
    TesseraProcessor(all_active((1, 4, 4))).attach(model)
    torch.testing.assert_close(run(model, inputs), stock, **TOL)


@pytest.mark.parametrize(
    "case",
    [
        {"batch": 1, "valid": (3,), "valid_2": (2,)},
        {"batch": 2, "valid": (3, 5), "valid_2": (2, 0)},  # different valid text per sample
        {"batch": 2, "valid": (6,), "valid_2": (4,), "image": True},  # no padding at all, I2V image tokens
        {"batch": 1, "valid": (0,), "valid_2": (0,)},  # no valid text
    ],
    ids=["padded", "per-sample", "i2v-full", "no-text"],
)
@pytest.mark.parametrize("tile", [(1, 4, 4), (2, 4, 8)], ids=str)
def test_hunyuan_video15_all_active_equals_stock(case, tile):
    model = tiny_hunyuan_video15_transformer()
    inputs = hv15_inputs(**case)
    stock = run(model, inputs)
    TesseraProcessor(all_active(tile)).attach(model)
    torch.testing.assert_close(run(model, inputs), stock, **TOL)


@pytest.mark.parametrize("model_name", ["wan", "hv15"])
def test_dense_decision_equals_stock(model_name):
    """A sparsifier that answers None (dense warm-up) runs full attention without any mask tensor."""
    model = tiny_wan_transformer() if model_name == "wan" else tiny_hunyuan_video15_transformer()
    inputs = wan_inputs() if model_name == "wan" else hv15_inputs(batch=2, valid=(2, 4), valid_2=(1, 3))
    stock = run(model, inputs)
    processor = TesseraProcessor(DenseWarmup(all_active((1, 4, 4)), steps=10)).attach(model)
    torch.testing.assert_close(run(model, inputs), stock, **TOL)
    assert processor.dense_calls == 2 and processor.sparse_calls == 0


# --------------------------------------------------------------------------- sparse == masked stock
def random_tile_order_mask(grid: LatentGrid, tile, heads: int, seed: int) -> LogicalMask:
    layout = tile_layout(grid, tile)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.rand(1, heads, layout.num_blocks, layout.num_blocks, generator=gen) < 0.4
    blocks |= torch.eye(layout.num_blocks, dtype=torch.bool)
    blocks[0, 0, 1] = False  # one query-block row with no key at all (output 0, as the reference)
    return LogicalMask(blocks, layout.block, layout.block, grid.num_tokens, grid.num_tokens)


def raster_token_mask(mask: LogicalMask, grid: LatentGrid, tile, head: int) -> torch.Tensor:
    """The token-level mask ``[S, S]`` of one head in raster order."""
    inverse = tile_layout(grid, tile).tensors("cpu").inverse
    dense = mask.to_dense(0, head)
    return dense[inverse][:, inverse]


def masked_sdpa(query, key, value, token_mask):
    """``(B, S, H, D)`` attention under a bool ``[B|1, H|1, Sq, Skv]`` mask; rows without keys -> 0."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", query.double(), key.double()) * scale
    scores = scores.masked_fill(~token_mask, -math.inf)
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, value.double()).to(query.dtype)


@pytest.mark.parametrize("tile", [(1, 4, 4), (2, 4, 8), (1, 3, 5)], ids=str)
def test_wan_sparse_call_equals_masked_stock(tile, monkeypatch):
    model = tiny_wan_transformer()
    attn = model.blocks[1].attn1
    grid = LatentGrid(3, 8, 8)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, grid.num_tokens, 24, generator=gen)
    rotary = model.rope(torch.zeros(1, 4, 3, 16, 16))
    mask = random_tile_order_mask(grid, tile, heads=2, seed=5)
    token_mask = torch.stack([raster_token_mask(mask, grid, tile, h) for h in range(2)])[None]

    def dispatch(query, key, value, attn_mask=None, **kwargs):
        return masked_sdpa(query, key, value, token_mask)

    with torch.no_grad():
        monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", dispatch)
        want = transformer_wan.WanAttnProcessor()(attn, x, None, None, rotary)
        monkeypatch.undo()
        processor = TesseraProcessor(StaticSparsifier(mask, tile=tile))
        processor.routes.clear()
        processor.begin_forward(ForwardContext(0, grid, 0, "cond"))
        got = processor(attn, x, None, None, rotary)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("batch,valid", [(1, (3,)), (2, (2, 6))], ids=["prefix", "per-sample"])
def test_hunyuan_video15_sparse_call_equals_masked_stock(batch, valid, monkeypatch):
    """Video queries: the sparse video mask plus every valid text key; text queries: every valid
    key; padded text rows 0 — exactly the stock processor with the video mask added to its own."""
    model = tiny_hunyuan_video15_transformer()
    attn = model.transformer_blocks[0].attn
    grid, tile = LatentGrid(2, 8, 8), (1, 4, 4)
    seq_v, seq_t = grid.num_tokens, 7
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq_v, 16, generator=gen)
    text = torch.randn(batch, seq_t, 16, generator=gen)
    text_mask = torch.stack([(torch.arange(seq_t) < n) for n in valid])
    if batch == 2:
        text_mask[1] = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)  # not a prefix: gathered
    rotary = model.rope(torch.zeros(1, 4, 2, 8, 8))
    mask = random_tile_order_mask(grid, tile, heads=2, seed=2)
    video_mask = torch.stack([raster_token_mask(mask, grid, tile, h) for h in range(2)])  # [H, Sv, Sv]

    def dispatch(query, key, value, attn_mask=None, **kwargs):
        combined = attn_mask.expand(batch, 2, seq_v + seq_t, seq_v + seq_t).clone()
        combined[:, :, :seq_v, :seq_v] &= video_mask
        return masked_sdpa(query, key, value, combined)

    with torch.no_grad():
        monkeypatch.setattr(transformer_hunyuan_video15, "dispatch_attention_fn", dispatch)
        want_v, want_t = transformer_hunyuan_video15.HunyuanVideo15AttnProcessor2_0()(
            attn, x, encoder_hidden_states=text, attention_mask=text_mask, image_rotary_emb=rotary
        )
        monkeypatch.undo()
        processor = TesseraProcessor(StaticSparsifier(mask, tile=tile))
        processor.begin_forward(ForwardContext(0, grid, 0, "cond"))
        got_v, got_t = processor(attn, x, encoder_hidden_states=text, attention_mask=text_mask, image_rotary_emb=rotary)
    torch.testing.assert_close(got_v, want_v, **TOL)
    torch.testing.assert_close(got_t, want_t, **TOL)


def test_sparse_masks_change_the_output():
    """The sparse path is not silently dense: a sparse mask gives a different result."""
    model = tiny_wan_transformer()
    inputs = wan_inputs()
    stock = run(model, inputs)
    TesseraProcessor(SSTASparsifier(tile=(1, 4, 4), window=(1, 1, 1), top_k=2)).attach(model)
    assert (run(model, inputs) - stock).abs().max() > 1e-3


# --------------------------------------------------------------------------- stock calls untouched
class Counting:
    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_cross_attention_and_refiner_keep_their_stock_processors():
    wan = tiny_wan_transformer(num_layers=3)
    wan.set_attn_processor({name: Counting(proc) for name, proc in wan.attn_processors.items()})
    counters = dict(wan.attn_processors)
    TesseraProcessor(all_active((1, 4, 4))).attach(wan)
    run(wan, wan_inputs())
    for name, counter in counters.items():
        assert counter.calls == (1 if "attn2" in name else 0), name

    hv = tiny_hunyuan_video15_transformer()
    hv.set_attn_processor({name: Counting(proc) for name, proc in hv.attn_processors.items()})
    counters = dict(hv.attn_processors)
    TesseraProcessor(all_active((1, 4, 4))).attach(hv)
    run(hv, hv15_inputs())
    for name, counter in counters.items():
        assert counter.calls == (1 if "token_refiner" in name else 0), name


def test_a_second_processor_cannot_attach_to_the_same_transformer():
    model = tiny_wan_transformer(num_layers=1)
    TesseraProcessor(all_active()).attach(model)
    with pytest.raises(InvalidArgumentError, match="detach that one first"):
        TesseraProcessor(all_active()).attach(model)


def test_detach_restores_the_original_processors():
    model = tiny_hunyuan_video15_transformer()
    before = dict(model.attn_processors)
    processor = TesseraProcessor(all_active((1, 4, 4))).attach(model)
    assert all(p is processor for p in model.attn_processors.values())
    processor.detach(model)
    assert model.attn_processors == before
    assert "tessera_context" not in model._diffusers_hook.hooks


# --------------------------------------------------------------------------- layer / step / branch / grid
class Recording:
    """Sparsifier that records what it is asked and answers with a fixed-pattern new mask."""

    def __init__(self, tile=(1, 4, 4)):
        self.tile = tile
        self.seen = []

    def layout(self, grid):
        return tile_layout(grid, self.tile)

    def __call__(self, q, k, *, layer, step, grid):
        self.seen.append((layer, step, grid))
        layout = self.layout(grid)
        return LogicalMask.dense(grid.num_tokens, grid.num_tokens, layout.block, layout.block)


def denoise(model, inputs, steps: int, branches=("cond", "uncond"), step_index: bool = True):
    for step in range(steps):
        for branch in branches:
            with cache_context(model, branch, step if step_index else None):
                run(model, inputs)


@pytest.mark.parametrize("step_index", [True, False], ids=["step_index", "counted"])
def test_layer_step_branch_and_grid_reach_the_sparsifier(step_index):
    model = tiny_wan_transformer(num_layers=3)
    recorder = Recording()
    processor = TesseraProcessor(recorder).attach(model)
    denoise(model, wan_inputs(frames=3, size=16), steps=2, step_index=step_index)
    grid = LatentGrid(3, 8, 8)
    want = [(layer, step, grid) for step in range(2) for _ in ("cond", "uncond") for layer in range(3)]
    assert recorder.seen == want
    assert processor.cache.report()["slots"] == 0  # recomputed every step: no mask outlives its call


def test_masks_kept_for_later_steps_have_one_slot_per_layer_and_branch():
    model = tiny_wan_transformer(num_layers=3)
    processor = TesseraProcessor(Recording(), recompute_every=2).attach(model)
    denoise(model, wan_inputs(frames=3, size=16), steps=2)
    assert processor.cache.report()["slots"] == 3 * 2


def test_hunyuan_video15_grid_uses_its_patch_size():
    model = tiny_hunyuan_video15_transformer(num_layers=1)
    recorder = Recording(tile=(1, 2, 4))
    TesseraProcessor(recorder).attach(model)
    run(model, hv15_inputs(frames=3, size=6))
    assert recorder.seen == [(0, 0, LatentGrid(3, 6, 6))]


def test_recompute_cadence_reuses_masks_and_plans():
    model = tiny_wan_transformer(num_layers=2)
    recorder = Recording()
    processor = TesseraProcessor(recorder, recompute_every=3).attach(model)
    denoise(model, wan_inputs(), steps=7)
    steps_computed = sorted({step for _, step, _ in recorder.seen})
    assert steps_computed == [0, 3, 6]
    report = processor.cache.report()
    assert report["mask_computes"] == 3 * 2 * 2 and report["mask_reuses"] == 4 * 2 * 2
    assert report["plan_builds"] == report["mask_computes"]  # a new mask object needs a new plan
    assert report["plan_reuses"] == report["mask_reuses"]


def test_shared_branch_masks_are_computed_once_per_step():
    model = tiny_wan_transformer(num_layers=2)
    recorder = Recording()
    TesseraProcessor(recorder, share_branch_masks=True).attach(model)
    denoise(model, wan_inputs(), steps=2)
    assert len(recorder.seen) == 2 * 2  # layers x steps, not x branches


def test_static_mask_plans_survive_recomputation():
    # A mask object the sparsifier hands back again is kept from that repeat on; its plan lives in
    # the layer's Runtime as long as the mask does, so it is prepared once per layer and branch.
    model = tiny_wan_transformer(num_layers=2)
    processor = TesseraProcessor(all_active((1, 4, 4))).attach(model)
    denoise(model, wan_inputs(), steps=4)
    report = processor.cache.report()
    assert report["mask_computes"] == 4 * 2 * 2
    assert report["plan_builds"] == 2 * 2 and report["plan_reuses"] == 3 * 2 * 2


def test_pipeline_reset_restarts_the_step_count():
    model = tiny_wan_transformer(num_layers=1)
    recorder = Recording()
    TesseraProcessor(recorder).attach(model)
    denoise(model, wan_inputs(), steps=2, step_index=False)
    model._reset_stateful_cache()  # what pipelines do at the end of a run
    denoise(model, wan_inputs(), steps=1, step_index=False)
    assert [step for _, step, _ in recorder.seen] == [0, 0, 1, 1, 0, 0]


def test_call_parity_without_cache_context():
    model = tiny_wan_transformer(num_layers=1)
    recorder = Recording()
    processor = TesseraProcessor(recorder, branches=2, recompute_every=2).attach(model)
    for _ in range(4):
        run(model, wan_inputs())
    assert [step for _, step, _ in recorder.seen] == [0, 0]  # step 1 of each branch reuses its mask
    assert {key[2] for key in processor.cache.slots} == {"branch0", "branch1"}


def test_cache_memory_is_bounded_and_reported():
    model = tiny_wan_transformer(num_layers=4)
    sparsifier = SSTASparsifier(tile=(1, 4, 4), window=(1, 3, 3), top_k=2)
    unbounded = TesseraProcessor(sparsifier, recompute_every=2).attach(model)
    run(model, wan_inputs())
    per_layer = unbounded.cache.nbytes / 4
    assert per_layer > 0
    unbounded.detach(model)

    bound = int(per_layer * 2.5)
    processor = TesseraProcessor(sparsifier, cache_bytes=bound, recompute_every=2).attach(model)
    denoise(model, wan_inputs(), steps=2)
    report = processor.cache.report()
    assert report["bytes"] <= bound and report["peak_bytes"] <= bound
    assert report["evictions"] > 0 and report["slots"] == 2
    assert processor.stats()["cache"]["bytes"] == report["bytes"]


# --------------------------------------------------------------------------- without attach
def test_set_attn_processor_alone_with_a_latent_grid_matches_attach():
    inputs = wan_inputs(frames=3, size=16)
    sparsifier = SSTASparsifier(tile=(1, 4, 4), window=(1, 3, 3), top_k=2)
    attached = tiny_wan_transformer(num_layers=2)
    TesseraProcessor(sparsifier).attach(attached)
    plain = tiny_wan_transformer(num_layers=2)
    processor = TesseraProcessor(sparsifier, latent_grid=(3, 8, 8))
    plain.set_attn_processor(processor)
    torch.testing.assert_close(run(plain, inputs), run(attached, inputs), **TOL)
    layers = sorted(r.layer for r in processor.routes.values() if r.layer >= 0)
    assert layers == [0, 1]


def test_set_attn_processor_alone_reads_the_grid_from_the_rotary_table():
    model = tiny_hunyuan_video15_transformer()
    inputs = hv15_inputs(frames=3, size=6)
    stock = run(model, inputs)
    recorder = Recording(tile=(1, 2, 4))
    model.set_attn_processor(TesseraProcessor(recorder))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run(model, inputs)
    assert {grid for _, _, grid in recorder.seen} == {LatentGrid(3, 6, 6)}
    torch.testing.assert_close(out, stock, **TOL)


def test_a_processor_that_cannot_learn_the_grid_raises():
    model = tiny_wan_transformer(num_layers=1)
    processor = TesseraProcessor(all_active())
    model.set_attn_processor(processor)
    attn = model.blocks[0].attn1
    hidden = torch.randn(1, 128, model.config.num_attention_heads * 12)
    with pytest.raises(InvalidArgumentError, match="latent grid") as info:
        processor(attn, hidden)  # no rotary table, no attach, no latent_grid
    assert "latent_grid=" in str(info.value)


# --------------------------------------------------------------------------- errors
def test_errors_name_argument_expected_and_received():
    with pytest.raises(InvalidArgumentError) as info:
        TesseraProcessor(sparsifier=object())
    assert info.value.argument == "sparsifier"
    with pytest.raises(InvalidArgumentError) as info:
        TesseraProcessor(recompute_every=0)
    assert info.value.argument == "recompute_every"
    with pytest.raises(InvalidArgumentError) as info:
        TesseraProcessor().attach(torch.nn.Linear(2, 2))
    assert info.value.argument == "transformer"

    model = tiny_wan_transformer(num_layers=1)
    wrong = StaticSparsifier(lambda g: LogicalMask.dense(16, 16, 16, 16), tile=(1, 4, 4))
    TesseraProcessor(wrong).attach(model)
    with pytest.raises(MaskError, match="sequence lengths"):
        run(model, wan_inputs())

    model = tiny_wan_transformer(num_layers=1)
    model.set_attn_processor(TesseraProcessor(all_active(), latent_grid=(2, 4, 4)))
    with pytest.raises(InvalidArgumentError, match="hidden_states"):
        run(model, wan_inputs())  # 128 tokens, not 2 x 4 x 4


def test_adaptive_sparsifier_runs_in_the_transformer():
    model = tiny_hunyuan_video15_transformer()
    sparsifier = AdaptiveSparsifier(tile=(2, 4, 4), block_sizes=(16, 32), block_costs=(1.0, 1.0), max_density=0.6)
    processor = TesseraProcessor(sparsifier).attach(model)
    out = run(model, hv15_inputs(frames=4, size=8))
    assert torch.isfinite(out).all()
    assert 0.0 < processor.stats()["mean_mask_density"] < 1.0
