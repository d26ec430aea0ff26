"""The profiler's records: one JSON line per measured (case, plan), one per finished case.

``profile.jsonl`` is appended to as measurements are made, so a run cut short (time budget, crash,
a killed machine) keeps everything it measured, and the next run skips what is done:

    {"type": "plan", "case": "<size>:<case name>:<dtype>:d<head dim>:b<batch>", "plan": <name>,
     "spec": <plan dict, on the first record of each plan only>,
     "status": "ok" | "invalid" | "failed", "latency_ms": <median>, "samples_ms": [...],
     "abandoned": <bool>, "timer": "cuda_events" | "host_monotonic" | <injected>, "check": {...}, "reason": ...}
    {"type": "case", "case": ..., "size": ..., "spec": <CaseSpec dict>, "family": ..., "source": ...,
     "group": <CV group>, "request": <Request dict>, "key": <request key>, "stats": {<stat>: value},
     "row_unions": {"2" | "4" | "8": <MaskState.row_union_ratios of that many block rows>},
     "arch": ..., "catalog_hash": ..., "plans": <eligible plan count>, "rejected": {<plan>: <reason>},
     "pruned": <plans not timed: not contenders, see ProfileConfig.contenders_after>, "device": ..., "torch": ...}
    {"type": "catalog", "catalog_hash": ..., "kernels": [<KernelSpec dict>],    (once per run)
     "kernel_sources": <the library's attention-kernel source hash>, "grouping_sources": <its grouping kernel's>}

A case record is written only after every plan of the case has a record: the table compiler uses
complete cases only.
"""

from __future__ import annotations

import gzip
import json
import lzma
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..plans import Request

RECORDS_FILE = "profile.jsonl"
RECORD_VERSION = 1


def request_to_dict(request: Request) -> dict:
    return asdict(request)


def request_from_dict(data: dict) -> Request:
    return Request(**{k: data[k] for k in Request.__dataclass_fields__ if k in data})


@dataclass
class Progress:
    """What a records file already holds (explicit state of a resumed run)."""

    done_plans: set = field(default_factory=set)  # (case key, plan name)
    done_cases: set = field(default_factory=set)  # case keys with a case record
    best_ms: dict = field(default_factory=dict)  # case key -> fastest valid median so far
    specs: set = field(default_factory=set)  # plan names whose spec the file already holds
    latencies: dict = field(default_factory=dict)  # case key -> {plan: median ms} of valid plans
    groups: dict = field(default_factory=dict)  # "<size>|<request key>" -> complete case keys
    catalogs: set = field(default_factory=set)  # catalog hashes of the runs that wrote the file
    methods: set = field(default_factory=set)  # timing methods of its timed plans ("interleaved", "sequential")
    bad_lines: int = 0

    def record_ok(self, case: str, plan: str, ms: float) -> None:
        self.latencies.setdefault(case, {})[plan] = ms
        self.best_ms[case] = min(ms, self.best_ms.get(case, ms))

    def contenders(self, group: str, regret: float) -> tuple[set, set]:
        """Plans within ``regret`` of the best on some complete case of ``group``, and every plan
        measured on one of them."""
        contenders, seen = set(), set()
        for case in self.groups.get(group, ()):
            lat = self.latencies.get(case, {})
            seen.update(lat)
            if lat:
                best = min(lat.values())
                contenders.update(p for p, ms in lat.items() if ms <= regret * best)
        return contenders, seen


def open_text(path: Path):
    """``path`` for reading text, through gzip or xz where its name says so."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt")
    if path.suffix == ".xz":
        return lzma.open(path, "rt")
    return open(path)


def read_records(paths: Iterable[str | Path], skipped: list | None = None) -> Iterator[dict]:
    """Every record of the given files (compressed where the name ends in ``.gz`` or ``.xz``). A line
    that is not JSON (a run killed mid-write) is skipped and counted in ``skipped`` when given."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            continue
        with open_text(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    if skipped is not None:
                        skipped.append(line[:80])
                    continue
                if isinstance(record, dict):
                    yield record


def load_progress(path: Path) -> Progress:
    progress = Progress()
    skipped: list = []
    for record in read_records([path], skipped):
        case = record.get("case")
        if record.get("type") == "plan":
            progress.done_plans.add((case, record.get("plan")))
            if "spec" in record:
                progress.specs.add(record.get("plan"))
            if record.get("status") == "ok":
                progress.record_ok(case, record.get("plan"), float(record["latency_ms"]))
                progress.methods.add(timing_method(record))
        elif record.get("type") == "catalog":
            progress.catalogs.add(record.get("catalog_hash"))
        elif record.get("type") == "case":
            progress.done_cases.add(case)
            progress.groups.setdefault(f"{record.get('size')}|{record.get('key')}", []).append(case)
    progress.bad_lines = len(skipped)
    return progress


def method_name(interleaved: bool, context: str | None) -> str:
    """"interleaved" or "sequential", with "+<context>" when plans were timed in one."""
    base = "interleaved" if interleaved else "sequential"
    return f"{base}+{context}" if context else base


def timing_method(record: dict) -> str:
    """How a timed plan record was measured: "interleaved" (a case's plans in turn, the GPU kept
    busy) or "sequential" (each plan right after its own validation, the only method before
    2026-11-30), with "+gemm<n>" where a GEMM ran before every timed launch
    (``ProfileConfig.context_gemm``). Times of different methods are not comparable."""
    return method_name(bool(record.get("interleaved")), record.get("context"))


def append_record(path: Path, record: dict) -> None:
    """One line, flushed at once (a later crash loses nothing written before it)."""
    record = {"version": RECORD_VERSION, **record}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
