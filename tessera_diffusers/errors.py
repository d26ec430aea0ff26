"""One exception family for everything a user can get wrong.

Every message names the argument, what was expected and what came, so that a user reading a
traceback from deep inside a diffusers pipeline knows which call to fix.
"""

from __future__ import annotations

import reprlib
import sys
from typing import Any


class TesseraError(Exception):
    """Base class of every error Tessera raises on purpose."""


class InvalidArgumentError(TesseraError, ValueError):
    """An argument has the wrong type, shape, dtype, device or value."""

    def __init__(self, argument: str, expected: str, received: Any, hint: str | None = None):
        self.argument = argument
        self.expected = expected
        self.received = received
        message = f"{argument}: expected {expected}, got {received}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


class MaskError(InvalidArgumentError):
    """A logical mask is malformed or does not match the tensors it is used with."""


class CatalogError(TesseraError):
    """The native kernel library is missing, stale, or does not match its manifest."""


class PlanTableError(TesseraError):
    """A plan-table artifact is corrupt or does not match the catalog / feature schema."""


class NativeKernelError(TesseraError):
    """A native kernel launch reported a CUDA error."""


def describe_tensor(t: Any) -> str:
    """Short description of a would-be tensor for error messages, never the values of a large one:
    ``tensor(shape=..., dtype=..., device=...)``, ``numpy.ndarray(shape=..., dtype=...)``, another
    array type by its module and name, anything else by its type and a repr cut to ~80 characters."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"
    kind = type(t)
    shape, dtype = getattr(t, "shape", None), getattr(t, "dtype", None)
    if shape is not None and dtype is not None:  # numpy, cupy, jax, ... (no import needed)
        package = kind.__module__.split(".")[0]
        try:
            shape = tuple(shape)
        except TypeError:
            pass
        device = None if package == "numpy" else getattr(t, "device", None)  # numpy: always host
        where = "" if device is None or callable(device) else f", device={device}"
        name = f"{package}.{kind.__name__}"
        return f"{name}(shape={shape}, dtype={dtype}{where})"
    # reprlib abbreviates containers before printing them and survives a broken __repr__.
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = 80
    text = short.repr(t)
    return f"{kind.__name__} {text if len(text) <= 80 else text[:77] + '...'}"
