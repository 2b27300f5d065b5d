// The fp32 few-row linear kernel for any CPU (GCC vector extensions at the baseline target:
// SSE2 on x86-64, NEON on Arm). See fp32_linear_kernel.h.

#include <stdint.h>
#include <string.h>

#include "fp32_linear_isa.h"

#define PDSERVE_FP32_LINEAR_PANELS fp32_linear_panels_portable
#define PDSERVE_QUANTIZED_LINEAR_PANELS quantized_linear_panels_portable
#define PDSERVE_DEQUANTIZE_PANELS dequantize_panels_portable
#include "fp32_linear_kernel.h"
