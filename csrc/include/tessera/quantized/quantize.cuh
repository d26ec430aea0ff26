// The quantization pass of 8-bit attention (tessera_diffusers/quantized.py's `quantize`, layouts in
// tessera/quantized/params.h), in four launches:
//   channel_statistics  per (b, h) and token segment, per channel: sums of K and V, V's max and min
//                       (16-byte loads: 16 threads per token row, 8 rows at a time);
//   channel_finish      per (b, h): k_mean, v_mean and v_scale from the segments' partials;
//   quantize_rows       per (b, h) and 128 tokens: Q rows to int8 with a scale per token (a
//                       half-warp per row, 16-byte loads; Q's lse_shift = scale * q . k_mean on the
//                       way), V to int8 per channel plus 128, written transposed in 16-token chunks
//                       (a thread per channel);
//   quantize_k_chunks   per (b, h) and 128 tokens: K rows to int8 with a scale per 16-token chunk
//                       (a half-warp per chunk, its 16 rows loaded at once).
// Without v8 (a kernel with a 16-bit P V reads V itself) the pass leaves V alone: no V statistics,
// no v8. The partials keep the pass deterministic (no atomics).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include "tessera/quantized/params.h"

namespace tessera::quantized {

constexpr int kQuantizeThreads = TESSERA_QUANTIZED_HEAD_DIM;  // a thread per channel
constexpr int kQuantizeTokens = 128;                          // tokens per quantize_rows and quantize_k_chunks CTA
constexpr int kChunk = TESSERA_QUANTIZED_K_CHUNK;              // tokens per K scale and per v8 chunk
constexpr float kInt8Max = 127.f;

__device__ __forceinline__ float load_element(const void* base, int64_t offset, int dtype) {
  return dtype == TESSERA_BF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(base)[offset])
                               : __half2float(static_cast<const __half*>(base)[offset]);
}

// Eight consecutive channels of one token row (16-byte aligned: rows start on 16 bytes, the
// strides are multiples of 8 elements).
__device__ __forceinline__ uint4 load_raw(const void* base, int64_t offset) {
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(base) + 2 * offset));
}

__device__ __forceinline__ void to_floats(const uint4& raw, int dtype, float (&x)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = dtype == TESSERA_BF16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]))
                                           : __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load_eight(const void* base, int64_t offset, int dtype, float (&x)[8]) {
  to_floats(load_raw(base, offset), dtype, x);
}

__device__ __forceinline__ int64_t row_offset(const int64_t (&stride)[3], int b, int s, int h) {
  return int64_t(b) * stride[0] + int64_t(s) * stride[1] + int64_t(h) * stride[2];
}

// round(x / scale) within [-127, 127], half to even as the twin's torch.round, by a multiply with
// inv = 1 / scale (one division per row or channel, not per value): x * inv may sit an ulp from
// x / scale, so a value on a rounding tie can land one step from the twin's.
__device__ __forceinline__ int quantize_value(float x, float inv) {
  return max(-127, min(127, __float2int_rn(x * inv)));
}

__device__ __forceinline__ uint32_t pack_int8(int a, int b, int c, int d) {
  return (uint32_t(a) & 0xffu) | ((uint32_t(b) & 0xffu) << 8) | ((uint32_t(c) & 0xffu) << 16) | (uint32_t(d) << 24);
}

// Tokens per statistics segment.
__host__ __device__ inline int segment_tokens(const TesseraQuantizeParams& p) {
  return (p.seq_kv + p.segments - 1) / p.segments;
}

// Thread t reads channels 8 (t % 16) .. + 8 of the segment's rows t / 16 + 8 i; the eight row lanes'
// sums meet in shared memory, then thread d writes channel d's partials.
__global__ void __launch_bounds__(kQuantizeThreads) channel_statistics(const __grid_constant__ TesseraQuantizeParams p) {
  constexpr int D = TESSERA_QUANTIZED_HEAD_DIM;
  constexpr int kGroups = D / 8, kRowLanes = kQuantizeThreads / kGroups;
  const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int c0 = 8 * (threadIdx.x % kGroups), lane_row = threadIdx.x / kGroups;
  const int len = segment_tokens(p);
  const int first = blockIdx.x * len, last = min(first + len, p.seq_kv);
  const bool with_v = p.v8 != nullptr;
  float k_sum[8], v_sum[8], v_max[8], v_min[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    k_sum[j] = v_sum[j] = 0.f;
    v_max[j] = -CUDART_INF_F;
    v_min[j] = CUDART_INF_F;
  }
#pragma unroll 4
  for (int s = first + lane_row; s < last; s += kRowLanes) {
    float x[8];
    load_eight(p.k, row_offset(p.k_stride, b, s, h) + c0, p.dtype, x);
#pragma unroll
    for (int j = 0; j < 8; ++j) k_sum[j] += x[j];
    if (with_v) {
      load_eight(p.v, row_offset(p.v_stride, b, s, h) + c0, p.dtype, x);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v_sum[j] += x[j];
        v_max[j] = fmaxf(v_max[j], x[j]);
        v_min[j] = fminf(v_min[j], x[j]);
      }
    }
  }
  __shared__ float lanes[4][kRowLanes][D];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    lanes[0][lane_row][c0 + j] = k_sum[j];
    lanes[1][lane_row][c0 + j] = v_sum[j];
    lanes[2][lane_row][c0 + j] = v_max[j];
    lanes[3][lane_row][c0 + j] = v_min[j];
  }
  __syncthreads();
  const int d = threadIdx.x;
  float ks = 0.f, vs = 0.f, vmax = -CUDART_INF_F, vmin = CUDART_INF_F;
#pragma unroll
  for (int r = 0; r < kRowLanes; ++r) {
    ks += lanes[0][r][d];
    vs += lanes[1][r][d];
    vmax = fmaxf(vmax, lanes[2][r][d]);
    vmin = fminf(vmin, lanes[3][r][d]);
  }
  float* out = p.partials + (int64_t(bh) * p.segments + blockIdx.x) * 4 * D + d;
  out[0 * D] = ks;
  out[1 * D] = vs;
  out[2 * D] = vmax;
  out[3 * D] = vmin;
}

__global__ void __launch_bounds__(kQuantizeThreads) channel_finish(const __grid_constant__ TesseraQuantizeParams p) {
  const int bh = blockIdx.x, d = threadIdx.x;
  float k_sum = 0.f, v_sum = 0.f, v_max = -CUDART_INF_F, v_min = CUDART_INF_F;
  for (int g = 0; g < p.segments; ++g) {
    const float* in = p.partials + (int64_t(bh) * p.segments + g) * 4 * TESSERA_QUANTIZED_HEAD_DIM + d;
    k_sum += in[0];
    v_sum += in[TESSERA_QUANTIZED_HEAD_DIM];
    v_max = fmaxf(v_max, in[2 * TESSERA_QUANTIZED_HEAD_DIM]);
    v_min = fminf(v_min, in[3 * TESSERA_QUANTIZED_HEAD_DIM]);
  }
  const float v_mean = v_sum / float(p.seq_kv);
  const float amax = fmaxf(v_max - v_mean, v_mean - v_min);  // largest |v - v_mean| of the channel
  const int64_t at = int64_t(bh) * TESSERA_QUANTIZED_HEAD_DIM + d;
  p.k_mean[at] = k_sum / float(p.seq_kv);
  if (p.v8 == nullptr) return;
  p.v_mean[at] = v_mean;
  p.v_scale[at] = amax > 0.f ? amax / kInt8Max : 1.f;
}

// A lane's eight values to int8 at 1 / scale = inv.
__device__ __forceinline__ uint2 pack_eight(const float (&x)[8], float inv) {
  return make_uint2(pack_int8(quantize_value(x[0], inv), quantize_value(x[1], inv), quantize_value(x[2], inv),
                              quantize_value(x[3], inv)),
                    pack_int8(quantize_value(x[4], inv), quantize_value(x[5], inv), quantize_value(x[6], inv),
                              quantize_value(x[7], inv)));
}

// One Q row to int8 with its own scale (a half-warp, 8 channels per lane: both halves of the warp
// call it together, each on its own row); returns the scale and through `dot` the row's dot product
// with `other` (the lane's 8 channels of it).
__device__ __forceinline__ float quantize_row(const float (&x)[8], const float (&other)[8], float& dot,
                                              uint2& bytes) {
  float amax = 0.f;
  dot = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    amax = fmaxf(amax, fabsf(x[j]));
    dot = fmaf(x[j], other[j], dot);
  }
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) {  // within the half-warp
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    dot += __shfl_xor_sync(0xffffffffu, dot, o);
  }
  const float scale = amax > 0.f ? amax / kInt8Max : 1.f;
  bytes = pack_eight(x, 1.f / scale);
  return scale;
}

// K per (b, h) and 128 tokens, a half-warp per 16-token chunk (8 channels per lane): its rows loaded
// at once and quantized at the chunk's scale (its largest |k - k_mean|; 1 for a chunk of zeros, as
// past seq_kv, so that a kernel's factor for a masked column stays finite), written for each of its
// rows; zero keys past seq_kv. A launch of its own: holding a chunk takes registers that would cut
// the occupancy the Q rows' loads need.
__global__ void __launch_bounds__(kQuantizeThreads) quantize_k_chunks(const __grid_constant__ TesseraQuantizeParams p) {
  constexpr int D = TESSERA_QUANTIZED_HEAD_DIM;
  static_assert(kQuantizeTokens == kChunk * kQuantizeThreads / 16, "a chunk per half-warp");
  const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int lane = threadIdx.x % 16, c0 = 8 * lane;
  const int s0 = blockIdx.x * kQuantizeTokens + kChunk * (threadIdx.x / 16);
  float k_mean[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) k_mean[j] = p.k_mean[int64_t(bh) * D + c0 + j];
  uint4 raw[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i)
    raw[i] = s0 + i < p.seq_kv ? load_raw(p.k, row_offset(p.k_stride, b, s0 + i, h) + c0) : make_uint4(0, 0, 0, 0);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    float x[8];
    to_floats(raw[i], p.dtype, x);
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = s0 + i < p.seq_kv ? fmaxf(amax, fabsf(x[j] - k_mean[j])) : amax;
  }
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));  // the half-warp
  const float scale = amax > 0.f ? amax / kInt8Max : 1.f;
  const float inv = 1.f / scale;
  const int64_t row0 = int64_t(bh) * p.seq_kv_padded + s0;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    float x[8];
    to_floats(raw[i], p.dtype, x);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = s0 + i < p.seq_kv ? x[j] - k_mean[j] : 0.f;
    reinterpret_cast<uint2*>(p.k8 + (row0 + i) * D)[lane] = pack_eight(x, inv);
    if (lane == 0) p.k_scale[row0 + i] = scale;
  }
}

__global__ void __launch_bounds__(kQuantizeThreads) quantize_rows(const __grid_constant__ TesseraQuantizeParams p) {
  constexpr int D = TESSERA_QUANTIZED_HEAD_DIM;
  constexpr int kRowsAtOnce = 2 * kQuantizeThreads / 32;  // a row per half-warp
  const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int lane = threadIdx.x % 16, c0 = 8 * lane;
  const int first = blockIdx.x * kQuantizeTokens;
  float k_mean[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) k_mean[j] = p.k_mean[int64_t(bh) * D + c0 + j];
  // Every lane runs every step (the shuffles), rows past the ends read zeros and store nothing.
  for (int r = threadIdx.x / 16; r < kQuantizeTokens; r += kRowsAtOnce) {
    const int s = first + r;
    float x[8], dot;
    uint2 bytes;
    const bool q_row = s < p.seq_q;
    if (q_row) {
      load_eight(p.q, row_offset(p.q_stride, b, s, h) + c0, p.dtype, x);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = 0.f;
    }
    const float scale = quantize_row(x, k_mean, dot, bytes);  // the Q row's dot with K's mean: its lse shift
    if (q_row) {
      const int64_t row = int64_t(bh) * p.seq_q + s;
      reinterpret_cast<uint2*>(p.q8 + row * D)[lane] = bytes;
      if (lane == 0) {
        p.q_scale[row] = scale;
        p.lse_shift[row] = p.scale * dot;
      }
    }
  }
  // V: thread d quantizes channel d of each token and writes 16-byte rows of the chunks.
  if (p.v8 == nullptr) return;
  const int d = threadIdx.x;
  const float v_mean = p.v_mean[int64_t(bh) * D + d], v_inv = 1.f / p.v_scale[int64_t(bh) * D + d];
  for (int c = 0; c < kQuantizeTokens / kChunk; ++c) {
    const int s0 = first + c * kChunk;
    if (s0 >= p.seq_kv_padded) break;
    uint32_t x[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      int q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = s0 + 4 * w + i;
        q[i] = s < p.seq_kv
                   ? quantize_value(load_element(p.v, row_offset(p.v_stride, b, s, h) + d, p.dtype) - v_mean, v_inv)
                   : 0;
      }
      x[w] = pack_int8(q[0], q[1], q[2], q[3]) ^ 0x80808080u;  // plus 128 per byte
    }
    // Byte j of the chunk row holds token TESSERA_V_CHUNK_TOKEN(j): words of tokens {0, 1, 8, 9},
    // {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}.
    const uint4 row = make_uint4(__byte_perm(x[0], x[2], 0x5410), __byte_perm(x[0], x[2], 0x7632),
                                 __byte_perm(x[1], x[3], 0x5410), __byte_perm(x[1], x[3], 0x7632));
    const int64_t chunk = int64_t(bh) * (p.seq_kv_padded / kChunk) + s0 / kChunk;
    *reinterpret_cast<uint4*>(p.v8 + (chunk * D + d) * kChunk) = row;
  }
}

#ifndef __CUDACC_RTC__
// Host: the four launches (0 on success, else a cudaError_t value); parameters checked by the caller.
inline int launch_quantize(const TesseraQuantizeParams& p, cudaStream_t stream) {
  const unsigned bh = unsigned(p.batch) * unsigned(p.heads);
  channel_statistics<<<dim3(unsigned(p.segments), bh), kQuantizeThreads, 0, stream>>>(p);
  channel_finish<<<dim3(bh), kQuantizeThreads, 0, stream>>>(p);
  const int tokens = max(p.seq_q, p.seq_kv_padded);
  quantize_rows<<<dim3(unsigned((tokens + kQuantizeTokens - 1) / kQuantizeTokens), bh), kQuantizeThreads, 0, stream>>>(p);
  quantize_k_chunks<<<dim3(unsigned(p.seq_kv_padded / kQuantizeTokens), bh), kQuantizeThreads, 0, stream>>>(p);
  return int(cudaGetLastError());
}
#endif

}  // namespace tessera::quantized
