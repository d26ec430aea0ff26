"""Build the native kernel library (a torch-free shared object with a plain C ABI).

Run by setup.py (``pip install .``) and usable on its own:

    python csrc/build_native.py --out tessera_diffusers/_native [--archs "80;90"] [--only REGEX] [--jobs N]

One translation unit per kernel row of ``tessera_diffusers/kernel_table.py`` is generated (so nvcc
runs in parallel), plus ``library.cu`` with the C ABI; with an sm90 target also the 8-bit kernels'
rows (``quantized_rows``) and ``quantized.cu`` with theirs. The manifest ``manifest.json`` lists
what was compiled; the runtime checks it against the kernel table.

Rebuilds are incremental: an object is compiled again only when its nvcc command changed or a file
it includes (nvcc's own dependency list, ``-MD``) is newer than it, so an edit of one header
recompiles the translation units that include it. ``--rebuild`` compiles everything.

Environment: ``TESSERA_CUDA_ARCHS`` ("80;90" by default; "none" skips the build), ``MAX_JOBS``,
``NVCC`` (path to nvcc), ``TESSERA_NVCC_FLAGS`` (extra nvcc flags; they enter the source hashes),
``TESSERA_PV_FORMATS`` (the 8-bit kernels' P V formats to compile, comma-separated keys of
``kernel_table.QUANTIZED_FAMILIES``: by default only the one ``precision="int8"`` runs,
``DEFAULT_PV``; "bf16,int8" adds the comparison kernels with an 8-bit P V).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIBRARY_NAME = "libtessera_kernels.so"
DEFAULT_ARCHS = "80;90"
# The grouping kernel's own sources (relative to csrc/), hashed apart from the attention kernels'
# (``grouping_sources`` of the manifest): the natural plans never run it, so a change to it leaves
# the plan table's natural keys valid. The headers it shares with the rest count in both hashes.
GROUPING_SOURCES = (
    "include/tessera/regroup.cuh", "include/tessera/prepare.cuh", "include/tessera/params.h", "kernels/library.cu")
GROUPING_ONLY = ("include/tessera/regroup.cuh",)  # left out of the attention kernels' hash
# The 8-bit path's own sources: the 16-bit kernels never include them, so they stay out of
# ``kernel_sources`` (an 8-bit change leaves the 16-bit plan table current) and make up
# ``quantized_sources`` with everything the 8-bit kernels include.
QUANTIZED_ONLY = ("include/tessera/quantized/", "kernels/quantized.cu")
HOPPER_GENCODE = ["-gencode=arch=compute_90a,code=sm_90a"]  # wgmma and setmaxnreg exist only in sm_90a


def load_kernel_table():
    """Import tessera_diffusers/kernel_table.py by path (the package itself imports torch)."""
    path = os.path.join(ROOT, "tessera_diffusers", "kernel_table.py")
    spec = importlib.util.spec_from_file_location("tessera_kernel_table", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def gpu_visible() -> bool:
    """Whether this machine shows an NVIDIA GPU (its driver's device nodes or ``nvidia-smi -L``)."""
    if glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "GPU" in listed


def install_archs(environ: dict | None = None, gpu: bool | None = None) -> tuple[str | None, str]:
    """The archs ``pip install`` compiles, or None and why not: ``TESSERA_CUDA_ARCHS`` when set
    (``none`` skips), else the default archs where a GPU is visible. Without one a newcomer's
    install takes seconds, not the catalog's compile; the first use on a GPU then names the
    command that builds the kernels."""
    environ = os.environ if environ is None else environ
    archs = environ.get("TESSERA_CUDA_ARCHS")
    if archs is not None:
        if archs.strip().lower() in ("none", "off", "0", ""):
            return None, "TESSERA_CUDA_ARCHS=none: the native library is not built (reference path only)"
        return archs, f"TESSERA_CUDA_ARCHS={archs}"
    if not (gpu_visible() if gpu is None else gpu):
        return None, ("no NVIDIA GPU on this machine: the kernels are not compiled (the reference path runs "
                      "everything); TESSERA_CUDA_ARCHS=\"80;90\" pip install . compiles them anyway, "
                      "`tessera build` in a source checkout later")
    return DEFAULT_ARCHS, f"a GPU is visible: the default archs {DEFAULT_ARCHS}"


def find_nvcc() -> str | None:
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def arch_names(archs: str) -> list[str]:
    """``"80;90"`` or ``"80,90"`` -> ``["80", "90"]``."""
    return [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]


def gencode_flags(archs: str) -> list[str]:
    """``"80;90"`` -> SASS for each arch plus PTX of the newest, so later GPUs can JIT it."""
    flags, names = [], arch_names(archs)
    for a in names:
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    if names:
        newest = names[-1].rstrip("a")
        flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


def hashed_archs(archs: str) -> str:
    """The arch list the source hashes name: the default one for a build of some of its archs, the
    build's own otherwise. Such a build compiles each of its targets as the default build does
    (nvcc compiles every target on its own), so on a GPU it has kernels for they are the same
    machine code, and a plan table profiled on the default build fits them: narrowing the build
    (``TESSERA_CUDA_ARCHS=90``) must not call the table stale. A GPU the narrowed build has no
    kernels for cannot use the table anyway: its Hopper kernels are missing (the catalog check) or
    nothing loads."""
    names = arch_names(archs)
    return DEFAULT_ARCHS if names and set(names) <= set(arch_names(DEFAULT_ARCHS)) else archs


PORTABLE_TYPES = {"bf16": "__nv_bfloat16", "fp16": "__half"}
CUTLASS_TYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}


def traits_of(row) -> str:
    """The C++ traits type of one kernel row."""
    families = load_kernel_table().QUANTIZED_FAMILIES
    if row.family in families.values():  # kPv16: the family with a 16-bit P V
        return (f"tessera::quantized::Traits<{row.tile_q}, {row.tile_kv}, {row.head_dim}, {row.stages}, "
                f"{CUTLASS_TYPES[row.dtype]}, {'true' if row.family == families['bf16'] else 'false'}>")
    if row.family == "hopper":
        return (f"tessera::hopper::Traits<{row.tile_q}, {row.tile_kv}, {row.head_dim}, {row.stages}, "
                f"{CUTLASS_TYPES[row.dtype]}>")
    return (f"tessera::portable::Traits<{row.tile_q}, {row.tile_kv}, {row.head_dim}, {row.warps}, {row.stages}, "
            f"{PORTABLE_TYPES[row.dtype]}>")


def instantiation_source(row) -> str:
    if row.family in load_kernel_table().QUANTIZED_FAMILIES.values():
        return quantized_instantiation_source(row)
    header = "tessera/hopper/attention.cuh" if row.family == "hopper" else "tessera/portable/attention.cuh"
    if row.family == "hopper":  # encodes its TMA descriptors before the launch
        launch = f"return tessera::hopper::launch<Traits_{row.name}>(p, stream);"
    else:
        launch = (f"return tessera::launch_tasks(kernel_{row.name}, Traits_{row.name}::kThreads, "
                  f"Traits_{row.name}::kSmemBytes, p, stream);")
    return f"""// Generated by csrc/build_native.py from tessera_diffusers/kernel_table.py. Do not edit.
#include "{header}"

namespace tessera::generated {{
using Traits_{row.name} = {traits_of(row)};
constexpr auto kernel_{row.name} = tessera::{row.family}::attention_kernel<Traits_{row.name}>;
int launch_{row.name}(const TesseraAttnParams& p, cudaStream_t stream) {{
  {launch}
}}
int ctas_per_sm_{row.name}() {{
  return tessera::occupancy(kernel_{row.name}, Traits_{row.name}::kThreads, Traits_{row.name}::kSmemBytes);
}}
int smem_bytes_{row.name}() {{ return Traits_{row.name}::kSmemBytes; }}
int threads_{row.name}() {{ return Traits_{row.name}::kThreads; }}
tessera::KernelLimits limits_{row.name}() {{ return tessera::kernel_limits<Traits_{row.name}>(); }}
}}  // namespace tessera::generated
"""


def quantized_instantiation_source(row) -> str:
    return f"""// Generated by csrc/build_native.py from tessera_diffusers/kernel_table.py. Do not edit.
#include "tessera/quantized/attention.cuh"

namespace tessera::generated {{
using Traits_{row.name} = {traits_of(row)};
int launch_{row.name}(const TesseraQuantizedParams& p, cudaStream_t stream) {{
  return tessera::quantized::launch<Traits_{row.name}>(p, stream);
}}
int ctas_per_sm_{row.name}() {{
  return tessera::occupancy(tessera::quantized::attention_kernel<Traits_{row.name}>, Traits_{row.name}::kThreads,
                            Traits_{row.name}::kSmemBytes);
}}
int smem_bytes_{row.name}() {{ return Traits_{row.name}::kSmemBytes; }}
tessera::quantized::KernelLimits limits_{row.name}() {{
  return tessera::quantized::kernel_limits<Traits_{row.name}>();
}}
}}  // namespace tessera::generated
"""


def quantized_registry_source(rows) -> str:
    """The 8-bit kernels as C++ for ``quantized.cu``: declarations and TESSERA_QUANTIZED_ENTRIES."""
    decls, entries = [], []
    for r in rows:
        decls += [f"int launch_{r.name}(const TesseraQuantizedParams&, cudaStream_t);",
                  f"int ctas_per_sm_{r.name}();", f"int smem_bytes_{r.name}();",
                  f"tessera::quantized::KernelLimits limits_{r.name}();"]
        entries.append(
            f'  {{"{r.name}", &tessera::generated::smem_bytes_{r.name}, &tessera::generated::launch_{r.name}, '
            f"&tessera::generated::ctas_per_sm_{r.name}, &tessera::generated::limits_{r.name}}},")
    return (
        "// Generated by csrc/build_native.py from tessera_diffusers/kernel_table.py. Do not edit.\n"
        "namespace tessera::generated {\n" + "\n".join(decls) + "\n}  // namespace tessera::generated\n\n"
        "#define TESSERA_QUANTIZED_ENTRIES \\\n" + " \\\n".join(entries) + "\n"
    )


def registry_source(rows) -> str:
    """The kernel table as C++: declarations and one TESSERA_KERNEL_ENTRIES initializer list (the
    registry never includes kernel headers, so it compiles for any architecture; ``KernelLimits``
    comes from tessera/tasks.cuh, which library.cu includes first)."""
    decls, entries = [], []
    for r in rows:
        for fn in ("launch", "ctas_per_sm", "smem_bytes", "threads"):
            args = "const TesseraAttnParams&, cudaStream_t" if fn == "launch" else ""
            decls.append(f"int {fn}_{r.name}({args});")
        decls.append(f"tessera::KernelLimits limits_{r.name}();")
        entries.append(
            f'  {{"{r.name}", &tessera::generated::smem_bytes_{r.name}, &tessera::generated::threads_{r.name}, '
            f"&tessera::generated::launch_{r.name}, &tessera::generated::ctas_per_sm_{r.name}, "
            f"&tessera::generated::limits_{r.name}}},"
        )
    return (
        "// Generated by csrc/build_native.py from tessera_diffusers/kernel_table.py. Do not edit.\n"
        "namespace tessera::generated {\n" + "\n".join(decls) + "\n}  // namespace tessera::generated\n\n"
        "#define TESSERA_KERNEL_ENTRIES \\\n" + " \\\n".join(entries) + "\n"
    )


def cutlass_include() -> str | None:
    """CuTe/CUTLASS headers from the nvidia-cutlass package (or CUTLASS_INCLUDE), for the Hopper family."""
    env = os.environ.get("CUTLASS_INCLUDE")
    if env and os.path.isdir(env):
        return env
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "source", "include")
    return path if os.path.isdir(os.path.join(path, "cute")) else None


def compile_one(nvcc: str, source: str, obj: str, flags: list[str], stamp: str = "") -> tuple[str, float, str]:
    """Compile ``source`` into ``obj`` (and its dependency list ``obj.d``), then write ``stamp``
    (``command_stamp``: what made it) to ``obj.cmd``; ``(source, seconds, stderr)``."""
    start = time.time()
    cmd = [nvcc, "-c", source, "-o", obj, "-MD", "-MF", obj + ".d"] + flags
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {os.path.basename(source)}:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
    with open(obj + ".cmd", "w") as f:
        f.write(stamp)
    with open(obj + ".log", "w") as f:  # ptxas -v of this object, for ptxas.log when it is reused
        f.write(proc.stderr)
    return source, time.time() - start, proc.stderr


def compiler_warnings(stderr: str) -> list[str]:
    """The warning lines of an nvcc run's stderr (the rest is ``ptxas -v`` information)."""
    return [line.strip() for line in stderr.splitlines() if re.search(r"\bwarning\b", line, re.IGNORECASE)]


def command_stamp(nvcc: str, nvcc_version: str, source: str, flags: list[str]) -> str:
    """What an object is made by: the compiler (path and version: an update in place counts) and
    the command line."""
    return "\0".join([nvcc, nvcc_version, source] + flags)


def depfile_paths(text: str) -> list[str]:
    """The prerequisites of a make rule as nvcc ``-MD`` writes it (``obj : a.cu \\ h.cuh ...``)."""
    body = text.replace("\\\n", " ")
    _, _, prerequisites = body.partition(": ")
    return prerequisites.split()


def object_is_current(stamp: str, obj: str) -> bool:
    """Whether ``obj`` was made by the command of ``stamp`` (``command_stamp``) from files none of
    which changed since: its stamp matches and no file of its dependency list is newer than it (or
    gone)."""
    try:
        built = os.path.getmtime(obj)
        with open(obj + ".cmd") as f:
            if f.read() != stamp:
                return False
        with open(obj + ".d") as f:
            deps = depfile_paths(f.read())
        if not os.path.exists(obj + ".log"):
            return False
        return bool(deps) and all(os.path.getmtime(d) <= built for d in deps)
    except OSError:
        return False


def build_native_library(
    out_dir: str,
    archs: str | None = None,
    only: str | None = None,
    jobs: int | None = None,
    log=lambda msg, level=2: print(msg, flush=True),
    build_dir: str | None = None,
    rebuild: bool = False,
) -> str | None:
    """Compile the catalog into ``out_dir/libtessera_kernels.so``; returns its path or None when
    skipped (no nvcc, or TESSERA_CUDA_ARCHS=none). Objects that are current (``object_is_current``)
    are reused unless ``rebuild``."""
    archs = archs or os.environ.get("TESSERA_CUDA_ARCHS", DEFAULT_ARCHS)
    if archs.strip().lower() in ("none", "off", "0", ""):
        log("tessera: TESSERA_CUDA_ARCHS=none, skipping the native library (reference path only)", 2)
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        log("tessera: nvcc not found, skipping the native library (reference path only)", 2)
        return None
    rows = kernel_rows(archs, only, log)
    quantized = quantized_kernel_rows(archs, only)
    cutlass = cutlass_include()
    build_dir = build_dir or os.path.join(ROOT, "build", "native")
    gen_dir = os.path.join(build_dir, "generated")
    os.makedirs(gen_dir, exist_ok=True)
    os.makedirs(out_dir, exist_ok=True)

    common = common_flags(gen_dir, cutlass)
    portable_flags = common + gencode_flags(archs)
    hopper_flags = common + HOPPER_GENCODE

    sources = []
    for r in rows + quantized:
        path = os.path.join(gen_dir, f"{r.name}.cu")
        write_if_changed(path, instantiation_source(r))
        sources.append((path, portable_flags if r.family == "portable" else hopper_flags))
    write_if_changed(os.path.join(gen_dir, "registry.inc"), registry_source(rows))
    sources.append((os.path.join(HERE, "kernels", "library.cu"), portable_flags))
    if quantized:
        write_if_changed(os.path.join(gen_dir, "registry_quantized.inc"), quantized_registry_source(quantized))
        sources.append((os.path.join(HERE, "kernels", "quantized.cu"), portable_flags))

    jobs = jobs or int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    nvcc_version = nvcc_version_line(nvcc)
    objects, ptxas_logs, stale = [], {}, []
    for src, flags in sources:
        obj = os.path.join(build_dir, os.path.basename(src).replace(".cu", ".o"))
        objects.append(obj)
        stamp = command_stamp(nvcc, nvcc_version, src, flags)
        if not rebuild and object_is_current(stamp, obj):
            with open(obj + ".log") as f:
                ptxas_logs[src] = f"== {os.path.basename(src)} (reused)\n{f.read()}"
        else:
            stale.append((src, obj, flags, stamp))
    reused = len(sources) - len(stale)
    log(f"tessera: compiling {len(stale)} of {len(sources)} translation units ({len(rows) + len(quantized)} kernels) "
        f"for sm {archs} "
        f"with {jobs} jobs" + (f"; {reused} are current" if reused else ""), 2)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(compile_one, nvcc, src, obj, flags, stamp): src for src, obj, flags, stamp in stale}
        for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            src, seconds, stderr = fut.result()
            ptxas_logs[src] = f"== {os.path.basename(src)} ({seconds:.0f}s)\n{stderr}"
            log(f"tessera: [{done}/{len(stale)}] {os.path.basename(src)} {seconds:.0f}s", 2)
            for line in compiler_warnings(stderr):  # the build is meant to have none: show each
                log(f"tessera: {os.path.basename(src)}: {line}", 1)

    lib = os.path.join(out_dir, LIBRARY_NAME)
    link = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "-o", lib] + objects
    proc = subprocess.run(link, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"link failed:\n{' '.join(link)}\n{proc.stderr[-4000:]}")
    with open(os.path.join(build_dir, "ptxas.log"), "w") as f:
        f.write("\n".join(ptxas_logs[src] for src, _ in sources))
    manifest = {
        "abi_version": abi_version(),
        "archs": archs,
        "kernels": [r.name for r in rows],
        "kernel_table_hash": hashlib.sha256("\n".join(r.name for r in rows).encode()).hexdigest()[:16],
        "quantized_kernels": [r.name for r in quantized],
        **source_hashes(rows, archs, common, nvcc_version, quantized),
        "nvcc": nvcc_version,
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    log(f"tessera: built {lib}", 2)
    return lib


def kernel_rows(archs: str, only: str | None = None, log=lambda msg, level=2: None) -> list:
    """The kernel table's rows a build for ``archs`` compiles (``only``: a regex over their names):
    the Hopper family only with an sm90 target and the CuTe headers."""
    rows = [r for r in load_kernel_table().all_rows() if only is None or re.search(only, r.name)]
    arch_list = [a.rstrip("a") for a in arch_names(archs)]
    cutlass = cutlass_include()
    if "90" not in arch_list or cutlass is None:
        why = "no sm90 target" if "90" not in arch_list else "CuTe headers not found (pip install nvidia-cutlass)"
        if any(r.family == "hopper" for r in rows):
            log(f"tessera: skipping the Hopper family ({why})", 2)
        rows = [r for r in rows if r.family != "hopper"]
    if not rows:
        raise RuntimeError(f"no kernel matches --only {only!r} for archs {archs!r}")
    return rows


def pv_formats(environ=os.environ) -> tuple[str, ...]:
    """The P V formats whose 8-bit kernels a build compiles: ``TESSERA_PV_FORMATS`` or the product's
    ``DEFAULT_PV`` alone (the other formats' kernels serve comparisons only)."""
    table = load_kernel_table()
    value = environ.get("TESSERA_PV_FORMATS", "").strip()
    formats = tuple(dict.fromkeys(f.strip() for f in value.split(",") if f.strip())) if value else (table.DEFAULT_PV,)
    unknown = [f for f in formats if f not in table.QUANTIZED_FAMILIES]
    if unknown or not formats:
        raise RuntimeError(f"TESSERA_PV_FORMATS: expected comma-separated P V formats out of "
                           f"{sorted(table.QUANTIZED_FAMILIES)}, got {value!r}")
    return formats


def quantized_kernel_rows(archs: str, only: str | None = None) -> list:
    """The 8-bit kernels a build for ``archs`` compiles: with an sm90 target and the CuTe headers,
    those of the P V formats ``pv_formats`` names."""
    if "90" not in [a.rstrip("a") for a in arch_names(archs)] or cutlass_include() is None:
        return []
    table = load_kernel_table()
    formats = pv_formats()
    return [r for r in table.quantized_rows()
            if table.pv_format(r) in formats and (only is None or re.search(only, r.name))]


def common_flags(gen_dir: str, cutlass: str | None) -> list[str]:
    """The nvcc flags of every translation unit (the arch flags come on top)."""
    return [
        "-O3",
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        f"-I{os.path.join(HERE, 'include')}",
        f"-I{gen_dir}",
        "-Xptxas=-v",
    ] + ([f"-I{cutlass}"] if cutlass else []) + os.environ.get("TESSERA_NVCC_FLAGS", "").split()


def nvcc_version_line(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]


def planned_source_hashes(archs: str | None = None) -> dict[str, str]:
    """The two source hashes a build of ``archs`` (default: ``TESSERA_CUDA_ARCHS`` or the default
    archs) would write into its manifest, without compiling: whether an edit leaves the shipped
    plan table current can be checked on a machine without a GPU."""
    archs = archs or os.environ.get("TESSERA_CUDA_ARCHS", DEFAULT_ARCHS)
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found: the source hashes include its version")
    return source_hashes(kernel_rows(archs), archs, common_flags("", cutlass_include()), nvcc_version_line(nvcc),
                         quantized_kernel_rows(archs))


def source_hashes(rows, archs: str, common: list[str], nvcc_version: str, quantized=()) -> dict[str, str]:
    """The manifest's source hashes of a build of kernel ``rows`` (and 8-bit ``quantized`` rows)
    for ``archs`` with the ``common`` nvcc flags: ``kernel_sources`` (the 16-bit attention
    kernels), ``grouping_sources`` and, with 8-bit rows, ``quantized_sources``. The arch list
    enters as ``hashed_archs`` names it."""
    portable = common + gencode_flags(hashed_archs(archs))
    dirs = [os.path.join(HERE, "include"), os.path.join(HERE, "kernels")]
    flag_sets, tools = [portable, common + HOPPER_GENCODE], [nvcc_version, cutlass_version()]
    hashes = {
        "kernel_sources": kernel_sources_hash(dirs, {r.name: instantiation_source(r) for r in rows}, flag_sets, tools,
                                              exclude=GROUPING_ONLY + QUANTIZED_ONLY),
        "grouping_sources": grouping_sources_hash([portable], [nvcc_version]),
    }
    if quantized:
        hashes["quantized_sources"] = kernel_sources_hash(
            dirs, {r.name: instantiation_source(r) for r in quantized}, flag_sets, tools, exclude=GROUPING_ONLY)
    return hashes


def kernel_sources_hash(
    source_dirs: list[str], generated: dict[str, str], flag_sets: list[list[str]], tools: list[str],
    exclude: tuple[str, ...] = (),
) -> str:
    """What the compiled kernels are made of, as one short hash: every file under ``source_dirs``
    (relative names and code, ``code_text``) but those named in ``exclude`` (relative to the
    directories' parent; a name ending in ``/`` leaves out a directory), the generated instantiations, the nvcc flags (include paths left out:
    they name this machine) and the tool versions. A plan table profiled on a library with another
    hash ranked other kernels (``PlanTable.sources_mismatch``)."""
    digest = hashlib.sha256()
    for top in source_dirs:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                relative = os.path.relpath(path, os.path.dirname(top))
                if any(relative == e or (e.endswith("/") and relative.startswith(e)) for e in exclude):
                    continue
                digest.update(relative.encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(code_text(f.read()) + b"\0")
    for name, text in sorted(generated.items()):
        digest.update(f"{name}\0{text}\0".encode())
    return build_digest(digest, flag_sets, tools)


def grouping_sources_hash(flag_sets: list[list[str]], tools: list[str], root: str = HERE) -> str:
    """The grouping kernel's ``kernel_sources_hash``: the files of ``GROUPING_SOURCES`` under ``root``,
    the flags of ``library.cu`` and the tools."""
    digest = hashlib.sha256()
    for relative in GROUPING_SOURCES:
        digest.update(relative.encode() + b"\0")
        with open(os.path.join(root, relative), "rb") as f:
            digest.update(code_text(f.read()) + b"\0")
    return build_digest(digest, flag_sets, tools)


_CODE_TOKENS = re.compile(rb'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)


def code_text(source: bytes) -> bytes:
    """``source`` (C, C++ or CUDA) without its comments, trailing blanks and blank lines: what the
    compiler sees, so an edit of comments or layout leaves the source hashes, and the plan table
    profiled on them, current. String and character literals are kept as they are."""
    def keep(match: re.Match) -> bytes:
        token = match.group(0)
        if token.startswith(b"//"):
            return b""
        if token.startswith(b"/*"):
            return b" " if b"\n" not in token else b"\n"
        return token

    lines = (line.rstrip() for line in _CODE_TOKENS.sub(keep, source).split(b"\n"))
    return b"\n".join(line for line in lines if line)


def build_digest(digest, flag_sets: list[list[str]], tools: list[str]) -> str:
    """``digest`` (a sha256 of the sources) with the nvcc flags (include paths left out: they name
    this machine) and the tool versions, as the 16 hex digits of a source hash."""
    for flags in flag_sets:
        digest.update(" ".join(f for f in flags if not f.startswith("-I")).encode() + b"\0")
    for tool in tools:
        digest.update(f"{tool}\0".encode())
    return digest.hexdigest()[:16]


def cutlass_version() -> str:
    """The installed ``nvidia-cutlass`` (the CuTe headers of the Hopper family), or "none"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"nvidia-cutlass {version('nvidia-cutlass')}"
    except PackageNotFoundError:
        return "none"


def abi_version() -> int:
    """``TESSERA_ABI_VERSION`` of params.h (what the compiled library reports)."""
    with open(os.path.join(HERE, "include", "tessera", "params.h")) as f:
        return int(re.search(r"#define TESSERA_ABI_VERSION (\d+)", f.read()).group(1))


def write_if_changed(path: str, text: str) -> None:
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "tessera_diffusers", "_native"))
    parser.add_argument("--archs", default=None)
    parser.add_argument("--only", default=None, help="regex over kernel names (a smoke subset)")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--build-dir", default=None)
    parser.add_argument("--rebuild", action="store_true", help="compile every translation unit, current or not")
    args = parser.parse_args(argv)
    lib = build_native_library(args.out, args.archs, args.only, args.jobs, build_dir=args.build_dir,
                               rebuild=args.rebuild)
    return 0 if lib else 1


if __name__ == "__main__":
    sys.exit(main())
