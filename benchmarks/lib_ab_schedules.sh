#!/usr/bin/env bash
# One device call: this tree's library against other builds of the kernel library ($AB_LIB: paths
# of libtessera_kernels.so, e.g. built with csrc/build_native.py --only ... --out DIR and carried),
# one CTA per task (lpt) and persistent grids of the same plans, every plan checked against the
# oracle first (benchmarks/kernel_counters.py); AB_ROUNDS rounds (default 2), interleaved; AB_CASES,
# AB_REPS. Then Nsight Compute's stall reasons of the first case's 64 x 64 plans under both
# schedules (this tree's library; AB_NCU=0 skips it). The library tag is its directory's name.
#   OUT=$OUT AB_LIB="v1/libtessera_kernels.so v2/libtessera_kernels.so" bash benchmarks/lib_ab_schedules.sh
set -u
OUT=${OUT:-/tmp/lib_ab}
mkdir -p "$OUT"
C=""
for c in ${AB_CASES:-Q16K16/sliding_tile Q64K64/temporal_heads Q64K64-HD/sliding_tile Q128K128/temporal_heads Q32K32/text_sink}; do
  C="$C --case $c"
done
P="--plan (direct|coarsened-packed|refined)_q(64k64|128k128)_from.*hopper_s2w[48]_lpt(-persistent)?$ --reps ${AB_REPS:-20} --warmup 3"
read -r -a LIBS <<< "base ${AB_LIB:-}"
for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for lib in "${LIBS[@]}"; do
    tag=$(basename "$(dirname "$lib")"); [ "$lib" = base ] && tag=base
    echo "== $tag, round $r"
    if [ "$lib" = base ]; then
      timeout 150 python3 benchmarks/kernel_counters.py $C $P 2>&1
    else
      TESSERA_NATIVE_LIB=$lib timeout 150 python3 benchmarks/kernel_counters.py $C $P 2>&1
    fi
  done
done > "$OUT/ab.log"
echo "oracle mismatches: $(grep -c "ORACLE MISMATCH" "$OUT/ab.log")"
[ "${AB_NCU:-1}" = 0 ] && exit 0
first=$(echo "$C" | awk '{print $2}')
timeout 150 ncu --clock-control none --kernel-name regex:attention_kernel \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__cycles_active.avg \
  python3 benchmarks/kernel_counters.py --case "$first" --plan 'direct_q64k64.*s2w4_lpt(-persistent)?$' \
  --plan 'coarsened-packed_q64k64.*s2w4_lpt(-persistent)?$' --reps 0 --warmup 0 > "$OUT/ncu_stalls.txt" 2>&1
echo "ncu rc=$?"
