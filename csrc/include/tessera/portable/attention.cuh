// Portable block-sparse attention forward (mma.sync + cp.async + ldmatrix; sm80 and newer).
//
// Reads top to bottom: task decoding, the loaders (Q tile, one KV tile of gathered slots), the
// per-tile compute (Q K^T, membership mask, online softmax, P V), the epilogue, the kernel, the
// launcher. The metadata format is documented in tessera_diffusers/prepare.py.
#pragma once
#include <math_constants.h>
#include <stdint.h>

#include "tessera/params.h"
#include "tessera/tasks.cuh"
#include "tessera/portable/ptx.cuh"
#include "tessera/portable/traits.cuh"

namespace tessera::portable {

using tessera::decode_task;
using tessera::Task;
template <class T>
using TileMeta = tessera::TileMeta<T::kMaxSlots>;

template <class T>
__device__ __forceinline__ void load_q_tile(const TesseraAttnParams& p, const Task& t,
                                            typename T::Element* sQ) {
  using Element = typename T::Element;
  const Element* q = static_cast<const Element*>(p.q);
  constexpr int kIters = T::kTileQ * T::kChunksPerRow / T::kThreads;
  constexpr int kRowStep = T::kThreads / T::kChunksPerRow;
  const int chunk = threadIdx.x % T::kChunksPerRow, row_in = threadIdx.x / T::kChunksPerRow;
  const Element* base = q + int64_t(t.b) * p.q_stride[0] + int64_t(t.h) * p.q_stride[2] + chunk * T::kChunkElems;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int row = row_in + i * kRowStep;
    const int token = tessera::query_row<T::kTileQ>(p, t, row);
    const bool ok = token >= 0 && token < p.seq_q;
    cp_async_16(smem_addr(sQ + swizzled<T>(row, chunk)), base + int64_t(ok ? token : 0) * p.q_stride[1], ok ? 16 : 0);
  }
}

// Gather one KV tile: row r of the tile is token slot_start[r / kv_unit] + r % kv_unit.
template <class T>
__device__ __forceinline__ void load_kv_tile(const TesseraAttnParams& p, const Task& t, int tile,
                                             typename T::Element* sK, typename T::Element* sV,
                                             TileMeta<T>& meta) {
  using Element = typename T::Element;
  const Element* k = static_cast<const Element*>(p.k);
  const Element* v = static_cast<const Element*>(p.v);
  const int32_t* slots = tessera::tile_slots(p, t, tile);
  const int unit_mask = (1 << p.kv_unit_log2) - 1;
  constexpr int kIters = T::kTileKV * T::kChunksPerRow / T::kThreads;
  constexpr int kRowStep = T::kThreads / T::kChunksPerRow;
  const int chunk = threadIdx.x % T::kChunksPerRow, row_in = threadIdx.x / T::kChunksPerRow;
  const Element* k_base = k + int64_t(t.b) * p.k_stride[0] + int64_t(t.h) * p.k_stride[2] + chunk * T::kChunkElems;
  const Element* v_base = v + int64_t(t.b) * p.v_stride[0] + int64_t(t.h) * p.v_stride[2] + chunk * T::kChunkElems;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int row = row_in + i * kRowStep;
    const int start = __ldg(slots + (row >> p.kv_unit_log2));
    const int token = start + (row & unit_mask);
    const bool ok = start >= 0 && token < p.seq_kv;
    const int64_t tok = ok ? token : 0;
    const int dst = swizzled<T>(row, chunk);
    cp_async_16(smem_addr(sK + dst), k_base + tok * p.k_stride[1], ok ? 16 : 0);
    cp_async_16(smem_addr(sV + dst), v_base + tok * p.v_stride[1], ok ? 16 : 0);
  }
  tessera::read_tile_meta<T::kTileQ>(p, t, tile, meta);
}

// Online-softmax state of the rows one thread touches: [m tile][row half (g, g + 8)].
template <class T>
struct RowState {
  float max[T::kMTiles][2];  // running max of scaled scores (log2 domain)
  float sum[T::kMTiles][2];  // this thread's partial row sum (reduced over the quad at the end)
};

// Scores of inactive (row, column) pairs become -inf. A slot is at least 16 tokens wide, so the
// slot of a column depends only on its n8 tile, and each row needs one S-bit slice of the word.
template <class T>
__device__ __forceinline__ void mask_scores(const TesseraAttnParams& p, const TileMeta<T>& meta, int warp_row0,
                                            float (&s)[T::kMTiles][T::kNTilesS][4]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  const unsigned slot_bits = (1u << p.slots) - 1u;
  unsigned row_bits[T::kMTiles][2];
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + m * 16 + g + 8 * half;
      row_bits[m][half] = unsigned(meta.member >> ((row >> p.q_unit_log2) * p.slots)) & slot_bits;
    }
  const int unit_mask = (1 << p.kv_unit_log2) - 1;
#pragma unroll
  for (int nt = 0; nt < T::kNTilesS; ++nt) {
    const int slot = (nt * 8) >> p.kv_unit_log2;
    bool col_ok[2] = {true, true};
    if (meta.partial) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + 2 * tq + e;
        col_ok[e] = meta.slot_start[slot] + (col & unit_mask) < p.seq_kv;
      }
    }
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const bool row_ok = (row_bits[m][half] >> slot) & 1u;
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (!(row_ok && col_ok[e])) s[m][nt][2 * half + e] = -CUDART_INF_F;
      }
  }
}

// Byte offsets of this lane's ldmatrix rows inside the Q, K and V tiles. With the xor swizzle,
// chunk (2k + c) ^ (row % 8) = 8 * (k / 4) + ((2 * (k % 4)) ^ c ^ (row % 8)): four registers per
// operand cover every k step; whole 16-row groups and the k / 4 part are immediate offsets.
template <class T>
struct LaneOffsets {
  uint32_t q[4], k[4], v[4];

  __device__ __forceinline__ LaneOffsets() {
    const int lane = threadIdx.x & 31;
    const int warp_row0 = (threadIdx.x >> 5) * T::kWarpRows;
    const int r7 = lane & 7;
    const int q_row = warp_row0 + r7 + 8 * ((lane >> 3) & 1), q_c = lane >> 4;
    const int k_row = r7 + 8 * (lane >> 4), k_c = (lane >> 3) & 1;
    const int v_row = r7 + 8 * ((lane >> 3) & 1), v_c = lane >> 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = (q_row * T::kChunksPerRow + ((2 * j) ^ q_c ^ r7)) * 16;
      k[j] = (k_row * T::kChunksPerRow + ((2 * j) ^ k_c ^ r7)) * 16;
      v[j] = (v_row * T::kChunksPerRow + ((2 * j) ^ v_c ^ r7)) * 16;
    }
  }
};

// Byte offset of row group `rows` and chunk group `step / 4` (compile-time in unrolled loops).
template <class T>
__device__ __forceinline__ constexpr uint32_t tile_offset(int rows, int step) {
  return uint32_t((rows * T::kChunksPerRow + 8 * (step >> 2)) * 16);
}

template <class T>
__device__ __forceinline__ void compute_tile(const TesseraAttnParams& p, uint32_t sQ, uint32_t sK, uint32_t sV,
                                             const LaneOffsets<T>& lo, const TileMeta<T>& meta, RowState<T>& state,
                                             float (&acc)[T::kMTiles][T::kNTilesO][4]) {
  using Element = typename T::Element;
  const int warp_row0 = (threadIdx.x >> 5) * T::kWarpRows;

  // S = Q K^T for this warp's rows.
  float s[T::kMTiles][T::kNTilesS][4];
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m)
#pragma unroll
    for (int nt = 0; nt < T::kNTilesS; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[m][nt][e] = 0.f;

#pragma unroll
  for (int ks = 0; ks < T::kKStepsS; ++ks) {
    uint32_t a[T::kMTiles][4];
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) ldmatrix_x4(a[m], sQ + lo.q[ks & 3] + tile_offset<T>(m * 16, ks));
#pragma unroll
    for (int np = 0; np < T::kNTilesS / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, sK + lo.k[ks & 3] + tile_offset<T>(np * 16, ks));
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m) {
        mma_16816<Element>(s[m][2 * np], a[m], b[0], b[1]);
        mma_16816<Element>(s[m][2 * np + 1], a[m], b[2], b[3]);
      }
    }
  }

  if (meta.needs_mask) mask_scores<T>(p, meta, warp_row0, s);

  // Online softmax: new running max, rescale the accumulator, probabilities in place.
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -CUDART_INF_F;
#pragma unroll
      for (int nt = 0; nt < T::kNTilesS; ++nt)
        tile_max = fmaxf(tile_max, fmaxf(s[m][nt][2 * half], s[m][nt][2 * half + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(state.max[m][half], tile_max * p.scale_log2);
      // A row with no active key so far keeps max = -inf; subtract 0 instead so exp2 gives 0, not NaN.
      const float ref = new_max == -CUDART_INF_F ? 0.f : new_max;
      const float alpha = fast_exp2(state.max[m][half] - ref);
      state.max[m][half] = new_max;
      float row_sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < T::kNTilesS; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float prob = fast_exp2(fmaf(s[m][nt][2 * half + e], p.scale_log2, -ref));
          s[m][nt][2 * half + e] = prob;
          row_sum += prob;
        }
      }
      state.sum[m][half] = state.sum[m][half] * alpha + row_sum;
#pragma unroll
      for (int dt = 0; dt < T::kNTilesO; ++dt) {
        acc[m][dt][2 * half] *= alpha;
        acc[m][dt][2 * half + 1] *= alpha;
      }
    }
  }

  // O += P V with P straight from the score registers (the m16n8 C layout is the m16k16 A layout).
#pragma unroll
  for (int kk = 0; kk < T::kKStepsO; ++kk) {
    uint32_t a[T::kMTiles][4];
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) {
      a[m][0] = pack2<Element>(s[m][2 * kk][0], s[m][2 * kk][1]);
      a[m][1] = pack2<Element>(s[m][2 * kk][2], s[m][2 * kk][3]);
      a[m][2] = pack2<Element>(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
      a[m][3] = pack2<Element>(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < T::kNTilesO / 2; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sV + lo.v[dp & 3] + tile_offset<T>(kk * 16, dp));
#pragma unroll
      for (int m = 0; m < T::kMTiles; ++m) {
        mma_16816<Element>(acc[m][2 * dp], a[m], b[0], b[1]);
        mma_16816<Element>(acc[m][2 * dp + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// Normalize and store: O (or the fp32 split-K partial) and the log-sum-exp of each row.
// Rows with no active key get 0 and -inf; rows with a +inf or NaN score NaN and row_lse's +inf or NaN.
template <class T>
__device__ __forceinline__ void store_tile(const TesseraAttnParams& p, const Task& t, RowState<T>& state,
                                           float (&acc)[T::kMTiles][T::kNTilesO][4]) {
  using Element = typename T::Element;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int warp_row0 = (threadIdx.x >> 5) * T::kWarpRows;
  const bool split = p.num_splits > 1;
#pragma unroll
  for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = state.sum[m][half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const bool has_key = sum > 0.f;
      const float inv = has_key ? 1.f / sum : 0.f;
      const float lse = tessera::row_lse(state.max[m][half], sum);
      const int row = tessera::query_row<T::kTileQ>(p, t, warp_row0 + m * 16 + g + 8 * half);
      if (row < 0 || row >= p.seq_q) continue;
      const int64_t bh_row = (int64_t(t.b) * p.heads + t.h) * p.seq_q + row;
      if (split) {
        const int64_t part = int64_t(t.split) * p.batch * p.heads * p.seq_q + bh_row;
        float* dst = p.o_partial + part * T::kHeadDim;
#pragma unroll
        for (int dt = 0; dt < T::kNTilesO; ++dt) {
          const float2 val = make_float2(acc[m][dt][2 * half] * inv, acc[m][dt][2 * half + 1] * inv);
          *reinterpret_cast<float2*>(dst + dt * 8 + 2 * tq) = val;
        }
        if (tq == 0) p.lse_partial[part] = lse;
      } else {
        Element* o = static_cast<Element*>(p.o) + int64_t(t.b) * p.o_stride[0] + int64_t(row) * p.o_stride[1] +
                     int64_t(t.h) * p.o_stride[2];
#pragma unroll
        for (int dt = 0; dt < T::kNTilesO; ++dt) {
          const uint32_t val = pack2<Element>(acc[m][dt][2 * half] * inv, acc[m][dt][2 * half + 1] * inv);
          *reinterpret_cast<uint32_t*>(o + dt * 8 + 2 * tq) = val;
        }
        if (p.lse != nullptr && tq == 0) p.lse[bh_row] = lse;
      }
    }
  }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads) attention_kernel(const __grid_constant__ TesseraAttnParams p) {
  using Element = typename T::Element;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* sQ = reinterpret_cast<Element*>(smem_raw);
  Element* sK = sQ + T::kSmemQElems;
  Element* sV = sK + T::kStages * T::kSmemKVElems;
  __shared__ TileMeta<T> meta[T::kStages];

  const LaneOffsets<T> lanes;
  const uint32_t q_base = smem_addr(sQ), k_base = smem_addr(sK), v_base = smem_addr(sV);
  constexpr uint32_t kStageBytes = T::kSmemKVElems * sizeof(Element);
  const int64_t tasks = tessera::num_tasks(p);
  for (int64_t task_id = blockIdx.x; task_id < tasks; task_id += gridDim.x) {
    const Task t = decode_task(p, task_id);
    const int n_tiles = t.tile_end - t.tile_begin;

    RowState<T> state;
    float acc[T::kMTiles][T::kNTilesO][4];
#pragma unroll
    for (int m = 0; m < T::kMTiles; ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        state.max[m][half] = -CUDART_INF_F;
        state.sum[m][half] = 0.f;
      }
#pragma unroll
      for (int dt = 0; dt < T::kNTilesO; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][dt][e] = 0.f;
    }

    if (n_tiles > 0) {
      load_q_tile<T>(p, t, sQ);
      cp_async_commit();
#pragma unroll
      for (int st = 0; st < T::kStages - 1; ++st) {
        if (st < n_tiles)
          load_kv_tile<T>(p, t, t.tile_begin + st, sK + st * T::kSmemKVElems, sV + st * T::kSmemKVElems, meta[st]);
        cp_async_commit();
      }
      for (int i = 0; i < n_tiles; ++i) {
        const int ahead = i + T::kStages - 1;
        if (ahead < n_tiles) {
          const int st = ahead % T::kStages;
          load_kv_tile<T>(p, t, t.tile_begin + ahead, sK + st * T::kSmemKVElems, sV + st * T::kSmemKVElems,
                          meta[st]);
        }
        cp_async_commit();
        cp_async_wait<T::kStages - 1>();
        __syncthreads();
        const int st = i % T::kStages;
        compute_tile<T>(p, q_base, k_base + st * kStageBytes, v_base + st * kStageBytes, lanes, meta[st], state, acc);
        __syncthreads();
      }
    }
    store_tile<T>(p, t, state, acc);
  }
}

}  // namespace tessera::portable
