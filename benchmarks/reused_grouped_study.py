"""A mask that comes back, 8-bit: the int8 kernel on its first-call plan (natural), on that plan's
grouped layout, and on the 16-bit reused plan where an 8-bit kernel runs it, beside Tessera bf16's
reused plan (the bench's `tessera`), timed interleaved per case; accuracy of each 8-bit arm on two
heads against the fp32 oracle."""
import dataclasses, json, sys
from pathlib import Path
import torch
from tessera_diffusers import reference, quantized
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.harness import problems, make_backend
from tessera_diffusers.bench.problem import make_inputs
from tessera_diffusers.bench.timing import time_interleaved
from tessera_diffusers.bench.tessera_backends import request_of
from tessera_diffusers.mask_state import build_mask_state
from tessera_diffusers.prepare import prepare
from tessera_diffusers.selector import Selector, has_quantized_variant
from tessera_diffusers.quantized_ops import quantize, run_quantized

sizes = tuple(sys.argv[1].split(","))
fams = tuple(sys.argv[2].split(","))
out = open(sys.argv[3], "a")
per = int(sys.argv[4])
cfg = BenchConfig(out_dir=Path("/tmp/x"), sizes=sizes, families=fams, cases_per_family=per)
dev = torch.device("cuda")
for key, build in problems(cfg, dev):
    p = build()
    inputs = make_inputs(p, 3, 0)
    state = build_mask_state(p.mask)
    req = request_of(p)
    sel = Selector()
    natural = sel.quantized(dataclasses.replace(req, precision="int8"), state).chosen
    first16 = sel.rank(req, state).chosen
    reused16 = sel.reused_plan(first16, req, state)
    arms = {"natural": natural}
    if natural.can_group_queries:
        arms["grouped"] = natural.grouped()
    if has_quantized_variant(reused16) and reused16 not in arms.values():
        arms["bf16reused"] = reused16
    b16 = make_backend("tessera")
    prep16 = b16.prepare(p)
    xs = [quantize(q, k, v, p.scale, "bf16") for q, k, v in inputs]
    preps = {n: prepare(pl, state) for n, pl in arms.items()}
    runs = [lambda i: b16.run(prep16, inputs[i])]
    runs += [(lambda i, pr=pr: run_quantized(pr, *inputs[i], p.scale, False, quantized=xs[i])) for pr in preps.values()]
    ts = time_interleaved(runs, 3, 3, 10, dev)
    names = ["bf16"] + list(arms)
    tf = {n: p.effective_flops() / t.median_ms / 1e9 for n, t in zip(names, ts)}
    acc = {}
    q, k, v = inputs[0]
    if p.mask.blocks.shape[1] == p.heads:
        h = slice(0, 2)
        sm = dataclasses.replace(p.mask, blocks=p.mask.blocks[:, h])
        oracle = reference.attention(q[:, :, h].float(), k[:, :, h].float(), v[:, :, h].float(), sm, p.scale)
        for n, pr in preps.items():
            o = run_quantized(pr, q, k, v, p.scale, False, quantized=xs[0])
            acc[n] = quantized.agreement(o[:, :, h], oracle).relative_l2
    rec = {"case": p.name, "family": p.family, "plans": {n: pl.name for n, pl in arms.items()},
           "bf16_plan": prep16[0].plan.name, "tflops": tf, "relative_l2": acc}
    out.write(json.dumps(rec) + "\n"); out.flush()
    s = " ".join(f"{n} {tf[n]:4.0f} ({tf[n] / tf['bf16']:.3f})" for n in names[1:])
    a = " ".join(f"{n} {e:.4f}" for n, e in acc.items())
    print(f"{p.family:9s} {p.name[7:30]:23s} bf16 {tf['bf16']:4.0f} | {s} | rel {a}", flush=True)
    print(f"    bf16 {prep16[0].plan.name[:70]} | " + " | ".join(f"{n}: {pl.name[:60]}" for n, pl in arms.items()), flush=True)
    del runs, inputs, xs, preps
