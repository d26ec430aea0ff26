# Call 3: compute-sanitizer on the library of call 1: synccheck on every Hopper kernel (both task
# schedules, grouped layouts too), racecheck on every d128 bf16 Hopper kernel (every tile x stages).
set -o pipefail
source .device_build/env.sh
mkdir -p /tmp/nat
xz -dc .device_build/lib/libtessera_kernels.so.xz > /tmp/nat/libtessera_kernels.so && cp .device_build/lib/manifest.json /tmp/nat/
export TESSERA_NATIVE_LIB=/tmp/nat/libtessera_kernels.so
echo "=== synccheck $(date +%T)"
timeout 250 compute-sanitizer --tool synccheck --error-exitcode 3 python3 benchmarks/sanitize_check.py --every-kernel --grouped > $OUT/sanitize_every_synccheck.log 2>&1; echo "synccheck rc=$? cases=$(grep -c ' ok$' $OUT/sanitize_every_synccheck.log) fail=$(grep -c FAIL $OUT/sanitize_every_synccheck.log) $(grep 'ERROR SUMMARY' $OUT/sanitize_every_synccheck.log | tail -1)"
echo "=== racecheck $(date +%T)"
timeout 300 compute-sanitizer --tool racecheck --error-exitcode 3 python3 benchmarks/sanitize_check.py --every-kernel --grouped --only 'hopper_t\d+x\d+_d128_bf16' > $OUT/sanitize_d128_bf16_racecheck.log 2>&1; echo "racecheck rc=$? cases=$(grep -c ' ok$' $OUT/sanitize_d128_bf16_racecheck.log) fail=$(grep -c FAIL $OUT/sanitize_d128_bf16_racecheck.log) $(grep 'RACECHECK SUMMARY' $OUT/sanitize_d128_bf16_racecheck.log | tail -1)"
echo "=== done $(date +%T)"
