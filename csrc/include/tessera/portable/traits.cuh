// Compile-time shape of one portable kernel variant: every constant the kernel uses, checked once.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tessera::portable {

template <int kTileQ_, int kTileKV_, int kHeadDim_, int kWarps_, int kStages_, typename Element_>
struct Traits {
  using Element = Element_;
  static constexpr int kTileQ = kTileQ_;      // query rows per CTA
  static constexpr int kTileKV = kTileKV_;    // key columns per KV tile
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;    // K/V shared-memory stages in flight
  static constexpr int kThreads = kWarps * 32;

  static constexpr int kWarpRows = kTileQ / kWarps;  // query rows owned by one warp
  static constexpr int kMTiles = kWarpRows / 16;     // m16 tiles per warp
  static constexpr int kNTilesS = kTileKV / 8;       // n8 tiles of the score tile
  static constexpr int kKStepsS = kHeadDim / 16;     // k16 steps of Q K^T
  static constexpr int kNTilesO = kHeadDim / 8;      // n8 tiles of the output
  static constexpr int kKStepsO = kTileKV / 16;      // k16 steps of P V

  static constexpr int kChunkElems = 16 / sizeof(Element);      // elements per 16-byte chunk
  static constexpr int kChunksPerRow = kHeadDim / kChunkElems;  // 16-byte chunks per smem row
  static constexpr int kMaxSlots = kTileKV / 16;                // a slot is at least 16 tokens
  static constexpr bool kPairedOStores = true;  // store_tile writes two O elements per 32-bit store

  static constexpr int kSmemQElems = kTileQ * kHeadDim;
  static constexpr int kSmemKVElems = kTileKV * kHeadDim;
  static constexpr int kSmemBytes = (kSmemQElems + 2 * kStages * kSmemKVElems) * int(sizeof(Element));

  static_assert(sizeof(Element) == 2, "16-bit elements only");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(kTileQ % (16 * kWarps) == 0, "each warp owns whole m16 tiles");
  static_assert(kMTiles == 1 || kMTiles == 2, "16 or 32 query rows per warp");
  static_assert(kTileKV % 16 == 0 && kTileKV <= 128, "KV tile: multiple of 16, at most 128");
  static_assert(kNTilesS % 2 == 0 && kNTilesO % 2 == 0, "ldmatrix.x4 covers two n8 tiles");
  static_assert(kChunksPerRow % 8 == 0, "the xor swizzle permutes groups of 8 chunks");
  static_assert(kStages >= 2 && kStages <= 4, "pipeline depth 2-4");
  static_assert((kTileQ * kChunksPerRow) % kThreads == 0, "Q tile loads split evenly over threads");
  static_assert((kTileKV * kChunksPerRow) % kThreads == 0, "K/V tile loads split evenly over threads");
  static_assert((kThreads / kChunksPerRow) % 8 == 0, "each loader thread keeps one swizzle phase");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one CTA fits an H100/H200 SM");
};

// Offset (in elements) of 16-byte chunk `chunk` of row `row` in a swizzled [rows][kHeadDim] tile:
// the xor with (row % 8) puts the 8 rows an ldmatrix phase reads in 8 different bank groups.
template <class T>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return (row * T::kChunksPerRow + (chunk ^ (row & 7))) * T::kChunkElems;
}

}  // namespace tessera::portable
