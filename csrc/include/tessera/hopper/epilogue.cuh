// Hopper epilogue: normalize the output accumulator by the row sums and store O (or the split-K
// partial) and the log-sum-exp straight from the wgmma accumulator registers. Rows with no active
// key get 0 and -inf. A tile row goes to its token row (query_row: the grouped layout scatters).
#pragma once
#include "tessera/hopper/traits.cuh"
#include "tessera/params.h"
#include "tessera/tasks.cuh"

namespace tessera::hopper {

// Accumulator value order is (column pair, row half, n8 block): value e sits on row half
// (e >> 1) & 1 of this thread, and the 4 lanes of a quad share each row.
template <class T, class FragO, class CoordO>
__device__ __forceinline__ void store_output(const TesseraAttnParams& p, const Task& t, const FragO& o,
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             const CoordO& coords, const int (&row_of_half)[2]) {
  using Element = typename T::Element;
  float inv[2], lse[2];
  int out_row[2];  // token rows of this thread's two row halves (-1: none)
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    out_row[half] = query_row<T::kTileQ>(p, t, row_of_half[half]);
    if (out_row[half] >= p.seq_q) out_row[half] = -1;
    float sum = row_sum[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[half] = sum > 0.f ? 1.f / sum : 0.f;
    lse[half] = row_lse(row_max[half], sum);
  }
  const bool split = p.num_splits > 1;
  const int64_t rows_per_split = int64_t(p.batch) * p.heads * p.seq_q;
  // A thread's two values of a pair are adjacent columns starting at an even one: one 32-bit store
  // where the output's base and strides keep such pairs 4-byte aligned, two 16-bit stores otherwise.
  const bool paired = (reinterpret_cast<uintptr_t>(p.o) & 3u) == 0 &&
                      ((p.o_stride[0] | p.o_stride[1] | p.o_stride[2]) & 1) == 0;
  CUTE_UNROLL
  for (int e = 0; e < size(o); e += 2) {
    const int half = (e >> 1) & 1;
    const int row = out_row[half];
    const int col = int(get<1>(coords(e)));
    if (row < 0) continue;
    const float v0 = o(e) * inv[half], v1 = o(e + 1) * inv[half];
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
  if ((threadIdx.x & 3) == 0) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int row = out_row[half];
      if (row < 0) continue;
      const int64_t bh_row = (int64_t(t.b) * p.heads + t.h) * p.seq_q + row;
      if (split)
        p.lse_partial[int64_t(t.split) * rows_per_split + bh_row] = lse[half];
      else if (p.lse != nullptr)
        p.lse[bh_row] = lse[half];
    }
  }
}

}  // namespace tessera::hopper
