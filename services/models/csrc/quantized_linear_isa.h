// The interface between the quantized linear op (quantized_linear.cpp, built for the baseline
// ISA) and its kernel variants, which fp32_linear_<isa>.cpp compile beside the fp32 kernel's
// (fp32_linear_kernel.h): plain structs and function pointers, no vector types.
#pragma once

#include <cstdint>

#include "fp32_linear_isa.h"

namespace pdserve {

// out = x @ weight^T + bias, x and out fp32, the weight as codes in the fp32 kernel's panel
// layout with a float32 scale (and offset) per `group` inputs of each output column:
//   weight[64 p + c][k] = codes[p][k][c] * scales[p][k / group][c] (+ offsets[p][k / group][c])
// with 8-bit codes (int8), or 4-bit ones (0-15) two a byte: code[p][k][c] is the low nibble of
// byte [p][k / 2][c] for an even k, its high nibble for an odd one.
struct QuantizedLinearArgs {
  Fp32LinearArgs base;   // x, bias, out, sizes; base.weight is unused (nullptr)
  const int8_t* codes;   // [out_features / 64][in_features * bits / 8][64]
  const float* scales;   // [out_features / 64][in_features / group][64]
  const float* offsets;  // the same shape, or nullptr (a symmetric format: Q8_0, Q4_0, Q6_K)
  int64_t group;         // inputs per scale: 16 or 32 (a divisor of 64: whole groups a block)
  int64_t bits;          // 8 or 4 (then offsets are given: the codes are unsigned)
};

// The output columns [64 * panel_begin, 64 * panel_end) of every row, on the calling thread.
using RunQuantizedPanels = void (*)(const QuantizedLinearArgs& args, int64_t panel_begin,
                                    int64_t panel_end);

// Panels [panel_begin, panel_end) of the weight, dequantized, into columns of its transpose:
// out[k * stride + 64 (p - first_panel) + c] = weight[64 p + c][k].
using RunDequantizePanels = void (*)(const QuantizedLinearArgs& args, int64_t panel_begin,
                                     int64_t panel_end, int64_t first_panel, float* out,
                                     int64_t stride);

void dequantize_panels_portable(const QuantizedLinearArgs& args, int64_t panel_begin,
                                int64_t panel_end, int64_t first_panel, float* out,
                                int64_t stride);
#if defined(__x86_64__)
void dequantize_panels_avx2(const QuantizedLinearArgs& args, int64_t panel_begin,
                            int64_t panel_end, int64_t first_panel, float* out,
                            int64_t stride);
void dequantize_panels_avx512(const QuantizedLinearArgs& args, int64_t panel_begin,
                              int64_t panel_end, int64_t first_panel, float* out,
                              int64_t stride);
#endif

void quantized_linear_panels_portable(const QuantizedLinearArgs& args, int64_t panel_begin,
                                      int64_t panel_end);
#if defined(__x86_64__)
void quantized_linear_panels_avx2(const QuantizedLinearArgs& args, int64_t panel_begin,
                                  int64_t panel_end);
void quantized_linear_panels_avx512(const QuantizedLinearArgs& args, int64_t panel_begin,
                                    int64_t panel_end);
#endif

}  // namespace pdserve
