"""The latent grid of a video transformer: ``frames x height x width`` tokens in raster order, what
a sparsifier and its tile layout are functions of."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..validation import check_positive_int


def check_triple(name: str, value: object) -> tuple[int, int, int]:
    """A ``(frames, height, width)`` triple of positive ints."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise InvalidArgumentError(name, "a (frames, height, width) triple of positive ints", repr(value))
    return tuple(check_positive_int(f"{name}[{i}]", v) for i, v in enumerate(value))  # type: ignore[return-value]


@dataclass(frozen=True)
class LatentGrid:
    """The video token grid after patch embedding: ``frames x height x width`` tokens in raster
    order ``(frame, height, width)``."""

    frames: int
    height: int
    width: int

    def __post_init__(self) -> None:
        check_triple("latent grid", (self.frames, self.height, self.width))

    @classmethod
    def of(cls, value: LatentGrid | tuple[int, int, int] | list[int]) -> LatentGrid:
        if isinstance(value, LatentGrid):
            return value
        frames, height, width = check_triple("latent_grid", value)
        return cls(frames, height, width)

    @property
    def num_tokens(self) -> int:
        return self.frames * self.height * self.width

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.frames, self.height, self.width)

    def __str__(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}"
