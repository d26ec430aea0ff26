// Hopper (sm90a) block-sparse attention forward, warp-specialized:
//   warpgroup 0      producer: one thread gathers Q, K and V tiles with TMA, one box per slot of
//                    the plan's metadata, into a multi-stage, 128-byte-swizzled ring of mbarriers
//                    (pipeline.cuh); with the dynamic schedule a second one takes the tasks and
//                    loads Q; the rest of the warpgroup only gives its registers away;
//   warpgroups 1..2  consumers, one per 64 query rows: wgmma Q K^T and P V, masking and the online
//                    softmax overlapped with the previous P V (mainloop.cuh), epilogue (epilogue.cuh).
// 64 x 64 tiles run two CTAs per SM (traits.cuh), so two independent 64-row tasks share the SM.
// Where shared memory allows, Q has two buffers that tasks take in turn: the producer loads the
// next task's Q early, and the epilogue stages O in the finished task's buffer and stores it with
// TMA, so the consumers do not wait on their own global stores before the next task.
// The persistent task schedule (longest rows first, split-K parts) is shared with the portable
// family (tessera/tasks.cuh), as is the metadata format (tessera_diffusers/prepare.py). A persistent
// grid launched with a task counter (p.task_counter) runs attention_kernel<T, true>: each CTA takes
// its next task from the counter as its producer issues the loads of the current one's last tiles
// (with one Q buffer, once it has issued them; the producer's taker thread decodes it and hands it
// to the consumers in shared memory), so the longest-first order is load-balanced as one CTA per
// task is, without a CTA launch per task.
#pragma once
#include <cutlass/arch/reg_reconfig.h>

#include <cute/atom/copy_traits_sm75.hpp>  // ldmatrix: Q into registers (Traits::kQInRegisters)

#include "tessera/hopper/epilogue.cuh"
#include "tessera/hopper/mainloop.cuh"
#include "tessera/hopper/pipeline.cuh"
#include "tessera/hopper/traits.cuh"
#include "tessera/params.h"
#include "tessera/tasks.cuh"

namespace tessera::hopper {

template <class T>
struct TiledMmas {
  typename T::MmaQK qk;
  typename T::MmaPV pv;
};

// What a consumer thread reads: its wgmma operand descriptors over K and V^T, its view of Q (wgmma
// descriptors over the Q buffers, or with T::kQInRegisters its ldmatrix source in them), and the
// coordinates of its score and output accumulator values.
template <class TQ, class TK, class TV, class CS, class CO>
struct ConsumerViews {
  TQ q;
  TK k;
  TV vt;
  CS coords_s;
  CO coords_o;
  int row_of_half[2];  // rows of this thread's two accumulator row halves
  int lane_col;        // column of accumulator value 0
};

template <class TQ, class TK, class TV, class CS, class CO>
__device__ __forceinline__ ConsumerViews<TQ, TK, TV, CS, CO> make_views(TQ q, TK k, TV vt, CS cs, CO co) {
  return {q, k, vt, cs, co, {int(get<0>(cs(0))), int(get<0>(cs(2)))}, int(get<1>(cs(0)))};
}

// kDynamic: the tasks come from the producer (producer_loop_dynamic), each through a q_full phase;
// otherwise every gridDim.x-th task, the same sequence as the producer's.
template <class T, bool kDynamic, class SmemQ, class SmemKV, class SmemVt>
__device__ void consumer_loop(const TesseraAttnParams& p, const TmaDescriptors& tma, SmemQ& sQ, SmemKV& sK,
                              SmemVt& sVt, PipelineBarriers<T::kStages, T::kQStages>& bar) {
  const int ctid = threadIdx.x - T::kProducerThreads;
  TiledMmas<T> mmas;
  auto thr_qk = mmas.qk.get_thread_slice(ctid);
  auto thr_pv = mmas.pv.get_thread_slice(ctid);
  // Q in registers: one ldmatrix copy of the task's Q buffer into q_regs per task.
  const auto q_tiled_copy = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, typename T::Element>{}, mmas.qk);
  const auto q_copy = q_tiled_copy.get_thread_slice(ctid);
  auto q_regs = [&] {
    if constexpr (T::kQInRegisters)
      return thr_qk.partition_fragment_A(sQ(_, _, 0));  // registers (MMA, MMA_M, MMA_K)
    else
      return 0;
  }();
  const auto views = make_views(
      [&] {
        if constexpr (T::kQInRegisters)
          return q_copy.partition_S(sQ);  // (CPY, CPY_M, CPY_K, Q BUFFERS)
        else
          return thr_qk.partition_fragment_A(sQ);  // descriptors (MMA, MMA_M, MMA_K, Q BUFFERS)
      }(),
      thr_qk.partition_fragment_B(sK),   // descriptors (MMA, MMA_N, MMA_K, STAGES)
      thr_pv.partition_fragment_B(sVt),  // descriptors (MMA, MMA_N, MMA_K, STAGES)
      thr_qk.partition_C(make_identity_tensor(Shape<Int<T::kTileQ>, Int<T::kTileKV>>{})),
      thr_pv.partition_C(make_identity_tensor(Shape<Int<T::kTileQ>, Int<T::kHeadDim>>{})));

  // Q K^T's A operand for the task in Q buffer qs, once it has landed (consume_task).
  // With Q in registers it returns consumer_loop's q_regs through a named reference capture (the
  // front end reads a return of the implicitly captured q_regs as a reference to a local).
  auto q_operand = [&, &regs = q_regs](int qs) -> decltype(auto) {
    if constexpr (T::kQInRegisters) {
      Tensor q_dst = q_copy.retile_D(regs);
      copy(q_tiled_copy, views.q(_, _, _, qs), q_dst);
      // The TMA-store epilogue later writes O into this buffer, and a thread's O rows are rows
      // another lane of its warp loaded here: the warp's reads are ordered before those writes.
      __syncwarp();
      return (regs);
    } else {
      return views.q(_, _, _, qs);
    }
  };

  PipeState<T::kStages> read_k, read_v;
  PipeState<T::kQStages> read_q;
  const bool tma_store = T::kTmaStore && tma.o_store != 0;
  const PingPong<T> turns{ctid / 128};
  turns.start();
  // The Q buffer whose O the TMA-store epilogue's copy may still be reading: the thread that issued
  // the copy (stores_o) releases it after the next task's first Q K^T is issued, or before a task
  // without tiles, or at the end (epilogue.cuh).
  uint64_t* stored_q = nullptr;
  auto release_stored = [&] {
    if (T::kTmaStore && stored_q != nullptr) {
      if (stores_o()) release_after_store<kDynamic>(stored_q);
      stored_q = nullptr;
    }
  };
  auto one_task = [&](const Task& t) {
    RowState<decltype(partition_fragment_C(mmas.pv, Shape<Int<T::kTileQ>, Int<T::kHeadDim>>{}))> st;
    static_assert(decltype(size(st.o))::value == T::kHeadDim / 2, "output accumulator: D / 2 values per thread");
    clear(st.o);
    st.row_max[0] = st.row_max[1] = -CUDART_INF_F;
    st.row_sum[0] = st.row_sum[1] = 0.f;
    const bool tiles = t.tile_end > t.tile_begin;
    if (tiles) {
      consume_task<T, kDynamic>(p, t, q_operand, mmas, views, st, bar, read_k, read_v, read_q, turns, tma_store,
                                release_stored);
    } else {
      release_stored();
      if constexpr (kDynamic) Barrier::arrive(&bar.q_empty[read_q.stage]);  // no tile: only empty rows are written
    }
    if (T::kTmaStore && tma_store && tiles) {
      const int qs = read_q.stage;
      store_output_tma<T, kDynamic>(p, tma, t, st.o, st.row_max, st.row_sum, views.row_of_half, sQ(_, _, qs), thr_pv,
                                    raw_pointer_cast(sQ.data()) + T::q_buffer_offset(qs), &bar.q_empty[qs]);
      stored_q = &bar.q_empty[qs];
    } else {
      store_output<T>(p, t, st.o, st.row_max, st.row_sum, views.coords_o, views.row_of_half);
    }
    if constexpr (!kDynamic)
      if (tiles) read_q.advance();  // the producer skips tasks without tiles
  };
  if constexpr (kDynamic) {
    while (true) {
      Barrier::wait(&bar.q_full[read_q.stage], read_q.phase);
      const Task t = handed_task(bar.task[read_q.stage]);
      if (t.b < 0) break;
      one_task(t);
      read_q.advance();  // every task, with tiles or not, came through a Q buffer
    }
  } else {
    const int64_t tasks = num_tasks(p);
    for (int64_t task_id = blockIdx.x; task_id < tasks; task_id += gridDim.x) one_task(decode_task(p, task_id));
  }
  release_stored();  // the last copy reads shared memory before the CTA exits
}

// kDynamic: a persistent grid that takes its tasks from p.task_counter. It is its own kernel, so the
// static schedule's code carries none of the dynamic one's (docs/design.md).
template <class T, bool kDynamic = false>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    attention_kernel(const __grid_constant__ TesseraAttnParams p, const __grid_constant__ TmaDescriptors tma) {
  using Element = typename T::Element;
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle is a function of address bits: tiles start on 1024-byte boundaries.
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(base)), typename T::SmemLayoutQ{});
  Element* k_ptr = reinterpret_cast<Element*>(base + T::kSmemQBytes);
  Element* v_ptr = reinterpret_cast<Element*>(base + T::kSmemQBytes + T::kSmemKVBytes);
  Tensor sK = make_tensor(make_smem_ptr(k_ptr), typename T::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(v_ptr), typename T::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(v_ptr), typename T::SmemLayoutVt{});
  __shared__ PipelineBarriers<T::kStages, T::kQStages> bar;

  if (threadIdx.x == 0) bar.init(1, T::kConsumerWarps, kDynamic ? T::kConsumerThreads : T::kConsumerWarps);
  __syncthreads();

  if (threadIdx.x < T::kProducerThreads) {
    if constexpr (T::kReallocRegisters) cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    if constexpr (kDynamic)
      producer_loop_dynamic<T>(p, tma, raw_pointer_cast(sQ.data()), k_ptr, v_ptr, bar);
    else
      producer_loop<T>(p, tma, raw_pointer_cast(sQ.data()), k_ptr, v_ptr, bar);
  } else {
    if constexpr (T::kReallocRegisters) cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegisters>();
    consumer_loop<T, kDynamic>(p, tma, sQ, sK, sVt, bar);
  }
}

// Host: encode the TMA descriptors and launch (0 on success, else a cudaError_t value).
template <class T>
int launch(const TesseraAttnParams& p, cudaStream_t stream) {
  TmaDescriptors tma;
  if (num_tasks(p) == 0) return 0;
  const int err = make_tma_descriptors<T>(p, tma);
  if (err != 0) return err;
  if (p.task_counter != nullptr) {  // dynamic scheduling: the CTAs count the tasks they take from zero
    const cudaError_t zeroed = cudaMemsetAsync(p.task_counter, 0, sizeof(int32_t), stream);
    if (zeroed != cudaSuccess) return int(zeroed);
    return launch_tasks(attention_kernel<T, true>, T::kThreads, T::kSmemBytes, p, stream, tma);
  }
  return launch_tasks(attention_kernel<T, false>, T::kThreads, T::kSmemBytes, p, stream, tma);
}

}  // namespace tessera::hopper
