"""The kernels' ceilings without the softmax (a study; on the H200, from the repository root):

    cp -r csrc tessera_diffusers setup.py pyproject.toml /tmp/treeB && (cd /tmp/treeB && patch -p1 < benchmarks/ceiling_no_softmax.diff)
    build both libraries (csrc/build_native.py --only hopper), then per library:
    TESSERA_NATIVE_LIB=... python benchmarks/ceiling_no_softmax.py n32k Q128K128,Q384K384,Q64K64 OUT.jsonl A|B

Kernel TFLOP/s of dense cuDNN, Tessera bf16, the int8 (16-bit P V) and int8pv kernels, timed
interleaved per case (with whatever library TESSERA_NATIVE_LIB names)."""
import json, sys
from pathlib import Path
import torch
from tessera_diffusers.bench.config import BenchConfig
from tessera_diffusers.bench.harness import problems, make_backend
from tessera_diffusers.bench.problem import make_inputs
from tessera_diffusers.bench.timing import time_interleaved

sizes = tuple(sys.argv[1].split(","))
fams = tuple(sys.argv[2].split(","))
out = open(sys.argv[3], "a")
tag = sys.argv[4]
names = ["sdpa-cudnn", "tessera", "tessera-int8-kernel", "tessera-int8pv-kernel"]
cfg = BenchConfig(out_dir=Path("/tmp/x"), sizes=sizes, families=fams, cases_per_family=1)
dev = torch.device("cuda")
for key, build in problems(cfg, dev):
    p = build()
    inputs = make_inputs(p, 3, 0)
    runs, used = [], []
    for n in names:
        b = make_backend(n)
        prep = b.prepare(p)
        conv = [b.convert(*s) for s in inputs]
        runs.append(lambda i, b=b, prep=prep, conv=conv: b.run(prep, conv[i]))
        used.append(n)
    ts = time_interleaved(runs, 3, 3, 10, dev)
    tf = {n: p.effective_flops() / t.median_ms / 1e9 for n, t in zip(used, ts)}
    rec = {"tag": tag, "case": p.name, "family": p.family, "tflops": tf}
    out.write(json.dumps(rec) + "\n"); out.flush()
    c, t16 = tf["sdpa-cudnn"], tf["tessera"]
    print(f"{tag:8s} {p.name[:34]:34s} cudnn {c:4.0f} bf16 {t16:4.0f} int8 {tf['tessera-int8-kernel']:4.0f} int8pv {tf['tessera-int8pv-kernel']:4.0f} | "
          f"/cudnn: bf16 {t16 / c:.2f} int8 {tf['tessera-int8-kernel'] / c:.2f} int8pv {tf['tessera-int8pv-kernel'] / c:.2f}", flush=True)
    del runs, inputs
