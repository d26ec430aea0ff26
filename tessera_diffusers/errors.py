"""One exception family for everything a user can get wrong.

Every message names the argument, what was expected and what came, so that a user reading a
traceback from deep inside a diffusers pipeline knows which call to fix.
"""

from __future__ import annotations

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


class NoEligiblePlanError(TesseraError):
    """No plan of the catalog can run this request; lists every rejection."""

    def __init__(self, request: str, rejections: dict[str, str]):
        self.request = request
        self.rejections = dict(rejections)
        lines = [f"no eligible plan for {request}:"]
        lines += [f"  {name}: {reason}" for name, reason in self.rejections.items()]
        super().__init__("\n".join(lines))


class CatalogError(TesseraError):
    """The native kernel library is missing, stale, or does not match its manifest."""


class PlanTableError(TesseraError):
    """A plan-table artifact is corrupt or does not match the catalog / feature schema."""


class NativeKernelError(TesseraError):
    """A native kernel launch reported a CUDA error."""


def describe_tensor(t: Any) -> str:
    """Short human description of a tensor for error messages."""
    try:
        return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"
    except AttributeError:
        return f"{type(t).__name__} {t!r}"
