// The AMX kernel of amx_linear (amx_linear_isa.h): bf16 rows times a oneDNN-packed weight on the
// tile registers, for the few rows of a decode step.
//
// Register plan, per 32 output columns (one oneDNN weight block) and 32 rows at a time:
//   tmm0..tmm3  fp32 accumulators, rows {0-15, 16-31} x columns {0-15, 16-31}   [16 x 16] each
//   tmm4, tmm5  the two 16-row halves of x, 32 inputs wide                      [16 x 32] bf16
//   tmm6, tmm7  the block's two 16-column halves, 16 input pairs deep            [16 x 16 x 2]
// Four tile loads feed four tile products; each weight byte is read from memory once, by the
// first 32 rows (the next 32 find the block in the L2). oneDNN's own kernel at these shapes
// keeps one accumulator per product chain and streams its weights at about two thirds of this
// rate (docs/benchmarks.md).
//
// Rows go in groups of 16, a tile's height: two groups a pass, and an odd last group alone (two
// products a slice). Whole groups are read in place; a partial last one from the op's
// zero-padded copy of it (`tail`), so that no tile load reads past x.
//
// Built into the same library as every other kernel with the baseline compiler flags; the target
// is switched here, after the headers, and the op (amx_linear.cpp) calls in only after
// amx_unavailable_reason() said yes (never SIGILL).

#include <stdint.h>
#include <string.h>

#include "amx_linear_isa.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#define PDSERVE_AVX512 1
#define PDSERVE_AVX512_BF16 1
#include "amx_tiles.h"
#include "simd.h"

namespace {

const char* check_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    return "cpuid leaf 7 is missing";
  }
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  __builtin_cpu_init();
  if (!amx_bf16 || !amx_tile || !__builtin_cpu_supports("avx512bf16")) {
    return "this CPU lacks AMX-BF16, AMX-TILE or AVX512-BF16";
  }
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): Linux >= 5.16 faults the first
  // tile instruction of a process that did not ask. Idempotent; oneDNN asks the same way.
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    return "the kernel refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)";
  }
  return "";
}

// Bias, epilogue and rounding of one 16 x 16 accumulator tile, written to rows [row0, row0 + 16)
// (those below num_rows) and columns [col0, col0 + 16) of out.
void finish_tile(const pdserve::AmxLinearArgs& a, const float (&tile)[16][16], int64_t row0,
                 int64_t col0) {
  const int64_t n = a.out_features;
  const int64_t rows = min64(16, a.num_rows - row0);
  const Vec bias = a.bias ? load(static_cast<const Bf16*>(a.bias) + col0) : Vec{};
  Bf16* out = static_cast<Bf16*>(a.out);
  const Bf16* other = static_cast<const Bf16*>(a.other);
  for (int64_t r = 0; r < rows; ++r) {
    Vec v = load(tile[r]) + bias;
    if (a.epilogue == pdserve::LinearEpilogue::kSilu) {
      v = v / (Vec{} + 1.0f + exp_clamped(Vec{} - v));
    } else if (a.epilogue == pdserve::LinearEpilogue::kMul) {
      v = v * load(other + (row0 + r) * n + col0);
    }
    store(out + (row0 + r) * n + col0, v);
  }
}

}  // namespace

namespace pdserve {

const char* amx_unavailable_reason() {
  static const char* reason = check_amx();
  return reason;
}

void amx_linear_blocks(const AmxLinearArgs& a, int64_t block_begin, int64_t block_end) {
  const TileScope tiles_in_use;
  const int64_t k_blocks = a.in_features / 32;
  const int64_t x_stride = a.in_features * 2;  // bytes between rows of x (and of the tail)
  const int64_t num_groups = (a.num_rows + 15) / 16;
  // Group g's 16 rows: in place in x when whole, else the zero-padded tail.
  auto group_rows = [&](int64_t g) {
    return (g + 1) * 16 <= a.num_rows ? static_cast<const char*>(a.x) + g * 16 * x_stride
                                      : static_cast<const char*>(a.tail);
  };
  alignas(64) float tiles[4][16][16];
  for (int64_t block = block_begin; block < block_end; ++block) {
    // One block: k_blocks slices of 16 pairs x 32 outputs x 2 bf16 = 2 KiB, 128 bytes a row.
    const char* w = static_cast<const char*>(a.weight) + block * k_blocks * 2048;
    for (int64_t g = 0; g < num_groups; g += 2) {
      const char* x0 = group_rows(g);
      if (g + 1 == num_groups) {
        // One row tile left: two products per slice, not four of which two would be on zeros.
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kb = 0; kb < k_blocks; ++kb) {
          _tile_loadd(4, x0 + kb * 64, x_stride);
          _tile_loadd(6, w + kb * 2048, 128);
          _tile_loadd(7, w + kb * 2048 + 64, 128);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, tiles[0], 64);
        _tile_stored(1, tiles[1], 64);
        finish_tile(a, tiles[0], g * 16, block * 32);
        finish_tile(a, tiles[1], g * 16, block * 32 + 16);
        continue;
      }
      const char* x1 = group_rows(g + 1);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        _tile_loadd(4, x0 + kb * 64, x_stride);
        _tile_loadd(6, w + kb * 2048, 128);
        _tile_loadd(5, x1 + kb * 64, x_stride);
        _tile_loadd(7, w + kb * 2048 + 64, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, tiles[0], 64);
      _tile_stored(1, tiles[1], 64);
      _tile_stored(2, tiles[2], 64);
      _tile_stored(3, tiles[3], 64);
      for (int t = 0; t < 4; ++t) {
        finish_tile(a, tiles[t], (g + (t >> 1)) * 16, block * 32 + (t & 1) * 16);
      }
    }
  }
}

}  // namespace pdserve

#else  // not x86-64: no AMX

namespace pdserve {

const char* amx_unavailable_reason() {
  return "AMX exists only on x86-64";
}

void amx_linear_blocks(const AmxLinearArgs&, int64_t, int64_t) {}

}  // namespace pdserve

#endif
