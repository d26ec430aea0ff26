// The C ABI of the kernel library: introspection (the manifest), launches by kernel id, and the
// native launch preparation and mask statistics (tessera/prepare.cuh).
#include <cuda_runtime.h>

#include "tessera/merge.cuh"
#include "tessera/params.h"
#include "tessera/prepare.cuh"
#include "tessera/regroup.cuh"
#include "registry.inc"  // generated: declarations + TESSERA_KERNEL_ENTRIES

namespace {

struct KernelEntry {
  const char* name;
  int (*smem_bytes)();
  int (*threads)();
  int (*launch)(const TesseraAttnParams&, cudaStream_t);
  int (*ctas_per_sm)();
};

const KernelEntry kEntries[] = {TESSERA_KERNEL_ENTRIES};
constexpr int kNumEntries = int(sizeof(kEntries) / sizeof(kEntries[0]));

bool valid_id(int id) { return id >= 0 && id < kNumEntries; }

}  // namespace

extern "C" {

int tessera_abi_version(void) { return TESSERA_ABI_VERSION; }
int tessera_num_kernels(void) { return kNumEntries; }
const char* tessera_kernel_name(int id) { return valid_id(id) ? kEntries[id].name : nullptr; }
int tessera_kernel_smem_bytes(int id) { return valid_id(id) ? kEntries[id].smem_bytes() : -1; }
int tessera_kernel_threads(int id) { return valid_id(id) ? kEntries[id].threads() : -1; }
int tessera_kernel_ctas_per_sm(int id) { return valid_id(id) ? kEntries[id].ctas_per_sm() : -1; }

int tessera_attention_forward(int id, const TesseraAttnParams* params, void* stream) {
  if (!valid_id(id) || params == nullptr) return int(cudaErrorInvalidValue);
  return kEntries[id].launch(*params, static_cast<cudaStream_t>(stream));
}

int tessera_split_merge(const TesseraMergeParams* params, void* stream) {
  if (params == nullptr || params->head_dim > tessera::kMaxMergeHeadDim) return int(cudaErrorInvalidValue);
  return tessera::launch_split_merge(*params, static_cast<cudaStream_t>(stream));
}

int tessera_prepare_counts(const TesseraPrepareParams* params, int32_t* host_max_count, void* stream) {
  if (params == nullptr) return int(cudaErrorInvalidValue);
  return tessera::prep::launch_prepare_counts(*params, host_max_count, static_cast<cudaStream_t>(stream));
}

int tessera_prepare_fill(const TesseraPrepareParams* params, void* stream) {
  if (params == nullptr) return int(cudaErrorInvalidValue);
  return tessera::prep::launch_prepare_fill(*params, static_cast<cudaStream_t>(stream));
}

int tessera_mask_counts(const TesseraMaskCountsParams* params, int64_t* host_counts, void* stream) {
  if (params == nullptr) return int(cudaErrorInvalidValue);
  return tessera::prep::launch_mask_counts(*params, host_counts, static_cast<cudaStream_t>(stream));
}

int tessera_group_query_blocks(const TesseraGroupParams* params, void* stream) {
  if (params == nullptr) return int(cudaErrorInvalidValue);
  return tessera::regroup::launch_group_query_blocks(*params, static_cast<cudaStream_t>(stream));
}

const char* tessera_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int tessera_struct_bytes(int which) {
  switch (which) {
    case TESSERA_STRUCT_ATTN: return int(sizeof(TesseraAttnParams));
    case TESSERA_STRUCT_MERGE: return int(sizeof(TesseraMergeParams));
    case TESSERA_STRUCT_BLOCK_MASK: return int(sizeof(TesseraBlockMask));
    case TESSERA_STRUCT_PREPARE: return int(sizeof(TesseraPrepareParams));
    case TESSERA_STRUCT_MASK_COUNTS: return int(sizeof(TesseraMaskCountsParams));
    case TESSERA_STRUCT_GROUP: return int(sizeof(TesseraGroupParams));
    default: return -1;
  }
}

}  // extern "C"
