// The interface between the bf16 few-row linear op (bf16_linear.cpp, built for the baseline ISA)
// and its kernel (bf16_linear_avx512_bf16.cpp), on the same terms as paged_attention_isa.h:
// plain structs and function pointers, no vector types.
#pragma once

#include <cstdint>

#include "linear_epilogue.h"

namespace pdserve {

// The width of oneDNN's bf16 weight panels on a CPU with AVX512-BF16 and no AMX: it packs an
// [out_features, in_features] bf16 weight as [out/64][in/2][64][2], each panel's 64 output
// columns contiguous for every pair of inputs, as vdpbf16ps multiplies them (bf16_linear.py
// checks that layout before the kernel reads it).
constexpr int64_t kBf16Panel = 64;

// out = epilogue(x @ weight^T + bias), every tensor bf16 (as its bits), fp32 sums.
struct Bf16LinearArgs {
  const uint16_t* x;       // [num_rows, in_features]
  const uint16_t* weight;  // [out_features / 64][in_features / 2][64][2]
  const uint16_t* bias;    // [out_features] or nullptr
  const uint16_t* other;   // [num_rows, out_features] (kMul) or nullptr
  uint16_t* out;           // [num_rows, out_features]
  int64_t num_rows, in_features, out_features;
  LinearEpilogue epilogue;
};

// The output columns [64 * panel_begin, 64 * panel_end) of every row, on the calling thread.
#if defined(__x86_64__)
void bf16_linear_panels_avx512_bf16(const Bf16LinearArgs& args, int64_t panel_begin,
                                    int64_t panel_end);
#endif

}  // namespace pdserve
