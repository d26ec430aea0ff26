"""Run pytest tests so that a test that hangs costs a timeout, not the whole device call.

A kernel that deadlocks never returns to the host: under plain pytest the run stops there, and the
tests after it never run. Here the tests are collected first and run in a child pytest process in
collection order; when the child reports no test for ``--timeout`` seconds, it is killed, the test
it was running is recorded as ``HANG``, and a new child runs the tests after it. Each child pays
the process start and CUDA initialization again, so the timeout should exceed the slowest test.

    python benchmarks/isolated_tests.py --timeout 60 --log OUT/tests.log -- -m gpu tests/test_native_gpu.py

Prints one line per test that did not pass (and per hang), then the counts; writes every child's
output to ``--log``. Exit status 0 when every test passed or was skipped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import subprocess
import sys
import time
from collections import Counter

OUTCOMES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")
RESULT = re.compile(r"^(\S.*::.*?) (" + "|".join(OUTCOMES) + r")(\s|$)")


# Node ids relative to the file system's root, so that a child runs them from there whatever the
# rootdir of the collection would have been; the children keep this process's directory importable
# (as `python -m pytest` run here would). The runner imports nothing of the package it tests (it
# must report a package that fails to import), so it does not use testing.with_pythonpath_first.
ROOT = os.path.abspath(os.sep)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    return env


def collect(pytest_args: list[str], python: str) -> list[str]:
    """The node ids pytest would run, in its order (relative to ``ROOT``)."""
    done = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           f"--rootdir={ROOT}", *pytest_args], capture_output=True, text=True)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if done.returncode not in (0, 5) or (not ids and done.returncode != 5):
        raise SystemExit(f"collection failed (rc {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


def run_child(ids: list[str], options: list[str], python: str, timeout: float, log) -> tuple[dict[str, str], bool]:
    """Run ``ids`` in one child pytest. Returns the outcome of each reported test, and whether the
    child stopped answering (then it was killed)."""
    command = [python, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--no-header", "-o", "console_output_style=classic",
               f"--rootdir={ROOT}", *options, *ids]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env())
    fd = child.stdout.fileno()
    outcomes: dict[str, str] = {}
    last, pending = time.monotonic(), b""
    while True:
        # Raw reads: pytest -v writes a test's id before running it and ends the line only after.
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                child.wait()
                log.write(pending.decode(errors="replace"))
                return outcomes, False
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                log.write(line + "\n")
                m = RESULT.match(line)
                if m and m.group(1) not in outcomes:
                    outcomes[m.group(1)] = m.group(2)
                    last = time.monotonic()
        elif time.monotonic() - last > timeout:
            child.kill()
            child.wait()
            log.write(pending.decode(errors="replace") + "\n")
            return outcomes, True


def run_isolated(ids: list[str], options: list[str], python: str, timeout: float, log) -> dict[str, str]:
    """Every test of ``ids`` once; a hang is recorded and the run resumes after it."""
    results: dict[str, str] = {}
    remaining = list(ids)
    while remaining:
        outcomes, hung = run_child(remaining, options, python, timeout, log)
        results.update(outcomes)
        if hung:
            stuck = next((i for i in remaining if i not in results), None)
            if stuck is None:  # every test reported, then the child hung on its way out
                log.write(f"=== the child stopped answering after its last test ({timeout:g} s), killed\n")
                break
            results[stuck] = "HANG"
            log.write(f"=== {stuck}: no result for {timeout:g} s, killed\n")
        left = [i for i in remaining if i not in results]
        if left and not hung:  # the child ended without reporting them (it crashed)
            results[left[0]] = "CRASHED"
            left = left[1:]
        remaining = left
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        own, pytest_args = argv[:cut], argv[cut + 1:]
    else:
        own, pytest_args = argv, []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without a test result before a kill")
    parser.add_argument("--log", default=os.devnull, help="file for every child's output")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(own)
    # Options (with a value where the option takes one) go to every child; paths are replaced by ids.
    options, takes_value = [], {"-m", "-k", "-p", "-o", "-W", "--maxfail", "--rootdir", "-c"}
    i = 0
    while i < len(pytest_args):
        a = pytest_args[i]
        if a.startswith("-"):
            options.append(a)
            if a in takes_value and i + 1 < len(pytest_args):
                options.append(pytest_args[i + 1])
                i += 1
        i += 1
    ids = collect(pytest_args, args.python)
    with open(args.log, "w") as log:
        results = run_isolated(ids, [o for o in options if o not in ("-x", "--exitfirst")], args.python, args.timeout,
                               log)
    for node, outcome in results.items():
        if outcome not in ("PASSED", "SKIPPED", "XFAIL"):
            print(f"{outcome} {node}")
    counts = Counter(results.values())
    print(", ".join(f"{n} {o.lower()}" for o, n in sorted(counts.items())) or "no tests")
    return 0 if set(counts) <= {"PASSED", "SKIPPED", "XFAIL"} else 1


if __name__ == "__main__":
    sys.exit(main())
