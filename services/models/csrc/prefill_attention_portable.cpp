// The prefill attention kernel for any CPU: GCC vector extensions at 4 fp32 lanes (SSE2
// on x86-64, NEON on Arm), no intrinsics.
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, so that only this kernel uses the ISA and the op
// (prefill_attention.cpp) calls it only after checking the CPU (never SIGILL).

#include <stdint.h>
#include <string.h>

#include "prefill_attention_isa.h"

#define PDSERVE_RUN_PREFILL_ITEMS run_prefill_items_portable
#include "prefill_attention_kernel.h"
