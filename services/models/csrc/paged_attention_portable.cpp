// The paged decode attention kernel for any CPU: GCC vector extensions at 4 fp32 lanes (SSE2
// on x86-64, NEON on Arm), no intrinsics.
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, so that only this kernel uses the ISA and the op
// (paged_attention.cpp) calls it only after checking the CPU (never SIGILL).

#include <stdint.h>
#include <string.h>

#include "paged_attention_isa.h"

#define PDSERVE_RUN_ITEMS run_items_portable
#include "paged_attention_kernel.h"
