// The interface between the fp32 few-row linear op (fp32_linear.cpp, built for the baseline ISA)
// and its kernel variants (fp32_linear_<isa>.cpp), on the same terms as paged_attention_isa.h:
// plain structs and function pointers, no vector types.
#pragma once

#include <cstdint>

#include "linear_epilogue.h"

namespace pdserve {

// The width of oneDNN's fp32 weight panels: it packs an [out_features, in_features] fp32 weight
// for its AVX-512 and AVX2 kernels as [out/64][in][64], each panel's 64 output columns
// contiguous for every input (fp32_linear.py checks that layout before the kernel reads it).
constexpr int64_t kFp32Panel = 64;

// out = epilogue(x @ weight^T + bias), every tensor fp32.
struct Fp32LinearArgs {
  const float* x;       // [num_rows, in_features]
  const float* weight;  // [out_features / 64][in_features][64]
  const float* bias;    // [out_features] or nullptr
  const float* other;   // [num_rows, out_features] (kMul) or nullptr
  float* out;           // [num_rows, out_features]
  int64_t num_rows, in_features, out_features;
  LinearEpilogue epilogue;
};

// The output columns [64 * panel_begin, 64 * panel_end) of every row, on the calling thread.
using RunFp32Panels = void (*)(const Fp32LinearArgs& args, int64_t panel_begin,
                               int64_t panel_end);

void fp32_linear_panels_portable(const Fp32LinearArgs& args, int64_t panel_begin,
                                 int64_t panel_end);
#if defined(__x86_64__)
void fp32_linear_panels_avx2(const Fp32LinearArgs& args, int64_t panel_begin, int64_t panel_end);
void fp32_linear_panels_avx512(const Fp32LinearArgs& args, int64_t panel_begin,
                               int64_t panel_end);
#endif

}  // namespace pdserve
