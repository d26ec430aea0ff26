"""How much a persistent grid is worth: Tessera bf16 on its reused plan (persistent, tasks from a
counter) and on the same plan with one CTA per task; the int8 kernel on its reused plan (one CTA
per task) and on the same plan persistent (static striding). Interleaved per case."""
import dataclasses, json, sys
from pathlib import Path
import torch
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.harness import problems
from tessera_diffusers.bench.problem import make_inputs
from tessera_diffusers.bench.timing import time_interleaved
from tessera_diffusers.bench.tessera_backends import request_of
from tessera_diffusers.mask_state import build_mask_state
from tessera_diffusers.prepare import prepare
from tessera_diffusers.runtime import execute
from tessera_diffusers.selector import Selector
from tessera_diffusers.quantized_ops import quantize, run_quantized

out = open(sys.argv[1], "a")
cfg = BenchConfig(out_dir=Path("/tmp/x"), sizes=("n32k",), cases_per_family=1)
dev = torch.device("cuda")
flip = lambda plan: dataclasses.replace(plan, tasks=dataclasses.replace(plan.tasks, persistent=not plan.tasks.persistent))
for key, build in problems(cfg, dev):
    p = build()
    inputs = make_inputs(p, 3, 0)
    state = build_mask_state(p.mask)
    req = request_of(p)
    sel = Selector()
    b16 = sel.reused_plan(sel.rank(req, state).chosen, req, state)
    r8 = dataclasses.replace(req, precision="int8")
    i8 = sel.reused_plan(sel.quantized(r8, state).chosen, r8, state)
    arms = {"bf16": b16, "bf16_flip": flip(b16), "int8": i8, "int8_flip": flip(i8)}
    preps = {n: prepare(pl, state) for n, pl in arms.items()}
    xs = [quantize(q, k, v, p.scale, "bf16") for q, k, v in inputs]
    runs = [lambda i, pr=preps["bf16"]: execute(pr, *inputs[i], p.scale, False),
            lambda i, pr=preps["bf16_flip"]: execute(pr, *inputs[i], p.scale, False),
            lambda i, pr=preps["int8"]: run_quantized(pr, *inputs[i], p.scale, False, quantized=xs[i]),
            lambda i, pr=preps["int8_flip"]: run_quantized(pr, *inputs[i], p.scale, False, quantized=xs[i])]
    ts = time_interleaved(runs, 3, 3, 10, dev)
    tf = {n: p.effective_flops() / t.median_ms / 1e9 for n, t in zip(arms, ts)}
    out.write(json.dumps({"case": p.name, "family": p.family, "plans": {n: pl.name for n, pl in arms.items()}, "tflops": tf}) + "\n"); out.flush()
    print(f"{p.family:10s} bf16 {tf['bf16']:4.0f} ({b16.tasks.name}) flip {tf['bf16_flip']:4.0f} -> {tf['bf16'] / tf['bf16_flip']:.3f} | "
          f"int8 {tf['int8']:4.0f} ({i8.tasks.name}) flip {tf['int8_flip']:4.0f} -> {tf['int8'] / tf['int8_flip']:.3f}", flush=True)
    del runs, inputs, xs, preps
