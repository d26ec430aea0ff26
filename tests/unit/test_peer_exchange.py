"""The copy-engine exchange's CPU-checkable parts: strided copies as rows of bytes (``copy_rows``,
emulated byte for byte against ``Tensor.copy_``), the staging slots, and the refusals before any GPU
work. The exchange itself runs in ``tests/gpu/test_peer_exchange_gpu.py`` (two GPUs)."""

from __future__ import annotations

import pytest
import torch

from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.parallel import TRANSPORT_ENV, Ulysses
from tessera_diffusers.peer_exchange import CopyEngineAllToAll, copy_rows, slot, words


def emulate_rows(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """What a 2D copy engine transfer writes: a copy of ``dst``'s storage after it."""
    rows = copy_rows(dst, src)
    assert rows is not None
    out = storage_bytes(dst)
    src_all = storage_bytes(src)
    size = src.element_size()
    s0, d0 = src.storage_offset() * size, dst.storage_offset() * size
    for r in range(rows.height):
        out[d0 + r * rows.dst_pitch : d0 + r * rows.dst_pitch + rows.width] = src_all[
            s0 + r * rows.src_pitch : s0 + r * rows.src_pitch + rows.width
        ]
    return out


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(t.untyped_storage()), dtype=torch.uint8)


CASES = {
    # name: (dst, src) builders; every src is random, every dst poisoned
    "head_slice_to_contiguous": lambda: (torch.empty(1, 30, 3, 8), torch.randn(1, 30, 12, 8)[:, :, 3:6]),
    "contiguous_to_head_slice": lambda: (torch.empty(1, 30, 12, 8)[:, :, 6:9], torch.randn(1, 30, 3, 8)),
    "batch_two": lambda: (torch.empty(2, 20, 2, 16), torch.randn(2, 20, 4, 16)[:, :, 2:]),
    "piece_of_a_chunk": lambda: (  # rank 1's heads of chunk 1, as Ulysses.exchange_chunk cuts them
        torch.empty(1, 15, 2, 8),
        torch.randn(1, 15, 8, 8).unflatten(2, (2, 2, 2))[:, :, :, 1].movedim(2, 0)[1],
    ),
    "contiguous": lambda: (torch.empty(4, 5, 6), torch.randn(4, 5, 6)),
    "bf16_rows": lambda: (torch.empty(7, 3, 4, dtype=torch.bfloat16)[:, 1:], torch.randn(7, 2, 4).bfloat16()),
}


@pytest.mark.parametrize("case", CASES)
def test_copy_rows_equals_copy(case):
    dst, src = CASES[case]()
    dst.fill_(float("nan"))
    rows_written = emulate_rows(dst, src)
    dst.copy_(src)
    assert torch.equal(rows_written, storage_bytes(dst))


@pytest.mark.parametrize(
    "case",
    [
        lambda: (torch.empty(3, 4), torch.empty(4, 3).t()),  # transposed: no contiguous rows
        lambda: (torch.empty(2, 3, 4), torch.empty(2, 4, 4)[:, ::2][:, :3]),  # unevenly spaced rows
        lambda: (torch.empty(2, 3), torch.empty(3, 2)),  # shapes differ
        lambda: (torch.empty(2, 3), torch.empty(2, 3, dtype=torch.float64)),  # dtypes differ
        lambda: (  # all pieces at once: the rank dim does not collapse into the token rows
            torch.empty(2, 1, 15, 2, 8),
            torch.randn(1, 15, 8, 8).unflatten(2, (2, 2, 2))[:, :, :, 1].movedim(2, 0),
        ),
    ],
)
def test_copy_rows_refuses_what_rows_cannot_express(case):
    dst, src = case()
    rows = copy_rows(dst, src)
    if rows is not None:  # the only acceptable answer is one that copies exactly
        dst_bytes = emulate_rows(dst, src)
        dst.copy_(src)
        assert torch.equal(dst_bytes, storage_bytes(dst))


@pytest.mark.parametrize(
    "make, wide",
    [
        (lambda x: x, True),  # contiguous
        (lambda x: x[:, :, 4:8], True),  # a head chunk: rows at a pitch of 10 heads
        (lambda x: x.unflatten(2, (2, 5))[:, :, 1, 1:3], True),  # the piece of rank 1, chunk 1 of 5
        (lambda x: x[..., 1:5], False),  # an offset of one element (2 bytes): not whole words
        (lambda x: x[..., :4], True),  # rows of one word
        (lambda x: x[..., :6], False),  # rows of 12 bytes
        (lambda x: x[..., :3], False),  # rows of 6 bytes
        (lambda x: x.transpose(1, 2), True),  # strides permuted, the last dim still contiguous
        (lambda x: x.transpose(2, 3), False),  # the last dim strided
    ],
)
def test_words_view_the_same_bytes(make, wide):
    x = torch.randn(2, 3, 10, 8).to(torch.bfloat16)
    t = make(x)
    w = words(t)
    assert (w is not None) == wide
    if w is not None:
        assert w.dtype == torch.int64 and w.data_ptr() == t.data_ptr()
        dst = torch.zeros_like(t)
        words(dst).copy_(w)  # what copy_words does on the GPU
        assert torch.equal(dst.view(torch.int16), t.contiguous().view(torch.int16))


def test_wide_words_move_the_bits():
    """copy_words' 16-byte words (complex128) and 8-byte words move bf16 bit patterns unchanged, NaNs
    and infinities included."""
    bits = torch.randint(-(2**15), 2**15, (2, 5, 4, 16), generator=torch.Generator().manual_seed(0), dtype=torch.int16)
    bits[0, 0, 0, :4] = torch.tensor([0x7FC1, 0x7F81, -0x0080, 0x7F80], dtype=torch.int16)  # qNaN, sNaN, -inf, inf
    x = bits.view(torch.bfloat16)
    for dtype in (torch.complex128, torch.int64):
        src = x[:, :, 2:4]  # a head chunk: rows of 2 heads at a pitch of 4
        dst = torch.zeros(src.shape, dtype=torch.bfloat16)
        words(dst, dtype).copy_(words(src, dtype))
        assert torch.equal(dst.view(torch.int16), src.contiguous().view(torch.int16))
    assert words(x[..., 4:12], torch.complex128) is None  # an offset of 8 bytes: not a whole 16-byte word
    assert words(x[..., 4:12], torch.int64) is not None
    assert words(x[..., :4], torch.complex128) is None  # rows of 8 bytes


def test_slots_pair_senders_and_receivers():
    for n in (2, 3, 5):
        for sender in range(n):
            slots = [slot(receiver, sender) for receiver in range(n) if receiver != sender]
            assert sorted(slots) == list(range(n - 1))  # every peer a slot of its own


def test_transport_argument_is_checked(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="transport"):
        Ulysses.__init__(object.__new__(Ulysses), transport="rdma")  # before any process group check
    monkeypatch.setenv(TRANSPORT_ENV, "ucx")
    with pytest.raises(InvalidArgumentError, match=TRANSPORT_ENV):
        Ulysses.__init__(object.__new__(Ulysses))


def test_engine_needs_a_cuda_device():
    with pytest.raises(InvalidArgumentError, match="device"):
        CopyEngineAllToAll(None, torch.device("cpu"))
