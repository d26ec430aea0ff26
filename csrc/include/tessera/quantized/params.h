// Plain C ABI of the 8-bit attention path: the quantization pass and the 8-bit Hopper kernels.
// Mirrored field for field by tessera_diffusers/library.py (ctypes.Structure); keep them in sync.
// The arithmetic is tessera_diffusers/quantized.py's (docs/design.md, "8-bit attention").
#pragma once
#include <stdint.h>

#include "tessera/params.h"

#ifdef __cplusplus
extern "C" {
#endif

// Layouts the quantization pass writes, heads-major (B, H, ...), all contiguous:
//   q8        [B, H, Sq, D] int8          q_scale [B, H, Sq] fp32       lse_shift [B, H, Sq] fp32
//   k8        [B, H, Skv_pad, D] int8     k_scale [B, H, Skv_pad] fp32  (k - k_mean; zero past Skv;
//             one scale per chunk of TESSERA_QUANTIZED_K_CHUNK tokens, below)
//   v8        [B, H, Skv_pad / 16, D, 16] uint8: int8 of v - v_mean plus 128, V transposed in chunks
//             of 16 tokens (8-bit wgmma reads both operands K-major), the tokens of a chunk in the
//             order of the P V product's register operand (TESSERA_V_CHUNK_TOKEN below); 128 past Skv
//   v_scale, v_mean, k_mean [B, H, D] fp32
// v8, v_scale and v_mean are made only for the kernels with an 8-bit P V (NULL otherwise).
// Skv_pad is a multiple of 128 at or past Skv, so a KV slot never reads past the buffers.
#define TESSERA_QUANTIZED_ALIGN 128
#define TESSERA_QUANTIZED_HEAD_DIM 128

// K's scale is one per chunk of TESSERA_QUANTIZED_K_CHUNK tokens from token 0, written for each of
// the chunk's tokens (1 for a chunk without a nonzero key, as past Skv, so a kernel's factor for a
// masked column stays finite). A KV slot of an 8-bit plan is whole chunks (its unit, a power of two
// of at least 16 tokens, starts on a multiple of itself), so a kernel applies one factor per chunk.
#define TESSERA_QUANTIZED_K_CHUNK 16

// Byte j of a 16-token chunk of v8 holds token TESSERA_V_CHUNK_TOKEN(j) of the chunk: the P
// fragment keeps the score accumulator's value order (thread t of a quad holds columns 2t, 2t + 1,
// 2t + 8, 2t + 9 of each 16) while the 8-bit A operand reads columns 4t .. 4t + 3, so V's rows are
// permuted to match instead of P's bytes.
#define TESSERA_V_CHUNK_TOKEN(j) (8 * (((j) & 3) >> 1) + 2 * ((j) >> 2) + ((j) & 1))

typedef struct TesseraQuantizedParams {
  TesseraAttnParams attn;  // q, k, v: q8, k8, v8 (their strides unused); for a kernel with a 16-bit
                           // P V, v is the request's 16-bit V with its strides; o, lse, split-K parts
                           // and the plan's metadata as for the 16-bit kernels; task_counter NULL
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  const float* v_mean;
  const float* lse_shift;
  int32_t seq_kv_padded;   // Skv_pad
  int32_t reserved;
} TesseraQuantizedParams;

// The quantization pass over q, k, v (B, S, H, D) bf16 or fp16 with element strides per (b, s, h).
typedef struct TesseraQuantizeParams {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride[3];
  int64_t k_stride[3];
  int64_t v_stride[3];
  int32_t batch;
  int32_t heads;
  int32_t seq_q;
  int32_t seq_kv;
  int32_t seq_kv_padded;   // Skv_pad
  int32_t head_dim;        // TESSERA_QUANTIZED_HEAD_DIM
  int32_t dtype;           // TesseraDtype of q, k, v
  int32_t segments;        // token segments of the channel statistics (partial sums per segment)
  float scale;             // softmax scale (lse_shift = scale * q . k_mean)
  int32_t reserved;
  int8_t* q8;
  float* q_scale;
  int8_t* k8;
  float* k_scale;
  uint8_t* v8;
  float* v_scale;
  float* v_mean;
  float* k_mean;
  float* lse_shift;
  float* partials;         // [B, H, segments, 4, D] fp32 scratch
} TesseraQuantizeParams;

enum TesseraQuantizedStruct { TESSERA_STRUCT_QUANTIZED_ATTN = 0, TESSERA_STRUCT_QUANTIZE = 1 };

int tessera_quantized_num_kernels(void);
const char* tessera_quantized_kernel_name(int kernel_id);
int tessera_quantized_kernel_smem_bytes(int kernel_id);
int tessera_quantized_kernel_ctas_per_sm(int kernel_id);
int tessera_quantized_struct_bytes(int which);
// Launches; each returns a cudaError_t value (0 = success) and checks its parameters first.
int tessera_quantize(const TesseraQuantizeParams* params, void* stream);
int tessera_quantized_attention_forward(int kernel_id, const TesseraQuantizedParams* params, void* stream);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
namespace tessera::quantized {
// What the C entry point checks a launch of one 8-bit kernel against (kernels/quantized.cu).
struct KernelLimits {
  int tile_q;
  int tile_kv;
  int max_slots;
  bool pv16;  // P V in 16 bits: v is the request's 16-bit V, v_scale and v_mean unused
};

template <class T>
constexpr KernelLimits kernel_limits() {
  return {T::kTileQ, T::kTileKV, T::kMaxSlots, T::kPv16};
}
}  // namespace tessera::quantized
#endif
