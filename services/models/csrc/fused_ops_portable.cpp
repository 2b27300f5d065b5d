// The fused elementwise kernels for any CPU (GCC vector extensions at the baseline target:
// SSE2 on x86-64, NEON on Arm).
// See fused_ops_kernel.h.

#include <stdint.h>
#include <string.h>

#include "fused_ops_isa.h"

#define PDSERVE_FUSED_OPS fused_ops_portable
#include "fused_ops_kernel.h"
