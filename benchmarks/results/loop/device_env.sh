# Sourced first in every device call: carried packages (wheel contents) into /tmp/site, paths.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/site
for a in .device_build/*.tar.xz; do tar xJf "$a" -C /tmp/site || exit 1; done
export PYTHONPATH=/tmp/site:$PWD
[ -e tessera_diffusers/processors ] || ln -s ../processors tessera_diffusers/processors
if [ -f .device_build/libtessera_kernels.so.xz ]; then
  mkdir -p /tmp/nat && xz -dc .device_build/libtessera_kernels.so.xz > /tmp/nat/libtessera_kernels.so && cp .device_build/manifest.json /tmp/nat/
else
  echo "=== build $(date +%T)"; start=$(date +%s)
  MAX_JOBS=16 TESSERA_CUDA_ARCHS=90 timeout 240 python3 csrc/build_native.py --out /tmp/nat --build-dir /tmp/nbuild > $OUT/build.log 2>&1
  echo "build rc=$? in $(( $(date +%s) - start )) s"; tail -2 $OUT/build.log
fi
export TESSERA_NATIVE_LIB=/tmp/nat/libtessera_kernels.so
