// The C ABI of the 8-bit attention path (tessera/quantized/params.h): the 8-bit kernels by id and
// the quantization pass. Each entry point checks what its kernels trust before any launch.
#include <cuda_runtime.h>

#include "tessera/quantized/params.h"
#include "tessera/quantized/quantize.cuh"
#include "tessera/tasks.cuh"
#include "registry_quantized.inc"  // generated: declarations + TESSERA_QUANTIZED_ENTRIES

namespace {

struct QuantizedEntry {
  const char* name;
  int (*smem_bytes)();
  int (*launch)(const TesseraQuantizedParams&, cudaStream_t);
  int (*ctas_per_sm)();
  tessera::quantized::KernelLimits (*limits)();
};

const QuantizedEntry kEntries[] = {TESSERA_QUANTIZED_ENTRIES};
constexpr int kNumEntries = int(sizeof(kEntries) / sizeof(kEntries[0]));

bool valid_id(int id) { return id >= 0 && id < kNumEntries; }

constexpr int kMinUnitLog2 = 4;   // a query unit or KV slot holds at least 16 rows or tokens
constexpr int kMaxUnitLog2 = 15;
constexpr int kMaxGridY = 65535;  // (b, h) pairs of the quantization launches
constexpr int kMembershipBits = 64;  // one int64 membership word per KV tile (as prepare.cuh)

int ceil_div(int a, int b) { return int((int64_t(a) + b - 1) / b); }

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % uintptr_t(bytes) == 0; }

bool strides_multiple_of(const int64_t (&stride)[3], int64_t elements) {
  return stride[0] % elements == 0 && stride[1] % elements == 0 && stride[2] % elements == 0;
}

bool padded_kv(int seq_kv, int seq_kv_padded) {
  return seq_kv_padded >= seq_kv && seq_kv_padded % TESSERA_QUANTIZED_ALIGN == 0;
}

// What an 8-bit kernel trusts in `qp`: the plan's metadata as the 16-bit launch checks it
// (library.cu), the 8-bit buffers of the quantization pass, and the static schedule.
bool valid_attention(const TesseraQuantizedParams& qp, const tessera::quantized::KernelLimits& k) {
  const TesseraAttnParams& p = qp.attn;
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr || p.tile_counts == nullptr ||
      p.tile_slots == nullptr || p.tile_member == nullptr || p.q_order == nullptr || qp.q_scale == nullptr ||
      qp.k_scale == nullptr || qp.lse_shift == nullptr)
    return false;
  if (!k.pv16 && (qp.v_scale == nullptr || qp.v_mean == nullptr)) return false;  // an 8-bit P V restores V with them
  if (p.task_counter != nullptr) return false;  // the 8-bit kernels take tasks by static striding only
  if (p.batch < 1 || p.heads < 1 || p.seq_q < 1 || p.seq_kv < 1 || !padded_kv(p.seq_kv, qp.seq_kv_padded)) return false;
  if ((p.mask_batch != 1 && p.mask_batch != p.batch) || (p.mask_heads != 1 && p.mask_heads != p.heads)) return false;
  if (p.q_unit_log2 < kMinUnitLog2 || p.q_unit_log2 > kMaxUnitLog2 || p.kv_unit_log2 < kMinUnitLog2 ||
      p.kv_unit_log2 > kMaxUnitLog2)
    return false;
  if (p.slots < 1 || p.slots > k.max_slots || (p.slots << p.kv_unit_log2) != k.tile_kv) return false;
  const int q_unit = 1 << p.q_unit_log2;
  if (k.tile_q % q_unit != 0 || (k.tile_q / q_unit) * p.slots > kMembershipBits) return false;
  if (p.num_q_tiles != ceil_div(p.seq_q, k.tile_q) || p.capacity < 0 || p.grid_size < 0) return false;
  if (p.num_splits < 1 || (p.num_splits > 1 && (p.o_partial == nullptr || p.lse_partial == nullptr))) return false;
  const int64_t tasks = int64_t(p.num_q_tiles) * p.batch * p.heads * p.num_splits;
  if (tasks > INT32_MAX) return false;
  // TMA and bulk copies read 16-byte aligned buffers; the epilogue reads v_scale / v_mean in pairs.
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.v, 16) || !aligned(qp.k_scale, 16) ||
      !aligned(qp.q_scale, 4) || !aligned(qp.v_scale, 8) || !aligned(qp.v_mean, 8) || !aligned(qp.lse_shift, 4))
    return false;
  return aligned(p.o, 2) && aligned(p.lse, 4) && aligned(p.o_partial, 8) && aligned(p.lse_partial, 4) &&
         aligned(p.tile_counts, 4) && aligned(p.tile_slots, 4) && aligned(p.tile_member, 8) && aligned(p.q_order, 4) &&
         aligned(p.q_units, 4);
}

// What the quantization pass trusts in `p`.
bool valid_quantize(const TesseraQuantizeParams& p) {
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.q8 == nullptr || p.q_scale == nullptr ||
      p.k8 == nullptr || p.k_scale == nullptr || p.k_mean == nullptr || p.lse_shift == nullptr || p.partials == nullptr)
    return false;
  // V's outputs come all together (an 8-bit P V) or not at all (a 16-bit one reads v itself).
  if ((p.v8 == nullptr) != (p.v_scale == nullptr) || (p.v8 == nullptr) != (p.v_mean == nullptr)) return false;
  if (p.batch < 1 || p.heads < 1 || p.seq_q < 1 || p.seq_kv < 1 || !padded_kv(p.seq_kv, p.seq_kv_padded)) return false;
  if (int64_t(p.batch) * p.heads > kMaxGridY) return false;
  if (p.head_dim != TESSERA_QUANTIZED_HEAD_DIM || (p.dtype != TESSERA_BF16 && p.dtype != TESSERA_FP16)) return false;
  if (p.segments < 1 || p.segments > p.seq_kv || p.segments > kMaxGridY) return false;
  // Rows are read four elements (8 bytes) at a time.
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.v, 16) || !strides_multiple_of(p.q_stride, 8) ||
      !strides_multiple_of(p.k_stride, 8) || !strides_multiple_of(p.v_stride, 8))
    return false;
  return aligned(p.q8, 16) && aligned(p.k8, 16) && aligned(p.v8, 16) && aligned(p.k_mean, 16) &&
         aligned(p.q_scale, 4) && aligned(p.k_scale, 4) && aligned(p.v_scale, 4) && aligned(p.v_mean, 4) &&
         aligned(p.lse_shift, 4) && aligned(p.partials, 4);
}

}  // namespace

extern "C" {

int tessera_quantized_num_kernels(void) { return kNumEntries; }
const char* tessera_quantized_kernel_name(int id) { return valid_id(id) ? kEntries[id].name : nullptr; }
int tessera_quantized_kernel_smem_bytes(int id) { return valid_id(id) ? kEntries[id].smem_bytes() : -1; }
int tessera_quantized_kernel_ctas_per_sm(int id) { return valid_id(id) ? kEntries[id].ctas_per_sm() : -1; }

int tessera_quantized_struct_bytes(int which) {
  switch (which) {
    case TESSERA_STRUCT_QUANTIZED_ATTN: return int(sizeof(TesseraQuantizedParams));
    case TESSERA_STRUCT_QUANTIZE: return int(sizeof(TesseraQuantizeParams));
    default: return -1;
  }
}

int tessera_quantize(const TesseraQuantizeParams* params, void* stream) {
  if (params == nullptr || !valid_quantize(*params)) return int(cudaErrorInvalidValue);
  return tessera::quantized::launch_quantize(*params, static_cast<cudaStream_t>(stream));
}

int tessera_quantized_attention_forward(int id, const TesseraQuantizedParams* params, void* stream) {
  if (!valid_id(id) || params == nullptr || !valid_attention(*params, kEntries[id].limits()))
    return int(cudaErrorInvalidValue);
  return kEntries[id].launch(*params, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
