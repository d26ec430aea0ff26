"""K scaled per 16-token chunk, for speed alone: dense cuDNN, Tessera bf16 and the int8 kernel (16-bit
P V) timed interleaved per case with whatever library TESSERA_NATIVE_LIB names; run alternately on
the unchanged library (A) and one built with k_chunk_speed.diff applied (B: the kernels read each
chunk's first per-token scale, the pass unchanged, so B's numbers are not B's accuracy).

    python benchmarks/k_chunk_ab.py n32k FAMILIES OUT.jsonl A|B"""
import json, sys
from pathlib import Path
import torch
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.harness import problems, make_backend
from tessera_diffusers.bench.problem import make_inputs
from tessera_diffusers.bench.timing import time_interleaved
from tessera_diffusers.bench.tessera_backends import TesseraQuantized

sizes = tuple(sys.argv[1].split(","))
fams = tuple(sys.argv[2].split(","))
out = open(sys.argv[3], "a")
tag = sys.argv[4]
names = ["sdpa-cudnn", "tessera", "tessera-int8-kernel"]
cfg = BenchConfig(out_dir=Path("/tmp/x"), sizes=sizes, families=fams, cases_per_family=1)
dev = torch.device("cuda")
for key, build in problems(cfg, dev):
    p = build()
    inputs = make_inputs(p, 3, 0)
    runs = []
    for n in names:
        b = make_backend(n)
        prep = b.prepare(p)
        conv = [b.convert(*s) for s in inputs]
        runs.append(lambda i, b=b, prep=prep, conv=conv: b.run(prep, conv[i]))
    plan = TesseraQuantized.prepared_plan(p).plan.name
    ts = time_interleaved(runs, 3, 3, 10, dev)
    tf = {n: p.effective_flops() / t.median_ms / 1e9 for n, t in zip(names, ts)}
    rec = {"tag": tag, "case": p.name, "family": p.family, "int8_plan": plan, "tflops": tf}
    out.write(json.dumps(rec) + "\n"); out.flush()
    c, t16, t8 = tf["sdpa-cudnn"], tf["tessera"], tf["tessera-int8-kernel"]
    print(f"{tag:3s} {p.family:9s} cudnn {c:4.0f} bf16 {t16:4.0f} int8 {t8:4.0f} int8/bf16 {t8 / t16:.3f} int8/cudnn {t8 / c:.3f} {plan[:60]}", flush=True)
    del runs, inputs
