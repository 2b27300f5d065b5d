// What pdserve's few-row linear kernels (amx_linear*.cpp, fp32_linear*.cpp) apply to each fp32
// accumulator, bias added first, before the output is stored: the post-ops oneDNN's packed
// linears take, so that either kernel stands in for oneDNN's on the same weights.
#pragma once

#include <cstdint>
#include <string>

namespace pdserve {

enum class LinearEpilogue : int32_t {
  kNone = 0,
  kSilu = 1,  // x / (1 + exp(-x)): oneDNN's "swish" post-op
  kMul = 2,   // x * other[row, col]: oneDNN's "mul" binary post-op
};

// "none", "silu" or "mul" into *out; false for anything else (the op says so, naming it).
inline bool parse_linear_epilogue(const std::string& name, LinearEpilogue* out) {
  if (name == "none") {
    *out = LinearEpilogue::kNone;
  } else if (name == "silu") {
    *out = LinearEpilogue::kSilu;
  } else if (name == "mul") {
    *out = LinearEpilogue::kMul;
  } else {
    return false;
  }
  return true;
}

}  // namespace pdserve
