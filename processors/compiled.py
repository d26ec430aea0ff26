"""The processor inside ``torch.compile``: each attention call is one opaque custom op.

What the processor decides per call (the route, the step and guidance branch, a layer's mask and
plan, whether a kept mask is reused) depends on host state and on data, so the compiled graph must
not trace it. Under compilation ``TesseraProcessor.__call__`` emits ``tessera::processor_call``
instead; at run time the op finds the attention module and runs the processor's eager call on it.
The graph around it (norms, modulation, feed-forward, the other attention modules' neighbours)
compiles and fuses as usual, with ``fullgraph=True`` too.

The op cannot take the module itself, and a module-specific constant in the graph would make every
block of ``compile_repeated_blocks`` compile again (one graph per layer). So the module travels as
one of its own parameters (``marker_of``), a graph input like the others: the op looks the module up
by that tensor's identity (``CompiledCalls``), which offloading and dtype casts keep, since they
replace a parameter's data and not the parameter.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tessera_diffusers.errors import InvalidArgumentError

from .compat import Attention

# Which processor argument carries the rotary table: Wan's ``rotary_emb`` or the legacy
# ``Attention``'s ``image_rotary_emb`` (HunyuanVideo-1.5).
NO_ROTARY, ROTARY_EMB, IMAGE_ROTARY_EMB = 0, 1, 2

_processors: dict[int, weakref.ref] = {}
_keys = itertools.count()


def register(processor: Any) -> int:
    """A key under which compiled graphs reach ``processor`` (held weakly)."""
    key = next(_keys)
    _processors[key] = weakref.ref(processor, lambda _ref, key=key: _processors.pop(key, None))
    return key


def marker_of(attn: torch.nn.Module) -> torch.Tensor:
    """The parameter that stands for ``attn`` in a compiled graph: a norm's weight where the module
    has one (never quantized), else its output projection's bias or weight, else its first parameter.
    The choice depends only on the module's structure, so every block of a model picks the same
    attribute and one graph serves them all."""
    for owner, name in (("norm_q", "weight"), ("norm_k", "weight")):
        module = getattr(attn, owner, None)
        tensor = getattr(module, name, None) if module is not None else None
        if isinstance(tensor, torch.Tensor):
            return tensor
    to_out = getattr(attn, "to_out", None)
    if isinstance(to_out, torch.nn.ModuleList) and len(to_out) > 0:
        for name in ("bias", "weight"):
            tensor = getattr(to_out[0], name, None)
            if isinstance(tensor, torch.Tensor):
                return tensor
    for tensor in attn.parameters():
        return tensor
    raise InvalidArgumentError(
        "attn", "an attention module with at least one parameter (under torch.compile the processor finds the "
        "module through one)", type(attn).__name__,
    )


def returns_pair(attn: torch.nn.Module, encoder_hidden_states: torch.Tensor | None) -> bool:
    """Whether the module's processor returns ``(hidden_states, encoder_hidden_states)``: a joint
    attention (HunyuanVideo-1.5's legacy ``Attention`` with added projections) given text tokens."""
    return (
        encoder_hidden_states is not None
        and isinstance(attn, Attention)
        and getattr(attn, "add_q_proj", None) is not None
    )


class CompiledCalls:
    """The attention modules a processor serves, by the identity of their marker tensor."""

    def __init__(self) -> None:
        self.by_marker: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def module_of(self, marker: torch.Tensor, candidates: Callable[[], list[torch.nn.Module]]) -> torch.nn.Module:
        """The module whose ``marker_of`` is ``marker``: from the index, else after indexing the
        ``candidates`` (modules this processor is installed on)."""
        found = self.lookup(marker)
        if found is not None:
            return found
        for module in candidates():
            try:
                tensor = marker_of(module)
            except InvalidArgumentError:
                continue
            self.by_marker[id(tensor)] = (weakref.ref(tensor), weakref.ref(module))
        self.by_marker = {key: refs for key, refs in self.by_marker.items() if refs[0]() is not None}
        found = self.lookup(marker)
        if found is None:
            raise InvalidArgumentError(
                "attention module",
                "a module this TesseraProcessor is installed on, found through its parameter "
                f"{tuple(marker.shape)} in the compiled graph",
                "no such module among the transformers it serves",
                hint="install the processor before compiling (set_attn_processor or attach), and compile the "
                "transformer or its blocks rather than a copy of them",
            )
        return found

    def lookup(self, marker: torch.Tensor) -> torch.nn.Module | None:
        refs = self.by_marker.get(id(marker))
        if refs is None or refs[0]() is not marker:
            return None
        return refs[1]()


# A CUDA graph would replay the op's first launches and freeze its host decisions: the tag keeps the op
# out of inductor's CUDA graphs. Torch releases without the tag cannot say so; there, do not compile
# with mode="reduce-overhead".
_UNSAFE_IN_CUDA_GRAPHS = {"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe") else {}


@torch.library.custom_op("tessera::processor_call", mutates_args=(), **_UNSAFE_IN_CUDA_GRAPHS)
def processor_call(
    processor: int,
    marker: torch.Tensor,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    rotary_argument: int,
    pair: bool,
) -> list[torch.Tensor]:
    """One attention call of a compiled graph: ``TesseraProcessor`` ``processor`` (a ``register``
    key) on the module whose marker is ``marker``. Returns ``[hidden_states]``, or
    ``[hidden_states, encoder_hidden_states]`` when ``pair``; each has its input's shape and dtype."""
    ref = _processors.get(processor)
    owner = ref() if ref is not None else None
    if owner is None:
        raise InvalidArgumentError("processor", "a live TesseraProcessor", f"key {processor} of a collected one")
    if owner.ulysses is not None:
        raise InvalidArgumentError(
            "torch.compile", "a transformer without context parallelism (the processor's Ulysses exchange reads "
            "the latent grid from attach's hook, which a compiled forward does not run)",
            "a compiled forward with enable_parallelism", hint="run context-parallel transformers eagerly",
        )
    rotary = None if rotary_cos is None else (rotary_cos, rotary_sin)
    with owner._lock:  # the marker index, like the rest of the processor, one call at a time
        attn = owner.compiled.module_of(marker, owner.served_attention_modules)
        out = owner.eager_call(
            attn, hidden_states, encoder_hidden_states, attention_mask,
            rotary if rotary_argument == ROTARY_EMB else None,
            rotary if rotary_argument == IMAGE_ROTARY_EMB else None,
        )
    outs = list(out) if pair else [out]
    inputs = [hidden_states, encoder_hidden_states] if pair else [hidden_states]
    for i, (result, given) in enumerate(zip(outs, inputs)):
        if not isinstance(result, torch.Tensor) or result.shape != given.shape or result.dtype != given.dtype:
            raise InvalidArgumentError(
                "attention output",
                f"output {i} with the shape and dtype of its input ({tuple(given.shape)}, {given.dtype}), as a "
                "compiled graph expects",
                f"{tuple(result.shape)}, {result.dtype}" if isinstance(result, torch.Tensor) else type(result).__name__,
                hint=f"this module ({type(attn).__name__}) cannot run inside torch.compile with TesseraProcessor",
            )
    return [result.contiguous() for result in outs]


@processor_call.register_fake
def _(processor, marker, hidden_states, encoder_hidden_states, attention_mask, rotary_cos, rotary_sin,
      rotary_argument, pair):
    outs = [torch.empty_like(hidden_states, memory_format=torch.contiguous_format)]
    if pair:
        outs.append(torch.empty_like(encoder_hidden_states, memory_format=torch.contiguous_format))
    return outs


def _refuse_backward(ctx, *grads):
    raise InvalidArgumentError(
        "backward", "inference: under torch.compile the processor's attention has no backward",
        "a backward pass through tessera::processor_call",
        hint="run the compiled transformer under torch.no_grad() or torch.inference_mode(), or train eagerly",
    )


processor_call.register_autograd(_refuse_backward)


def traced_call(
    key: int,
    attn: torch.nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    rotary_emb: Any,
    image_rotary_emb: Any,
):
    """What ``TesseraProcessor.__call__`` puts in a graph being compiled: the op for the processor
    registered under ``key`` (``register``)."""
    rotary, argument = (rotary_emb, ROTARY_EMB) if rotary_emb is not None else (image_rotary_emb, IMAGE_ROTARY_EMB)
    if rotary is None:
        cos = sin = None
        argument = NO_ROTARY
    elif isinstance(rotary, (tuple, list)) and len(rotary) == 2:
        cos, sin = rotary
    else:
        raise InvalidArgumentError(
            "rotary_emb" if argument == ROTARY_EMB else "image_rotary_emb",
            "a (cos, sin) pair of tensors", type(rotary).__name__,
        )
    pair = returns_pair(attn, encoder_hidden_states)
    outs = torch.ops.tessera.processor_call(
        key, marker_of(attn), hidden_states, encoder_hidden_states, attention_mask, cos, sin, argument, pair
    )
    return (outs[0], outs[1]) if pair else outs[0]
