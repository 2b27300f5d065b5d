// The bf16 few-row linear kernel, for CPUs with AVX-512 F, BW, VL and AVX512-BF16 (and no AMX,
// where amx_linear runs instead): the fp32 kernel's structure (fp32_linear_kernel.h) on
// vdpbf16ps, which multiplies a pair of inputs by a pair of weights per lane and adds both
// products to an fp32 accumulator.
//
// Why: a decode step's bf16 linears are compute-bound at 64 rows on such a CPU, and oneDNN's
// kernel runs them at ~85-90 % of its cache-resident rate once the weights come from memory
// (docs/benchmarks.md, issue 21). This kernel reads the same packed buffer and, while it
// multiplies one 64-column panel by every row, prefetches the thread's next panel into the L2
// (PanelPrefetch), so that the stream runs under the arithmetic. It also asks ahead for the two
// kinds of line a decode step's linear finds in no cache of its core: its output (a fresh
// activation: prefetchw of each row group's tile before its loop) and, on its first panel, its
// input rows (just written by the op before, half on the other core). Inside the engine the
// same weights ran 8-10 % slower than in a tight loop without them (docs/benchmarks.md, issue
// 21, eighteenth pass).
//
// A panel is [in_features / 2][64][2]: for each pair of inputs, the 64 output columns' two
// weights, contiguous (four vectors of 16 pairs). Rows go kRows at a time through a register tile
// of kRows x 4 fp32 accumulators; each step broadcasts the pair x[r][2k], x[r][2k + 1] (one
// 32-bit word) and multiplies it by the four weight vectors. The epilogue adds the bias, applies
// SiLU or the product with `other` in fp32 and rounds once to bf16, as oneDNN's post-ops do.
//
// Built into the same library as every other variant with the baseline compiler flags; the
// target is switched here, after the headers, and the op (bf16_linear.cpp) calls it only after
// checking the CPU (never SIGILL).

#include <stdint.h>
#include <string.h>

#include "bf16_linear_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,prfchw")
#define PDSERVE_AVX512 1
#define PDSERVE_AVX512_BF16 1
#include "panel_prefetch.h"

namespace {

using pdserve::Bf16LinearArgs;
using pdserve::kBf16Panel;
using pdserve::LinearEpilogue;

// The register tile: kRows x kVecs accumulators, 24 of AVX-512's 32 registers, 4 for the weights.
constexpr int64_t kRows = 6;
constexpr int64_t kVecs = kBf16Panel / kLanes;
static_assert(kVecs == 4, "a panel is one pass of the tile");

// A line of the output about to be written, asked for with intent to write (prefetchw): a
// fresh activation's lines are in no cache, and each store would otherwise wait for its line.
inline void prefetch_line_for_write(const void* address) {
  __builtin_prefetch(address, 1, 3);
  __asm__ volatile("" : : "r"(address));  // as prefetch_line_l2: keep the prefetch
}

// Rows [row0, row0 + R) times one panel (`panel`: its [in / 2][64] pairs; col0 its first
// output column). `rows_prefetch` asks for the next group's rows of x a few lines a step (on a
// thread's first panel only: x was just written by the op before, half of it on the other
// core, and after one panel it is in this core's L2).
template <int64_t R>
void rows_times_panel(const Bf16LinearArgs& a, int64_t row0, const uint32_t* panel,
                      int64_t col0, PanelPrefetch& prefetch, PanelPrefetch& rows_prefetch) {
  const int64_t pairs = a.in_features / 2, N = a.out_features;
  // x's rows as pairs of inputs: row r's pair k is word r * pairs + k.
  const uint32_t* x = reinterpret_cast<const uint32_t*>(a.x) + row0 * pairs;
  Bf16* out = reinterpret_cast<Bf16*>(a.out);
  // This group's output tile (R rows of 128 bytes, two lines each) is written after the k loop:
  // its lines are asked for now, a loop's length before the stores.
  for (int64_t r = 0; r < R; ++r) {
    prefetch_line_for_write(out + (row0 + r) * N + col0);
    prefetch_line_for_write(out + (row0 + r) * N + col0 + kBf16Panel / 2);
  }
  __m512 acc[R][kVecs];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kVecs; ++j) {
      acc[r][j] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < pairs; ++k) {
    const uint32_t* w = panel + k * kBf16Panel;
    __m512bh weights[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) {
      weights[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * kLanes));
    }
    prefetch.step();
    rows_prefetch.step();
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[r * pairs + k]));
      for (int64_t j = 0; j < kVecs; ++j) {
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, weights[j]);
      }
    }
  }
  const Bf16* bias = reinterpret_cast<const Bf16*>(a.bias);
  const Bf16* other = reinterpret_cast<const Bf16*>(a.other);
  for (int64_t j = 0; j < kVecs; ++j) {
    const int64_t col = col0 + j * kLanes;
    const Vec b = bias ? load(bias + col) : Vec{};
    for (int64_t r = 0; r < R; ++r) {
      Vec v = reinterpret_cast<Vec>(acc[r][j]) + b;
      if (a.epilogue == LinearEpilogue::kSilu) {
        v = v / (Vec{} + 1.0f + exp_clamped(Vec{} - v));
      } else if (a.epilogue == LinearEpilogue::kMul) {
        v = v * load(other + (row0 + r) * N + col);
      }
      store(out + (row0 + r) * N + col, v);
    }
  }
}

// The rows past the last whole group of kRows, as one group of their count.
template <int64_t R = kRows - 1>
void remainder_rows(const Bf16LinearArgs& a, int64_t row0, int64_t rows, const uint32_t* panel,
                    int64_t col0, PanelPrefetch& prefetch, PanelPrefetch& rows_prefetch) {
  if constexpr (R > 0) {
    if (rows == R) {
      rows_times_panel<R>(a, row0, panel, col0, prefetch, rows_prefetch);
    } else {
      remainder_rows<R - 1>(a, row0, rows, panel, col0, prefetch, rows_prefetch);
    }
  }
}

}  // namespace

void pdserve::bf16_linear_panels_avx512_bf16(const Bf16LinearArgs& a, int64_t panel_begin,
                                             int64_t panel_end) {
  const int64_t M = a.num_rows, panel_words = a.in_features / 2 * kBf16Panel;
  const int64_t whole = M / kRows * kRows;
  const int64_t groups = M / kRows + (M % kRows ? 1 : 0);
  const uint32_t* weight = reinterpret_cast<const uint32_t*>(a.weight);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const uint32_t* panel = weight + p * panel_words;
    // This thread's next panel comes in under this one's arithmetic.
    PanelPrefetch prefetch(p + 1 < panel_end ? panel + panel_words : nullptr,
                           panel_words * sizeof(uint32_t) / kLineBytes,
                           groups * (a.in_features / 2));
    const int64_t col0 = p * kBf16Panel;
    const int64_t row_bytes = a.in_features * static_cast<int64_t>(sizeof(uint16_t));
    for (int64_t row0 = 0; row0 < whole; row0 += kRows) {
      // On the first panel, the next group's rows of x (up to kRows) come in under this one.
      const int64_t next_rows = p == panel_begin ? min64(kRows, M - row0 - kRows) : 0;
      PanelPrefetch rows_prefetch(next_rows > 0 ? a.x + (row0 + kRows) * a.in_features : nullptr,
                                  (next_rows * row_bytes + kLineBytes - 1) / kLineBytes,
                                  a.in_features / 2);
      rows_times_panel<kRows>(a, row0, panel, col0, prefetch, rows_prefetch);
    }
    PanelPrefetch no_rows(nullptr, 0, 0);
    remainder_rows(a, whole, M - whole, panel, col0, prefetch, no_rows);
    prefetch.finish();
  }
}
#endif
