// The prefill attention kernel for CPUs with AVX2 and FMA: 8 fp32 lanes.
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, so that only this kernel uses the ISA and the op
// (prefill_attention.cpp) calls it only after checking the CPU (never SIGILL).

#include <stdint.h>
#include <string.h>

#include "prefill_attention_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC target("avx2,fma")
#define PDSERVE_AVX2 1
#define PDSERVE_RUN_PREFILL_ITEMS run_prefill_items_avx2
#include "prefill_attention_kernel.h"
#endif
