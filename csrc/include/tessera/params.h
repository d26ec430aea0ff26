// Plain C ABI of the Tessera kernel library: raw pointers, sizes, strides and a stream.
// Mirrored field for field by tessera_diffusers/ops.py (ctypes.Structure); keep them in sync.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One block-sparse attention launch over a prepared plan (see tessera_diffusers/prepare.py for
// the metadata format). Tensors are (B, S, H, D) with element strides per (b, s, h); the last dim
// is contiguous.
typedef struct TesseraAttnParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;               // (B, Sq, H, D), same dtype as q
  float* lse;            // [B, H, Sq] natural log-sum-exp, or NULL
  float* o_partial;      // split-K workspace [num_splits, B, H, Sq, D] fp32 (num_splits > 1)
  float* lse_partial;    // split-K workspace [num_splits, B, H, Sq] fp32 (num_splits > 1)

  int64_t q_stride[3];   // element strides of q for (b, s, h)
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t o_stride[3];

  int32_t batch;
  int32_t heads;
  int32_t seq_q;
  int32_t seq_kv;
  int32_t mask_batch;    // 1 (broadcast) or batch
  int32_t mask_heads;    // 1 (broadcast) or heads

  int32_t num_q_tiles;   // nQT
  int32_t capacity;      // cap: KV tiles per query tile in the metadata
  int32_t slots;         // S: KV slots per KV tile
  int32_t q_unit_log2;   // log2(q_unit)
  int32_t kv_unit_log2;  // log2(kv_unit)
  int32_t num_splits;    // split-K parts (1: write o/lse directly)
  int32_t grid_size;     // CTAs to launch; < number of tasks makes the grid persistent

  const int32_t* tile_counts;  // [Bm, Hm, nQT]
  const int32_t* tile_slots;   // [Bm, Hm, nQT, cap, S]
  const int64_t* tile_member;  // [Bm, Hm, nQT, cap]
  const int32_t* q_order;      // [Bm, Hm, nQT]

  float scale_log2;      // softmax scale * log2(e)
} TesseraAttnParams;

// Split-K merge: o_partial/lse_partial -> o (and lse when not NULL).
typedef struct TesseraMergeParams {
  const float* o_partial;    // [num_splits, B, H, Sq, D]
  const float* lse_partial;  // [num_splits, B, H, Sq]
  void* o;                   // (B, Sq, H, D)
  float* lse;                // [B, H, Sq] or NULL
  int64_t o_stride[3];
  int32_t batch;
  int32_t heads;
  int32_t seq_q;
  int32_t head_dim;
  int32_t num_splits;
  int32_t dtype;             // 0 bf16, 1 fp16 (TesseraDtype)
} TesseraMergeParams;

enum TesseraDtype { TESSERA_BF16 = 0, TESSERA_FP16 = 1 };

// Library introspection (the manifest the runtime checks against its kernel table).
int tessera_abi_version(void);
int tessera_num_kernels(void);
const char* tessera_kernel_name(int kernel_id);
int tessera_kernel_smem_bytes(int kernel_id);
int tessera_kernel_threads(int kernel_id);

// Launches. Return a cudaError_t value (0 = success). `stream` is a cudaStream_t.
int tessera_attention_forward(int kernel_id, const TesseraAttnParams* params, void* stream);
int tessera_split_merge(const TesseraMergeParams* params, void* stream);
// Occupancy-derived CTAs per SM for `kernel_id` on the current device (for persistent grids).
int tessera_kernel_ctas_per_sm(int kernel_id);
const char* tessera_error_string(int error);

#ifdef __cplusplus
}
#endif

#define TESSERA_ABI_VERSION 1
