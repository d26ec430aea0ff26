"""Run diffusers' own tests of the Wan and HunyuanVideo-1.5 transformers with and without Tessera.

    python tests/integration/diffusers_suite/run.py [--diffusers-src DIR] [--out DIR] [-k EXPR]

Each transformer test file runs three times in its own pytest process, with ``plugin.py`` and
``--tessera off`` (stock processors), ``default`` and ``sparse``. Outcomes are read test by test
from JUnit XML; ``diffusers_tests.json`` and ``diffusers_tests.md`` under ``--out`` give the counts
per mode and file and every test whose outcome differs from ``off``. Exit status: 0 when no test
differs, 1 when some do, 2 when the suite could not run (no diffusers source, a pytest crash).

diffusers' test files are not part of this tree: ``--diffusers-src`` names a diffusers checkout
whose ``tests/`` matches the installed diffusers, otherwise ``tests/`` of the installed version's
tag is cloned once into ``~/.cache/tessera/diffusers-<version>``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUITE_DIR = Path(__file__).resolve().parent
REPO_ROOT = SUITE_DIR.parents[2]
PLUGIN = f"{SUITE_DIR.name}.plugin"  # importable with SUITE_DIR's parent on PYTHONPATH
MODES = ("off", "default", "sparse")
OUTCOMES = ("passed", "failed", "skipped", "xfailed", "error")
SEVERITY = {"missing": -1, "passed": 0, "skipped": 1, "xfailed": 2, "error": 3, "failed": 4}
DIFFUSERS_URL = "https://github.com/huggingface/diffusers"
TRANSFORMER_TESTS = Path("tests/models/transformers")
CLONE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Target:
    """A transformer and the names its diffusers test file has had (tried in order)."""

    model_class: str
    file_names: tuple[str, ...]


TARGETS = (
    Target("WanTransformer3DModel", ("test_models_transformer_wan.py",)),
    Target(
        "HunyuanVideo15Transformer3DModel",
        (
            "test_models_transformer_hunyuan_1_5.py",
            "test_models_transformer_hunyuan_video15.py",
            "test_models_transformer_hunyuan_video_1_5.py",
        ),
    ),
)


class SetupError(RuntimeError):
    """The suite cannot run (exit status 2)."""


@dataclass(frozen=True)
class Outcome:
    """One test's result: its outcome and, for failures and errors, pytest's message and report."""

    outcome: str
    message: str = ""
    details: str = ""


@dataclass
class Run:
    """One pytest process: one mode on one test file."""

    mode: str
    file: str
    returncode: int | None = None
    duration_s: float = 0.0
    problem: str | None = None
    log: str = ""
    junit: str = ""
    stats: dict[str, Any] | None = None
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(OUTCOMES, 0)
        for outcome in self.outcomes.values():
            counts[outcome.outcome] += 1
        return counts


# ---------------------------------------------------------------------- the diffusers source
def cache_dir(version: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tessera" / f"diffusers-{version}"


def locate_source(given: Path | None, version: str) -> Path:
    """The diffusers source whose ``tests/`` the suite runs: ``--diffusers-src``, the cached clone,
    or a new clone of tag ``v<version>``."""
    if given is not None:
        src = given.expanduser().resolve()
        if not (src / TRANSFORMER_TESTS).is_dir():
            raise SetupError(f"--diffusers-src {src}: no {TRANSFORMER_TESTS}/ there; give a diffusers checkout")
        return src
    cached = cache_dir(version)
    if (cached / TRANSFORMER_TESTS).is_dir():
        return cached
    print(f"cloning {DIFFUSERS_URL} at v{version} (tests/ only) into {cached}", flush=True)
    try:
        clone(version, cached)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SetupError(
            f"no diffusers source to take the tests from: cloning {DIFFUSERS_URL} at v{version} failed ({exc}).\n"
            f"Pass --diffusers-src DIR, a diffusers checkout at v{version} (only its tests/ folder is used)."
        ) from exc
    return cached


def clone(version: str, dest: Path) -> None:
    """A shallow, sparse clone of tag ``v<version>`` with only ``tests/`` (and top-level files)."""
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    clone_args = ["--quiet", "--depth", "1", "--branch", f"v{version}", "--filter=blob:none", "--sparse"]
    steps = [
        ["git", "-c", "advice.detachedHead=false", "clone", *clone_args, DIFFUSERS_URL, str(partial)],
        ["git", "-C", str(partial), "sparse-checkout", "set", "tests"],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, check=False, env=env, capture_output=True, text=True, timeout=CLONE_TIMEOUT_S)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise subprocess.SubprocessError(f"`{' '.join(step[:4])} ...` exited {done.returncode}: {last}")
        partial.rename(dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def source_version(src: Path) -> str | None:
    """The diffusers version a source tree declares (``src/diffusers/__init__.py`` or ``setup.py``)."""
    for relative, pattern in (
        ("src/diffusers/__init__.py", r"__version__\s*=\s*[\"']([^\"']+)"),
        ("setup.py", r"\bversion\s*=\s*[\"']([^\"']+)"),
    ):
        path = src / relative
        if path.is_file():
            match = re.search(pattern, path.read_text(errors="replace"))
            if match:
                return match.group(1)
    return None


def find_test_file(src: Path, target: Target) -> Path | None:
    """The target's test file: a known name, else the first transformer test naming its class."""
    folder = src / TRANSFORMER_TESTS
    for name in target.file_names:
        if (folder / name).is_file():
            return folder / name
    word = re.compile(rf"\b{re.escape(target.model_class)}\b")
    for path in sorted(folder.glob("test_*.py")):
        if word.search(path.read_text(errors="replace")):
            return path
    return None


# ---------------------------------------------------------------------- this checkout
def tessera_revision() -> dict[str, Any]:
    """The commit of this checkout and a hash of its uncommitted changes to the runtime sources."""
    paths = ["processors", "tessera_diffusers"]

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], check=False, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else ""

    diff = git("diff", "HEAD", "--", *paths)
    return {
        "commit": git("rev-parse", "HEAD").strip() or None,
        "uncommitted_files": [line[3:] for line in git("status", "--porcelain", "--", *paths).splitlines()],
        "uncommitted_diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None,
    }


# ---------------------------------------------------------------------- pytest runs
def run_pytest(src: Path, test_file: Path, mode: str, out: Path, keyword: str | None, timeout: float) -> Run:
    """One pytest process for ``mode`` on ``test_file``; its log, JUnit XML and processor stats
    go under ``out``."""
    stem = test_file.stem
    log, junit, stats = (
        out / "logs" / f"{mode}-{stem}.log",
        out / "junit" / f"{mode}-{stem}.xml",
        out / "stats" / f"{mode}-{stem}.json",
    )
    for path in (log, junit, stats):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
    relative = test_file.relative_to(src)
    command = [sys.executable, "-m", "pytest", str(relative), "-q", "-rfE", "-p", "no:cacheprovider"]
    command += ["-p", PLUGIN, "--tessera", mode, f"--tessera-stats={stats}"]
    command += [f"--junitxml={junit}", f"--rootdir={src}"]
    if keyword:
        command += ["-k", keyword]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SUITE_DIR.parent), env.get("PYTHONPATH")) if p)
    run = Run(mode, test_file.name, log=str(log), junit=str(junit))
    start = time.monotonic()
    with log.open("w") as sink:
        sink.write("$ " + " ".join(command) + f"\n(cwd {src})\n\n")
        sink.flush()
        try:
            run.returncode = subprocess.run(
                command, check=False, cwd=src, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            run.problem = f"timed out after {timeout:.0f} s"
    run.duration_s = time.monotonic() - start
    if run.returncode not in (None, 0, 1, 5):  # 1: tests failed, 5: none collected (e.g. with -k)
        run.problem = f"pytest exited {run.returncode} (see {log})"
    if junit.is_file():
        module = ".".join(relative.with_suffix("").parts)
        run.outcomes = parse_junit(junit, test_file.name, module)
    elif run.problem is None:
        run.problem = f"pytest wrote no JUnit XML (see {log})"
    if stats.is_file():
        run.stats = json.loads(stats.read_text())
    return run


def parse_junit(path: Path, file_name: str, module: str) -> dict[str, Outcome]:
    """Test id (``file::Class::test``) -> outcome; a test reported twice keeps the worse outcome."""
    results: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if classname == module:
            classname = ""
        elif classname.startswith(module + "."):
            classname = classname[len(module) + 1 :]
        test_id = "::".join(part for part in (file_name, classname, name) if part)
        outcome = case_outcome(case)
        previous = results.get(test_id)
        if previous is None or SEVERITY[outcome.outcome] > SEVERITY[previous.outcome]:
            results[test_id] = outcome
    return results


def case_outcome(case: ET.Element) -> Outcome:
    for tag, outcome in (("failure", "failed"), ("error", "error")):
        element = case.find(tag)
        if element is not None:
            return Outcome(outcome, element.get("message", ""), element.text or "")
    skipped = case.find("skipped")
    if skipped is not None:
        kind = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        return Outcome(kind, skipped.get("message", ""))
    return Outcome("passed")


# ---------------------------------------------------------------------- comparison and report
def key_lines(details: str, errors: int = 4) -> list[str]:
    """The lines of a pytest failure report that say what went wrong: the first ``E`` lines, the
    first source location (where the test was) and the last one (where it raised)."""
    lines = details.splitlines()
    picked = [line[1:].strip() for line in lines if line.startswith("E ") and line[1:].strip()][:errors]
    locations = [line.strip() for line in lines if re.match(r"^\S+\.py:\d+: ", line)]
    picked += locations[:1] + locations[-1:] if len(locations) > 1 else locations
    return picked or [line for line in lines if line.strip()][-errors:]


def differences(runs: list[Run]) -> dict[str, list[dict[str, Any]]]:
    """Per mode other than ``off``: the tests whose outcome differs from ``off``."""
    by_mode: dict[str, dict[str, Outcome]] = {mode: {} for mode in MODES}
    for run in runs:
        by_mode[run.mode].update(run.outcomes)
    result: dict[str, list[dict[str, Any]]] = {}
    for mode in MODES[1:]:
        rows = []
        for test_id in sorted(set(by_mode["off"]) | set(by_mode[mode])):
            base, other = by_mode["off"].get(test_id), by_mode[mode].get(test_id)
            base_outcome = base.outcome if base else "missing"
            other_outcome = other.outcome if other else "missing"
            if base_outcome == other_outcome:
                continue
            changed = other if other is not None and other.outcome != "passed" else base
            rows.append(
                {
                    "test": test_id,
                    "off": base_outcome,
                    mode: other_outcome,
                    "message": changed.message if changed else "",
                    "key_lines": key_lines(changed.details) if changed else [],
                    "details": changed.details if changed else "",
                }
            )
        result[mode] = rows
    return result


def density_text(stats: dict[str, Any] | None) -> str:
    if not stats or not stats.get("classes"):
        return "-"
    parts = []
    for class_name, entry in stats["classes"].items():
        density = entry.get("mean_mask_density")
        shown = "no masks" if density is None else f"density {density:.3f}"
        parts.append(
            f"{class_name}: {entry['models']} models, {entry['sparse_calls']} sparse / {entry['dense_calls']} dense "
            f"calls, {entry['masks_computed']} masks, {shown}"
        )
    return "; ".join(parts)


def imported_text(runs: list[Run]) -> str:
    """The diffusers the pytest processes imported (normally the installed one)."""
    seen = {
        f"{d['version']} from {d['path']}"
        for run in runs
        if run.stats and (d := run.stats.get("diffusers")) is not None
    }
    return "; ".join(sorted(seen)) or "unknown"


def header_lines(meta: dict[str, Any], runs: list[Run]) -> list[str]:
    """What was tested: diffusers (installed, imported, the tests' source), this checkout, versions."""
    source, tessera = meta["source"], meta["tessera"]
    processors = sorted(
        {run.stats["processors_module"] for run in runs if run.stats and "processors_module" in run.stats}
    )
    checkout = f"- tessera-diffusers checkout: {tessera['commit']}"
    if tessera["uncommitted_diff_sha256"]:
        checkout += f" with uncommitted runtime changes (diff sha256 {tessera['uncommitted_diff_sha256']})"
    lines = [
        f"- diffusers installed: {meta['diffusers_version']}; imported by the tests: {imported_text(runs)}",
        f"- tests from {source['path']} (declares diffusers {source['version'] or '?'}): {', '.join(source['files'])}",
        checkout,
        f"- TesseraProcessor imported from: {', '.join(processors) or 'unknown'}",
        f"- python {meta['python']}, torch {meta['torch']}",
    ]
    if meta["keyword"]:
        lines.append(f"- pytest -k {meta['keyword']!r}")
    return lines


def write_reports(out: Path, meta: dict[str, Any], runs: list[Run], diffs: dict[str, list[dict[str, Any]]]) -> None:
    data = {
        **meta,
        "runs": [{**{k: v for k, v in asdict(run).items() if k != "outcomes"}, "counts": run.counts()} for run in runs],
        "outcomes": {
            mode: {tid: o.outcome for run in runs if run.mode == mode for tid, o in run.outcomes.items()}
            for mode in MODES
        },
        "differences": diffs,
        "identical": not any(diffs.values()) and not any(run.problem for run in runs),
    }
    (out / "diffusers_tests.json").write_text(json.dumps(data, indent=2) + "\n")

    md = [
        "# diffusers' transformer tests with Tessera",
        "",
        *header_lines(meta, runs),
        "",
        "| mode | file | passed | failed | skipped | xfailed | errors | time (s) | Tessera |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        c = run.counts()
        extra = run.problem or density_text(run.stats)
        md.append(
            f"| {run.mode} | {run.file} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['xfailed']} | "
            f"{c['error']} | {run.duration_s:.1f} | {extra} |"
        )
    for target in meta["missing_targets"]:
        md += ["", f"No test file for `{target}` in {meta['source']['path']}/{TRANSFORMER_TESTS}."]
    md += ["", "## Outcomes that differ from `off`", ""]
    for mode, rows in diffs.items():
        md.append(f"### {mode}: {len(rows)} test(s)")
        md.append("")
        for row in rows:
            md.append(f"- `{row['test']}`: off **{row['off']}**, {mode} **{row[mode]}**")
            if row["key_lines"]:
                md.append("")
                md.append("  ```")
                md += [f"  {line}" for line in row["key_lines"]]
                md.append("  ```")
        md.append("")
    (out / "diffusers_tests.md").write_text("\n".join(md) + "\n")


def print_table(runs: list[Run], diffs: dict[str, list[dict[str, Any]]]) -> None:
    header = (
        f"{'mode':<8} {'file':<42} {'passed':>6} {'failed':>6} {'skipped':>7} {'xfailed':>7} {'errors':>6} {'time':>7}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for run in runs:
        c = run.counts()
        print(
            f"{run.mode:<8} {run.file:<42} {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} {c['xfailed']:>7} "
            f"{c['error']:>6} {run.duration_s:>6.1f}s" + (f"  {run.problem}" if run.problem else "")
        )
    print()
    for run in runs:
        if run.mode != "off" and run.stats:
            print(f"tessera {run.mode:<8} {run.file}: {density_text(run.stats)}")
    for mode, rows in diffs.items():
        print(f"\n{mode}: {len(rows)} test(s) differ from off")
        for row in rows:
            message = (row["message"].splitlines() or [""])[0]
            print(f"  {row['test']}: {row['off']} -> {row[mode]}  {message[:200]}")


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--diffusers-src", type=Path, help="a diffusers checkout whose tests/ matches the installed diffusers"
    )
    parser.add_argument("--out", type=Path, help="folder for the reports and logs (default: a new temporary folder)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, passed to every run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per pytest run (default 1800)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    version = importlib.metadata.version("diffusers")
    try:
        src = locate_source(args.diffusers_src, version)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    declared = source_version(src)
    if declared is not None and declared != version:
        print(f"warning: the tests at {src} declare diffusers {declared}; diffusers {version} is installed", flush=True)

    files, missing = [], []
    for target in TARGETS:
        path = find_test_file(src, target)
        if path is None:
            print(f"warning: no test file for {target.model_class} in {src / TRANSFORMER_TESTS}", flush=True)
            missing.append(target.model_class)
        else:
            files.append(path)
    if not files:
        print(f"error: no transformer test file found in {src / TRANSFORMER_TESTS}", file=sys.stderr)
        return 2

    out = (args.out or Path(tempfile.mkdtemp(prefix="tessera-diffusers-tests-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"diffusers {version}, tests from {src}\nreports and logs: {out}", flush=True)

    import torch  # only for the report header; after the source checks so that errors come fast

    meta = {
        "diffusers_version": version,
        "source": {"path": str(src), "version": declared, "files": [str(f.relative_to(src)) for f in files]},
        "missing_targets": missing,
        "tessera": tessera_revision(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "keyword": args.keyword,
        "modes": list(MODES),
    }
    runs: list[Run] = []
    total = len(MODES) * len(files)
    started = time.monotonic()
    for mode in MODES:
        for test_file in files:
            print(f"[{len(runs) + 1}/{total}] --tessera {mode:<7} {test_file.name} ...", end=" ", flush=True)
            run = run_pytest(src, test_file, mode, out, args.keyword, args.timeout)
            runs.append(run)
            summary = ", ".join(f"{n} {k}" for k, n in run.counts().items() if n)
            print(
                f"{summary or 'no tests'} ({run.duration_s:.1f} s)" + (f"  {run.problem}" if run.problem else ""),
                flush=True,
            )

    diffs = differences(runs)
    write_reports(out, meta, runs, diffs)
    print_table(runs, diffs)
    print(f"\ndiffusers imported by the tests: {imported_text(runs)}")
    print(
        f"wall time {time.monotonic() - started:.1f} s; reports: {out / 'diffusers_tests.md'}, {out / 'diffusers_tests.json'}"
    )
    if any(run.problem for run in runs):
        return 2
    return 1 if any(diffs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
