"""Reports: the environment header, ``results.json``, ``results.md`` and matplotlib plots."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from ..corpus import FAMILIES, NINE_FAMILIES
from .config import SIZE_PROFILES, BenchConfig
from .flashinfer_backends import flashinfer_version
from .metrics import BEST_PLAN, DENSE_YARDSTICK, FLASHINFER_BEST, TESSERA
from .timing import INTERLEAVED_WARM_LAUNCHES

FAMILY_ORDER = [f.name for f in FAMILIES]
# Columns of the family tables, in this order when present.
COLUMN_ORDER = (DENSE_YARDSTICK, "sdpa-fa2", "flex", "flex-tuned", FLASHINFER_BEST, "flashinfer-bsr-fa2", "flashinfer-bsr-fa3",
                "flashinfer-var-fa2", "flashinfer-var-fa3", "vsa", "flex-block-attn", "reference", TESSERA, BEST_PLAN)


def command_output(args: list[str]) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    text = done.stdout.strip()
    return text or None


def source_commit(root: Path) -> str | None:
    """The commit of the checkout at ``root``, or None when ``root`` is not the top of a git work
    tree (a copy of the sources inside another repository would otherwise report that one's HEAD)."""
    top = command_output(["git", "-C", str(root), "rev-parse", "--show-toplevel"])
    if top is None or Path(top).resolve() != root.resolve():
        return None
    return command_output(["git", "-C", str(root), "rev-parse", "--short", "HEAD"])


def package_version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version(name)
    except (ImportError, PackageNotFoundError):
        return None


def environment(device: torch.device) -> dict:
    """GPU, driver and library versions for the report header."""
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": package_version("triton"),
        "flashinfer": flashinfer_version(),
        "fastvideo_kernel": package_version("fastvideo-kernel"),
        "flex_block_attn": package_version("flex_block_attn"),
        "spas_sage_attn": package_version("spas_sage_attn"),
        "tessera_diffusers": package_version("tessera-diffusers"),
        "git_commit": source_commit(Path(__file__).resolve().parents[2]),
        "device": str(device),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            capability=f"sm{props.major}{props.minor}",
            sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            driver=command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            clocks=command_output(["nvidia-smi", "--query-gpu=clocks.max.sm,clocks.max.mem", "--format=csv,noheader"]),
        )
        if env["driver"]:
            env["driver"] = env["driver"].splitlines()[0]
    else:
        env.update(gpu=None, driver=None, cpu_threads=torch.get_num_threads(), cpu_count=os.cpu_count())
    return env


def config_dict(config: BenchConfig) -> dict:
    out = {}
    for key, value in config.__dict__.items():
        out[key] = str(value) if isinstance(value, Path) else (list(value) if isinstance(value, tuple) else value)
    return out


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}f}".rstrip("0").rstrip(".")


def ordered_columns(present: set[str]) -> list[str]:
    cols = [c for c in COLUMN_ORDER if c in present]
    return cols + sorted(present - set(cols))


def family_sort(families: list[str]) -> list[str]:
    return sorted(families, key=lambda f: FAMILY_ORDER.index(f) if f in FAMILY_ORDER else len(FAMILY_ORDER))


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def metric_table(families: dict, size: str, metric: str, digits: int = 3) -> list[str]:
    fams = families.get(size, {})
    present = {b for fam in fams.values() for b in fam}
    cols = ordered_columns(present)
    rows = []
    for family in family_sort(list(fams)):
        entry = fams[family]
        density = next((v["density"] for v in entry.values() if v.get("density") is not None), None)
        cases = max(v["cases"] for v in entry.values())
        rows.append([family, str(cases), fmt(100 * density if density is not None else None, 3)]
                    + [fmt(entry[c][metric], digits) if c in entry else "-" for c in cols])
    return table(["family", "cases", "density %"] + cols, rows)


def quantized_table(records: list[dict]) -> list[str]:
    """Every 8-bit record's agreement with the fp32 oracle (its checked heads), within the budget
    or not (a peer outside it is still timed); no lines without 8-bit records."""
    rows = [[r["case"], r["backend"], f"{r['check']['cosine']:.5f}", f"{r['check']['relative_l2']:.4f}",
             "yes" if r["check"]["ok"] else "no"]
            for r in records if r.get("kind") == "quantized" and "cosine" in r.get("check", {})]
    if not rows:
        return []
    from ..quantized import MAX_RELATIVE_L2, MIN_COSINE

    title = f"## 8-bit agreement with the fp32 oracle (budget: cosine >= {MIN_COSINE}, relative L2 <= {MAX_RELATIVE_L2})"
    return [title, ""] + table(["case", "backend", "cosine", "relative L2", "within budget"], rows) + [""]


def speedup_table(speedups: dict, size: str) -> list[str]:
    baselines = sorted(b for b in speedups if size in speedups[b])
    families = family_sort(sorted({f for b in baselines for f in speedups[b][size]["families"]}))
    rows = []
    for b in baselines:
        s = speedups[b][size]
        cells = [fmt(s["families"][f]["speedup"]) if f in s["families"] else "-" for f in families]
        nine = fmt(s["nine_family_gm"]) + ("" if s["nine_families_present"] == len(NINE_FAMILIES)
                                           else f" ({s['nine_families_present']}/9)")
        rows.append([b] + cells + [nine, fmt(s["paired_case_gm"]), f"{s['win']}/{s['tie']}/{s['loss']}"])
    return table(["baseline"] + families + ["nine-family GM", "paired-case GM", "win/tie/loss"], rows)


def kernel_study(summary: dict, size: str) -> list[str]:
    """Best single Tessera plan per family beside FlexAttention and dense FA2 (the issue-3 view)."""
    fams = summary["families"].get(size, {})
    rows = []
    for family in family_sort(list(fams)):
        entry = fams[family]
        best = entry.get(BEST_PLAN)
        if best is None:
            continue
        flex, fa2 = entry.get("flex"), entry.get("sdpa-fa2")
        rows.append([
            family,
            ", ".join(best["variants"]),
            fmt(best["kernel_ms"]),
            fmt(best["tflops"]),
            fmt(flex["kernel_ms"]) if flex else "-",
            fmt(flex["kernel_ms"] / best["kernel_ms"]) if flex else "-",
            fmt(100 * best["tflops"] / fa2["tflops"], 3) if fa2 else "-",
        ])
    if not rows:
        return []
    return table(["family", "best plan", "ms", "eff. TFLOP/s", "flex ms", "speedup vs flex", "% of dense FA2 TFLOP/s"],
                 rows)


def peer_versions(env: dict) -> str:
    """``, fastvideo-kernel (VSA) X, flex-block-attn Y, ...`` for the peers installed (nothing otherwise)."""
    peers = (("fastvideo_kernel", "fastvideo-kernel (VSA)"), ("flex_block_attn", "flex-block-attn"),
             ("spas_sage_attn", "spas_sage_attn (SpargeAttn)"))
    return "".join(f", {label} {env[key]}" for key, label in peers if env.get(key))


def header_lines(env: dict, config: BenchConfig, records: list[dict] = ()) -> list[str]:
    """The environment and protocol lines that open every report (the timing method as the records
    say, so that a report rebuilt with ``--report-only`` names the method of the measuring run)."""
    gpu = env.get("gpu") or "no GPU (CPU run)"
    device = (f"- device: {gpu} {env.get('capability', '')} ({env.get('sms', '-')} SMs, "
              f"{env.get('gpu_memory_gib', '-')} GiB), driver {env.get('driver') or '-'}, "
              f"clocks {env.get('clocks') or '-'}")
    versions = (f"- torch {env['torch']} (CUDA {env['cuda_runtime'] or '-'}, cuDNN {env['cudnn'] or '-'}), "
                f"triton {env['triton'] or '-'}, flashinfer {env['flashinfer'] or 'not installed'}, "
                f"python {env['python']}" + peer_versions(env))
    if config.full:
        sizes = "- sizes: the whole evaluation split"
    else:
        sizes = "- sizes: " + "; ".join(f"{s}: {SIZE_PROFILES[s].description}" for s in config.sizes)
    timer = "CUDA-event" if env.get("gpu") else "host-clock"
    if config.interleave or any(r.get("timing_method") == "interleaved" for r in records):
        warm = (f"at least {INTERLEAVED_WARM_LAUNCHES} warm-up launches, every valid backend of a case timed in "
                "turn with the device kept busy (dense baselines on every case)")
    else:
        warm = f"{config.warmup} warm-ups" + (f" and {config.warmup_ms:g} ms of sustained warm-up"
                                              if config.warmup_ms else "") + ", each backend right after its setup"
    protocol = (f"- {config.dtype}, D={config.head_dim}, batch {config.batch}; kernel latency = median of "
                f"{config.reps} {timer} timings after {warm}, over {config.input_sets} rotated "
                f"input sets; complete request = median of {config.request_reps} host-clock timings; every output "
                f"checked against the fp32 oracle on {config.validate_heads} heads before it is timed")
    return [
        f"# Tessera benchmark ({config.mode})",
        "",
        f"- date: {env['date_utc']}, host: {env['host']}",
        device,
        versions,
        f"- tessera-diffusers {env['tessera_diffusers'] or '-'} at commit {env['git_commit'] or '-'}",
        sizes,
        protocol,
        "",
    ]


DERIVED_NOTE = (
    "Derived rows: `flashinfer-best` = per family the FlashInfer variant with the lowest mean latency (among those "
    "that ran on the most cases); `tessera-best-plan` = per family the single catalog plan with the lowest mean "
    "latency among plans valid on all its cases."
)


def markdown(env: dict, config: BenchConfig, records: list[dict], summary: dict, unavailable: dict) -> str:
    lines = header_lines(env, config, records)
    if unavailable:
        lines += ["**Not run:** " + "; ".join(f"`{k}`: {v}" for k, v in unavailable.items()), ""]
    families = summary["families"]
    sections = (
        ("Kernel latency (ms, mean over cases)", "kernel_ms"),
        ("Effective TFLOP/s (4·D·|E(M)| / time; dense rows: the full matrix)", "tflops"),
        ("Efficiency (effective TFLOP/s over the same run's dense cuDNN TFLOP/s)", "efficiency"),
        ("Complete-request latency (ms: mask preprocessing or plan() + layout + kernel, host clock)", "request_ms"),
    )
    for size in sorted(families):
        lines += [f"## {size}", ""]
        for title, metric in sections:
            lines += [f"### {title}", ""] + metric_table(families, size, metric) + [""]
        band = f"{100 * summary['tie_band']:.0f}%"
        for target, by_baseline in summary["speedups"].items():
            if any(size in v for v in by_baseline.values()):
                title = f"### Speedup of `{target}` (baseline mean / {target} mean over paired cases; tie band {band})"
                lines += [title, ""] + speedup_table(by_baseline, size) + [""]
        study = kernel_study(summary, size)
        if study:
            lines += ["### Kernel study: best single Tessera plan per family", ""] + study + [""]
    lines += quantized_table(records)
    regret = summary["regret"]
    if regret["cases"]:
        stats = (f"cases {len(regret['cases'])}, median {fmt(regret['median'])}, P90 {fmt(regret['p90'])}, "
                 f"max {fmt(regret['max'])}, within 5%: {fmt(100 * regret['within_5pct'], 3)}%")
        lines += ["## Regret (selected plan / fastest measured plan)", "", stats, ""]
    rows = []
    for backend, entry in sorted(summary["status"].items()):
        reasons = "<br>".join(r.replace("|", "/") for r in entry["reasons"][:3]) or "-"
        rows.append([backend, str(entry["ok"]), str(entry["skipped"]), str(entry["invalid"]), str(entry["failed"]),
                     str(entry["nonzero_empty_rows"]), fmt(entry["max_first_call_s"]), reasons])
    lines += ["## Status per backend", ""]
    header = ["backend", "ok", "skipped", "invalid", "failed", "empty rows not 0", "first call s (max, incl. JIT)",
              "reasons (first)"]
    lines += table(header, rows)
    notes = sorted({n for r in records for n in r.get("notes", [])})
    if notes:
        lines += ["", "Notes: " + "; ".join(notes)]
    lines += ["", DERIVED_NOTE, ""]
    return "\n".join(lines)


def write_plots(out_dir: Path, summary: dict) -> list[str]:
    """speedup_vs_dense_<size>.png, tessera_speedup_<size>.png, latency_vs_density_<size>.png,
    regret_cdf.png (when regrets exist). Returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []

    def grouped_bars(name: str, families: list[str], bars: dict[str, list[float]], ylabel: str, title: str) -> None:
        """One bar per family and series (``bars``: label -> a value per family), a line at 1."""
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(families)), 4.5))
        width = 0.8 / max(1, len(bars))
        for i, (label, ys) in enumerate(bars.items()):
            ax.bar([x + i * width for x in range(len(families))], ys, width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(families))], families, rotation=30)
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        written.append(name)

    written: list[str] = []
    for size, fams in summary["families"].items():
        families = family_sort(list(fams))
        yardstick = DENSE_YARDSTICK if any(DENSE_YARDSTICK in fams[f] for f in families) else None
        if yardstick is None:  # CPU runs: relative to the first backend present
            present = ordered_columns({b for f in families for b in fams[f]})
            yardstick = present[0] if present else None
        if yardstick:
            backends = [b for b in ordered_columns({b for f in families for b in fams[f]}) if b != yardstick]
            bars = {b: [fams[f][yardstick]["kernel_ms"] / fams[f][b]["kernel_ms"] if b in fams[f] and yardstick in fams[f]
                        else 0 for f in families] for b in backends}
            grouped_bars(f"speedup_vs_dense_{size}.png", families, bars, f"kernel speedup over {yardstick}",
                         f"{size}: speedup per family over {yardstick}")
        for target, by_baseline in summary["speedups"].items():
            baselines = [b for b in sorted(by_baseline) if size in by_baseline[b]]
            if not baselines:
                continue
            bars = {b: [by_baseline[b][size]["families"][f]["speedup"] if f in by_baseline[b][size]["families"] else 0
                        for f in families] for b in baselines}
            grouped_bars(f"{target}_speedup_{size}.png", families, bars,
                         f"{target} speedup (baseline ms / {target} ms)", f"{size}: {target} speedup per family per baseline")
    return written


def write_scatter(out_dir: Path, records: list[dict]) -> list[str]:
    """latency_vs_density_<size>.png: kernel latency of every valid record against mask density."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    sizes = sorted({r["size"] for r in records})
    for size in sizes:
        rows = [r for r in records if r["size"] == size and r.get("status") == "ok" and r.get("density") is not None
                and not r["backend"].startswith("tessera:")]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for backend in ordered_columns({r["backend"] for r in rows}):
            pts = [(100 * r["density"], r["kernel_ms"]) for r in rows if r["backend"] == backend]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, label=backend)
        ax.set_xlabel("mask density (%)")
        ax.set_ylabel("kernel latency (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title(f"{size}: latency vs density")
        fig.tight_layout()
        path = out_dir / f"latency_vs_density_{size}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path.name)
    return written


def write_regret_cdf(out_dir: Path, summary: dict) -> list[str]:
    values = sorted(r["regret"] for r in summary["regret"]["cases"])
    if not values:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
    ax.set_xlabel("regret (selected / fastest measured plan)")
    ax.set_ylabel("fraction of cases")
    ax.set_title("regret CDF")
    fig.tight_layout()
    path = out_dir / "regret_cdf.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path.name]


def write_reports(out_dir: Path, config: BenchConfig, env: dict, records: list[dict], summary: dict,
                  unavailable: dict) -> list[str]:
    """results.json, results.md and the plots. Returns the file names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    payload = {"environment": env, "config": config_dict(config), "unavailable": unavailable, "summary": summary,
               "records": records}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    written.append("results.json")
    (out_dir / "results.md").write_text(markdown(env, config, records, summary, unavailable))
    written.append("results.md")
    if config.plots:
        written += write_plots(out_dir, summary)
        written += write_scatter(out_dir, records)
        written += write_regret_cdf(out_dir, summary)
    return written
