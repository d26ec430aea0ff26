"""Saving and loading a corpus: packed bits plus a JSON manifest.

A saved corpus is a directory with

    manifest.json   format tag, one entry per mask: case (if any), geometry, shape, density, sha256
    masks.npz       one uint8 array per entry: the block tensor flattened and packed 8 blocks a byte
                    (``numpy.packbits``, little bit order), zip-deflated

Loading checks each entry's shape and hash against the manifest. A mask that did not come from a
``CaseSpec`` (a dump from a real sparsifier, say) is stored with ``case = null`` and free metadata.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..mask import LogicalMask
from .cases import CaseSpec

CORPUS_FORMAT = "tessera-mask-corpus/1"
MANIFEST_FILE = "manifest.json"
MASKS_FILE = "masks.npz"


@dataclass(frozen=True, eq=False)
class CorpusEntry:
    """One stored mask with the case it was built from (None for foreign masks)."""

    case: CaseSpec | None
    mask: LogicalMask
    info: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.case is not None:
            return self.case.name
        return str(self.info.get("name", "unnamed"))


def pack_blocks(blocks: torch.Tensor) -> np.ndarray:
    """``[B, H, nQ, nKV]`` bool -> packed ``uint8 [ceil(numel / 8)]``."""
    return np.packbits(blocks.detach().to("cpu").contiguous().numpy().reshape(-1), bitorder="little")


def unpack_blocks(packed: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``pack_blocks``. Returns a CPU bool tensor of ``shape``."""
    count = int(np.prod(shape))
    bits = np.unpackbits(packed, count=count, bitorder="little").astype(bool)
    return torch.from_numpy(bits.reshape(shape))


def save_corpus(
    directory: str | Path,
    entries: Iterable[CorpusEntry | tuple[CaseSpec | None, LogicalMask]],
) -> Path:
    """Write ``entries`` to ``directory`` (created if needed). Returns the manifest path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    manifest_entries = []
    for index, item in enumerate(entries):
        entry = item if isinstance(item, CorpusEntry) else CorpusEntry(item[0], item[1])
        mask = entry.mask
        if not isinstance(mask, LogicalMask):
            raise InvalidArgumentError(f"entries[{index}].mask", "a LogicalMask", type(mask).__name__)
        key = f"m{index:06d}"
        packed = pack_blocks(mask.blocks)
        arrays[key] = packed
        manifest_entries.append(
            {
                "key": key,
                "name": entry.name,
                "case": None if entry.case is None else entry.case.to_dict(),
                "info": entry.info,
                "shape": list(mask.blocks.shape),
                "block_q": mask.block_q,
                "block_kv": mask.block_kv,
                "seq_len_q": mask.seq_len_q,
                "seq_len_kv": mask.seq_len_kv,
                "density": mask.density(),
                "sha256": hashlib.sha256(packed.tobytes()).hexdigest(),
            }
        )
    np.savez_compressed(directory / MASKS_FILE, **arrays)
    manifest_path = directory / MANIFEST_FILE
    manifest_path.write_text(json.dumps({"format": CORPUS_FORMAT, "entries": manifest_entries}, indent=1))
    return manifest_path


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise InvalidArgumentError("directory", f"a saved corpus with {MANIFEST_FILE}", str(directory))
    manifest = json.loads(path.read_text())
    if manifest.get("format") != CORPUS_FORMAT:
        raise InvalidArgumentError(f"{path}", f"format {CORPUS_FORMAT!r}", repr(manifest.get("format")))
    return manifest


def iter_corpus(directory: str | Path, device: torch.device | str = "cpu") -> Iterator[CorpusEntry]:
    """Entries of a saved corpus, one at a time, with their masks on ``device``."""
    manifest = read_manifest(directory)
    with np.load(Path(directory) / MASKS_FILE) as arrays:
        for meta in manifest["entries"]:
            packed = arrays[meta["key"]]
            digest = hashlib.sha256(packed.tobytes()).hexdigest()
            if digest != meta["sha256"]:
                raise InvalidArgumentError(f"corpus entry {meta['name']}", f"sha256 {meta['sha256']}", digest,
                                           hint="the corpus files are corrupt or were edited")
            blocks = unpack_blocks(packed, tuple(meta["shape"])).to(device)
            mask = LogicalMask(blocks, meta["block_q"], meta["block_kv"], meta["seq_len_q"], meta["seq_len_kv"])
            case = None if meta["case"] is None else CaseSpec.from_dict(meta["case"])
            yield CorpusEntry(case, mask, dict(meta.get("info") or {}))


def load_corpus(directory: str | Path, device: torch.device | str = "cpu") -> list[CorpusEntry]:
    """Every entry of a saved corpus (see ``iter_corpus``)."""
    return list(iter_corpus(directory, device))
