# Call 2: the library call 1 built (carried back), the shipped table: bench of all ten families
# beside every baseline, the demo, the 720p loops.
set -o pipefail
source .device_build/env.sh
mkdir -p /tmp/nat
[ -f /tmp/nat/libtessera_kernels.so ] && echo "library still on the machine" || { xz -dc .device_build/lib/libtessera_kernels.so.xz > /tmp/nat/libtessera_kernels.so && cp .device_build/lib/manifest.json /tmp/nat/; }
export TESSERA_NATIVE_LIB=/tmp/nat/libtessera_kernels.so
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/env.txt
FAM=Q16K16,Q32K16,Q32K32,Q64K32,Q64K64-HD,Q64K64,Q64K64-DD,Q128K64,Q128K128,Q384K384
echo "=== bench $(date +%T)"
timeout 300 python3 -m tessera_diffusers.bench --out /tmp/bench --families $FAM --cases-per-family 1 --interleave --no-progress > /tmp/bench.log 2>&1; echo "bench rc=$?"
cp /tmp/bench.log /tmp/bench/ 2>/dev/null
echo "=== demo $(date +%T)"
timeout 60 python3 -m tessera_diffusers.cli demo --device cuda > /tmp/bench/demo.log 2>&1; echo "demo rc=$?"; tail -3 /tmp/bench/demo.log
echo "=== loop $(date +%T)"
timeout 130 python3 benchmarks/diffusion_loop.py --out /tmp/loop --models wan,hv15 --steps 4 --layers 2 --max-minutes 1.6 > /tmp/loop.log 2>&1; echo "loop rc=$?"; mkdir -p /tmp/loop; cp /tmp/loop.log /tmp/loop/
(cd /tmp && tar czf $OUT/bench.tgz bench && tar czf $OUT/loop.tgz loop)
echo "=== done $(date +%T)"
python3 - <<'PY'
import json
try:
    recs = [json.loads(l) for l in open("/tmp/bench/records.jsonl")]
except OSError:
    recs = []
by = {}
for r in recs:
    if r.get("status") == "ok": by.setdefault(r["family"], {})[r["backend"]] = r["kernel_ms"]
for f, d in by.items():
    fi = min([v for k, v in d.items() if k.startswith("flashinfer")] or [float("nan")])
    print(f"  {f:10s} tessera {d.get('tessera', float('nan')):.3f} cudnn {d.get('sdpa-cudnn', float('nan')):.2f} flex {d.get('flex', float('nan')):.3f} fi {fi:.3f}")
PY
tail -12 /tmp/loop/diffusion_loop.md 2>/dev/null
