// Whether this CPU executes a kernel variant's instructions: checked by every op before it calls
// a variant, so that forcing one the CPU lacks is an error, never SIGILL.
#pragma once

#include <string>

namespace pdserve {

// Raises (TORCH_CHECK) unless `isa` names a variant ("avx512_bf16", "avx512", "avx2" on x86-64,
// "portable" everywhere) that this CPU runs; `op` names the caller in the message.
void check_cpu_runs(const std::string& isa, const char* op);

}  // namespace pdserve
