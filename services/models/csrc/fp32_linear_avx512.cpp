// The fp32 few-row linear kernel for CPUs with AVX-512 F, BW and VL (also the avx512_bf16
// variant's: no bf16 here).
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, and the op (fp32_linear.cpp) calls it only after
// checking the CPU (never SIGILL). See fp32_linear_kernel.h.

#include <stdint.h>
#include <string.h>

#include "fp32_linear_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
#define PDSERVE_AVX512 1
#define PDSERVE_FP32_LINEAR_PANELS fp32_linear_panels_avx512
#define PDSERVE_QUANTIZED_LINEAR_PANELS quantized_linear_panels_avx512
#define PDSERVE_DEQUANTIZE_PANELS dequantize_panels_avx512
#include "fp32_linear_kernel.h"
#endif
