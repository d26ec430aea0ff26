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
if [ "$STEP" = all ] || [ "$STEP" = bench ]; then
  timeout 300 python3 benchmarks/portable_quick.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
fi
