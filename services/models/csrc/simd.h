// Vector helpers of the CPU kernels (paged_attention_kernel.h, prefill_attention_kernel.h,
// fused_ops_kernel.h), for the instruction set of the file that includes them: kLanes-wide fp32
// vectors (GCC/Clang vector extensions: 16 lanes for AVX-512, 8 for AVX2, 4 portable), bf16
// loads and stores that widen to and round from fp32, reductions and exp; and the attention
// kernels' scratch buffer and element-type dispatch. Everything sits in an anonymous namespace: each
// variant's file gets its own copy, compiled for its own target, so no code built for one ISA
// can be linked into another's (the linker keeps one copy of an ordinary inline function).
//
// Deliberately free of torch and of standard-library templates, for the same reason.
#pragma once

#include <stdint.h>
#include <string.h>

namespace {

// bf16 as its bits: the top half of an fp32.
struct Bf16 {
  uint16_t bits;
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

// fn(Q{}, KV{}) for the attention kernels' element types: the query's (and output's) and the
// cache's, each bf16 or fp32 (the ops check that), every pairing.
template <typename Fn>
inline void with_element_types(bool query_is_bf16, bool cache_is_bf16, Fn&& fn) {
  if (query_is_bf16) {
    if (cache_is_bf16) {
      fn(Bf16{}, Bf16{});
    } else {
      fn(Bf16{}, 0.0f);
    }
  } else if (cache_is_bf16) {
    fn(0.0f, Bf16{});
  } else {
    fn(0.0f, 0.0f);
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

inline float to_float(float x) {
  return x;
}

inline float to_float(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void from_float(float x, float* out) {
  *out = x;
}

inline void from_float(float x, Bf16* out) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  out->bits = x != x ? 0x7fc0 : static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
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

// 2^x for x <= 0 (the prefill softmax works in base 2: its scale carries log2(e)). Below -127
// the result is ~2^-127, as good as 0 beside a sum that holds a 1; NaN stays NaN. AVX-512 rounds
// and scales in one instruction each (vrndscaleps, vscalefps): 10 operations a vector where
// exp_clamped takes 19. Above 0 (a hidden key's score, which the caller drops) it may overflow.
inline Vec exp2_nonpositive(Vec x) {
#if defined(PDSERVE_AVX512)
  x = _mm512_max_ps(Vec{} - 127.0f, x);  // a NaN x (the second operand) passes through
  const Vec n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Vec f = x - n;  // [-0.5, 0.5]
  // 2^f: its Taylor series to f^6 (error below 2e-7 on that interval).
  Vec p = Vec{} + 1.5403530393e-4f;
  p = p * f + 1.3333558146e-3f;
  p = p * f + 9.6181291076e-3f;
  p = p * f + 5.5504108665e-2f;
  p = p * f + 2.4022650696e-1f;
  p = p * f + 6.9314718056e-1f;
  p = p * f + 1.0f;
  return _mm512_scalef_ps(p, n);
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
