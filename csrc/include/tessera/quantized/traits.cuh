// Compile-time shape of one 8-bit Hopper (sm90a) kernel variant: Q K^T as int8 x int8 -> int32
// wgmma, and P V either as uint8 x uint8 -> int32 (V offset by 128, both operands K-major) or, with
// kPv16, in the output's 16-bit type with fp32 accumulation (V as given, MN-major, as the 16-bit
// kernels read it); the warpgroup roles, ping-pong and register budgets of the 16-bit kernels
// (tessera/hopper/traits.cuh). Every shape assumption is checked here.
#pragma once
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "tessera/quantized/params.h"

namespace tessera::quantized {

using namespace cute;

template <int kTileQ_, int kTileKV_, int kHeadDim_, int kStages_, typename Output_, bool kPv16_ = false>
struct Traits {
  using Output = Output_;  // O's type: cutlass::bfloat16_t or cutlass::half_t
  static constexpr bool kPv16 = kPv16_;  // P V in Output's type (V unquantized), else in 8 bits
  using VElement = conditional_t<kPv16, Output, uint8_t>;
  static constexpr int kTileQ = kTileQ_;
  static constexpr int kTileKV = kTileKV_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStages = kStages_;
  static constexpr int kWarpgroups = kTileQ / 64;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = kWarpgroups * 128;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr bool kPingPong = kWarpgroups == 2;
  static constexpr int kMaxSlots = kTileKV / 16;
  // A 64 x 64 tile has one consumer warpgroup: two CTAs share an SM, so each one's softmax overlaps
  // the other's GEMMs (as the 16-bit 64 x 64 kernels, tessera/hopper/traits.cuh).
  static constexpr int kCtasPerSm = kTileQ == 64 && kTileKV == 64 ? 2 : 1;

  // Shared memory: Q buffers, then the K ring, the V ring, the K scales.
  static constexpr int kSmemQTileBytes = kTileQ * kHeadDim;
  static constexpr int kSmemKTileBytes = kTileKV * kHeadDim;
  static constexpr int kSmemVTileBytes = kTileKV * kHeadDim * int(sizeof(VElement));
  static constexpr int kSmemKScaleBytes = kTileKV * int(sizeof(float));
  static constexpr int smem_bytes(int q_stages) {
    return q_stages * kSmemQTileBytes + kStages * (kSmemKTileBytes + kSmemVTileBytes + kSmemKScaleBytes) + 1024;
  }
  // Each CTA's shared memory with 2 KB of margin (the SM's 1 KB reserved per CTA, the barriers).
  static constexpr bool fits(int bytes) { return kCtasPerSm * (bytes + 2048) <= 228 * 1024; }
  static constexpr int kQStages = fits(smem_bytes(2)) ? 2 : 1;
  static constexpr int kSmemQBytes = kQStages * kSmemQTileBytes;
  static constexpr int kSmemBytes = smem_bytes(kQStages);
  static constexpr int kSmemKOffset = kSmemQBytes;
  static constexpr int kSmemVOffset = kSmemKOffset + kStages * kSmemKTileBytes;
  static constexpr int kSmemKScaleOffset = kSmemVOffset + kStages * kSmemVTileBytes;

  static constexpr bool kReallocRegisters = kWarpgroups == 2 || kCtasPerSm == 2;
  static constexpr int kLaunchRegisters = (65536 / (kThreads * kCtasPerSm)) / 8 * 8;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = kWarpgroups == 2 ? 232 : 216;
  static constexpr float kRescaleThreshold = 8.0f;  // lazy softmax reference (attention.cuh)

  // int32 values the scores and a tile's P V product reach: a score converts to fp32 exactly
  // (|s| < 2^22), a product (u8 x u8, never negative) stays below 2^23, where its bits read as an
  // fp32 denormal are exactly the product times 2^-149 (attention.cuh).
  static constexpr int64_t kMaxScore = int64_t(kHeadDim) * 127 * 127;
  static constexpr int64_t kMaxProduct = int64_t(kTileKV) * 255 * 255;

  using MmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<int8_t, int8_t, int32_t, Shape<Int<64>, Int<kTileKV>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kWarpgroups>, _1, _1>>{}));
  using MmaPVShape = Shape<Int<64>, Int<kHeadDim>, Int<kTileKV>>;
  using MmaPV = decltype(make_tiled_mma(
      conditional_t<kPv16,
                    decltype(GMMA::rs_op_selector<Output, Output, float, MmaPVShape, GMMA::Major::K, GMMA::Major::MN>()),
                    decltype(GMMA::rs_op_selector<uint8_t, uint8_t, int32_t, MmaPVShape, GMMA::Major::K,
                                                  GMMA::Major::K>())>{},
      Layout<Shape<Int<kWarpgroups>, _1, _1>>{}));

  // Q and K: rows of kHeadDim bytes, 128-byte swizzled as TMA writes them.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<int8_t>{},
                                             Shape<Int<kTileQ>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<int8_t>{},
                                             Shape<Int<kTileKV>, Int<kHeadDim>, Int<kStages>>{}));
  // 8-bit V^T (head dim, key): per 16-key chunk, kHeadDim rows of 16 bytes (8 x 16-byte core
  // matrices), chunks 2 KB apart: the chunk layout of v8, so a slot's chunks arrive in one bulk copy.
  // 16-bit V (kPv16): (key, head dim) tiles as the 16-bit kernels' TMA writes them (64-column
  // halves, 128-byte swizzled), seen transposed.
  using SmemLayoutV16 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Output>{},
                                               Shape<Int<kTileKV>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutVt = conditional_t<
      kPv16,
      decltype(composition(SmemLayoutV16{},
                           make_ordered_layout(Shape<Int<kHeadDim>, Int<kTileKV>, Int<kStages>>{}, Step<_2, _1, _3>{}))),
      decltype(tile_to_shape(GMMA::Layout_K_INTER_Atom<uint8_t>{}, Shape<Int<kHeadDim>, Int<kTileKV>, Int<kStages>>{}))>;
  // What hopper::load_kv_tile reads of a 16-bit V tile (kPv16).
  struct VTile {
    using Element = Output;
    static constexpr int kTileKV = kTileKV_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kMaxSlots = kTileKV_ / 16;
  };

  static_assert(kTileQ == 64 || kTileQ == 128, "64 or 128 query rows (one or two consumer warpgroups)");
  static_assert(kTileKV == 64 || kTileKV == 128, "KV tile 64 or 128");
  static_assert(kHeadDim == TESSERA_QUANTIZED_HEAD_DIM, "rows of Q and K are one 128-byte swizzle span");
  static_assert(kStages >= 2 && kStages <= 4, "pipeline depth 2-4");
  static_assert(kMaxScore < (1 << 22) && (kPv16 || kMaxProduct < (1 << 23)),
                "int32 results convert exactly (attention.cuh)");
  static_assert(!kReallocRegisters || kProducerRegisters * kProducerThreads + kConsumerRegisters * kConsumerThreads <=
                                          kLaunchRegisters * kThreads,
                "register budgets fit the registers the CTA launches with");
  static_assert(fits(kSmemBytes), "shared memory of kCtasPerSm CTAs fits an H100/H200 SM");
  static_assert(kSmemKOffset % 1024 == 0 && kSmemVOffset % 1024 == 0 && kSmemKScaleOffset % 16 == 0,
                "swizzled tiles on 1024-byte boundaries, bulk copies on 16-byte ones");
};

}  // namespace tessera::quantized
