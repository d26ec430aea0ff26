"""The issue-6 benchmark scripts on the CPU: the dispatch micro-benchmark (selection step only,
synthetic compiler-built table), the A0/A1/A2 ablation in its smoke configuration, and the
selection-regret report's reading of profile records."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


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


def test_ablation_smoke(tmp_path):
    rc = load("ablation").main(["--out", str(tmp_path), "--smoke", "--families", "Q64K64", "--cases-per-family", "1",
                                "--cold-reps", "1", "--reps", "1"])
    assert rc == 0
    payload = json.loads((tmp_path / "ablation.json").read_text())
    (row,) = payload["rows"]
    systems = row["systems"]
    assert set(systems) == {"A0 direct", "A1 search", "A2 tessera"}
    assert all(s["status"] == "ok" and s["check"]["ok"] for s in systems.values())
    assert systems["A0 direct"]["plan"].startswith("direct_q64k64_from_q64k64")
    assert systems["A2 tessera"]["plan"] == "reference oracle"  # no table and no native kernels on a CPU
    assert "| A1 search |" in (tmp_path / "ablation.md").read_text()


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


def test_timing_spread_smoke(tmp_path):
    """benchmarks/timing_spread.py on the CPU: per (case, plan) the rounds of fresh buffers, each with
    two timings (new buffers, then the same buffers again), summarized and written as JSON + markdown."""
    assert load("timing_spread").main(["--out", str(tmp_path), "--smoke", "--cases", "1", "--rounds", "2",
                                       "--plans-per-case", "2", "--reps", "2", "--warmup", "1"]) == 0
    payload = json.loads((tmp_path / "timing_spread.json").read_text())
    (entry,) = payload["rounds"]
    assert len(entry["plans"]) == 2 and all(len(pairs) == 2 and len(pairs[0]) == 2 for pairs in entry["plans"].values())
    (summary,) = payload["summaries"]
    assert summary["distinct_winners"] in (1, 2) and summary["round_winner_regret_gm"] >= 1.0
    assert "max / min over rounds" in (tmp_path / "timing_spread.md").read_text()


def test_batch_context_smoke(tmp_path):
    """benchmarks/batch_context.py on the CPU: every context timed ``--repeats`` times per case, the
    targets one plan per tile group, the report per case and context."""
    module = load("batch_context")
    assert module.main(["--out", str(tmp_path), "--smoke", "--cases", "2", "--repeats", "2", "--reps", "2"]) == 0
    payload = json.loads((tmp_path / "batch_context.json").read_text())
    assert len(payload["cases"]) == 2 and [m[0] for m in payload["marks"]].count("full+gemm") == 2 * 2
    for case in payload["cases"]:
        assert case["targets"] and len(set(case["targets"])) == len(case["targets"])
        for context in module.CONTEXTS:
            assert all(len(v) == 2 for v in case["times"][context].values())
    assert "| case | alone | full | gemm | full+gemm |" in (tmp_path / "batch_context.md").read_text()
    assert module.tile_rows("coarsened-packed_q128k64_from_q16k16_d128_bf16_sm90a_hopper_s2w8_lpt") == 128


@pytest.mark.parametrize("script, option", [("batch_context", "--targets"), ("batch_context", "--repeats"),
                                            ("timing_spread", "--rounds")])
def test_studies_refuse_counts_below_one(tmp_path, capsys, script, option):
    with pytest.raises(SystemExit):
        load(script).parse_args(["--out", str(tmp_path), "--smoke", option, "0"])
    assert f"{option}: expected a positive count, got 0" in capsys.readouterr().err


def test_batch_context_from_records_compares_pruned_and_full_batches(tmp_path):
    """Offline mode: per (family, source) the 64-row over 128-row tile ratio of cases timed with
    their contenders only against cases timed with all plans (here 1.0 against 1.1)."""
    small, tall = "direct_q64k64_from_q64k64_d128_bf16_sm90a_hopper_s2w4_lpt", \
        "coarsened-packed_q128k128_from_q64k64_d128_bf16_sm90a_hopper_s2w8_lpt"
    lines = []
    for i, (pruned, ratio) in enumerate([(0, 1.1), (0, 1.1), (12, 1.0), (12, 1.0)]):
        case = f"n32k:Q64K64/sliding_tile/s{i}"
        lines += [{"type": "plan", "case": case, "plan": small, "status": "ok", "latency_ms": 2.0 * ratio},
                  {"type": "plan", "case": case, "plan": tall, "status": "ok", "latency_ms": 2.0},
                  {"type": "case", "case": case, "family": "Q64K64", "source": "sliding_tile", "pruned": pruned}]
    records = tmp_path / "run" / "profile.jsonl"
    records.parent.mkdir()
    records.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    module = load("batch_context")
    assert module.main(["--out", str(tmp_path), "--from-records", str(records)]) == 0
    text = (tmp_path / "batch_context_from_records.md").read_text()
    assert "| contenders only vs all plans, both run | 1 | 0.909 | 0.909-0.909 |" in text
    persistent = {small: 1.0, small + "-persistent": 0.9, tall: 2.0}
    assert abs(module.persistent_ratio(persistent) - math.log(0.9)) < 1e-12
    assert module.persistent_ratio({small: 1.0}) is None and module.tile_ratio({small: 1.0}) is None


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


def test_schedule_ratios_pairs_lpt_and_persistent_of_one_case(tmp_path):
    """benchmarks/schedule_ratios.py: persistent / lpt of the same plan on the same case, grouped
    by (family, mapping, tile, stages), with KV tiles per row from the case's density; plans timed
    one way only, failed plans and other task organizations are left out."""
    plan = "direct_q64k64_from_q64k64_d128_bf16_sm90a_hopper_s2w4_{}"
    case = {"type": "case", "case": "c1", "family": "Q64K64", "stats": {"density": 0.25},
            "request": {"seq_len_kv": 1024}}
    records = [case,
               {"type": "plan", "case": "c1", "plan": plan.format("lpt"), "status": "ok", "latency_ms": 2.0},
               {"type": "plan", "case": "c1", "plan": plan.format("lpt-persistent"), "status": "ok", "latency_ms": 1.5},
               {"type": "plan", "case": "c1", "plan": plan.format("rowmajor"), "status": "ok", "latency_ms": 1.0},
               {"type": "plan", "case": "c1", "plan": plan.replace("s2w4", "s3w4").format("lpt"), "status": "ok",
                "latency_ms": 1.0},
               {"type": "plan", "case": "c1", "plan": plan.replace("s2w4", "s3w4").format("lpt-persistent"),
                "status": "invalid"}]
    path = tmp_path / "profile.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    report = load("schedule_ratios")
    assert dict(report.ratios(records)) == {("Q64K64", "direct", "64x64", 2, "hopper"): [(4.0, 0.75)]}
    md = tmp_path / "out.md"
    assert report.main([str(path), "--md", str(md)]) == 0
    assert "| Q64K64 | direct | 64x64 | 2 | hopper | 1 | 4.0 | 0.750 | 0.750 | 0.750 |" in md.read_text()
    png = tmp_path / "ratios.png"
    assert report.main([str(path), "--plot", str(png), "--select", "^Q64K64 direct 64x64"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.main([str(path), "--plot", str(tmp_path / "none.png"), "--select", "Q16K16"]) == 1


def test_selection_regret_mask_cache_round_trips(tmp_path):
    """benchmarks/selection_regret.py --mask-cache: the second run reads back the very mask the
    first built (bit-packed, any block count), without building it again."""
    import torch

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


def test_tile_fill_counts_active_pairs_and_idle_warps():
    tile_fill = load("tile_fill").tile_fill
    # One head, 8 query blocks of 16 rows (one 128-row tile), 8 key blocks of 16 (two 64-wide tiles).
    blocks = torch.zeros(1, 8, 8, dtype=torch.bool)
    blocks[0, 0, :4] = True      # query unit 0: the first KV tile only
    blocks[0, 7, 4:] = True      # query unit 7: the second KV tile only
    # Union of the tile's rows: all 8 key blocks = 2 KV tiles x 4 slots x 8 units = 64 scheduled pairs.
    fill, idle = tile_fill(blocks, 16, 16, 128, 64, 32)
    assert fill == pytest.approx(8 / 64)
    # 32 rows per warp: 4 warps x 2 tiles; warp 0 works on tile 0 only, warp 3 on tile 1 only.
    assert idle == pytest.approx(6 / 8)
    fill16, idle16 = tile_fill(blocks, 16, 16, 128, 64, 16)
    assert fill16 == pytest.approx(fill)
    assert idle16 == pytest.approx(14 / 16)


def test_ab_compare_reports_per_plan_ratios(tmp_path):
    ab = load("ab_compare")
    for name, scale in (("base", 1.0), ("study", 1.21)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"family": "Q64K64", "backend": "tessera-plans", "plan": "p1", "status": "ok", "kernel_ms": 2.0 * scale},
                {"family": "Q64K64", "backend": "tessera-plans", "plan": "p2", "status": "ok", "kernel_ms": 4.0},
                {"family": "Q64K64", "backend": "tessera-plans", "plan": "p3", "status": "failed", "kernel_ms": 1.0},
                {"family": "Q64K64", "backend": "sdpa-cudnn", "status": "ok", "kernel_ms": 19.0}]
        (run / "records.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = ab.report(ab.kernel_times(tmp_path / "base"), ab.kernel_times(tmp_path / "study"), None, "t")
    assert "GM **1.100** over 2 plans" in text  # sqrt(1.21 * 1.0): failed records and dense rows left out
    assert "| Q64K64 | p1 | 2.000 | 2.420 | 1.210 |" in text
    assert "19.000 / 19.000" in text
    with pytest.raises(SystemExit):
        ab.report(ab.kernel_times(tmp_path / "base"), ab.kernel_times(tmp_path / "study"), "^nothing$", "t")


def test_query_regrouping_groups_blocks_by_their_key_sets():
    regroup = load("query_regrouping")
    # Two heads, 8 query blocks; head 0 alternates between two key sets (natural pairs mix them),
    # head 1 is already grouped (the natural order is kept).
    blocks = torch.zeros(2, 8, 8, dtype=torch.bool)
    blocks[0, 0::2, :4] = True
    blocks[0, 1::2, 4:] = True
    blocks[1, :4, :4] = True
    blocks[1, 4:, 4:] = True
    perm = regroup.group_query_blocks(blocks, group=2, window=4)
    for h in range(2):
        assert sorted(perm[h].tolist()) == list(range(8))  # a permutation of the query blocks
    natural = torch.arange(8).expand(2, 8)
    assert regroup.scheduled_key_blocks(blocks, natural, 2).tolist() == [32, 16]
    assert regroup.scheduled_key_blocks(blocks, perm, 2).tolist() == [16, 16]
    assert perm[1].tolist() == list(range(8))
    with pytest.raises(ValueError):
        regroup.group_query_blocks(blocks, group=0)


def test_regrouped_attention_scattered_back_equals_the_original():
    from tessera_diffusers import LogicalMask, reference
    from tessera_diffusers.testing import random_mask, random_qkv

    regroup = load("query_regrouping")
    mask = random_mask(1, 3, 8 * 16, 8 * 16 - 5, 16, 16, density=0.4, seed=3)
    perm = regroup.group_query_blocks(mask.blocks[0], group=4, window=4)
    q, k, v = random_qkv(1, mask.seq_len_q, mask.seq_len_kv, 3, 32, torch.float32, "cpu", seed=3)
    expected = reference.attention(q, k, v, mask, 0.125)
    moved = reference.attention(regroup.gather_rows(q, perm, 16), k, v, regroup.permuted_mask(mask, perm), 0.125)
    back = regroup.gather_rows(moved, torch.argsort(perm, dim=1), 16)
    torch.testing.assert_close(back, expected)
    partial = LogicalMask(mask.blocks, 16, 16, mask.seq_len_q - 3, mask.seq_len_kv)
    with pytest.raises(ValueError):
        regroup.permuted_mask(partial, perm)


def tiny_elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF image holding ``sections`` (and its section-name table)."""
    import struct

    names = b"\0.shstrtab\0" + b"".join(name.encode() + b"\0" for name in sections)
    blobs = [names] + list(sections.values())
    data, offsets, at = b"", [], 64
    for blob in blobs:
        offsets.append(at)
        data += blob
        at += len(blob)
    name_offsets = [1] + [names.index(name.encode() + b"\0") for name in sections]
    headers = struct.pack("<IIQQQQIIQQ", *[0] * 10)  # the null section
    for name_off, offset, blob in zip(name_offsets, offsets, blobs):
        headers += struct.pack("<IIQQQQIIQQ", name_off, 1, 0, 0, offset, len(blob), 0, 0, 1, 0)
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + bytes(9), 1, 190, 1, 0, 0, at, 0, 64, 0, 0,
                         64, len(blobs) + 1, 1)
    return header + data + headers


def test_kernel_code_diff_compares_text_sections_by_kernel(tmp_path, monkeypatch, capsys):
    diff = load("kernel_code_diff")
    old = tiny_elf({".text.kernel_a": b"\x01\x02", ".text.kernel_b": b"\x03", ".nv.info.kernel_a": b"x"})
    moved_lines = tiny_elf({".text.kernel_a": b"\x01\x02", ".nv.info.kernel_a": b"yy", ".text.kernel_b": b"\x03"})
    changed = tiny_elf({".text.kernel_a": b"\x01\x09", ".text.kernel_b": b"\x03"})
    hashes = diff.kernel_text_hashes(old)
    assert set(hashes) == {"kernel_a", "kernel_b"}  # only instruction sections
    assert diff.kernel_text_hashes(moved_lines) == hashes
    assert [len(i) for i in diff.split_images(b"pad" + old + b"gap" + changed)] == [len(old) + 3 + len(changed),
                                                                                    len(changed)]
    images = {"old.so": [old], "same.so": [moved_lines], "new.so": [changed]}
    monkeypatch.setattr(diff, "embedded_cubins", lambda path: images[path.name])
    for name in images:
        (tmp_path / name).write_bytes(b"")
    assert diff.main([str(tmp_path / "old.so"), str(tmp_path / "same.so")]) == 0
    assert diff.main([str(tmp_path / "old.so"), str(tmp_path / "new.so")]) == 1
    out = capsys.readouterr().out
    assert "changed: kernel_a" in out and "1 kernels with the same code, 1 changed" in out


def test_profile_pairs_groups_plans_by_stages_and_schedule(tmp_path):
    pairs = load("profile_pairs")
    persistent, static = "direct_q64k64_from_q64k64_x_s2w4_lpt-persistent", "direct_q64k64_from_q64k64_x_s3w4_lpt"

    def write(path, scale):
        rows = [{"type": "case", "case": "c0"}]
        for case, base in (("c0", 2.0), ("c1", 4.0)):
            rows.append({"type": "plan", "case": case, "plan": persistent, "status": "ok", "latency_ms": base * scale})
            rows.append({"type": "plan", "case": case, "plan": static, "status": "ok", "latency_ms": base})
        rows.append({"type": "plan", "case": "c1", "plan": "only_old_s2w4_lpt", "status": "ok", "latency_ms": 1.0})
        rows.append({"type": "plan", "case": "c0", "plan": static, "status": "failed", "latency_ms": 99.0})
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    write(tmp_path / "old.jsonl", 1.0)
    write(tmp_path / "new.jsonl", 1.1)
    ratios = pairs.pair(pairs.latencies([tmp_path / "old.jsonl"]), pairs.latencies([tmp_path / "new.jsonl"]), 2)
    assert set(ratios) == {persistent, static}  # the one-case plan is left out
    assert pairs.gm(ratios[persistent]) == pytest.approx(1.1) and pairs.gm(ratios[static]) == pytest.approx(1.0)
    md = tmp_path / "pairs.md"
    assert pairs.main(["--old", str(tmp_path / "old.jsonl"), "--new", str(tmp_path / "new.jsonl"), "--min-cases", "2",
                       "--md", str(md)]) == 0
    text = md.read_text()
    assert "| 2 stages, persistent (dynamic) | 1 | 1.100 |" in text and "| 3 stages, static grid | 1 | 1.000 |" in text


def write_counters_log(path: Path, rows: list[tuple[str, str, float]]) -> None:
    """A kernel_counters.py log: header, then case, density, plan, ms, TF/s per pair."""
    lines = ["case                             density plan    ms   TF/s"]
    lines += [f"{case} 0.100 {plan} {ms:.3f} 500" for case, plan, ms in rows]
    path.write_text("\n".join(lines) + "\n")


def test_ab_counters_summary_pools_runs_per_library_and_tile_width(tmp_path):
    ab = load("ab_counters")
    narrow = "direct_q64k64_from_q64k64_d128_bf16_sm90a_hopper_s2w4_lpt"
    wide = "direct_q128k128_from_q128k128_d128_bf16_sm90a_hopper_s2w8_lpt"
    write_counters_log(tmp_path / "ab_old_1.log", [("Q64K64/a", narrow, 2.0), ("Q128K128/a", wide, 3.0)])
    write_counters_log(tmp_path / "ab_old_2.log", [("Q64K64/a", narrow, 8.0), ("Q128K128/a", wide, 3.0)])
    write_counters_log(tmp_path / "ab_new_1.log", [("Q64K64/a", narrow, 3.6), ("Q128K128/a", wide, 3.3)])
    assert ab.main(["--summarize", str(tmp_path), "--order", "old,new"]) == 0
    text = (tmp_path / "ab.md").read_text()
    # old's two runs pool to the geometric mean 4.0 on the 64-column plan: 3.6 / 4.0 = 0.9
    assert "| Q64K64/a | " + narrow + " | 4.000 | 3.600 | 0.900 |" in text
    assert "| 64-column tiles | 1 | 0.9000 |" in text
    assert "| 128-column tiles | 1 | 1.1000 |" in text
    with pytest.raises(SystemExit):  # a library without logs is refused
        ab.main(["--summarize", str(tmp_path), "--order", "old,other"])


def test_ab_counters_runs_a_library_with_its_own_python_tree(tmp_path, monkeypatch):
    """--pythonpath NAME=DIR puts DIR first on that library's runs' PYTHONPATH and no other's; a
    name that no --lib gives is refused."""
    ab = load("ab_counters")
    seen = []

    def fake_run(command, stdout, env, **kwargs):
        seen.append((env["TESSERA_NATIVE_LIB"], env.get("PYTHONPATH")))
        stdout.write("")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    base = ["--out", str(tmp_path), "--lib", "a=/la.so", "--lib", "b=/lb.so", "--case", "Q64K64/x", "--plan", "p"]
    assert ab.main(base + ["--pythonpath", f"b={tmp_path}", "--order", "b,a"]) == 0
    assert seen == [("/lb.so", os.pathsep.join([str(tmp_path), "/elsewhere"])), ("/la.so", "/elsewhere")]
    with pytest.raises(SystemExit):
        ab.main(base + ["--pythonpath", f"c={tmp_path}", "--order", "a"])


def test_warpgroup_idle_counts_one_sided_tiles_in_both_orders():
    """Two query blocks with disjoint key sets {0, 2} and {1, 3}: ascending packing gives tiles
    (0, 1), (2, 3), where each warpgroup has a block; shared-first order packs (0, 2), (1, 3), and
    each warpgroup idles on one of them. Blocks {0..3} and {0, 4}: one idle tile each, either way."""
    study = load("warpgroup_idle")
    blocks = torch.zeros(1, 2, 4, dtype=torch.bool)
    blocks[0, 0, [0, 2]] = True
    blocks[0, 1, [1, 3]] = True
    assert study.warpgroup_idle(blocks) == (2, 0.0, 0.5)
    blocks = torch.zeros(1, 2, 5, dtype=torch.bool)
    blocks[0, 0, :4] = True
    blocks[0, 1, [0, 4]] = True
    tiles, now, ordered = study.warpgroup_idle(blocks)
    assert tiles == 3 and now == pytest.approx(1 / 3) and ordered == pytest.approx(1 / 3)
    # one pair (a head's two query blocks): shared {0}, union {0..4}, own 4 + 2 = 6 blocks
    shared, loads, work = study.pair_sharing(blocks)
    assert (shared, loads, work) == (pytest.approx(1 / 5), pytest.approx(5 / 6), pytest.approx(10 / 6))


def test_grouping_criterion_counts_packed_tiles_per_lack_weight():
    """Four 64 x 64 query blocks {0..3}, {4}, {0..4}, {4} in 128 x 128 tiles (two blocks a side):
    the natural pairs' unions {0..4}, {0..4} pack into 3 + 3 tiles; weighing the lacking blocks
    pairs rows 0 and 2 ({0..4}: 3 tiles) and rows 1 and 3 ({4}: 1 tile). Active work: 11 blocks
    over 4 per tile."""
    study = load("grouping_criterion")
    rows = [{0, 1, 2, 3}, {4}, {0, 1, 2, 3, 4}, {4}]
    blocks = torch.zeros(1, 4, 5, dtype=torch.bool)
    for i, row in enumerate(rows):
        blocks[0, i, sorted(row)] = True
    work = study.tile_work(blocks, 64, 64, 128, weights=(0, 1))
    active = 11 / 4
    assert work == {"natural": pytest.approx(6 / active), "w=0": pytest.approx(6 / active),
                    "w=1": pytest.approx(4 / active)}
    order = torch.tensor([[0, 2, 1, 3]])
    assert study.scheduled_tiles(blocks, order, 2, 2) == 4


def test_isolated_tests_records_a_hang_and_runs_the_tests_after_it(tmp_path, capsys):
    """benchmarks/isolated_tests.py: a test that never returns is killed after the timeout and
    recorded as a hang, the tests after it still run (in a new child), and failures are reported."""
    tests = tmp_path / "test_sample.py"
    tests.write_text("\n".join([
        "import time",
        "import pytest",
        "def test_first(): pass",
        "def test_stuck(): time.sleep(120)",
        "@pytest.mark.parametrize('x', [1, 2])",
        "def test_after(x): assert x == 1",
    ]) + "\n")
    tool = load("isolated_tests")
    log = tmp_path / "run.log"
    rc = tool.main(["--timeout", "4", "--log", str(log), "--", "-p", "no:randomly", str(tests)])
    out = capsys.readouterr().out
    assert rc == 1
    lines = out.splitlines()
    assert any(line.startswith("HANG ") and line.endswith("test_sample.py::test_stuck") for line in lines), out
    assert any(line.startswith("FAILED ") and line.endswith("test_sample.py::test_after[2]") for line in lines), out
    assert "2 passed" in out and "1 hang" in out and "1 failed" in out
    assert "test_stuck: no result for 4 s, killed" in log.read_text()


def test_task_overhead_masks_rows_of_exactly_k_and_fits_the_fixed_cost(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it reads kernel_counters' timer
    study = load("task_overhead")
    gen = torch.Generator().manual_seed(3)
    blocks = study.rows_of_k(3, 5, 40, 7, gen)
    assert blocks.shape == (1, 3, 5, 40) and blocks.dtype == torch.bool
    assert (blocks.sum(-1) == 7).all()
    assert not torch.equal(blocks[0, 0], blocks[0, 1])  # heads draw their own blocks
    with pytest.raises(ValueError, match="k: expected 1..40"):
        study.rows_of_k(1, 2, 40, 41, gen)
    ks = [4, 8, 16, 32]
    fit = study.fit_line(ks, [0.3 + 0.05 * k for k in ks])
    assert fit.c0 == pytest.approx(0.3) and fit.c1 == pytest.approx(0.05) and fit.tiles == pytest.approx(6.0)
    assert fit.max_residual < 1e-9
    noisy = study.fit_line(ks, [0.3 + 0.05 * k + (0.01 if k == 8 else 0.0) for k in ks])
    assert noisy.max_residual > 0.005
    with pytest.raises(ValueError, match="two distinct k"):
        study.fit_line([4, 4], [1.0, 1.1])
    points = study.with_lost_tiles([study.Point("Q64K64", "a", 8, 0.1, 1.0, 400.0),
                                    study.Point("Q64K64", "a", 32, 0.4, 2.0, 500.0),
                                    study.Point("Q64K64", "b", 8, 0.1, 1.0, 100.0)])
    assert [p.lost for p in points] == pytest.approx([2.0, 0.0, 0.0])  # 8 * (500 / 400 - 1); b is its own best
    assert study.parse_config("Q64K64=^direct_") == ("Q64K64", "^direct_")
    for bad in ("Q64K64", "Q64=^x", "Q64K64="):
        with pytest.raises(ValueError):
            study.parse_config(bad)
