// Hopper consumer side: wgmma Q K^T (K from shared memory; Q from shared memory, or from registers
// where the KV tile has 64 columns: Traits::kQInRegisters) and P V (P from registers),
// membership masking and the online softmax, with the softmax of tile i overlapped with the P V
// product of tile i - 1 inside each warpgroup:
//
//   issue S = Q K_i^T;  issue O += P_{i-1} V_{i-1};  wait S;  release K_i;
//   mask + softmax(S) -> alpha, row max and sum;     wait O; release V_{i-1};
//   O *= alpha;  P_i = bf16(S)
//
// The two consumer warpgroups of a 128-row tile take turns issuing their GEMMs (ping-pong, named
// barriers below), so one warpgroup's softmax also overlaps the other's GEMMs.
#pragma once
#include <math_constants.h>

#include "tessera/hopper/pipeline.cuh"
#include "tessera/hopper/traits.cuh"
#include "tessera/portable/ptx.cuh"  // fast_exp2
#include "tessera/tasks.cuh"

namespace tessera::hopper {

using portable::fast_exp2;

// Issue one wgmma GEMM over all k blocks of its operands and commit it as one group (no wait).
template <bool kZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_issue(Mma& mma, TA const& a, TB const& b, TC& c) {
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
  warpgroup_fence_operand(c);
}

// Scores of inactive (row, column) pairs and of columns past Skv become -inf. Accumulator value e
// sits on column pair e & 1 of n8 block e >> 2 and on row half (e >> 1) & 1 of this thread; the
// thread's columns are the same in both halves. A KV slot holds at least 16 tokens, so an n8 block
// lies in one slot: the activity of the thread's columns is built as one bit per (n8 block, pair)
// and per row half first, then applied with constant bit positions.
template <class T, class FragS>
__device__ __forceinline__ void mask_scores(const TesseraAttnParams& p, const TileActivity& a, const int32_t* slots,
                                            FragS& s, int lane_col, const int (&row_of_half)[2]) {
  constexpr int kBlocks = T::kTileKV / 8;
  static_assert(kBlocks * 2 <= 32, "one 32-bit word holds the thread's columns");
  const unsigned slot_bits = (1u << p.slots) - 1u;
  unsigned row_bits[2];
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half)
    row_bits[half] = unsigned(a.member >> ((row_of_half[half] >> p.q_unit_log2) * p.slots)) & slot_bits;
  uint32_t keep[2] = {0u, 0u};
  // Slot s covers n8 blocks [s, s + 1) * 2^(u - 3) (u = kv_unit_log2 >= 4), which are the keep
  // bits [s, s + 1) * 2^(u - 2): one span of ones per active slot instead of a test per n8 block.
  const int span_log2 = p.kv_unit_log2 - 2;
  const uint32_t span = span_log2 >= 5 ? ~0u : (1u << (1 << span_log2)) - 1u;
  CUTE_UNROLL
  for (int s = 0; s < T::kMaxSlots; ++s) {
    const uint32_t ones = span << ((s << span_log2) & 31);  // slots past p.slots have no row bit
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) keep[half] |= (0u - ((row_bits[half] >> s) & 1u)) & ones;
  }
  if (a.partial) {  // the tile holds the last, partial block: drop columns at or past Skv
    const int unit_mask = (1 << p.kv_unit_log2) - 1;
    uint32_t valid = 0u;
#pragma unroll 4
    for (int j = 0; j < kBlocks; ++j) {
      const int col = j * 8 + lane_col;
      const int left = p.seq_kv - __ldg(slots + (col >> p.kv_unit_log2)) - (col & unit_mask);
      valid |= (uint32_t(left > 0) | (uint32_t(left > 1) << 1)) << (2 * j);
    }
    keep[0] &= valid;
    keep[1] &= valid;
  }
  CUTE_UNROLL
  for (int e = 0; e < size(s); ++e)
    if (!((keep[(e >> 1) & 1] >> (2 * (e >> 2) + (e & 1))) & 1u)) s(e) = -CUDART_INF_F;
}

// Online softmax over one score tile, in place (scores -> unnormalized probabilities); returns in
// `alpha` the factor that rescales what was accumulated under the previous reference maxima. The
// reference is the row maximum so far, or with T::kLazyRescale one that moves only when a tile's
// scores exceed it by more than T::kRescaleThreshold (traits.cuh).
template <class T, class FragS>
__device__ __forceinline__ void online_softmax(FragS& s, float (&row_max)[2], float (&row_sum)[2], float (&alpha)[2],
                                               float scale_log2) {
  constexpr int kVals = decltype(size(s))::value;
  constexpr int kLanes = 4;  // independent partial max / sum chains (shorter dependency chains)
  static_assert(kVals % (4 * kLanes) == 0, "row half values split evenly over the partial chains");
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    float part[kLanes];
    CUTE_UNROLL
    for (int l = 0; l < kLanes; ++l) part[l] = fmaxf(s(2 * half + 4 * l), s(2 * half + 4 * l + 1));
    CUTE_UNROLL
    for (int e = 2 * half + 4 * kLanes; e < kVals; e += 4) {
      float& m = part[(e >> 2) % kLanes];
      m = fmaxf(m, fmaxf(s(e), s(e + 1)));
    }
    float tile_max = fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    float ref;
    if constexpr (T::kLazyRescale) {
      const float tile_ref = tile_max * scale_log2;
      // Also taken when the row had no active score yet (-inf) and this tile has one: alpha is 0 then.
      const bool moves = tile_ref > row_max[half] + T::kRescaleThreshold;
      alpha[half] = moves ? fast_exp2(row_max[half] - tile_ref) : 1.f;
      if (moves) row_max[half] = tile_ref;
      ref = row_max[half] == -CUDART_INF_F ? 0.f : row_max[half];  // empty so far: exp2 gives 0, not NaN
    } else {
      const float new_max = fmaxf(row_max[half], tile_max * scale_log2);
      ref = new_max == -CUDART_INF_F ? 0.f : new_max;  // empty so far: exp2 gives 0, not NaN
      alpha[half] = fast_exp2(row_max[half] - ref);
      row_max[half] = new_max;
    }
    CUTE_UNROLL
    for (int l = 0; l < kLanes; ++l) part[l] = 0.f;
    CUTE_UNROLL
    for (int e = 2 * half; e < kVals; e += 4) {
      s(e) = fast_exp2(fmaf(s(e), scale_log2, -ref));
      s(e + 1) = fast_exp2(fmaf(s(e + 1), scale_log2, -ref));
      part[(e >> 2) % kLanes] += s(e) + s(e + 1);
    }
    row_sum[half] = row_sum[half] * alpha[half] + ((part[0] + part[1]) + (part[2] + part[3]));
  }
}

// Turns of the two consumer warpgroups at issuing GEMMs (T::kPingPong): warpgroup w waits on named
// barrier kFirstBarrier + w, issues, then lets the other one go. Barrier 0 is __syncthreads. Both
// warpgroups work on the same tasks, so their turns pair up; warpgroup 1 lends warpgroup 0 its
// first turn (``start``), and its last pass at the kernel's end stays unmatched.
template <class T>
struct PingPong {
  static constexpr int kFirstBarrier = 1;
  static constexpr int kThreads = 2 * 128;
  int warpgroup;  // consumer warpgroup of this thread: 0 or 1

  __device__ __forceinline__ void wait_turn() const {
    if constexpr (T::kPingPong) asm volatile("bar.sync %0, %1;" ::"r"(kFirstBarrier + warpgroup), "n"(kThreads) : "memory");
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (T::kPingPong)
      asm volatile("bar.arrive %0, %1;" ::"r"(kFirstBarrier + 1 - warpgroup), "n"(kThreads) : "memory");
  }
  __device__ __forceinline__ void start() const {
    if constexpr (T::kPingPong)
      if (warpgroup == 1) asm volatile("bar.arrive %0, %1;" ::"r"(kFirstBarrier), "n"(kThreads) : "memory");
  }
};

// consume_task's hook after the task's first Q K^T is issued (while it runs): nothing by default.
struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};

// Per-thread state of one query tile: the output accumulator and the running row statistics.
template <class FragO>
struct RowState {
  FragO o;
  float row_max[2];
  float row_sum[2];
};

// The consumer's work on one task with at least one KV tile: Q K^T, masking, softmax and P V over
// the task's tiles, advancing the K and V read states. `o`, `row_max`, `row_sum` start cleared.
// The task's Q is in buffer read_q.stage (advanced by the caller once the task is done); once it
// has landed, `q_operand(qs)` gives Q K^T's A operand: wgmma descriptors over that buffer, or the
// registers it loads it into (T::kQInRegisters). The buffer is released after the last Q K^T
// unless `keep_q` (the TMA-store epilogue stages O in it). kDynamic (a dynamically scheduled grid):
// Q has already landed (its q_full phase also carried the task), and every thread, not one per
// warp, releases it. `after_first_issue` runs once the first Q K^T is issued, before its wait (the
// TMA-store epilogue's deferred release of the previous task's buffer, attention.cuh).
template <class T, bool kDynamic = false, class QOperand, class Mmas, class Views, class State, class Hook = NoHook>
__device__ __forceinline__ void consume_task(const TesseraAttnParams& p, const Task& t, const QOperand& q_operand,
                                             Mmas& mmas, const Views& v, State& st,
                                             PipelineBarriers<T::kStages, T::kQStages>& bar,
                                             PipeState<T::kStages>& read_k, PipeState<T::kStages>& read_v,
                                             const PipeState<T::kQStages>& read_q, const PingPong<T>& turns,
                                             bool keep_q = false, const Hook& after_first_issue = Hook{}) {
  using Element = typename T::Element;
  const int n = t.tile_end - t.tile_begin;
  const int qs = read_q.stage;
  if constexpr (!kDynamic) Barrier::wait(&bar.q_full[qs], read_q.phase);
  decltype(auto) q = q_operand(qs);

  Tensor s = partition_fragment_C(mmas.qk, Shape<Int<T::kTileQ>, Int<T::kTileKV>>{});
  // P in the register layout of the A operand: ((2, 2, 2), 1, N / 16), the same value order as S.
  Tensor prob = make_tensor<Element>(Layout<Shape<Shape<_2, _2, _2>, _1, Int<T::kTileKV / 16>>>{});
  float alpha[2];

  auto issue_scores = [&]() {  // S = Q K^T on the next K stage, once the producer has filled it
    Barrier::wait(&bar.k_full[read_k.stage], read_k.phase);  // TMA writes and wgmma reads: both async proxy
    wgmma_issue<true>(mmas.qk, q, v.k(_, _, _, read_k.stage), s);
  };
  auto issue_pv = [&]() {  // O += P V on the next V stage
    Barrier::wait(&bar.v_full[read_v.stage], read_v.phase);
    wgmma_issue<false>(mmas.pv, prob, v.vt(_, _, _, read_v.stage), st.o);
  };
  auto scores_done = [&](int i, const TileActivity& a) {  // release K, mask, softmax
    warpgroup_fence_operand(s);
    release(&bar.k_empty[read_k.stage]);
    read_k.advance();
    if (i == n - 1 && !keep_q) release_q<kDynamic>(&bar.q_empty[qs]);
    if (a.needs_mask) mask_scores<T>(p, a, tile_slots(p, t, t.tile_begin + i), s, v.lane_col, v.row_of_half);
    online_softmax<T>(s, st.row_max, st.row_sum, alpha, p.scale_log2);
  };
  auto pv_done = [&]() {  // release V
    warpgroup_fence_operand(st.o);
    warpgroup_fence_operand(prob);
    release(&bar.v_empty[read_v.stage]);
    read_v.advance();
  };
  auto to_prob = [&]() {
    CUTE_UNROLL
    for (int e = 0; e < size(s); ++e) prob(e) = static_cast<Element>(s(e));
  };

  // Tile 0: no P V in flight yet.
  TileActivity act = tile_activity<T::kTileQ>(p, t, t.tile_begin);
  turns.wait_turn();
  issue_scores();
  turns.pass_turn();
  after_first_issue();
  warpgroup_wait<0>();
  scores_done(0, act);
  to_prob();

  for (int i = 1; i < n; ++i) {
    act = tile_activity<T::kTileQ>(p, t, t.tile_begin + i);
    turns.wait_turn();
    issue_scores();
    issue_pv();
    turns.pass_turn();
    warpgroup_wait<1>();  // S done, O += P V still in flight
    scores_done(i, act);
    warpgroup_wait<0>();
    pv_done();
    // With lazy references a warp none of whose rows moved its reference skips the rescale.
    if (!T::kLazyRescale || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
      CUTE_UNROLL
      for (int e = 0; e < size(st.o); ++e) st.o(e) *= alpha[(e >> 1) & 1];
    }
    to_prob();
  }

  turns.wait_turn();
  issue_pv();
  turns.pass_turn();
  warpgroup_wait<0>();
  pv_done();
}

}  // namespace tessera::hopper
