// Vector helpers of the CPU kernels (paged_attention_kernel.h, prefill_attention_kernel.h,
// fused_ops_kernel.h), for the instruction set of the file that includes them: kLanes-wide fp32
// vectors (GCC/Clang vector extensions: 16 lanes for AVX-512, 8 for AVX2, 4 portable), bf16 and
// fp8 E5M2 loads and stores that widen to and round from fp32, reductions and exp; and the
// attention kernels' scratch buffer and element-type dispatch. Everything sits in an anonymous
// namespace: each variant's file gets its own copy, compiled for its own target, so no code built
// for one ISA can be linked into another's (the linker keeps one copy of an ordinary inline
// function).
//
// Deliberately free of torch and of standard-library templates, for the same reason.
#pragma once

#include <stdint.h>
#include <string.h>

#include "cache_type.h"

namespace {

// bf16 as its bits: the top half of an fp32.
struct Bf16 {
  uint16_t bits;
};

// fp8 E5M2 as its bits: the top byte of an IEEE half (1 sign, 5 exponent, 2 mantissa bits).
struct Fp8E5M2 {
  uint8_t bits;
};

inline int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

template <typename A, typename B>
constexpr bool kSameType = false;
template <typename A>
constexpr bool kSameType<A, A> = true;

// A heap array freed with its owner, for the kernels' per-thread scratch; no std::vector, whose
// out-of-line parts (one instantiation per element type, shared by every translation unit)
// could link this ISA's code into another's.
template <typename E>
class Buffer {
 public:
  explicit Buffer(int64_t n) : data_(new E[n]()) {}
  ~Buffer() { delete[] data_; }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  E* data() const { return data_; }
  E& operator[](int64_t i) const { return data_[i]; }

 private:
  E* data_;
};

// fn(Q{}, KV{}) for the attention kernels' element types: the query's (and output's), bf16 or
// fp32, and the cache's, fp32, bf16 or fp8 E5M2 (the ops check that), every pairing. The cache
// write takes its rows' type for Q.
template <typename Fn>
inline void with_element_types(bool query_is_bf16, pdserve::CacheType cache, Fn&& fn) {
  auto with_cache = [&](auto query) {
    switch (cache) {
      case pdserve::CacheType::kFloat:
        return fn(query, 0.0f);
      case pdserve::CacheType::kBf16:
        return fn(query, Bf16{});
      case pdserve::CacheType::kFp8E5M2:
        return fn(query, Fp8E5M2{});
    }
  };
  if (query_is_bf16) {
    with_cache(Bf16{});
  } else {
    with_cache(0.0f);
  }
}

// fp32 lanes of one vector register; also the tokens of a tile (portable: 4, SSE and NEON).
#if defined(PDSERVE_AVX512)
constexpr int64_t kLanes = 16;
#elif defined(PDSERVE_AVX2)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI32 __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t VecU32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t VecU16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint8_t VecU8 __attribute__((vector_size(kLanes)));

// Lane i of the result is lane idx[i] of x (0 .. kLanes - 1) or y (kLanes .. 2 * kLanes - 1). GCC
// has __builtin_shufflevector only from version 12.
#if defined(__clang__)
#define SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, VecI32{__VA_ARGS__})
#endif

// ---- kLanes-wide loads and stores; `n` < kLanes variants zero-fill / skip the missing lanes. ----

inline Vec load(const float* p) {
  Vec v;
  memcpy(&v, p, sizeof(v));
  return v;
}

// int8 codes widened to fp32 (the quantized linear kernel's weights). GCC's generic conversion
// of an int8 vector goes through scalar registers a lane at a time.
inline Vec load(const int8_t* p) {
#if defined(PDSERVE_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#elif defined(PDSERVE_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
#else
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) {
    v[i] = static_cast<float>(p[i]);
  }
  return v;
#endif
}

// kLanes bytes of two 4-bit codes each (the quantized linear kernel's packed weights): `low` the
// low nibbles widened to fp32, `high` the high ones.
inline void load_nibbles(const uint8_t* p, Vec& low, Vec& high) {
#if defined(PDSERVE_AVX512)
  const __m512i bytes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = reinterpret_cast<Vec>(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))));
  high = reinterpret_cast<Vec>(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)));
#elif defined(PDSERVE_AVX2)
  const __m256i bytes =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  low = reinterpret_cast<Vec>(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))));
  high = reinterpret_cast<Vec>(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)));
#else
  for (int64_t i = 0; i < kLanes; ++i) {
    low[i] = static_cast<float>(p[i] & 15);
    high[i] = static_cast<float>(p[i] >> 4);
  }
#endif
}

// bf16 is the top half of an fp32. GCC lowers the portable version to ~7 instructions on x86
// where the intrinsics take 2.
inline Vec load(const Bf16* p) {
#if defined(PDSERVE_AVX512)
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<Vec>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#elif defined(PDSERVE_AVX2)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
#else
  VecU16 half;
  memcpy(&half, p, sizeof(half));
  return reinterpret_cast<Vec>(__builtin_convertvector(half, VecU32) << 16);
#endif
}

// bits as the other type of the same size (float <-> uint32_t, Vec <-> VecU32): one algorithm
// for a lane and for a vector.
template <typename To, typename From>
inline To bit_cast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs types of one size");
  To y;
  memcpy(&y, &x, sizeof(y));
  return y;
}

// E5M2 bytes (zero-extended into the lanes of U: uint32_t or VecU32) widened exactly to fp32
// (F: float or Vec). The 7 magnitude bits placed at an fp32's bits 21-27 read as
// 2^(e - 127) * 1.m (or a denormal for e = 0), which 2^112 rescales to E5M2's 2^(e - 15) * 1.m.
// Exponent 31 (infinity, NaN), the only one that comes out at 2^16 or more, then takes fp32's
// 255, the mantissa kept (a NaN stays a NaN): a compare and two logic operations.
template <typename F, typename U>
inline F widen_e5m2(U bytes) {
  const F scaled = bit_cast<F>((bytes & 0x7fu) << 21) * 5.192296858534828e33f;  // 2^112
  const U special = scaled >= 65536.0f ? U{} + 0x7f800000u : U{};
  return bit_cast<F>(bit_cast<U>(scaled) | special | ((bytes & 0x80u) << 24));
}

// x rounded to E5M2's bits (in the low byte of each lane of U) exactly as c10's
// fp8e5m2_from_fp32_value rounds (torch's .to(torch.float8_e5m2)): to nearest even, a magnitude
// of 61,440 or more (halfway from the largest finite, 57,344, to 2^16) to infinity, not
// saturating; NaN to 0x7f (0xff negative). Branch-free, so that it vectorises: F and U as for
// widen_e5m2.
template <typename F, typename U>
inline U round_to_e5m2(F x) {
  const U bits = bit_cast<U>(x);
  const U sign = bits & 0x80000000u;
  const U magnitude = bits ^ sign;
  // Below 2^-14 (E5M2's least normal): adding 2^7, whose ulp is E5M2's least denormal 2^-16,
  // rounds the magnitude to a multiple of it, to nearest even, in the fp32 adder; the sum's low
  // bits then count those multiples (up to 4: the least normal's bits).
  const U denormal = bit_cast<U>(bit_cast<F>(magnitude) + 128.0f) - (134u << 23);
  // Else the exponent rebiased from 127 to 15 and the 21 bits dropped rounded to nearest even;
  // a carry out of exponent 30 makes infinity's 0x7c.
  const U normal = (magnitude + (((15u - 127u) << 23) + 0xfffffu) + ((magnitude >> 21) & 1u)) >> 21;
  U out = magnitude < (113u << 23) ? denormal : normal;
  const U special = magnitude > 0x7f800000u ? U{} + 0x7fu : U{} + 0x7cu;
  out = magnitude >= (143u << 23) ? special : out;
  return out | (sign >> 24);
}

// AVX-512 widens with vcvtph2ps (an E5M2 byte is the top byte of a half; exact, inf and NaN
// included). AVX2's target has no F16C (nor does the CPU check ask for it), so it and the
// portable path take widen_e5m2; AVX2 zero-extends the bytes with vpmovzxbd, which GCC's
// __builtin_convertvector does one byte at a time (that made decode over an fp8 cache ~2.4x
// slower than over bf16 on AVX2).
inline Vec load(const Fp8E5M2* p) {
#if defined(PDSERVE_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8)));
#elif defined(PDSERVE_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return widen_e5m2<Vec>(reinterpret_cast<VecU32>(_mm256_cvtepu8_epi32(bytes)));
#else
  VecU8 bytes;
  memcpy(&bytes, p, sizeof(bytes));
  return widen_e5m2<Vec>(__builtin_convertvector(bytes, VecU32));
#endif
}

inline float to_float(float x) {
  return x;
}

inline float to_float(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float to_float(Fp8E5M2 x) {
  return widen_e5m2<float>(static_cast<uint32_t>(x.bits));
}

inline void from_float(float x, float* out) {
  *out = x;
}

inline void from_float(float x, Bf16* out) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  out->bits = x != x ? 0x7fc0 : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline void from_float(float x, Fp8E5M2* out) {
  out->bits = static_cast<uint8_t>(round_to_e5m2<float, uint32_t>(x));
}

template <typename T>
inline Vec load_partial(const T* p, int64_t n) {
  Vec v = {};
  for (int64_t i = 0; i < n; ++i) {
    v[i] = to_float(p[i]);
  }
  return v;
}

inline void store(float* p, Vec v) {
  memcpy(p, &v, sizeof(v));
}

// Rounded to nearest even, NaN to a quiet NaN: c10::BFloat16's conversion, except that
// AVX512-BF16's instruction also flushes an fp32 denormal (below 1.2e-38) to zero, which c10
// keeps as a bf16 denormal.
inline void store(Bf16* p, Vec v) {
#if defined(PDSERVE_AVX512_BF16)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v))));
#else
  VecU32 bits = reinterpret_cast<VecU32>(v);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  bits = v != v ? VecU32{} + 0x7fc0u : bits;
  const VecU16 half = __builtin_convertvector(bits, VecU16);
  memcpy(p, &half, sizeof(half));
#endif
}

// The rounded lanes narrowed to bytes: vpmovdb on AVX-512; AVX2 packs them (each <= 0xff, so
// the saturating packs keep them), where GCC's __builtin_convertvector goes a byte at a time.
inline void store(Fp8E5M2* p, Vec v) {
  const VecU32 bits = round_to_e5m2<Vec, VecU32>(v);
#if defined(PDSERVE_AVX2)
  const __m256i lanes = reinterpret_cast<__m256i>(bits);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(lanes),
                                         _mm256_extracti128_si256(lanes, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
#else
  const VecU8 bytes = __builtin_convertvector(bits, VecU8);
  memcpy(p, &bytes, sizeof(bytes));
#endif
}

template <typename T>
inline void store_partial(T* p, Vec v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    from_float(v[i], p + i);
  }
}

// Once per query head and sequence: not worth shuffles.
inline float reduce_add(Vec v) {
  float sum = v[0];
  for (int64_t i = 1; i < kLanes; ++i) {
    sum += v[i];
  }
  return sum;
}

inline float reduce_max(Vec v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) {
    m = v[i] > m ? v[i] : m;
  }
  return m;
}

inline Vec vmax(Vec a, Vec b) {
  return a > b ? a : b;
}

// exp(x) with x clamped to [-87, 88] first: Cephes' expf polynomial (~2 ulp), branch-free on all
// lanes. Below -87, exp(x) < 2^-125 is flushed to about that; above 88 it saturates at ~2.4e38
// instead of overflowing. NaN stays NaN (the comparisons are false for it), so a NaN input
// poisons the output as in torch.
inline Vec exp_clamped(Vec x) {
  const Vec lowest = Vec{} - 87.0f, highest = Vec{} + 88.0f;
  x = x < lowest ? lowest : x;
  x = x > highest ? highest : x;
  // n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer in the float's low bits.
  const float kRound = 12582912.0f;
  const Vec n = (x * 1.44269504088896341f + kRound) - kRound;
  // r = x - n * ln2, with ln2 split in two for precision.
  const Vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n built in the exponent bits; -126 <= n <= 127 keeps it a normal float.
  const VecI32 exponent = (__builtin_convertvector(n, VecI32) + 127) << 23;
  return p * reinterpret_cast<Vec>(exponent);
}

// exp(x) for x <= 0 (attention scores minus their max).
inline Vec exp_nonpositive(Vec x) {
  return exp_clamped(x);
}

// 2^f for f in [-0.5, 0.5]: its Taylor series to f^6 (error below 2e-7 on that interval).
inline Vec exp2_fraction(Vec f) {
  Vec p = Vec{} + 1.5403530393e-4f;
  p = p * f + 1.3333558146e-3f;
  p = p * f + 9.6181291076e-3f;
  p = p * f + 5.5504108665e-2f;
  p = p * f + 2.4022650696e-1f;
  p = p * f + 6.9314718056e-1f;
  return p * f + 1.0f;
}

// 2^x for x <= 0 (the prefill softmax works in base 2: its scale carries log2(e)). Below -127
// (AVX2: -126) the result is ~2^-127 (2^-126), as good as 0 beside a sum that holds a 1; NaN
// stays NaN. AVX-512 rounds and scales in one instruction each (vrndscaleps, vscalefps): 10
// operations a vector where exp_clamped takes 19; AVX2 rounds in one (vroundps) and builds 2^n
// in the exponent bits: 13. Above 0 (a hidden key's score, which the caller drops) it may
// overflow.
inline Vec exp2_nonpositive(Vec x) {
#if defined(PDSERVE_AVX2)
  x = _mm256_max_ps(Vec{} - 126.0f, x);  // a NaN x (the second operand) passes through
  const Vec n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // 2^n in the exponent bits: -126 <= n <= 0 keeps it a normal float (a NaN's n does not
  // matter: NaN times anything is NaN).
  const VecI32 exponent = (__builtin_convertvector(n, VecI32) + 127) << 23;
  return exp2_fraction(x - n) * reinterpret_cast<Vec>(exponent);
#elif defined(PDSERVE_AVX512)
  x = _mm512_max_ps(Vec{} - 127.0f, x);  // a NaN x (the second operand) passes through
  const Vec n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_fraction(x - n), n);
#else
  return exp_clamped(x * 0.69314718055994531f);
#endif
}

// A cache line into the L2 only (prefetcht1 on x86): data wanted a while from now, which should
// not push out what the L1 holds for the work in between.
inline void prefetch_line_l2(const void* address) {
  __builtin_prefetch(address, 0, 2);
  // GCC treats a prefetch as free of side effects and deletes loops made only of prefetches; an
  // empty volatile asm that "uses" the address keeps them.
  __asm__ volatile("" : : "r"(address));
}

}  // namespace
