"""The quantization pass alone (tessera_diffusers.quantized_ops.quantize) with whatever library
TESSERA_NATIVE_LIB names: median of CUDA-event timings per shape and P V format, and the time of
each of its three launches (torch.profiler)."""
import json, sys, torch
from tessera_diffusers.quantized_ops import quantize
tag, out = sys.argv[1], open(sys.argv[2], "a")
shapes = {"n32k": (32768, 24), "wan720p": (75600, 40), "hv720p": (140225, 16)}
torch.manual_seed(0)
for name, (seq, heads) in shapes.items():
    q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for pv in ("bf16", "int8"):
        for _ in range(5):
            quantize(q, k, v, 0.088, pv)
        ts = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); quantize(q, k, v, 0.088, pv); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        med = ts[len(ts) // 2]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                quantize(q, k, v, 0.088, pv)
            torch.cuda.synchronize()
        per = {}
        for e in prof.key_averages():
            if any(n in e.key for n in ("channel_statistics", "channel_finish", "quantize_rows")):
                per[e.key.split("(")[0].split("::")[-1]] = e.device_time_total / e.count / 1000 if e.count else 0.0
        gb = (2 * 2 + 2 + 1 + 1) * seq * heads * 128 / 1e9 if pv == "bf16" else (2 * 2 + 2 + 2 + 1 + 1 + 1) * seq * heads * 128 / 1e9
        rec = {"tag": tag, "shape": name, "pv": pv, "median_ms": med, "launch_ms": per}
        out.write(json.dumps(rec) + "\n"); out.flush()
        print(f"{tag} {name:8s} pv={pv:4s} {med:6.3f} ms  " + " ".join(f"{k} {v:.3f}" for k, v in per.items()), flush=True)
    del q, k, v
