// Plain C ABI of the Tessera kernel library: raw pointers, sizes, strides and a stream.
// Mirrored field for field by tessera_diffusers/library.py (ctypes.Structure); keep them in sync.
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
  int32_t* task_counter; // persistent grids of the Hopper family: one device int32 the launch zeroes
                         // and the CTAs take their next task from (dynamic scheduling); NULL: each
                         // CTA takes every grid_size-th task (static striding)
  const int32_t* q_units;  // grouped query layout: [Bm, Hm, nQT * kq], the query unit (of q_unit rows)
                           // at position a of query tile t is q_units[.., t * kq + a], -1 for none;
                           // NULL: the natural layout (unit t * kq + a). Both families read it.
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

// The block tensor of a logical mask (tessera_diffusers/mask.py): bool [Bm, Hm, nQ, nKV] read as
// bytes (0 / 1), any non-negative strides (0 where a dim is expanded).
typedef struct TesseraBlockMask {
  const uint8_t* blocks;
  int64_t stride[4];     // element (= byte) strides of (mb, mh, query-block row, KV-block column)
  int32_t batch;         // Bm: 1 (broadcast) or B
  int32_t heads;         // Hm: 1 (broadcast) or H
  int32_t rows;          // nQ = ceil(seq_q / block_q)
  int32_t cols;          // nKV = ceil(seq_kv / block_kv)
} TesseraBlockMask;

// Launch preparation of one plan over one mask: the metadata of tessera_diffusers/prepare.py
// (format in its docstring), bit for bit. Units: q_unit rows, kv_unit columns; a query tile holds
// kq = tile_q / q_unit query units, a KV tile S = tile_kv / kv_unit slots (kq * S <= 64).
typedef struct TesseraPrepareParams {
  TesseraBlockMask mask;
  int32_t block_q;       // logical block rows (a multiple of q_unit)
  int32_t block_kv;      // logical block columns (a multiple of kv_unit)
  int32_t seq_q;         // Sq: query units at or past ceil(Sq / q_unit) are inactive
  int32_t seq_kv;        // Skv: n_uk = ceil(Skv / kv_unit) KV units
  int32_t tile_q;        // query rows per query tile (a multiple of q_unit)
  int32_t tile_kv;       // KV columns per KV tile (a multiple of kv_unit)
  int32_t q_unit;        // gcd(block_q, tile_q)
  int32_t kv_unit;       // gcd(block_kv, tile_kv)
  int32_t packed;        // 1: KvLayout.PACKED (active units S per tile), 0: aligned groups of S units
  int32_t longest_first; // 1: q_order = stable descending argsort of tile_counts, 0: identity
  int32_t num_q_tiles;   // nQT = ceil(seq_q / tile_q) (checked)
  int32_t capacity;      // cap of tile_slots / tile_member (tessera_prepare_fill): >= every tile count
  int32_t* tile_counts;  // [Bm, Hm, nQT] out
  int32_t* tile_slots;   // [Bm, Hm, nQT, cap, S] out (tessera_prepare_fill)
  int64_t* tile_member;  // [Bm, Hm, nQT, cap] out (tessera_prepare_fill)
  int32_t* q_order;      // [Bm, Hm, nQT] out (tessera_prepare_fill)
  int32_t* max_count;    // one device int32 of scratch: the longest tile count (tessera_prepare_counts)
} TesseraPrepareParams;

// Most group sizes of one tessera_mask_counts call, and the int64 counts it writes: the six of
// mask_state.count_blocks, then one union sum per group size (unused ones stay 0).
#define TESSERA_MAX_UNION_GROUPS 4
#define TESSERA_MASK_COUNT_SLOTS (6 + TESSERA_MAX_UNION_GROUPS)
enum TesseraMaskCount {
  TESSERA_COUNT_ACTIVE = 0,      // active blocks
  TESSERA_COUNT_SINGLE_RUNS = 1, // runs of length 1 along a row
  TESSERA_COUNT_RUNS = 2,        // runs of consecutive active blocks along a row
  TESSERA_COUNT_OVERLAP = 3,     // active blocks also active in the previous row of the same (mb, mh)
  TESSERA_COUNT_LONGEST_ROW = 4, // most active blocks in one row
  TESSERA_COUNT_EMPTY_ROWS = 5,  // rows with no active block
  TESSERA_COUNT_UNIONS = 6,      // + k: (group, column) pairs active in an aligned group of group_rows[k] rows
};

// Mask statistics: the counts above (and the per-row counts kv_num_blocks) in one launch.
typedef struct TesseraMaskCountsParams {
  TesseraBlockMask mask;
  int32_t num_groups;                            // group sizes in group_rows, 0..TESSERA_MAX_UNION_GROUPS
  int32_t group_rows[TESSERA_MAX_UNION_GROUPS];  // query-block rows per aligned group (>= 1)
  int64_t* counts;       // device [TESSERA_MASK_COUNT_SLOTS] out (zeroed by the call first)
  int32_t* row_counts;   // device [Bm, Hm, nQ] out: active blocks per row, or NULL
} TesseraMaskCountsParams;

// Query-block grouping for the grouped query layout (tessera_diffusers/regroup.py, algorithm in its
// docstring): per (mb, mh) mask head, an order of the query blocks in which each run of `group`
// consecutive entries (one query tile) shares few key blocks beyond its own. Each head's blocks are
// grouped in independent segments of `segment` consecutive blocks (run side by side).
typedef struct TesseraGroupParams {
  TesseraBlockMask mask;
  int32_t group;         // g: query blocks per query tile (>= 1)
  int32_t window;        // W: a group's candidates are the free blocks within W after its seed (>= 1)
  int32_t num_slots;     // ceil(nQ / g) * g: entries per head of q_units
  int32_t segment;       // S: query blocks per segment, a multiple of g; groups never cross a segment
                         // and segment s fills positions [s * S, min((s + 1) * S, nQ)). 0 (or >= nQ):
                         // one segment per head
  int32_t* q_units;      // [Bm, Hm, num_slots] out: query block per position, -1 past the last block
  int64_t* key_blocks;   // [Bm, Hm, 2] out or NULL: key blocks summed over the groups of the natural
                         // order and of the greedy order (the head keeps the greedy one only when fewer)
  int64_t* segment_key_blocks;  // [Bm, Hm, ceil(nQ / S), 2] scratch: the same per segment (one per
                                // head when S is 0 or >= nQ)
} TesseraGroupParams;

// Sizes of the structs above (tessera_struct_bytes), so a mirror can check its layout.
enum TesseraStruct {
  TESSERA_STRUCT_ATTN = 0,
  TESSERA_STRUCT_MERGE = 1,
  TESSERA_STRUCT_BLOCK_MASK = 2,
  TESSERA_STRUCT_PREPARE = 3,
  TESSERA_STRUCT_MASK_COUNTS = 4,
  TESSERA_STRUCT_GROUP = 5,
};

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
// sizeof of one struct of this header (a TesseraStruct value), or -1.
int tessera_struct_bytes(int which);

// Launch preparation (see TesseraPrepareParams). Both return a cudaError_t value.
// tessera_prepare_counts: tile_counts and the longest count (max_count, zeroed first); with
// host_max_count not NULL it also copies that count to the host (a sync of `stream`).
int tessera_prepare_counts(const TesseraPrepareParams* params, int32_t* host_max_count, void* stream);
// tessera_prepare_fill: tile_counts, tile_slots, tile_member and q_order for `capacity` (no sync);
// every tile count must fit: capacity >= the longest (the compact capacity, from
// tessera_prepare_counts) or capacity = ceil(ceil(seq_kv / kv_unit) / S) (the worst case).
int tessera_prepare_fill(const TesseraPrepareParams* params, void* stream);
// Mask statistics (see TesseraMaskCountsParams); with host_counts not NULL it also copies the
// TESSERA_MASK_COUNT_SLOTS counts to the host (a sync of `stream`).
int tessera_mask_counts(const TesseraMaskCountsParams* params, int64_t* host_counts, void* stream);
// Query-block grouping (see TesseraGroupParams), no sync. Returns a cudaError_t value.
int tessera_group_query_blocks(const TesseraGroupParams* params, void* stream);

#ifdef __cplusplus
}
#endif

#define TESSERA_ABI_VERSION 5
