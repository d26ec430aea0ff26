# Call 1: build from the tree, GPU tests, HunyuanVideo-1.5 720p full depth: dense / one-liner / attach.
source .device_build/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv; python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"; } | tee $OUT/env.txt
ls -la /tmp/nat; xz -T16 -6 -c /tmp/nat/libtessera_kernels.so > $OUT/libtessera_kernels.so.xz; cp /tmp/nat/manifest.json $OUT/
echo "=== gpu tests $(date +%T)"
timeout 240 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider -x > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/gpu_tests.log
echo "=== hv15 $(date +%T)"
timeout 300 python3 benchmarks/diffusion_loop.py --out $OUT/hv15 --models hv15 --systems dense,one-liner,attach --steps 3 --progress --max-minutes 4.5 > $OUT/hv15.log 2>&1; echo "loop rc=$?"
grep -v "^|" $OUT/hv15.log | tail -25; grep "^|" $OUT/hv15.log
echo "=== done $(date +%T)"
# Call 2: Wan2.1-14B 720p full depth: dense / one-liner / attach, and both default candidates on Tessera and FlexAttention.
source .device_build/env.sh
echo "=== wan $(date +%T)"
timeout 570 python3 benchmarks/diffusion_loop.py --out $OUT/wan --models wan --systems dense,one-liner,attach,tessera:ssta_tuned,flex:spade_64,flex:ssta_tuned --steps 3 --progress --max-minutes 8.3 > $OUT/wan.log 2>&1; echo "loop rc=$?"
grep -v "^|" $OUT/wan.log | grep -v "    step" | tail -25; grep "^|" $OUT/wan.log
echo "=== done $(date +%T)"
# Call 3: Wan2.1-14B 720p full depth with the final default: a true 50-step single-branch loop with the
# one-liner (steps 0-9 its dense warm-up), then dense / one-liner / attach side by side.
source .device_build/env.sh
echo "=== wan 50 steps $(date +%T)"
timeout 400 python3 benchmarks/diffusion_loop.py --out $OUT/wan50 --models wan --systems one-liner --first-step 0 --steps 50 --no-warmup --progress --max-minutes 6 > $OUT/wan50.log 2>&1; echo "loop rc=$?"
grep -v "^|" $OUT/wan50.log | tail -8; grep "^|" $OUT/wan50.log
echo "=== wan front door $(date +%T)"
timeout 175 python3 benchmarks/diffusion_loop.py --out $OUT/wan --models wan --systems dense,one-liner,attach --steps 3 --max-minutes 2.2 > $OUT/wan.log 2>&1; echo "loop rc=$?"
grep "^|" $OUT/wan.log
echo "=== done $(date +%T)"

# Session call 2: the model-size buckets under the real catalog (explain) and the reliability GPU tests.
source .device_build/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
python3 -c "import torch; print(torch.__version__, torch.version.cuda)" >> $OUT/env.txt
echo "=== explain $(date +%T)"
for a in "40 75600" "40 32760" "12 75600" "12 32760" "16 111600" "16 49290"; do set -- $a
  python3 -m tessera_diffusers.cli explain --geometry Q384K384 --heads $1 --seq $2 --density 0.15 --mask banded 2>&1 | head -8
  echo; done > $OUT/explain.txt
grep -E "^(request|regime|chosen|note)" $OUT/explain.txt | cut -c1-150
echo "=== reliability gpu $(date +%T)"
timeout 150 python3 -m pytest -m gpu tests/test_runtime_reliability_gpu.py tests/test_processor_guards.py -q -s -p no:cacheprovider > $OUT/reliability_gpu.log 2>&1; echo "rc=$?"
grep -E "device memory|passed|failed|Error" $OUT/reliability_gpu.log | tail -5
echo "=== done $(date +%T)"

# Session call 3: the front door at full depth on the final code: Wan2.1-14B and HunyuanVideo-1.5 720p,
# dense / one-liner / attach side by side per model.
source .device_build/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv; python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"; } > $OUT/env.txt
echo "=== wan front door $(date +%T)"
timeout 200 python3 benchmarks/diffusion_loop.py --out $OUT/wan --models wan --systems dense,one-liner,attach --steps 3 --max-minutes 2.6 > $OUT/wan.log 2>&1; echo "loop rc=$?"
grep "^|" $OUT/wan.log
echo "=== hv15 front door $(date +%T)"
timeout 320 python3 benchmarks/diffusion_loop.py --out $OUT/hv15 --models hv15 --systems dense,one-liner,attach --steps 3 --max-minutes 4.6 > $OUT/hv15.log 2>&1; echo "loop rc=$?"
grep "^|" $OUT/hv15.log
echo "=== done $(date +%T)"

# Session call 4: every GPU test on the final tree (diffusers compat module, CLI, logging included).
source .device_build/env.sh
echo "=== gpu tests $(date +%T)"
timeout 420 python3 -m pytest -m gpu tests -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "rc=$?"; tail -3 $OUT/gpu_tests.log
grep -E "FAILED|ERROR" $OUT/gpu_tests.log | head -20
echo "=== done $(date +%T)"
# The compile and combination calls (`compile/`, `gpu_tests.log`); each sources this setup first:
# diffusers and the extras (accelerate, peft, torchao, bitsandbytes) as carried wheel contents, the library prebuilt.
setup() {
  set -o pipefail; export PYTHONUNBUFFERED=1
  mkdir -p /tmp/site && { [ -d /tmp/site/diffusers ] || { tar xJf .device_build/diffusers.tar.xz -C /tmp/site && tar xJf .device_build/extras.tar.xz -C /tmp/site; }; }
  [ -e tessera_diffusers/processors ] || ln -s ../processors tessera_diffusers/processors
  [ -f tessera_diffusers/_native/libtessera_kernels.so ] || { mkdir -p tessera_diffusers/_native && xz -T8 -dc .device_build/after_lib.so.xz > tessera_diffusers/_native/libtessera_kernels.so && cp .device_build/after_manifest.json tessera_diffusers/_native/manifest.json; }
  export PYTHONPATH=/tmp/site:$PWD
}
# Call A: the combination tests, then Wan2.1 720p full depth, eager and compiled; call B: the same loop on HunyuanVideo-1.5.
setup
python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_combinations_gpu.py > $OUT/gpu_tests.log 2>&1
for model in wan hv15; do  # one device call each
  python3 benchmarks/diffusion_loop.py --out $OUT/$model --models $model --systems one-liner,one-liner+compile,dense,dense+compile \
    --steps 3 --max-minutes 6.8 --progress > $OUT/$model.log 2>&1
done

# The wheel calls (`gpu_tests.log`, `memcheck.log`, `../plan_table/kernel_change_ab.md`): the wheel built
# on the 2-core machine (TESSERA_CUDA_ARCHS="80;90" pip wheel . --no-deps -w dist/) installed as a user
# would, the tests run from a copy of tests/ and benchmarks/ (no package beside them), the shipped
# table's library (65f7ed0a) in /tmp/oldlib for the A/B.
wheel_setup() {
  setup
  mkdir -p /tmp/whl /tmp/wt /tmp/oldlib
  python3 -m pip install -q --no-deps --no-index --target /tmp/whl dist/tessera_diffusers-*.whl
  cp -r tests benchmarks pyproject.toml /tmp/wt/
  xz -T8 -dc .device_build/after_lib.so.xz > /tmp/oldlib/libtessera_kernels.so && cp .device_build/after_manifest.json /tmp/oldlib/manifest.json
  export PYTHONPATH=/tmp/whl:/tmp/site; cd /tmp/wt
}
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# Call 1: every GPU test, memcheck on the representative plans.
wheel_setup
python3 -m pytest -m gpu tests -q -p no:cacheprovider -rs > $OUT/gpu_tests.log 2>&1
$CS --tool memcheck --error-exitcode 3 python3 benchmarks/sanitize_check.py > $OUT/memcheck.log 2>&1
# Calls 2 and 3: A (the shipped table's library), B (the wheel's), A again, per group of families, then
# memcheck on the entry-point and merge tests, and the Wan2.1 720p loop with the wheel.
wheel_setup
prof() {  # prof NAME LIB MINUTES ARGS...
  local name=$1 lib=$2 minutes=$3; shift 3
  TESSERA_NATIVE_LIB=$lib python3 -m tessera_diffusers.cli profile --out /tmp/ab/$name --split evaluation \
    --cases-per-combo 1 --no-compile --no-progress --minutes $minutes "$@" > /tmp/ab/$name.log 2>&1
}
OLD=/tmp/oldlib/libtessera_kernels.so NEW=/tmp/whl/tessera_diffusers/_native/libtessera_kernels.so
# (NAT names the ten families; its time budget ends it within the first three, so BIG covers the rest)
NAT="--sizes n32k --families Q16K16,Q32K16,Q32K32,Q64K32,Q64K64-HD,Q64K64,Q64K64-DD,Q128K64,Q128K128,Q384K384 --sources sliding_tile,importance_topk,ssta"
REU="--sizes n32k --families Q16K16,Q32K16,Q32K32 --sources sliding_tile,importance_topk --reused-masks"
BIG="--sizes n32k --families Q64K32,Q64K64,Q128K64,Q128K128,Q384K384 --sources importance_topk,ssta"
prof natA $OLD 1.8 $NAT; prof natB $NEW 1.8 $NAT; prof natA2 $OLD 1.8 $NAT
prof reuA $OLD 0.9 $REU; prof reuB $NEW 0.9 $REU; prof reuA2 $OLD 0.9 $REU
prof bigA $OLD 1.2 $BIG; prof bigB $NEW 1.2 $BIG; prof bigA2 $OLD 1.2 $BIG
$CS --tool memcheck --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_entry_point_checks_gpu.py \
  tests/gpu/test_native_gpu.py -k "non_finite or poisoned or direct_launch or refused or accepted" >> $OUT/memcheck.log 2>&1
python3 benchmarks/diffusion_loop.py --out $OUT/wan --models wan --systems dense,one-liner --steps 3 --max-minutes 4 > $OUT/wan.log 2>&1
