// Hopper (sm90a) block-sparse attention forward: wgmma for Q K^T (both operands in shared memory)
// and P V (P from registers), 128-byte-swizzled shared memory, a cp.async multi-stage K/V pipeline
// that gathers the plan's slots, one consumer warpgroup per 64 query rows.
//
// Same metadata, task decoding and semantics as the portable family (tessera/portable/attention.cuh);
// only the math engine and the shared-memory layout differ.
#pragma once
#include <cutlass/arch/barrier.h>
#include <math_constants.h>

#include "tessera/hopper/traits.cuh"
#include "tessera/params.h"
#include "tessera/portable/ptx.cuh"  // cp.async wrappers, fast_exp2
#include "tessera/tasks.cuh"

namespace tessera::hopper {

using portable::cp_async_16;
using portable::cp_async_commit;
using portable::cp_async_wait;
using portable::fast_exp2;
using tessera::decode_task;
using tessera::Task;
template <class T>
using TileMeta = tessera::TileMeta<T::kMaxSlots>;

// One wgmma GEMM over all k blocks of its operands, waited for before returning.
template <bool kZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kRegisterA = !is_base_of<GMMA::DescriptorIterator, typename Mma::FrgTypeA>::value;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
}

template <class T, class SmemQ>
__device__ __forceinline__ void load_q_tile(const TesseraAttnParams& p, const Task& t, SmemQ& sQ) {
  using Element = typename T::Element;
  const Element* q = static_cast<const Element*>(p.q);
  constexpr int kIters = T::kTileQ * T::kChunksPerRow / T::kThreads;
  constexpr int kRowStep = T::kThreads / T::kChunksPerRow;
  const int chunk = threadIdx.x % T::kChunksPerRow, row_in = threadIdx.x / T::kChunksPerRow;
  const Element* base = q + int64_t(t.b) * p.q_stride[0] + int64_t(t.h) * p.q_stride[2] + chunk * T::kChunkElems;
  const int row0 = t.q_tile * T::kTileQ;
  CUTE_UNROLL
  for (int i = 0; i < kIters; ++i) {
    const int row = row_in + i * kRowStep;
    const bool ok = row0 + row < p.seq_q;
    const uint32_t dst = portable::smem_addr(&sQ(row, chunk * T::kChunkElems));
    cp_async_16(dst, base + int64_t(ok ? row0 + row : 0) * p.q_stride[1], ok ? 16 : 0);
  }
}

// Gather one KV tile into stage `st`: row r is token slot_start[r / kv_unit] + r % kv_unit.
template <class T, class SmemKV>
__device__ __forceinline__ void load_kv_tile(const TesseraAttnParams& p, const Task& t, int tile, int st,
                                             SmemKV& sK, SmemKV& sV, TileMeta<T>& meta) {
  using Element = typename T::Element;
  const Element* k = static_cast<const Element*>(p.k);
  const Element* v = static_cast<const Element*>(p.v);
  const int32_t* slots = tessera::tile_slots(p, t, tile);
  const int unit_mask = (1 << p.kv_unit_log2) - 1;
  constexpr int kIters = T::kTileKV * T::kChunksPerRow / T::kThreads;
  constexpr int kRowStep = T::kThreads / T::kChunksPerRow;
  const int chunk = threadIdx.x % T::kChunksPerRow, row_in = threadIdx.x / T::kChunksPerRow;
  const Element* k_base = k + int64_t(t.b) * p.k_stride[0] + int64_t(t.h) * p.k_stride[2] + chunk * T::kChunkElems;
  const Element* v_base = v + int64_t(t.b) * p.v_stride[0] + int64_t(t.h) * p.v_stride[2] + chunk * T::kChunkElems;
  CUTE_UNROLL
  for (int i = 0; i < kIters; ++i) {
    const int row = row_in + i * kRowStep;
    const int start = __ldg(slots + (row >> p.kv_unit_log2));
    const int token = start + (row & unit_mask);
    const bool ok = start >= 0 && token < p.seq_kv;
    const int64_t tok = ok ? token : 0;
    cp_async_16(portable::smem_addr(&sK(row, chunk * T::kChunkElems, st)), k_base + tok * p.k_stride[1], ok ? 16 : 0);
    cp_async_16(portable::smem_addr(&sV(row, chunk * T::kChunkElems, st)), v_base + tok * p.v_stride[1], ok ? 16 : 0);
  }
  tessera::read_tile_meta<T::kTileQ>(p, t, tile, meta);
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) attention_kernel(const __grid_constant__ TesseraAttnParams p) {
  using Element = typename T::Element;
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle is a function of address bits: tiles start on 1024-byte boundaries.
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  Element* q_ptr = reinterpret_cast<Element*>(base);
  Element* k_ptr = reinterpret_cast<Element*>(base + T::kSmemQBytes);
  Element* v_ptr = reinterpret_cast<Element*>(base + T::kSmemQBytes + T::kSmemKVBytes);
  __shared__ TileMeta<T> meta[T::kStages];

  Tensor sQ = make_tensor(make_smem_ptr(q_ptr), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(k_ptr), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(v_ptr), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(v_ptr), typename T::SmemLayoutVt{});

  typename T::MmaQK mma_qk;
  typename T::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(threadIdx.x);
  auto thr_pv = mma_pv.get_thread_slice(threadIdx.x);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // descriptors (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // descriptors (MMA, MMA_N, MMA_K, STAGES)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // descriptors (MMA, MMA_N, MMA_K, STAGES)
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<T::kTileQ>, Int<T::kTileKV>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<T::kTileQ>, Int<T::kHeadDim>>{}));

  // Accumulator value order is (column pair, row half, n8 block): element i sits on row half
  // (i >> 1) & 1 of this thread, and the 4 lanes of a quad share each row.
  constexpr int kSVals = T::kTileKV / 2;
  constexpr int kOVals = T::kHeadDim / 2;
  const int row_of_half[2] = {int(get<0>(tScS(0))), int(get<0>(tScS(2)))};

  const int64_t tasks = tessera::num_tasks(p);
  for (int64_t task_id = blockIdx.x; task_id < tasks; task_id += gridDim.x) {
    const Task t = decode_task(p, task_id);
    const int n_tiles = t.tile_end - t.tile_begin;

    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<T::kTileQ>, Int<T::kHeadDim>>{});
    static_assert(decltype(size(tOrO))::value == kOVals, "output accumulator: D / 2 values per thread");
    clear(tOrO);
    float row_max[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float row_sum[2] = {0.f, 0.f};

    if (n_tiles > 0) {
      load_q_tile<T>(p, t, sQ);
      cp_async_commit();
      CUTE_UNROLL
      for (int st = 0; st < T::kStages - 1; ++st) {
        if (st < n_tiles) load_kv_tile<T>(p, t, t.tile_begin + st, st, sK, sV, meta[st]);
        cp_async_commit();
      }
      for (int i = 0; i < n_tiles; ++i) {
        const int ahead = i + T::kStages - 1;
        if (ahead < n_tiles) load_kv_tile<T>(p, t, t.tile_begin + ahead, ahead % T::kStages, sK, sV, meta[ahead % T::kStages]);
        cp_async_commit();
        cp_async_wait<T::kStages - 1>();
        cutlass::arch::fence_view_async_shared();  // cp.async writes -> wgmma (async proxy) reads
        __syncthreads();
        const int st = i % T::kStages;

        Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<T::kTileQ>, Int<T::kTileKV>>{});
        static_assert(decltype(size(tSrS))::value == kSVals, "score accumulator: N / 2 values per thread");
        wgmma_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, st), tSrS);

        const TileMeta<T>& m = meta[st];
        if (m.needs_mask) {
          const unsigned slot_bits = (1u << p.slots) - 1u;
          unsigned row_bits[2];
          CUTE_UNROLL
          for (int half = 0; half < 2; ++half)
            row_bits[half] = unsigned(m.member >> ((row_of_half[half] >> p.q_unit_log2) * p.slots)) & slot_bits;
          const int unit_mask = (1 << p.kv_unit_log2) - 1;
          CUTE_UNROLL
          for (int e = 0; e < kSVals; ++e) {
            const int col = int(get<1>(tScS(e)));
            const int slot = col >> p.kv_unit_log2;
            bool ok = (row_bits[(e >> 1) & 1] >> slot) & 1u;
            if (m.partial) ok = ok && m.slot_start[slot] + (col & unit_mask) < p.seq_kv;
            if (!ok) tSrS(e) = -CUDART_INF_F;
          }
        }

        // Online softmax per row half; rescale the output accumulator.
        float alpha[2];
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
          float tile_max = -CUDART_INF_F;
          CUTE_UNROLL
          for (int e = 2 * half; e < kSVals; e += 4) tile_max = fmaxf(tile_max, fmaxf(tSrS(e), tSrS(e + 1)));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
          const float new_max = fmaxf(row_max[half], tile_max * p.scale_log2);
          const float ref = new_max == -CUDART_INF_F ? 0.f : new_max;  // empty so far: exp2 gives 0, not NaN
          alpha[half] = fast_exp2(row_max[half] - ref);
          row_max[half] = new_max;
          float sum = 0.f;
          CUTE_UNROLL
          for (int e = 2 * half; e < kSVals; e += 4) {
            tSrS(e) = fast_exp2(fmaf(tSrS(e), p.scale_log2, -ref));
            tSrS(e + 1) = fast_exp2(fmaf(tSrS(e + 1), p.scale_log2, -ref));
            sum += tSrS(e) + tSrS(e + 1);
          }
          row_sum[half] = row_sum[half] * alpha[half] + sum;
        }
        CUTE_UNROLL
        for (int e = 0; e < kOVals; ++e) tOrO(e) *= alpha[(e >> 1) & 1];

        // P in the register layout of the A operand: ((2, 2, 2), 1, N / 16), the same value order.
        Tensor tOrP = make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<T::kTileKV / 16>>>{});
        CUTE_UNROLL
        for (int e = 0; e < kSVals; ++e) tOrP(e) = static_cast<Element>(tSrS(e));
        wgmma_gemm<false>(mma_pv, tOrP, tOrV(_, _, _, st), tOrO);
        __syncthreads();  // every warpgroup is done with stage st before it is refilled
      }
    }

    // Epilogue: normalize, store O (or the split-K partial) and the log-sum-exp.
    const int lane = threadIdx.x & 31;
    float inv[2], lse[2];
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const bool has_key = sum > 0.f;
      inv[half] = has_key ? 1.f / sum : 0.f;
      lse[half] = tessera::row_lse(row_max[half], sum);
    }
    const bool split = p.num_splits > 1;
    CUTE_UNROLL
    for (int e = 0; e < kOVals; e += 2) {
      const int half = (e >> 1) & 1;
      const int row = t.q_tile * T::kTileQ + int(get<0>(tOcO(e)));
      const int col = int(get<1>(tOcO(e)));
      if (row >= p.seq_q) continue;
      const int64_t bh_row = (int64_t(t.b) * p.heads + t.h) * p.seq_q + row;
      const float v0 = tOrO(e) * inv[half], v1 = tOrO(e + 1) * inv[half];
      if (split) {
        const int64_t part = int64_t(t.split) * p.batch * p.heads * p.seq_q + bh_row;
        *reinterpret_cast<float2*>(p.o_partial + part * T::kHeadDim + col) = make_float2(v0, v1);
      } else {
        Element* o = static_cast<Element*>(p.o) + int64_t(t.b) * p.o_stride[0] + int64_t(row) * p.o_stride[1] +
                     int64_t(t.h) * p.o_stride[2] + col;
        o[0] = static_cast<Element>(v0);
        o[1] = static_cast<Element>(v1);
      }
    }
    if ((lane & 3) == 0) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int row = t.q_tile * T::kTileQ + row_of_half[half];
        if (row >= p.seq_q) continue;
        const int64_t bh_row = (int64_t(t.b) * p.heads + t.h) * p.seq_q + row;
        if (split)
          p.lse_partial[int64_t(t.split) * p.batch * p.heads * p.seq_q + bh_row] = lse[half];
        else if (p.lse != nullptr)
          p.lse[bh_row] = lse[half];
      }
    }
  }
}

}  // namespace tessera::hopper
