"""Shared pieces of the model examples (``wan21.py``, ``hunyuanvideo15.py``).

The command line, the checkpoint checks, where the pipeline runs (offloading, regional
compilation), installing Tessera the way the README does, timing the denoising steps, the summary
and writing the video. Each model script only builds its pipeline and its inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera_diffusers import TesseraProcessor
from tessera_diffusers.processors.context import Route
from tessera_diffusers.processors.processor import DEFAULT_WARMUP_STEPS
from tessera_diffusers.sparsifiers import spade_64, ssta_384, ssta_tuned

# ``--sparsifier`` names: "default" is the model's own default (what TesseraProcessor() picks);
# the others are the library's presets at their default budgets.
SPARSIFIERS = {"default": None, "spade_64": spade_64, "ssta_tuned": ssta_tuned, "ssta_384": ssta_384}
MP4_HINT = 'for an mp4, install the video extra: pip install ".[video]" (or: pip install imageio imageio-ffmpeg)'


@dataclass(frozen=True)
class Size:
    """A default video size in pixels and frames."""

    height: int
    width: int
    frames: int


# ------------------------------------------------------------------ command line
def build_parser(doc: str, *, prompt: str, out: str) -> argparse.ArgumentParser:
    """The options both model scripts share (``--help`` shows the script's docstring, commands
    included); the model source is one of --model, --random-weights, --tiny."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a diffusers checkpoint: hub id or local folder")
    source.add_argument("--random-weights", action="store_true", help="the real architecture, random weights (offline)")
    source.add_argument("--tiny", action="store_true", help="a tiny random model and pipeline: offline, CPU-sized")
    parser.add_argument("--image", type=Path, help="first frame: image-to-video (needs an I2V checkpoint)")
    parser.add_argument("--prompt", default=prompt)
    parser.add_argument("--layers", type=int, help="with --random-weights or --tiny: transformer blocks to build")
    parser.add_argument("--height", type=int, help="pixels (default 720; with --image the size follows the image)")
    parser.add_argument("--width", type=int, help="pixels (1280 by default)")
    parser.add_argument("--frames", type=int, help="video frames (4k + 1)")
    parser.add_argument("--steps", type=int, default=50, help="denoising steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cuda (default when available) or cpu; --tiny runs on the cpu")
    parser.add_argument("--offload", choices=("none", "model", "group"), default="none",
                        help="keep weights on the CPU: whole models (model) or layer groups (group); needs CUDA")
    parser.add_argument("--compile", action="store_true", help="torch.compile the repeated transformer blocks")
    parser.add_argument("--out", type=Path, default=Path(out), help="output .mp4 (PNG frames without the video extra)")
    attention = parser.add_argument_group("attention")
    attention.add_argument("--sparsifier", choices=tuple(SPARSIFIERS), default="default",
                           help="the masks' maker (default: the model's own default)")
    attention.add_argument("--warmup-steps", type=int,
                           help=f"dense steps before sparse attention (default: {DEFAULT_WARMUP_STEPS})")
    attention.add_argument("--dense", action="store_true", help="stock attention only (no Tessera)")
    attention.add_argument("--compare-dense", action="store_true",
                           help="also run stock attention (same seed and steps) and report Tessera's speedup")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, real: Size, tiny: Size) -> argparse.Namespace:
    """Parse, fill the mode's default size, device and dtype, and refuse contradictory options."""
    args = parser.parse_args(argv)
    size = tiny if args.tiny else real
    args.height = args.height or size.height
    args.width = args.width or size.width
    args.frames = args.frames or size.frames
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    args.dtype = torch.bfloat16 if args.device.type == "cuda" and not args.tiny else torch.float32
    problem = argument_problem(args)
    if problem:
        parser.error(problem)
    return args


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of options, or None."""
    if args.layers is not None and args.model:
        return "--layers builds a smaller model: use it with --random-weights or --tiny"
    if args.image is not None and args.tiny:
        return "--image needs an image-to-video model; the --tiny pipeline is text-to-video"
    if args.image is not None and not args.image.is_file():
        return f"--image {args.image}: no such file"
    if args.dense and (args.compare_dense or args.sparsifier != "default" or args.warmup_steps is not None):
        return "--dense runs stock attention only: drop --compare-dense, --sparsifier and --warmup-steps"
    if args.offload != "none" and args.device.type != "cuda":
        return (f"--offload {args.offload} moves weights between the CPU and a GPU, but the device is "
                f"{args.device.type}: use --offload none (or --device cuda on a GPU machine)")
    if args.steps < 1 or (args.warmup_steps or 0) < 0 or min(args.height, args.width, args.frames) < 1:
        return "--steps must be >= 1, --warmup-steps >= 0, and the video size positive"
    return None


def checkpoint_class(parser: argparse.ArgumentParser, model: str, known: tuple[str, ...]) -> str:
    """The pipeline class a checkpoint declares (its model_index.json, read before any weights)."""
    from diffusers import DiffusionPipeline

    try:
        name = DiffusionPipeline.load_config(model)["_class_name"]
    except Exception as err:  # noqa: BLE001 - a missing folder, an unknown hub id, no network: say which
        parser.error(f"--model {model}: no diffusers checkpoint found ({type(err).__name__}: {err})")
    if name not in known:
        parser.error(f"--model {model} is a {name} checkpoint; this example runs {' or '.join(known)}")
    return name


def check_task(parser: argparse.ArgumentParser, image_to_video: bool, image: Path | None, what: str) -> None:
    """Refuse --image for a text-to-video model, and a missing --image for an image-to-video one."""
    if image_to_video and image is None:
        parser.error(f"{what} is an image-to-video model: pass --image PATH (the first frame)")
    if not image_to_video and image is not None:
        parser.error(f"--image needs an image-to-video model; {what} is text-to-video")


def cast_like_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast a randomly built diffusers model to ``dtype`` as ``from_pretrained(torch_dtype=dtype)``
    does: the modules the class keeps in float32 (``_keep_in_fp32_modules``) stay in float32."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not keep & set(name.split(".")):
            tensor.data = tensor.data.to(dtype)
    return model.eval()


# ------------------------------------------------------------------ where the pipeline runs
def place(pipe: Any, args: argparse.Namespace) -> None:
    """Put the pipeline on the device whole (none), one model at a time (model: diffusers' model
    CPU offload), or as groups of layers streamed in from the CPU (group: diffusers' group
    offloading at leaf level, copies on a side stream); then compile if asked."""
    if args.offload == "none":
        pipe.to(args.device)
    elif args.offload == "model":
        pipe.enable_model_cpu_offload(device=args.device)
    else:
        pipe.enable_group_offload(
            onload_device=args.device, offload_device=torch.device("cpu"), offload_type="leaf_level", use_stream=True
        )
    if args.compile:
        # Regional compilation: the repeated blocks are compiled once and reused by every block;
        # each attention call is one opaque op in the graph (Tessera's host-side decisions run there).
        pipe.transformer.compile_repeated_blocks(fullgraph=True)


def tessera_processor(args: argparse.Namespace, route: Route) -> TesseraProcessor:
    """The processor the README installs: the model's defaults unless --sparsifier or
    --warmup-steps say otherwise. It times its attention calls for the summary."""
    preset = SPARSIFIERS[args.sparsifier]
    if preset is None:
        return TesseraProcessor(warmup_steps=args.warmup_steps, time_attention=True)
    steps = DEFAULT_WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps
    return TesseraProcessor(preset(), warmup_steps=steps, time_attention=True)


# ------------------------------------------------------------------ running and timing
class StepTimer:
    """Wall time of each denoising step and the final latents.

    The first transformer forward of a run starts the clock; the end of each step (the pipeline's
    ``callback_on_step_end``, or ``scheduler.step`` where the pipeline has no callback, as in
    HunyuanVideo-1.5) marks a lap. On a GPU each mark synchronizes first so that queued kernels count.
    """

    def __init__(self, pipe: Any, device: torch.device):
        self.device = device
        self.uses_callback = "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
        self.reset()
        pipe.transformer.register_forward_pre_hook(self.on_forward)
        if not self.uses_callback:
            self.wrap_scheduler(pipe.scheduler)

    def reset(self) -> None:
        self.start: float | None = None
        self.marks: list[float] = []
        self.latents: torch.Tensor | None = None

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if self.start is None:
            self.start = self.now()

    def step_end(self, latents: torch.Tensor) -> None:
        self.marks.append(self.now())
        self.latents = latents

    def callback(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
        self.step_end(callback_kwargs["latents"])
        return callback_kwargs

    def wrap_scheduler(self, scheduler: Any) -> None:
        step = scheduler.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            self.step_end(out[0] if isinstance(out, tuple) else out.prev_sample)
            return out

        scheduler.step = timed_step

    def pipeline_kwargs(self) -> dict:
        return {"callback_on_step_end": self.callback} if self.uses_callback else {}

    def step_seconds(self) -> list[float]:
        starts = [self.start, *self.marks[:-1]]
        return [end - start for start, end in zip(starts, self.marks)]


@dataclass
class Run:
    """One pipeline run: seconds per denoising step, final latents, decoded frames (or None)."""

    step_s: list[float]
    latents: torch.Tensor
    frames: Any


def generate(pipe: Any, timer: StepTimer, args: argparse.Namespace, inputs: dict, decode: bool) -> Run:
    """Run the pipeline with ``inputs`` for ``args.steps`` steps from ``args.seed``; without
    ``decode`` the latents are not decoded (the dense comparison needs only them)."""
    timer.reset()
    output = pipe(
        **inputs,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),
        output_type="np" if decode else "latent",
        **timer.pipeline_kwargs(),
    )
    return Run(timer.step_seconds(), timer.latents, output.frames[0] if decode else None)


def run_example(pipe: Any, args: argparse.Namespace, route: Route, inputs: dict, fps: int) -> dict:
    """Place the pipeline, install Tessera with the README's one-liner (unless --dense), run it,
    write the video, run stock attention for the comparison if asked, and print the summary.
    Returns the summary."""
    place(pipe, args)
    timer = StepTimer(pipe, args.device)
    stock = pipe.transformer.attn_processors
    processor = None if args.dense else tessera_processor(args, route)
    if processor is not None:
        pipe.transformer.set_attn_processor(processor)  # the README's one-liner
    run = generate(pipe, timer, args, inputs, decode=True)
    stats = None if processor is None else processor.stats()
    dense = None
    if args.compare_dense:
        pipe.transformer.set_attn_processor(stock)  # the same pipeline, seed and steps, stock attention
        dense = generate(pipe, timer, args, inputs, decode=False)
    summary = summarize(run, stats, dense)
    summary["out"] = save_video(run.frames, args.out, fps)
    print_summary(summary, args)
    return summary


# ------------------------------------------------------------------ summary
def steady_seconds(step_s: list[float]) -> float:
    """Denoising seconds without the first step, which carries one-time costs (compilation, CUDA
    and library start-up, plan-table loading); all steps when there is only one."""
    return sum(step_s[1:]) if len(step_s) > 1 else sum(step_s)


def summarize(run: Run, stats: dict | None, dense: Run | None) -> dict:
    """Seconds per step, Tessera's attention share and masks, and the comparison with stock attention."""
    denoise_s = sum(run.step_s)
    summary: dict[str, Any] = {
        "steps": len(run.step_s),
        "denoise_s": denoise_s,
        "s_per_step": denoise_s / len(run.step_s),
        "step_s": run.step_s,
        "video": tuple(run.frames.shape[:3]),  # frames, height, width as decoded
    }
    if stats is not None:
        summary.update(
            stats=stats,
            sparse_calls=stats["sparse_calls"],
            dense_calls=stats["dense_calls"],
            mean_mask_density=stats["mean_mask_density"],
            attention_s=stats["attention_ms"] / 1e3,
            attention_share=stats["attention_ms"] / 1e3 / denoise_s,
        )
    if dense is not None:
        summary["dense_denoise_s"] = sum(dense.step_s)
        summary["speedup"] = steady_seconds(dense.step_s) / steady_seconds(run.step_s)
        reference = dense.latents.float()
        summary["latents_rel_l2"] = float((run.latents.float() - reference).norm() / reference.norm())
    return summary


def print_summary(summary: dict, args: argparse.Namespace) -> None:
    """A few lines: time per step, attention share, masks, the comparison with stock attention."""
    steps, (frames, height, width) = summary["steps"], summary["video"]
    who = "stock attention" if args.dense else "Tessera"
    print(f"\n{who}: {steps} steps in {summary['denoise_s']:.2f} s, {summary['s_per_step']:.3f} s/step "
          f"({height}x{width}, {frames} frames, {args.device.type})")
    if "stats" in summary:
        print(f"  video attention {summary['attention_s']:.2f} s = {100 * summary['attention_share']:.0f} % of "
              f"denoising; {summary['sparse_calls']} sparse, {summary['dense_calls']} dense calls; "
              f"mean mask density {summary['mean_mask_density']:.3f}")
        print(f"  sparsifier: {', '.join(summary['stats']['sparsifiers'].values())}")
        if summary["sparse_calls"] == 0:
            print(f"  no sparse attention ran: all {steps} steps were dense warm-up steps (lower --warmup-steps)")
    if "speedup" in summary:
        span = {1: "one step", 2: "step 2"}.get(steps, f"steps 2-{steps}")
        costs = "one-time costs" + (", and with --compile the compilation" if args.compile else "")
        print(f"  stock attention: {summary['dense_denoise_s']:.2f} s; Tessera's speedup {summary['speedup']:.2f}x "
              f"({span}; the first step carries {costs}); final latents differ by "
              f"{100 * summary['latents_rel_l2']:.2f} % (relative L2)")
    print(f"  video: {summary['out']}")


# ------------------------------------------------------------------ saving
def video_writer_available() -> bool:
    """Whether diffusers can write mp4 here (imageio with its ffmpeg binary: the video extra)."""
    return all(importlib.util.find_spec(name) is not None for name in ("imageio", "imageio_ffmpeg"))


def save_video(frames: Any, path: Path, fps: int) -> Path:
    """Write ``frames`` (``[F, H, W, 3]`` floats in [0, 1]) as an mp4, or as PNG frames in
    ``<stem>_frames/`` when the video extra is not installed. Returns what was written."""
    from diffusers.utils import export_to_video

    path.parent.mkdir(parents=True, exist_ok=True)
    if video_writer_available():
        export_to_video(list(frames), str(path), fps=fps)
        return path
    from PIL import Image

    folder = path.with_name(path.stem + "_frames")
    folder.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        Image.fromarray((np.clip(frame, 0, 1) * 255).round().astype(np.uint8)).save(folder / f"{i:04d}.png")
    print(f"wrote {len(frames)} PNG frames to {folder}/; {MP4_HINT}")
    return folder
