# Call 4: racecheck on the other Hopper kernels (head dim 64, and fp16 at 128) of the library of call 1.
set -o pipefail
source .device_build/env.sh
mkdir -p /tmp/nat
xz -dc .device_build/lib/libtessera_kernels.so.xz > /tmp/nat/libtessera_kernels.so && cp .device_build/lib/manifest.json /tmp/nat/
export TESSERA_NATIVE_LIB=/tmp/nat/libtessera_kernels.so
echo "=== racecheck $(date +%T)"
timeout 470 compute-sanitizer --tool racecheck --error-exitcode 3 python3 benchmarks/sanitize_check.py --every-kernel --grouped --only 'hopper_t\d+x\d+_(d64_|d128_fp16)' > $OUT/sanitize_rest_racecheck.log 2>&1; echo "racecheck rc=$? cases=$(grep -c ' ok$' $OUT/sanitize_rest_racecheck.log) fail=$(grep -c FAIL $OUT/sanitize_rest_racecheck.log) $(grep 'RACECHECK SUMMARY' $OUT/sanitize_rest_racecheck.log | tail -1)"
echo "non-grouping hazards: $(grep -E 'Race reported|and (Read|Write) access' $OUT/sanitize_rest_racecheck.log | grep -vc regroup)"
echo "=== done $(date +%T)"
