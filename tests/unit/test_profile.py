"""The profiler on the CPU: the smoke run end to end through the CLI (executor plans validated and
timed, records, resume, table built and used), an injected timing function, the time budget, the
early abandon of hopeless plans, and plans failing their oracle check."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
import torch

from tessera_diffusers import build_mask_state
from tessera_diffusers.bench.config import MODEL_SIZES
from tessera_diffusers.bench.timing import INTERLEAVED_WARM_LAUNCHES, Timing
from tessera_diffusers.corpus import DEFAULTS_FAMILIES, CaseSpec
from tessera_diffusers.errors import InvalidArgumentError
from tessera_diffusers.plan_table import load_plan_table, shipped_table_path, tile_group
from tessera_diffusers.plans import Request
from tessera_diffusers.profile import cli
from tessera_diffusers.profile import runner as runner_module
from tessera_diffusers.profile.compile import compile_table, load_profile
from tessera_diffusers.profile.config import ProfileConfig, smoke_config
from tessera_diffusers.profile.records import RECORDS_FILE, read_records, timing_method
from tessera_diffusers.profile.runner import KernelTimer, Measured, Trial, run_profile
from tessera_diffusers.selector import Selector

TINY = ["--smoke", "--no-progress", "--families", "Q64K64", "--sources", "sliding_tile,temporal_heads"]


def records(out) -> list[dict]:
    return list(read_records([out / RECORDS_FILE]))


def test_smoke_profile_builds_a_table_the_selector_uses(tmp_path):
    out = tmp_path / "p"
    assert cli.main(TINY + ["--out", str(out)]) == 0
    recs = records(out)
    cases = [r for r in recs if r["type"] == "case"]
    plans = [r for r in recs if r["type"] == "plan"]
    assert len(cases) == 2 and {c["source"] for c in cases} == {"sliding_tile", "temporal_heads"}
    assert len(plans) == 2 * 4  # direct and coarsened KV tiles, each with and without a 2-way split
    for r in plans:
        assert r["status"] == "ok" and r["check"]["ok"] and r["latency_ms"] > 0
        assert r["timer"] == "host_monotonic"
    case = cases[0]
    assert case["key"] == "cpu/Q64K64/d64/bf16/bshd" and case["group"] == case["source"]
    assert set(case["stats"]) >= {"density", "run_coverage"} and case["request"]["heads"] == 2

    table = load_plan_table(out / "plan_table_cpu.json")
    assert "bh1-8/s1-4096" in (out / "compile_report.md").read_text()
    key = table.keys["cpu/Q64K64/d64/bf16/bshd"]
    (bucket,) = key.buckets.values()
    ranking = [r.plan for r in bucket.regimes[0].ranking]
    assert ranking[-1] == key.base_plan and set(ranking) <= {r["plan"] for r in plans}

    # The online selector takes the table's first plan for a CPU request of that key (two cases in
    # two CV groups: too few to judge another way of choosing), or a schedule rule's organization of it.
    mask = CaseSpec.from_dict(case["spec"]).build()
    chosen = Selector(table=table).select(Request(**case["request"]), build_mask_state(mask))
    (regime,) = bucket.regimes
    assert regime.choice == "ranking" and chosen is not None
    assert chosen.name == ranking[0] or tile_group(chosen) == tile_group(table.plans[ranking[0]])

    # The case record keeps the row-union ratios of the mask (the cost model's query-axis waste).
    assert case["row_unions"] == {str(r): v for r, v in build_mask_state(mask).row_union_ratios((2, 4, 8)).items()}
    assert all(v >= 1.0 for v in case["row_unions"].values())

    # Resuming measures nothing new.
    assert cli.main(TINY + ["--out", str(out), "--no-compile"]) == 0
    assert len([r for r in records(out) if r["type"] == "plan"]) == len(plans)


def injected(trial: Trial) -> Measured:
    """Coarsened KV tiles twice as fast, splits a little slower: a known answer."""
    ms = (1.0 if trial.plan.tile_kv > trial.plan.block_kv else 2.0) * (1.1 if trial.plan.tasks.num_splits > 1 else 1.0)
    return Measured(Timing((ms,), "injected"))


def test_injected_timing_drives_the_ranking(tmp_path):
    config = smoke_config(tmp_path, families=("Q32K16",), sources=("sliding_tile",), progress=False, interleave=False)
    summary = run_profile(config, measure=injected, log=lambda m: None)
    assert summary.cases_new == 1 and summary.stopped is None
    table, _ = compile_table(load_profile([tmp_path / RECORDS_FILE]))
    (bucket,) = table.keys["cpu/Q32K16/d64/bf16/bshd"].buckets.values()
    best = bucket.regimes[0].ranking[0]
    assert best.gm_ms == 1.0 and "k32_from_q32k16" in best.plan and "split" not in best.plan


def test_time_budget_stops_and_resume_continues(tmp_path):
    config = smoke_config(tmp_path, families=("Q64K64",), sources=("sliding_tile",), minutes=0.0, progress=False,
                          interleave=False)
    summary = run_profile(config, measure=injected, log=lambda m: None)
    assert summary.stopped == "time budget" and summary.cases_done == 0
    assert not [r for r in records(tmp_path) if r["type"] in ("plan", "case")]
    summary = run_profile(ProfileConfig(**{**config.__dict__, "minutes": None}), measure=injected, log=lambda m: None)
    assert summary.cases_done == 1 and summary.stopped is None


def test_hopeless_plans_keep_one_sample():
    calls = []
    trial = Trial(None, None, None, lambda i: (calls.append(i), time.sleep(0.003)), 2, torch.device("cpu"), 0.5)
    measured = KernelTimer(warmup=3, reps=5, abandon_factor=1.5)(trial)
    assert measured.abandoned and len(measured.timing.samples_ms) == 1 and len(calls) == 1
    trial = Trial(None, None, None, lambda i: calls.append(i), 2, torch.device("cpu"), None)
    measured = KernelTimer(warmup=3, reps=5, abandon_factor=1.5)(trial)
    assert not measured.abandoned and len(measured.timing.samples_ms) == 5 and len(calls) == 1 + 1 + 3 + 5


@pytest.fixture
def broken_splits(monkeypatch):
    """Plans with split-K give a wrong output (0.5 added), so the oracle check must reject them."""
    real_execute = runner_module.execute

    def execute(prepared, q, k, v, scale, return_lse):
        out = real_execute(prepared, q, k, v, scale, return_lse)
        return out + 0.5 if prepared.plan.tasks.num_splits > 1 else out

    monkeypatch.setattr(runner_module, "execute", execute)


def test_plans_that_fail_the_oracle_are_recorded_and_never_ranked(tmp_path, broken_splits):
    out = tmp_path / "p"
    assert cli.main(TINY + ["--out", str(out), "--max-cases", "1"]) == 1  # an invalid plan: exit status 1
    invalid = [r for r in records(out) if r.get("status") == "invalid"]
    assert len(invalid) == 2 and all("split2" in r["plan"] for r in invalid)
    assert "differs from the oracle" in invalid[0]["reason"]
    table = load_plan_table(out / "plan_table_cpu.json")
    assert not [name for name in table.plans if "split" in name]


def test_interleaved_profile_validates_then_times_every_plan(tmp_path, broken_splits):
    """The default (interleaved) profile: every valid plan of a case is timed (reps samples, marked
    interleaved, none abandoned), invalid plans are recorded as such and never timed, the table is
    built. --sequential times plan by plan; a per-plan timer with an interleaving config is refused."""
    out = tmp_path / "p"
    assert cli.main(TINY + ["--out", str(out), "--max-cases", "1", "--reps", "3"]) == 1
    plans = [r for r in records(out) if r.get("type") == "plan"]
    ok = [r for r in plans if r["status"] == "ok"]
    invalid = [r for r in plans if r["status"] == "invalid"]
    assert ok and all(r["interleaved"] and r["round_order"] == "shuffled" and not r["abandoned"]
                      and len(r["samples_ms"]) == 3 for r in ok)
    assert invalid and all("split2" in r["plan"] and "samples_ms" not in r for r in invalid)
    assert len(ok) + len(invalid) == len(plans)
    assert load_plan_table(out / "plan_table_cpu.json").plans
    sequential = tmp_path / "s"
    cli.main(TINY + ["--out", str(sequential), "--max-cases", "1", "--reps", "3", "--sequential"])
    assert not any(r.get("interleaved") for r in records(sequential) if r.get("status") == "ok")
    with pytest.raises(InvalidArgumentError, match="measure"):
        run_profile(smoke_config(tmp_path / "x", progress=False), measure=injected, log=lambda m: None)


def test_interleaved_profile_makes_room_when_memory_runs_out(tmp_path, monkeypatch):
    """Out of memory while validating the third plan: the two validated plans are timed and freed
    first, then the third is validated again; every plan ends timed, none failed."""
    real_validate = runner_module.validate_plan
    calls = []

    def validate(key, plan, *args):
        calls.append(plan.name)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_validate(key, plan, *args)

    monkeypatch.setattr(runner_module, "validate_plan", validate)
    config = smoke_config(tmp_path, families=("Q64K64",), sources=("sliding_tile",), max_cases=1, progress=False)
    run_profile(config, log=lambda m: None)
    plans = [r for r in records(tmp_path) if r.get("type") == "plan"]
    assert plans and all(r["status"] == "ok" and r["interleaved"] for r in plans)
    assert calls[2] == calls[3] and len(calls) == len(plans) + 1
    assert [r["plan"] for r in plans][:3] == [calls[0], calls[1], calls[2]]  # the first two were timed first


def test_resuming_with_another_timing_method_is_flagged(tmp_path):
    """A records file timed sequentially, resumed with the default interleaved timing: the run says
    the two are not comparable, and the compiler notes the mix in its report."""
    first = smoke_config(tmp_path, families=("Q64K64",), sources=("sliding_tile",), max_cases=1, progress=False,
                         interleave=False)
    run_profile(first, log=lambda m: None)
    logs: list[str] = []
    run_profile(ProfileConfig(**{**first.__dict__, "max_cases": 2, "interleave": True,
                                 "sources": ("sliding_tile", "temporal_heads")}), log=logs.append)
    assert any("sequential timings and this run times interleaved" in line for line in logs)
    methods = {r.get("interleaved", False) for r in records(tmp_path) if r.get("status") == "ok"}
    assert methods == {False, True}
    assert any("mix timing methods" in note for note in load_profile([tmp_path / RECORDS_FILE]).notes)


def test_profile_in_a_gemm_context(tmp_path, monkeypatch):
    """--context-gemm: a GEMM launched before every timed plan (warm-ups included), outside its timed
    span; the records say so, their timing method is its own, and resuming a records file of
    plain interleaved timings with it is flagged. Sequential timing refuses a context."""
    launches = []
    real = runner_module.gemm_context

    def counting(size, device):
        gemm = real(size, device)
        return lambda: launches.append(gemm())

    monkeypatch.setattr(runner_module, "gemm_context", counting)
    plain = smoke_config(tmp_path, families=("Q64K64",), sources=("sliding_tile",), max_cases=1, progress=False)
    run_profile(plain, log=lambda m: None)
    assert not launches
    logs: list[str] = []
    in_context = ProfileConfig(**{**plain.__dict__, "context_gemm": 32, "max_cases": 2,
                                  "sources": ("sliding_tile", "temporal_heads")})
    assert in_context.timing_method == "interleaved+gemm32"
    run_profile(in_context, log=logs.append)
    assert any("interleaved timings and this run times interleaved+gemm32" in line for line in logs)
    timed = [r for r in records(tmp_path) if r.get("status") == "ok"]
    second = [r for r in timed if "temporal_heads" in r["case"]]
    assert second and all(r["context"] == "gemm32" and timing_method(r) == "interleaved+gemm32" for r in second)
    assert all("context" not in r for r in timed if r not in second)
    rounds = max(plain.warmup, -(-INTERLEAVED_WARM_LAUNCHES // len(second)))
    assert len(launches) == len(second) * (rounds + plain.reps)  # one per launch of a timed plan
    with pytest.raises(InvalidArgumentError, match="context_gemm"):
        ProfileConfig(out_dir=".", interleave=False, context_gemm=64)


def test_profile_config_lists_cases_rank_major():
    config = ProfileConfig(out_dir=".", families=("Q64K64", "Q128K128"), sources=("sliding_tile", "text_sink"),
                           cases_per_combo=2)
    cases = config.cases()
    assert len(cases) == 8
    assert [c.family for _, c in cases[:4]] == ["Q64K64", "Q64K64", "Q128K128", "Q128K128"]
    assert all(c.split == "profiling" for _, c in cases)
    assert cases[0][1].seed != cases[4][1].seed and cases[0][1].source == cases[4][1].source
    with pytest.raises(Exception, match="sizes"):
        ProfileConfig(out_dir=".", sizes=("huge",))


def test_model_sizes_profile_the_defaults_masks_into_buckets_the_shipped_table_has():
    """The one-liner's sparse calls (both models, both resolutions, both Wan2.1 sizes) are profiled on
    their own model's masks only, and each lands in a bucket of the shipped sm90 table: a profiled
    regime, not the key's base plan."""
    config = ProfileConfig(out_dir=".", sizes=MODEL_SIZES, families=tuple(f.name for f in DEFAULTS_FAMILIES),
                           cases_per_combo=1)
    cases = config.cases()
    assert [(size, case.family) for size, case in cases] == [
        (size, "Q384K384-H" if size.startswith("hv") else "Q384K384-W") for size in MODEL_SIZES]
    assert {case.heads for _, case in cases} == {40, 12, 16}
    table = load_plan_table(shipped_table_path("sm90"))
    for size, case in cases:
        seq = case.grid.video_tokens
        request = Request(batch=1, heads=case.heads, seq_len_q=seq, seq_len_kv=seq, head_dim=128, dtype="bf16",
                          block_q=384, block_kv=384, arch="sm90", return_lse=False)
        lookup = table.lookup(request)
        assert lookup.bucket is not None and lookup.note == "regime lookup", f"{size}: {lookup.note}"


def test_a_device_error_stops_the_run_after_recording_it(tmp_path):
    from tessera_diffusers.errors import NativeKernelError

    def crash(trial: Trial) -> Measured:
        raise NativeKernelError("attention failed: CUDA error 700 (an illegal memory access was encountered)")

    config = smoke_config(tmp_path, families=("Q64K64",), sources=("sliding_tile",), progress=False, interleave=False)
    summary = run_profile(config, measure=crash, log=lambda m: None)
    assert summary.stopped.startswith("device error on") and summary.cases_done == 0
    (record,) = [r for r in records(tmp_path) if r["type"] == "plan"]
    assert record["status"] == "failed" and "illegal memory access" in record["reason"] and "spec" in record


def test_contenders_after_n_cases_prune_hopeless_plans(tmp_path):
    config = smoke_config(tmp_path, families=("Q64K64",), contenders_after=2, contender_regret=1.05, progress=False,
                          interleave=False)
    summary = run_profile(config, measure=injected, log=lambda m: None)
    assert summary.cases_done == 5
    cases = [r for r in records(tmp_path) if r["type"] == "case"]
    assert [c["pruned"] for c in cases] == [0, 0, 3, 3, 3]
    plans = [r for r in records(tmp_path) if r["type"] == "plan"]
    assert len(plans) == 2 * 4 + 3 * 1
    table, _ = compile_table(load_profile([tmp_path / RECORDS_FILE]))
    key = table.keys["cpu/Q64K64/d64/bf16/bshd"]
    (bucket,) = key.buckets.values()
    assert [r.plan for r in bucket.regimes[0].ranking] == [key.base_plan]
    assert "k128_from_q64k64" in key.base_plan and "split" not in key.base_plan


def test_evaluation_split_is_measured_but_never_compiled(tmp_path):
    """``--split evaluation`` profiles held-out seeds (other masks than the profiling split's) for
    selection regret; the compiler leaves those cases out and builds nothing from them alone."""
    prof, held = tmp_path / "prof", tmp_path / "eval"
    assert cli.main(TINY + ["--out", str(prof), "--no-compile", "--max-cases", "1"]) == 0
    assert cli.main(TINY + ["--out", str(held), "--split", "evaluation", "--max-cases", "1"]) == 0
    assert not (held / "plan_table_cpu.json").exists()
    (train,), (test,) = ([r for r in records(d) if r["type"] == "case"] for d in (prof, held))
    assert test["split"] == "evaluation" and train["split"] == "profiling"
    assert test["spec"]["seed"] != train["spec"]["seed"]
    assert cli.main(["--compile-only", "--out", str(held)]) == 1  # nothing to compile
    assert cli.main(["--compile-only", "--out", str(prof), "--records", str(prof / RECORDS_FILE),
                     str(held / RECORDS_FILE)]) == 0
    assert "left out 1 evaluation-split cases" in (prof / "compile_report.md").read_text()


def test_read_records_reads_gzipped_files_and_skips_torn_lines(tmp_path):
    lines = [json.dumps({"type": "case", "case": "a"}), "{not json", json.dumps({"type": "plan", "case": "a"})]
    plain, packed = tmp_path / "profile.jsonl", tmp_path / "kept.jsonl.gz"
    plain.write_text("\n".join(lines) + "\n")
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    skipped: list = []
    assert list(read_records([packed], skipped)) == list(read_records([plain])) == [json.loads(lines[0]), json.loads(lines[2])]
    assert skipped == ["{not json\n"]


def test_kernel_sources_of_the_profiled_library_reach_the_table(tmp_path, monkeypatch):
    """The library's kernel_sources hash goes into the run's catalog record, and from there into the
    table's provenance; records of two libraries built from different sources are flagged."""
    from tessera_diffusers.profile import runner

    monkeypatch.setattr(runner, "library_kernel_sources",
                        lambda cuda=True, part="kernel_sources": "src-one" if part == "kernel_sources" else None)
    config = smoke_config(tmp_path, families=("Q64K64",), sources=("sliding_tile",), max_cases=1, progress=False,
                          interleave=False)
    run_profile(config, measure=injected, log=lambda m: None)
    assert [r["kernel_sources"] for r in records(tmp_path) if r["type"] == "catalog"] == ["src-one"]
    profile = load_profile([tmp_path / RECORDS_FILE])
    assert profile.kernel_sources == ("src-one",)
    table, _ = compile_table(profile)
    assert table.provenance["kernel_sources"] == ["src-one"]
    assert table.sources_mismatch("src-one") is None

    monkeypatch.setattr(runner, "library_kernel_sources",
                        lambda cuda=True, part="kernel_sources": "src-two" if part == "kernel_sources" else None)
    run_profile(ProfileConfig(**{**config.__dict__, "max_cases": 2, "sources": ("sliding_tile", "temporal_heads")}),
                measure=injected, log=lambda m: None)
    profile = load_profile([tmp_path / RECORDS_FILE])
    assert profile.kernel_sources == ("src-one", "src-two")
    assert any("2 different sources" in note for note in profile.notes)
    table, _ = compile_table(profile)
    assert "part of plan table" in table.sources_mismatch("src-two")
    assert "may be stale" in table.sources_mismatch("src-three")


def test_grouping_sources_count_only_for_cases_that_timed_grouped_plans(tmp_path, monkeypatch):
    """The grouping kernel's hash reaches the table from the files whose kept cases timed a grouped
    plan, so a grouping change leaves natural keys fresh."""
    from tessera_diffusers.profile import runner

    hashes = {"kernel_sources": "att-1", "grouping_sources": "grp-1"}
    monkeypatch.setattr(runner, "library_kernel_sources", lambda cuda=True, part="kernel_sources": hashes[part])
    config = smoke_config(tmp_path, families=("Q32K16",), sources=("sliding_tile",), max_cases=1, progress=False,
                          interleave=False)
    run_profile(config, measure=injected, log=lambda m: None)
    natural = records(tmp_path)
    (catalog,) = [r for r in natural if r["type"] == "catalog"]
    assert (catalog["kernel_sources"], catalog["grouping_sources"]) == ("att-1", "grp-1")
    profile = load_profile([tmp_path / RECORDS_FILE])
    assert profile.kernel_sources == ("att-1",) and profile.grouping_sources == ()  # no grouped plan timed
    table, _ = compile_table(profile)
    assert "grouping_sources" not in table.provenance
    assert table.sources_mismatch("att-1", "grp-2") is None

    def write(name: str, recs: list[dict]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return path

    # The same key profiled again, one of its plans in the grouped layout, by another grouping kernel.
    grouped, renamed = [], {}
    for r in natural:
        r = json.loads(json.dumps(r))
        if r["type"] == "catalog":
            r["grouping_sources"] = "grp-2"
        if r["type"] == "plan" and "spec" in r and not renamed:
            renamed[r["plan"]] = "grouped-" + r["plan"]
            r["spec"]["q_layout"] = "grouped"
        if r["type"] == "plan" and r["plan"] in renamed:
            r["plan"] = renamed[r["plan"]]
        grouped.append(r)
    profile = load_profile([tmp_path / RECORDS_FILE, write("grouped.jsonl", grouped)])
    assert profile.kernel_sources == ("att-1",) and profile.grouping_sources == ("grp-2",)
    table, _ = compile_table(profile)
    assert table.provenance["grouping_sources"] == ["grp-2"]
    assert table.sources_mismatch("att-1", "grp-2") is None
    note = table.sources_mismatch("att-1", "grp-3")
    assert "grouping kernel" in note and "grp-2" in note and "re-profile" in note
    assert "grouping kernel" not in table.sources_mismatch("att-2", "grp-2")



def test_a_later_records_file_supersedes_a_key_bucket_whole(tmp_path):
    """Compiling [old, new]: a key and bucket the new file profiles takes its cases from it alone (its
    old cases, and their times, are set aside and the report says so); a key only the old file holds
    keeps them, and so does a bucket of the same key that the new file does not profile."""
    def split_wins(trial: Trial) -> Measured:  # the opposite answer to ``injected``
        return Measured(Timing((1.0 if trial.plan.tasks.num_splits > 1 else 3.0,), "injected"))

    old, new = tmp_path / "old", tmp_path / "new"
    run_profile(smoke_config(old, families=("Q32K16", "Q64K64"), sources=("sliding_tile", "temporal_heads"),
                             progress=False, interleave=False), measure=split_wins, log=lambda m: None)
    run_profile(smoke_config(new, families=("Q32K16",), sources=("sliding_tile",), progress=False, interleave=False),
                measure=injected, log=lambda m: None)
    profile = load_profile([old / RECORDS_FILE, new / RECORDS_FILE])
    by_key: dict[str, list] = {}
    for case in profile.cases:
        by_key.setdefault(case.request.key, []).append(case)
    assert len(by_key["cpu/Q32K16/d64/bf16/bshd"]) == 1 and len(by_key["cpu/Q64K64/d64/bf16/bshd"]) == 2
    (note,) = [n for n in profile.notes if "supersede" in n]
    assert note == (f"cpu/Q32K16/d64/bf16/bshd bh1-8/s1-4096: its 1 cases of new/{RECORDS_FILE} supersede the "
                    f"earlier profile (2 cases of old/{RECORDS_FILE})")
    table, _ = compile_table(profile)
    first = {key: next(iter(table.keys[key].buckets.values())).regimes[0].ranking[0].plan
             for key in ("cpu/Q32K16/d64/bf16/bshd", "cpu/Q64K64/d64/bf16/bshd")}
    assert "split" not in first["cpu/Q32K16/d64/bf16/bshd"]  # the new file's answer, unmixed with the old
    assert "split" in first["cpu/Q64K64/d64/bf16/bshd"]  # the old file's, for the key the new one lacks
    # The other order: the old file is now the later one for every key.
    assert all(len([c for c in load_profile([new / RECORDS_FILE, old / RECORDS_FILE]).cases
                    if c.request.key == key]) == 2 for key in first)
    # A third file profiles the same key at more heads (another bucket): both buckets keep their cases.
    more = tmp_path / "more"
    run_profile(smoke_config(more, families=("Q32K16",), sources=("sliding_tile",), heads=12, progress=False,
                             interleave=False), measure=injected, log=lambda m: None)
    profile = load_profile([old / RECORDS_FILE, new / RECORDS_FILE, more / RECORDS_FILE])
    heads = sorted(c.request.heads for c in profile.cases if c.request.key == "cpu/Q32K16/d64/bf16/bshd")
    assert heads == [2, 12]
    assert sorted(compile_table(profile)[0].keys["cpu/Q32K16/d64/bf16/bshd"].buckets) == [(0, 0), (1, 0)]
