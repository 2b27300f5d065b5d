// The next weights' prefetch of the few-row linear kernels (bf16_linear_avx512_bf16.cpp: the
// next panel; fp32_linear_kernel.h: the next 256-input block of a panel): while a thread
// multiplies the current ones by every row, it asks for the next ones' cache lines into the L2, a
// few at every step of the current work, spread evenly over it, so that the weight stream runs
// under the arithmetic instead of taking turns with it. In an anonymous namespace, like simd.h: each variant's file gets its own copy.
#pragma once

#include <stdint.h>

#include "simd.h"

namespace {

constexpr int64_t kLineBytes = 64;  // a cache line

// The next panel's lines, a few at every step of this panel's work: `steps` steps in all, and
// after step s the first (s * lines) / steps lines have been asked for (fixed point: no division
// in the loop).
class PanelPrefetch {
 public:
  PanelPrefetch(const void* next, int64_t lines, int64_t steps)
      : next_(static_cast<const char*>(next)),
        lines_(next ? lines : 0),
        scale_(steps > 0 ? (lines << 16) / steps : 0) {}

  void step() {
    ++steps_;
    const int64_t due = min64(lines_, (steps_ * scale_) >> 16);
    for (; done_ < due; ++done_) {
      prefetch_line_l2(next_ + done_ * kLineBytes);
    }
  }

  // The lines the fixed point rounded away.
  void finish() {
    for (; done_ < lines_; ++done_) {
      prefetch_line_l2(next_ + done_ * kLineBytes);
    }
  }

 private:
  const char* next_;
  int64_t lines_, scale_;
  int64_t steps_ = 0, done_ = 0;
};

}  // namespace
