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
// through TMA stores (epilogue.cuh's store_output_tma), else from registers. The alignment TMA
// needs comes from CUtensorMap itself (cuda.h declares it aligned).
struct TmaDescriptors {
  CUtensorMap q, k, v, o;
  int o_store;
};
static_assert(alignof(TmaDescriptors) >= 64, "a TMA descriptor in kernel parameters is 64-byte aligned");

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
  // Dynamic scheduling: the taker thread announces each slot's task on task_ready (one arrival), and
  // the loader thread lets it take the next one on take_go (one arrival), producer_loop_dynamic.
  uint64_t task_ready[kQStages];
  uint64_t take_go;

  // `q_releases`: arrivals that complete q_empty (consumer warps, or threads when scheduling is dynamic).
  __device__ void init(int producer_arrivals, int consumer_warps, int q_releases) {
    for (int s = 0; s < kQStages; ++s) {
      Barrier::init(&q_full[s], producer_arrivals);
      Barrier::init(&q_empty[s], q_releases);
      Barrier::init(&task_ready[s], 1);
    }
    Barrier::init(&take_go, 1);
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

// Q of task t into buffer `qs` (arming its q_full phase with the bytes expected), once the buffer is free.
template <class T>
__device__ __forceinline__ void load_q(const TesseraAttnParams& p, const TmaDescriptors& tma, const Task& t,
                                       typename T::Element* q_smem, uint64_t* q_full) {
  constexpr int kHalves = T::kHeadDim / 64;
  TxBarrier::arrive_and_expect_tx(q_full, T::kTileQ * T::kHeadDim * int(sizeof(typename T::Element)));
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
}

// K and V once per KV tile of task t, each after the consumers have released the stage.
// `before_tile(tile)` runs before each tile's loads are issued (the dynamic producer's hand-over
// of the next task, producer_loop_dynamic).
template <class T, class BeforeTile>
__device__ __forceinline__ void load_tiles(const TesseraAttnParams& p, const TmaDescriptors& tma, const Task& t,
                                           typename T::Element* k_smem, typename T::Element* v_smem,
                                           PipelineBarriers<T::kStages, T::kQStages>& bar,
                                           PipeState<T::kStages>& write, const BeforeTile& before_tile) {
  const int unit = 1 << p.kv_unit_log2;
  for (int tile = t.tile_begin; tile < t.tile_end; ++tile) {
    before_tile(tile);
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
    load_q<T>(p, tma, t, q_smem + T::q_buffer_offset(write_q.stage), &bar.q_full[write_q.stage]);
    write_q.advance();
    load_tiles<T>(p, tma, t, k_smem, v_smem, bar, write, [](int) {});
  }
}

// The producer of a dynamically scheduled persistent grid (p.task_counter), in two threads so that
// taking a task never holds up a K or V load:
//   the taker (thread 32) takes the CTA's tasks (CTA b starts with task b, then the counter),
//     decodes each, waits for the next Q buffer, writes the task into its slot (bar.task, announced
//     on task_ready) and loads its Q (q_full: the consumers read the task from it). Every task, with
//     tiles or not, and the end (b = -1) go through a Q buffer;
//   the loader (thread 0) reads each task from task_ready and loads its K and V tiles. With two Q
//     buffers it lets the taker take the next task (take_go) as it issues the loads of the current
//     task's last kTakeAhead tiles, so that the atomic's round trip, the decoding and the Q load
//     overlap the consumers' last tiles; with one, after the loads (the next Q waits for this
//     task's buffer anyway).
// Split this way, the next task's atomic, decoding and Q-buffer wait never sit between two tiles'
// loads (docs/design.md).
constexpr int kTakeAhead = 2;  // tiles before a task's end at which the next task is taken
static_assert(kTakeAhead >= 0, "kTakeAhead: tiles before a task's end, 0 for after its loads");
constexpr int kTakerThread = 32;  // lane 0 of the producer warpgroup's second warp

template <class T>
__device__ void producer_loop_dynamic(const TesseraAttnParams& p, const TmaDescriptors& tma,
                                      typename T::Element* q_smem, typename T::Element* k_smem,
                                      typename T::Element* v_smem, PipelineBarriers<T::kStages, T::kQStages>& bar) {
  if (threadIdx.x == kTakerThread) {
    cute::prefetch_tma_descriptor(&tma.q);
    const int64_t tasks = num_tasks(p);
    PipeState<T::kQStages> write_q;
    uint32_t go_phase = 0;
    int64_t task_id = blockIdx.x;
    while (true) {
      Task t{};
      t.b = -1;
      if (task_id < tasks) t = decode_task(p, task_id);  // before the wait: its reads overlap it
      const int qs = write_q.stage;
      Barrier::wait(&bar.q_empty[qs], write_q.phase ^ 1u);
      write_q.advance();
      bar.task[qs] = t;
      Barrier::arrive(&bar.task_ready[qs]);
      if (t.b >= 0 && t.tile_end > t.tile_begin)
        load_q<T>(p, tma, t, q_smem + T::q_buffer_offset(qs), &bar.q_full[qs]);
      else
        Barrier::arrive(&bar.q_full[qs]);  // no Q to load: the consumers write the empty rows, or stop
      if (t.b < 0) return;
      Barrier::wait(&bar.take_go, go_phase);
      go_phase ^= 1u;
      task_id = int64_t(gridDim.x) + atomicAdd(p.task_counter, 1);
    }
  }
  if (threadIdx.x != 0) return;
  cute::prefetch_tma_descriptor(&tma.k);
  cute::prefetch_tma_descriptor(&tma.v);
  PipeState<T::kStages> write;
  PipeState<T::kQStages> read_q;
  while (true) {
    Barrier::wait(&bar.task_ready[read_q.stage], read_q.phase);
    const Task t = handed_task(bar.task[read_q.stage]);
    read_q.advance();
    if (t.b < 0) return;
    constexpr bool kEarly = T::kQStages == 2 && kTakeAhead > 0;
    const int go_at = kEarly ? max(t.tile_begin, t.tile_end - kTakeAhead) : t.tile_end;
    load_tiles<T>(p, tma, t, k_smem, v_smem, bar, write, [&](int tile) {
      if (tile == go_at) Barrier::arrive(&bar.take_go);
    });
    if (go_at >= t.tile_end) Barrier::arrive(&bar.take_go);  // not during the loads (or no tiles)
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
