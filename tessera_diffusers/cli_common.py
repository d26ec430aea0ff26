"""What every ``tessera`` command shares (``cli.py``, ``demo.py``, ``bench/cli.py``,
``profile/cli.py``): the parser whose mistakes end in one line, the error handling of a run, and the
argument types."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import NoReturn

from .errors import TesseraError
from .mask import BLOCK_ALIGNMENT, MAX_BLOCK, MIN_BLOCK
from .validation import MAX_HEAD_DIM


class CommandLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage mistakes end in one line, ``<prog>: error: <message>``, with
    exit status 2 (no usage dump); descriptions keep their line breaks."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_command(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)``; a ``TesseraError`` (a user's mistake found past parsing) becomes one line on
    stderr and exit status 2. Other exceptions are bugs and keep their traceback."""
    try:
        return run(args)
    except TesseraError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


def rejected(expected: str, text: str, note: str | None = None) -> argparse.ArgumentTypeError:
    """The error of an argument type: what was expected, what came (and why it does not do)."""
    return argparse.ArgumentTypeError(f"expected {expected}, got {text!r}" + (f" ({note})" if note else ""))


def int_at_least(least: int) -> Callable[[str], int]:
    """Argument type: an int >= ``least``."""
    expected = "a positive int" if least == 1 else f"an int >= {least}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise rejected(expected, text) from None
        if value < least:
            raise rejected(expected, text)
        return value

    parse.__name__ = f"int_at_least_{least}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def number_at_least(least: float) -> Callable[[str], float]:
    """Argument type: a finite number >= ``least``."""
    expected = f"a number >= {least:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise rejected(expected, text) from None
        if not math.isfinite(value) or value < least:
            raise rejected(expected, text)
        return value

    parse.__name__ = f"number_at_least_{least:g}"
    return parse


non_negative_number = number_at_least(0.0)


def density(text: str) -> float:
    """Argument type: a share of active blocks in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise rejected("a density in (0, 1]", text) from None
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise rejected("a density in (0, 1]", text)
    return value


def geometry(text: str) -> tuple[int, int]:
    """Argument type: ``"Q64K128"`` -> ``(64, 128)``, the query and key block sizes."""
    match = re.fullmatch(r"Q(\d+)K(\d+)", text.strip(), flags=re.IGNORECASE)
    sizes = None if match is None else (int(match[1]), int(match[2]))
    if sizes is None or any(s % BLOCK_ALIGNMENT or not MIN_BLOCK <= s <= MAX_BLOCK for s in sizes):
        raise rejected(f"Q<B_Q>K<B_KV> with block sizes multiples of {BLOCK_ALIGNMENT} in "
                       f"[{MIN_BLOCK}, {MAX_BLOCK}] (e.g. Q64K64)", text)
    return sizes


def head_dim(text: str) -> int:
    """Argument type: a head dimension the kernels take, a multiple of 8 up to ``MAX_HEAD_DIM``."""
    expected = f"a head dimension, a multiple of 8 in [8, {MAX_HEAD_DIM}]"
    try:
        value = int(text)
    except ValueError:
        raise rejected(expected, text) from None
    if value % 8 or not 8 <= value <= MAX_HEAD_DIM:
        raise rejected(expected, text)
    return value


def arch(text: str) -> str:
    """Argument type: ``cpu`` or a CUDA architecture such as ``sm80``, ``sm90`` or ``sm120``."""
    name = text.strip().lower()
    if name != "cpu" and re.fullmatch(r"sm[1-9]\d{1,2}a?", name) is None:
        raise rejected("a CUDA architecture like sm80, sm90 or sm120, or cpu", text)
    return name.removesuffix("a")  # requests name the device (sm90), kernels the instruction set (sm90a)


def device(text: str) -> str:
    """Argument type: ``cpu``, or ``cuda`` / ``cuda:N`` where a CUDA device is visible."""
    import torch

    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise rejected("cpu, cuda or cuda:N", text) from None
    if parsed.type not in ("cpu", "cuda"):
        raise rejected("cpu, cuda or cuda:N", text)
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise rejected("cpu", text, "no CUDA device is visible here")
    return text


def regex(text: str) -> str:
    """Argument type: a Python regular expression."""
    try:
        re.compile(text)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"expected a regular expression, got {text!r} ({err})") from None
    return text


def names_from(choices: Collection[str]) -> Callable[[str], tuple[str, ...]]:
    """Argument type: comma-separated names, each one of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated names from {list(choices)}, got {', '.join(map(repr, unknown or [text]))}")
        return names

    parse.__name__ = "names"
    return parse


def existing_file(text: str) -> Path:
    """Argument type: a path to a file that exists."""
    path = Path(text)
    if not path.is_file():
        raise rejected("an existing file", text, "a directory" if path.is_dir() else "no such file")
    return path


def existing_dir(text: str) -> Path:
    """Argument type: a path to a directory that exists."""
    path = Path(text)
    if not path.is_dir():
        raise rejected("an existing directory", text, "a file" if path.exists() else "no such directory")
    return path


def writable_parent(path: Path) -> str | None:
    """Why files could not be created at ``path`` (its nearest existing ancestor is not a writable
    directory), or None."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


def output_dir(text: str) -> Path:
    """Argument type: a directory to write into, existing or creatable (nothing is created here)."""
    path = Path(text)
    expected = "a directory to write into (created if missing)"
    if path.exists():
        if not path.is_dir():
            raise rejected(expected, text, "an existing file")
        if not os.access(path, os.W_OK | os.X_OK):
            raise rejected(expected, text, "not writable")
        return path
    why = writable_parent(path)
    if why is not None:
        raise rejected(expected, text, why)
    return path


def output_file(text: str) -> Path:
    """Argument type: a file to write (its directory created if missing)."""
    path = Path(text)
    why = "a directory" if path.is_dir() else writable_parent(path)
    if why is not None:
        raise rejected("a file path to write", text, why)
    return path
