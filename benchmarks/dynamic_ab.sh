#!/usr/bin/env bash
# One device call: the static schedule of this build against a build of the previous kernels
# ($OLD_TREE: a tree with its own library, e.g. `git archive` of the earlier commit built with
# csrc/build_native.py --only ...) on packed 16-token-slot plans, twice interleaved; then the
# dynamic schedule (persistent grids with a task counter) against one CTA per task and against
# static striding. Logs under $OUT.
#   OUT=$OUT OLD_TREE=old_tree bash benchmarks/dynamic_ab.sh
set -u
OUT=${OUT:-/tmp/dynamic_ab}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
AB="--case Q16K16/sliding_tile --case Q32K16/temporal_heads --case Q64K64/temporal_heads
    --plan coarsened-packed_q64k64.*hopper_s2w4_lpt$ --plan coarsened-packed_q128k128.*hopper_s2w8_lpt$
    --plan direct_q64k64.*hopper_s2w4_lpt$ --reps 30"
for r in 1 2; do
  echo "== this build, run $r"
  timeout 120 python3 benchmarks/kernel_counters.py $AB 2>&1 | tail -7
  if [ -n "${OLD_TREE:-}" ]; then
    echo "== previous kernels, run $r"
    (cd "$OLD_TREE" && PYTHONPATH=$PWD timeout 120 python3 benchmarks/kernel_counters.py $AB 2>&1 | tail -7)
  fi
done > "$OUT/static_ab.log"
C=""
for c in Q128K128/temporal_heads Q128K128/importance_topk Q128K64/clustered_permuted Q64K64/temporal_heads \
         Q64K64-HD/sliding_tile Q64K64-HD/temporal_heads Q32K32/text_sink Q16K16/sliding_tile Q384K384/ssta; do
  C="$C --case $c"
done
timeout 300 python3 benchmarks/kernel_counters.py $C --plan 'q128k128_from.*hopper_s2w8_lpt(-persistent)?$' \
  --plan 'direct_q64k64.*hopper_s2w4_lpt(-persistent)?$' --plan 'coarsened-packed_q64k64.*hopper_s2w4_lpt(-persistent)?$' \
  --static --reps 20 > "$OUT/schedules.log" 2>&1
tail -60 "$OUT/static_ab.log" | cut -c1-140
echo; cut -c1-150 "$OUT/schedules.log" | tail -70
