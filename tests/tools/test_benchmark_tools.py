"""The benchmark tools on the CPU: the dispatch micro-benchmark (selection step only, synthetic
compiler-built table), the selection-regret report's reading of profile records, the ptxas and
SASS reports, and the sanitizer driver's case list."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"tessera_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dispatch_overhead_reports_percentiles(tmp_path):
    out = tmp_path / "dispatch.json"
    load("dispatch_overhead").main(["--iters", "300", "--warmup", "20", "--masks", "8", "--seq", "8192",
                                    "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"regime hit", "new regime", "new request", "cost model"}
    for row in rows.values():
        assert 0 < row["p50_us"] <= row["p95_us"] <= row["p99_us"]
    assert rows["regime hit"]["p50_us"] < rows["cost model"]["p50_us"]  # the cache skips the ranking


def test_selection_regret_reads_profile_records_and_their_abandoned_plans():
    """Profile records: only complete cases (with a case record) count, failed plans are dropped,
    and plans kept at one abandoned sample are listed so the report can mark them."""
    case = {"type": "case", "case": "c1", "spec": {}, "request": {}}
    plans = [
        {"type": "plan", "case": "c1", "plan": "fast", "status": "ok", "latency_ms": 1.0, "abandoned": False},
        {"type": "plan", "case": "c1", "plan": "slow", "status": "ok", "latency_ms": 1.6, "abandoned": True},
        {"type": "plan", "case": "c1", "plan": "broken", "status": "failed", "latency_ms": None},
        {"type": "plan", "case": "c2", "plan": "fast", "status": "ok", "latency_ms": 2.0},  # no case record
    ]
    report = load("selection_regret")
    cases = report.profile_cases([case, *plans])
    assert set(cases) == {"c1"}
    assert cases["c1"]["plans"] == {"fast": 1.0, "slow": 1.6}
    assert cases["c1"]["abandoned"] == {"slow"}
    assert report.timing_methods(cases) == {"sequential"}
    plans[0]["interleaved"] = True
    assert report.timing_methods(report.profile_cases([case, *plans])) == {"sequential", "interleaved"}


def test_selection_regret_first_call_view_keeps_the_natural_plans_only():
    report = load("selection_regret")
    natural, grouped = "direct_q64k64_from_q64k64_x_s2w4_lpt", "grouped-packed_q128k128_from_q64k64_x_s2w8_lpt"
    run = {"c1": {"record": {}, "plans": {natural: 1.2, grouped: 1.0}, "abandoned": {grouped},
                  "samples": {natural: [1.2, 1.3], grouped: [1.0, 1.1]}},
           "c2": {"record": {}, "plans": {grouped: 2.0}, "abandoned": set(), "samples": {}}}
    view = report.first_call_view(run)
    assert set(view) == {"c1"}  # a case with no natural plan timed has nothing to judge
    assert view["c1"]["plans"] == {natural: 1.2} and view["c1"]["samples"] == {natural: [1.2, 1.3]}
    assert view["c1"]["abandoned"] == set()
    assert run["c1"]["plans"] == {natural: 1.2, grouped: 1.0}  # the run itself is left as it was


def test_selection_regret_averages_repeated_runs_and_reports_the_repeat_floor():
    """Several records files of the same cases: latencies are the geometric mean over the runs of the
    plans every run timed; the repeat floor judges each run's fastest plan in the other run."""
    report = load("selection_regret")

    def run(**plans):
        return {"c1": {"record": {}, "plans": plans, "abandoned": set()}}

    first, second = run(a=1.0, b=1.1, c=5.0), run(a=1.21, b=1.1)
    merged = report.merge_runs([first, second])
    assert set(merged["c1"]["plans"]) == {"a", "b"}
    assert abs(merged["c1"]["plans"]["a"] - 1.1) < 1e-12 and abs(merged["c1"]["plans"]["b"] - 1.1) < 1e-12
    assert report.merge_runs([first]) is first
    lines = report.repeat_floor([first, second], ["one", "two"])
    assert len(lines) == 2
    assert "fastest plan of `one` judged in `two`: GM regret 1.1000" in lines[0]  # a: 1.21 / 1.1
    assert "fastest plan of `two` judged in `one`: GM regret 1.1000" in lines[1]  # b: 1.1 / 1.0


def test_selection_regret_sample_floor_judges_half_the_samples_by_the_other_half():
    """The sample floor of one run: per case the fastest plan by half of its samples, judged by the
    other half. Two plans whose samples alternate which is faster give a floor above 1; plans that
    never swap give exactly 1; cases without samples (kernel studies) give none."""
    report = load("selection_regret")

    def case(**samples):
        return {"record": {}, "plans": {p: min(v) for p, v in samples.items()}, "abandoned": set(),
                "samples": samples}

    apart = {"c1": case(a=[1.0, 1.0, 1.0, 1.0], b=[2.0, 2.0, 2.0, 2.0])}
    assert "GM regret 1.0000" in report.sample_floor(apart) and "within 3% on 20/20 case splits" in report.sample_floor(apart)
    swapping = {"c1": case(a=[1.0, 1.2, 1.0, 1.2], b=[1.2, 1.0, 1.2, 1.0])}  # rounds 0, 2 favour a; 1, 3 favour b
    line = report.sample_floor(swapping, splits=50)
    assert line.startswith("- sample floor of the judge") and "GM regret 1.0000" not in line
    assert report.sample_floor({"c1": {"record": {}, "plans": {"a": 1.0}, "abandoned": set()}}) is None
    record = {"type": "case", "case": "c1", "spec": {}, "request": {}}
    plan = {"type": "plan", "case": "c1", "plan": "a", "status": "ok", "latency_ms": 1.0, "samples_ms": [1.0, 1.1]}
    assert report.profile_cases([record, plan])["c1"]["samples"] == {"a": [1.0, 1.1]}


def test_ptxas_report_reads_both_schedules_and_spills(tmp_path):
    """benchmarks/ptxas_report.py on a log in ptxas's format: one row per Hopper attention kernel
    (static and dynamic schedule), spills and static shared memory read, other kernels ignored."""
    log = tmp_path / "ptxas.log"
    name = "_ZN7tessera6hopper16attention_kernelINS0_6TraitsILi128ELi64ELi128ELi3EN7cutlass{}_tEEELb{}EEEv17TesseraAttnParamsNS0_14TmaDescriptorsE"
    log.write_text("\n".join([
        "== hopper_t128x64_d128_fp16_s3_w8_sm90a.cu (11s)",
        f"ptxas info    : Compiling entry function '{name.format('6half', 1)}' for 'sm_90a'",
        "    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads",
        "ptxas info    : Used 168 registers, used 16 barriers, 128 bytes smem",
        f"ptxas info    : Compiling entry function '{name.format('10bfloat16', 0)}' for 'sm_90a'",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 168 registers, used 16 barriers, 24 bytes cumulative stack size, 128 bytes smem",
        "ptxas info    : Compiling entry function '_ZN7tessera8portable16attention_kernelINS0_6TraitsILi64E' for 'sm_80'",
        "ptxas info    : Used 96 registers, used 1 barriers",
    ]))
    report = load("ptxas_report")
    rows = report.parse(log.read_text())
    assert [(r["dtype"], r["schedule"], r["spills"], r["registers"], r["smem"]) for r in rows] == [
        ("fp16", "dynamic", (8, 12), 168, 128), ("bf16", "static", (0, 0), 168, 128)]
    md = tmp_path / "out.md"
    assert report.main(["--log", str(log), "--md", str(md)]) == 0
    assert "| 128x64 | 128 | 3 | fp16 | dynamic | 168 | 8 / 12 | 128 |" in md.read_text()
    assert "2 kernels, 1 with spills." in md.read_text()


def test_sass_report_counts_hgmma_per_kernel(tmp_path):
    """benchmarks/sass_report.py on a listing in cuobjdump -sass's format: one row per Hopper
    attention kernel with its HGMMA, TMA-load and instruction counts (NOPs and other kernels out)."""
    name = "_ZN7tessera6hopper16attention_kernelINS0_6TraitsILi64ELi64ELi128ELi2EN7cutlass10bfloat16_tEEELb{}EEEv17TesseraAttnParamsNS0_14TmaDescriptorsE"
    sass = tmp_path / "lib.sass"
    sass.write_text("\n".join([
        "\tcode for sm_90a",
        f"\t\tFunction : {name.format(1)}",
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        "        /*0010*/              @!P0 UTMALDG.4D [UR8], [UR4] ;",
        "        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;",
        "        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;",
        "        /*0040*/                   NOP;",
        "\t\tFunction : _ZN7tessera8portable16attention_kernelINS0_6TraitsILi64E",
        "        /*0000*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        f"\t\tFunction : {name.format(0)}",
        "        /*0000*/                   EXIT ;",
    ]))
    report = load("sass_report")
    rows = report.parse(sass.read_text())
    assert [(r["schedule"], r["hgmma"], r["tma"], r["instructions"]) for r in rows] == [
        ("dynamic", 2, 1, 4), ("static", 0, 0, 1)]
    md = tmp_path / "out.md"
    assert report.main(["--sass", str(sass), "--md", str(md)]) == 0
    assert "| 64x64 | 128 | 2 | bf16 | dynamic | 2 | 1 | 4 |" in md.read_text()
    assert "2 kernels, 1 without HGMMA." in md.read_text()


def test_selection_regret_mask_cache_round_trips(tmp_path):
    """benchmarks/selection_regret.py --mask-cache: the second run reads back the very mask the
    first built (bit-packed, any block count), without building it again."""

    from tessera_diffusers import LogicalMask

    report = load("selection_regret")
    blocks = torch.rand(1, 3, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.4  # 105 bits: not a multiple of 8
    mask = LogicalMask.from_blocks(blocks, 64, 64, 300, 420)
    built = report.cached_mask(tmp_path, "case/a", lambda: mask)
    assert built is mask

    def must_not_build():
        raise AssertionError("the cached mask should have been read")

    again = report.cached_mask(tmp_path, "case/a", must_not_build)
    assert torch.equal(again.blocks, blocks)
    assert (again.block_q, again.block_kv, again.seq_len_q, again.seq_len_kv) == (64, 64, 300, 420)


def test_sanitize_every_kernel_covers_each_hopper_kernel_once_per_schedule():
    """benchmarks/sanitize_check.py --every-kernel: every Hopper kernel of the catalog runs twice,
    once on the static schedule and once persistent (the dynamic one), and every plan is eligible
    for the case's sizes (a rejected plan would only fail on the GPU host)."""
    from tessera_diffusers import PhysicalPlan
    from tessera_diffusers.catalog import all_kernels
    from tessera_diffusers.eligibility import rejection
    from tessera_diffusers.plans import Request

    report = load("sanitize_check")
    hopper = [k for k in all_kernels() if k.family.value == "hopper"]
    cases = report.every_hopper_kernel(all_kernels())
    by_key = {(k.tile_q, k.tile_kv, k.head_dim, k.dtype, k.stages, k.warps): k for k in hopper}
    seen = {}
    for (bq, bkv), family, key, layout, org in cases:
        kernel = by_key[key]
        plan = PhysicalPlan(bq, bkv, layout, org, kernel)
        seq_q, seq_kv = report.case_sizes(bq, bkv)
        request = Request(1, 2, seq_q, seq_kv, kernel.head_dim, kernel.dtype, bq, bkv, "sm90", False)
        assert rejection(plan, request) is None, plan.name
        seen.setdefault(kernel.name, []).append(org.persistent)
    assert sorted(seen) == sorted(k.name for k in hopper)
    assert all(sorted(v) == ([False, False, True] if name.startswith("hopper_t128") else [False, True])
               for name, v in seen.items())
    # the 128-row kernels' static case covers two query blocks per tile (and its grouped layout)
    coarse = [PhysicalPlan(bq, bkv, layout, org, by_key[key]) for (bq, bkv), _, key, layout, org in cases
              if key[0] == 128 and (bq, bkv) == (64, 32)]
    assert len(coarse) == sum(k.tile_q == 128 for k in hopper)
    assert all(not p.tasks.persistent and p.q_units_per_tile == 2 and p.can_group_queries for p in coarse)


def test_selection_regret_splits_regret_into_organization_and_tile():
    """benchmarks/selection_regret.py: a choice's regret = (its time over the fastest task
    organization of its own tile, pipeline depth included) x (that over the fastest plan of all)."""
    report = load("selection_regret")
    tile = "direct_q64k64_from_q64k64_d128_bf16_sm90a_hopper"
    plans = {f"{tile}_s2w4_lpt": 2.2, f"{tile}_s3w4_lpt-persistent": 2.0, "coarsened-packed_q128k128_x_s2w8_lpt": 1.6}
    organization, tile_part = report.regret_split(plans, f"{tile}_s2w4_lpt", 1.6)
    assert (round(organization, 6), round(tile_part, 6)) == (1.1, 1.25)
    assert report.regret_split(plans, "coarsened-packed_q128k128_x_s2w8_lpt", 1.6) == (1.0, 1.0)
    assert report.family_of("n32k:Q64K64-HD/text_sink/bench32k/h24/s0:bf16:d128:b1") == "Q64K64-HD"
    assert report.family_of("Q128K64/sliding_tile/bench32k/h24/s32") == "Q128K64"
    assert report.family_of("n32k:Q16K16/text_sink/bench32k/h24/s0:bf16:d128:b1:reused") == "Q16K16"  # --reused-masks
