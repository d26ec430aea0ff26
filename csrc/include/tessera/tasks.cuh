// What every kernel family shares: CTA task decoding over the prepared-plan metadata, the per-stage
// description of a KV tile, and the host-side launch (grid, shared memory, persistent grids).
// The metadata format is documented in tessera_diffusers/prepare.py.
#pragma once
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "tessera/params.h"

namespace tessera {

constexpr float kLn2 = 0.69314718055994530942f;

// One CTA task: a query tile of one (b, h), and the part of its KV tile list it handles.
struct Task {
  int b, h;
  int q_tile;        // which query tile (after traversal order)
  int split;
  int tile_begin, tile_end;
  int64_t meta_row;  // (mb * Hm + mh) * nQT + q_tile: row of the metadata tensors
};

__host__ __device__ inline int64_t num_tasks(const TesseraAttnParams& p) {
  return int64_t(p.num_q_tiles) * p.batch * p.heads * p.num_splits;
}

// Tasks are numbered head-major, task = ((b * H + h) * nQT + rank) * num_splits + split: the CTAs
// resident at one time work on the query tiles of one or two heads, longest rows first, so the K/V
// tiles they gather (16 MB per head at 32k tokens, D = 128) are shared in L2.
__device__ __forceinline__ Task decode_task(const TesseraAttnParams& p, int64_t task_id) {
  Task t;
  t.split = int(task_id % p.num_splits);
  const int64_t rest = task_id / p.num_splits;
  const int rank = int(rest % p.num_q_tiles);
  const int bh = int(rest / p.num_q_tiles);
  t.b = bh / p.heads;
  t.h = bh % p.heads;
  const int mb = p.mask_batch == 1 ? 0 : t.b;
  const int mh = p.mask_heads == 1 ? 0 : t.h;
  const int64_t mask_row = (int64_t(mb) * p.mask_heads + mh) * p.num_q_tiles;
  t.q_tile = p.q_order[mask_row + rank];
  t.meta_row = mask_row + t.q_tile;
  const int count = p.tile_counts[t.meta_row];
  const int per = (count + p.num_splits - 1) / p.num_splits;
  t.tile_begin = min(t.split * per, count);
  t.tile_end = min(t.tile_begin + per, count);
  return t;
}

// Token row of row r of task t's query tile: the tile's own rows in the natural layout; in the
// grouped one (p.q_units), row r % q_unit of the query unit that q_units puts at position
// r / q_unit, or -1 where the position holds none (the last tile of a head).
template <int kTileQ>
__device__ __forceinline__ int query_row(const TesseraAttnParams& p, const Task& t, int r) {
  if (p.q_units == nullptr) return t.q_tile * kTileQ + r;
  const int unit = __ldg(p.q_units + t.meta_row * (kTileQ >> p.q_unit_log2) + (r >> p.q_unit_log2));
  return unit < 0 ? -1 : (unit << p.q_unit_log2) + (r & ((1 << p.q_unit_log2) - 1));
}

// Per-stage description of the KV tile in flight, written by the loader, read by the compute.
template <int kMaxSlots>
struct TileMeta {
  int slot_start[kMaxSlots];
  unsigned long long member;
  int needs_mask;  // some (row, column) of the tile is inactive or past Skv
  int partial;     // the tile reaches past Skv (the last, partial block)
};

// First slot index of KV tile `tile` of task `t` (the loaders read tile_slots from here).
__device__ __forceinline__ const int32_t* tile_slots(const TesseraAttnParams& p, const Task& t, int tile) {
  return p.tile_slots + (t.meta_row * p.capacity + tile) * p.slots;
}

// Which (row, column) pairs of KV tile `tile` are active: the membership word of the tile, whether
// the tile reaches past Skv (the last, partial block), and whether any pair must be masked at all.
struct TileActivity {
  unsigned long long member;
  bool partial;
  bool needs_mask;
};

template <int kTileQ>
__device__ __forceinline__ TileActivity tile_activity(const TesseraAttnParams& p, const Task& t, int tile) {
  const int32_t* slots = tile_slots(p, t, tile);
  TileActivity a;
  a.member = static_cast<unsigned long long>(__ldg(p.tile_member + t.meta_row * p.capacity + tile));
  const int bits = (kTileQ >> p.q_unit_log2) * p.slots;
  const unsigned long long all = bits >= 64 ? ~0ull : ((1ull << bits) - 1ull);
  const int last = __ldg(slots + p.slots - 1);
  a.partial = last < 0 || last + (1 << p.kv_unit_log2) > p.seq_kv;
  a.needs_mask = a.member != all || a.partial;
  return a;
}

// Fill `meta` for KV tile `tile` (threads 0..slots-1 write the slot starts, thread 0 the rest).
template <int kTileQ, int kMaxSlots>
__device__ __forceinline__ void read_tile_meta(const TesseraAttnParams& p, const Task& t, int tile,
                                               TileMeta<kMaxSlots>& meta) {
  const int32_t* slots = tile_slots(p, t, tile);
  if (threadIdx.x < p.slots) meta.slot_start[threadIdx.x] = __ldg(slots + threadIdx.x);
  if (threadIdx.x == 0) {
    const TileActivity a = tile_activity<kTileQ>(p, t, tile);
    meta.member = a.member;
    meta.partial = a.partial;
    meta.needs_mask = a.needs_mask;
  }
}

// Log-sum-exp of a row from its running max (log2 domain, scaled) and its sum, as the executor
// gives it: -inf for a row with no active key (sum 0). A +inf or NaN active score makes the sum NaN
// (exp2(inf - inf), exp2(NaN)): the row gets +inf where its max is +inf (a +inf score), else NaN
// (a NaN score, which fmaxf leaves out of the max; logf(NaN) is NaN). Epilogue only.
__device__ __forceinline__ float row_lse(float max_log2, float sum) {
  if (sum == 0.f) return -CUDART_INF_F;
  return max_log2 == CUDART_INF_F ? CUDART_INF_F : max_log2 * kLn2 + logf(sum);
}

// Launch `kernel` with one CTA per task, or a persistent grid of p.grid_size CTAs; `extra` are
// the kernel's parameters after `p` (the Hopper family's TMA descriptors).
template <class Kernel, class... Extra>
int launch_tasks(Kernel kernel, int threads, int smem_bytes, const TesseraAttnParams& p, cudaStream_t stream,
                 const Extra&... extra) {
  // Dynamic plus static shared memory may pass 48 KB even when the dynamic part alone does not;
  // the attribute is per device, so it is set on every launch (a host-side call of ~1 us).
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return int(err);
  const int64_t tasks = num_tasks(p);
  if (tasks == 0) return 0;
  const int64_t grid = p.grid_size > 0 && p.grid_size < tasks ? p.grid_size : tasks;
  kernel<<<dim3(unsigned(grid)), dim3(threads), smem_bytes, stream>>>(p, extra...);
  return int(cudaGetLastError());
}

// What the C entry point checks a launch of one kernel against (library.cu), from its traits.
struct KernelLimits {
  int tile_q;
  int tile_kv;
  int max_slots;          // KV slots per tile the kernel's slot arrays hold (T::kMaxSlots)
  int element_bytes;      // of q, k, v and o
  bool paired_o_stores;   // O is stored two elements per 32-bit store: a 4-byte aligned o, even strides
};

template <class T>
constexpr KernelLimits kernel_limits() {
  return {T::kTileQ, T::kTileKV, T::kMaxSlots, int(sizeof(typename T::Element)), T::kPairedOStores};
}

template <class Kernel>
int occupancy(Kernel kernel, int threads, int smem_bytes) {
  int blocks = 0;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes);
  return blocks;
}

}  // namespace tessera
