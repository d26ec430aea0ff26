// Hopper epilogue: normalize the output accumulator by the row sums and store O (or the split-K
// partial) and the log-sum-exp. Rows with no active key get 0 and -inf, rows with a +inf or NaN
// score NaN and row_lse's +inf or NaN. A tile row goes to its token row (query_row: the grouped
// layout scatters). Two ways to store O:
//   store_output      straight from the wgmma accumulator registers (every kernel can);
//   store_output_tma  through the task's Q buffer and a TMA store (kernels with two Q buffers,
//                     T::kTmaStore, when the launch's output allows a TMA descriptor): the consumer
//                     warpgroups wait only for the copy's shared-memory reads, not for their own
//                     global stores, before the next task.
#pragma once
#include <cutlass/arch/barrier.h>

#include <cute/arch/copy_sm90_tma.hpp>

#include "tessera/hopper/traits.cuh"  // before pipeline.cuh: `using namespace cute`
#include "tessera/hopper/pipeline.cuh"
#include "tessera/params.h"
#include "tessera/tasks.cuh"

namespace tessera::hopper {

// What a consumer thread writes for its two accumulator row halves: 1 / row sum, log-sum-exp, and
// the token row (-1: none).
struct RowOutputs {
  float inv[2], lse[2];
  int row[2];
};

template <class T>
__device__ __forceinline__ RowOutputs row_outputs(const TesseraAttnParams& p, const Task& t, const float (&row_max)[2],
                                                  const float (&row_sum)[2], const int (&row_of_half)[2]) {
  RowOutputs r;
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    r.row[half] = query_row<T::kTileQ>(p, t, row_of_half[half]);
    if (r.row[half] >= p.seq_q) r.row[half] = -1;
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    r.inv[half] = sum > 0.f ? 1.f / sum : 0.f;
    r.lse[half] = row_lse(row_max[half], sum);
  }
  return r;
}

// The log-sum-exp of the thread's rows (or the split-K partial), from one lane per quad.
__device__ __forceinline__ void store_lse(const TesseraAttnParams& p, const Task& t, const RowOutputs& r) {
  if ((threadIdx.x & 3) != 0) return;
  const int64_t rows_per_split = int64_t(p.batch) * p.heads * p.seq_q;
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = r.row[half];
    if (row < 0) continue;
    const int64_t bh_row = (int64_t(t.b) * p.heads + t.h) * p.seq_q + row;
    if (p.num_splits > 1)
      p.lse_partial[int64_t(t.split) * rows_per_split + bh_row] = r.lse[half];
    else if (p.lse != nullptr)
      p.lse[bh_row] = r.lse[half];
  }
}

// Accumulator value order is (column pair, row half, n8 block): value e sits on row half
// (e >> 1) & 1 of this thread, and the 4 lanes of a quad share each row.
template <class T, class FragO, class CoordO>
__device__ __forceinline__ void store_output(const TesseraAttnParams& p, const Task& t, const FragO& o,
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             const CoordO& coords, const int (&row_of_half)[2]) {
  using Element = typename T::Element;
  const RowOutputs r = row_outputs<T>(p, t, row_max, row_sum, row_of_half);
  const bool split = p.num_splits > 1;
  const int64_t rows_per_split = int64_t(p.batch) * p.heads * p.seq_q;
  // A thread's two values of a pair are adjacent columns starting at an even one: one 32-bit store
  // where the output's base and strides keep such pairs 4-byte aligned, two 16-bit stores otherwise.
  const bool paired = (reinterpret_cast<uintptr_t>(p.o) & 3u) == 0 &&
                      ((p.o_stride[0] | p.o_stride[1] | p.o_stride[2]) & 1) == 0;
  CUTE_UNROLL
  for (int e = 0; e < size(o); e += 2) {
    const int half = (e >> 1) & 1;
    const int row = r.row[half];
    const int col = int(get<1>(coords(e)));
    if (row < 0) continue;
    const float v0 = o(e) * r.inv[half], v1 = o(e + 1) * r.inv[half];
    if (split) {
      const int64_t part = int64_t(t.split) * rows_per_split + (int64_t(t.b) * p.heads + t.h) * p.seq_q + row;
      *reinterpret_cast<float2*>(p.o_partial + part * T::kHeadDim + col) = make_float2(v0, v1);
    } else {
      Element* out = static_cast<Element*>(p.o) + int64_t(t.b) * p.o_stride[0] + int64_t(row) * p.o_stride[1] +
                     int64_t(t.h) * p.o_stride[2] + col;
      const Element e0 = static_cast<Element>(v0), e1 = static_cast<Element>(v1);
      if (paired) {
        *reinterpret_cast<uint32_t*>(out) = uint32_t(e0.raw()) | (uint32_t(e1.raw()) << 16);
      } else {
        out[0] = e0;
        out[1] = e1;
      }
    }
  }
  store_lse(p, t, r);
}

// Named barriers of the TMA-store epilogue, one per consumer warpgroup (0 is __syncthreads, 1 and 2
// the ping-pong turns of mainloop.cuh).
constexpr int kEpilogueBarrier = 3;

__device__ __forceinline__ void warpgroup_sync(int warpgroup) {
  asm volatile("barrier.sync %0, %1;" ::"r"(kEpilogueBarrier + warpgroup), "n"(128) : "memory");
}

// The warpgroup's 64 rows of O, normalized and converted, into its own rows of the task's Q buffer
// `sO` (kTileQ x D, its Q K^T products are done; the other warpgroup reads only its own rows), two
// adjacent columns per 32-bit store, then one thread (the warpgroup's first, `stores_o`) stores them
// with TMA, a box per 64-column half (per query unit and half in the grouped layout). The buffer is
// released on `q_empty` (by every consumer thread in a dynamically scheduled grid, else by one lane
// per warp): by every releasing thread but that one at once, and by that one only once the copy has
// read shared memory (release_after_store), which the consumer loop defers until it has issued the
// next task's first Q K^T, so the warpgroup does not wait on the copy. q_empty completes only with
// every arrival, so the producer refills the buffer only after the copy has read it. Rows past Sq
// are clipped by the TMA unit. Only for launches without split-K (p.num_splits == 1).
__device__ __forceinline__ bool stores_o() { return (threadIdx.x & 127) == 0; }

// The thread that stored O from a Q buffer (stores_o) releases it once the copy has read it.
template <bool kDynamic>
__device__ __forceinline__ void release_after_store(uint64_t* q_empty) {
  tma_store_wait<0>();  // the copy has read shared memory; its global writes complete on their own
  release_q<kDynamic>(q_empty);
}

template <class T, bool kDynamic, class FragO, class SmemO, class ThrMma>
__device__ __forceinline__ void store_output_tma(const TesseraAttnParams& p, const TmaDescriptors& tma, const Task& t,
                                                 const FragO& o, const float (&row_max)[2], const float (&row_sum)[2],
                                                 const int (&row_of_half)[2], SmemO sO, const ThrMma& thr_pv,
                                                 typename T::Element* o_smem, uint64_t* q_empty) {
  using Element = typename T::Element;
  const RowOutputs r = row_outputs<T>(p, t, row_max, row_sum, row_of_half);
  Tensor tOsO = thr_pv.partition_C(sO);
  static_assert(decltype(size(tOsO))::value == decltype(size(o))::value, "O in shared memory: the accumulator's values");
  cutlass::arch::fence_view_async_shared();  // after the wgmma reads of these rows, before generic writes
  // Values e and e + 1 are adjacent columns from an even one: the 128-byte swizzle moves 16-byte
  // chunks, so the pair stays adjacent and 4-byte aligned in shared memory.
  CUTE_UNROLL
  for (int e = 0; e < size(o); e += 2) {
    const float inv = r.inv[(e >> 1) & 1];
    const Element e0 = static_cast<Element>(o(e) * inv), e1 = static_cast<Element>(o(e + 1) * inv);
    const uint32_t pair = uint32_t(e0.raw()) | (uint32_t(e1.raw()) << 16);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(&tOsO(e)))), "r"(pair) : "memory");
  }
  cutlass::arch::fence_view_async_shared();  // generic writes visible to the TMA unit (async proxy)
  const int warpgroup = (int(threadIdx.x) - T::kProducerThreads) / 128;
  warpgroup_sync(warpgroup);
  if (stores_o()) {
    constexpr int kHalves = T::kHeadDim / 64;
    const int first = 64 * warpgroup;  // the warpgroup's first tile row
    if (p.q_units == nullptr) {
      CUTE_UNROLL
      for (int dh = 0; dh < kHalves; ++dh)
        SM90_TMA_STORE_4D::copy(&tma.o, o_smem + T::q_box_offset(first, dh), dh * 64,
                                t.q_tile * T::kTileQ + first, t.h, t.b);
    } else {
      const int q_unit = 1 << p.q_unit_log2;
      const int32_t* units = p.q_units + t.meta_row * (T::kTileQ >> p.q_unit_log2) + (first >> p.q_unit_log2);
      for (int a = 0; a < (64 >> p.q_unit_log2); ++a) {
        const int unit = __ldg(units + a);
        if (unit < 0) continue;  // no query unit at this position (the last tile of a head)
        CUTE_UNROLL
        for (int dh = 0; dh < kHalves; ++dh)
          SM90_TMA_STORE_4D::copy(&tma.o, o_smem + T::q_box_offset(first + a * q_unit, dh), dh * 64,
                                  unit << p.q_unit_log2, t.h, t.b);
      }
    }
    tma_store_arrive();  // its shared-memory reads are waited for by release_after_store
  }
  store_lse(p, t, r);
  if (!stores_o()) release_q<kDynamic>(q_empty);
}

}  // namespace tessera::hopper
