"""The model examples run offline on the CPU: their documented quick checks make sparse masks, the
dense comparison reports a speedup and a difference, and wrong options are refused clearly."""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPTS = ("wan21", "hunyuanvideo15")


def load(name: str):
    """An example script as a module (its ``common`` import resolves to ``examples/common.py``)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def documented_quick_check(module) -> list[str]:
    """The arguments of the quick CPU check the script's docstring shows."""
    lines = module.__doc__.replace("\\\n", " ").splitlines()
    command = next(line for line in lines if "quick CPU check" in line)
    words = shlex.split(command.split("#")[0])
    assert words[:2] == ["python", f"examples/{module.__name__.removeprefix('example_')}.py"]
    return words[2:]


def with_out(argv: list[str], out: Path) -> list[str]:
    argv = list(argv)
    argv[argv.index("--out") + 1] = str(out)
    return argv


def written(path: Path) -> bool:
    """An mp4 (with the video extra) or a folder of PNG frames."""
    return path.is_file() or any(path.glob("*.png"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_documented_quick_check_runs_sparse_attention(name, tmp_path, capsys):
    module = load(name)
    argv = with_out(documented_quick_check(module), tmp_path / "video.mp4")
    assert "--tiny" in argv
    summary = module.main(argv)
    assert summary["sparse_calls"] > 0 and summary["dense_calls"] > 0  # warm-up, then sparse steps
    assert 0.0 < summary["mean_mask_density"] < 1.0
    assert summary["steps"] == 3 and all(s > 0 for s in summary["step_s"])
    assert 0.0 < summary["attention_share"] < 1.0
    assert written(summary["out"])
    out = capsys.readouterr().out
    assert "s/step" in out and "sparse" in out and "mean mask density" in out

    compared = module.main([*with_out(argv, tmp_path / "compared.mp4"), "--compare-dense"])
    assert compared["speedup"] > 0 and math.isfinite(compared["speedup"])
    assert math.isfinite(compared["latents_rel_l2"]) and compared["latents_rel_l2"] > 0  # sparse masks differ
    for key in ("sparse_calls", "dense_calls", "mean_mask_density"):  # the comparison leaves Tessera's run as it was
        assert compared[key] == summary[key]
    assert "speedup" in capsys.readouterr().out


def test_both_examples_default_to_the_processor_defaults():
    for name in SCRIPTS:
        args = load(name).build_parser("", prompt="", out="x.mp4").parse_args(["--tiny"])
        assert args.sparsifier == "default" and args.warmup_steps is None


def test_dense_run_and_warmup_past_the_last_step(tmp_path, capsys):
    wan = load("wan21")
    small = ["--tiny", "--steps", "2", "--layers", "1", "--height", "64", "--width", "64", "--frames", "5"]
    dense = wan.main([*small, "--dense", "--out", str(tmp_path / "dense.mp4")])
    assert "sparse_calls" not in dense and written(dense["out"])
    assert "stock attention: 2 steps" in capsys.readouterr().out
    late = wan.main([*small, "--warmup-steps", "5", "--out", str(tmp_path / "late.mp4")])
    assert late["sparse_calls"] == 0 and math.isnan(late["mean_mask_density"])
    assert "no sparse attention ran" in capsys.readouterr().out


def test_png_frames_and_the_hint_without_the_video_extra(tmp_path, capsys, monkeypatch):
    load("wan21")
    common = sys.modules["common"]  # examples/common.py, imported by the script
    monkeypatch.setattr(common, "video_writer_available", lambda: False)
    import numpy as np

    folder = common.save_video(np.zeros((3, 16, 16, 3), np.float32), tmp_path / "v.mp4", fps=8)
    assert folder == tmp_path / "v_frames" and len(list(folder.glob("*.png"))) == 3
    assert 'pip install ".[video]"' in capsys.readouterr().out


def run_refused(name: str, argv: list[str], capsys) -> str:
    """The message of an option combination the script must refuse before loading anything."""
    with pytest.raises(SystemExit) as exit_info:
        load(name).main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("name", SCRIPTS)
def test_offload_needs_a_gpu(name, capsys):
    err = run_refused(name, ["--tiny", "--offload", "model"], capsys)
    assert "--offload model" in err and "GPU" in err and "--offload none" in err


def checkpoint(tmp_path: Path, class_name: str) -> Path:
    """A folder with only model_index.json: enough for the task check, which runs before any weights."""
    folder = tmp_path / class_name
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name, "_diffusers_version": "0.42.1"}))
    return folder


@pytest.fixture
def image(tmp_path) -> Path:
    from PIL import Image

    path = tmp_path / "first.png"
    Image.new("RGB", (32, 32)).save(path)
    return path


@pytest.mark.parametrize(
    "name, t2v, i2v",
    [("wan21", "WanPipeline", "WanImageToVideoPipeline"),
     ("hunyuanvideo15", "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")],
)
def test_task_and_checkpoint_mismatches_are_refused(name, t2v, i2v, tmp_path, image, capsys):
    err = run_refused(name, ["--model", str(checkpoint(tmp_path, t2v)), "--image", str(image)], capsys)
    assert "--image needs an image-to-video model" in err and "text-to-video" in err
    err = run_refused(name, ["--model", str(checkpoint(tmp_path, i2v))], capsys)
    assert "is an image-to-video model: pass --image PATH" in err
    err = run_refused(name, ["--model", str(checkpoint(tmp_path, "FluxPipeline"))], capsys)
    assert "FluxPipeline checkpoint" in err and t2v in err
    err = run_refused(name, ["--tiny", "--image", str(image)], capsys)
    assert "--image needs an image-to-video model" in err and "--tiny" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "one of the arguments --model --random-weights --tiny is required"),
        (["--tiny", "--random-weights"], "not allowed with argument"),
        (["--model", "x", "--layers", "2"], "--layers builds a smaller model"),
        (["--tiny", "--dense", "--compare-dense"], "--dense runs stock attention only"),
        (["--random-weights", "--image", "missing.png"], "no such file"),
        (["--tiny", "--sparsifier", "dense_64"], "invalid choice"),
    ],
)
def test_argument_errors_are_clear(argv, message, capsys):
    assert message in run_refused("wan21", argv, capsys)


@pytest.mark.parametrize("name", ["wan21", "hunyuanvideo15"])
def test_compile_runs_the_blocks_compiled_with_fullgraph(name, tmp_path):
    """--compile: compile_repeated_blocks(fullgraph=True) around the processor's opaque op (eager
    backend here: the trace is what --compile adds; inductor's kernels are the GPU's business)."""
    import torch._dynamo

    torch._dynamo.reset()
    module = load(name)
    small = ["--tiny", "--steps", "2", "--warmup-steps", "1", "--layers", "1", "--height", "64", "--width", "64",
             "--frames", "5"]
    original = torch.compile

    def eager_backend(*args, **kwargs):
        return original(*args, **{**kwargs, "backend": "eager"})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "compile", eager_backend)
        summary = module.main([*small, "--compile", "--out", str(tmp_path / "compiled.mp4")])
    torch._dynamo.reset()
    assert summary["sparse_calls"] > 0
