#!/usr/bin/env bash
# A/B of builds of the kernel library in one device call: the installed one, then each library of
# $AB_LIB (space-separated paths, e.g. built with TESSERA_NVCC_FLAGS=-D... into other directories
# and carried), each through benchmarks/kernels.py with AB_KERNELS_ARGS; the carried ones also through
# the GPU tests (AB_PYTEST_ARGS) and compute-sanitizer synccheck. Reports: $OUT/kernels_base,
# $OUT/kernels_ab (one library) or $OUT/kernels_ab1, kernels_ab2, ... (tarred).
#   OUT=$OUT AB_LIB="$PWD/pp/libtessera_kernels.so" bash benchmarks/ab_library.sh
set -u
KARGS=${AB_KERNELS_ARGS:-"--sizes n32k --families Q128K128,Q128K64,Q384K384,Q64K64 --backends sdpa-cudnn,tessera --no-flashinfer --all-plans --plan-filter hopper_s[23]w8_lpt$ --reps 10"}
OUT=$OUT KERNELS_TIMEOUT=180 KERNELS_TAG=kernels_base KERNELS_ARGS="$KARGS" bash benchmarks/device_check.sh kernels 2>&1 | tail -12
read -r -a LIBS <<< "$AB_LIB"
i=0
for LIB in "${LIBS[@]}"; do
  i=$((i + 1))
  TAG=kernels_ab; [ ${#LIBS[@]} -gt 1 ] && TAG=kernels_ab$i
  echo "=== $TAG: $LIB"
  TESSERA_NATIVE_LIB=$LIB OUT=$OUT KERNELS_TIMEOUT=150 KERNELS_TAG=$TAG KERNELS_ARGS="${AB_LIB_KERNELS_ARGS:-$KARGS}" \
    PYTEST_ARGS="${AB_PYTEST_ARGS:--k hopper -x -q}" TESTS_TIMEOUT=150 \
    bash benchmarks/device_check.sh tests kernels 2>&1 | grep -v "^NVIDIA\|^name\|^torch" | tail -16
  mv "$OUT/gpu_tests.log" "$OUT/${TAG}_gpu_tests.log"
  TESSERA_NATIVE_LIB=$LIB timeout 150 compute-sanitizer --tool synccheck --error-exitcode 3 \
    python3 benchmarks/sanitize_check.py ${AB_SANITIZE_ARGS:---family hopper} > "$OUT/${TAG}_synccheck.log" 2>&1
  echo "synccheck rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/${TAG}_synccheck.log" | tail -1)"
done
