// The fp32 few-row linear kernel, compiled once per instruction set: each fp32_linear_<isa>.cpp
// defines PDSERVE_<ISA> macros, switches the compiler's target to that ISA and includes this
// file, which defines PDSERVE_FP32_LINEAR_PANELS (fp32_linear.cpp's op) and
// PDSERVE_QUANTIZED_LINEAR_PANELS and PDSERVE_DEQUANTIZE_PANELS (quantized_linear.cpp's: the
// same arithmetic over weights kept as codes, int8 or 4-bit two a byte, with a scale, and an
// offset, per group of inputs, each block dequantized just before it is multiplied; and a
// weight's transpose dequantized for a prefill step's GEMM).
//
// Why: a decode step multiplies a few rows (one per sequence) by every weight. In fp32 (what
// `--dtype auto` picks where bf16 arithmetic is slow) that is compute-bound at 64 rows, yet
// oneDNN's kernel runs at about three quarters of its own cache-resident rate when the weights
// come from memory: the arithmetic and the weight stream take turns. This kernel reads the same
// packed buffer, and while it multiplies a block of one 64-column panel by every row it
// prefetches the thread's next block into the L2, a line every few steps, spread evenly over the
// block's work, so that the stream runs under the arithmetic (docs/benchmarks.md, issue 21).
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
#include "quantized_linear_isa.h"
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
// Inputs a step of the arithmetic covers: the loop over k runs kUnroll inputs per iteration and
// advances the prefetch once per iteration. Its bookkeeping (a multiply, a shift, a compare) at
// every input took as many instruction slots as the 12 FMAs of a 16-register ISA's tile.
constexpr int64_t kUnroll = 8;

// Inputs of one block: a panel is multiplied kBlock inputs at a time (its rows [k0, k0 + kBlock)
// are kBlock x 256 bytes, contiguous), every pass and row of the block before the next, the sums
// kept in `out` in between. What one core then works on: the block of the panel (64 KiB), the
// next block coming in (64 KiB) and x's columns of the block (64 KiB at 64 rows) sit in a 512 KiB
// L2 whatever in_features is; a whole panel ([K][64]: 512 KiB at K = 2048) with the next one
// coming in and all of x (512 KiB at 64 rows x 2048) did not, and the arithmetic waited on the
// L3. Blocks of 64 and 128 ran alike, 512 slower; 256 takes the sums through `out` the fewest
// times (docs/benchmarks.md, issue 21, twenty-third pass).
constexpr int64_t kBlock = 256;

// One input k of a pass: the pass's kVecs weight vectors times x[r][k] for every row r (`x`
// points at row 0's x[k], rows K floats apart).
template <int64_t R>
inline void multiply_input(const float* x, int64_t K, const float* w, Vec (&acc)[R][kVecs]) {
  Vec weights[kVecs];
#pragma GCC unroll 4
  for (int64_t j = 0; j < kVecs; ++j) {
    weights[j] = load(w + j * kLanes);
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    // A scalar times a vector: one broadcast load (Vec{} + x would add 0.0 first, an extra
    // operation on the multiply ports, since -0.0 + 0.0 is +0.0).
    const float xr = x[r * K];
#pragma GCC unroll 4
    for (int64_t j = 0; j < kVecs; ++j) {
      acc[r][j] += xr * weights[j];
    }
  }
}

// Rows [row0, row0 + R) times the kPassCols columns of one pass over inputs [k0, k1): `block`
// points at the pass's first column of input k0 (inputs kFp32Panel floats apart: a panel's rows,
// or the quantized kernel's dequantized block), `col0` is that column's index. The sums start
// from `out` after the first block and end there, with the bias and the epilogue applied after
// the last (the same additions in the same order as one pass over every input: the products do
// not depend on kBlock). `prefetch` takes (k1 - k0) / kUnroll steps.
template <int64_t R>
void rows_times_pass(const pdserve::Fp32LinearArgs& a, int64_t row0, const float* block,
                     int64_t col0, int64_t k0, int64_t k1, PanelPrefetch& prefetch) {
  const int64_t K = a.in_features, N = a.out_features;
  const float* x = a.x + row0 * K;
  float* out = a.out + row0 * N + col0;
  Vec acc[R][kVecs] = {};
  if (k0 > 0) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < kVecs; ++j) {
        acc[r][j] = load(out + r * N + j * kLanes);
      }
    }
  }
  // A copy the compiler keeps in registers (through the reference it stored the step count to
  // memory at every step).
  PanelPrefetch next = prefetch;
  int64_t k = k0;
  for (; k + kUnroll <= k1; k += kUnroll) {
#pragma GCC unroll 8
    for (int64_t u = 0; u < kUnroll; ++u) {
      multiply_input<R>(x + k + u, K, block + (k - k0 + u) * kFp32Panel, acc);
    }
    next.step();
  }
  for (; k < k1; ++k) {
    multiply_input<R>(x + k, K, block + (k - k0) * kFp32Panel, acc);
  }
  prefetch = next;
  const bool last = k1 == K;
  for (int64_t j = 0; j < kVecs; ++j) {
    const int64_t col = col0 + j * kLanes;
    const Vec bias = last && a.bias ? load(a.bias + col) : Vec{};
    for (int64_t r = 0; r < R; ++r) {
      Vec v = acc[r][j];
      if (last) {
        v += bias;
        if (a.epilogue == LinearEpilogue::kSilu) {
          v = v / (Vec{} + 1.0f + exp_clamped(Vec{} - v));
        } else if (a.epilogue == LinearEpilogue::kMul) {
          v = v * load(a.other + (row0 + r) * N + col);
        }
      }
      store(out + r * N + j * kLanes, v);
    }
  }
}

// The rows past the last whole group of kRows, as one group of their count.
template <int64_t R = kRows - 1>
void remainder_rows(const pdserve::Fp32LinearArgs& a, int64_t row0, int64_t rows,
                    const float* block, int64_t col0, int64_t k0, int64_t k1,
                    PanelPrefetch& prefetch) {
  if constexpr (R > 0) {
    if (rows == R) {
      rows_times_pass<R>(a, row0, block, col0, k0, k1, prefetch);
    } else {
      remainder_rows<R - 1>(a, row0, rows, block, col0, k0, k1, prefetch);
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
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
      const int64_t k1 = min64(K, k0 + kBlock);
      // This thread's next block (the rest of this panel's, else the next panel's first) comes
      // in under this one's arithmetic.
      const bool more = k1 < K;
      const float* next = more ? panel + k1 * kFp32Panel
                               : p + 1 < panel_end ? panel + K * kFp32Panel : nullptr;
      const int64_t next_inputs = min64(K, (more ? k1 : 0) + kBlock) - (more ? k1 : 0);
      PanelPrefetch prefetch(next, next_inputs * kFp32Panel * sizeof(float) / kLineBytes,
                             groups * passes * ((k1 - k0) / kUnroll));
      for (int64_t pass = 0; pass < passes; ++pass) {
        const float* columns = panel + k0 * kFp32Panel + pass * kPassCols;
        const int64_t col0 = p * kFp32Panel + pass * kPassCols;
        for (int64_t row0 = 0; row0 < whole; row0 += kRows) {
          rows_times_pass<kRows>(a, row0, columns, col0, k0, k1, prefetch);
        }
        remainder_rows(a, whole, M - whole, columns, col0, k0, k1, prefetch);
      }
      prefetch.finish();
    }
  }
}

// ---- The quantized kernel (quantized_linear.cpp's ops): the same register tiles over blocks
// dequantized into a per-call scratch. ----
#if defined(PDSERVE_QUANTIZED_LINEAR_PANELS)

namespace {

// Inputs of one dequantized block: for a decode step's few rows 64 (the block's 64 x 64 floats,
// 16 KiB, stay in the L1 between the dequantization and the multiplication), for more rows 128
// (the sums go through `out` half as often). With 256, the fp32 kernel's block, the scratch went
// through the L2 and one row took 1.6x as long as with 64; 128 was 4-9 % faster than 64 from 64
// rows up (one 576 x 3,072 projection, docs/benchmarks.md, "GGUF weights as codes").
constexpr int64_t kFewRowsBlock = 64;
constexpr int64_t kManyRowsBlock = 128;
constexpr int64_t kFewRows = 16;
// Above kManyRows rows (a prefill chunk) each panel is dequantized whole, once, and multiplied
// by the rows kRowChunk at a time. Measured against oneDNN's fp32 kernel on the dequantized
// weights (the small model's projections, streamed; docs/benchmarks.md, "GGUF weights as
// codes"): with the few-row path's blocks for every row count, a 1,024-row chunk all at once
// ran at 0.81x, 192 rows at a time 0.90-0.91x; a whole panel dequantized once with 48 rows at a
// time 0.94-0.95x (24-36 the same within the noise, 96-192 0.89-0.90x). From 16 to 64 rows the
// few-row path stayed 0.90-0.95x where the whole panel gave 0.86-0.87x.
constexpr int64_t kRowChunk = 48;
constexpr int64_t kManyRows = 64;

// Inputs [k0, k1) of one quantized panel into `block` (input k's 64 floats at (k - k0) * stride):
// each weight is code * scale (+ offset) of its group, the scale multiplied and the offset added
// as two roundings (not one fused multiply-add), which is how the gguf package and llama.cpp
// dequantize: the block holds the very floats a dequantized checkpoint would.
void dequantize_block(const pdserve::QuantizedLinearArgs& q, int64_t panel, int64_t k0,
                      int64_t k1, float* block, int64_t stride = kFp32Panel) {
  constexpr int64_t kVecsPerInput = kFp32Panel / kLanes;
  const int64_t K = q.base.in_features, G = q.group, groups = K / G;
  const int8_t* codes = q.codes + panel * (K * q.bits / 8) * kFp32Panel;
  const float* scales = q.scales + panel * groups * kFp32Panel;
  const float* offsets = q.offsets ? q.offsets + panel * groups * kFp32Panel : nullptr;
  // One weight vector: code * scale (+ offset), stored at input k's row.
  auto put = [&](Vec code, Vec scale, Vec offset, int64_t k, int64_t j) {
    Vec w = code * scale;
    if (offsets) {
#if defined(__x86_64__) && (defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2))
      // Keeps the compiler from fusing the add into the multiply (one rounding, not two).
      __asm__("" : "+v"(w));
#elif defined(__x86_64__)
      __asm__("" : "+x"(w));
#endif
      w = w + offset;
    }
    store(block + (k - k0) * stride + j * kLanes, w);
  };
  for (int64_t g0 = k0; g0 < k1; g0 += G) {  // a block is whole groups: k0 starts one
    const int64_t g = g0 / G;
    Vec scale[kVecsPerInput], offset[kVecsPerInput];
    for (int64_t j = 0; j < kVecsPerInput; ++j) {
      scale[j] = load(scales + g * kFp32Panel + j * kLanes);
      offset[j] = offsets ? load(offsets + g * kFp32Panel + j * kLanes) : Vec{};
    }
    if (q.bits == 4) {
      const uint8_t* pairs = reinterpret_cast<const uint8_t*>(codes);
      for (int64_t k = g0; k < g0 + G; k += 2) {  // a group is whole pairs
#pragma GCC unroll 4
        for (int64_t j = 0; j < kVecsPerInput; ++j) {
          Vec low, high;
          load_nibbles(pairs + k / 2 * kFp32Panel + j * kLanes, low, high);
          put(low, scale[j], offset[j], k, j);
          put(high, scale[j], offset[j], k + 1, j);
        }
      }
      continue;
    }
    for (int64_t k = g0; k < g0 + G; ++k) {
#pragma GCC unroll 4
      for (int64_t j = 0; j < kVecsPerInput; ++j) {
        put(load(codes + k * kFp32Panel + j * kLanes), scale[j], offset[j], k, j);
      }
    }
  }
}

// Every row of `a` times inputs [k0, k1) of panel p, dequantized in `block` (its input k0's row,
// kFp32Panel floats an input).
void multiply_block(const pdserve::Fp32LinearArgs& a, const float* block, int64_t p, int64_t k0,
                    int64_t k1, PanelPrefetch& prefetch) {
  const int64_t M = a.num_rows, whole = M / kRows * kRows;
  for (int64_t pass = 0; pass < kFp32Panel / kPassCols; ++pass) {
    const float* columns = block + pass * kPassCols;
    const int64_t col0 = p * kFp32Panel + pass * kPassCols;
    for (int64_t row0 = 0; row0 < whole; row0 += kRows) {
      rows_times_pass<kRows>(a, row0, columns, col0, k0, k1, prefetch);
    }
    remainder_rows(a, whole, M - whole, columns, col0, k0, k1, prefetch);
  }
}

// A decode step's rows: each block of each panel dequantized just before every row is
// multiplied by it, the thread's next block's codes prefetched under the arithmetic.
void few_rows(const pdserve::QuantizedLinearArgs& q, int64_t panel_begin, int64_t panel_end) {
  const pdserve::Fp32LinearArgs& a = q.base;
  const int64_t K = a.in_features, M = a.num_rows;
  const int64_t groups = M / kRows + (M % kRows ? 1 : 0);
  const int64_t passes = kFp32Panel / kPassCols;
  const int64_t inputs = M <= kFewRows ? kFewRowsBlock : kManyRowsBlock;
  Buffer<float> block(kManyRowsBlock * kFp32Panel);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    for (int64_t k0 = 0; k0 < K; k0 += inputs) {
      const int64_t k1 = min64(K, k0 + inputs);
      dequantize_block(q, p, k0, k1, block.data());
      // The codes of this thread's next block come in under this one's arithmetic (a quarter
      // of the fp32 kernel's stream; the scales are a sixteenth or less of it and are left to
      // the hardware's prefetcher).
      const int64_t bytes_per_input = kFp32Panel * q.bits / 8;
      const int8_t* panel_codes = q.codes + p * K * bytes_per_input;
      const bool more = k1 < K;
      const int8_t* next = more ? panel_codes + k1 * bytes_per_input
                                : p + 1 < panel_end ? panel_codes + K * bytes_per_input : nullptr;
      const int64_t next_inputs = min64(K, (more ? k1 : 0) + inputs) - (more ? k1 : 0);
      PanelPrefetch prefetch(next, next_inputs * bytes_per_input / kLineBytes,
                             groups * passes * ((k1 - k0) / kUnroll));
      multiply_block(a, block.data(), p, k0, k1, prefetch);
      prefetch.finish();
    }
  }
}

// A prefill chunk's rows: each panel dequantized whole, once, then multiplied by the rows
// kRowChunk at a time (their x block stays in the L2 while the panel passes over it).
void many_rows(const pdserve::QuantizedLinearArgs& q, int64_t panel_begin, int64_t panel_end) {
  const pdserve::Fp32LinearArgs& a = q.base;
  const int64_t K = a.in_features;
  Buffer<float> panel(K * kFp32Panel);
  PanelPrefetch none(nullptr, 0, 0);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    dequantize_block(q, p, 0, K, panel.data());
    for (int64_t r0 = 0; r0 < a.num_rows; r0 += kRowChunk) {
      pdserve::Fp32LinearArgs rows = a;
      rows.x = a.x + r0 * K;
      rows.out = a.out + r0 * a.out_features;
      rows.num_rows = min64(kRowChunk, a.num_rows - r0);
      for (int64_t k0 = 0; k0 < K; k0 += kManyRowsBlock) {
        const int64_t k1 = min64(K, k0 + kManyRowsBlock);
        multiply_block(rows, panel.data() + k0 * kFp32Panel, p, k0, k1, none);
      }
    }
  }
}

}  // namespace

void pdserve::PDSERVE_QUANTIZED_LINEAR_PANELS(const QuantizedLinearArgs& q, int64_t panel_begin,
                                              int64_t panel_end) {
  if (q.base.num_rows > kManyRows) {
    many_rows(q, panel_begin, panel_end);
  } else {
    few_rows(q, panel_begin, panel_end);
  }
}

void pdserve::PDSERVE_DEQUANTIZE_PANELS(const QuantizedLinearArgs& q, int64_t panel_begin,
                                        int64_t panel_end, int64_t first_panel, float* out,
                                        int64_t stride) {
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    dequantize_block(q, p, 0, q.base.in_features, out + (p - first_panel) * kFp32Panel, stride);
  }
}

#endif  // PDSERVE_QUANTIZED_LINEAR_PANELS
