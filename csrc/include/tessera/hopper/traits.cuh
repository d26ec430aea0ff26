// Compile-time shape of one Hopper (sm90a) kernel variant: tiles, warpgroup roles and register
// budgets, wgmma tiled MMAs and the 128-byte-swizzled shared-memory layouts they read. Every shape
// assumption is checked here.
#pragma once
#include <cute/arch/copy_sm80.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace tessera::hopper {

using namespace cute;

template <int kTileQ_, int kTileKV_, int kHeadDim_, int kStages_, typename Element_>
struct Traits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kTileQ = kTileQ_;
  static constexpr int kTileKV = kTileKV_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStages = kStages_;
  static constexpr int kWarpgroups = kTileQ / 64;  // consumer warpgroups: one per 64 query rows (wgmma M = 64)
  static constexpr int kProducerThreads = 128;     // warpgroup 0: one thread issues the TMA copies
  static constexpr int kConsumerThreads = kWarpgroups * 128;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  // Two consumer warpgroups take turns issuing their GEMMs (named barriers, mainloop.cuh), so one
  // warpgroup's softmax runs while the other's GEMMs occupy the tensor cores (docs/design.md).
  static constexpr bool kPingPong = kWarpgroups == 2;

  static constexpr int kSmemQTileBytes = kTileQ * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemKVBytes = kTileKV * kHeadDim * kStages * int(sizeof(Element));
  static constexpr int smem_bytes(int q_stages) { return q_stages * kSmemQTileBytes + 2 * kSmemKVBytes + 1024; }  // + alignment slack
  // A 64 x 64 tile has one consumer warpgroup and, with a 2-stage ring, needs 81 KB at D = 128 (97
  // KB with two Q buffers), so two CTAs share an SM and each one's softmax overlaps the other's
  // GEMMs (the role the second consumer warpgroup of a 128-row tile plays). The SM's 228 KB also
  // hold 1 KB reserved per CTA and the static barriers: 2 KB of margin per CTA covers both.
  static constexpr int kCtasPerSm = kTileQ == 64 && kTileKV == 64 && 2 * (smem_bytes(1) + 2048) <= 228 * 1024 ? 2 : 1;
  // Q buffers: two where they fit beside the KV ring at the same CTAs per SM, so the producer
  // loads the next task's Q while the consumers still work on the current one (a persistent grid
  // then starts each task without waiting for its Q); one otherwise (e.g. 128 x 128 with 3
  // stages).
  static constexpr bool fits(int bytes) {
    return kCtasPerSm == 2 ? 2 * (bytes + 2048) <= 228 * 1024 : bytes + 2048 <= 228 * 1024;
  }
  static constexpr int kQStages = fits(smem_bytes(2)) ? 2 : 1;
  static constexpr int kSmemQBytes = kQStages * kSmemQTileBytes;
  // Element offset of Q buffer `qs` in the Q region: the producer loads a task's Q there and the
  // TMA-store epilogue stages its O there.
  CUTE_HOST_DEVICE static constexpr int q_buffer_offset(int qs) { return qs * kTileQ * kHeadDim; }
  // Element offset, within one Q buffer, of the TMA box of head-dim half `half` (64 columns) that
  // starts at tile row `row`: each half is a kTileQ x 64 slab of 128-byte-swizzled rows.
  CUTE_HOST_DEVICE static constexpr int q_box_offset(int row, int half) { return half * kTileQ * 64 + row * 64; }
  // With two Q buffers the epilogue can stage O in the finished task's one and store it with TMA
  // (epilogue.cuh).
  static constexpr bool kTmaStore = kQStages == 2;
  static constexpr int kSmemBytes = smem_bytes(kQStages);

  // Register budgets after setmaxnreg. 384 threads at one CTA per SM launch with 168 registers each
  // (65536 / 384, rounded down to 8): 128 x 40 + 256 x 232 = 384 x 168. 256 threads at two CTAs
  // per SM launch with 128: 128 x 40 + 128 x 216 = 256 x 128. One consumer warpgroup alone on an
  // SM already has up to 255 per thread and nothing is moved.
  static constexpr bool kReallocRegisters = kWarpgroups == 2 || kCtasPerSm == 2;
  static constexpr int kLaunchRegisters = (65536 / (kThreads * kCtasPerSm)) / 8 * 8;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = kWarpgroups == 2 ? 232 : 216;
  static constexpr int kMaxSlots = kTileKV / 16;  // a slot is at least 16 tokens
  // store_output pairs O elements only where the output's alignment allows (epilogue.cuh).
  static constexpr bool kPairedOStores = false;

  // Q K^T with Q in registers: each consumer thread loads its share of the task's Q from shared
  // memory once (ldmatrix) and every Q K^T reads only K there (rs wgmma). With Q in shared memory
  // (ss wgmma), a 64-column K tile makes each m64n64k16 read as many A bytes (Q) as B bytes (K),
  // which with the TMA writes of K and V asks more of the SM's shared memory bandwidth than one
  // tile's tensor work covers: Q sits in registers where the KV tile has 64 columns. The
  // 128-column kernels, where it gains nothing consistent, keep Q in shared memory.
  static constexpr bool kQInRegisters = kTileKV == 64;
  // Lazy softmax references (mainloop.cuh, online_softmax): a row's reference maximum moves only
  // when a tile's scores exceed it by more than kRescaleThreshold powers of two. Otherwise the
  // stale reference stays, the row's probabilities reach at most 2^kRescaleThreshold (256: bf16
  // and fp16 round them with the same relative error as values below 1, and fp32 sums stay far
  // from overflow), its alpha is exactly 1, and a warp whose rows all keep theirs skips rescaling
  // its output accumulator. The log-sum-exp is the reference plus the log of the sum, whatever
  // the reference. Only the 64-column kernels do it; in the 128-column ones, where it does not
  // pay, the reference moves on every increase.
  static constexpr float kRescaleThreshold = 8.0f;
  static constexpr bool kLazyRescale = kTileKV == 64;
  // S = Q K^T: B (K) from shared memory, A (Q) from shared memory or registers, both K-major (head
  // dim contiguous).
  using MmaQKShape = Shape<Int<64>, Int<kTileKV>, Int<kHeadDim>>;
  using MmaQK = decltype(make_tiled_mma(
      conditional_t<kQInRegisters, decltype(GMMA::rs_op_selector<Element, Element, float, MmaQKShape>()),
                    decltype(GMMA::ss_op_selector<Element, Element, float, MmaQKShape>())>{},
      Layout<Shape<Int<kWarpgroups>, _1, _1>>{}));
  // O += P V: A (P) from registers, B (V) from shared memory with the head dim contiguous (MN-major).
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<Int<64>, Int<kHeadDim>, Int<kTileKV>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<Int<kWarpgroups>, _1, _1>>{}));

  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;  // 8 rows x 64 elements, 128B swizzle
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kTileQ>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kTileKV>, Int<kHeadDim>, Int<kStages>>{}));
  // V seen as (head dim, key, stage) for the PV product: the same bytes, transposed coordinates.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kTileKV>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  static_assert(kTileQ % 64 == 0 && kWarpgroups <= 2, "64 or 128 query rows (one or two consumer warpgroups)");
  static_assert(kTileKV == 64 || kTileKV == 128, "KV tile 64 or 128");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(kStages >= 2 && kStages <= 4, "pipeline depth 2-4");
  static_assert(kTileQ <= 256 && kTileKV <= 256, "one TMA box spans at most 256 rows");
  static_assert(!kReallocRegisters || kProducerRegisters * kProducerThreads + kConsumerRegisters * kConsumerThreads <=
                                          kLaunchRegisters * kThreads,
                "register budgets fit the registers the CTA launches with");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA fits an H100/H200 SM");
  static_assert(size(typename MmaQK::AtomLayoutC_TV{}) > 0, "wgmma atom selected");
};

}  // namespace tessera::hopper
