// The argument checks the two few-row linear ops (amx_linear.cpp, fp32_linear.cpp) share; each
// error names the op and the argument. Only the ops include this (it needs ATen); their kernels
// take linear_epilogue.h alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>

#include "linear_epilogue.h"

namespace pdserve {

// The element type a few-row linear op computes in, with the name its errors give it.
struct LinearDtype {
  at::ScalarType type;
  const char* name;  // "bfloat16", "float32"
};

// A tensor argument of the op: of its dtype, on the CPU, contiguous.
inline void check_linear_tensor(const char* op, LinearDtype dtype, const at::Tensor& t,
                                const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype.type, op, ": ", name, " must be ", dtype.name, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// x [num_rows, in_features]; the epilogue's name; bias [out_features] when given; other
// [num_rows, out_features] given exactly when the epilogue is mul. Returns the epilogue.
inline LinearEpilogue check_linear_args(const char* op, LinearDtype dtype, const at::Tensor& x,
                                        int64_t in_features, int64_t out_features,
                                        const std::optional<at::Tensor>& bias,
                                        const std::string& epilogue,
                                        const std::optional<at::Tensor>& other) {
  check_linear_tensor(op, dtype, x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, op, ": x must be [num_rows, ",
              in_features, "], got ", x.sizes());
  LinearEpilogue kind;
  TORCH_CHECK(parse_linear_epilogue(epilogue, &kind), op,
              ": epilogue must be none, silu or mul, got '", epilogue, "'");
  if (bias) {
    check_linear_tensor(op, dtype, *bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, op, ": bias must be [",
                out_features, "], got ", bias->sizes());
  }
  TORCH_CHECK(other.has_value() == (kind == LinearEpilogue::kMul), op,
              ": other is given exactly when the epilogue is mul");
  if (other) {
    check_linear_tensor(op, dtype, *other, "other");
    TORCH_CHECK(other->dim() == 2 && other->size(0) == x.size(0) &&
                    other->size(1) == out_features,
                op, ": other must be [", x.size(0), ", ", out_features, "], got ",
                other->sizes());
  }
  return kind;
}

}  // namespace pdserve
