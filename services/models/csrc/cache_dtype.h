// A KV cache tensor's dtype as the kernels take it (cache_type.h), checked the same way by the
// three ops that read or write a cache (paged_attention.cpp, prefill_attention.cpp,
// fused_ops.cpp). Only the ops include this (it needs ATen); the kernels take cache_type.h alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "cache_type.h"

namespace pdserve {

// key_cache's CacheType: float32, bfloat16 or float8_e5m2, with value_cache of the same dtype.
inline CacheType check_cache_dtypes(const char* op, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache) {
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kFloat8_e5m2, op,
              ": key_cache must be float32, bfloat16 or float8_e5m2, got ", dtype);
  TORCH_CHECK(value_cache.scalar_type() == dtype, op, ": value_cache must have key_cache's dtype ",
              dtype, ", got ", value_cache.scalar_type());
  return dtype == at::kBFloat16       ? CacheType::kBf16
         : dtype == at::kFloat8_e5m2 ? CacheType::kFp8E5M2
                                     : CacheType::kFloat;
}

}  // namespace pdserve
