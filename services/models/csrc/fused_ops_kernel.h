// The fused elementwise kernels of a decoder layer, compiled once per instruction set: each
// fused_ops_<isa>.cpp switches the compiler's target to its ISA, defines PDSERVE_<ISA> macros and
// PDSERVE_FUSED_OPS (the name of its entry point) and includes this file. See fused_ops.cpp for
// the ops and fused_ops_isa.h for what each computes.
//
// Why fused: at a prefill step's 2,048 tokens of the `small` model, torch ran RMSNorm, rotary and
// SiLU-and-mul as 3-8 bf16 elementwise ops each, every one a pass over memory with its own
// widening to fp32 and rounding back; together they took about as long as the layer's GEMMs. Here
// each is one pass over its rows, with the same roundings as torch's ops (rotary: the same bits;
// RMSNorm: the sum of squares is added in another order; SiLU: another exp, ~2 ulp in fp32).
//
// Multiplies and adds are never contracted into FMAs here (fp-contract off below): a fused
// multiply-add rounds once where torch rounds twice, and rotary's bits must be torch's.

#ifndef PDSERVE_FUSED_OPS
#error "include from a fused_ops_<isa>.cpp that defines PDSERVE_FUSED_OPS"
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

#include "simd.h"

namespace {

// Each lane rounded to the element type and widened back: where torch's bf16 op rounds its fp32
// result (to nearest even, NaN to a quiet NaN). A float is already its own rounding.
inline Vec round_to(Vec v, const float*) {
  return v;
}

inline Vec round_to(Vec v, const Bf16*) {
#if defined(PDSERVE_AVX512_BF16)
  // The instruction the bf16 stores use (simd.h): 2 operations where the integer version
  // takes 6. It flushes an fp32 denormal to zero, as those stores do.
  const __m256i half = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
  return reinterpret_cast<Vec>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#else
  VecU32 bits = reinterpret_cast<VecU32>(v);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  bits = v != v ? VecU32{} + 0x7fc00000u : bits;
  return reinterpret_cast<Vec>(bits);
#endif
}

// kLanes elements from p, or the n < kLanes left at the end of a row (zero-filled).
template <typename T>
inline Vec load_n(const T* p, int64_t n) {
  return n == kLanes ? load(p) : load_partial(p, n);
}

template <typename T>
inline void store_n(T* p, Vec v, int64_t n) {
  if (n == kLanes) {
    store(p, v);
  } else {
    store_partial(p, v, n);
  }
}

template <typename T>
void rms_norm_rows(const pdserve::NormArgs& a, int64_t begin, int64_t end) {
  const int64_t width = a.width;
  const T* weight = static_cast<const T*>(a.weight);
  const T* tag = nullptr;  // selects round_to's overload
  for (int64_t row = begin; row < end; ++row) {
    T* hidden = static_cast<T*>(a.hidden) + row * width;
    const T* addend = a.addend ? static_cast<const T*>(a.addend) + row * width : nullptr;
    T* out = static_cast<T*>(a.out) + row * width;
    // Pass 1: the residual add (written back: it is the next layer's input) and sum of squares.
    Vec squares = {};
    for (int64_t i = 0; i < width; i += kLanes) {
      const int64_t n = min64(kLanes, width - i);
      Vec x = load_n(hidden + i, n);
      if (addend) {
        x = round_to(x + load_n(addend + i, n), tag);
        store_n(hidden + i, x, n);
      }
      squares += x * x;
    }
    const float mean = reduce_add(squares) / static_cast<float>(width);
    const float inv = 1.0f / __builtin_sqrtf(mean + a.eps);
    // Pass 2: normalise, round, scale by the weight (rounded by the store).
    for (int64_t i = 0; i < width; i += kLanes) {
      const int64_t n = min64(kLanes, width - i);
      const Vec normed = round_to(load_n(hidden + i, n) * inv, tag);
      store_n(out + i, load_n(weight + i, n) * normed, n);
    }
  }
}

template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  const T* tag = nullptr;
  for (int64_t i = 0; i < half; i += kLanes) {
    const int64_t n = min64(kLanes, half - i);
    const Vec x1 = load_n(x + i, n), x2 = load_n(x + half + i, n);
    const Vec first = round_to(round_to(x1 * load_n(cos + i, n), tag) +
                                   round_to((Vec{} - x2) * load_n(sin + i, n), tag),
                               tag);
    const Vec second = round_to(round_to(x2 * load_n(cos + half + i, n), tag) +
                                    round_to(x1 * load_n(sin + half + i, n), tag),
                                tag);
    store_n(x + i, first, n);
    store_n(x + half + i, second, n);
  }
}

template <typename T>
void rotary_rows(const pdserve::RotaryArgs& a, int64_t begin, int64_t end) {
  const int64_t dim = a.head_dim, half = dim / 2;
  for (int64_t row = begin; row < end; ++row) {
    const T* cos = static_cast<const T*>(a.cos) + row * dim;
    const T* sin = static_cast<const T*>(a.sin) + row * dim;
    T* query = static_cast<T*>(a.query) + row * a.query_stride;
    for (int64_t h = 0; h < a.num_heads; ++h) {
      rotate_head(query + h * dim, cos, sin, half);
    }
    T* key = static_cast<T*>(a.key) + row * a.key_stride;
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      rotate_head(key + h * dim, cos, sin, half);
    }
  }
}

template <typename T>
void silu_and_mul_rows(const pdserve::SiluMulArgs& a, int64_t begin, int64_t end) {
  const int64_t width = a.width;
  const T* tag = nullptr;
  const Vec one = Vec{} + 1.0f;
  for (int64_t row = begin; row < end; ++row) {
    const T* gate = static_cast<const T*>(a.gate_up) + row * 2 * width;
    const T* up = gate + width;
    T* out = static_cast<T*>(a.out) + row * width;
    for (int64_t i = 0; i < width; i += kLanes) {
      const int64_t n = min64(kLanes, width - i);
      const Vec g = load_n(gate + i, n);
      // torch's silu: x / (1 + exp(-x)) in fp32, rounded to the element type.
      const Vec silu = round_to(g / (one + exp_clamped(Vec{} - g)), tag);
      store_n(out + i, silu * load_n(up + i, n), n);
    }
  }
}

// One pass: each lane keeps the largest value it has seen and the index where it first saw it
// (a strict > never replaces an earlier equal one); the lanes are then reduced to the largest
// value's smallest index. A NaN never compares greater, so a row whose whole vectors hold one is
// scanned again for its first NaN (torch's answer there); the tail past the last whole vector is
// scalar, and its first NaN is the row's first when the vectors held none.
template <typename T>
int64_t argmax_row(const T* row, int64_t width) {
  int64_t best = 0;
  float best_value = to_float(row[0]);
  int64_t i = 0;
  if (width >= kLanes) {
    Vec values = load(row);
    VecI32 indices, lane;
    for (int64_t l = 0; l < kLanes; ++l) {
      lane[l] = static_cast<int32_t>(l);
    }
    indices = lane;
    VecI32 nan = values != values;
    for (i = kLanes; i + kLanes <= width; i += kLanes) {
      const Vec x = load(row + i);
      const VecI32 greater = x > values;
      values = greater ? x : values;
      indices = greater ? lane + static_cast<int32_t>(i) : indices;
      nan |= x != x;
    }
    bool any_nan = false;
    for (int64_t l = 0; l < kLanes; ++l) {
      any_nan |= nan[l] != 0;
    }
    if (any_nan) {
      for (int64_t j = 0; j < width; ++j) {
        const float x = to_float(row[j]);
        if (x != x) {
          return j;
        }
      }
    }
    best_value = values[0];
    best = indices[0];
    for (int64_t l = 1; l < kLanes; ++l) {
      if (values[l] > best_value || (values[l] == best_value && indices[l] < best)) {
        best_value = values[l];
        best = indices[l];
      }
    }
  }
  for (; i < width; ++i) {
    const float x = to_float(row[i]);
    if (x != x) {
      return i;
    }
    if (x > best_value) {
      best_value = x;
      best = i;
    }
  }
  return best;
}

template <typename T>
void argmax_rows(const pdserve::ArgmaxArgs& a, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    a.out[row] = argmax_row(static_cast<const T*>(a.logits) + row * a.width, a.width);
  }
}

void rms_norm_any(const pdserve::NormArgs& a, int64_t begin, int64_t end) {
  a.is_bf16 ? rms_norm_rows<Bf16>(a, begin, end) : rms_norm_rows<float>(a, begin, end);
}

// dst[0, n) = src[0, n) in dst's element type (rounded to nearest even into bf16 or fp8 E5M2).
template <typename T, typename C>
inline void convert_row(const T* src, C* dst, int64_t n) {
  if constexpr (kSameType<T, C>) {
    memcpy(dst, src, sizeof(T) * n);
  } else {
    for (int64_t i = 0; i < n; i += kLanes) {
      const int64_t m = min64(kLanes, n - i);
      store_n(dst + i, load_n(src + i, m), m);
    }
  }
}

template <typename T, typename C>
void write_kv_rows(const pdserve::KvWriteArgs& a, int64_t begin, int64_t end) {
  const int64_t width = a.row_width;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t slot = a.slots[row];
    convert_row(static_cast<const T*>(a.key) + row * a.key_stride,
                static_cast<C*>(a.key_cache) + slot * width, width);
    convert_row(static_cast<const T*>(a.value) + row * a.value_stride,
                static_cast<C*>(a.value_cache) + slot * width, width);
  }
}

void rotary_any(const pdserve::RotaryArgs& a, int64_t begin, int64_t end) {
  a.is_bf16 ? rotary_rows<Bf16>(a, begin, end) : rotary_rows<float>(a, begin, end);
}

void silu_and_mul_any(const pdserve::SiluMulArgs& a, int64_t begin, int64_t end) {
  a.is_bf16 ? silu_and_mul_rows<Bf16>(a, begin, end) : silu_and_mul_rows<float>(a, begin, end);
}

void argmax_any(const pdserve::ArgmaxArgs& a, int64_t begin, int64_t end) {
  a.is_bf16 ? argmax_rows<Bf16>(a, begin, end) : argmax_rows<float>(a, begin, end);
}

void write_kv_cache_any(const pdserve::KvWriteArgs& a, int64_t begin, int64_t end) {
  with_element_types(a.is_bf16, a.cache_type, [&](auto row, auto cache) {
    write_kv_rows<decltype(row), decltype(cache)>(a, begin, end);
  });
}

}  // namespace

pdserve::FusedOps pdserve::PDSERVE_FUSED_OPS() {
  return {rms_norm_any, rotary_any, silu_and_mul_any, argmax_any, write_kv_cache_any};
}
