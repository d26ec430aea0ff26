"""The sparsifier protocol: ``(q, k, layer, step, latent grid) -> LogicalMask``.

A sparsifier decides *which* video-token blocks attend to which. It works on the video tokens of
one self-attention call in the token order of its ``layout(grid)`` (a ``TileLayout``: 3-D tiles,
or plain raster order), and returns a ``LogicalMask`` over ``(S, S)`` in that order — or ``None``
for full attention (dense warm-up, or an adaptive choice). The processor permutes the tokens into
the layout's order before it calls the sparsifier and permutes the attention output back.

Text tokens (HunyuanVideo-1.5 joint attention) are never part of a sparsifier's mask: the processor
keeps them dense (video queries see every valid text key, text queries see every valid key).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..errors import InvalidArgumentError
from ..mask import LogicalMask
from .grid import LatentGrid
from .layout import TileLayout


@runtime_checkable
class Sparsifier(Protocol):
    """What the processor asks of a sparsifier.

    ``layout(grid)`` is the token order the mask refers to (pure function of the grid).
    ``__call__`` gets ``q, k: [B, S, H, D]`` already in that order (S = grid.num_tokens) and returns
    a ``LogicalMask`` over ``(S, S)`` broadcastable to ``(B, H)``, or ``None`` for full attention.
    Returning the *same* mask object for an unchanged pattern lets prepared plans be reused.

    Optional ``head_separable`` (default False): True when the mask of any subset of heads is the
    one computed on those heads alone, over exactly q's heads (or 1). Context parallelism then
    runs the sparsifier per head chunk as the chunks arrive (``parallel.layout_attention``).
    """

    def layout(self, grid: LatentGrid) -> TileLayout: ...

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, *, layer: int, step: int, grid: LatentGrid
    ) -> LogicalMask | None: ...


def check_qk(q: torch.Tensor, k: torch.Tensor, grid: LatentGrid) -> None:
    """Raise unless ``q, k`` are ``[B, S, H, D]`` with ``S = grid.num_tokens``."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InvalidArgumentError(name, "a [B, S, H, D] tensor", getattr(t, "shape", type(t).__name__))
        if t.shape[1] != grid.num_tokens:
            raise InvalidArgumentError(
                name, f"S = {grid.num_tokens} tokens (latent grid {grid})", f"shape {tuple(t.shape)}"
            )
    if q.shape != k.shape:
        raise InvalidArgumentError("k", f"the shape of q {tuple(q.shape)}", tuple(k.shape))
