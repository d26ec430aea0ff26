"""One K scale per tile against a K scale per key (on the H200: python3 benchmarks/k_scale_per_tile_ab.py
SIZES CASES_PER_FAMILY OUT.jsonl [FAMILIES]): the product's 8-bit plan of each case, the int8
kernel alone, timed interleaved on the same inputs: tile (k_chunk 128, one scale per tile), key
(k_chunk 1, the previous product), key128 (the run scales read per key: the kernel effect alone).
Accuracy of tile and key against the fp32 oracle on two heads of the first input set."""
import dataclasses, json, sys
from pathlib import Path
import torch
from tessera_diffusers import reference, quantized
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.harness import problems
from tessera_diffusers.bench.problem import make_inputs
from tessera_diffusers.bench.timing import time_interleaved
from tessera_diffusers.bench.tessera_backends import TesseraQuantized
from tessera_diffusers.quantized_ops import quantize, run_quantized

sizes = tuple(sys.argv[1].split(","))
per = int(sys.argv[2])
out = open(sys.argv[3], "w")
fams = tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else None
kw = dict(out_dir=Path("/tmp/x"), sizes=sizes, cases_per_family=per)
if fams: kw["families"] = fams
cfg = BenchConfig(**kw)
dev = torch.device("cuda")
for key, build in problems(cfg, dev):
    p = build()
    prepared = TesseraQuantized.prepared_plan(p)
    plan = prepared.plan
    inputs = make_inputs(p, 3, 0)
    chunk = quantized.k_chunk_for(plan)
    x_tile = [quantize(q, k, v, p.scale, "bf16", 128) for q, k, v in inputs]
    x_key = [quantize(q, k, v, p.scale, "bf16", 1) for q, k, v in inputs]
    x_key128 = [dataclasses.replace(x, k_chunk=1) for x in x_tile]
    arms = {"tile": x_tile, "key": x_key, "key128": x_key128}
    runs = [(lambda i, xs=xs: run_quantized(prepared, *inputs[i], p.scale, False, quantized=xs[i])) for xs in arms.values()]
    ts = time_interleaved(runs, 3, 3, 12, dev)
    q, k, v = inputs[0]
    h = slice(0, 2)  # the oracle on two heads
    mask = p.mask if p.mask.blocks.shape[1] == 1 else dataclasses.replace(p.mask, blocks=p.mask.blocks[:, h])
    oracle = reference.attention(q[:, :, h].float(), k[:, :, h].float(), v[:, :, h].float(), mask, p.scale)
    acc = {}
    for name in ("tile", "key"):
        o = run_quantized(prepared, *inputs[0], p.scale, False, quantized=arms[name][0])
        acc[name] = vars(quantized.agreement(o[:, :, h], oracle))
    res = {n: {"ms": t.median_ms, "tflops": p.effective_flops() / t.median_ms / 1e9} for n, t in zip(arms, ts)}
    rec = {"case": p.name, "family": p.family, "plan": plan.name, "k_chunk": chunk, "results": res, "accuracy": acc}
    out.write(json.dumps(rec) + "\n"); out.flush()
    r = res
    a = " ".join(f"{n} rel {acc[n]['relative_l2']:.4f}" for n in ("tile", "key"))
    print(f"{p.family:10s} {p.name[:26]:26s} chunk {chunk:3d} tile {r['tile']['tflops']:4.0f} key {r['key']['tflops']:4.0f} key128 {r['key128']['tflops']:4.0f} "
          f"tile/key {r['tile']['tflops'] / r['key']['tflops']:.3f} key128/key {r['key128']['tflops'] / r['key']['tflops']:.3f} | {a}", flush=True)
    del x_tile, x_key, x_key128, inputs, arms, runs
