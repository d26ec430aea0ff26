"""Per-step reuse: masks and prepared plan state per (model, layer, guidance branch).

A diffusion loop calls every attention layer once per step and guidance branch with the same
shapes, and sparse masks change slowly across steps. ``StepCache`` keeps, per key
``(model, layer, branch)``, the mask a sparsifier made and every backend's plan state for it:

- the mask is recomputed when ``recompute_every`` steps have passed since it was made (or when the
  token layout, batch or sequence changes, or the step went backwards: a new run); a mask that no
  later call can use (``recompute_every`` 1, no mask shared between branches) is not kept at all —
  its plan lives for its own call, and the layer keeps only its plan-table decision (the backend's);
  unless the sparsifier hands the same mask object back (a static mask, which it keeps alive
  itself): from then on that mask and its plan are kept like any other;
- the plan state (a FlexAttention ``BlockMask``, ...) is kept while the slot holds the same mask
  object; a new mask object drops it (a sparsifier that returns the same object for an unchanged
  pattern keeps it). Tessera's prepared plans live in their ``Runtime``, which drops each with its
  mask; the slot counts their bytes (``track``);
- "dense" decisions (``None`` masks) are never kept: they are cheap to ask again, and a dense
  warm-up must end on time whatever the cadence;
- the total size of everything kept is bounded by ``max_bytes``; the least recently used slots go
  first (never the one being used). ``None`` leaves the bound to the owner, who sets it at first use
  (the processor: twice the bytes of the first sparse call's hidden states).

Dense helper masks (text keys of HunyuanVideo-1.5) live in shared slots keyed by shape.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.mask import LogicalMask


@dataclass(eq=False)
class CacheSlot:
    """What is kept for one key: a mask and the plan state built for it."""

    key: Hashable
    mask: LogicalMask | None
    step: int  # step the mask was computed at
    signature: Hashable  # what the mask is valid for (layout, batch, sequence)
    plans: dict = field(default_factory=dict)  # backend plan key -> plan state
    tracked: dict = field(default_factory=dict)  # plan key -> (weak ref, bytes) of a state kept elsewhere
    mask_bytes: int = 0
    plan_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.mask_bytes + self.plan_bytes


@dataclass
class CacheStats:
    mask_computes: int = 0  # sparsifier calls
    mask_reuses: int = 0  # calls served by a kept mask
    plan_builds: int = 0  # backend plan states built
    plan_reuses: int = 0  # calls served by a kept plan state
    evictions: int = 0
    peak_bytes: int = 0


class StepCache:
    """Masks and plan state per (model, layer, branch); see the module docstring.

    Args:
        recompute_every: steps a mask is used for before it is recomputed (1: every step).
        max_bytes: bound on the bytes kept (masks + plan state); None: unbounded until set.
        keep_masks: whether computed masks are kept for later calls (False: each lives for its call).
    """

    def __init__(self, recompute_every: int = 1, max_bytes: int | None = None, keep_masks: bool = True):
        if isinstance(recompute_every, bool) or not isinstance(recompute_every, int) or recompute_every < 1:
            raise InvalidArgumentError("recompute_every", "an int >= 1", repr(recompute_every))
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise InvalidArgumentError("max_bytes", "None or an int >= 0", repr(max_bytes))
        self.keep_masks = bool(keep_masks)
        self.last_masks: dict[Hashable, weakref.ref] = {}  # key -> the last mask not kept (repeat detection)
        self.recompute_every = recompute_every
        self.max_bytes = max_bytes
        self.slots: OrderedDict[Hashable, CacheSlot] = OrderedDict()
        self.stats = CacheStats()

    # ------------------------------------------------------------------ masks
    def kept_mask(self, key: Hashable, step: int, signature: Hashable) -> CacheSlot | None:
        """The slot whose mask can serve ``step``, or None when the mask must be (re)computed."""
        slot = self.slots.get(key)
        if slot is None or slot.mask is None or slot.signature != signature:
            return None
        if step < slot.step or step - slot.step >= self.recompute_every:
            return None
        self.slots.move_to_end(key)
        self.stats.mask_reuses += 1
        return slot

    def store_mask(self, key: Hashable, mask: LogicalMask | None, step: int, signature: Hashable) -> CacheSlot:
        """Record a freshly computed mask (plan state survives only if it is the same object)."""
        self.stats.mask_computes += 1
        slot = self.slots.get(key)
        if slot is not None and slot.mask is mask and mask is not None and slot.signature == signature:
            slot.step = step
            self.slots.move_to_end(key)
            return slot
        slot = CacheSlot(key, mask, step, signature, mask_bytes=mask_nbytes(mask))
        if mask is None or not (self.keep_masks or self.repeated(key, mask)):
            self.slots.pop(key, None)  # dense decisions, and masks no later call can use, are not kept
            return slot
        self.slots[key] = slot
        self.slots.move_to_end(key)
        self.enforce_bound(keep=key)
        return slot

    def repeated(self, key: Hashable, mask: LogicalMask) -> bool:
        """Whether the mask that was not kept for ``key`` last time is this very object."""
        last = self.last_masks.get(key)
        if last is not None and last() is mask:
            return True
        self.last_masks[key] = weakref.ref(mask)
        return False

    def shared_slot(self, key: Hashable, make_mask) -> CacheSlot:
        """A slot that never expires (e.g. a dense helper mask keyed by its shape)."""
        slot = self.slots.get(key)
        if slot is None:
            mask = make_mask()
            slot = CacheSlot(key, mask, 0, key, mask_bytes=mask_nbytes(mask))
            self.slots[key] = slot
            self.enforce_bound(keep=key)
        self.slots.move_to_end(key)
        return slot

    # ------------------------------------------------------------------ plans
    def plan(self, slot: CacheSlot, plan_key: Hashable, build) -> object:
        """The plan state of ``slot`` for ``plan_key``, built with ``build() -> (state, nbytes)``
        when missing."""
        if plan_key in slot.plans:
            self.stats.plan_reuses += 1
            return slot.plans[plan_key]
        state, nbytes = build()
        self.stats.plan_builds += 1
        slot.plans[plan_key] = state
        slot.plan_bytes += int(nbytes)
        if slot.key in self.slots:
            self.enforce_bound(keep=slot.key)
        return state

    def track(self, slot: CacheSlot, plan_key: Hashable, state: object, built: bool) -> None:
        """Count a plan state that another owner keeps for the slot's mask (Tessera's prepared plans
        live in their ``Runtime`` as long as the mask does): ``built`` or reused, and its bytes in
        the slot's total, taken again whenever the owner hands over a new object (a trimmed or
        re-prepared plan: ``Runtime.reuse``). The slot holds it weakly."""
        if built:
            self.stats.plan_builds += 1
        else:
            self.stats.plan_reuses += 1
        ref, nbytes = slot.tracked.get(plan_key, (None, 0))
        if (ref() if ref is not None else None) is state and plan_key in slot.tracked:
            return
        now = tensor_nbytes(state)
        slot.tracked[plan_key] = (weakref.ref(state) if state is not None else None, now)
        slot.plan_bytes = max(0, slot.plan_bytes + now - nbytes)
        if slot.key in self.slots:
            self.enforce_bound(keep=slot.key)

    # ------------------------------------------------------------------ memory
    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots.values())

    def enforce_bound(self, keep: Hashable) -> None:
        total = self.nbytes
        for key in list(self.slots):
            if self.max_bytes is None or total <= self.max_bytes:
                break
            if key == keep:
                continue
            total -= self.slots.pop(key).nbytes
            self.stats.evictions += 1
        self.stats.peak_bytes = max(self.stats.peak_bytes, total)

    def clear(self, model: Hashable | None = None) -> None:
        """Drop every slot (None), or only the masks and plans of one model's keys
        ``(model, layer, branch)``: the other models sharing the cache keep theirs, and shared slots
        stay."""
        if model is None:
            self.slots.clear()
            self.last_masks.clear()
            return
        for kept in (self.slots, self.last_masks):
            for key in [key for key in kept if isinstance(key, tuple) and len(key) == 3 and key[0] == model]:
                del kept[key]

    def report(self) -> dict:
        """Counts and memory (bytes) of the cache."""
        return {
            "slots": len(self.slots),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "recompute_every": self.recompute_every,
            **dataclasses.asdict(self.stats),
        }


def mask_nbytes(mask: LogicalMask | None) -> int:
    return 0 if mask is None else tensor_nbytes(mask.blocks)


def tensor_nbytes(obj: object, seen: set | None = None) -> int:
    """Bytes of the tensors reachable from ``obj`` through dataclass fields, tuples, lists and dicts;
    shared storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        ident = (obj.device, storage.data_ptr())
        if ident in seen:
            return 0
        seen.add(ident)
        return storage.nbytes()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_nbytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if isinstance(obj, (tuple, list)):
        return sum(tensor_nbytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_nbytes(x, seen) for x in obj.values())
    return 0
