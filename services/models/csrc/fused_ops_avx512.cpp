// The fused elementwise kernels for CPUs with AVX-512 F, BW and VL.
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, and the ops (fused_ops.cpp) call it only after
// checking the CPU (never SIGILL). See fused_ops_kernel.h.

#include <stdint.h>
#include <string.h>

#include "fused_ops_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
#define PDSERVE_AVX512 1
#define PDSERVE_FUSED_OPS fused_ops_avx512
#include "fused_ops_kernel.h"
#endif
