"""pytest plugin: run diffusers' own model tests with TesseraProcessor installed.

    python -m pytest -p diffusers_suite.plugin --tessera default <diffusers>/tests/models/transformers/...

(with this folder's parent, ``tests/integration/``, on ``PYTHONPATH``; ``run.py`` does all of this.)

``--tessera`` picks what every ``WanTransformer3DModel`` and ``HunyuanVideo15Transformer3DModel``
gets right after construction (the constructor and ``from_pretrained`` both run ``__init__``):

    off      nothing: diffusers' stock processors
    default  ``model.set_attn_processor(TesseraProcessor())``, the user's one-liner
    sparse   the same with ``SPARSE_SPARSIFIER``, small enough that the tests' tiny latent grids
             get genuinely sparse block masks, and no dense warm-up

Tests that set their own processors afterwards replace ours, as they would a user's. The wrapped
``__init__`` methods are restored at the end of the session. ``--tessera-stats PATH`` writes the
processors' statistics (calls, sparse/dense decisions, mean mask density) as JSON.

Importing this module has no side effects; nothing is patched unless ``--tessera`` is not ``off``.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

MODES = ("off", "default", "sparse")
TARGET_CLASSES = ("WanTransformer3DModel", "HunyuanVideo15Transformer3DModel")

# Keyword arguments of the ``SSTASparsifier`` of ``--tessera sparse``, sized for the tests' latent
# grids: Wan 2 x 8 x 8 tokens (inputs 2 x 16 x 16, patch 1 x 2 x 2), HunyuanVideo-1.5 1 x 8 x 8.
# Tiles of 1 x 4 x 4 = 16 tokens are exactly one 16-token block each (the smallest block): 8 and 4
# blocks. A one-tile window plus the top-1 other tile per query tile gives block densities of 2/8
# and 2/4. ``halve_top_k_at_frames=0`` keeps ``top_k`` at 1 (it would be halved to 0 on these
# short grids), so the data-dependent top-k selection runs as well. An explicit sparsifier gets no
# dense warm-up steps.
SPARSE_SPARSIFIER: dict[str, Any] = {"tile": (1, 4, 4), "window": (1, 1, 1), "top_k": 1, "halve_top_k_at_frames": 0}

_INSTALLER_KEY = pytest.StashKey["TesseraInstaller"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tessera", "Tessera attention processor")
    group.addoption(
        "--tessera",
        choices=MODES,
        default="off",
        help="install TesseraProcessor on every Wan / HunyuanVideo-1.5 transformer built: "
        "off (stock), default (TesseraProcessor()), sparse (a sparsifier for tiny grids)",
    )
    group.addoption(
        "--tessera-stats",
        metavar="PATH",
        default=None,
        help="write the statistics of the installed processors to PATH (JSON)",
    )


def make_processor(mode: str) -> Any:
    """A new processor for ``mode`` ("default" or "sparse")."""
    from tessera_diffusers.processors import TesseraProcessor
    from tessera_diffusers.sparsifiers import SSTASparsifier

    if mode == "default":
        return TesseraProcessor()
    if mode == "sparse":
        return TesseraProcessor(SSTASparsifier(**SPARSE_SPARSIFIER))
    raise ValueError(f"no processor for --tessera {mode}")


@dataclass
class TesseraInstaller:
    """Wraps the target classes' ``__init__`` so that every new model gets a processor."""

    mode: str
    originals: dict[type, Callable[..., None]] = field(default_factory=dict)
    processors: list[tuple[str, Any]] = field(default_factory=list)  # (model class, processor)

    def install(self) -> None:
        import diffusers

        for name in TARGET_CLASSES:
            cls = getattr(diffusers, name)
            original = cls.__dict__["__init__"]
            self.originals[cls] = original
            cls.__init__ = self.wrap(cls, original)

    def uninstall(self) -> None:
        for cls, original in self.originals.items():
            cls.__init__ = original
        self.originals.clear()

    def wrap(self, cls: type, original: Callable[..., None]) -> Callable[..., None]:
        installer = self

        @functools.wraps(original)  # keeps the signature diffusers' config machinery inspects
        def __init__(model: Any, *args: Any, **kwargs: Any) -> None:
            original(model, *args, **kwargs)
            installer.attach(cls.__name__, model)

        return __init__

    def attach(self, class_name: str, model: Any) -> None:
        processor = make_processor(self.mode)
        model.set_attn_processor(processor)
        self.processors.append((class_name, processor))

    def summary(self) -> dict[str, Any]:
        """Processor statistics per model class: models built, attention calls per route,
        sparse/dense decisions, masks computed and their mean block density (from each
        processor's ``stats()``; an error there is reported, not raised)."""
        per_class: dict[str, dict[str, Any]] = {}
        weighted: dict[str, float] = {}
        errors: list[str] = []
        for class_name, processor in self.processors:
            entry = per_class.setdefault(
                class_name, {"models": 0, "calls": {}, "sparse_calls": 0, "dense_calls": 0, "masks_computed": 0}
            )
            entry["models"] += 1
            try:
                stats = processor.stats()
            except Exception as exc:  # noqa: BLE001 - a processor left unusable by a failed test is reported
                errors.append(f"{class_name}: {type(exc).__name__}: {exc}")
                continue
            for route, n in stats.get("calls", {}).items():
                entry["calls"][route] = entry["calls"].get(route, 0) + n
            for key in ("sparse_calls", "dense_calls", "masks_computed"):
                entry[key] += int(stats.get(key, 0))
            masks = int(stats.get("masks_computed", 0))
            if masks:
                weighted[class_name] = weighted.get(class_name, 0.0) + float(stats["mean_mask_density"]) * masks
        for class_name, entry in per_class.items():
            masks = entry["masks_computed"]
            entry["mean_mask_density"] = weighted.get(class_name, 0.0) / masks if masks else None
        import tessera_diffusers.processors

        return {
            "mode": self.mode,
            "sparsifier": describe_sparsifier(self.mode),
            "processors_module": str(Path(tessera_diffusers.processors.__file__).parent),
            "classes": per_class,
            "errors": errors,
        }


def describe_sparsifier(mode: str) -> str:
    """The sparsifier of ``mode`` as the processor is built with it."""
    if mode == "default":
        return "none given (the processor's per-model default)"
    return "SSTASparsifier(" + ", ".join(f"{k}={v!r}" for k, v in SPARSE_SPARSIFIER.items()) + ")"


def pytest_configure(config: pytest.Config) -> None:
    mode = config.getoption("--tessera")
    if mode == "off":
        return
    installer = TesseraInstaller(mode)
    installer.install()
    config.stash[_INSTALLER_KEY] = installer


def pytest_unconfigure(config: pytest.Config) -> None:
    installer = config.stash.get(_INSTALLER_KEY, None)
    path = config.getoption("--tessera-stats")
    if installer is None:
        if path:
            summary = {"mode": "off", "sparsifier": None, "classes": {}, "errors": []}
            write_json(Path(path), {**summary, "diffusers": imported_diffusers()})
        return
    try:
        if path:
            write_json(Path(path), {**installer.summary(), "diffusers": imported_diffusers()})
    finally:
        installer.uninstall()
        del config.stash[_INSTALLER_KEY]


def pytest_report_header(config: pytest.Config) -> str:
    installer = config.stash.get(_INSTALLER_KEY, None)
    if installer is None:
        return "tessera: off (stock attention processors)"
    return f"tessera: {installer.mode}: set_attn_processor(TesseraProcessor(...)), sparsifier {describe_sparsifier(installer.mode)}"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    installer = config.stash.get(_INSTALLER_KEY, None)
    if installer is None:
        return
    terminalreporter.section("tessera")
    summary = installer.summary()
    for class_name, entry in summary["classes"].items():
        density = entry["mean_mask_density"]
        terminalreporter.write_line(
            f"{class_name}: {entry['models']} models, {entry['sparse_calls']} sparse / {entry['dense_calls']} dense "
            f"calls, {entry['masks_computed']} masks, mean block density "
            + ("-" if density is None else f"{density:.3f}")
        )
    for error in summary["errors"]:
        terminalreporter.write_line(f"stats() failed: {error}")


def imported_diffusers() -> dict[str, str] | None:
    """Version and location of the diffusers the tests imported (a checkout's ``src/`` can take
    precedence over the installed package: diffusers' ``tests/conftest.py`` puts it on ``sys.path``)."""
    module = sys.modules.get("diffusers")
    if module is None:
        return None
    return {"version": str(getattr(module, "__version__", "")), "path": str(Path(module.__file__).parent)}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
