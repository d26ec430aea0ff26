"""Run the processor tests under other diffusers releases, each in a throw-away virtual environment.

    python tests/integration/diffusers_versions.py                 # the oldest supported release and the newest
    python tests/integration/diffusers_versions.py 0.38.0 0.42.1   # any list of releases ("latest": the newest)

For each release: a venv in a temporary folder with ``--system-site-packages`` (torch and the rest
come from this interpreter's site-packages); ``pip install diffusers==X --no-deps`` into it (even where
the system has that release); then the base requirements of that release the environment does not
meet (``huggingface-hub<2`` for 0.41, also ``httpx`` for 0.36; never torch, which diffusers does not
require), and again, in releases that fit those, the system packages they leave unmet (transformers
newer than the old huggingface-hub). The venv imports this checkout's ``tessera_diffusers`` and ``processors/`` (mapped as
setup.py's ``package_dir`` does) whatever the editable install points at; that, and that diffusers
comes from the venv, is checked before ``python -m pytest -q -p no:cacheprovider <files>`` runs. One
result line per release; the exit status is non-zero when any release fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCESSOR_TESTS = (
    "tests/integration/test_processors.py",
    "tests/integration/test_one_liner.py",
    "tests/integration/test_processor_guards.py",
    "tests/integration/test_processors_pipelines.py",
    "tests/integration/test_processors_examples.py",
)
LATEST = "latest"

# Written into each venv: imports ``tessera_diffusers`` and ``tessera_diffusers.processors`` from this
# checkout (setup.py maps the processors package to the top-level ``processors/`` folder).
CHECKOUT_FINDER = '''"""Import tessera_diffusers from the checkout under test (from tests/integration/diffusers_versions.py)."""
import importlib.util
import os
import sys

ROOT = {root!r}
PACKAGES = {{
    "tessera_diffusers": os.path.join(ROOT, "tessera_diffusers"),
    "tessera_diffusers.processors": os.path.join(ROOT, "processors"),
}}


class CheckoutFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        folder = PACKAGES.get(name)
        if folder is None:
            return None
        init = os.path.join(folder, "__init__.py")
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])


sys.meta_path.insert(0, CheckoutFinder)
'''

# Run inside a venv: the base requirements of the installed diffusers that the environment does not meet.
UNMET_REQUIREMENTS = """
import json
from importlib.metadata import PackageNotFoundError, requires, version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
unmet = []
for line in requires("diffusers") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        if req.specifier.contains(version(req.name), prereleases=True):
            continue
    except PackageNotFoundError:
        pass
    unmet.append(str(req))
print(json.dumps(unmet))
"""

# Run inside a venv, given the requirements just installed (JSON on argv[1]): the other installed
# distributions that now miss one of them (a system package needing a newer huggingface-hub than the
# old diffusers allows, e.g. transformers), to be installed again within the venv's versions.
BROKEN_DEPENDENTS = """
import json, sys
from importlib.metadata import distributions, version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
changed = {Requirement(r).name.lower().replace("_", "-") for r in json.loads(sys.argv[1])}
broken = set()
for dist in distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name in changed or name == "diffusers":
        continue
    for line in dist.requires or []:
        req = Requirement(line)
        if req.name.lower().replace("_", "-") not in changed:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if not req.specifier.contains(version(req.name), prereleases=True):
            broken.add(dist.metadata["Name"])
print(json.dumps(sorted(broken)))
"""

# Run inside a venv: where diffusers and the checkout's packages are imported from.
IMPORT_ORIGINS = """
import json, diffusers, tessera_diffusers, tessera_diffusers.processors as processors
print(json.dumps({"diffusers": diffusers.__version__, "diffusers_file": diffusers.__file__,
                  "tessera": tessera_diffusers.__file__, "processors": processors.__file__}))
"""


@dataclass(frozen=True)
class Result:
    """The outcome of one release: ``ok`` and a one-line summary."""

    requested: str
    installed: str
    ok: bool
    summary: str
    setup_s: float
    test_s: float

    def line(self) -> str:
        status = "ok" if self.ok else "FAILED"
        name = self.installed or self.requested
        if self.requested == LATEST:
            name += f" ({LATEST})"
        return (
            f"diffusers {name}: {status}  {self.summary} "
            f"(setup {self.setup_s:.0f}s, tests {self.test_s:.0f}s)"
        )


class SetupError(Exception):
    """A venv could not be made ready for the tests (pip, or the import check)."""


def oldest_supported() -> str:
    """The lower bound of the diffusers dependency in pyproject.toml (``diffusers>=X``)."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"diffusers\s*>=\s*([0-9][0-9A-Za-z.]*)', text)
    if match is None:
        raise SystemExit("pyproject.toml: expected a dependency 'diffusers>=X'")
    return match.group(1)


def run(cmd: list[str], *, env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def checked(cmd: list[str], what: str, **kwargs) -> str:
    proc = run(cmd, **kwargs)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = [line[:300] for line in lines if not line.startswith("WARNING")][-4:]
        raise SetupError(f"{what} failed (exit {proc.returncode}): " + " | ".join(tail))
    return proc.stdout


def make_env(venv: Path, version: str, python: str) -> tuple[Path, dict]:
    """Create the venv, install diffusers ``version`` and its unmet requirements, point it at this checkout."""
    checked([python, "-m", "venv", "--system-site-packages", str(venv)], "python -m venv")
    vpython = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    spec = "diffusers" if version == LATEST else f"diffusers=={version}"
    pip = [str(vpython), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # --ignore-installed: into the venv even when the system's diffusers is that release (or the newest)
    checked(pip + ["--no-deps", "--ignore-installed", spec], f"pip install --no-deps {spec}")
    unmet = json.loads(checked([str(vpython), "-c", UNMET_REQUIREMENTS], "reading diffusers' requirements"))
    if unmet:
        checked(pip + unmet, "pip install " + " ".join(unmet))
        broken = json.loads(checked([str(vpython), "-c", BROKEN_DEPENDENTS, json.dumps(unmet)],
                                    "finding packages the older requirements break"))
        if broken:  # pip picks releases of them that fit diffusers' requirements
            checked(pip + broken + unmet, "pip install " + " ".join(broken + unmet))
    purelib = checked([str(vpython), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "sysconfig")
    site = Path(purelib.strip())
    (site / "_tessera_checkout.py").write_text(CHECKOUT_FINDER.format(root=str(ROOT)))
    (site / "_tessera_checkout.pth").write_text("import _tessera_checkout\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTHONHOME", None)
    return vpython, env


def check_origins(vpython: Path, env: dict, venv: Path, version: str) -> str:
    """The installed diffusers version, after checking it and the checkout's packages are the ones imported."""
    output = checked([str(vpython), "-c", IMPORT_ORIGINS], "importing the packages", env=env)
    origins = json.loads(output.splitlines()[-1])
    problems = []
    if not Path(origins["diffusers_file"]).resolve().is_relative_to(venv.resolve()):
        problems.append(f"diffusers imported from {origins['diffusers_file']}, not the venv")
    if version != LATEST and origins["diffusers"] != version:
        problems.append(f"diffusers {origins['diffusers']} imported, {version} asked for")
    for key, folder in (("tessera", ROOT / "tessera_diffusers"), ("processors", ROOT / "processors")):
        if not Path(origins[key]).resolve().is_relative_to(folder):
            problems.append(f"{key} imported from {origins[key]}, not from {folder}")
    if problems:
        raise SetupError("; ".join(problems))
    return origins["diffusers"]


def pytest_summary(output: str) -> str:
    """The final ``N passed, M failed in Xs`` line of a pytest run (without its ``=`` padding)."""
    for line in reversed(output.strip().splitlines()):
        if re.search(r"\b(passed|failed|error|errors|no tests ran)\b", line):
            return line.strip("= ").strip()
    return "no pytest summary"


def check_release(version: str, files: list[str], pytest_args: list[str], python: str, keep: bool) -> Result:
    """Set up a venv for diffusers ``version`` and run the processor tests there."""
    folder = Path(tempfile.mkdtemp(prefix=f"tessera-diffusers-{version}-"))
    start = time.perf_counter()
    installed = ""
    try:
        venv = folder / "venv"
        vpython, env = make_env(venv, version, python)
        installed = check_origins(vpython, env, venv, version)
        setup_s = time.perf_counter() - start
        cmd = [str(vpython), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, *files]
        proc = run(cmd, env=env)
        test_s = time.perf_counter() - start - setup_s
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
            print("\n".join(failed[:30]) or output[-3000:], file=sys.stderr)
        return Result(version, installed, proc.returncode == 0, pytest_summary(output), setup_s, test_s)
    except (SetupError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
        return Result(version, installed, False, f"setup: {error}", time.perf_counter() - start, 0.0)
    finally:
        if keep:
            print(f"kept {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "versions", nargs="*", help=f"diffusers releases (default: the oldest supported and {LATEST!r}, the newest)"
    )
    parser.add_argument(
        "--files", nargs="+", default=list(PROCESSOR_TESTS), help="test files (default: the processor tests)"
    )
    parser.add_argument("--pytest-arg", action="append", default=[], help="an extra pytest argument (repeatable)")
    parser.add_argument("--python", default=sys.executable, help="interpreter the venvs are made from")
    parser.add_argument("--keep", action="store_true", help="keep the temporary venvs")
    args = parser.parse_args(argv)
    versions = args.versions or [oldest_supported(), LATEST]
    results = []
    for version in versions:
        result = check_release(version, args.files, args.pytest_arg, args.python, args.keep)
        print(result.line(), flush=True)
        results.append(result)
    return 0 if all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
