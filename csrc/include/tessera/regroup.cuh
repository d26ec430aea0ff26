// Query-block grouping for the grouped query layout: the greedy of tessera_diffusers/regroup.py
// (algorithm in its docstring), bit for bit, in two launches:
//
//   group_segment_kernel   one CTA per segment of S rows of a (mb, mh) mask head: the segment's
//                          greedy order into its positions of q_units and its (natural, greedy) key
//                          blocks into segment_key_blocks.
//   choose_order_kernel    one CTA per head, after them in the stream: sums its segments' key
//                          blocks, writes key_blocks, and rewrites the head's q_units to the natural
//                          order where that schedules no more; pads q_units with -1.
//
// A segment's greedy is a chain of S dependent picks, so a segment is one CTA and the design follows
// the latency of one pick; the segments of all heads run side by side. The CTA's warps have three
// roles (rows below are the segment's, numbered from its first):
//
//   picker warp     runs the greedy, with no block barrier. Each lane keeps, in registers, the
//                   count of key blocks in which each of its candidates (j = lane + 32m) and the
//                   group's union differ (popcount(row[c] ^ union)). They start at the rows'
//                   popcounts (an empty union), and the seed lists the words of its row; a pick is
//                   a warp argmin of the keys count << kSlotBits | j (the unsigned minimum: ties to
//                   the lowest candidate), then its row ORed into the union, listing the words
//                   where it adds key blocks. Each list moves every count by the blocks it adds
//                   (a warp sum) less twice popcount(row[c] & added) over the listed words.
//   helper warps    OR the rows the picker has seen published since the last group into the natural
//                   groups' unions (the natural order's sum), posted by the picker each group through
//                   a named barrier it only arrives at, and waited for at the next group.
//   producer warps  pack the mask's rows into 32-bit words (bit j: KV block j), round robin, into
//                   a ring of R rows in shared memory (row r in slot r % R), as far ahead as the ring
//                   allows, and publish each by a release store of its index in tag[slot].
//
// The ring holds every row a group reads: rows below the seed s are all taken, and while a group
// runs every taken row lies below s + W + g. (Rows past s + W are taken only by the fallback, which
// extends a run starting right after s + W while the whole window is taken; the next seed then lies
// past the run.) So R >= W + g + 1 rows suffice, a producer may overwrite row r - R once the
// picker has published a seed past it (after the helpers have read it), and taken[r % R] == r
// tells whether row r is taken.
//
// The per-head choice needs every segment's sum, so it is a second kernel rather than a grid-wide
// handshake: stream order makes the segments' stores visible to it, with no counters to reset and
// no fences, and it costs one launch of ~nQ stores per head.
//
// Cost per pick, on the picker: two warp reductions (the argmin, the count of added key blocks), a
// pass over the union's words, and (listed words) x W / 32 shared reads per lane (the seed lists
// all the nonzero words of its row). A segment costs about S picks and the segments run side by
// side, so a mask costs about S picks while all its segments fit on the device at once. The
// picker's chain of shared-memory round trips is the bound, which more warps per segment do not
// shorten. A segment whose ring does not fit in shared memory (about (W + g + 64) * nKV / 8 bytes)
// gets cudaErrorInvalidConfiguration: regroup.py then runs the torch code.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include "tessera/params.h"
#include "tessera/prepare.cuh"  // prep::valid_mask, prep::ceil_div

namespace tessera::regroup {

constexpr int kHelperWarps = 4;  // the natural unions of ~g rows per group: light work
constexpr int kProducerWarps = 7;  // rows packed at once: enough to stay ahead of the picks
constexpr int kHelperThreads = kHelperWarps * 32;
constexpr int kThreads = (1 + kHelperWarps + kProducerWarps) * 32;  // warp 0 picks, then the helpers
constexpr int kJobThreads = 32 + kHelperThreads;  // the named barriers' picker and helpers
constexpr int kWakeBarrier = 1;  // the picker has posted a job (0 is __syncthreads)
constexpr int kDoneBarrier = 2;  // the helpers have done it
constexpr int kSlotBits = 10;
constexpr int kMaxWindow = 1 << kSlotBits;  // candidates per group
constexpr int kMaxCols = (1 << (32 - kSlotBits)) - 2;  // keeps every key below kNoKey
constexpr uint32_t kNoKey = 0xffffffffu;  // not a candidate: taken, or past the window or the mask
constexpr uint32_t kNoCount = 0xffffffffu;
constexpr int kLookahead = 64;  // ring rows past those a group may read, when shared memory allows
constexpr int kPackSteps = 5;  // 31-word steps of a row whose loads are in flight together (155 words)
constexpr int kWordsPerStep = 31;  // a step's 32 lanes load 32 flat words and form 31 row words
constexpr int kRowSteps = 4;  // 32-word steps of the picker's pass over a row, loads in flight together
// Listed words whose candidate reads are in flight together (fewer with many candidates per lane:
// registers).
template <int kPerLane>
constexpr int kListSteps = kPerLane > 8 ? 2 : 8;
constexpr int kPollSleepNs = 256;  // a producer waiting for the seed to move: rows take ~1 us each
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kChooseThreads = 256;  // choose_order_kernel: a head's q_units, a store per thread and pass
static_assert(kThreads <= 512, "128 registers per thread for the widest picker");
static_assert(kChooseThreads % 32 == 0, "whole warps sum the segments");

// Scalars the roles share, at the start of the dynamic shared memory.
struct Control {
  unsigned long long greedy;   // key blocks of the greedy groups (picker)
  unsigned long long natural;  // key blocks of the natural groups (helpers)
  int32_t seed;                // the seed the picker last published (release; producers acquire)
  // The helpers' job, posted by the picker before the wake barrier:
  int32_t job_rows_begin;      // rows [begin, end) to add to the natural groups' unions
  int32_t job_rows_end;
  int32_t job_last;            // 1: the helpers leave after this job
};

// One launch over one mask, derived and checked on the host (make_layout).
struct Layout {
  TesseraBlockMask mask;
  int group;         // g
  int segment;       // S: rows per segment, a multiple of g (nQ: one segment per head)
  int segments;      // ceil(nQ / S): CTAs per head
  int window;        // W' = min(W, S - 1): candidates per group
  int num_slots;     // entries per head of q_units
  int words;         // ceil(nKV / 32): words of a packed row
  int ld;            // ring row stride in words: odd, so lanes over candidates read distinct banks
  int ring;          // R: rows of the ring
  int publish_step;  // seed moves between the picker's publications (keeps producers within the ring)
  int contiguous;    // 1: the columns are contiguous bytes (16-byte loads)
  int32_t* q_units;
  int64_t* key_blocks;
  int64_t* segment_key_blocks;  // [heads, segments, 2]: (natural, greedy) per segment
};

// The rows one CTA groups: rows [begin, begin + rows) of head `head` (= mb * Hm + mh), its segment
// `index`. The roles number them from 0 (a row r of the roles is row begin + r of the head).
struct Segment {
  int64_t head;
  int index;
  int begin;  // index * S: a multiple of g, so the natural groups start at the same rows
  int rows;   // S, or fewer in a head's last segment
};

__device__ __forceinline__ Segment segment_of_block(const Layout& l) {
  Segment seg;
  seg.head = blockIdx.x / l.segments;
  seg.index = int(blockIdx.x % l.segments);
  seg.begin = seg.index * l.segment;
  seg.rows = min(l.segment, l.mask.rows - seg.begin);
  return seg;
}

// The dynamic shared memory, carved in 4-byte words after Control.
struct Shared {
  Control* control;
  uint2* added;        // [words] (word, key blocks) where the seed or the last pick adds key blocks
  uint32_t* ring;      // [R][ld] packed rows
  uint32_t* unite;     // [words] the union of the group's picks (picker)
  uint32_t* natural;   // [words] the union of the current natural group (helpers)
  int32_t* row_count;  // [R] key blocks of the row in each slot
  int32_t* tag;        // [R] row in each slot once packed
  int32_t* taken;      // [R] taken[r % R] == r: row r is taken
};

constexpr int kControlWords = int((sizeof(Control) + 15) / 16 * 4);

// Offsets (in words) of Shared's arrays; `end` is the size.
struct Carve {
  int64_t added, ring, unite, natural, row_count, tag, taken, end;
};

__host__ __device__ inline Carve carve(int ring, int ld, int words) {
  Carve c;
  c.added = kControlWords;  // 8-byte aligned: Control is a whole number of 16-byte units
  c.ring = c.added + 2 * int64_t(words);
  c.unite = c.ring + int64_t(ring) * ld;
  c.natural = c.unite + words;
  c.row_count = c.natural + words;
  c.tag = c.row_count + ring;
  c.taken = c.tag + ring;
  c.end = c.taken + ring;
  return c;
}

__device__ __forceinline__ Shared shared_arrays(const Layout& l, uint32_t* base) {
  const Carve c = carve(l.ring, l.ld, l.words);
  Shared s;
  s.control = reinterpret_cast<Control*>(base);
  s.added = reinterpret_cast<uint2*>(base + c.added);
  s.ring = base + c.ring;
  s.unite = base + c.unite;
  s.natural = base + c.natural;
  s.row_count = reinterpret_cast<int32_t*>(base + c.row_count);
  s.tag = reinterpret_cast<int32_t*>(base + c.tag);
  s.taken = reinterpret_cast<int32_t*>(base + c.taken);
  return s;
}

// The hand-offs between the picker and the producers: polls are plain shared loads (cheap while
// spinning), followed by one acquire fence once the value is seen; publications are release stores.
// compute-sanitizer racecheck, which models barriers but not this release / acquire pattern, reports
// hazards on exactly these hand-offs (a ring row, its count and its tag written by a producer and
// read by the picker after it saw the tag; a slot rewritten after the picker published a seed past
// it); the orders stay bit for bit those of the torch code under it.
__device__ __forceinline__ int load_relaxed(const int32_t& x) {
  int v;
  asm volatile("ld.relaxed.cta.shared.b32 %0, [%1];"
               : "=r"(v)
               : "r"(uint32_t(__cvta_generic_to_shared(&x)))
               : "memory");
  return v;
}

__device__ __forceinline__ void fence_acquire() { asm volatile("fence.acq_rel.cta;" ::: "memory"); }

__device__ __forceinline__ void store_release(int32_t& x, int32_t v) {
  asm volatile("st.release.cta.shared.b32 [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(&x))), "r"(v)
               : "memory");
}

// Slot arithmetic from the seed's slot: the rows a group reads lie less than R past the seed.
__device__ __forceinline__ int wrap(int slot, int ring) { return slot >= ring ? slot - ring : slot; }

// The picker and the helpers meet here (ordered shared memory between them); the picker may only
// arrive at the wake barrier (posting a job without waiting). The non-aligned barrier.sync /
// barrier.arrive: with the aligned bar.sync / bar.arrive (every thread of a warp at the same
// instruction) compute-sanitizer synccheck reports divergent arrivals of the picker warp, even
// after a __syncwarp; with these it reports none, and the orders are the same.
__device__ __forceinline__ void job_barrier(int id) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "n"(kJobThreads) : "memory");
}

__device__ __forceinline__ void job_arrive(int id) {
  asm volatile("barrier.arrive %0, %1;" ::"r"(id), "n"(kJobThreads) : "memory");
}

// ------------------------------------------------------------------ packing rows (producers)

// Bits 0..3: whether bytes 0..3 of `x` are nonzero. The multiply moves each byte's top bit of the
// compare mask (bits 7, 15, 23, 31) to bits 28..31 without carries.
__device__ __forceinline__ uint32_t nonzero_bytes(uint32_t x) {
  return ((__vcmpne4(x, 0u) & 0x80808080u) * 0x00204081u) >> 28;
}

__device__ __forceinline__ uint32_t nonzero_bytes(uint4 v) {
  return nonzero_bytes(v.x) | nonzero_bytes(v.y) << 4 | nonzero_bytes(v.z) << 8 | nonzero_bytes(v.w) << 12;
}

// Word `w` of a row of `cols` columns with the bits past the last column cleared.
__device__ __forceinline__ uint32_t clip(uint32_t word, int w, int cols) {
  const int left = cols - 32 * w;
  return left >= 32 ? word : word & ((1u << left) - 1u);
}

// The 16 bytes at `at` if they overlap [begin, end) (an aligned chunk: never past the page of a
// byte of the row), else zeros.
__device__ __forceinline__ uint4 load_chunk(uintptr_t at, uintptr_t begin, uintptr_t end) {
  return at + 16 > begin && at < end ? __ldg(reinterpret_cast<const uint4*>(at)) : make_uint4(0, 0, 0, 0);
}

// Calls sink(w, word) for the words of a row of contiguous bytes, by 16-byte loads from the 32-byte
// boundary below the row: flat word m flags the bytes [base + 32m, base + 32m + 32), and row word w
// is the 32 bits from bit `offset` of flat words w, w + 1 (the next lane's). Lane l of step i forms
// row word 31i + l; the loads of kPackSteps steps are in flight together.
template <class Sink>
__device__ __forceinline__ void pack_contiguous(const uint8_t* row, int cols, int words, int lane, Sink sink) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(row), end = begin + cols;
  const uintptr_t base = begin & ~uintptr_t(31);
  const int offset = int(begin - base);
  for (int first = 0; first < words; first += kWordsPerStep * kPackSteps) {
    uint4 low[kPackSteps], high[kPackSteps];
#pragma unroll
    for (int i = 0; i < kPackSteps; ++i) {
      const uintptr_t at = base + 32 * uintptr_t(first + kWordsPerStep * i + lane);
      low[i] = load_chunk(at, begin, end);
      high[i] = load_chunk(at + 16, begin, end);
    }
#pragma unroll
    for (int i = 0; i < kPackSteps; ++i) {
      const uint32_t flat = nonzero_bytes(low[i]) | nonzero_bytes(high[i]) << 16;
      const uint32_t next = __shfl_down_sync(kFullWarp, flat, 1);
      const int w = first + kWordsPerStep * i + lane;
      if (lane < kWordsPerStep && w < words) sink(w, clip(__funnelshift_r(flat, next, offset), w, cols));
    }
  }
}

// Calls sink(w, word) for the words of a row of columns `stride` bytes apart: a byte per lane and
// column, a ballot per word; lane l keeps word 32i + l.
template <class Sink>
__device__ __forceinline__ void pack_strided(const uint8_t* row, int64_t stride, int cols, int words, int lane,
                                             Sink sink) {
  for (int first = 0; first < words; first += 32) {
    uint32_t mine = 0;
#pragma unroll 8
    for (int k = 0; k < 32; ++k) {
      const int64_t column = int64_t(first + k) * 32 + lane;
      const uint32_t word = __ballot_sync(kFullWarp, column < cols && __ldg(row + column * stride) != 0);
      if (lane == k) mine = word;
    }
    if (first + lane < words) sink(first + lane, mine);
  }
}

// Producer `producer`: rows producer, producer + kProducerWarps, ... of the `rows` rows from `first`
// (the segment's first row).
__device__ void produce(const Layout& l, const Shared& s, const uint8_t* first, int rows, int producer) {
  const int lane = threadIdx.x & 31;
  int64_t limit = 0;  // rows below it may be written: the seed last read + R
  for (int r = producer; r < rows; r += kProducerWarps) {
    if (r >= limit) {  // the ring slot may still hold a row the picker reads
      while (r >= (limit = int64_t(load_relaxed(s.control->seed)) + l.ring)) __nanosleep(kPollSleepNs);
      fence_acquire();
    }
    const int slot = r % l.ring;
    uint32_t* packed = s.ring + slot * l.ld;
    uint32_t count = 0;
    auto sink = [&](int w, uint32_t word) {
      packed[w] = word;
      count += __popc(word);
    };
    const uint8_t* row = first + int64_t(r) * l.mask.stride[2];
    if (l.contiguous)
      pack_contiguous(row, l.mask.cols, l.words, lane, sink);
    else
      pack_strided(row, l.mask.stride[3], l.mask.cols, l.words, lane, sink);
    count = __reduce_add_sync(kFullWarp, count);
    if (lane == 0) s.row_count[slot] = int32_t(count);
    __syncwarp();  // the lanes' words before the tag
    if (lane == 0) store_release(s.tag[slot], r);
  }
}

// ------------------------------------------------------------------ natural unions (helpers)

// One job: the rows [begin, end) of the segment's `rows` into the natural groups' unions. Helper
// thread h owns the words h + kHelperThreads * k and keeps `natural`, its sum of the closed groups'
// key blocks; a word's union stays in a register across the rows, so their loads are independent.
__device__ __forceinline__ void do_job(const Layout& l, const Shared& s, int rows, int h,
                                       unsigned long long& natural) {
  const Control& job = *s.control;
  for (int w = h; w < l.words; w += kHelperThreads) {
    uint32_t grown = s.natural[w];
    for (int r = job.job_rows_begin, slot = r % l.ring; r < job.job_rows_end; ++r, slot = wrap(slot + 1, l.ring)) {
      grown |= s.ring[slot * l.ld + w];
      if (r % l.group == l.group - 1 || r == rows - 1) {  // the last row of its natural group
        natural += __popc(grown);
        grown = 0;
      }
    }
    s.natural[w] = grown;
  }
}

// The helper warps: jobs until the last, then their natural sum into the control.
__device__ void help(const Layout& l, const Shared& s, int rows) {
  const int h = int(threadIdx.x) - 32;
  unsigned long long natural = 0;
  for (bool last = false; !last;) {
    job_barrier(kWakeBarrier);
    do_job(l, s, rows, h, natural);
    last = s.control->job_last != 0;
    job_barrier(kDoneBarrier);
  }
  for (int d = 16; d > 0; d >>= 1) natural += __shfl_xor_sync(kFullWarp, natural, d);
  if ((h & 31) == 0) atomicAdd(&s.control->natural, natural);
}

// ------------------------------------------------------------------ the greedy (picker warp)

// The first of the `rows` rows from `from` on that is not taken (one exists).
__device__ __forceinline__ int first_free(const Layout& l, const Shared& s, int from, int rows, int lane) {
  for (int base = from;; base += 32) {
    const int r = base + lane;
    const uint32_t free_rows = __ballot_sync(kFullWarp, r < rows && s.taken[r % l.ring] != r);
    if (free_rows != 0) return base + __ffs(free_rows) - 1;
  }
}

// Rows the picker has seen published: below `ready` every row is in the ring and fenced.
struct Readiness {
  int rows;           // the segment's
  int ready = 0;
  int published = 0;  // the seed the producers last saw

  // Makes the rows below `needed` readable: polls the tags from `ready` on (blocking until
  // `needed`, then taking whatever else is already published), then one acquire fence. Rows at or
  // past published + R are not yet producible; their slots hold older rows.
  __device__ __forceinline__ void reach(const Layout& l, const Shared& s, int needed, int lane) {
    if (needed <= ready) return;
    const int producible = int(min(int64_t(rows), int64_t(published) + l.ring));
    while (ready < producible) {
      const int r = ready + lane;
      const uint32_t in_ring = __ballot_sync(kFullWarp, r >= producible || load_relaxed(s.tag[r % l.ring]) == r);
      const int run = __ffs(~in_ring) - 1;  // rows published in order from `ready` (-1: all 32)
      ready = run < 0 ? min(ready + 32, producible) : ready + run;
      if (run >= 0 && ready >= needed) break;
    }
    fence_acquire();
  }

  // Lets the producers overwrite the rows below `seed` once it has moved `step` rows on (a release
  // fence each time, so not every group).
  __device__ __forceinline__ void publish(const Shared& s, int seed, int step, int lane) {
    if (seed - published < step) return;
    if (lane == 0) store_release(s.control->seed, seed);
    published = seed;
  }
};

// Takes row `r` (in ring slot `slot`) for position `position` of the segment's `order`: the head's
// row begin + r.
__device__ __forceinline__ void take(const Shared& s, int32_t* order, int begin, int r, int slot, int position,
                                     int lane) {
  if (lane == 0) {
    s.taken[slot] = r;
    order[position] = begin + r;
  }
  __syncwarp();
}

// ORs the ring row in `slot` into the group's union (`first`: starts it) and returns this lane's
// count of the key blocks it adds; lists (word, added key blocks) where it adds some in `added`
// and returns their number in `listed` (the same in every lane). The loads of kRowSteps 32-word
// steps are in flight together.
__device__ __forceinline__ uint32_t add_row(const Layout& l, const Shared& s, int slot, bool first, int* listed,
                                            int lane) {
  const uint32_t* row = s.ring + slot * l.ld;
  uint32_t added_count = 0;
  int n = 0;
  for (int w0 = 0; w0 < l.words; w0 += 32 * kRowSteps) {
    uint32_t bits[kRowSteps], before[kRowSteps];
#pragma unroll
    for (int i = 0; i < kRowSteps; ++i) {
      const int w = w0 + 32 * i + lane;
      bits[i] = w < l.words ? row[w] : 0u;
      before[i] = w < l.words && !first ? s.unite[w] : 0u;
    }
#pragma unroll
    for (int i = 0; i < kRowSteps; ++i) {
      const int w = w0 + 32 * i + lane;
      const uint32_t added = bits[i] & ~before[i];
      if (w < l.words) s.unite[w] = before[i] | bits[i];
      added_count += __popc(added);
      const uint32_t adding = __ballot_sync(kFullWarp, added != 0);
      if (added != 0) s.added[n + __popc(adding & ((1u << lane) - 1u))] = make_uint2(uint32_t(w), added);
      n += __popc(adding);
    }
  }
  __syncwarp();  // the list before the lanes read it
  *listed = n;
  return added_count;
}

// Moves each candidate's count of key blocks that differ from the union, popcount(row[c] ^ union),
// to that of the union grown by the listed words, which add `added` key blocks: the blocks of
// row[c] among them no longer differ, the others now do. `added` first, so that no count passes
// below zero on the way. The reads of kSteps entries are in flight together, for every candidate
// (a closed one reads a row of the ring and ignores it: no branch between the loads).
template <int kPerLane>
__device__ __forceinline__ void update_counts(const Shared& s, int listed, uint32_t added, const int (&base)[kPerLane],
                                              uint32_t (&count)[kPerLane]) {
  constexpr int kSteps = kListSteps<kPerLane>;
#pragma unroll
  for (int m = 0; m < kPerLane; ++m)
    if (count[m] != kNoCount) count[m] += added;
  int i = 0;
  for (; i + kSteps <= listed; i += kSteps) {
    uint2 e[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) e[u] = s.added[i + u];
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      uint32_t n = 0;
#pragma unroll
      for (int u = 0; u < kSteps; ++u) n += __popc(s.ring[base[m] + int(e[u].x)] & e[u].y);
      if (count[m] != kNoCount) count[m] -= 2 * n;
    }
  }
  for (; i < listed; ++i) {
    const uint2 e = s.added[i];
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const uint32_t n = __popc(s.ring[base[m] + int(e.x)] & e.y);
      if (count[m] != kNoCount) count[m] -= 2 * n;
    }
  }
}

// The helpers' jobs from the picker's side: at most one in flight.
struct Jobs {
  bool pending = false;

  // Posts the natural unions of rows [natural_rows, ready); natural_rows advances to `ready`.
  __device__ __forceinline__ void post(const Shared& s, int& natural_rows, int ready, bool last, int lane) {
    if (lane == 0) {
      Control& job = *s.control;
      job.job_rows_begin = natural_rows;
      job.job_rows_end = ready;
      job.job_last = last;
    }
    job_arrive(kWakeBarrier);
    pending = true;
    natural_rows = ready;
  }

  // Waits for the job in flight: its rows are read.
  __device__ __forceinline__ void wait() {
    if (pending) job_barrier(kDoneBarrier);
    pending = false;
  }
};

// The greedy order of the segment into `order` (its positions of the head's q_units) and its key
// blocks into the control, by warp 0. kPerLane candidates per lane: j = lane + 32m, m < kPerLane.
template <int kPerLane>
__device__ void pick(const Layout& l, const Shared& s, const Segment& seg, int32_t* order) {
  const int lane = threadIdx.x & 31;
  const int rows = seg.rows;
  Readiness rows_in_ring{rows};
  Jobs jobs;
  int natural_rows = 0;  // rows below it are handed to the natural unions
  unsigned long long greedy = 0;
  uint32_t count[kPerLane];  // key blocks in which candidate j and the union differ, or kNoCount
  int base[kPerLane];        // candidate j's ring row, in words from the ring's start
  int seed = 0;
  for (int written = 0; written < rows; written += l.group) {
    const int n = min(l.group, rows - written);
    seed = first_free(l, s, seed, rows, lane);
    jobs.wait();  // then the rows below the seed are read: the producers may overwrite them
    rows_in_ring.publish(s, seed, l.publish_step, lane);
    rows_in_ring.reach(l, s, min(rows, seed + 1 + (n > 1 ? l.window : 0)), lane);
    const int seed_slot = seed % l.ring;
    take(s, order, seg.begin, seed, seed_slot, written, lane);
    jobs.post(s, natural_rows, rows_in_ring.ready, false, lane);
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int j = lane + 32 * m, c = seed + 1 + j, slot = wrap(seed_slot + 1 + j, l.ring);
      const bool open = n > 1 && j < l.window && c < rows && s.taken[slot] != c;
      base[m] = j < l.window ? slot * l.ld : 0;  // past the window: a row of the ring, never used
      count[m] = open ? uint32_t(s.row_count[slot]) : kNoCount;
    }
    int listed;
    uint32_t added = add_row(l, s, seed_slot, true, &listed, lane);  // this lane's words
    greedy += added;
    for (int k = 1; k < n; ++k) {
      // By what the seed or the last pick added (the whole warp's count of it).
      update_counts<kPerLane>(s, listed, __reduce_add_sync(kFullWarp, added), base, count);
      uint32_t best = kNoKey;
#pragma unroll
      for (int m = 0; m < kPerLane; ++m)
        if (count[m] != kNoCount) best = min(best, count[m] << kSlotBits | uint32_t(lane + 32 * m));
      best = __reduce_min_sync(kFullWarp, best);
      int next, slot;
      if (best != kNoKey) {
        const int j = int(best & ((1u << kSlotBits) - 1u));
        next = seed + 1 + j;
        slot = wrap(seed_slot + 1 + j, l.ring);
#pragma unroll
        for (int m = 0; m < kPerLane; ++m)
          if (lane + 32 * m == j) count[m] = kNoCount;
      } else {  // the whole window is taken
        next = first_free(l, s, seed + 1, rows, lane);
        rows_in_ring.reach(l, s, next + 1, lane);
        slot = next % l.ring;
      }
      take(s, order, seg.begin, next, slot, written + k, lane);
      added = add_row(l, s, slot, false, &listed, lane);
      greedy += added;
    }
  }
  while (natural_rows < rows) {  // the rest of the natural unions, as far as the ring allows each time
    jobs.wait();
    rows_in_ring.publish(s, natural_rows, 1, lane);
    rows_in_ring.reach(l, s, natural_rows + 1, lane);
    jobs.post(s, natural_rows, rows_in_ring.ready, false, lane);
  }
  jobs.wait();
  jobs.post(s, natural_rows, rows, true, lane);
  jobs.wait();
  for (int d = 16; d > 0; d >>= 1) greedy += __shfl_xor_sync(kFullWarp, greedy, d);
  if (lane == 0) s.control->greedy = greedy;
}

// ------------------------------------------------------------------ the kernels

// One CTA per segment: its greedy order into its positions of the head's q_units, its key blocks
// into segment_key_blocks.
template <int kPerLane>
__global__ void __launch_bounds__(kThreads, 1) group_segment_kernel(const __grid_constant__ Layout l) {
  extern __shared__ __align__(16) uint32_t shared_words[];
  const Shared s = shared_arrays(l, shared_words);
  const Segment seg = segment_of_block(l);
  for (int i = threadIdx.x; i < l.ring; i += kThreads) s.tag[i] = s.taken[i] = -1;
  for (int w = threadIdx.x; w < l.words; w += kThreads) s.natural[w] = 0;
  if (threadIdx.x == 0) {
    s.control->seed = 0;
    s.control->natural = 0;
  }
  __syncthreads();

  const int64_t mb = seg.head / l.mask.heads, mh = seg.head % l.mask.heads;
  const int warp = threadIdx.x >> 5;
  if (warp == 0) {
    pick<kPerLane>(l, s, seg, l.q_units + seg.head * l.num_slots + seg.begin);
  } else if (warp <= kHelperWarps) {
    help(l, s, seg.rows);
  } else {
    const uint8_t* first = l.mask.blocks + mb * l.mask.stride[0] + mh * l.mask.stride[1] +
                           int64_t(seg.begin) * l.mask.stride[2];
    produce(l, s, first, seg.rows, warp - 1 - kHelperWarps);
  }
  __syncthreads();

  if (threadIdx.x == 0) {
    int64_t* counts = l.segment_key_blocks + 2 * (seg.head * l.segments + seg.index);
    counts[0] = int64_t(s.control->natural);
    counts[1] = int64_t(s.control->greedy);
  }
}

// One CTA per head, after group_segment_kernel: the head's key blocks summed over its segments, the
// natural order where natural <= greedy, and the -1 padding.
__global__ void __launch_bounds__(kChooseThreads) choose_order_kernel(const __grid_constant__ Layout l) {
  __shared__ unsigned long long sums[2];  // natural, greedy
  const int64_t head = blockIdx.x;
  const int64_t* counts = l.segment_key_blocks + 2 * head * l.segments;
  if (threadIdx.x == 0) sums[0] = sums[1] = 0;
  __syncthreads();
  unsigned long long natural = 0, greedy = 0;
  for (int i = threadIdx.x; i < l.segments; i += kChooseThreads) {
    natural += uint64_t(counts[2 * i]);
    greedy += uint64_t(counts[2 * i + 1]);
  }
  for (int d = 16; d > 0; d >>= 1) {
    natural += __shfl_xor_sync(kFullWarp, natural, d);
    greedy += __shfl_xor_sync(kFullWarp, greedy, d);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&sums[0], natural);
    atomicAdd(&sums[1], greedy);
  }
  __syncthreads();
  natural = sums[0];
  greedy = sums[1];
  if (threadIdx.x == 0 && l.key_blocks != nullptr) {
    l.key_blocks[2 * head] = int64_t(natural);
    l.key_blocks[2 * head + 1] = int64_t(greedy);
  }
  const int rows = l.mask.rows;
  const bool keep_natural = natural <= greedy;
  int32_t* order = l.q_units + head * l.num_slots;
  for (int i = threadIdx.x; i < l.num_slots; i += kChooseThreads) {
    if (i >= rows)
      order[i] = -1;
    else if (keep_natural)
      order[i] = i;
  }
}

// ------------------------------------------------------------------ host launcher

inline int64_t shared_bytes(const Layout& l) {
  return carve(l.ring, l.ld, l.words).end * int64_t(sizeof(uint32_t));
}

// Checks `p` (cudaErrorInvalidValue) and lays the launch out for a device with `max_shared` bytes of
// shared memory per CTA (cudaErrorInvalidConfiguration where the ring or the window does not fit).
inline cudaError_t make_layout(const TesseraGroupParams& p, int max_shared, Layout* l) {
  if (!prep::valid_mask(p.mask) || p.q_units == nullptr || p.segment_key_blocks == nullptr || p.group < 1 ||
      p.window < 1 || p.segment < 0 || p.segment % p.group != 0)
    return cudaErrorInvalidValue;
  if (int64_t(p.num_slots) != int64_t(prep::ceil_div(p.mask.rows, p.group)) * p.group) return cudaErrorInvalidValue;
  // From here on `rows` are a segment's: the ring and the window are per CTA.
  const int rows = p.segment == 0 || p.segment >= p.mask.rows ? p.mask.rows : p.segment;
  l->mask = p.mask;
  l->group = p.group;
  l->segment = rows;
  l->segments = prep::ceil_div(p.mask.rows, rows);
  l->window = p.window < rows - 1 ? p.window : rows - 1;
  l->num_slots = p.num_slots;
  l->words = prep::ceil_div(p.mask.cols, 32);
  l->ld = l->words | 1;
  l->contiguous = p.mask.stride[3] == 1;
  l->q_units = p.q_units;
  l->key_blocks = p.key_blocks;
  l->segment_key_blocks = p.segment_key_blocks;
  if (l->window > kMaxWindow || p.mask.cols > kMaxCols ||
      int64_t(p.mask.batch) * p.mask.heads * l->segments > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  const int64_t needed = int64_t(l->window) + p.group + 1;  // rows a group may read, plus one
  for (const int64_t extra : {int64_t(kLookahead), int64_t(0)}) {
    l->ring = int(needed + extra < rows ? needed + extra : rows);
    // A producer may pack rows below (last published seed) + R; the picker needs them below
    // seed + R - extra, so publishing every extra / 2 rows leaves half the lookahead to the producers.
    l->publish_step = l->ring == rows ? rows : int(extra / 2 > 1 ? extra / 2 : 1);
    if (shared_bytes(*l) <= max_shared) return cudaSuccess;
  }
  return cudaErrorInvalidConfiguration;
}

template <int kPerLane>
int launch_kernels(const Layout& l, cudaStream_t stream) {
  const int bytes = int(shared_bytes(l));
  // The attribute is per device, so it is set on every launch (a host-side call of ~1 us).
  const auto kernel = group_segment_kernel<kPerLane>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return int(err);
  const int64_t heads = int64_t(l.mask.batch) * l.mask.heads;
  kernel<<<unsigned(heads * l.segments), kThreads, bytes, stream>>>(l);
  err = cudaGetLastError();
  if (err != cudaSuccess) return int(err);
  choose_order_kernel<<<unsigned(heads), kChooseThreads, 0, stream>>>(l);
  return int(cudaGetLastError());
}

inline int launch_group_query_blocks(const TesseraGroupParams& p, cudaStream_t stream) {
  int device = 0, max_shared = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return int(err);
  Layout l;
  err = make_layout(p, max_shared, &l);
  if (err != cudaSuccess) return int(err);
  // Candidates per lane: the fewest that hold the window (registers, fully unrolled).
  if (l.window <= 2 * 32) return launch_kernels<2>(l, stream);
  if (l.window <= 8 * 32) return launch_kernels<8>(l, stream);
  static_assert(kMaxWindow == 32 * 32, "the widest instantiation holds kMaxWindow candidates");
  return launch_kernels<32>(l, stream);
}

}  // namespace tessera::regroup
