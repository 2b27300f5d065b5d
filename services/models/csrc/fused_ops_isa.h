// The interface between the fused elementwise ops (fused_ops.cpp, built for the baseline ISA) and
// their kernel variants (fused_ops_<isa>.cpp, each built for its own instruction set), on the
// same terms as paged_attention_isa.h: plain structs and function pointers, no vector types.
#pragma once

#include <cstdint>

#include "cache_type.h"

namespace pdserve {

// hidden = round(hidden + addend) when addend is given (the residual stream, in place), then
// out = round(weight * round(hidden * rsqrt(mean(hidden^2) + eps))): transformers' LlamaRMSNorm
// order, rounding to the element type where torch's bf16 ops round.
struct NormArgs {
  void* hidden;         // [num_rows, width]
  const void* addend;   // [num_rows, width] or nullptr
  const void* weight;   // [width]
  void* out;            // [num_rows, width]
  int64_t width;
  float eps;
  bool is_bf16;         // element type of every tensor: bf16 or float
};

// In place, rotating halves (transformers' rotate_half): for i < head_dim / 2,
//   x[i]     = round(round(x[i] * cos[i]) + round(-x[i + h] * sin[i]))
//   x[i + h] = round(round(x[i + h] * cos[i + h]) + round(x[i] * sin[i + h]))
// of every head of the query and the key rows: the bits of q * cos + rotate_half(q) * sin (but
// for an fp32 denormal in between, which the AVX512-BF16 variant flushes to zero: simd.h).
struct RotaryArgs {
  void* query;               // rows of num_heads x head_dim, row i at query + i * query_stride
  void* key;                 // rows of num_kv_heads x head_dim
  const void* cos;           // [num_rows, head_dim]
  const void* sin;           // [num_rows, head_dim]
  int64_t query_stride, key_stride;  // elements between rows (the fused QKV output's width)
  int64_t num_heads, num_kv_heads, head_dim;
  bool is_bf16;
};

// out = round(round(silu(gate)) * up), gate and up the halves of each gate_up row.
struct SiluMulArgs {
  const void* gate_up;  // [num_rows, 2 * width]
  void* out;            // [num_rows, width]
  int64_t width;
  bool is_bf16;
};

// out[row] = the first index of the maximum of logits[row], a NaN counting as the maximum (the
// first NaN then): torch's argmax / max(dim).indices.
struct ArgmaxArgs {
  const void* logits;  // [num_rows, width]
  int64_t* out;        // [num_rows]
  int64_t width;       // > 0
  bool is_bf16;
};

// key_cache[slots[i]] = round(key[i]) and value_cache[slots[i]] = round(value[i]) for each token
// row i: its num_kv_heads x head_dim elements rounded to the caches' element type (c10's
// round-to-nearest-even, as .to() rounds): the bits of index_copy_ of the converted rows, in one
// pass instead of a conversion and two copies. Into bf16, a NaN's aside (c10's 0x7fc0 where
// torch's vectorised conversion gives 0xffff) and on AVX512-BF16 an fp32 denormal, flushed to
// zero (simd.h's store); into fp8 E5M2, without exception (overflow to infinity, NaN to 0x7f:
// simd.h's round_to_e5m2). The slots are distinct (a step writes a slot once) and in range (the
// op checks).
struct KvWriteArgs {
  const void* key;      // rows of row_width elements, key_stride apart (views of the QKV output)
  const void* value;    // likewise, value_stride apart
  void* key_cache;      // [num_slots, row_width]
  void* value_cache;    // [num_slots, row_width]
  const int64_t* slots;  // [num_rows]
  int64_t key_stride, value_stride, row_width;
  bool is_bf16;          // element type of key and value: bf16 or float
  CacheType cache_type;  // that of the caches, independently
};

// Rows [begin, end) on the calling thread.
struct FusedOps {
  void (*rms_norm)(const NormArgs& args, int64_t begin, int64_t end);
  void (*rotary)(const RotaryArgs& args, int64_t begin, int64_t end);
  void (*silu_and_mul)(const SiluMulArgs& args, int64_t begin, int64_t end);
  void (*argmax)(const ArgmaxArgs& args, int64_t begin, int64_t end);
  void (*write_kv_cache)(const KvWriteArgs& args, int64_t begin, int64_t end);
};

// One per kernel variant; the AVX ones exist only in x86-64 builds.
FusedOps fused_ops_portable();
#if defined(__x86_64__)
FusedOps fused_ops_avx2();
FusedOps fused_ops_avx512();
FusedOps fused_ops_avx512_bf16();
#endif

}  // namespace pdserve
