// The element type of a paged KV cache, as the attention kernels and the cache write take it:
// fp32, bf16 or fp8 E5M2 (torch.float8_e5m2, vLLM's fp8_e5m2), each independently of the query's
// or the written rows' fp32 or bf16. Shared by the ops' interfaces (paged_attention_isa.h,
// prefill_attention_isa.h, fused_ops_isa.h) and the kernels' dispatch (simd.h's
// with_element_types); like those interfaces, free of torch and of templates.
#pragma once

#include <stdint.h>

namespace pdserve {

enum class CacheType : uint8_t {
  kFloat,
  kBf16,
  // 1 sign, 5 exponent, 2 mantissa bits: an IEEE half's top byte. Every value widens exactly to
  // fp32 (and bf16); written rows are rounded to nearest even, overflowing to infinity.
  kFp8E5M2,
};

}  // namespace pdserve
