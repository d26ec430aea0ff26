// 8-bit Hopper (sm90a) block-sparse attention forward over the 16-bit kernels' plans and metadata
// (tessera/tasks.cuh): the same warp specialization, pipeline barriers, ping-pong and masking
// (tessera/hopper/), on the quantization pass's tensors (tessera/quantized/params.h).
//   producer   one thread: Q and K by TMA (a box per query tile or unit, a box per KV slot), the
//              slot's K scales and its V^T chunks by bulk copies (v8's chunks are contiguous);
//   consumers  per KV tile i, inside each warpgroup:
//                issue O_i = P8_{i-1} V8_{i-1} (int32);  issue S = Q8 K8_i^T (int32);
//                wait O_i;  O += c_{i-1} O_i,  c = max_tile p / 255;  wait S;
//                scores = S * k_scale (columns) * q_scale * scale (rows), masked; online softmax;
//                P8_i = round(255 * p / max_tile p) (uint8, packed in the A operand's registers),
//                the row sums of the rounded P8_i;  O *= alpha_i
//              then the epilogue: (O * 2^23 / row sum - 128) * v_scale + v_mean, lse + lse_shift.
// V is offset by 128 (uint8), so a tile's P V product is never negative and below 2^23: its bits
// are an fp32 denormal, product * 2^-149, and one FFMA adds it to O, which holds 2^-23 times the
// output's scale; the offset's share, 128 times the row sum of P8, comes off in the epilogue.
// P's bytes come from f16 pairs: two fp32 exponentials packed, one HFMA2 rounds both to bytes.
// With T::kPv16 only Q K^T is 8-bit: P and V stay in the output's 16-bit type and P V accumulates
// in fp32 in the tensor cores, in the 16-bit kernels' order (consumer_loop_p16); its scores take
// K's scale once per 16-token chunk (TESSERA_QUANTIZED_K_CHUNK): the row maximum of the raw scores
// per chunk, the chunk's factor in the exponent's FFMA.
// Static schedule only (every gridDim.x-th task): the launcher refuses a task counter.
#pragma once
#include <cutlass/arch/reg_reconfig.h>

#include <cute/arch/copy_sm90_tma.hpp>

#include "tessera/hopper/attention.cuh"  // TiledMmas, make_views
#include "tessera/hopper/epilogue.cuh"   // row_outputs, store_lse
#include "tessera/hopper/mainloop.cuh"  // wgmma_issue, mask_scores, PingPong
#include "tessera/hopper/pipeline.cuh"  // barriers, PipeState
#include "tessera/quantized/params.h"
#include "tessera/quantized/traits.cuh"
#include "tessera/tasks.cuh"

namespace tessera::quantized {

using hopper::Barrier;
using hopper::PingPong;
using hopper::PipelineBarriers;
using hopper::PipeState;
using hopper::TxBarrier;
using portable::fast_exp2;

// TMA descriptors of one launch: Q boxes of kTileQ rows (q_unit rows in the grouped layout) and K
// boxes of kv_unit rows, kHeadDim bytes wide, 128-byte swizzled; with T::kPv16, 16-bit V boxes of
// kv_unit rows x 64 columns (as the 16-bit kernels' V).
struct TmaMaps {
  CUtensorMap q, k, v;
};

// x + 1.5 * 2^23 holds x's integer value in its low mantissa bits for |x| < 2^22: an int32 becomes
// the float x + 1.5 * 2^23 with one integer add (the 8-bit P V's row sums of P's bytes).
constexpr float kMagic = 12582912.f;
constexpr int kMagicBits = 0x4B400000;

__device__ __forceinline__ float magic_float(int32_t x) { return __int_as_float(x + kMagicBits); }  // x + kMagic

// O's scale: O holds 2^-23 times the output (a P V product enters as a denormal, product * 2^-149,
// times max_tile p / 255 * 2^126; the factor stays below 2^127 under the lazy reference).
constexpr float kUnitScale = 0x1p126f;
constexpr float kOutputScale = 0x1p23f;

// a * b + c with a denormal `a` kept (no flush to zero, whatever the compiler's -ftz says).
__device__ __forceinline__ float fma_keep_denormals(float a, float b, float c) {
  float d;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}

// 2^a and 2^b (a, b <= 0 but for rounding), as rounded bytes round(255 * 2^x) in the low byte of
// each f16 half: f16 values in [1536, 2048) are integers, so 255 * 2^x + 1536 rounds to nearest
// even (as the twin's torch.round) and its low mantissa bits are the byte.
// (ex2.approx.f16x2 would be two MUFU operations and a repack: the fp32 ones cost the same.)
__device__ __forceinline__ uint32_t exp2_bytes(float a, float b) {
  uint32_t h, r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(fast_exp2(b)), "f"(fast_exp2(a)));  // a's in the low half
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(0x5BF85BF8u), "r"(0x66006600u));  // 255, 1536
  return r;
}

// ---- producer ----------------------------------------------------------------------------------

template <class T>
__device__ __forceinline__ void load_q(const TesseraAttnParams& p, const TmaMaps& tma, const Task& t, int8_t* q_smem,
                                       uint64_t* q_full) {
  TxBarrier::arrive_and_expect_tx(q_full, T::kSmemQTileBytes);
  if (p.q_units == nullptr) {
    SM90_TMA_LOAD_4D::copy(&tma.q, q_full, uint64_t(TMA::CacheHintSm90::EVICT_FIRST), q_smem, 0, t.q_tile * T::kTileQ,
                           t.h, t.b);
  } else {  // grouped layout: one box of q_unit rows per query unit, at the unit's token rows
    const int q_unit = 1 << p.q_unit_log2;
    const int kq = T::kTileQ >> p.q_unit_log2;
    const int32_t* units = p.q_units + t.meta_row * kq;
    for (int a = 0; a < kq; ++a) {
      const int row = max(__ldg(units + a), 0) << p.q_unit_log2;  // no unit: rows of unit 0, never stored
      SM90_TMA_LOAD_4D::copy(&tma.q, q_full, uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                             q_smem + a * q_unit * T::kHeadDim, 0, row, t.h, t.b);
    }
  }
}

// K (a TMA box per slot) with its scales, then V: 8-bit V^T by a bulk copy per slot (a slot of
// kv_unit tokens is kv_unit / 16 contiguous chunks of v8), 16-bit V (T::kPv16) by TMA boxes as the
// 16-bit kernels load it; once per KV tile of task t, each after its stage is free.
template <class T>
__device__ __forceinline__ void load_tiles(const TesseraQuantizedParams& qp, const TmaMaps& tma, const Task& t,
                                           unsigned char* smem, PipelineBarriers<T::kStages, T::kQStages>& bar,
                                           PipeState<T::kStages>& write) {
  const TesseraAttnParams& p = qp.attn;
  const int unit = 1 << p.kv_unit_log2;
  const int64_t bh = int64_t(t.b) * p.heads + t.h;
  const float* k_scale = qp.k_scale + bh * qp.seq_kv_padded;
  const uint8_t* v8 = static_cast<const uint8_t*>(p.v) + bh * qp.seq_kv_padded * T::kHeadDim;
  for (int tile = t.tile_begin; tile < t.tile_end; ++tile) {
    const int32_t* slots = tile_slots(p, t, tile);
    int start[T::kMaxSlots];
    CUTE_UNROLL
    for (int j = 0; j < T::kMaxSlots; ++j) start[j] = j < p.slots ? max(__ldg(slots + j), 0) : 0;
    const int s = write.stage;
    int8_t* k_stage = reinterpret_cast<int8_t*>(smem + T::kSmemKOffset) + s * T::kSmemKTileBytes;
    unsigned char* v_stage = smem + T::kSmemVOffset + s * T::kSmemVTileBytes;
    float* ks_stage = reinterpret_cast<float*>(smem + T::kSmemKScaleOffset) + s * T::kTileKV;
    Barrier::wait(&bar.k_empty[s], write.phase ^ 1u);
    TxBarrier::arrive_and_expect_tx(&bar.k_full[s], T::kSmemKTileBytes + T::kSmemKScaleBytes);
    for (int j = 0; j < p.slots; ++j) {
      SM90_TMA_LOAD_4D::copy(&tma.k, &bar.k_full[s], uint64_t(TMA::CacheHintSm90::EVICT_LAST),
                             k_stage + j * unit * T::kHeadDim, 0, start[j], t.h, t.b);
      SM90_BULK_COPY_G2S::copy(k_scale + start[j], &bar.k_full[s], ks_stage + j * unit, unit * int(sizeof(float)));
    }
    Barrier::wait(&bar.v_empty[s], write.phase ^ 1u);
    if constexpr (T::kPv16) {
      hopper::load_kv_tile<typename T::VTile>(&tma.v, &bar.v_full[s], reinterpret_cast<typename T::Output*>(v_stage),
                                              start, p.slots, unit, t);
    } else {
      TxBarrier::arrive_and_expect_tx(&bar.v_full[s], T::kSmemVTileBytes);
      for (int j = 0; j < p.slots; ++j)
        SM90_BULK_COPY_G2S::copy(v8 + int64_t(start[j]) * T::kHeadDim, &bar.v_full[s], v_stage + j * unit * T::kHeadDim,
                                 unit * T::kHeadDim);
    }
    write.advance();
  }
}

template <class T>
__device__ void producer_loop(const TesseraQuantizedParams& qp, const TmaMaps& tma, unsigned char* smem,
                              PipelineBarriers<T::kStages, T::kQStages>& bar) {
  if (threadIdx.x != 0) return;
  const TesseraAttnParams& p = qp.attn;
  cute::prefetch_tma_descriptor(&tma.q);
  cute::prefetch_tma_descriptor(&tma.k);
  if constexpr (T::kPv16) cute::prefetch_tma_descriptor(&tma.v);
  PipeState<T::kStages> write;
  PipeState<T::kQStages> write_q;
  const int64_t tasks = num_tasks(p);
  for (int64_t task_id = blockIdx.x; task_id < tasks; task_id += gridDim.x) {
    const Task t = decode_task(p, task_id);
    if (t.tile_end <= t.tile_begin) continue;  // the consumers write the empty-row epilogue alone
    Barrier::wait(&bar.q_empty[write_q.stage], write_q.phase ^ 1u);
    load_q<T>(p, tma, t, reinterpret_cast<int8_t*>(smem) + write_q.stage * T::kSmemQTileBytes,
              &bar.q_full[write_q.stage]);
    write_q.advance();
    load_tiles<T>(qp, tma, t, smem, bar, write);
  }
}

// ---- consumers ---------------------------------------------------------------------------------

// The K scales of the thread's columns (lane_col + 8 j + {0, 1}) in one stage, from shared memory.
template <int kBlocks>
__device__ __forceinline__ void load_k_scales(uint32_t ks_stage, int lane_col, float2 (&ks)[kBlocks]) {
  CUTE_UNROLL
  for (int j = 0; j < kBlocks; ++j)
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                 : "=f"(ks[j].x), "=f"(ks[j].y)
                 : "r"(ks_stage + uint32_t(lane_col + 8 * j) * uint32_t(sizeof(float))));
}

// One tile's int32 scores `s` as fp32 `sf`: float(s) * k_scale (column), masked where `act` says
// (-inf). The row factor (q_scale * scale * log2 e) comes later. The conversion (I2F) issues at
// half the FMA rate and not on the exponentials' unit; exact (|s| < 2^22, traits.cuh).
template <class T, class FragS, class FragF, int kBlocks>
__device__ __forceinline__ void column_scaled_scores(const TesseraAttnParams& p, const Task& t, int tile,
                                                     const TileActivity& act, const FragS& s,
                                                     const float2 (&ks)[kBlocks], int lane_col,
                                                     const int (&row_of_half)[2], FragF& sf) {
  static_assert(kBlocks * 4 == decltype(size(s))::value, "a K scale pair per n8 block");
  CUTE_UNROLL
  for (int j = 0; j < kBlocks; ++j) {  // n8 block j: columns lane_col + 8 j + {0, 1}, both row halves
    sf(4 * j + 0) = __int2float_rn(s(4 * j + 0)) * ks[j].x;
    sf(4 * j + 1) = __int2float_rn(s(4 * j + 1)) * ks[j].y;
    sf(4 * j + 2) = __int2float_rn(s(4 * j + 2)) * ks[j].x;
    sf(4 * j + 3) = __int2float_rn(s(4 * j + 3)) * ks[j].y;
  }
  if (act.needs_mask) hopper::mask_scores<T>(p, act, tile_slots(p, t, tile), sf, lane_col, row_of_half);
}

// The maximum of m over the thread's quad (the four lanes that hold one row's columns).
__device__ __forceinline__ float quad_max(float m) {
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
}

// The maximum of one row half (0 or 1) of the thread's quad's scores, in independent chains.
template <class FragF>
__device__ __forceinline__ float row_half_max(const FragF& sf, int half) {
  constexpr int kBlocks = decltype(size(sf))::value / 4;
  constexpr int kChains = 4;  // the row half's maximum in independent chains (not one chain of kVals / 2)
  float part[kChains];
  CUTE_UNROLL
  for (int c = 0; c < kChains; ++c) part[c] = fmaxf(sf(4 * c + 2 * half), sf(4 * c + 2 * half + 1));
  CUTE_UNROLL
  for (int j = kChains; j < kBlocks; ++j)
    part[j % kChains] = fmaxf(part[j % kChains], fmaxf(sf(4 * j + 2 * half), sf(4 * j + 2 * half + 1)));
  return quad_max(fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
}

// A row half's references after one tile: `tile`, the tile's maximum score m times the row factor rf
// (-inf where none of its columns is active), and `row`, the row's reference the tile's
// probabilities are taken against (0 while the row has no active score: exp2 gives 0 then). The
// reference is lazy (as the 16-bit 64-column kernels'): it moves only when the tile exceeds it by
// more than 2^kRescaleThreshold, also when the row had no active score yet; `alpha` is the factor
// for what was accumulated under the previous one (0 from an empty row, 1 where it stays).
struct References {
  float tile, row;
};

template <class T>
__device__ __forceinline__ References move_reference(float m, float rf, float& row_max, float& alpha) {
  const float tile_ref = m == -CUDART_INF_F ? -CUDART_INF_F : m * rf;
  const bool moves = tile_ref > row_max + T::kRescaleThreshold;
  alpha = moves ? fast_exp2(row_max - tile_ref) : 1.f;
  if (moves) row_max = tile_ref;
  return {tile_ref, row_max == -CUDART_INF_F ? 0.f : row_max};
}

// Online softmax of one tile's int32 scores `s` into the packed P operand `prob_w`: the scores are
// column_scaled_scores times rf (row: q_scale * scale * log2 e); returns in `alpha` the factor for
// what was accumulated under the previous reference and in `tile_unit` the value of one P step
// (max_tile p / 255, relative to the new reference; 0 for a row none of whose tile columns is
// active). The row sums add up the rounded bytes (the weights P V applies).
template <class T, class FragS, class FragP, int kBlocks>
__device__ __forceinline__ void softmax_to_p8(const TesseraAttnParams& p, const Task& t, int tile,
                                              const TileActivity& act, const FragS& s,
                                              const float2 (&ks)[kBlocks], int lane_col, const int (&row_of_half)[2],
                                              const float (&rf)[2], float (&row_max)[2], float (&row_sum)[2],
                                              float (&alpha)[2], float (&tile_unit)[2], FragP& prob_w) {
  constexpr int kVals = decltype(size(s))::value;
  Tensor sf = make_tensor<float>(s.layout());
  column_scaled_scores<T>(p, t, tile, act, s, ks, lane_col, row_of_half, sf);
  float base[2];
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    // P is rounded against the tile's own maximum, so a stale reference costs no precision.
    const References r = move_reference<T>(row_half_max(sf, half), rf[half], row_max[half], alpha[half]);
    base[half] = r.tile == -CUDART_INF_F ? 0.f : r.tile;
    tile_unit[half] = r.tile == -CUDART_INF_F ? 0.f : fast_exp2(r.tile - r.row) * (1.f / 255.f);
  }
  uint32_t bytes[2] = {0u, 0u};
  CUTE_UNROLL
  for (int w = 0; w < kVals / 4; ++w) {  // word w: values e0, e0 + 1, e0 + 4, e0 + 5 of one row half
    const int e0 = 2 * (w & 1) + 8 * (w >> 1);
    const int half = w & 1;
    const uint32_t lo = exp2_bytes(fmaf(sf(e0), rf[half], -base[half]), fmaf(sf(e0 + 1), rf[half], -base[half]));
    const uint32_t hi = exp2_bytes(fmaf(sf(e0 + 4), rf[half], -base[half]), fmaf(sf(e0 + 5), rf[half], -base[half]));
    const uint32_t word = __byte_perm(lo, hi, 0x6420);
    prob_w(w) = word;
    bytes[half] = __dp4a(word, 0x01010101u, bytes[half]);
  }
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half)
    row_sum[half] = fmaf(row_sum[half], alpha[half], (magic_float(int32_t(bytes[half])) - kMagic) * tile_unit[half]);
}

// The K scales of one stage's 16-token chunks (TESSERA_QUANTIZED_K_CHUNK): the scale of each
// chunk's first token, which all its tokens share.
template <int kChunks>
__device__ __forceinline__ void load_chunk_scales(uint32_t ks_stage, float (&kc)[kChunks]) {
  CUTE_UNROLL
  for (int c = 0; c < kChunks; ++c)
    asm volatile("ld.shared.f32 %0, [%1];"
                 : "=f"(kc[c])
                 : "r"(ks_stage + uint32_t(TESSERA_QUANTIZED_K_CHUNK * c) * uint32_t(sizeof(float))));
}

// Chunk c of a thread's score columns is n8 blocks 2c and 2c + 1: of row half `half`, the values
// e0, e0 + 1, e0 + 4, e0 + 5 with e0 = 8 c + 2 half.
__device__ __forceinline__ constexpr int chunk_value(int c, int half) { return 8 * c + 2 * half; }

// The maximum over a row half's quad of the scores as floats times their chunk's K scale: per
// chunk the raw maximum, then one product (a K scale is positive).
template <class FragF, int kChunks>
__device__ __forceinline__ float chunk_scaled_max(const FragF& sf, int half, const float (&kc)[kChunks]) {
  float m = -CUDART_INF_F;
  CUTE_UNROLL
  for (int c = 0; c < kChunks; ++c) {
    const int e0 = chunk_value(c, half);
    m = fmaxf(m, fmaxf(fmaxf(sf(e0), sf(e0 + 1)), fmaxf(sf(e0 + 4), sf(e0 + 5))) * kc[c]);
  }
  return quad_max(m);
}

// Online softmax of one tile's int32 scores `s` into fp32 probabilities `sf` for a 16-bit P V
// (T::kPv16): a score is float(s) times its chunk's K scale kc times rf, one FFMA with the chunk's
// factor kc * rf per value (no factor per key); probabilities relative to the row's lazy reference
// (as the 16-bit kernels': at most 2^kRescaleThreshold), the row sums of the unrounded
// probabilities (as the twin's pv="bf16"); returns in `alpha` the factor for what was accumulated
// under the previous reference.
template <class T, class FragS, class FragF, int kChunks>
__device__ __forceinline__ void softmax_to_p16(const TesseraAttnParams& p, const Task& t, int tile,
                                               const TileActivity& act, const FragS& s, const float (&kc)[kChunks],
                                               int lane_col, const int (&row_of_half)[2], const float (&rf)[2],
                                               float (&row_max)[2], float (&row_sum)[2], float (&alpha)[2], FragF& sf) {
  static_assert(kChunks * 8 == decltype(size(s))::value, "two n8 blocks of the thread's columns per chunk");
  CUTE_UNROLL
  for (int e = 0; e < size(s); ++e) sf(e) = __int2float_rn(s(e));  // exact: |s| < 2^22
  if (act.needs_mask) hopper::mask_scores<T>(p, act, tile_slots(p, t, tile), sf, lane_col, row_of_half);
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const float ref = move_reference<T>(chunk_scaled_max(sf, half, kc), rf[half], row_max[half], alpha[half]).row;
    float part[4] = {0.f, 0.f, 0.f, 0.f};
    CUTE_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      const float factor = kc[c] * rf[half];
      const int e0 = chunk_value(c, half);
      sf(e0) = fast_exp2(fmaf(sf(e0), factor, -ref));
      sf(e0 + 1) = fast_exp2(fmaf(sf(e0 + 1), factor, -ref));
      sf(e0 + 4) = fast_exp2(fmaf(sf(e0 + 4), factor, -ref));
      sf(e0 + 5) = fast_exp2(fmaf(sf(e0 + 5), factor, -ref));
      part[c % 4] += (sf(e0) + sf(e0 + 1)) + (sf(e0 + 4) + sf(e0 + 5));
    }
    row_sum[half] = fmaf(row_sum[half], alpha[half], (part[0] + part[1]) + (part[2] + part[3]));
  }
}

// The row factors of the thread's two row halves: q_scale * scale * log2 e (q_scale 1 past Sq).
template <class T>
__device__ __forceinline__ void row_factors(const TesseraQuantizedParams& qp, const Task& t, const int (&row_of_half)[2],
                                            float (&rf)[2]) {
  const TesseraAttnParams& p = qp.attn;
  const int64_t bh = int64_t(t.b) * p.heads + t.h;
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int row = query_row<T::kTileQ>(p, t, row_of_half[half]);
    rf[half] = (row >= 0 && row < p.seq_q ? __ldg(qp.q_scale + bh * p.seq_q + row) : 1.f) * p.scale_log2;
  }
}

// O += unit * O_tile per row half (O_tile the int32 product of one tile, read as a denormal; `unit`
// carries kUnitScale).
template <class FragO, class FragOi>
__device__ __forceinline__ void accumulate(FragO& o, const FragOi& oi, const float (&unit)[2]) {
  CUTE_UNROLL
  for (int e = 0; e < size(o); ++e) o(e) = fma_keep_denormals(__int_as_float(oi(e)), unit[(e >> 1) & 1], o(e));
}

// O *= alpha per row half, skipped by a warp none of whose rows moved its reference.
template <class FragO>
__device__ __forceinline__ void rescale(FragO& o, const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
    CUTE_UNROLL
    for (int e = 0; e < size(o); ++e) o(e) *= alpha[(e >> 1) & 1];
  }
}

// The task's output: (O * 2^23 / row sum - 128) * v_scale + v_mean, or O / row sum with T::kPv16
// (0 for an empty row), lse + lse_shift.
template <class T, class FragO, class CoordO>
__device__ __forceinline__ void store_output(const TesseraQuantizedParams& qp, const Task& t, const FragO& o,
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             const CoordO& coords, const int (&row_of_half)[2]) {
  using Output = typename T::Output;
  constexpr int kPairs = decltype(size(o))::value / 4;  // column pairs of the thread (each in both row halves)
  const TesseraAttnParams& p = qp.attn;
  const int64_t bh = int64_t(t.b) * p.heads + t.h;
  // The thread's channel factors, all loaded before any store (a store may alias them, so the
  // compiler would otherwise wait on each pair's loads in turn).
  const float* v_scale = qp.v_scale + bh * T::kHeadDim;
  const float* v_mean = qp.v_mean + bh * T::kHeadDim;
  float2 vs[kPairs], vm[kPairs];
  if constexpr (!T::kPv16) {
    CUTE_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      const int col = int(get<1>(coords(4 * j)));
      vs[j] = __ldg(reinterpret_cast<const float2*>(v_scale + col));
      vm[j] = __ldg(reinterpret_cast<const float2*>(v_mean + col));
    }
  }
  hopper::RowOutputs r = hopper::row_outputs<T>(p, t, row_max, row_sum, row_of_half);
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half)
    if (r.row[half] >= 0) r.lse[half] += __ldg(qp.lse_shift + bh * p.seq_q + r.row[half]);
  const bool split = p.num_splits > 1;
  const int64_t rows_per_split = int64_t(p.batch) * p.heads * p.seq_q;
  const bool paired = (reinterpret_cast<uintptr_t>(p.o) & 3u) == 0 &&
                      ((p.o_stride[0] | p.o_stride[1] | p.o_stride[2]) & 1) == 0;
  CUTE_UNROLL
  for (int e = 0; e < size(o); e += 2) {
    const int half = (e >> 1) & 1;
    const int row = r.row[half];
    if (row < 0) continue;
    const int col = int(get<1>(coords(e)));
    const float inv = r.inv[half];
    float v0, v1;
    if constexpr (T::kPv16) {
      v0 = o(e) * inv;  // an empty row's O and inv are 0
      v1 = o(e + 1) * inv;
    } else {
      const float2 f = vs[e >> 2], m = vm[e >> 2];
      const bool keys = inv != 0.f;  // an empty row stays 0 (v_mean is added to weights summing to 1)
      v0 = keys ? fmaf(fmaf(o(e) * inv, kOutputScale, -128.f), f.x, m.x) : 0.f;
      v1 = keys ? fmaf(fmaf(o(e + 1) * inv, kOutputScale, -128.f), f.y, m.y) : 0.f;
    }
    if (split) {
      const int64_t part = int64_t(t.split) * rows_per_split + bh * p.seq_q + row;
      *reinterpret_cast<float2*>(p.o_partial + part * T::kHeadDim + col) = make_float2(v0, v1);
    } else {
      Output* out = static_cast<Output*>(p.o) + int64_t(t.b) * p.o_stride[0] + int64_t(row) * p.o_stride[1] +
                    int64_t(t.h) * p.o_stride[2] + col;
      const Output e0 = static_cast<Output>(v0), e1 = static_cast<Output>(v1);
      if (paired) {
        *reinterpret_cast<uint32_t*>(out) = uint32_t(e0.raw()) | (uint32_t(e1.raw()) << 16);
      } else {
        out[0] = e0;
        out[1] = e1;
      }
    }
  }
  hopper::store_lse(p, t, r);
}

// One lane per warp arrives on the V and Q releases (the lane test kept in a register, not read
// again from the thread index on every release).
struct LaneRelease {
  bool lane0 = cute::elect_one_sync();
  __device__ __forceinline__ void operator()(uint64_t* barrier) const {
    if (lane0) Barrier::arrive(barrier);
  }
};

// This consumer thread's views (hopper::ConsumerViews): wgmma descriptors over the Q buffers, the K
// and the V^T stages, the coordinates of its score and output values, its rows and first column.
template <class T, class SmemQ, class SmemK, class SmemVt>
__device__ __forceinline__ auto consumer_views(hopper::TiledMmas<T>& mmas, int ctid, SmemQ& sQ, SmemK& sK,
                                               SmemVt& sVt) {
  auto thr_qk = mmas.qk.get_thread_slice(ctid);
  auto thr_pv = mmas.pv.get_thread_slice(ctid);
  return hopper::make_views(thr_qk.partition_fragment_A(sQ), thr_qk.partition_fragment_B(sK),
                            thr_pv.partition_fragment_B(sVt),
                            thr_qk.partition_C(make_identity_tensor(Shape<Int<T::kTileQ>, Int<T::kTileKV>>{})),
                            thr_pv.partition_C(make_identity_tensor(Shape<Int<T::kTileQ>, Int<T::kHeadDim>>{})));
}

// The consumers' frame around each task, for both P V formats: every gridDim.x-th task (the
// producer's sequence) with its row state cleared; for a task with KV tiles the row factors, the
// wait on its Q buffer qs, `body(t, n, qs, rf, row_max, row_sum)` over its n tiles, and the Q read
// state advanced; then the output (an empty row's too).
template <class T, class Views, class FragO, class Body>
__device__ __forceinline__ void for_each_task(const TesseraQuantizedParams& qp, const Views& views, FragO& o,
                                              PipelineBarriers<T::kStages, T::kQStages>& bar,
                                              PipeState<T::kQStages>& read_q, Body&& body) {
  const TesseraAttnParams& p = qp.attn;
  const int64_t tasks = num_tasks(p);
  for (int64_t task_id = blockIdx.x; task_id < tasks; task_id += gridDim.x) {
    const Task t = decode_task(p, task_id);
    const int n = t.tile_end - t.tile_begin;
    float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F}, row_sum[2] = {0.f, 0.f};
    clear(o);
    if (n > 0) {
      float rf[2];
      row_factors<T>(qp, t, views.row_of_half, rf);
      const int qs = read_q.stage;
      Barrier::wait(&bar.q_full[qs], read_q.phase);
      body(t, n, qs, rf, row_max, row_sum);
      read_q.advance();
    }
    store_output<T>(qp, t, o, row_max, row_sum, views.coords_o, views.row_of_half);
  }
}

// S = Q8 K8^T (int32) on the next K stage, Q in buffer qs, once the producer has filled the stage
// (its K scales with it).
template <class T, class Views, class FragS>
__device__ __forceinline__ void issue_scores(hopper::TiledMmas<T>& mmas, const Views& views, int qs,
                                             PipelineBarriers<T::kStages, T::kQStages>& bar,
                                             const PipeState<T::kStages>& read_k, FragS& s) {
  Barrier::wait(&bar.k_full[read_k.stage], read_k.phase);
  hopper::wgmma_issue<true>(mmas.qk, views.q(_, _, _, qs), views.k(_, _, _, read_k.stage), s);
}

// The shared-memory address of the K scales of the stage issue_scores waited for.
template <class T>
__device__ __forceinline__ uint32_t k_scale_stage(uint32_t ks_smem, const PipeState<T::kStages>& read_k) {
  return ks_smem + uint32_t(read_k.stage * T::kSmemKScaleBytes);
}

// Releases the K stage of the current tile: every thread, after its own reads of the K scales
// (init_barriers).
template <class T>
__device__ __forceinline__ void release_k(PipelineBarriers<T::kStages, T::kQStages>& bar,
                                          PipeState<T::kStages>& read_k) {
  Barrier::arrive(&bar.k_empty[read_k.stage]);
  read_k.advance();
}

// O = P V (kFresh: the 8-bit P V's int32 product of one tile) or O += P V on the next V stage, once
// the producer has filled it.
template <bool kFresh, class T, class Views, class FragP, class FragO>
__device__ __forceinline__ void issue_pv(hopper::TiledMmas<T>& mmas, const Views& views,
                                         PipelineBarriers<T::kStages, T::kQStages>& bar,
                                         const PipeState<T::kStages>& read_v, FragP& prob, FragO& o) {
  Barrier::wait(&bar.v_full[read_v.stage], read_v.phase);
  hopper::wgmma_issue<kFresh>(mmas.pv, prob, views.vt(_, _, _, read_v.stage), o);
}

// The P V that issue_pv started is done: P's and O's registers are free, the V stage is released.
template <class T, class FragP, class FragO>
__device__ __forceinline__ void pv_done(const LaneRelease& release, PipelineBarriers<T::kStages, T::kQStages>& bar,
                                        PipeState<T::kStages>& read_v, FragP& prob, FragO& o) {
  warpgroup_fence_operand(o);
  warpgroup_fence_operand(prob);
  release(&bar.v_empty[read_v.stage]);
  read_v.advance();
}

// The consumers with an 8-bit P V: per KV tile i, issue O_i = P8_{i-1} V8_{i-1} (int32) and
// S = Q8 K8_i^T; wait O_i, add it to O; wait S; softmax into P8_i; O *= alpha_i.
template <class T, class SmemQ, class SmemK, class SmemVt>
__device__ void consumer_loop(const TesseraQuantizedParams& qp, SmemQ& sQ, SmemK& sK, SmemVt& sVt,
                              uint32_t ks_smem, PipelineBarriers<T::kStages, T::kQStages>& bar) {
  const TesseraAttnParams& p = qp.attn;
  const int ctid = threadIdx.x - T::kProducerThreads;
  const LaneRelease release;
  hopper::TiledMmas<T> mmas;
  const auto views = consumer_views<T>(mmas, ctid, sQ, sK, sVt);

  Tensor s = partition_fragment_C(mmas.qk, Shape<Int<T::kTileQ>, Int<T::kTileKV>>{});  // int32
  Tensor oi = partition_fragment_C(mmas.pv, Shape<Int<T::kTileQ>, Int<T::kHeadDim>>{});  // int32, one tile
  Tensor o = make_fragment_like<float>(oi);
  // P in the register layout of the 8-bit A operand: ((4, 2, 2), 1, kTileKV / 32) bytes; word w
  // holds score values e0, e0 + 1, e0 + 4, e0 + 5 (e0 = 2 (w & 1) + 8 (w >> 1)), and v8's token
  // order within a chunk (TESSERA_V_CHUNK_TOKEN) makes that the A operand's column order.
  Tensor prob = make_tensor<uint8_t>(Layout<Shape<Shape<_4, _2, _2>, _1, Int<T::kTileKV / 32>>>{});
  Tensor prob_w = recast<uint32_t>(prob);
  static_assert(decltype(size(prob_w))::value * 4 == decltype(size(s))::value, "a byte of P per score value");
  constexpr int kBlocks = decltype(size(s))::value / 4;  // n8 blocks of the thread's score columns

  PipeState<T::kStages> read_k, read_v;
  PipeState<T::kQStages> read_q;
  const PingPong<T> turns{ctid / 128};
  turns.start();

  for_each_task<T>(qp, views, o, bar, read_q, [&](const Task& t, int n, int qs, const float (&rf)[2],
                                                  float (&row_max)[2], float (&row_sum)[2]) {
    float alpha[2], unit[2];
    TileActivity act = tile_activity<T::kTileQ>(p, t, t.tile_begin);
    float2 ks[kBlocks];
    auto scores = [&](int i) {  // S_i landed: softmax into P, then release K (its scales were read)
      warpgroup_fence_operand(s);
      softmax_to_p8<T>(p, t, t.tile_begin + i, act, s, ks, views.lane_col, views.row_of_half, rf, row_max, row_sum, alpha,
                       unit, prob_w);
      unit[0] *= kUnitScale;
      unit[1] *= kUnitScale;
      release_k<T>(bar, read_k);
      if (i == n - 1) release(&bar.q_empty[qs]);
    };

    turns.wait_turn();
    issue_scores(mmas, views, qs, bar, read_k, s);
    turns.pass_turn();
    load_k_scales(k_scale_stage<T>(ks_smem, read_k), views.lane_col, ks);  // before the wait on S
    warpgroup_wait<0>();
    scores(0);
    // P_{i-1} V_{i-1} is issued before S_i: tile i's softmax rewrites P's registers. Its int32
    // product joins O (relative to reference i - 1) while S_i runs, so only O, S and P are live
    // through the softmax.
    for (int i = 1; i < n; ++i) {
      act = tile_activity<T::kTileQ>(p, t, t.tile_begin + i);
      turns.wait_turn();
      issue_pv<true>(mmas, views, bar, read_v, prob, oi);
      issue_scores(mmas, views, qs, bar, read_k, s);
      turns.pass_turn();
      warpgroup_wait<1>();  // O_{i-1} done (committed first), S_i in flight
      accumulate(o, oi, unit);
      pv_done<T>(release, bar, read_v, prob, oi);
      load_k_scales(k_scale_stage<T>(ks_smem, read_k), views.lane_col, ks);
      warpgroup_wait<0>();
      scores(i);
      rescale(o, alpha);
    }
    turns.wait_turn();
    issue_pv<true>(mmas, views, bar, read_v, prob, oi);
    turns.pass_turn();
    warpgroup_wait<0>();
    accumulate(o, oi, unit);
    pv_done<T>(release, bar, read_v, prob, oi);
  });
}

// The consumers with a 16-bit P V (T::kPv16), in the 16-bit kernels' order (hopper::consume_task):
// per KV tile i, issue S = Q8 K8_i^T (int32) and O += P_{i-1} V_{i-1} (fp32); wait S; release
// K_i; softmax into fp32 P_i; wait O; O *= alpha_i; P_i to 16 bits.
template <class T, class SmemQ, class SmemK, class SmemVt>
__device__ void consumer_loop_p16(const TesseraQuantizedParams& qp, SmemQ& sQ, SmemK& sK, SmemVt& sVt,
                                  uint32_t ks_smem, PipelineBarriers<T::kStages, T::kQStages>& bar) {
  using Output = typename T::Output;
  const TesseraAttnParams& p = qp.attn;
  const int ctid = threadIdx.x - T::kProducerThreads;
  const LaneRelease release;
  hopper::TiledMmas<T> mmas;
  const auto views = consumer_views<T>(mmas, ctid, sQ, sK, sVt);

  Tensor s = partition_fragment_C(mmas.qk, Shape<Int<T::kTileQ>, Int<T::kTileKV>>{});  // int32
  Tensor sf = make_tensor<float>(s.layout());                                          // the tile's P, fp32
  Tensor o = partition_fragment_C(mmas.pv, Shape<Int<T::kTileQ>, Int<T::kHeadDim>>{});  // fp32
  // P in the register layout of the 16-bit A operand: ((2, 2, 2), 1, N / 16), the same value order as S.
  Tensor prob = make_tensor<Output>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<T::kTileKV / 16>>>{});
  static_assert(decltype(size(prob))::value == decltype(size(s))::value, "a P value per score value");
  constexpr int kChunks = T::kTileKV / TESSERA_QUANTIZED_K_CHUNK;  // K scales per tile

  PipeState<T::kStages> read_k, read_v;
  PipeState<T::kQStages> read_q;
  const PingPong<T> turns{ctid / 128};
  turns.start();

  for_each_task<T>(qp, views, o, bar, read_q, [&](const Task& t, int n, int qs, const float (&rf)[2],
                                                  float (&row_max)[2], float (&row_sum)[2]) {
    float alpha[2];
    TileActivity act = tile_activity<T::kTileQ>(p, t, t.tile_begin);
    float kc[kChunks];
    auto scores = [&](int i) {  // S_i landed: release K (its scales are in registers), softmax
      warpgroup_fence_operand(s);
      release_k<T>(bar, read_k);
      if (i == n - 1) release(&bar.q_empty[qs]);
      softmax_to_p16<T>(p, t, t.tile_begin + i, act, s, kc, views.lane_col, views.row_of_half, rf, row_max, row_sum, alpha,
                        sf);
    };
    auto to_prob = [&]() {
      CUTE_UNROLL
      for (int e = 0; e < size(sf); ++e) prob(e) = static_cast<Output>(sf(e));
    };

    turns.wait_turn();
    issue_scores(mmas, views, qs, bar, read_k, s);
    turns.pass_turn();
    load_chunk_scales(k_scale_stage<T>(ks_smem, read_k), kc);
    warpgroup_wait<0>();
    scores(0);
    to_prob();
    for (int i = 1; i < n; ++i) {
      act = tile_activity<T::kTileQ>(p, t, t.tile_begin + i);
      turns.wait_turn();
      issue_scores(mmas, views, qs, bar, read_k, s);
      issue_pv<false>(mmas, views, bar, read_v, prob, o);
      turns.pass_turn();
      load_chunk_scales(k_scale_stage<T>(ks_smem, read_k), kc);
      warpgroup_wait<1>();  // S_i done (committed first), O += P_{i-1} V_{i-1} in flight
      scores(i);
      warpgroup_wait<0>();
      pv_done<T>(release, bar, read_v, prob, o);
      rescale(o, alpha);
      to_prob();
    }
    turns.wait_turn();
    issue_pv<false>(mmas, views, bar, read_v, prob, o);
    turns.pass_turn();
    warpgroup_wait<0>();
    pv_done<T>(release, bar, read_v, prob, o);
  });
}

// The barriers as PipelineBarriers::init sets them for a static schedule, but k_empty counts
// consumer threads: each reads its K scales from the stage with generic loads, and an arrival
// releases only the arriving thread's own reads, so every thread arrives after its reads.
template <class T>
__device__ void init_barriers(PipelineBarriers<T::kStages, T::kQStages>& bar) {
  for (int s = 0; s < T::kQStages; ++s) {
    Barrier::init(&bar.q_full[s], 1);
    Barrier::init(&bar.q_empty[s], T::kConsumerWarps);
  }
  for (int s = 0; s < T::kStages; ++s) {
    Barrier::init(&bar.k_full[s], 1);
    Barrier::init(&bar.k_empty[s], T::kConsumerThreads);
    Barrier::init(&bar.v_full[s], 1);
    Barrier::init(&bar.v_empty[s], T::kConsumerWarps);
  }
  cutlass::arch::fence_barrier_init();
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    attention_kernel(const __grid_constant__ TesseraQuantizedParams qp, const __grid_constant__ TmaMaps tma) {
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle is a function of address bits: tiles start on 1024-byte boundaries.
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<int8_t*>(base)), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<int8_t*>(base + T::kSmemKOffset)), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(reinterpret_cast<typename T::VElement*>(base + T::kSmemVOffset)),
                           typename T::SmemLayoutVt{});
  __shared__ PipelineBarriers<T::kStages, T::kQStages> bar;
  if (threadIdx.x == 0) init_barriers<T>(bar);
  __syncthreads();
  if (threadIdx.x < T::kProducerThreads) {
    if constexpr (T::kReallocRegisters) cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    producer_loop<T>(qp, tma, base, bar);
  } else {
    if constexpr (T::kReallocRegisters) cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    const uint32_t ks_smem = uint32_t(__cvta_generic_to_shared(base + T::kSmemKScaleOffset));
    if constexpr (T::kPv16)
      consumer_loop_p16<T>(qp, sQ, sK, sVt, ks_smem, bar);
    else
      consumer_loop<T>(qp, sQ, sK, sVt, ks_smem, bar);
  }
}

#ifndef __CUDACC_RTC__
// Host: the two TMA descriptors of one launch (0 on success, else a cudaError_t value).
template <class T>
int make_tma_maps(const TesseraQuantizedParams& qp, TmaMaps& d) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return int(cudaErrorNotSupported);
  const TesseraAttnParams& p = qp.attn;
  // [B, H, S, D] int8, S rows per head in the buffer (seq_rows), seq of them read (TMA zero-fills past).
  auto one = [&](CUtensorMap* map, const void* base, int seq, int seq_rows, int rows) {
    const cuuint64_t dims[4] = {cuuint64_t(T::kHeadDim), cuuint64_t(seq), cuuint64_t(p.heads), cuuint64_t(p.batch)};
    const cuuint64_t row = T::kHeadDim;
    const cuuint64_t strides[3] = {row, row * cuuint64_t(seq_rows), row * cuuint64_t(seq_rows) * cuuint64_t(p.heads)};
    const cuuint32_t box[4] = {cuuint32_t(T::kHeadDim), cuuint32_t(rows), 1u, 1u};
    const cuuint32_t unit_strides[4] = {1u, 1u, 1u, 1u};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(base), dims, strides, box, unit_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  const int q_rows = p.q_units != nullptr ? 1 << p.q_unit_log2 : T::kTileQ;
  if (one(&d.q, p.q, p.seq_q, p.seq_q, q_rows) != CUDA_SUCCESS ||
      one(&d.k, p.k, p.seq_kv, qp.seq_kv_padded, 1 << p.kv_unit_log2) != CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);
  if constexpr (T::kPv16) {  // 16-bit V [B, Skv, H, D] with its element strides per (b, s, h), as the 16-bit kernels'
    constexpr cuuint64_t kBytes = 2;
    const CUtensorMapDataType type = std::is_same_v<typename T::Output, cutlass::half_t>
                                         ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const cuuint64_t dims[4] = {cuuint64_t(T::kHeadDim), cuuint64_t(p.seq_kv), cuuint64_t(p.heads), cuuint64_t(p.batch)};
    const cuuint64_t strides[3] = {cuuint64_t(p.v_stride[1]) * kBytes, cuuint64_t(p.v_stride[2]) * kBytes,
                                   cuuint64_t(p.v_stride[0]) * kBytes};
    const cuuint32_t box[4] = {64u, cuuint32_t(1 << p.kv_unit_log2), 1u, 1u};
    const cuuint32_t unit_strides[4] = {1u, 1u, 1u, 1u};
    if (encode(&d.v, type, 4, const_cast<void*>(p.v), dims, strides, box, unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      return int(cudaErrorInvalidValue);  // V's base or strides not 16-byte aligned
  }
  return 0;
}

template <class T>
int launch(const TesseraQuantizedParams& qp, cudaStream_t stream) {
  const int64_t tasks = num_tasks(qp.attn);
  if (tasks == 0) return 0;
  TmaMaps tma;
  const int err = make_tma_maps<T>(qp, tma);
  if (err != 0) return err;
  auto kernel = attention_kernel<T>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (status != cudaSuccess) return int(status);
  const int64_t grid = qp.attn.grid_size > 0 && qp.attn.grid_size < tasks ? qp.attn.grid_size : tasks;
  kernel<<<dim3(unsigned(grid)), dim3(T::kThreads), T::kSmemBytes, stream>>>(qp, tma);
  return int(cudaGetLastError());
}
#endif

}  // namespace tessera::quantized
