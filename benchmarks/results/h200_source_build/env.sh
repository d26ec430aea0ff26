# Sourced first in every call: the carried packages (wheel contents, unpacked into /tmp/site), paths.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/site
for a in .device_build/*.tar.xz; do tar xJf "$a" -C /tmp/site || exit 1; done
export PYTHONPATH=/tmp/site:$PWD
[ -e tessera_diffusers/processors ] || ln -s ../processors tessera_diffusers/processors
