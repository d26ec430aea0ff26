// Split-K merge: rescale the normalized partial outputs of each row to a common maximum.
//   out = sum_i exp(lse_i - lse_max) * o_i / sum_i exp(lse_i - lse_max)
//   lse = lse_max + log(sum_i exp(lse_i - lse_max))
// Parts that saw no key carry lse_i = -inf and weigh 0; a row no part saw gets 0 and -inf. As in
// the executor's merge_splits, a part that saw a NaN score (lse_i NaN) makes the row NaN and NaN,
// else one that saw a +inf score (lse_i +inf) makes it NaN and +inf.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>
#include <stdint.h>

#include "tessera/params.h"

namespace tessera {

constexpr int kMergeWarps = 4;
constexpr int kMaxMergeHeadDim = 256;

template <typename Element>
__device__ __forceinline__ Element merge_cast(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 merge_cast<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half merge_cast<__half>(float x) { return __float2half_rn(x); }

// One warp per (b, h, row); lanes stride over the head dim.
template <typename Element>
__global__ void __launch_bounds__(kMergeWarps * 32) split_merge_kernel(const __grid_constant__ TesseraMergeParams p) {
  const int64_t rows = int64_t(p.batch) * p.heads * p.seq_q;
  const int64_t row = int64_t(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  float lse_max = -CUDART_INF_F;
  for (int s = 0; s < p.num_splits; ++s) {
    const float lse = p.lse_partial[int64_t(s) * rows + row];
    lse_max = lse > lse_max || isnan(lse) ? lse : lse_max;  // a NaN stays (fmaxf would drop it)
  }
  // Without a finite maximum every weight is 0, and the row comes out as its parts' outputs times 0:
  // 0 where no part saw a key (they wrote 0), NaN where one saw a +inf or NaN score (it wrote NaN).
  const bool has_key = isfinite(lse_max);
  float total = 0.f;
  for (int s = 0; s < p.num_splits; ++s) total += has_key ? expf(p.lse_partial[int64_t(s) * rows + row] - lse_max) : 0.f;
  const float inv = has_key ? 1.f / total : 0.f;

  const int seq = int(row % p.seq_q);
  const int64_t bh = row / p.seq_q;
  const int b = int(bh / p.heads), h = int(bh % p.heads);
  Element* o = static_cast<Element*>(p.o) + int64_t(b) * p.o_stride[0] + int64_t(seq) * p.o_stride[1] +
               int64_t(h) * p.o_stride[2];
  for (int d = lane; d < p.head_dim; d += 32) {
    float val = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = has_key ? expf(p.lse_partial[int64_t(s) * rows + row] - lse_max) : 0.f;
      val += w * p.o_partial[(int64_t(s) * rows + row) * p.head_dim + d];
    }
    o[d] = merge_cast<Element>(val * inv);
  }
  if (p.lse != nullptr && lane == 0) p.lse[row] = has_key ? lse_max + logf(total) : lse_max;
}

inline int launch_split_merge(const TesseraMergeParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.heads * p.seq_q;
  if (rows == 0) return 0;
  const dim3 grid(unsigned((rows + kMergeWarps - 1) / kMergeWarps));
  if (p.dtype == TESSERA_BF16)
    split_merge_kernel<__nv_bfloat16><<<grid, kMergeWarps * 32, 0, stream>>>(p);
  else
    split_merge_kernel<__half><<<grid, kMergeWarps * 32, 0, stream>>>(p);
  return int(cudaGetLastError());
}

}  // namespace tessera
