"""Kernel table, catalog plans, eligibility reasons, selection on CPU and the cost model."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tessera_diffusers import LogicalMask, build_mask_state, cost_model
from tessera_diffusers.catalog import catalog_hash, hopper_kernels, plans_for, portable_kernels
from tessera_diffusers.cost_model import estimate_ms, masked_tile_slowdown
from tessera_diffusers.eligibility import rejection
from tessera_diffusers.kernel_table import all_rows
from tessera_diffusers.plans import AxisMapping, Family, KvLayout, Request
from tessera_diffusers.selector import rank, select
from tessera_diffusers.testing import random_mask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernel_names_are_unique_and_deterministic():
    names = [r.name for r in all_rows()]
    assert len(names) == len(set(names))
    assert [k.name for k in portable_kernels()] == names[: len(portable_kernels())]
    assert catalog_hash(portable_kernels()) == catalog_hash(portable_kernels())
    assert "portable_t64x64_d128_bf16_s2_w4_sm80" in names


def test_plan_names_are_unique_per_geometry():
    for bq, bkv in ((16, 16), (64, 64), (128, 128), (384, 384)):
        plans = plans_for(bq, bkv, portable_kernels())
        assert len({p.name for p in plans}) == len(plans)


def request(arch="sm90", bq=64, bkv=64, dtype="bf16", head_dim=128, seq=32768):
    return Request(1, 24, seq, seq, head_dim, dtype, bq, bkv, arch)


def test_eligibility_gives_reasons():
    plans = plans_for(16, 16, portable_kernels())
    reasons = {rejection(p, request(bq=16, bkv=16)) for p in plans}
    assert None in reasons
    assert any(r and "head_dim" in r for r in reasons)
    assert all(rejection(p, request(arch="cpu", bq=16, bkv=16)) for p in plans)
    assert any("shared memory" in (rejection(p, request(arch="sm86", bq=16, bkv=16)) or "") for p in plans)
    assert all("sm80 or newer" in rejection(p, request(arch="sm75", bq=16, bkv=16)) for p in plans
               if p.kernel.head_dim == 128 and p.kernel.dtype == "bf16")


def test_selector_uses_reference_on_cpu_and_explains():
    mask = random_mask(1, 2, 256, 256, 64, 64)
    state = build_mask_state(mask)
    req = Request(1, 2, 256, 256, 128, "bf16", 64, 64, "cpu")
    assert select(req, state) is None
    assert "reference oracle" in rank(req, state).explain()


def test_cost_model_prefers_large_tiles_for_large_blocks_and_penalizes_waste():
    blocks = torch.zeros(1, 1, 256, 256, dtype=torch.bool)
    for i in range(256):
        blocks[0, 0, i, max(0, i - 12) : i + 13] = True  # a band: ~10% dense, long runs
    mask = LogicalMask(blocks, 128, 128, 32768, 32768)
    stats = build_mask_state(mask).host_stats()
    plans = [p for p in plans_for(128, 128, portable_kernels()) if rejection(p, request(bq=128, bkv=128)) is None]
    best = min(plans, key=lambda p: estimate_ms(p, request(bq=128, bkv=128), stats))
    assert best.tile_q == 128 and best.q_mapping is AxisMapping.DIRECT
    assert best.kv_mapping in (AxisMapping.DIRECT, AxisMapping.REFINED)
    small = LogicalMask(blocks.repeat_interleave(8, 2).repeat_interleave(8, 3), 16, 16, 32768, 32768)
    small_stats = build_mask_state(small).host_stats()
    req16 = request(bq=16, bkv=16)
    ranked = sorted((p for p in plans_for(16, 16, portable_kernels()) if rejection(p, req16) is None),
                    key=lambda p: estimate_ms(p, req16, small_stats))
    assert ranked[0].kv_mapping is AxisMapping.PACKED  # gathered tiles beat aligned ones on scattered small blocks


def test_masked_tile_slowdown_per_shape_falls_back_to_the_family():
    assert masked_tile_slowdown(Family.HOPPER, 64, 64, 4) == cost_model.MASKED_TILE_SLOWDOWN_BY_SHAPE[Family.HOPPER][(64, 64, 4)]
    assert masked_tile_slowdown(Family.HOPPER, 128, 128, 8) == cost_model.MASKED_TILE_SLOWDOWN[Family.HOPPER]
    assert masked_tile_slowdown(Family.PORTABLE, 64, 64, 4) == cost_model.MASKED_TILE_SLOWDOWN[Family.PORTABLE]


@pytest.mark.parametrize(("shift", "tile_q"), [(8, 128), (20, 64)])
def test_cost_model_picks_the_query_tile_by_the_union_of_neighbouring_rows(shift, tile_q):
    """Q32K32 rows in identical pairs; in each aligned group of four rows the second pair's band
    sits ``shift`` blocks after the first's. A 64-row tile computes no waste, a 128-row one the union
    of its two pairs ((100 + shift) / 100 of the active blocks). A small shift leaves the faster
    128 x 128 tile ahead; a 20% union does not."""
    rows, band = 1024, 100
    blocks = torch.zeros(1, 1, rows, rows, dtype=torch.bool)
    for i in range(rows):
        start = (37 * (i // 4)) % (rows - band - shift) + shift * ((i // 2) % 2)
        blocks[0, 0, i, start : start + band] = True
    mask = LogicalMask(blocks, 32, 32, 32768, 32768)
    state = build_mask_state(mask)
    req = request(bq=32, bkv=32)
    plans = [p for p in plans_for(32, 32, hopper_kernels()) if rejection(p, req) is None
             and p.kv_layout is KvLayout.PACKED and p.q_mapping is AxisMapping.COARSENED and p.tile_q == p.tile_kv]
    assert {p.tile_q for p in plans} == {64, 128}
    stats = state.host_stats() | cost_model.row_union_stats(plans, 32, state)
    assert stats["row_union_2"] == pytest.approx(1.0, abs=0.01)
    assert stats["row_union_4"] == pytest.approx((band + shift) / band, abs=0.01)
    best = min(plans, key=lambda p: estimate_ms(p, req, stats))
    assert best.tile_q == tile_q


def build_native_module():
    spec = importlib.util.spec_from_file_location("tessera_build_native", os.path.join(ROOT, "csrc", "build_native.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_sources_hash_sees_code_flags_and_tools_not_paths(tmp_path):
    build = build_native_module()
    src = tmp_path / "include"
    (src / "tessera").mkdir(parents=True)
    (src / "tessera" / "mainloop.cuh").write_text("constexpr int kStages = 1;\n")

    def digest(flags=("-O3", "-I/here"), tools=("nvcc 13.0",), generated=None):
        return build.kernel_sources_hash([str(src)], generated or {"k": "instantiate<64>"}, [list(flags)], list(tools))

    base = digest()
    assert len(base) == 16 and base == digest()
    assert digest(flags=("-O3", "-I/elsewhere")) == base  # include paths name the machine, not the code
    assert digest(flags=("-O3", "-DTESSERA_SWITCH=0", "-I/here")) != base
    assert digest(tools=("nvcc 13.1",)) != base
    assert digest(generated={"k": "instantiate<128>"}) != base
    (src / "tessera" / "mainloop.cuh").write_text("constexpr int kStages = 2;\n")
    assert digest() != base
    (src / "tessera" / "mainloop.cuh").write_text("// why one stage\nconstexpr int kStages = 1;  /* see above */\n\n")
    assert digest() == base  # comments and blank lines are not code
    (src / "tessera" / "epilogue.cuh").write_text("int x;")
    assert digest() != base  # a new file counts


def test_code_text_drops_comments_and_blank_lines_but_keeps_literals():
    build = build_native_module()
    source = (b'int a = 1; // one\n/* two\n lines */ const char* s = "//kept /*too*/";\n\n'
              b"char c = '\\''; /* x */ int d;   \n")
    assert build.code_text(source) == (b'int a = 1;\n const char* s = "//kept /*too*/";\n'
                                       b"char c = '\\'';   int d;")
    assert build.code_text(b"int a;\n") != build.code_text(b"int b;\n")


def test_grouping_kernel_sources_are_hashed_apart_from_the_attention_kernels(tmp_path):
    """An edit of the grouping kernel's own header changes the grouping hash only; an edit of a
    header both compile changes both."""
    build = build_native_module()
    root = tmp_path / "csrc"
    for index, relative in enumerate(build.GROUPING_SOURCES + ("include/tessera/hopper/mainloop.cuh",)):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(f"int file{index};\n")

    def hashes():
        attention = build.kernel_sources_hash([str(root / "include"), str(root / "kernels")], {}, [["-O3"]],
                                              ["nvcc 13.0"], exclude=build.GROUPING_ONLY)
        return attention, build.grouping_sources_hash([["-O3"]], ["nvcc 13.0"], root=str(root))

    base = hashes()
    (root / "include/tessera/regroup.cuh").write_text("int pick_by_symmetric_difference;\n")
    edited = hashes()
    assert edited[0] == base[0] and edited[1] != base[1]
    (root / "include/tessera/regroup.cuh").write_text("// a comment only\nint pick_by_symmetric_difference;\n")
    assert hashes() == edited
    (root / "include/tessera/params.h").write_text("#define TESSERA_ABI_VERSION 6\n")
    shared = hashes()
    assert shared[0] != edited[0] and shared[1] != edited[1]
    (root / "include/tessera/hopper/mainloop.cuh").write_text("int mainloop_v2;\n")
    assert hashes()[1] == shared[1]


def test_a_build_of_some_default_archs_hashes_as_the_default_build():
    """Narrowing the build (TESSERA_CUDA_ARCHS=90) compiles each kept target as the default build
    does, so its source hashes, which a plan table's profile is checked against, are the default
    build's; another arch list, or other flags, is another build."""
    build = build_native_module()
    rows = build.load_kernel_table().all_rows()

    def hashes(archs, common=("-O3",)):
        return build.source_hashes(rows, archs, list(common), "V13.0")

    default = hashes(build.DEFAULT_ARCHS)
    assert hashes("90") == default and hashes("80") == default and hashes("90,80") == default
    for other in ("86;90", "90a"):
        assert hashes(other)["kernel_sources"] != default["kernel_sources"]
        assert hashes(other)["grouping_sources"] != default["grouping_sources"]
    assert hashes("90", ("-O3", "-DTESSERA_HOPPER_TAKE_AHEAD=0")) != default
    assert hashes("90")["kernel_sources"] != build.source_hashes(rows[:-1], "90", ["-O3"], "V13.0")["kernel_sources"]


def test_an_object_is_reused_only_while_its_command_and_inputs_are_unchanged(tmp_path):
    """The incremental build's check: nvcc's dependency list (line continuations included), the
    command stamp, and no input newer than the object."""
    build = build_native_module()
    src, header, obj = tmp_path / "k.cu", tmp_path / "k.cuh", tmp_path / "k.o"
    for path in (src, header, obj):
        path.write_text("x")
    assert build.depfile_paths(f"{obj} : {src} \\\n    {header}\n") == [str(src), str(header)]
    flags = ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]
    stamp = build.command_stamp("nvcc", "V13.0", str(src), flags)
    assert not build.object_is_current(stamp, str(obj))  # never stamped
    (tmp_path / "k.o.d").write_text(f"{obj} : {src} \\\n    {header}\n")
    (tmp_path / "k.o.cmd").write_text(stamp)
    (tmp_path / "k.o.log").write_text("ptxas info")
    old, new = 1_000_000_000, 1_000_000_100
    for path in (src, header):
        os.utime(path, (old, old))
    os.utime(obj, (new, new))
    assert build.object_is_current(stamp, str(obj))
    assert not build.object_is_current(build.command_stamp("nvcc", "V13.0", str(src), flags + ["-DSTUDY"]), str(obj))
    assert not build.object_is_current(build.command_stamp("nvcc", "V13.1", str(src), flags), str(obj))  # nvcc updated
    os.utime(header, (new + 1, new + 1))
    assert not build.object_is_current(stamp, str(obj))  # an included file changed
    os.utime(header, (old, old))
    header.unlink()
    assert not build.object_is_current(stamp, str(obj))  # an included file is gone


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_the_shipped_plan_table_names_these_kernel_sources():
    """An edit that changes the kernels' code must re-profile the shipped table, or show by a
    same-run A/B that it moves no plan and re-express the table's hashes
    (tessera_diffusers/data/README.md); otherwise every GPU user is told the table may be stale.
    The hashes cover nvcc's and CUTLASS's versions: this runs with those the table was built with."""
    from tessera_diffusers.plan_table import default_table

    build = build_native_module()
    tools = (build.nvcc_version_line(build.find_nvcc()), build.cutlass_version())
    if "cuda_13.0" not in tools[0] or tools[1] != "nvidia-cutlass 4.2.0.0":
        pytest.skip(f"the shipped table's hashes are of nvcc 13.0 and nvidia-cutlass 4.2.0.0, not {tools}")
    planned = build.planned_source_hashes("80;90")
    provenance = default_table("sm90").table.provenance
    assert provenance["kernel_sources"] == [planned["kernel_sources"]], planned
    assert provenance["grouping_sources"] == [planned["grouping_sources"]], planned


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_native_smoke_subset_compiles_and_links(tmp_path):
    """Build breaks cannot land: compile and link two catalog entries (one per dtype) for sm90."""
    command = [sys.executable, os.path.join(ROOT, "csrc", "build_native.py"), "--archs", "90", "--jobs", "2",
               "--only", "t64x128_d128_(bf16|fp16)_s2|hopper8qk_t128x128_d128_bf16_s2", "--out", str(tmp_path / "lib"), "--build-dir", str(tmp_path / "b")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "lib" / "libtessera_kernels.so").stat().st_size > 0
    log = (tmp_path / "b" / "ptxas.log").read_text()
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)  # nothing changed: relink only
    assert again.returncode == 0 and "compiling 0 of" in again.stdout, again.stdout[-3000:]
    assert (tmp_path / "b" / "ptxas.log").read_text().count("(reused)") == log.count("\n== ") + 1
    assert "bytes spill stores" in log
    assert build_native_module().compiler_warnings(log) == []  # the native build compiles without warnings
    manifest = json.loads((tmp_path / "lib" / "manifest.json").read_text())
    assert len(manifest["kernel_sources"]) == 16  # what a plan table's profile is checked against
    assert len(manifest["grouping_sources"]) == 16 and manifest["grouping_sources"] != manifest["kernel_sources"]
    if importlib.util.find_spec("cutlass_library") is not None:  # the Hopper family builds with CuTe headers
        hopper = [name for name in manifest["kernels"] if name.startswith("hopper_")]
        assert len(hopper) == 2, manifest["kernels"]
        # The 8-bit kernels and their C entry points build and link beside them, hashed apart.
        assert manifest["quantized_kernels"] == ["hopper8qk_t128x128_d128_bf16_s2_w8_sm90a"]
        assert len(manifest["quantized_sources"]) == 16 and manifest["quantized_sources"] != manifest["kernel_sources"]
        # Each Hopper entry function compiles without local-memory spills (a regression guard: a
        # spilling consumer warpgroup loses a third of its speed).
        entries = log.split("Compiling entry function")[1:]
        hopper_entries = [e for e in entries if "hopper" in e.split("\n")[0]]
        assert len(hopper_entries) >= 2
        for entry in hopper_entries:
            assert "0 bytes spill stores, 0 bytes spill loads" in entry, entry[:600]


def test_a_library_source_hash_is_asked_for_by_its_manifest_name():
    from tessera_diffusers import library
    from tessera_diffusers.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="part"):
        library.kernel_sources("attention_sources")
    for part in library.SOURCE_HASHES:
        value = library.kernel_sources(part)  # None without a library or in an older manifest
        assert value is None or len(value) == 16


def test_pip_install_compiles_the_kernels_where_a_gpu_is_visible_or_when_asked():
    """A GPU-less machine (a newcomer's laptop, CI) installs in seconds instead of compiling the
    catalog; TESSERA_CUDA_ARCHS builds anyway (a wheel, an image) or never."""
    build = build_native_module()
    archs, why = build.install_archs({}, gpu=False)
    assert archs is None and "no NVIDIA GPU" in why and "TESSERA_CUDA_ARCHS" in why and "tessera build" in why
    assert build.install_archs({}, gpu=True)[0] == build.DEFAULT_ARCHS
    assert build.install_archs({"TESSERA_CUDA_ARCHS": "90"}, gpu=False)[0] == "90"
    assert build.install_archs({"TESSERA_CUDA_ARCHS": "none"}, gpu=True)[0] is None
    assert isinstance(build.gpu_visible(), bool)
