"""The command line: a user's mistake in any command ends in one line naming the option, exit status
2 and no traceback; every command's help describes it for a user."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera_diffusers import cli, demo
from tessera_diffusers.bench import cli as bench_cli
from tessera_diffusers.profile import cli as profile_cli

MAINS = {"tessera": cli.main, "bench": bench_cli.main, "profile": profile_cli.main, "demo": demo.main}
COMMANDS = ("demo", "bench", "explain", "profile", "build")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine this command is valid")

# (main, argv, the option the message must name); {tmp}: a fresh directory, {file}: a file in it,
# {notjson}: a file that is not JSON.
MISTAKES = [
    ("tessera", "explain --geometry Q8K8", "--geometry"),
    ("tessera", "explain --geometry Q64", "--geometry"),
    ("tessera", "explain --geometry foo", "--geometry"),
    ("tessera", "explain --geometry Q64K", "--geometry"),
    ("tessera", "explain --geometry Q-16K16", "--geometry"),
    ("tessera", "explain --geometry Q1024K64", "--geometry"),
    ("tessera", "explain --seq 0", "--seq"),
    ("tessera", "explain --seq 100000000", "--seq"),
    ("tessera", "explain --heads -1", "--heads"),
    ("tessera", "explain --density 2", "--density"),
    ("tessera", "explain --density nan", "--density"),
    ("tessera", "explain --head-dim 7", "--head-dim"),
    ("tessera", "explain --arch sm1000", "--arch"),
    ("tessera", "explain --table /nonexistent/table.json", "--table"),
    ("tessera", "explain --table {notjson}", "--table"),
    ("tessera", "explain --table {notjson} --no-table", "--table"),
    ("tessera", "explain --bogus", "--bogus"),
    ("tessera", "nosuch", "command"),
    ("tessera", "bench --out {tmp}/b --families NOPE", "--families"),
    ("tessera", "bench --out {tmp}/b --sizes huge", "--sizes"),
    ("tessera", "bench --out {file}", "--out"),
    ("tessera", "bench --out {file}/sub --smoke", "--out"),
    ("tessera", "bench --smoke", "--out"),
    ("bench", "--out {tmp}/b --backends nope", "--backends"),
    ("bench", "--out {tmp}/b --reps 0", "--reps"),
    ("bench", "--out {tmp}/b --plan-filter (", "--plan-filter"),
    ("bench", "--out {tmp}/b --device tpu", "--device"),
    pytest.param("bench", "--out {tmp}/b --device cuda", "--device", marks=no_cuda),
    ("bench", "--out {tmp}/never_ran --report-only", "--out"),
    ("tessera", "profile --out {tmp}/p --smoke --families NOPE", "--families"),
    ("tessera", "profile --out {tmp}/p --smoke --minutes -1", "--minutes"),
    ("profile", "--out {tmp}/p --smoke --sizes huge", "--sizes"),
    ("profile", "--out {tmp}/p --smoke --sources nope", "--sources"),
    ("profile", "--out {file} --smoke", "--out"),
    ("profile", "--out {tmp}/p --compile-only --records /nonexistent/profile.jsonl", "--records"),
    ("profile", "--out {tmp}/never_profiled --compile-only", "--out"),
    ("profile", "--out {tmp}/p --smoke --abandon-factor 1", "--abandon-factor"),
    ("profile", "--out {tmp}/p --smoke --context-gemm 64 --sequential", "--context-gemm"),
    ("profile", "--out {tmp}/p --compile-only --no-compile", "--no-compile"),
    ("profile", "--out {tmp}/p --folds 1", "--folds"),
    ("tessera", "demo --steps 0", "--steps"),
    pytest.param("demo", "--device cuda", "--device", marks=no_cuda),
    ("tessera", "build --jobs 0", "--jobs"),
    ("tessera", "build --archs sm90", "--archs"),
    ("tessera", "build --only (", "--only"),
]


def call(main: str, argv: list[str]) -> int:
    try:
        return MAINS[main](argv)
    except SystemExit as exit:  # argparse's way out
        return exit.code


def assert_one_line_error(code: int, err: str, argument: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    (line,) = lines
    assert line.startswith("tessera") and "error" in line and argument in line, line
    return line


@pytest.mark.parametrize("main, argv, argument", MISTAKES, ids=lambda p: p if isinstance(p, str) else None)
def test_a_mistake_ends_in_one_line_naming_the_option(main, argv, argument, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "not_json.txt").write_text("this is not a plan table\n")
    args = argv.format(tmp=tmp_path, file=tmp_path / "a_file", notjson=tmp_path / "not_json.txt").split()
    code = call(main, args)
    assert_one_line_error(code, capsys.readouterr().err, argument)
    assert not (tmp_path / "b").exists() and not (tmp_path / "p").exists()  # refused before any work


def test_an_unwritable_output_directory_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)  # as root every directory is writable
    code = call("tessera", ["bench", "--smoke", "--out", str(tmp_path / "out")])
    line = assert_one_line_error(code, capsys.readouterr().err, "--out")
    assert "not writable" in line


def test_build_outside_a_source_checkout_says_what_to_do(monkeypatch, capsys):
    isfile = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda p: not str(p).endswith("build_native.py") and isfile(p))
    line = assert_one_line_error(call("tessera", ["build"]), capsys.readouterr().err, "source checkout")
    assert "pip install -e ." in line


def test_the_module_runs_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "tessera_diffusers.cli", "explain", "--geometry", "Q8K8"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("tessera explain: error: argument --geometry")


def help_text(main: str, argv: list[str], capsys) -> str:
    assert call(main, argv + ["--help"]) == 0
    return capsys.readouterr().out


HELPS = [("tessera", [])] + [("tessera", [c]) for c in COMMANDS] + [("bench", []), ("profile", []), ("demo", [])]


@pytest.mark.parametrize("main, argv", HELPS, ids=lambda p: p if isinstance(p, str) else " ".join(p) or "-")
def test_every_help_describes_the_command_for_a_user(main, argv, capsys):
    text = help_text(main, argv, capsys)
    description = text.split("\n\n", 1)[1].split("options:", 1)[0]  # between the usage and the options
    assert len(description.split()) >= 30, text
    assert re.search(r"\b(issues?|sessions?|stud(y|ies))\b", text, flags=re.IGNORECASE) is None, text


def test_smoke_profile_report_names_what_was_profiled(tmp_path, capsys):
    """Without native kernels the table's catalog hash is that of an empty catalog; the report says so."""
    argv = ["--smoke", "--no-progress", "--families", "Q64K64", "--sources", "sliding_tile", "--max-cases", "1",
            "--out", str(tmp_path)]
    assert profile_cli.main(argv) == 0
    title = (tmp_path / profile_cli.REPORT_FILE).read_text().splitlines()[0]
    assert "no native kernels, the PyTorch executor's plans" in title


def test_explain_on_a_gpu_with_the_library_says_when_the_table_is_stale(monkeypatch, capsys):
    """On the device the table serves, explain plans with the loaded library's kernels, so a table
    profiled on other kernel sources gets the note the runtime warns with; elsewhere it plans with
    the whole catalog and has no library to compare with."""
    from tessera_diffusers import catalog, library, selector

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(library, "native_available", lambda: True)
    monkeypatch.setattr(selector, "discover_kernels", lambda arch: (catalog.all_kernels(), None))
    monkeypatch.setattr(selector, "library_kernel_sources", lambda cuda=True, part="kernel_sources": "0" * 16)
    argv = ["explain", "--geometry", "Q64K64", "--seq", "4096", "--heads", "2"]
    with pytest.warns(UserWarning, match="stale|profiled on"):
        assert call("tessera", argv) == 0
    assert "plan table possibly stale" in capsys.readouterr().out
    monkeypatch.setattr(library, "native_available", lambda: False)
    assert call("tessera", argv) == 0
    assert "possibly stale" not in capsys.readouterr().out


def test_explain_shows_an_8bit_request_and_its_8bit_kernel(capsys):
    argv = ["explain", "--geometry", "Q128K128", "--seq", "4096", "--heads", "2", "--arch", "sm90", "--precision", "int8"]
    assert call("tessera", argv) == 0
    out = capsys.readouterr().out
    assert "/int8 " in out and "precision int8" in out
    chosen = next(line for line in out.splitlines() if line.startswith("chosen"))
    assert "_hopper_" in chosen and "(8-bit kernel hopper8qk_t128x128_d128_bf16_" in chosen
    back = next(line for line in out.splitlines() if line.startswith("a mask that comes back"))
    assert "the rule" in back and "grouped" not in back  # a 128-row block fills its tile: nothing to group
    assert call("tessera", ["explain", "--geometry", "Q32K32", "--seq", "4096", "--heads", "2", "--arch", "sm90",
                            "--precision", "int8"]) == 0
    back = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("a mask that comes back"))
    assert back.startswith("a mask that comes back: grouped") and "the rule" in back
    assert call("tessera", argv[:-2]) == 0
    assert "precision" not in capsys.readouterr().out


def test_runtime_explain_takes_the_precision(capsys):
    from tessera_diffusers import LogicalMask, Runtime

    q = torch.randn(1, 256, 2, 128)
    mask = LogicalMask(torch.ones(1, 2, 2, 2, dtype=torch.bool), 128, 128, 256, 256)
    selection = Runtime().explain(q, q, q, mask, precision="int8")
    assert selection.request.precision == "int8" and "precision int8" in capsys.readouterr().out
