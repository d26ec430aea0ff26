"""The 8-bit kernels on a persistent grid taking tasks from a counter: per case (ten families,
N = 32,768, the plan of a mask that comes back), interleaved: Tessera bf16 on its plan, the int8
kernel on the plan the current rule picks (one CTA per task first), that plan persistent (now
dynamic), and the best-ranked 8-bit-capable plan whatever its grid."""
import dataclasses, json, math, sys
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
from tessera_diffusers.selector import Selector, has_quantized_variant
from tessera_diffusers.quantized_ops import quantize, run_quantized

out = open(sys.argv[1], "a")
tag = sys.argv[2]
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
    now = sel.quantized(r8, state).chosen
    base, entry = sel._base_entry(r8, None)
    ranked = sel.rank(base, state)
    plans = {pl.name: pl for pl in entry.eligible}
    names = [n for n, _ in ranked.ranking if n in plans and has_quantized_variant(plans[n])]
    best = plans[names[0]] if names else now
    arms = {"bf16": b16, "int8_now": sel.reused_plan(now, r8, state), "int8_flip": sel.reused_plan(flip(now), r8, state),
            "int8_rank": sel.reused_plan(best, r8, state)}
    preps = {n: prepare(pl, state) for n, pl in arms.items()}
    xs = [quantize(q, k, v, p.scale, "bf16") for q, k, v in inputs]
    runs = [lambda i, pr=preps["bf16"]: execute(pr, *inputs[i], p.scale, False)]
    runs += [lambda i, pr=preps[n]: run_quantized(pr, *inputs[i], p.scale, False, quantized=xs[i])
             for n in ("int8_now", "int8_flip", "int8_rank")]
    ts = time_interleaved(runs, 3, 3, 10, dev)
    tf = {n: p.effective_flops() / t.median_ms / 1e9 for n, t in zip(arms, ts)}
    out.write(json.dumps({"tag": tag, "case": p.name, "family": p.family, "plans": {n: pl.name for n, pl in arms.items()},
                          "persistent": {n: pl.tasks.persistent for n, pl in arms.items()}, "tflops": tf}) + "\n"); out.flush()
    print(f"{tag} {p.family:10s} bf16 {tf['bf16']:4.0f} | now {tf['int8_now']:4.0f} ({'P' if arms['int8_now'].tasks.persistent else '1'}) "
          f"flip {tf['int8_flip']:4.0f} -> {tf['int8_flip'] / tf['int8_now']:.3f} | rank {tf['int8_rank']:4.0f} "
          f"({'P' if arms['int8_rank'].tasks.persistent else '1'}) -> {tf['int8_rank'] / tf['int8_now']:.3f} | rank/bf16 {tf['int8_rank'] / tf['bf16']:.3f}", flush=True)
    del runs, inputs, xs, preps
