// The prefill attention kernel for CPUs with AMX-BF16 (and AVX512-BF16): bf16 query and cache
// multiply on the AMX tiles, everything else as in the AVX512-BF16 variant
// (prefill_attention_kernel.h, attend_amx).
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, and the op (prefill_attention.cpp) calls it only
// after amx_unavailable_reason() said yes (never SIGILL; the tile-data permission is asked for).

#include <stdint.h>
#include <string.h>

#include "prefill_attention_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#define PDSERVE_AVX512 1
#define PDSERVE_AVX512_BF16 1
#define PDSERVE_AMX 1
#define PDSERVE_RUN_PREFILL_ITEMS run_prefill_items_amx
#include "prefill_attention_kernel.h"
#endif
