// See cpu_isa.h. __builtin_cpu_supports reads cpuid and, for AVX and AVX-512, whether the OS
// saves their registers.

#include "cpu_isa.h"

#include <c10/util/Exception.h>

namespace pdserve {

void check_cpu_runs(const std::string& isa, const char* op) {
  if (isa == "portable") {
    return;
  }
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  if (isa == "avx2" || isa == "avx512" || isa == "avx512_bf16") {
    const bool ok = isa == "avx2"     ? avx2
                    : isa == "avx512" ? avx512
                                      : avx512 && __builtin_cpu_supports("avx512bf16");
    TORCH_CHECK(ok, op, ": this CPU cannot run the ", isa,
                " kernel (it lacks some of its instructions); use a variant it supports");
    return;
  }
#endif
  TORCH_CHECK(false, op, ": unknown or unavailable kernel variant '", isa,
              "' (avx512_bf16, avx512 and avx2 on x86-64; portable everywhere)");
}

}  // namespace pdserve
