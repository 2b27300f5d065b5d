// The fp32 few-row linear kernel, compiled once per instruction set: each fp32_linear_<isa>.cpp
// defines PDSERVE_<ISA> macros, switches the compiler's target to that ISA and includes this
// file, which defines PDSERVE_FP32_LINEAR_PANELS. See fp32_linear.cpp for the op.
//
// Why: a decode step multiplies a few rows (one per sequence) by every weight. In fp32 (what
// `--dtype auto` picks where bf16 arithmetic is slow) that is compute-bound at 64 rows, yet
// oneDNN's kernel runs at about three quarters of its own cache-resident rate when the weights
// come from memory: the arithmetic and the weight stream take turns. This kernel reads the same
// packed buffer, and while it multiplies one 64-column panel by every row it prefetches the
// thread's next panel into the L2, a line every few steps, spread evenly over the panel's work,
// so that the stream runs under the arithmetic (docs/benchmarks.md, issue 21).
//
// A panel is [in_features][64]: for each input k, the 64 output columns' weights, contiguous.
// Rows go kRows at a time through a register tile of kRows x kVecs accumulators (kVecs vectors,
// kVecs x kLanes columns); each step broadcasts x[r][k] and multiplies it by kVecs weight
// vectors. Columns of a panel past kVecs x kLanes (all but AVX-512) take further passes.
//
// Deliberately free of torch and of standard-library templates, like paged_attention_kernel.h.

#ifndef PDSERVE_FP32_LINEAR_PANELS
#error "include from an fp32_linear_<isa>.cpp that defines PDSERVE_FP32_LINEAR_PANELS"
#endif

#include "panel_prefetch.h"
#include "simd.h"

namespace {

using pdserve::kFp32Panel;
using pdserve::LinearEpilogue;

// The register tile: kRows x kVecs accumulators. AVX-512: 6 x 4 = 24 of its 32 registers, and
// 4 for the weights; 16-register ISAs 6 x 2 = 12, 2 for the weights and one for the broadcast
// (they have no broadcast operand).
constexpr int64_t kRows = 6;
#if defined(PDSERVE_AVX512)
constexpr int64_t kVecs = 4;
#else
constexpr int64_t kVecs = 2;
#endif
constexpr int64_t kPassCols = kVecs * kLanes;
static_assert(kFp32Panel % kPassCols == 0, "a panel is whole passes");
// Rows [row0, row0 + R) times the kPassCols columns of one pass: `panel` points at the pass's
// first column of input 0 (inputs kFp32Panel floats apart), `col0` is that column's index.
template <int64_t R>
void rows_times_pass(const pdserve::Fp32LinearArgs& a, int64_t row0, const float* panel,
                     int64_t col0, PanelPrefetch& prefetch) {
  const int64_t K = a.in_features, N = a.out_features;
  const float* x = a.x + row0 * K;
  Vec acc[R][kVecs] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kFp32Panel;
    Vec weights[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) {
      weights[j] = load(w + j * kLanes);
    }
    prefetch.step();
    for (int64_t r = 0; r < R; ++r) {
      // A scalar times a vector: one broadcast load (Vec{} + x would add 0.0 first, an extra
      // operation on the multiply ports, since -0.0 + 0.0 is +0.0).
      const float xr = x[r * K + k];
      for (int64_t j = 0; j < kVecs; ++j) {
        acc[r][j] += xr * weights[j];
      }
    }
  }
  for (int64_t j = 0; j < kVecs; ++j) {
    const int64_t col = col0 + j * kLanes;
    const Vec bias = a.bias ? load(a.bias + col) : Vec{};
    for (int64_t r = 0; r < R; ++r) {
      Vec v = acc[r][j] + bias;
      if (a.epilogue == LinearEpilogue::kSilu) {
        v = v / (Vec{} + 1.0f + exp_clamped(Vec{} - v));
      } else if (a.epilogue == LinearEpilogue::kMul) {
        v = v * load(a.other + (row0 + r) * N + col);
      }
      store(a.out + (row0 + r) * N + col, v);
    }
  }
}

// The rows past the last whole group of kRows, as one group of their count.
template <int64_t R = kRows - 1>
void remainder_rows(const pdserve::Fp32LinearArgs& a, int64_t row0, int64_t rows,
                    const float* panel, int64_t col0, PanelPrefetch& prefetch) {
  if constexpr (R > 0) {
    if (rows == R) {
      rows_times_pass<R>(a, row0, panel, col0, prefetch);
    } else {
      remainder_rows<R - 1>(a, row0, rows, panel, col0, prefetch);
    }
  }
}

}  // namespace

void pdserve::PDSERVE_FP32_LINEAR_PANELS(const Fp32LinearArgs& a, int64_t panel_begin,
                                         int64_t panel_end) {
  const int64_t K = a.in_features, M = a.num_rows;
  const int64_t whole = M / kRows * kRows;
  const int64_t groups = M / kRows + (M % kRows ? 1 : 0);
  const int64_t passes = kFp32Panel / kPassCols;
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const float* panel = a.weight + p * K * kFp32Panel;
    // This thread's next panel comes in under this one's arithmetic.
    PanelPrefetch prefetch(p + 1 < panel_end ? panel + K * kFp32Panel : nullptr,
                           K * kFp32Panel * sizeof(float) / kLineBytes, groups * passes * K);
    for (int64_t pass = 0; pass < passes; ++pass) {
      const float* columns = panel + pass * kPassCols;
      const int64_t col0 = p * kFp32Panel + pass * kPassCols;
      for (int64_t row0 = 0; row0 < whole; row0 += kRows) {
        rows_times_pass<kRows>(a, row0, columns, col0, prefetch);
      }
      remainder_rows(a, whole, M - whole, columns, col0, prefetch);
    }
    prefetch.finish();
  }
}
