// The interface between the AMX linear op (amx_linear.cpp, built for the baseline ISA) and its
// kernel (amx_linear_amx.cpp, built for AMX), on the same terms as paged_attention_isa.h: plain
// structs and function pointers, no vector or tile types.
#pragma once

#include <cstdint>

#include "linear_epilogue.h"

namespace pdserve {

// out = epilogue(x @ weight^T + bias), every tensor bf16, accumulated in fp32.
struct AmxLinearArgs {
  // [num_rows, in_features]; the kernel reads its whole groups of 16 rows in place.
  const void* x;
  // [16, in_features]: x's rows past its last whole group of 16, then zeros; nullptr when
  // num_rows is a multiple of 16.
  const void* tail;
  // oneDNN's AB16b32a2b layout of the [out_features, in_features] weight, which is the AMX
  // B-tile layout: [out/32][in/32][16 pairs of inputs][32 outputs][2 inputs of the pair].
  const void* weight;
  const void* bias;   // [out_features] or nullptr
  const void* other;  // [num_rows, out_features] (kMul) or nullptr
  void* out;          // [num_rows, out_features]
  int64_t num_rows, in_features, out_features;
  LinearEpilogue epilogue;  // applied before rounding to bf16
};

// Why this process cannot run the kernel ("" when it can): the CPU lacks AMX-BF16 / AMX-TILE /
// AVX512-BF16, the build is not x86-64, or the kernel refused the tile-data permission. Asks for
// that permission (once per process; Linux requires it before the first tile instruction).
const char* amx_unavailable_reason();

// The output columns [32 * block_begin, 32 * block_end) of every row, on the calling thread.
// Only after amx_unavailable_reason() returned "".
void amx_linear_blocks(const AmxLinearArgs& args, int64_t block_begin, int64_t block_end);

}  // namespace pdserve
