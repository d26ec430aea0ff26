// The quantization pass of 8-bit attention (tessera_diffusers/quantized.py's `quantize`, layouts in
// tessera/quantized/params.h), in three launches:
//   channel_statistics  per (b, h) and token segment, per channel: sums of K and V, V's max and min
//                       (one thread per channel, coalesced token rows);
//   channel_finish      per (b, h): k_mean, v_mean and v_scale from the segments' partials;
//   quantize_rows       per (b, h) and 128 tokens: Q and K rows to int8 with a scale per token (a
//                       warp per row; Q's lse_shift = scale * q . k_mean on the way), V to int8 per
//                       channel plus 128, written transposed in 16-token chunks (a thread per
//                       channel).
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
constexpr int kQuantizeTokens = 128;                          // tokens per quantize_rows CTA
constexpr int kChunk = 16;                                    // tokens per v8 chunk
constexpr float kInt8Max = 127.f;

__device__ __forceinline__ float load_element(const void* base, int64_t offset, int dtype) {
  return dtype == TESSERA_BF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(base)[offset])
                               : __half2float(static_cast<const __half*>(base)[offset]);
}

// Four consecutive channels of one token row (8-byte aligned: the row is 16-byte aligned).
__device__ __forceinline__ float4 load_four(const void* base, int64_t offset, int dtype) {
  const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(base) + 2 * offset);
  float2 lo, hi;
  if (dtype == TESSERA_BF16) {
    lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  } else {
    lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
    hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  }
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ int64_t row_offset(const int64_t (&stride)[3], int b, int s, int h) {
  return int64_t(b) * stride[0] + int64_t(s) * stride[1] + int64_t(h) * stride[2];
}

// round(x / scale) within [-127, 127], as the twin's torch.round (half to even).
__device__ __forceinline__ int quantize_value(float x, float scale) {
  return max(-127, min(127, __float2int_rn(x / scale)));
}

__device__ __forceinline__ uint32_t pack_int8(int a, int b, int c, int d) {
  return (uint32_t(a) & 0xffu) | ((uint32_t(b) & 0xffu) << 8) | ((uint32_t(c) & 0xffu) << 16) | (uint32_t(d) << 24);
}

// Tokens per statistics segment.
__host__ __device__ inline int segment_tokens(const TesseraQuantizeParams& p) {
  return (p.seq_kv + p.segments - 1) / p.segments;
}

__global__ void __launch_bounds__(kQuantizeThreads) channel_statistics(const __grid_constant__ TesseraQuantizeParams p) {
  const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads, d = threadIdx.x;
  const int len = segment_tokens(p);
  const int first = blockIdx.x * len, last = min(first + len, p.seq_kv);
  float k_sum = 0.f, v_sum = 0.f, v_max = -CUDART_INF_F, v_min = CUDART_INF_F;
  if (p.v8 != nullptr) {
#pragma unroll 4
    for (int s = first; s < last; ++s) {
      k_sum += load_element(p.k, row_offset(p.k_stride, b, s, h) + d, p.dtype);
      const float v = load_element(p.v, row_offset(p.v_stride, b, s, h) + d, p.dtype);
      v_sum += v;
      v_max = fmaxf(v_max, v);
      v_min = fminf(v_min, v);
    }
  } else {
#pragma unroll 4
    for (int s = first; s < last; ++s) k_sum += load_element(p.k, row_offset(p.k_stride, b, s, h) + d, p.dtype);
  }
  float* out = p.partials + (int64_t(bh) * p.segments + blockIdx.x) * 4 * TESSERA_QUANTIZED_HEAD_DIM + d;
  out[0 * TESSERA_QUANTIZED_HEAD_DIM] = k_sum;
  out[1 * TESSERA_QUANTIZED_HEAD_DIM] = v_sum;
  out[2 * TESSERA_QUANTIZED_HEAD_DIM] = v_max;
  out[3 * TESSERA_QUANTIZED_HEAD_DIM] = v_min;
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

// One token row to int8 with its own scale (a warp, 4 channels per lane); returns the scale and,
// through `dot`, the row's dot product with `other` (the lane's 4 channels of it).
__device__ __forceinline__ float quantize_row(float4 x, int8_t* out, int lane, float4 other, float& dot) {
  float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
  dot = x.x * other.x + x.y * other.y + x.z * other.z + x.w * other.w;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    dot += __shfl_xor_sync(0xffffffffu, dot, o);
  }
  const float scale = amax > 0.f ? amax / kInt8Max : 1.f;
  reinterpret_cast<uint32_t*>(out)[lane] = pack_int8(quantize_value(x.x, scale), quantize_value(x.y, scale),
                                                     quantize_value(x.z, scale), quantize_value(x.w, scale));
  return scale;
}

__global__ void __launch_bounds__(kQuantizeThreads) quantize_rows(const __grid_constant__ TesseraQuantizeParams p) {
  constexpr int D = TESSERA_QUANTIZED_HEAD_DIM;
  const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kQuantizeTokens;
  const float4 k_mean = *reinterpret_cast<const float4*>(p.k_mean + int64_t(bh) * D + 4 * lane);
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int r = warp; r < kQuantizeTokens; r += kQuantizeThreads / 32) {
    const int s = first + r;
    if (s < p.seq_q) {
      float dot;
      const float4 x = load_four(p.q, row_offset(p.q_stride, b, s, h) + 4 * lane, p.dtype);
      const int64_t row = int64_t(bh) * p.seq_q + s;
      const float scale = quantize_row(x, p.q8 + row * D, lane, k_mean, dot);
      if (lane == 0) {
        p.q_scale[row] = scale;
        p.lse_shift[row] = p.scale * dot;
      }
    }
    if (s < p.seq_kv_padded) {
      const int64_t row = int64_t(bh) * p.seq_kv_padded + s;
      if (s < p.seq_kv) {
        float4 x = load_four(p.k, row_offset(p.k_stride, b, s, h) + 4 * lane, p.dtype);
        x = make_float4(x.x - k_mean.x, x.y - k_mean.y, x.z - k_mean.z, x.w - k_mean.w);
        float dot;  // unused
        const float scale = quantize_row(x, p.k8 + row * D, lane, zero, dot);
        if (lane == 0) p.k_scale[row] = scale;
      } else {  // padding: zero keys (their columns are masked)
        reinterpret_cast<uint32_t*>(p.k8 + row * D)[lane] = 0u;
        if (lane == 0) p.k_scale[row] = 0.f;
      }
    }
  }
  // V: thread d quantizes channel d of each token and writes 16-byte rows of the chunks.
  if (p.v8 == nullptr) return;
  const int d = threadIdx.x;
  const float v_mean = p.v_mean[int64_t(bh) * D + d], v_scale = p.v_scale[int64_t(bh) * D + d];
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
                   ? quantize_value(load_element(p.v, row_offset(p.v_stride, b, s, h) + d, p.dtype) - v_mean, v_scale)
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
// Host: the three launches (0 on success, else a cudaError_t value); parameters checked by the caller.
inline int launch_quantize(const TesseraQuantizeParams& p, cudaStream_t stream) {
  const unsigned bh = unsigned(p.batch) * unsigned(p.heads);
  channel_statistics<<<dim3(unsigned(p.segments), bh), kQuantizeThreads, 0, stream>>>(p);
  channel_finish<<<dim3(bh), kQuantizeThreads, 0, stream>>>(p);
  const int tokens = max(p.seq_q, p.seq_kv_padded);
  quantize_rows<<<dim3(unsigned((tokens + kQuantizeTokens - 1) / kQuantizeTokens), bh), kQuantizeThreads, 0, stream>>>(p);
  return int(cudaGetLastError());
}
#endif

}  // namespace tessera::quantized
