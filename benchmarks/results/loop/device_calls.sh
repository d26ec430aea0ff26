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
