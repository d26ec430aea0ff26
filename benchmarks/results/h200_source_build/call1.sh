# Call 1: build the library from this tree on the device as a user narrowing the build would
# (TESSERA_CUDA_ARCHS=90, all cores), check its hashes against the shipped table, GPU tests.
set -o pipefail
source .device_build/env.sh
{ nvcc --version | tail -2; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv; } | tee $OUT/env.txt
echo "=== build $(date +%T)"
start=$(date +%s)
MAX_JOBS=16 TESSERA_CUDA_ARCHS=90 timeout 330 python3 csrc/build_native.py --out /tmp/nat --build-dir /tmp/nbuild > $OUT/build.log 2>&1; echo "build rc=$? in $(( $(date +%s) - start )) s"
tail -2 $OUT/build.log; cp /tmp/nbuild/ptxas.log /tmp/nat/manifest.json $OUT/ 2>/dev/null; gzip -f $OUT/ptxas.log
export TESSERA_NATIVE_LIB=/tmp/nat/libtessera_kernels.so
python3 - <<'PY' 2>&1 | tee $OUT/stale_check.txt
import json, warnings
import torch
from tessera_diffusers import ops
from tessera_diffusers.plan_table import default_table
from tessera_diffusers.selector import Selector
t = default_table("sm90").table
print("library", ops.library_path(), "kernel_sources", ops.kernel_sources(), "grouping_sources", ops.kernel_sources("grouping_sources"))
print("table provenance", t.provenance.get("kernel_sources"), t.provenance.get("grouping_sources"))
notes = []
ctx = Selector().context("sm90", warn=notes.append)
print("table used:", ctx.table is not None, "| catalog note:", ctx.table_note, "| stale note:", ctx.stale_note, "| warnings:", notes)
PY
echo "=== tests $(date +%T)"
timeout 210 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider -x > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/gpu_tests.log; gzip -f $OUT/gpu_tests.log
xz -T16 -6 -c /tmp/nat/libtessera_kernels.so > $OUT/libtessera_kernels.so.xz
echo "=== done $(date +%T)"
