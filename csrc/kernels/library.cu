// The C ABI of the kernel library: introspection (the manifest), launches by kernel id, and the
// native launch preparation and mask statistics (tessera/prepare.cuh).
#include <cuda_runtime.h>

#include <initializer_list>

#include "tessera/merge.cuh"
#include "tessera/params.h"
#include "tessera/prepare.cuh"
#include "tessera/regroup.cuh"
#include "tessera/tasks.cuh"  // KernelLimits, num_tasks
#include "registry.inc"       // generated: declarations + TESSERA_KERNEL_ENTRIES

namespace {

struct KernelEntry {
  const char* name;
  int (*smem_bytes)();
  int (*threads)();
  int (*launch)(const TesseraAttnParams&, cudaStream_t);
  int (*ctas_per_sm)();
  tessera::KernelLimits (*limits)();
};

const KernelEntry kEntries[] = {TESSERA_KERNEL_ENTRIES};
constexpr int kNumEntries = int(sizeof(kEntries) / sizeof(kEntries[0]));

bool valid_id(int id) { return id >= 0 && id < kNumEntries; }

// The smallest query unit and KV slot: 16 rows or tokens (blocks and tiles are multiples of 16; a
// slot then spans whole n8 column blocks of the score tile). Units are powers of two below 2^16.
constexpr int kMinUnitLog2 = 4;
constexpr int kMaxUnitLog2 = 15;
constexpr int kLoadBytes = 16;  // q, k, v are read in 16-byte chunks (cp.async, TMA)

// Whether the product of the positive `factors` is at most `limit` (no int64 overflow on the way:
// every factor is below 2^31).
bool product_at_most(std::initializer_list<int64_t> factors, int64_t limit) {
  int64_t product = 1;
  for (const int64_t f : factors) {
    product *= f;
    if (product > limit) return false;
  }
  return true;
}

// Whether `ptr` is a multiple of `bytes` (NULL is: a NULL optional buffer is checked apart).
bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % uintptr_t(bytes) == 0; }

bool strides_multiple_of(const int64_t (&stride)[3], int64_t elements) {
  return stride[0] % elements == 0 && stride[1] % elements == 0 && stride[2] % elements == 0;
}

// What the attention kernels trust in `p`, for the kernel of `k`, checked on the host before any
// launch: the Python launcher checks the same against the tensors (ops.check_launch), this refuses
// a call whose sizes, units or pointers would make a kernel read or write past its buffers.
bool valid_attention(const TesseraAttnParams& p, const tessera::KernelLimits& k) {
  // Always read or written; lse, q_units and task_counter may be NULL.
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr || p.tile_counts == nullptr ||
      p.tile_slots == nullptr || p.tile_member == nullptr || p.q_order == nullptr)
    return false;
  if (p.batch < 1 || p.heads < 1 || p.seq_q < 1 || p.seq_kv < 1) return false;
  if ((p.mask_batch != 1 && p.mask_batch != p.batch) || (p.mask_heads != 1 && p.mask_heads != p.heads)) return false;
  if (p.q_unit_log2 < kMinUnitLog2 || p.q_unit_log2 > kMaxUnitLog2 || p.kv_unit_log2 < kMinUnitLog2 ||
      p.kv_unit_log2 > kMaxUnitLog2)
    return false;
  // S slots of kv_unit tokens make the KV tile, within the kernel's slot arrays (shared memory).
  if (p.slots < 1 || p.slots > k.max_slots || (p.slots << p.kv_unit_log2) != k.tile_kv) return false;
  // kq = tile_q / q_unit whole query units, and one membership bit per (query unit, slot).
  const int q_unit = 1 << p.q_unit_log2;
  if (k.tile_q % q_unit != 0 || (k.tile_q / q_unit) * p.slots > tessera::prep::kMembershipBits) return false;
  if (p.num_q_tiles != tessera::prep::ceil_div(p.seq_q, k.tile_q) || p.capacity < 0 || p.grid_size < 0) return false;
  if (p.num_splits < 1 || (p.num_splits > 1 && (p.o_partial == nullptr || p.lse_partial == nullptr))) return false;
  // One CTA per task at most (grid.x) and task indices decoded as int.
  if (!product_at_most({p.num_q_tiles, p.batch, p.heads, p.num_splits}, INT32_MAX)) return false;
  const int64_t load_elements = kLoadBytes / k.element_bytes;
  if (!aligned(p.q, kLoadBytes) || !aligned(p.k, kLoadBytes) || !aligned(p.v, kLoadBytes) ||
      !strides_multiple_of(p.q_stride, load_elements) || !strides_multiple_of(p.k_stride, load_elements) ||
      !strides_multiple_of(p.v_stride, load_elements))
    return false;
  if (k.paired_o_stores && p.num_splits == 1 && (!aligned(p.o, 2 * k.element_bytes) || !strides_multiple_of(p.o_stride, 2)))
    return false;
  // The other buffers are read and written in whole elements (o_partial in float2 pairs).
  return aligned(p.o, k.element_bytes) && aligned(p.lse, 4) && aligned(p.o_partial, 8) && aligned(p.lse_partial, 4) &&
         aligned(p.tile_counts, 4) && aligned(p.tile_slots, 4) && aligned(p.tile_member, 8) && aligned(p.q_order, 4) &&
         aligned(p.q_units, 4) && aligned(p.task_counter, 4);
}

// What the split-K merge trusts in `p`.
bool valid_merge(const TesseraMergeParams& p) {
  if (p.o_partial == nullptr || p.lse_partial == nullptr || p.o == nullptr) return false;  // lse may be NULL
  if (p.batch < 1 || p.heads < 1 || p.seq_q < 1 || p.num_splits < 1) return false;
  if (p.head_dim < 1 || p.head_dim > tessera::kMaxMergeHeadDim) return false;
  if (p.dtype != TESSERA_BF16 && p.dtype != TESSERA_FP16) return false;
  if (!aligned(p.o_partial, 4) || !aligned(p.lse_partial, 4) || !aligned(p.o, 2) || !aligned(p.lse, 4)) return false;
  // One warp per row, kMergeWarps rows per CTA: the grid must fit grid.x.
  return product_at_most({p.batch, p.heads, p.seq_q}, int64_t(INT32_MAX) * tessera::kMergeWarps);
}

}  // namespace

extern "C" {

int tessera_abi_version(void) { return TESSERA_ABI_VERSION; }
int tessera_num_kernels(void) { return kNumEntries; }
const char* tessera_kernel_name(int id) { return valid_id(id) ? kEntries[id].name : nullptr; }
int tessera_kernel_smem_bytes(int id) { return valid_id(id) ? kEntries[id].smem_bytes() : -1; }
int tessera_kernel_threads(int id) { return valid_id(id) ? kEntries[id].threads() : -1; }
int tessera_kernel_ctas_per_sm(int id) { return valid_id(id) ? kEntries[id].ctas_per_sm() : -1; }

int tessera_attention_forward(int id, const TesseraAttnParams* params, void* stream) {
  if (!valid_id(id) || params == nullptr || !valid_attention(*params, kEntries[id].limits()))
    return int(cudaErrorInvalidValue);
  return kEntries[id].launch(*params, static_cast<cudaStream_t>(stream));
}

int tessera_split_merge(const TesseraMergeParams* params, void* stream) {
  if (params == nullptr || !valid_merge(*params)) return int(cudaErrorInvalidValue);
  return tessera::launch_split_merge(*params, static_cast<cudaStream_t>(stream));
}

// The preparation, statistics and grouping launchers check their parameters themselves
// (prep::make_geometry, prep::valid_mask, regroup::make_layout).
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
