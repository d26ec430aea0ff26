#!/usr/bin/env bash
# One device call: environment, install (no network, no rebuild when the library is carried),
# GPU tests, then the quick portable benchmark. Logs go to $OUT.
set -u
OUT=${OUT:-/tmp/tessera_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
if [ ! -f tessera_diffusers/_native/libtessera_kernels.so ]; then
  MAX_JOBS=16 python3 csrc/build_native.py --archs "90" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
TESSERA_CUDA_ARCHS=none python3 -m pip install --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { echo "pip install failed; using PYTHONPATH"; export PYTHONPATH=$PWD; }
STEP=${1:-all}
if [ "$STEP" = all ] || [ "$STEP" = tests ]; then
  timeout 300 python3 -m pytest tests/test_native_gpu.py -q -x -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ "$STEP" = all ] || [ "$STEP" = sanitize ]; then
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 python3 benchmarks/sanitize_check.py > "$OUT/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  done
  cuobjdump -sass tessera_diffusers/_native/libtessera_kernels.so 2>/dev/null > "$OUT/sass.txt"
  echo "SASS: $(grep -c HMMA "$OUT/sass.txt") HMMA, $(grep -c LDSM "$OUT/sass.txt") LDSM, $(grep -c LDGSTS "$OUT/sass.txt") LDGSTS, $(grep -cE 'STL|LDL' "$OUT/sass.txt") local-memory ops"
  gzip -f "$OUT/sass.txt"
fi
if [ "$STEP" = all ] || [ "$STEP" = bench ]; then
  timeout 300 python3 benchmarks/portable_quick.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
fi
