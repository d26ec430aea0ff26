// Launch preparation and mask statistics on the device: the metadata of
// tessera_diffusers/prepare.py (format in its docstring) and the counts of mask_state.count_blocks /
// MaskState.row_union_ratios, bit for bit, in a few launches instead of a few dozen torch ops.
//
//   prepare_count_kernel  one CTA per query tile: its tile count, and the longest count (atomicMax)
//   prepare_fill_kernel   one CTA per query tile: tile count, slots and membership words for `cap`
//   prepare_order_kernel  CTAs of kThreads query tiles of one (mb, mh): q_order
//   mask_count_kernel     one warp per query-block row (grid-stride): the statistics' counts,
//                         a 32-bit word per lane and step where the row allows it
//
// Terms (prepare.py): a query tile t holds the kq query units t * kq + a; a KV unit u is kv_unit
// tokens; activity(query unit, KV unit u) = blocks[.., unit / rq, u / rk] (a unit never straddles
// a block; rq = block_q / q_unit, rk = block_kv / kv_unit), 0 for a query unit past Sq. A KV unit of
// a query tile is *active* when some query unit of the tile is active there. The tile list of a
// query tile is a list of *flags* in ascending order: active units (packed layout, S per tile) or
// aligned groups of S units holding an active unit (contiguous layout, one per tile).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "tessera/params.h"

namespace tessera::prep {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kMembershipBits = 64;  // one int64 membership word per KV tile
constexpr int kMaxQueryUnits = kMembershipBits;  // kq <= kq * S <= 64
constexpr int kMaskCountCtas = 1024;  // grid of mask_count_kernel: a few waves of warps, one atomic set per CTA
static_assert(kThreads % 32 == 0 && kWarps <= 32, "block scans keep one total per warp, read by every thread");
static_assert(TESSERA_MASK_COUNT_SLOTS == TESSERA_COUNT_UNIONS + TESSERA_MAX_UNION_GROUPS, "count layout");

// One plan over one mask, derived and checked on the host (make_geometry).
struct Geometry {
  TesseraBlockMask mask;
  int q_units_per_block;   // rq = block_q / q_unit
  int kv_units_per_block;  // rk = block_kv / kv_unit
  int q_units;             // kq: query units per query tile
  int slots;               // S: KV units per KV tile
  int live_q_units;        // ceil(Sq / q_unit): query units holding a row
  int kv_units;            // n_uk = ceil(Skv / kv_unit)
  int kv_groups;           // ceil(n_uk / S): aligned groups of S units
  int num_q_tiles;         // nQT
  int kv_unit;             // tokens per KV unit
  int capacity;            // cap: KV tiles per query tile in tile_slots / tile_member
  int packed;              // 1: packed layout
  int longest_first;       // 1: q_order by descending count
  int32_t* tile_counts;    // [Bm, Hm, nQT]
  int32_t* tile_slots;     // [Bm, Hm, nQT, cap, S]; read back by the CTA that wrote it (not const)
  int64_t* tile_member;    // [Bm, Hm, nQT, cap]
  int32_t* q_order;        // [Bm, Hm, nQT]
  int32_t* max_count;      // one int
};

__host__ __device__ inline int ceil_div(int a, int b) { return int((int64_t(a) + b - 1) / b); }

__host__ __device__ inline int num_flags(const Geometry& g) { return g.packed ? g.kv_units : g.kv_groups; }

// KV tiles of a query tile with `flags` flags.
__host__ __device__ inline int tile_count(const Geometry& g, int flags) {
  return g.packed ? ceil_div(flags, g.slots) : flags;
}

// ------------------------------------------------------------------ block-wide helpers

__device__ __forceinline__ int warp_sum(int v) {
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullWarp, v, d);
  return v;
}

// Sum of one int per thread, returned to every thread. Every thread of the block must call it.
__device__ __forceinline__ int block_sum(int v, int* warp_totals) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) warp_totals[threadIdx.x >> 5] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_totals[w];
  __syncthreads();  // warp_totals may be reused on return
  return total;
}

// Exclusive prefix sum of one int per thread in thread order; `total` gets the block's sum.
// Every thread of the block must call it.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_totals, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = v;
  for (int d = 1; d < 32; d <<= 1) {
    const int below = __shfl_up_sync(kFullWarp, inclusive, d);
    if (lane >= d) inclusive += below;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    const int t = warp_totals[w];
    before += w < warp ? t : 0;
    sum += t;
  }
  __syncthreads();  // warp_totals may be reused on return
  *total = sum;
  return before + inclusive - v;
}

// ------------------------------------------------------------------ unit activity of one query tile

// The query units of the query tile of metadata row `tile_row` ((mb * Hm + mh) * nQT + t): the byte
// offset of each unit's block row in `rows` (-1 for a unit past Sq), in shared memory. Returns the
// (mb, mh) slice of the block tensor. Every thread of the block must call it (it syncs).
__device__ __forceinline__ const uint8_t* load_query_units(const Geometry& g, int64_t tile_row, int64_t* rows) {
  const int t = int(tile_row % g.num_q_tiles);
  const int64_t bh = tile_row / g.num_q_tiles;
  const int64_t mb = bh / g.mask.heads, mh = bh % g.mask.heads;
  for (int a = threadIdx.x; a < g.q_units; a += kThreads) {
    const int64_t unit = int64_t(t) * g.q_units + a;
    rows[a] = unit < g.live_q_units ? (unit / g.q_units_per_block) * g.mask.stride[2] : -1;
  }
  __syncthreads();
  return g.mask.blocks + mb * g.mask.stride[0] + mh * g.mask.stride[1];
}

// Byte offset of the block column of KV unit `unit` (< n_uk) in a block row.
__device__ __forceinline__ int64_t unit_column(const Geometry& g, int unit) {
  return int64_t(unit / g.kv_units_per_block) * g.mask.stride[3];
}

// Whether query unit `a` of the tile is active at the KV unit of block column offset `column`.
__device__ __forceinline__ bool unit_active(const uint8_t* slice, const int64_t* rows, int a, int64_t column) {
  return rows[a] >= 0 && slice[rows[a] + column] != 0;
}

// Whether some query unit of the tile is active at KV unit `unit` (< n_uk).
__device__ __forceinline__ bool unit_any(const Geometry& g, const uint8_t* slice, const int64_t* rows, int unit) {
  const int64_t column = unit_column(g, unit);
  for (int a = 0; a < g.q_units; ++a)
    if (unit_active(slice, rows, a, column)) return true;
  return false;
}

// Flag `f` of the tile list: KV unit f is active (packed), or group f holds an active unit.
__device__ __forceinline__ bool kv_flag(const Geometry& g, const uint8_t* slice, const int64_t* rows, int f) {
  if (g.packed) return unit_any(g, slice, rows, f);
  const int first = f * g.slots;
  const int last = min(first + g.slots, g.kv_units);
  for (int unit = first; unit < last; ++unit)
    if (unit_any(g, slice, rows, unit)) return true;
  return false;
}

// ------------------------------------------------------------------ kernels

// One CTA per query tile: its tile count, and the longest count over all tiles.
__global__ void __launch_bounds__(kThreads) prepare_count_kernel(const __grid_constant__ Geometry g) {
  __shared__ int64_t rows[kMaxQueryUnits];
  __shared__ int warp_totals[kWarps];
  const int64_t tile_row = blockIdx.x;
  const uint8_t* slice = load_query_units(g, tile_row, rows);
  const int flags = num_flags(g);
  int mine = 0;
  for (int f = threadIdx.x; f < flags; f += kThreads) mine += kv_flag(g, slice, rows, f) ? 1 : 0;
  const int total = block_sum(mine, warp_totals);
  if (threadIdx.x == 0) {
    const int count = tile_count(g, total);
    g.tile_counts[tile_row] = count;
    // The longest so far only grows: a stale read costs an extra atomic, never a wrong maximum, and
    // skipping the atomic when it cannot raise the value spares thousands of CTAs one contended address.
    if (count > *reinterpret_cast<volatile int32_t*>(g.max_count)) atomicMax(g.max_count, count);
  }
}

// One CTA per query tile: the flags in ascending order by a block-wide scan (chunks of kThreads),
// each written to its position; -1 slots past the count up to cap; then the membership words read
// back from the slots (this CTA's global writes are visible to it after __syncthreads).
__global__ void __launch_bounds__(kThreads) prepare_fill_kernel(const __grid_constant__ Geometry g) {
  __shared__ int64_t rows[kMaxQueryUnits];
  __shared__ int warp_totals[kWarps];
  const int64_t tile_row = blockIdx.x;
  const uint8_t* slice = load_query_units(g, tile_row, rows);
  const int flags = num_flags(g);
  const int slots_per_tile = g.slots;
  const int64_t capacity = g.capacity;
  const int64_t slot_capacity = capacity * slots_per_tile;
  int32_t* slots = g.tile_slots + tile_row * slot_capacity;
  int64_t* member = g.tile_member + tile_row * capacity;

  int placed = 0;  // flags of the chunks before this one (the same in every thread)
  for (int chunk = 0; chunk < flags; chunk += kThreads) {
    const int f = chunk + int(threadIdx.x);
    const bool flag = f < flags && kv_flag(g, slice, rows, f);
    int chunk_flags;
    const int before = block_exclusive_scan(flag ? 1 : 0, warp_totals, &chunk_flags);
    if (flag) {
      const int64_t position = int64_t(placed) + before;
      if (g.packed) {
        if (position < slot_capacity) slots[position] = f * g.kv_unit;
      } else if (position < capacity) {
        for (int s = 0; s < slots_per_tile; ++s) {
          const int unit = f * slots_per_tile + s;
          slots[position * slots_per_tile + s] = unit < g.kv_units ? unit * g.kv_unit : -1;
        }
      }
    }
    placed += chunk_flags;
  }
  const int64_t first_empty = g.packed ? int64_t(placed) : int64_t(placed) * slots_per_tile;
  for (int64_t e = first_empty + threadIdx.x; e < slot_capacity; e += kThreads) slots[e] = -1;
  if (threadIdx.x == 0) g.tile_counts[tile_row] = tile_count(g, placed);
  __syncthreads();

  // KV tiles holding a slot: the membership words past them are 0 (their slots are all -1), written
  // without reading the slots back (most of an uncompacted row is such padding).
  const int64_t filled = g.packed ? int64_t(ceil_div(placed, slots_per_tile)) : int64_t(placed);
  for (int64_t tile = threadIdx.x; tile < capacity; tile += kThreads) {
    unsigned long long word = 0;
    for (int s = 0; s < (tile < filled ? slots_per_tile : 0); ++s) {
      const int32_t start = slots[tile * slots_per_tile + s];
      if (start < 0) continue;
      const int64_t column = unit_column(g, start / g.kv_unit);
      for (int a = 0; a < g.q_units; ++a)
        if (unit_active(slice, rows, a, column)) word |= 1ull << (a * slots_per_tile + s);
    }
    member[tile] = static_cast<int64_t>(word);
  }
}

// Rank order key: larger for a longer count, then for a smaller index (unique per row).
__device__ __forceinline__ unsigned long long order_key(int32_t count, int index) {
  return (static_cast<unsigned long long>(static_cast<uint32_t>(count)) << 32) |
         static_cast<unsigned long long>(~static_cast<uint32_t>(index));
}

// CTAs of kThreads query tiles of one (mb, mh); grid = Bm * Hm * ceil(nQT / kThreads). Longest
// first: query tile i goes to rank #{j: c_j > c_i} + #{j < i: c_j == c_i} (a stable descending
// argsort), counting over every tile of the row in shared-memory chunks. Otherwise the identity.
__global__ void __launch_bounds__(kThreads) prepare_order_kernel(const __grid_constant__ Geometry g) {
  __shared__ unsigned long long keys[kThreads];
  const int chunks = ceil_div(g.num_q_tiles, kThreads);
  const int64_t bh = blockIdx.x / chunks;
  const int i = int(blockIdx.x % chunks) * kThreads + int(threadIdx.x);
  const int32_t* counts = g.tile_counts + bh * g.num_q_tiles;
  int32_t* order = g.q_order + bh * g.num_q_tiles;
  if (!g.longest_first) {
    if (i < g.num_q_tiles) order[i] = i;
    return;
  }
  // Padding keys are 0, below every real key (a real key has a nonzero low word: ~index, index < 2^31).
  const unsigned long long mine = i < g.num_q_tiles ? order_key(counts[i], i) : 0ull;
  int rank = 0;
  for (int chunk = 0; chunk < g.num_q_tiles; chunk += kThreads) {
    const int j = chunk + int(threadIdx.x);
    keys[threadIdx.x] = j < g.num_q_tiles ? order_key(counts[j], j) : 0ull;
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kThreads; ++k) rank += keys[k] > mine ? 1 : 0;
    __syncthreads();
  }
  if (i < g.num_q_tiles) order[rank] = i;
}

// The four flags of one 32-bit word of a block row (bytes 0..3 -> bits 0..3; a byte is active when
// nonzero, as in the byte path).
__device__ __forceinline__ uint32_t active_nibble(uint32_t word) {
  const uint32_t v = __vcmpne4(word, 0u);  // 0xff in each nonzero byte
  return ((v >> 7) & 1u) | ((v >> 14) & 2u) | ((v >> 21) & 4u) | ((v >> 28) & 8u);
}

// Counts of one block row. In the helpers below, column j of row `r` is r[j * col_stride] and `i`
// is the row's index in its (mb, mh) slice (the previous row, at r - row_stride, exists when i > 0).
struct RowCounts {
  int active = 0;
  unsigned long long runs = 0, single_runs = 0, overlap = 0;
};

// Columns [first, cols), one lane per column (the byte path).
__device__ __forceinline__ void count_columns(const uint8_t* r, int first, int cols, int64_t col_stride,
                                              int64_t row_stride, int i, int lane, RowCounts& c) {
  for (int j = first + lane; j < cols; j += 32) {
    if (r[j * col_stride] == 0) continue;
    ++c.active;
    const bool left = j > 0 && r[(j - 1) * col_stride] != 0;
    const bool right = j + 1 < cols && r[(j + 1) * col_stride] != 0;
    if (!left) {
      ++c.runs;
      if (!right) ++c.single_runs;
    }
    if (i > 0 && r[j * col_stride - row_stride] != 0) ++c.overlap;
  }
}

// The words of a row whose columns are contiguous bytes and whose words are 4-byte aligned (the
// row and the row above it): columns [0, 4 * words), four per lane per step, the neighbours of a
// word's first and last column read as bytes. Unconditional loads, so a lane's loads overlap.
__device__ __forceinline__ void count_words(const uint8_t* r, int words, int cols, int64_t row_stride, int i,
                                            int lane, RowCounts& c) {
  const uint32_t* row = reinterpret_cast<const uint32_t*>(r);
  const uint32_t* above = reinterpret_cast<const uint32_t*>(r - row_stride);
  for (int w = lane; w < words; w += 32) {
    const uint32_t m = active_nibble(__ldg(row + w));
    const uint32_t left = w > 0 ? uint32_t(__ldg(r + 4 * w - 1) != 0) : 0u;
    const uint32_t right = 4 * w + 4 < cols ? uint32_t(__ldg(r + 4 * w + 4) != 0) : 0u;
    const uint32_t starts = m & ~(((m << 1) | left) & 0xfu);  // active, the column before not
    const uint32_t ends = m & ~(((m >> 1) | (right << 3)) & 0xfu);  // active, the column after not
    c.active += __popc(m);
    c.runs += __popc(starts);
    c.single_runs += __popc(starts & ends);
    if (i > 0) c.overlap += __popc(m & active_nibble(__ldg(above + w)));
  }
}

// Columns of an aligned group of `rows_in_group` rows from `r` active in at least one of them.
__device__ __forceinline__ unsigned long long count_union(const uint8_t* r, int words, int cols, int64_t col_stride,
                                                          int64_t row_stride, int rows_in_group, int lane) {
  unsigned long long n = 0;
  for (int w = lane; w < words; w += 32) {
    uint32_t any = 0;
    for (int ii = 0; ii < rows_in_group; ++ii)
      any |= active_nibble(__ldg(reinterpret_cast<const uint32_t*>(r + ii * row_stride) + w));
    n += __popc(any);
  }
  for (int j = 4 * words + lane; j < cols; j += 32) {
    for (int ii = 0; ii < rows_in_group; ++ii) {
      if (r[ii * row_stride + j * col_stride] != 0) {
        ++n;
        break;
      }
    }
  }
  return n;
}

// One warp per query-block row r = (mb * Hm + mh) * nQ + i (grid-stride), lanes over the columns;
// per-lane int64 counts, reduced over the CTA at the end: one atomic per count per CTA. A row of
// contiguous, 4-byte-aligned bytes (the row above it too) is read a word per lane and step; the
// rest of it, and any other row, a byte per lane and step.
__global__ void __launch_bounds__(kThreads) mask_count_kernel(const __grid_constant__ TesseraMaskCountsParams p) {
  __shared__ unsigned long long partial[kWarps][TESSERA_MASK_COUNT_SLOTS];
  const TesseraBlockMask& m = p.mask;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t num_rows = int64_t(m.batch) * m.heads * m.rows;
  const int64_t col_stride = m.stride[3], row_stride = m.stride[2];
  const bool word_rows = col_stride == 1 && row_stride % 4 == 0;
  unsigned long long counts[TESSERA_MASK_COUNT_SLOTS] = {};  // longest and empty rows: lane 0 only

  for (int64_t row = int64_t(blockIdx.x) * kWarps + warp; row < num_rows; row += int64_t(gridDim.x) * kWarps) {
    const int i = int(row % m.rows);
    const int64_t bh = row / m.rows;
    const uint8_t* r = m.blocks + (bh / m.heads) * m.stride[0] + (bh % m.heads) * m.stride[1] + i * row_stride;
    const int words = word_rows && (reinterpret_cast<uintptr_t>(r) & 3) == 0 ? m.cols / 4 : 0;
    RowCounts c;
    count_words(r, words, m.cols, row_stride, i, lane, c);
    count_columns(r, 4 * words, m.cols, col_stride, row_stride, i, lane, c);
    counts[TESSERA_COUNT_RUNS] += c.runs;
    counts[TESSERA_COUNT_SINGLE_RUNS] += c.single_runs;
    counts[TESSERA_COUNT_OVERLAP] += c.overlap;
    counts[TESSERA_COUNT_ACTIVE] += c.active;
#pragma unroll
    for (int k = 0; k < TESSERA_MAX_UNION_GROUPS; ++k) {  // unrolled: counts[] stays in registers
      if (k >= p.num_groups || i % p.group_rows[k] != 0) continue;  // not the first row of a group
      const int rows_in_group = int(min(int64_t(p.group_rows[k]), int64_t(m.rows) - i));
      counts[TESSERA_COUNT_UNIONS + k] += count_union(r, words, m.cols, col_stride, row_stride, rows_in_group, lane);
    }
    const int total = warp_sum(c.active);
    if (lane == 0) {
      if (p.row_counts != nullptr) p.row_counts[row] = total;
      counts[TESSERA_COUNT_LONGEST_ROW] = max(counts[TESSERA_COUNT_LONGEST_ROW], static_cast<unsigned long long>(total));
      counts[TESSERA_COUNT_EMPTY_ROWS] += total == 0 ? 1 : 0;
    }
  }

#pragma unroll
  for (int c = 0; c < TESSERA_MASK_COUNT_SLOTS; ++c) {
    unsigned long long v = counts[c];
    for (int d = 16; d > 0; d >>= 1) {
      const unsigned long long other = __shfl_xor_sync(kFullWarp, v, d);
      v = c == TESSERA_COUNT_LONGEST_ROW ? max(v, other) : v + other;
    }
    if (lane == 0) partial[warp][c] = v;
  }
  __syncthreads();
  if (threadIdx.x < TESSERA_MASK_COUNT_SLOTS) {
    const int c = threadIdx.x;
    unsigned long long v = 0;
    for (int w = 0; w < kWarps; ++w) v = c == TESSERA_COUNT_LONGEST_ROW ? max(v, partial[w][c]) : v + partial[w][c];
    unsigned long long* out = reinterpret_cast<unsigned long long*>(p.counts) + c;
    if (v != 0) {
      if (c == TESSERA_COUNT_LONGEST_ROW)
        atomicMax(out, v);
      else
        atomicAdd(out, v);
    }
  }
}

// ------------------------------------------------------------------ host launchers

inline bool valid_mask(const TesseraBlockMask& m) {
  if (m.blocks == nullptr || m.batch < 1 || m.heads < 1 || m.rows < 1 || m.cols < 1) return false;
  for (int d = 0; d < 4; ++d)
    if (m.stride[d] < 0) return false;
  return true;
}

// Checks `p` and derives its geometry; cudaErrorInvalidValue on any inconsistency.
inline cudaError_t make_geometry(const TesseraPrepareParams& p, Geometry* g) {
  const bool positive = p.block_q > 0 && p.block_kv > 0 && p.seq_q > 0 && p.seq_kv > 0 && p.tile_q > 0 &&
                        p.tile_kv > 0 && p.q_unit > 0 && p.kv_unit > 0;
  if (!valid_mask(p.mask) || !positive) return cudaErrorInvalidValue;
  if (p.block_q % p.q_unit || p.tile_q % p.q_unit || p.block_kv % p.kv_unit || p.tile_kv % p.kv_unit)
    return cudaErrorInvalidValue;
  const int64_t q_units = p.tile_q / p.q_unit, slots = p.tile_kv / p.kv_unit;
  if (q_units * slots > kMembershipBits) return cudaErrorInvalidValue;
  if (p.mask.rows != ceil_div(p.seq_q, p.block_q) || p.mask.cols != ceil_div(p.seq_kv, p.block_kv) ||
      p.num_q_tiles != ceil_div(p.seq_q, p.tile_q))
    return cudaErrorInvalidValue;
  if (int64_t(p.mask.batch) * p.mask.heads * p.num_q_tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  g->mask = p.mask;
  g->q_units_per_block = p.block_q / p.q_unit;
  g->kv_units_per_block = p.block_kv / p.kv_unit;
  g->q_units = int(q_units);
  g->slots = int(slots);
  g->live_q_units = ceil_div(p.seq_q, p.q_unit);
  g->kv_units = ceil_div(p.seq_kv, p.kv_unit);
  g->kv_groups = ceil_div(g->kv_units, g->slots);
  g->num_q_tiles = p.num_q_tiles;
  g->kv_unit = p.kv_unit;
  g->capacity = p.capacity;
  g->packed = p.packed != 0;
  g->longest_first = p.longest_first != 0;
  g->tile_counts = p.tile_counts;
  g->tile_slots = p.tile_slots;
  g->tile_member = p.tile_member;
  g->q_order = p.q_order;
  g->max_count = p.max_count;
  return cudaSuccess;
}

inline unsigned num_tile_rows(const Geometry& g) {
  return unsigned(int64_t(g.mask.batch) * g.mask.heads * g.num_q_tiles);
}

inline int launch_prepare_counts(const TesseraPrepareParams& p, int32_t* host_max_count, cudaStream_t stream) {
  Geometry g;
  cudaError_t err = make_geometry(p, &g);
  if (err != cudaSuccess) return int(err);
  if (p.tile_counts == nullptr || p.max_count == nullptr) return int(cudaErrorInvalidValue);
  err = cudaMemsetAsync(p.max_count, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return int(err);
  prepare_count_kernel<<<num_tile_rows(g), kThreads, 0, stream>>>(g);
  err = cudaGetLastError();
  if (err != cudaSuccess || host_max_count == nullptr) return int(err);
  err = cudaMemcpyAsync(host_max_count, p.max_count, sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return int(err);
  return int(cudaStreamSynchronize(stream));
}

inline int launch_prepare_fill(const TesseraPrepareParams& p, cudaStream_t stream) {
  Geometry g;
  cudaError_t err = make_geometry(p, &g);
  if (err != cudaSuccess) return int(err);
  if (p.tile_counts == nullptr || p.tile_slots == nullptr || p.tile_member == nullptr || p.q_order == nullptr ||
      p.capacity < 1)
    return int(cudaErrorInvalidValue);
  prepare_fill_kernel<<<num_tile_rows(g), kThreads, 0, stream>>>(g);
  err = cudaGetLastError();
  if (err != cudaSuccess) return int(err);
  const int64_t order_ctas = int64_t(g.mask.batch) * g.mask.heads * ceil_div(g.num_q_tiles, kThreads);
  prepare_order_kernel<<<unsigned(order_ctas), kThreads, 0, stream>>>(g);
  return int(cudaGetLastError());
}

inline int launch_mask_counts(const TesseraMaskCountsParams& p, int64_t* host_counts, cudaStream_t stream) {
  if (!valid_mask(p.mask) || p.counts == nullptr || p.num_groups < 0 || p.num_groups > TESSERA_MAX_UNION_GROUPS)
    return int(cudaErrorInvalidValue);
  for (int k = 0; k < p.num_groups; ++k)
    if (p.group_rows[k] < 1) return int(cudaErrorInvalidValue);
  const int64_t bytes = TESSERA_MASK_COUNT_SLOTS * sizeof(int64_t);
  cudaError_t err = cudaMemsetAsync(p.counts, 0, bytes, stream);
  if (err != cudaSuccess) return int(err);
  const int64_t num_rows = int64_t(p.mask.batch) * p.mask.heads * p.mask.rows;
  const int64_t ctas = (num_rows + kWarps - 1) / kWarps;
  mask_count_kernel<<<unsigned(ctas < kMaskCountCtas ? ctas : kMaskCountCtas), kThreads, 0, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || host_counts == nullptr) return int(err);
  err = cudaMemcpyAsync(host_counts, p.counts, bytes, cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return int(err);
  return int(cudaStreamSynchronize(stream));
}

}  // namespace tessera::prep
