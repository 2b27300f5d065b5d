// The prefill attention kernel for CPUs with AVX-512 F, BW, VL and AVX512-BF16: the
// AVX-512 kernel with vcvtneps2bf16 stores, and a bf16 query and cache multiplied in bf16 pairs
// on vdpbf16ps (prefill_attention_kernel.h, attend_dpbf16).
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, so that only this kernel uses the ISA and the op
// (prefill_attention.cpp) calls it only after checking the CPU (never SIGILL).

#include <stdint.h>
#include <string.h>

#include "prefill_attention_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")
#define PDSERVE_AVX512 1
#define PDSERVE_AVX512_BF16 1
#define PDSERVE_RUN_PREFILL_ITEMS run_prefill_items_avx512_bf16
#include "prefill_attention_kernel.h"
#endif
