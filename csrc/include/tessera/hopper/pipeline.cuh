// Hopper producer side: the mbarrier pipeline between the producer and the consumer warpgroups,
// the TMA descriptors of Q, K and V, and the producer loop.
//
// K and V have separate barriers so a K stage is refilled as soon as its Q K^T is done, while the
// V of the same tile is still being read by P V. Each buffer has a "full" barrier (one producer
// arrival that sets the expected bytes, completed by the TMA transactions) and an "empty" barrier
// (one arrival per consumer warp once its wgmma reads are done).
//
// Tiles are gathered by slot: slot j of a KV tile is kv_unit consecutive tokens starting at
// slot_start[j] (the prepared-plan metadata, tessera_diffusers/prepare.py), one TMA box of
// kv_unit rows x 64 columns per slot and head-dim half, written 128-byte-swizzled where the
// consumers' wgmma descriptors expect it. Rows past Skv are zero-filled by TMA; empty slots load
// rows of token 0; the consumers mask both. One thread issues every copy.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only; descriptors are encoded through the runtime's driver entry point)
#include <cutlass/arch/barrier.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include "tessera/params.h"
#include "tessera/tasks.cuh"

namespace tessera::hopper {

using Barrier = cutlass::arch::ClusterBarrier;
using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

// TMA descriptors of one launch, passed as a __grid_constant__ kernel parameter. Q boxes are
// kTileQ rows (q_unit rows in the grouped query layout), K and V boxes kv_unit rows, O boxes 64
// rows (q_unit rows grouped; all 64 head-dim columns, 128-byte swizzle). `o_store`: O goes out
// through TMA stores (epilogue.cuh's store_output_tma), else from registers.
struct alignas(64) TmaDescriptors {
  CUtensorMap q, k, v, o;
  int o_store;
};

template <int kStages, int kQStages>
struct PipelineBarriers {
  uint64_t q_full[kQStages], q_empty[kQStages];  // one pair per Q buffer; tasks take the buffers in turn
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t v_full[kStages], v_empty[kStages];
  // Dynamic task scheduling (p.task_counter): the task whose Q the current phase of q_full[i]
  // carries, decoded by the producer (b = -1 when the CTA has no task left). Written by the
  // producer before it arrives on q_full[i] (release), read by every consumer thread after its
  // wait on it (acquire), rewritten only once q_empty[i] has completed, which then counts every
  // consumer thread (each arrives after its own read).
  Task task[kQStages];

  // `q_releases`: arrivals that complete q_empty (consumer warps, or threads when scheduling is dynamic).
  __device__ void init(int producer_arrivals, int consumer_warps, int q_releases) {
    for (int s = 0; s < kQStages; ++s) {
      Barrier::init(&q_full[s], producer_arrivals);
      Barrier::init(&q_empty[s], q_releases);
    }
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&k_full[s], producer_arrivals);
      Barrier::init(&k_empty[s], consumer_warps);
      Barrier::init(&v_full[s], producer_arrivals);
      Barrier::init(&v_empty[s], consumer_warps);
    }
    cutlass::arch::fence_barrier_init();
  }
};

// The task the producer handed over in `slot` (PipelineBarriers::task), read once the q_full
// phase that carries it has completed.
__device__ __forceinline__ Task handed_task(const Task& slot) {
  const volatile Task& v = slot;
  Task t;
  t.b = v.b;
  t.h = v.h;
  t.q_tile = v.q_tile;
  t.split = v.split;
  t.tile_begin = v.tile_begin;
  t.tile_end = v.tile_end;
  t.meta_row = v.meta_row;
  return t;
}

// Position in a ring of kStages buffers: the stage and the parity of its current phase.
template <int kStages>
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// A consumer warp is done with a buffer (lane 0 arrives for the warp; the barrier counts warps).
__device__ __forceinline__ void release(uint64_t* bar) {
  if ((threadIdx.x & 31) == 0) Barrier::arrive(bar);
}

// The consumers are done with a Q buffer: in a dynamically scheduled grid every consumer thread
// arrives (each has read the handed task, PipelineBarriers::task), else one lane per warp.
template <bool kDynamic>
__device__ __forceinline__ void release_q(uint64_t* q_empty) {
  if constexpr (kDynamic)
    Barrier::arrive(q_empty);
  else
    release(q_empty);
}

// TMA loads of one KV tile of `map` (K or V) into one stage: per slot, one box per head-dim half.
template <class T>
__device__ __forceinline__ void load_kv_tile(const CUtensorMap* map, uint64_t* bar, typename T::Element* stage,
                                             const int (&start)[T::kMaxSlots], int slots, int unit, const Task& t) {
  constexpr int kHalves = T::kHeadDim / 64;
  TxBarrier::arrive_and_expect_tx(bar, T::kTileKV * T::kHeadDim * int(sizeof(typename T::Element)));
  CUTE_UNROLL
  for (int j = 0; j < T::kMaxSlots; ++j) {
    if (j >= slots) break;
    CUTE_UNROLL
    for (int dh = 0; dh < kHalves; ++dh)
      SM90_TMA_LOAD_4D::copy(map, bar, uint64_t(TMA::CacheHintSm90::EVICT_LAST),
                             stage + dh * T::kTileKV * 64 + j * unit * 64, dh * 64, start[j], t.h, t.b);
  }
}

// The loads of one task with tiles into Q buffer `qs`, once that buffer is free: Q (arming its
// q_full phase), then K and V once per KV tile, each after the consumers have released the stage.
// `taken` (dynamic scheduling): the counter's value for the CTA's next task, taken as the loads of
// the last kTakeAhead tiles are issued, so that the atomic's round trip, the next task's decoding
// and its Q load overlap the consumers' last tiles (the value is read only after this returns).
// -DTESSERA_HOPPER_TAKE_AHEAD=0 takes it after the loads in every kernel (an A/B switch: with one
// Q buffer the early take measured 1-2% slower, benchmarks/results/h200_tma_store_epilogue).
#ifndef TESSERA_HOPPER_TAKE_AHEAD
#define TESSERA_HOPPER_TAKE_AHEAD 2
#endif
constexpr int kTakeAhead = TESSERA_HOPPER_TAKE_AHEAD;
static_assert(kTakeAhead >= 0, "TESSERA_HOPPER_TAKE_AHEAD: tiles before a task's end, 0 for after its loads");

template <class T>
__device__ __forceinline__ void load_task(const TesseraAttnParams& p, const TmaDescriptors& tma, const Task& t, int qs,
                                          typename T::Element* q_smem, typename T::Element* k_smem,
                                          typename T::Element* v_smem, PipelineBarriers<T::kStages, T::kQStages>& bar,
                                          PipeState<T::kStages>& write, int* taken = nullptr) {
  using Element = typename T::Element;
  constexpr int kHalves = T::kHeadDim / 64;
  const int unit = 1 << p.kv_unit_log2;
  uint64_t* q_full = &bar.q_full[qs];
  q_smem += T::q_buffer_offset(qs);
  TxBarrier::arrive_and_expect_tx(q_full, T::kTileQ * T::kHeadDim * int(sizeof(Element)));
  if (p.q_units == nullptr) {
    CUTE_UNROLL
    for (int dh = 0; dh < kHalves; ++dh)
      SM90_TMA_LOAD_4D::copy(&tma.q, q_full, uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                             q_smem + T::q_box_offset(0, dh), dh * 64, t.q_tile * T::kTileQ, t.h, t.b);
  } else {  // grouped layout: one box of q_unit rows per query unit, at the unit's token rows
    const int q_unit = 1 << p.q_unit_log2;
    const int kq = T::kTileQ >> p.q_unit_log2;
    const int32_t* units = p.q_units + t.meta_row * kq;
    for (int a = 0; a < kq; ++a) {
      const int row = max(__ldg(units + a), 0) << p.q_unit_log2;  // no unit: rows of unit 0, never stored
      CUTE_UNROLL
      for (int dh = 0; dh < kHalves; ++dh)
        SM90_TMA_LOAD_4D::copy(&tma.q, q_full, uint64_t(TMA::CacheHintSm90::EVICT_FIRST),
                               q_smem + T::q_box_offset(a * q_unit, dh), dh * 64, row, t.h, t.b);
    }
  }
  const int take_at = max(t.tile_begin, t.tile_end - kTakeAhead);
  for (int tile = t.tile_begin; tile < t.tile_end; ++tile) {
    if (taken != nullptr && tile == take_at) *taken = atomicAdd(p.task_counter, 1);
    const int32_t* slots = tile_slots(p, t, tile);
    int start[T::kMaxSlots];
    CUTE_UNROLL
    for (int j = 0; j < T::kMaxSlots; ++j) start[j] = j < p.slots ? max(__ldg(slots + j), 0) : 0;
    const int64_t stage = int64_t(write.stage) * T::kTileKV * T::kHeadDim;
    Barrier::wait(&bar.k_empty[write.stage], write.phase ^ 1u);
    load_kv_tile<T>(&tma.k, &bar.k_full[write.stage], k_smem + stage, start, p.slots, unit, t);
    Barrier::wait(&bar.v_empty[write.stage], write.phase ^ 1u);
    load_kv_tile<T>(&tma.v, &bar.v_full[write.stage], v_smem + stage, start, p.slots, unit, t);
    write.advance();
  }
}

// The producer: walks the same task sequence as the consumers and fills Q once per task and K, V
// once per KV tile, each after the consumers have released the buffer.
template <class T>
__device__ void producer_loop(const TesseraAttnParams& p, const TmaDescriptors& tma, typename T::Element* q_smem,
                              typename T::Element* k_smem, typename T::Element* v_smem,
                              PipelineBarriers<T::kStages, T::kQStages>& bar) {
  if (threadIdx.x != 0) return;
  cute::prefetch_tma_descriptor(&tma.q);
  cute::prefetch_tma_descriptor(&tma.k);
  cute::prefetch_tma_descriptor(&tma.v);
  PipeState<T::kStages> write;
  PipeState<T::kQStages> write_q;
  const int64_t tasks = num_tasks(p);
  for (int64_t task_id = blockIdx.x; task_id < tasks; task_id += gridDim.x) {
    const Task t = decode_task(p, task_id);
    if (t.tile_end <= t.tile_begin) continue;  // the consumers write the empty-row epilogue alone
    Barrier::wait(&bar.q_empty[write_q.stage], write_q.phase ^ 1u);
    load_task<T>(p, tma, t, write_q.stage, q_smem, k_smem, v_smem, bar, write);
    write_q.advance();
  }
}

// The producer of a dynamically scheduled persistent grid (p.task_counter): CTA b starts with task
// b and takes its next one from the counter while it issues the loads of the current one's last
// tiles (load_task; with one Q buffer, once it has issued them). Every task, with tiles or not, and
// the end (-1) are handed to the consumers through a phase of the next Q buffer's q_full.
template <class T>
__device__ void producer_loop_dynamic(const TesseraAttnParams& p, const TmaDescriptors& tma,
                                      typename T::Element* q_smem, typename T::Element* k_smem,
                                      typename T::Element* v_smem, PipelineBarriers<T::kStages, T::kQStages>& bar) {
  if (threadIdx.x != 0) return;
  cute::prefetch_tma_descriptor(&tma.q);
  cute::prefetch_tma_descriptor(&tma.k);
  cute::prefetch_tma_descriptor(&tma.v);
  PipeState<T::kStages> write;
  PipeState<T::kQStages> write_q;
  const int64_t tasks = num_tasks(p);
  int64_t task_id = blockIdx.x;
  while (true) {
    // Decoded before the wait: its metadata reads overlap the consumers' last tiles.
    const bool done = task_id >= tasks;
    Task t{};
    if (!done) t = decode_task(p, task_id);
    const int qs = write_q.stage;
    Barrier::wait(&bar.q_empty[qs], write_q.phase ^ 1u);
    write_q.advance();
    if (done) {
      bar.task[qs].b = -1;
      Barrier::arrive(&bar.q_full[qs]);
      return;
    }
    bar.task[qs] = t;
    int taken;
    if (t.tile_end > t.tile_begin) {
      // With two Q buffers the next task is taken while the last tiles' loads are issued (its Q then
      // loads at once); with one, after them, as its Q waits for this task's buffer anyway (taking it
      // early measured 1-2% slower there: benchmarks/results/h200_tma_store_epilogue).
      constexpr bool kEarlyTake = T::kQStages == 2 && kTakeAhead > 0;
      load_task<T>(p, tma, t, qs, q_smem, k_smem, v_smem, bar, write, kEarlyTake ? &taken : nullptr);
      if constexpr (!kEarlyTake) taken = atomicAdd(p.task_counter, 1);
    } else {
      Barrier::arrive(&bar.q_full[qs]);  // no Q to load: the consumers only write the empty rows
      taken = atomicAdd(p.task_counter, 1);
    }
    task_id = int64_t(gridDim.x) + taken;
  }
}

#ifndef __CUDACC_RTC__
// Host: encode the three descriptors of one launch (0 on success, else a cudaError_t value).
template <class T>
int make_tma_descriptors(const TesseraAttnParams& p, TmaDescriptors& d) {
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
  constexpr size_t kBytes = sizeof(typename T::Element);
  const CUtensorMapDataType type =
      std::is_same_v<typename T::Element, cutlass::half_t> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  auto one = [&](CUtensorMap* map, const void* base, const int64_t (&stride)[3], int seq, int rows) {
    const cuuint64_t dims[4] = {cuuint64_t(T::kHeadDim), cuuint64_t(seq), cuuint64_t(p.heads), cuuint64_t(p.batch)};
    const cuuint64_t strides[3] = {cuuint64_t(stride[1]) * kBytes, cuuint64_t(stride[2]) * kBytes,
                                   cuuint64_t(stride[0]) * kBytes};
    const cuuint32_t box[4] = {64u, cuuint32_t(rows), 1u, 1u};
    const cuuint32_t unit_strides[4] = {1u, 1u, 1u, 1u};
    return encode(map, type, 4, const_cast<void*>(base), dims, strides, box, unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  const int unit = 1 << p.kv_unit_log2;
  const int q_rows = p.q_units != nullptr ? 1 << p.q_unit_log2 : T::kTileQ;  // grouped: a box per query unit
  if (q_rows % 8 != 0 || q_rows > T::kTileQ) return int(cudaErrorInvalidValue);  // whole 8-row swizzle atoms
  if (one(&d.q, p.q, p.q_stride, p.seq_q, q_rows) != CUDA_SUCCESS ||
      one(&d.k, p.k, p.k_stride, p.seq_kv, unit) != CUDA_SUCCESS ||
      one(&d.v, p.v, p.v_stride, p.seq_kv, unit) != CUDA_SUCCESS)
    return int(cudaErrorInvalidValue);  // strides or base not 16-byte aligned, or a box past the limits
  // O by TMA where the kernel stages it (two Q buffers), the launch has no split-K workspace and the
  // output's layout takes a descriptor (16-byte aligned base and strides); else from registers.
  const int o_rows = p.q_units != nullptr ? q_rows : 64;
  d.o_store = T::kTmaStore && p.num_splits == 1 && o_rows <= 64 &&
              one(&d.o, p.o, p.o_stride, p.seq_q, o_rows) == CUDA_SUCCESS;
  return 0;
}
#endif

}  // namespace tessera::hopper
