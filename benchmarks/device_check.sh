#!/usr/bin/env bash
# One device call: environment, install (no network; the native library and wheels are carried),
# then the steps named on the command line, in order:
#   smoke      benchmarks/sanitize_check.py alone under a short timeout (SMOKE_ARGS); a failure or
#              a hang stops the remaining steps
#   tests      every GPU test (pytest -m gpu: each catalog entry x family x layout x splits, runtime, processors)
#   sanitize   compute-sanitizer memcheck + racecheck + synccheck on representative plans (SANITIZE_ARGS,
#              e.g. --every-kernel --grouped), SASS instruction counts
#   harness    tessera bench default subset (HARNESS_ARGS, HARNESS_TIMEOUT)
#   kernels    benchmarks/kernel_study.py (KERNELS_ARGS, KERNELS_TIMEOUT)
#   loop       benchmarks/diffusion_loop.py (LOOP_ARGS, LOOP_TIMEOUT)
#   demo       tessera demo --device cuda (the README's main job on the GPU)
#   request    benchmarks/request_breakdown.py (REQUEST_ARGS): where a cold request's time goes
#   profile    tessera profile (PROFILE_MINUTES, PROFILE_ARGS); records and table under $OUT/profile
#   cp         torchrun benchmarks/cp_scaling.py on CP_NPROC GPUs (default: all), CP_ARGS, CP_TAG; needs 2+ GPUs
# Logs and results go to $OUT.
set -u
OUT=${OUT:-/tmp/tessera_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Never NVLink multicast on shared multi-GPU hosts (it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
if [ ! -f tessera_diffusers/_native/libtessera_kernels.so ]; then
  MAX_JOBS=16 python3 csrc/build_native.py --archs "90" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
if ls wheels/*.whl > /dev/null 2>&1; then
  python3 -m pip install --no-deps --no-index wheels/*.whl > "$OUT/wheels.log" 2>&1 || echo "wheel install failed (see wheels.log)"
fi
TESSERA_CUDA_ARCHS=none python3 -m pip install --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { echo "pip install failed; using PYTHONPATH"; export PYTHONPATH=$PWD; }

# A report directory under $OUT as one archive (at most 8 files come back from a device call).
pack() { (cd "$OUT" && tar czf "$1.tgz" "$1" && rm -rf "$1"); }

for STEP in "${@:-tests}"; do
  echo "=== $STEP ($(date +%T))"
  case "$STEP" in
    smoke)
      timeout ${SMOKE_TIMEOUT:-120} python3 benchmarks/sanitize_check.py ${SMOKE_ARGS:-} 2>&1 | tee "$OUT/smoke.log" | tail -12
      rc=${PIPESTATUS[0]}
      if [ "$rc" != 0 ]; then echo "smoke failed (rc=$rc): stopping"; exit 1; fi ;;
    tests)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -m gpu tests -q -p no:cacheprovider ${PYTEST_ARGS:-} \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 python3 benchmarks/sanitize_check.py ${SANITIZE_ARGS:-} > "$OUT/sanitize_$tool.log" 2>&1
        echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
      done
      cuobjdump -sass tessera_diffusers/_native/libtessera_kernels.so 2>/dev/null > "$OUT/sass.txt"
      echo "SASS: $(grep -c HGMMA "$OUT/sass.txt") HGMMA, $(grep -c HMMA "$OUT/sass.txt") HMMA, $(grep -c LDSM "$OUT/sass.txt") LDSM, $(grep -c LDGSTS "$OUT/sass.txt") LDGSTS, $(grep -cE 'STL|LDL' "$OUT/sass.txt") local-memory ops"
      gzip -f "$OUT/sass.txt" ;;
    harness)
      timeout ${HARNESS_TIMEOUT:-420} python3 -m tessera_diffusers.bench --out "$OUT/harness" --no-progress ${HARNESS_ARGS:-} \
        2>&1 | tee "$OUT/harness.log" | tail -40
      pack harness ;;
    kernels)
      KTAG=${KERNELS_TAG:-kernels}
      timeout ${KERNELS_TIMEOUT:-420} python3 benchmarks/kernel_study.py --out "$OUT/$KTAG" --no-progress ${KERNELS_ARGS:-} \
        2>&1 | tee "$OUT/$KTAG.log" | tail -40
      pack $KTAG ;;
    loop)
      timeout ${LOOP_TIMEOUT:-420} python3 benchmarks/diffusion_loop.py --out "$OUT/loop" ${LOOP_ARGS:-} \
        2>&1 | tee "$OUT/loop.log" | tail -30
      pack loop ;;
    profile)
      timeout ${PROFILE_TIMEOUT:-420} python3 -m tessera_diffusers.cli profile --out "$OUT/profile" \
        --minutes ${PROFILE_MINUTES:-6} --no-progress ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" | tail -25 ;;
    request)
      timeout ${REQUEST_TIMEOUT:-240} python3 benchmarks/request_breakdown.py --out "$OUT/request_breakdown.json" \
        ${REQUEST_ARGS:-} 2>&1 | tee "$OUT/request.log" | tail -30
      if [ -d "$OUT/request_profile" ]; then pack request_profile; fi ;;
    cp)
      NPROC=${CP_NPROC:-$(nvidia-smi -L | wc -l)}
      nvidia-smi topo -m > "$OUT/topology.txt" 2>&1; head -5 "$OUT/topology.txt"
      CTAG=${CP_TAG:-cp}
      timeout ${CP_TIMEOUT:-420} torchrun --standalone --nproc-per-node $NPROC benchmarks/cp_scaling.py --out "$OUT/$CTAG" \
        ${CP_ARGS:-} 2>&1 | tee "$OUT/$CTAG.log" | grep -v "^W1" | tail -30
      pack $CTAG ;;
    demo)
      timeout ${DEMO_TIMEOUT:-120} tessera demo --device cuda 2>&1 | tee "$OUT/demo.log" | grep -v "it/s" | tail -8 ;;
    *) echo "unknown step $STEP" ;;
  esac
done
