// The prefill attention kernel, compiled once per instruction set: each
// prefill_attention_<isa>.cpp defines PDSERVE_<ISA> macros, switches the compiler's target to
// that ISA and includes this file, which keeps everything in an anonymous namespace and defines
// run_prefill_items_<isa>. See prefill_attention.cpp for the op.
//
// A work item is one chunk, one KV head and a tile of up to tile_tokens consecutive queries:
// its rows are the tile's tokens times the GQA group (row r = token r / G, query head
// kv * G + r % G, HF's repeat_interleave order), so K/V rows are widened once for the group.
// It is a flash-attention loop (online softmax: no [queries, context] score matrix) over the
// keys 0 .. the tile's last position, kKeyBlock keys at a time, read straight from the cache
// blocks through the chunk's block table (the chunk's own new K/V were written there first):
//
//   scores_t[j][r] = sum_d keys[j][d] * query_t[d][r]        (query pre-scaled)
//   m'[r] = max(m[r], max_j scores_t[j][r]) over the keys row r may see (position <= its own),
//           kept at m[r] unless that is more than kLazyRescale above it (softmax_block)
//   probs_t[j][r] = exp(scores_t[j][r] - m'[r]), 0 for the keys it may not see
//   l[r] = l[r] * exp(m[r] - m'[r]) + sum_j probs_t[j][r]
//   acc[r][d] = acc[r][d] * exp(m[r] - m'[r]) + sum_j probs_t[j][r] * values[j][d]
//   out[r][d] = acc[r][d] / l[r]
//
// (in base 2: the exponentials are 2^x of log2(e) times the scores).
//
// Scores and probabilities are stored transposed, query rows along the vector lanes: the
// softmax's maxima, sums and causal mask are then plain vector operations down the key axis,
// with no horizontal reductions. Both products are register tiles of broadcast scalars times
// vectors (tile_product): a K element times kLanes query rows, a probability times kLanes
// head_dim entries of a V row. The query is transposed once per item on the way in; K and V
// rows are widened to fp32 once per key block (widen_rows: from an fp32, bf16 or fp8 E5M2
// cache, through simd.h's loads); everything accumulates in fp32. Where the query is bf16 and
// head_dim a multiple of 32, the avx512_bf16 variant (PDSERVE_AVX512_BF16) runs both products
// on vdpbf16ps instead (attend_dpbf16: bf16 pairs, fp32 sums, twice the fp32 FMA's products an
// instruction) over a bf16 cache, whose rows it reads in place, or an fp8 E5M2 one, whose rows
// it widens to bf16 once per key block (exactly: the same products as over the bf16 widening of
// the cache); the amx variant (PDSERVE_AMX) runs them on the AMX tiles (attend_amx) over a bf16
// cache only, and takes attend_dpbf16 for an fp8 one. The dispatch is attend's. The softmax is
// the same between them.
//
// Deliberately free of torch and of standard-library templates, like paged_attention_kernel.h.

#ifndef PDSERVE_RUN_PREFILL_ITEMS
#error "include from a prefill_attention_<isa>.cpp that defines PDSERVE_RUN_PREFILL_ITEMS"
#endif

#include "simd.h"
#if defined(PDSERVE_AMX)
#include "amx_tiles.h"
#endif

namespace {

// Register tiles of the two products: kS broadcast scalars times kV vectors, kS x kV
// accumulators. Scores (keys x query-row vectors): AVX-512 8 x 3 = 24 of its 32 registers,
// 16-register ISAs 4 x 3 (12, and 3 + 1 for the operands). Values (query rows x head_dim
// vectors): 6 x 4 and 6 x 2. On the AVX2 Zen 3 host (twenty-fourth pass of docs/benchmarks.md),
// 12 accumulators for the values instead of 8 (4 x 2, whose FMAs wait on each other's latency)
// made the kernel 7-14 % faster; the score tile's 12 instead of 8 alone changed nothing, but
// it makes the rows a multiple of 6.
#if defined(PDSERVE_AVX512)
constexpr int64_t kScoreScalars = 8, kScoreVecs = 3;
constexpr int64_t kValueRows = 6, kValueVecs = 4;
#else
constexpr int64_t kScoreScalars = 4, kScoreVecs = 3;
constexpr int64_t kValueRows = 6, kValueVecs = 2;
#endif
// Keys per block of the online softmax; a multiple of kScoreScalars.
constexpr int64_t kKeyBlock = 4 * kScoreScalars;
// How far (base 2) a block's maximum score may exceed a row's running one before the row's
// accumulators are rescaled (softmax_block).
constexpr float kLazyRescale = 8.0f;
// Keys per block of the AMX path (attend_amx): two tile depths.
constexpr int64_t kAmxKeys = 64;
static_assert(kAmxKeys % 32 == 0 && kAmxKeys <= 64, "score_tiles holds 4 tiles of 16 keys");
// The longest block either path takes: the scratch's size.
constexpr int64_t kMaxKeys = kAmxKeys > kKeyBlock ? kAmxKeys : kKeyBlock;
// An item's rows are padded to whole score tiles (a multiple of kValueRows too).
constexpr int64_t kRowMultiple = kScoreVecs * kLanes;
static_assert(kRowMultiple % kValueRows == 0, "value tiles must cover the padded rows");
#if defined(PDSERVE_AVX512_BF16)
// Rows of one pass of attend_dpbf16: one score tile's query vectors. As in attend_amx, a pass
// runs the whole key loop for its rows, so that its scores ([kKeyBlock][48] fp32, 6 KiB), their
// bf16 pairs (3 KiB), accumulators ([48][head_dim] fp32, 12 KiB at 64) and the block's V pairs
// (4 KiB) stay in a 32 KiB L1, and each pass stops at its own last row's keys.
constexpr int64_t kPairRows = kRowMultiple;
#endif
#if defined(PDSERVE_AMX)
// Rows of one pass of attend_amx: three 16-row query tiles. A pass runs the whole key loop for
// its rows, so that its scores ([kAmxKeys][48] fp32, 12 KiB), probabilities ([48][kAmxKeys]
// bf16, 6 KiB), accumulators ([48][head_dim] fp32, 12 KiB at 64) and the block's V pairs
// (8 KiB) stay in the L1 (48 KiB here) instead of the whole item's going through the L2 every
// block; each pass also stops at its own last row's keys, which skips more of the diagonal.
constexpr int64_t kAmxRows = 48;
static_assert(kRowMultiple % kAmxRows == 0, "an item's rows are whole passes");
#endif

using Shape = pdserve::PrefillShape;

// Q: the element type of query and out; KV: that of the caches, fp32, bf16 or fp8 E5M2 (as in
// paged_attention_kernel.h).
template <typename Q, typename KV>
struct Problem {
  Shape s;
  Q* out;
  const Q* query;
  const KV* key_cache;
  const KV* value_cache;
  const pdserve::PrefillArgs* args;
};

// Per-thread fp32 scratch for one work item of up to `rows` (a multiple of kRowMultiple) query
// rows, reused across items. V rows and the accumulators are padded to dims (whole vectors).
struct Scratch {
  int64_t rows, dims;
  Buffer<float> query_t;    // [head_dim][rows], pre-scaled
  Buffer<float> keys;       // [kKeyBlock][head_dim]: this block's K rows
  Buffer<float> values;     // [kKeyBlock][dims]: its V rows, zero past head_dim
  Buffer<float> scores_t;   // [kMaxKeys][rows]: scores, then probabilities (attend_amx:
                            // [kAmxKeys][kAmxRows], one pass's)
  Buffer<float> acc;        // [rows][dims] (attend_amx: [kAmxRows][head_dim], one pass's)
  Buffer<float> max_score;  // [rows]: m
  Buffer<float> sum;        // [rows]: l
  Buffer<float> rescale;    // [rows]: 2^(m - m') of the current block (m in base 2)
  Buffer<float> position;   // [rows]: the position of each row's token (exact below 2^24)
#if defined(PDSERVE_AVX512_BF16)
  Buffer<uint32_t> query_pairs;  // [head_dim / 2][rows]: bf16 pairs (attend_dpbf16, attend_amx)
  Buffer<uint32_t> value_pairs;  // [kMaxKeys / 2][head_dim]: bf16 pairs
  Buffer<uint32_t> prob_pairs;   // [kKeyBlock / 2][kPairRows]: bf16 pairs (attend_dpbf16)
  Buffer<Bf16> zero_row;         // [head_dim]: the K row of the keys past a block's last
  Buffer<Bf16> key_rows;         // [kMaxKeys][head_dim]: a block's K rows where they are not
                                 // read in place (an fp8 cache's, widened; attend_amx's where
                                 // cache blocks are not whole tiles)
#endif
#if defined(PDSERVE_AMX)
  Buffer<Bf16> prob_rows;        // [kAmxRows][kAmxKeys]
#endif

  Scratch(int64_t rows_, int64_t head_dim)
      : rows(rows_),
        dims((head_dim + kLanes - 1) / kLanes * kLanes),
        query_t(head_dim * rows_),
        keys(kKeyBlock * head_dim),
        values(kKeyBlock * dims),
        scores_t(kMaxKeys * rows_),
        acc(rows_ * dims),
        max_score(rows_),
        sum(rows_),
        rescale(rows_),
        position(rows_)
#if defined(PDSERVE_AVX512_BF16)
        ,
        query_pairs(head_dim / 2 * rows_),
        value_pairs(kMaxKeys / 2 * head_dim),
        prob_pairs(kKeyBlock / 2 * kPairRows),
        zero_row(head_dim),
        key_rows(kMaxKeys * head_dim)
#endif
#if defined(PDSERVE_AMX)
        ,
        prob_rows(kAmxRows * kAmxKeys)
#endif
  {
  }
};

// out[i][v] (+)= sum_k a[i * a_stride + k * a_step] * b[k][v], k < n, for kS values of i and kV
// vectors of v (row stride of b and out: `stride`): the register tile of both products.
// Scores: i a key, k a head_dim entry, v the query rows (a = keys, b = query_t, out =
// scores_t); values: i a query row, k a key, v head_dim (a = probs_t, b = values, out = acc).
template <int64_t kS, int64_t kV, bool kAccumulate>
inline void tile_product(const float* a, int64_t a_stride, int64_t a_step, const float* b,
                         int64_t stride, int64_t n, float* out) {
  Vec acc[kS][kV];
  for (int64_t i = 0; i < kS; ++i) {
    for (int64_t v = 0; v < kV; ++v) {
      acc[i][v] = kAccumulate ? load(out + i * stride + v * kLanes) : Vec{};
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    Vec b_k[kV];
    for (int64_t v = 0; v < kV; ++v) {
      b_k[v] = load(b + k * stride + v * kLanes);
    }
    for (int64_t i = 0; i < kS; ++i) {
      const float x = a[i * a_stride + k * a_step];
      for (int64_t v = 0; v < kV; ++v) {
        acc[i][v] += x * b_k[v];
      }
    }
  }
  for (int64_t i = 0; i < kS; ++i) {
    for (int64_t v = 0; v < kV; ++v) {
      store(out + i * stride + v * kLanes, acc[i][v]);
    }
  }
}

// Widens n <= kKeyBlock cache rows of one KV head, tokens [first, first + n) of the chunk, into
// `dst` [kKeyBlock][dst_stride]; rows past n and columns past head_dim stay zero (garbage there
// could be NaN, and 0 * NaN is NaN).
template <typename KV>
inline void widen_rows(const KV* cache, const int64_t* table, const Shape& s, int64_t kv,
                       int64_t first, int64_t n, float* dst, int64_t dst_stride) {
  const int64_t D = s.head_dim, row_stride = s.num_kv_heads * D;
  const int64_t full = D / kLanes * kLanes;
  // One division per call, not per row: the rows walk the block table.
  int64_t block = first / s.block_size, offset = first % s.block_size;
  for (int64_t j = 0; j < n; ++j) {
    const KV* row = cache + (table[block] * s.block_size + offset) * row_stride + kv * D;
    if (++offset == s.block_size) {
      offset = 0;
      ++block;
    }
    float* out = dst + j * dst_stride;
    for (int64_t d = 0; d < full; d += kLanes) {
      store(out + d, load(row + d));
    }
    for (int64_t d = full; d < D; ++d) {
      out[d] = to_float(row[d]);
    }
  }
  for (int64_t j = n; j < kKeyBlock; ++j) {
    memset(dst + j * dst_stride, 0, sizeof(float) * dst_stride);
  }
}

// The state of one item's online softmax: which rows it holds, and where they stand.
struct Rows {
  int64_t first_row;       // flat batch row of the tile's first token
  int64_t first_position;  // its position
  int64_t num_tokens;      // real tokens in the tile (rows past num_tokens * G are padding)
};

// Per-row state at the start of an item; padding rows take the last real token's position,
// so that they see a key and stay finite.
inline void start_rows(const Rows& rows, int64_t G, Scratch& sc) {
  for (int64_t r = 0, t = 0, g = 0; r < sc.rows; ++r) {
    sc.position[r] = static_cast<float>(rows.first_position + min64(t, rows.num_tokens - 1));
    if (++g == G) {
      g = 0;
      ++t;
    }
    sc.max_score[r] = -__builtin_inff();
    sc.sum[r] = 0.0f;
  }
}

// The online softmax of one key block over rows [begin, end) (a multiple of kLanes apart),
// kLanes rows at a time: scores_t [keys][stride] (row r in column r - begin; times score_scale)
// becomes probabilities, and m, l and rescale (2^(m - m'), per row, m in base 2) advance. Key
// k0 + j is visible to row r iff k0 + j <= position[r]; a row's first block always holds its
// key 0, so m is finite from then on (and 2^(m - m') of the first block, 2^-inf clamped to
// ~2^-127, multiplies a sum of 0). Returns whether any row's maximum moved.
inline bool softmax_block(Scratch& sc, float* scores_t, int64_t stride, int64_t begin,
                          int64_t end, int64_t keys, int64_t k0, float score_scale) {
  // Base 2: m, the rescale and the probabilities come from exp2 of log2(e) times the scores.
  const Vec scale = Vec{} + score_scale * 1.44269504088896341f;
  const Vec hidden = Vec{} - __builtin_inff();
  bool rose = false;
  for (int64_t r = begin; r < end; r += kLanes) {
    float* column = scores_t + (r - begin);
    const Vec pos = load(sc.position.data() + r);
    const Vec m_old = load(sc.max_score.data() + r);
    // Positions rise with the row: the lanes' first holds the least.
    const bool needs_mask = k0 + keys - 1 > static_cast<int64_t>(sc.position[r]);
    // Two running maxima: one would chain every key's max on the last one's latency.
    Vec m_even = m_old, m_odd = m_old;
    // The key's position in every lane, counted in a vector (exact below 2^24, like the
    // positions): no broadcast per key.
    const Vec first_key = Vec{} + static_cast<float>(k0);
    Vec key = first_key;
    for (int64_t j = 0; j < keys; j += 2, key += 2.0f) {
      Vec x = load(column + j * stride) * scale;
      if (needs_mask) {
        x = key <= pos ? x : hidden;
      }
      m_even = vmax(m_even, x);
      if (j + 1 < keys) {
        Vec y = load(column + (j + 1) * stride) * scale;
        if (needs_mask) {
          y = key + 1.0f <= pos ? y : hidden;
        }
        m_odd = vmax(m_odd, y);
      }
    }
    // A row keeps its running maximum until a block's exceeds it by more than 2^kLazyRescale:
    // its probabilities may then reach 2^kLazyRescale (fp32 and bf16 hold that easily, and the
    // final division by l cancels it), and the accumulators are rescaled far less often (on
    // random scores hardly ever after a row's first block, where acc is still zero). A NaN
    // maximum keeps the old one, and the NaN reaches l and acc through the probabilities.
    const Vec m_block = vmax(m_even, m_odd);
    const Vec m = m_block - m_old > Vec{} + kLazyRescale ? m_block : m_old;
    const Vec alpha = exp2_nonpositive(m_old - m);
    Vec l = load(sc.sum.data() + r) * alpha;
    key = first_key;
    for (int64_t j = 0; j < keys; ++j, key += 1.0f) {
      // A hidden key's score may exceed m (it is above the diagonal): its exp, which may
      // overflow, is dropped here, as is a NaN.
      Vec prob = exp2_nonpositive(load(column + j * stride) * scale - m);
      if (needs_mask) {
        prob = key <= pos ? prob : Vec{};
      }
      store(column + j * stride, prob);
      l += prob;
    }
    store(sc.sum.data() + r, l);
    store(sc.max_score.data() + r, m);
    store(sc.rescale.data() + r, alpha);
    for (int64_t i = 0; i < kLanes; ++i) {
      rose = rose || m[i] != m_old[i];
    }
  }
  return rose;
}

// acc row r - begin *= rescale[r] for the rows of [begin, end) whose maximum rose;
// acc [end - begin][stride], dims used.
inline void rescale_rows(Scratch& sc, float* acc, int64_t stride, int64_t dims, int64_t begin,
                         int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    if (sc.rescale[r] != 1.0f) {
      const Vec alpha = Vec{} + sc.rescale[r];
      float* acc_r = acc + (r - begin) * stride;
      for (int64_t d = 0; d < dims; d += kLanes) {
        store(acc_r + d, load(acc_r + d) * alpha);
      }
    }
  }
}

// out rows = acc / l for the item's real rows among [begin, end); acc [end - begin][stride].
template <typename Q, typename KV>
inline void write_rows(const Problem<Q, KV>& p, const Rows& rows, int64_t kv, const float* acc,
                       int64_t stride, int64_t begin, int64_t end, Scratch& sc) {
  const int64_t G = p.s.group, D = p.s.head_dim;
  const int64_t full = D / kLanes * kLanes;
  for (int64_t r = begin; r < min64(end, rows.num_tokens * G); ++r) {
    const float inv = 1.0f / sc.sum[r];
    const float* acc_r = acc + (r - begin) * stride;
    Q* o = p.out + ((rows.first_row + r / G) * p.s.num_heads + kv * G + r % G) * D;
    for (int64_t d = 0; d < full; d += kLanes) {
      store(o + d, load(acc_r + d) * inv);
    }
    if (full < D) {
      store_partial(o + full, load(acc_r + full) * inv, D - full);
    }
  }
}

// The query row of item row r (zero-filled padding rows return nullptr).
template <typename Q, typename KV>
inline const Q* query_row(const Problem<Q, KV>& p, const Rows& rows, int64_t kv, int64_t r) {
  const int64_t G = p.s.group;
  if (r >= rows.num_tokens * G) {
    return nullptr;
  }
  return p.query + (rows.first_row + r / G) * p.args->query_row_stride +
         (kv * G + r % G) * p.s.head_dim;
}

// Chunk c, KV head kv, the tile `rows`, on the vector units.
template <typename Q, typename KV>
void attend_vector(const Problem<Q, KV>& p, int64_t c, int64_t kv, const Rows& rows,
                   Scratch& sc) {
  const Shape& s = p.s;
  const pdserve::PrefillArgs& a = *p.args;
  const int64_t D = s.head_dim, R = sc.rows, dims = sc.dims;
  const int64_t context = rows.first_position + rows.num_tokens;  // keys the last row sees
  const int64_t* table = a.block_tables + c * s.max_blocks;
  float* query_t = sc.query_t.data();
  float* acc = sc.acc.data();

  // The query, transposed and pre-scaled.
  for (int64_t r = 0; r < R; ++r) {
    const Q* q = query_row(p, rows, kv, r);
    for (int64_t d = 0; d < D; ++d) {
      query_t[d * R + r] = q ? to_float(q[d]) * a.scale : 0.0f;
    }
  }
  memset(acc, 0, sizeof(float) * R * dims);

  const int64_t full_value_vecs = dims / kLanes / kValueVecs * kValueVecs;
  for (int64_t k0 = 0; k0 < context; k0 += kKeyBlock) {
    const int64_t n = min64(kKeyBlock, context - k0);
    const int64_t keys = (n + kScoreScalars - 1) / kScoreScalars * kScoreScalars;
    widen_rows(p.key_cache, table, s, kv, k0, n, sc.keys.data(), D);
    widen_rows(p.value_cache, table, s, kv, k0, n, sc.values.data(), dims);

    // scores_t[j][r] = keys[j] . query_t[.][r] (keys past n are zero rows: masked)
    for (int64_t r0 = 0; r0 < R; r0 += kRowMultiple) {
      for (int64_t j0 = 0; j0 < keys; j0 += kScoreScalars) {
        tile_product<kScoreScalars, kScoreVecs, false>(sc.keys.data() + j0 * D, D, 1,
                                                      query_t + r0, R, D,
                                                      sc.scores_t.data() + j0 * R + r0);
      }
    }
    if (softmax_block(sc, sc.scores_t.data(), R, 0, R, keys, k0, 1.0f) && k0 > 0) {
      rescale_rows(sc, acc, dims, dims, 0, R);
    }
    // acc[r][d] += sum_j probs_t[j][r] * values[j][d]
    const float* probs_t = sc.scores_t.data();
    for (int64_t r0 = 0; r0 < R; r0 += kValueRows) {
      for (int64_t v0 = 0; v0 < full_value_vecs; v0 += kValueVecs) {
        tile_product<kValueRows, kValueVecs, true>(probs_t + r0, 1, R,
                                                   sc.values.data() + v0 * kLanes, dims, keys,
                                                   acc + r0 * dims + v0 * kLanes);
      }
      for (int64_t v0 = full_value_vecs; v0 < dims / kLanes; ++v0) {
        tile_product<kValueRows, 1, true>(probs_t + r0, 1, R, sc.values.data() + v0 * kLanes,
                                          dims, keys, acc + r0 * dims + v0 * kLanes);
      }
    }
  }
  write_rows(p, rows, kv, acc, dims, 0, R, sc);
}

#if defined(PDSERVE_AVX512_BF16)
// Which products a Q query over a KV cache takes where head_dim is a multiple of 32 (attend;
// elsewhere attend_vector's fp32 FMAs). The AMX tiles (the amx variant) load a bf16 cache's rows
// as they are; vdpbf16ps pairs (attend_dpbf16) also take an fp8 E5M2 cache, whose rows widen to
// bf16 exactly (load_bf16).
template <typename Q, typename KV>
constexpr bool kProductsOnTiles = kSameType<Q, Bf16> && kSameType<KV, Bf16>;
template <typename Q, typename KV>
constexpr bool kProductsInBf16Pairs =
    kSameType<Q, Bf16> && (kSameType<KV, Bf16> || kSameType<KV, Fp8E5M2>);

// 32 elements of a cache row as bf16: a bf16 row's bits; an fp8 E5M2 row's values, widened
// exactly to fp32 (simd.h's load) and then to bf16, which holds every E5M2 value (its 5-bit
// exponent's denormals are normal in bf16's 8 bits), so vcvtne2ps2bf16 rounds none of them;
// infinities stay infinities, NaNs NaNs.
inline __m512i load_bf16(const Bf16* p) {
  return _mm512_loadu_si512(p);
}

inline __m512i load_bf16(const Fp8E5M2* p) {
  const __m512 low = reinterpret_cast<__m512>(load(p));
  const __m512 high = reinterpret_cast<__m512>(load(p + 16));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
}

// out[2d + h] = (h ? odd : even)[d] for d < D (a multiple of 32): two cache rows interleaved
// into D bf16 pairs; odd == nullptr pairs `even` with zeros.
template <typename KV>
inline void interleave_rows(const KV* even, const KV* odd, int64_t D, uint32_t* out) {
  // Words 0-31 of the result take words 0-15 of each source alternately, 32-63 words 16-31.
  alignas(64) static const uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t d = 0; d < D; d += 32) {
    const __m512i e = load_bf16(even + d);
    const __m512i o = odd ? load_bf16(odd + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(e, low, o));
    _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(e, high, o));
  }
}

// r[j] = column j of the 16 x 16 block whose row i is r[i]: four rounds of shuffles, in place.
inline void transpose_in_registers(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved by element
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // then by pairs of elements
    for (int k = 0; k < 2; ++k) {
      const __m512d a = _mm512_castps_pd(t[i + k]), b = _mm512_castps_pd(t[i + k + 2]);
      r[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  for (int i = 0; i < 16; i += 8) {  // then by 128-bit lanes
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {  // and by 256-bit halves
    r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
  }
}

// sc.query_pairs[i][r] = dims 2i, 2i + 1 of the item's row r (bf16, zero for padding rows): 16
// rows x 16 pairs a transpose. head_dim is a multiple of 32.
template <typename KV>
inline void transpose_query_pairs(const Problem<Bf16, KV>& p, const Rows& rows, int64_t kv,
                                  Scratch& sc) {
  const int64_t D = p.s.head_dim, R = sc.rows;
  uint32_t* query_pairs = sc.query_pairs.data();
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const Bf16* q[16];
    for (int64_t i = 0; i < 16; ++i) {
      q[i] = query_row(p, rows, kv, r0 + i);
    }
    for (int64_t i0 = 0; i0 < D / 2; i0 += 16) {
      __m512 block[16];
      for (int64_t i = 0; i < 16; ++i) {
        block[i] = q[i] ? _mm512_loadu_ps(q[i] + 2 * i0) : _mm512_setzero_ps();
      }
      transpose_in_registers(block);
      for (int64_t i = 0; i < 16; ++i) {
        _mm512_storeu_ps(reinterpret_cast<float*>(query_pairs + (i0 + i) * R + r0), block[i]);
      }
    }
  }
}

// out[i][v] (+)= sum_k a[i][k * a_step] . b[k][v] (pairs) for kS values of i and kV vectors of v:
// tile_product on vdpbf16ps, where a and b hold bf16 pairs (a 32-bit word each) and each lane
// adds the pair's two products in fp32. b's rows are b_stride words apart, out's rows
// out_stride floats. Scores: i a key (a: its cache row, read in place), k a pair of head_dim
// entries, v the query rows (b: query_pairs); values: i a query row (a: its probability pairs),
// k a pair of keys, v head_dim (b: value_pairs).
template <int64_t kS, int64_t kV, bool kAccumulate>
inline void pair_product(const uint32_t* const* a, int64_t a_step, const uint32_t* b,
                         int64_t b_stride, int64_t n, float* out, int64_t out_stride) {
  __m512 acc[kS][kV];
  for (int64_t i = 0; i < kS; ++i) {
    for (int64_t v = 0; v < kV; ++v) {
      acc[i][v] = kAccumulate ? _mm512_loadu_ps(out + i * out_stride + v * kLanes)
                              : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    __m512bh b_k[kV];
    for (int64_t v = 0; v < kV; ++v) {
      b_k[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + k * b_stride + v * kLanes));
    }
    for (int64_t i = 0; i < kS; ++i) {
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(a[i][k * a_step]));
      for (int64_t v = 0; v < kV; ++v) {
        acc[i][v] = _mm512_dpbf16_ps(acc[i][v], x, b_k[v]);
      }
    }
  }
  for (int64_t i = 0; i < kS; ++i) {
    for (int64_t v = 0; v < kV; ++v) {
      _mm512_storeu_ps(out + i * out_stride + v * kLanes, acc[i][v]);
    }
  }
}

// The loop of attend_vector with both products on vdpbf16ps, for a bf16 query, a bf16 or fp8
// E5M2 cache and head_dim a multiple of 32; kKeyBlock keys a block, kPairRows rows a pass (a
// pass runs the whole key loop for its rows: see kPairRows). Per block:
//   scores    scores_t[j][r] = sum_i K[j][2i, 2i + 1] . query_pairs[i][r]: the K rows are read
//             in place from a bf16 cache, or from key_rows, widened there from an fp8 one
//             (keys past the block's last read a zero row; the mask hides them), the query
//             transposed into pairs once an item; unscaled, so that the softmax applies the
//             scale (the bf16 query is not rounded twice);
//   softmax   softmax_block, as on every path;
//   pairs     prob_pairs[j / 2][r] = bf16 probabilities of keys j, j + 1 (as torch's flash
//             kernel and the amx path round them: relative 2^-9 each);
//   values    acc[r][d] += sum_j prob_pairs[j / 2][r] . value_pairs[j / 2][d]: the V rows
//             interleaved in pairs of keys, as bf16 (zero past the last key: 0 * NaN would
//             be NaN).
// Over an fp8 cache the products' inputs are those over its bf16 widening, in the same order:
// the same bits out.
template <typename Q, typename KV>
void attend_dpbf16(const Problem<Q, KV>& p, int64_t c, int64_t kv, const Rows& rows,
                   Scratch& sc) {
  static_assert(kProductsInBf16Pairs<Q, KV>, "a bf16 query, a bf16 or fp8 E5M2 cache");
  const Shape& s = p.s;
  const pdserve::PrefillArgs& a = *p.args;
  const int64_t D = s.head_dim, R = sc.rows, row_stride = s.num_kv_heads * D;
  const int64_t* table = a.block_tables + c * s.max_blocks;
  const uint32_t* query_pairs = sc.query_pairs.data();  // [D / 2][R]
  uint32_t* value_pairs = sc.value_pairs.data();        // [kKeyBlock / 2][D]
  uint32_t* prob_pairs = sc.prob_pairs.data();          // [kKeyBlock / 2][kPairRows]
  float* scores_t = sc.scores_t.data();                 // [kKeyBlock][kPairRows]
  float* acc = sc.acc.data();                           // [kPairRows][D]
  Bf16* widened_keys = sc.key_rows.data();              // [kKeyBlock][D] (an fp8 cache)
  const auto* zero_row = reinterpret_cast<const uint32_t*>(sc.zero_row.data());
  constexpr int64_t kRowVecs = kPairRows / kLanes;
  const int64_t value_vecs = D / kLanes, full_value_vecs = value_vecs / kValueVecs * kValueVecs;

  transpose_query_pairs(p, rows, kv, sc);
  for (int64_t r0 = 0; r0 < min64(R, rows.num_tokens * s.group); r0 += kPairRows) {
    // Positions rise with the row (padding rows repeat the last real one's).
    const int64_t context = static_cast<int64_t>(sc.position[r0 + kPairRows - 1]) + 1;
    memset(acc, 0, sizeof(float) * kPairRows * D);
    for (int64_t k0 = 0; k0 < context; k0 += kKeyBlock) {
      const int64_t n = min64(kKeyBlock, context - k0);
      const int64_t keys = (n + kScoreScalars - 1) / kScoreScalars * kScoreScalars;
      const uint32_t* key_rows[kKeyBlock];
      const KV* value_rows[kKeyBlock];
      int64_t block = k0 / s.block_size, offset = k0 % s.block_size;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = (table[block] * s.block_size + offset) * row_stride + kv * D;
        if (++offset == s.block_size) {
          offset = 0;
          ++block;
        }
        if constexpr (kSameType<KV, Bf16>) {
          key_rows[j] = reinterpret_cast<const uint32_t*>(p.key_cache + slot);
        } else {
          Bf16* widened = widened_keys + j * D;
          for (int64_t d = 0; d < D; d += 32) {
            _mm512_storeu_si512(widened + d, load_bf16(p.key_cache + slot + d));
          }
          key_rows[j] = reinterpret_cast<const uint32_t*>(widened);
        }
        value_rows[j] = p.value_cache + slot;
      }
      for (int64_t j = n; j < keys; ++j) {
        key_rows[j] = zero_row;
      }
      for (int64_t j = 0; j < n; j += 2) {
        interleave_rows(value_rows[j], j + 1 < n ? value_rows[j + 1] : nullptr, D,
                        value_pairs + (j / 2) * D);
      }
      if ((n + 1) / 2 < keys / 2) {
        memset(value_pairs + (n + 1) / 2 * D, 0, sizeof(uint32_t) * (keys / 2 - (n + 1) / 2) * D);
      }

      for (int64_t j0 = 0; j0 < keys; j0 += kScoreScalars) {
        pair_product<kScoreScalars, kRowVecs, false>(key_rows + j0, 1, query_pairs + r0, R, D / 2,
                                                     scores_t + j0 * kPairRows, kPairRows);
      }
      if (softmax_block(sc, scores_t, kPairRows, r0, r0 + kPairRows, keys, k0, a.scale) &&
          k0 > 0) {
        rescale_rows(sc, acc, D, D, r0, r0 + kPairRows);
      }

      // prob_pairs[j / 2][r]: key j's probability in the low half, key j + 1's in the high.
      for (int64_t j = 0; j < keys; j += 2) {
        for (int64_t v = 0; v < kRowVecs; ++v) {
          const __m512 even = _mm512_loadu_ps(scores_t + j * kPairRows + v * kLanes);
          const __m512 odd = _mm512_loadu_ps(scores_t + (j + 1) * kPairRows + v * kLanes);
          const __m512i low = _mm512_cvtepu16_epi32(
              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(even)));
          const __m512i high = _mm512_cvtepu16_epi32(
              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(odd)));
          _mm512_storeu_si512(prob_pairs + (j / 2) * kPairRows + v * kLanes,
                              _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
        }
      }

      for (int64_t i0 = 0; i0 < kPairRows; i0 += kValueRows) {
        const uint32_t* row_probs[kValueRows];
        for (int64_t i = 0; i < kValueRows; ++i) {
          row_probs[i] = prob_pairs + i0 + i;
        }
        float* acc_rows = acc + i0 * D;
        for (int64_t v0 = 0; v0 < full_value_vecs; v0 += kValueVecs) {
          pair_product<kValueRows, kValueVecs, true>(row_probs, kPairRows,
                                                     value_pairs + v0 * kLanes, D, keys / 2,
                                                     acc_rows + v0 * kLanes, D);
        }
        for (int64_t v0 = full_value_vecs; v0 < value_vecs; ++v0) {
          pair_product<kValueRows, 1, true>(row_probs, kPairRows, value_pairs + v0 * kLanes, D,
                                            keys / 2, acc_rows + v0 * kLanes, D);
        }
      }
    }
    write_rows(p, rows, kv, acc, D, r0, r0 + kPairRows, sc);
  }
}
#endif

#if defined(PDSERVE_AMX)
// out[i][j] = in[j * stride + i] for a 16 x 16 block of floats.
inline void transpose_16x16(const float* in, int64_t stride, float (&out)[16][16]) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm512_loadu_ps(in + i * stride);
  }
  transpose_in_registers(r);
  for (int i = 0; i < 16; ++i) {
    _mm512_store_ps(out[i], r[i]);
  }
}

// Up to 4 score tiles of one 16-row query tile: tiles[g] ([16 keys x 16 rows], fp32, row stride
// `out_stride` floats) = the 16 keys at key_tiles[g] (bf16 rows of D, `key_stride` bytes apart)
// times the query pairs (query_pairs[i][r], row stride R). Tile numbers are immediates, hence
// the unrolled groups.
inline void score_tiles(int64_t num_tiles, const Bf16* const (&key_tiles)[4], int64_t key_stride,
                        const uint32_t* query_pairs, int64_t D, int64_t R, float* tiles,
                        int64_t out_stride) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // The K tiles rotate through tmm4, 6 and 7: a load into the tile the previous product reads
  // would wait for it.
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    _tile_loadd(5, query_pairs + (d0 / 2) * R, R * sizeof(uint32_t));
    _tile_loadd(4, key_tiles[0] + d0, key_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (num_tiles > 1) {
      _tile_loadd(6, key_tiles[1] + d0, key_stride);
      _tile_dpbf16ps(1, 6, 5);
    }
    if (num_tiles > 2) {
      _tile_loadd(7, key_tiles[2] + d0, key_stride);
      _tile_dpbf16ps(2, 7, 5);
    }
    if (num_tiles > 3) {
      _tile_loadd(4, key_tiles[3] + d0, key_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  const int64_t stride = out_stride * sizeof(float);
  _tile_stored(0, tiles, stride);
  if (num_tiles > 1) {
    _tile_stored(1, tiles + 16 * out_stride, stride);
  }
  if (num_tiles > 2) {
    _tile_stored(2, tiles + 32 * out_stride, stride);
  }
  if (num_tiles > 3) {
    _tile_stored(3, tiles + 48 * out_stride, stride);
  }
}

// Up to 4 accumulator tiles of one 16-row query tile: acc[.][16i .. 16i + 15] ([16 rows x 16
// dims] fp32, row stride D floats) += the tile's probabilities (probs [16][kAmxKeys] bf16) times
// the V pairs (value_pairs[j][2d + h], row stride D), 32 keys a product, the second 32 where
// two_depths. The accumulators (tmm0-3) are independent, so the products overlap instead of
// each waiting on the last; the V tiles alternate between tmm6 and 7.
inline void value_tiles(int64_t num_tiles, bool two_depths, const Bf16* probs,
                        const uint32_t* value_pairs, int64_t D, float* acc) {
  const int64_t acc_stride = D * sizeof(float), pair_stride = D * sizeof(uint32_t);
  _tile_loadd(0, acc, acc_stride);
  if (num_tiles > 1) {
    _tile_loadd(1, acc + 16, acc_stride);
  }
  if (num_tiles > 2) {
    _tile_loadd(2, acc + 32, acc_stride);
  }
  if (num_tiles > 3) {
    _tile_loadd(3, acc + 48, acc_stride);
  }
  for (int64_t h = 0; h < (two_depths ? 2 : 1); ++h) {
    const uint32_t* pairs = value_pairs + 16 * h * D;
    _tile_loadd(4, probs + 32 * h, kAmxKeys * sizeof(Bf16));
    _tile_loadd(6, pairs, pair_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (num_tiles > 1) {
      _tile_loadd(7, pairs + 16, pair_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (num_tiles > 2) {
      _tile_loadd(6, pairs + 32, pair_stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (num_tiles > 3) {
      _tile_loadd(7, pairs + 48, pair_stride);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, acc, acc_stride);
  if (num_tiles > 1) {
    _tile_stored(1, acc + 16, acc_stride);
  }
  if (num_tiles > 2) {
    _tile_stored(2, acc + 32, acc_stride);
  }
  if (num_tiles > 3) {
    _tile_stored(3, acc + 48, acc_stride);
  }
}

// The same loop with both products on the AMX tiles, for bf16 query and cache and head_dim a
// multiple of 32, kAmxKeys keys a block, kAmxRows rows a pass. Tiles (amx_tiles.h: all 16 rows
// x 64 bytes):
//   scores: tmm0-3 [16 keys x 16 rows] fp32 += tmm4, 6, 7 [16 keys x 32 dims] bf16 (K rows,
//           read from the cache block itself when its size is a multiple of 16) x tmm5 [16 dim
//           pairs x 16 rows x 2] (the query, transposed into pairs once an item)
//   values: tmm0-3 [16 rows x 16 dims] fp32 (acc, loaded and stored around each block)
//           += tmm4 [16 rows x 32 keys] bf16 (the probabilities, transposed back to rows)
//           x tmm6, 7 [16 key pairs x 16 dims x 2] (V rows interleaved in pairs)
// The softmax runs on the vector units between them, as above; scores come out of the tiles
// unscaled (the bf16 query is not rounded twice), so the softmax applies the scale. Blocks of
// 64 keys, twice the vector path's: the accumulators make one round trip through the L1 per
// block (the rescale needs them there). K rows past the context are the cache's (or zero):
// every row's mask hides them; V rows past it are zero, since 0 * NaN would be NaN.
template <typename Q, typename KV>
void attend_amx(const Problem<Q, KV>& p, int64_t c, int64_t kv, const Rows& rows,
                Scratch& sc) {
  // Cache rows are read in place and copied as bf16 (pairs of 2-byte elements).
  static_assert(kProductsOnTiles<Q, KV>, "a bf16 query and cache only");
  const Shape& s = p.s;
  const pdserve::PrefillArgs& a = *p.args;
  const int64_t D = s.head_dim, R = sc.rows, row_stride = s.num_kv_heads * D;
  const int64_t* table = a.block_tables + c * s.max_blocks;
  uint32_t* query_pairs = sc.query_pairs.data();  // [D / 2][R]: bf16 pairs of dims 2i, 2i + 1
  Bf16* keys = sc.key_rows.data();                 // [kAmxKeys][D] where blocks are not tiles
  uint32_t* value_pairs = sc.value_pairs.data();   // [kAmxKeys / 2][D]: pairs of keys 2i, 2i + 1
  Bf16* probs = sc.prob_rows.data();               // [kAmxRows][kAmxKeys]
  float* scores_t = sc.scores_t.data();            // [kAmxKeys][kAmxRows]
  float* acc = sc.acc.data();                      // [kAmxRows][D]
  const bool tiles_in_cache = s.block_size % 16 == 0;

  transpose_query_pairs(p, rows, kv, sc);

  for (int64_t r0 = 0; r0 < min64(R, rows.num_tokens * p.s.group); r0 += kAmxRows) {
    // Positions rise with the row (padding rows repeat the last real one's).
    const int64_t context = static_cast<int64_t>(sc.position[r0 + kAmxRows - 1]) + 1;
    memset(acc, 0, sizeof(float) * kAmxRows * D);
    for (int64_t k0 = 0; k0 < context; k0 += kAmxKeys) {
      const int64_t n = min64(kAmxKeys, context - k0);
      const int64_t keys_used = (n + 15) / 16 * 16;  // whole score tiles
      const int64_t key_tiles = keys_used / 16;
      if (n < kAmxKeys) {
        memset(value_pairs, 0, sizeof(uint32_t) * kAmxKeys / 2 * D);
      }
      int64_t block = k0 / s.block_size, offset = k0 % s.block_size;
      const Bf16* value_rows[kAmxKeys];
      const Bf16* key_tile[4] = {keys, keys + 16 * D, keys + 32 * D, keys + 48 * D};
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = (table[block] * s.block_size + offset) * row_stride + kv * D;
        if (++offset == s.block_size) {
          offset = 0;
          ++block;
        }
        if (tiles_in_cache) {
          if (j % 16 == 0) {
            key_tile[j / 16] = p.key_cache + slot;
          }
        } else {
          memcpy(keys + j * D, p.key_cache + slot, sizeof(Bf16) * D);
        }
        value_rows[j] = p.value_cache + slot;
      }
      if (!tiles_in_cache && n < keys_used) {
        memset(keys + n * D, 0, sizeof(Bf16) * (keys_used - n) * D);
      }
      for (int64_t j = 0; j < n; j += 2) {
        interleave_rows(value_rows[j], j + 1 < n ? value_rows[j + 1] : nullptr, D,
                        value_pairs + (j / 2) * D);
      }

      // scores_t[j][r] = K[j] . Q[r], 16 keys x 16 rows a tile, 32 dims a product: each 16
      // rows' query tile (tmm5) is loaded once per 32 dims for all the block's keys, whose
      // tiles (tmm0-3) accumulate together.
      const int64_t key_stride = (tiles_in_cache ? row_stride : D) * sizeof(Bf16);
      for (int64_t t = 0; t < kAmxRows; t += 16) {
        score_tiles(key_tiles, key_tile, key_stride, query_pairs + r0 + t, D, R, scores_t + t,
                    kAmxRows);
      }
      if (softmax_block(sc, scores_t, kAmxRows, r0, r0 + kAmxRows, keys_used, k0, a.scale) &&
          k0 > 0) {
        rescale_rows(sc, acc, D, D, r0, r0 + kAmxRows);
      }

      // The probabilities back to rows, in bf16: probs[r][j] = probs_t[j][r] (zero past
      // keys_used).
      for (int64_t t = 0; t < kAmxRows; t += 16) {
        alignas(64) float columns[kAmxKeys / 16][16][16];  // [key group][row][key]
        for (int64_t g = 0; g < kAmxKeys / 16; ++g) {
          if (g < key_tiles) {
            transpose_16x16(scores_t + g * 16 * kAmxRows + t, kAmxRows, columns[g]);
          } else {
            memset(columns[g], 0, sizeof(columns[g]));
          }
        }
        for (int64_t i = 0; i < 16; ++i) {
          for (int64_t g = 0; g < kAmxKeys / 16; g += 2) {
            const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_load_ps(columns[g + 1][i]),
                                                      _mm512_load_ps(columns[g][i]));
            _mm512_storeu_si512(probs + (t + i) * kAmxKeys + g * 16,
                                reinterpret_cast<__m512i>(pair));
          }
        }
      }

      // acc[r][d] += sum_j probs[r][j] * V[j][d], 16 rows x 16 dims a tile, 32 keys a product.
      for (int64_t t = 0; t < kAmxRows; t += 16) {
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          value_tiles(min64(4, (D - d0) / 16), key_tiles > 2, probs + t * kAmxKeys,
                      value_pairs + d0, D, acc + t * D + d0);
        }
      }
    }
    write_rows(p, rows, kv, acc, D, r0, r0 + kAmxRows, sc);
  }
}
#endif

// The products' path of one item: the AMX tiles, else bf16 pairs, else fp32 FMAs (see
// kProductsOnTiles).
template <typename Q, typename KV>
void attend(const Problem<Q, KV>& p, int64_t c, int64_t kv, const Rows& rows, Scratch& sc) {
#if defined(PDSERVE_AVX512_BF16)
  if (p.s.head_dim % 32 == 0) {
#if defined(PDSERVE_AMX)
    if constexpr (kProductsOnTiles<Q, KV>) {
      return attend_amx(p, c, kv, rows, sc);
    }
#endif
    if constexpr (kProductsInBf16Pairs<Q, KV>) {
      return attend_dpbf16(p, c, kv, rows, sc);
    }
  }
#endif
  attend_vector(p, c, kv, rows, sc);
}

template <typename Q, typename KV>
void run_typed(const pdserve::PrefillArgs& a, int64_t begin, int64_t end) {
  const Problem<Q, KV> p{a.s,
                         static_cast<Q*>(a.out),
                         static_cast<const Q*>(a.query),
                         static_cast<const KV*>(a.key_cache),
                         static_cast<const KV*>(a.value_cache),
                         &a};
  const int64_t rows =
      (a.tile_tokens * a.s.group + kRowMultiple - 1) / kRowMultiple * kRowMultiple;
  Scratch scratch(rows, a.s.head_dim);
#if defined(PDSERVE_AMX)
  const TileScope tiles_in_use;
#endif
  int64_t c = 0;
  for (int64_t item = begin; item < end; ++item) {
    while (item >= a.first_items[c + 1]) {
      ++c;
    }
    const int64_t tiles = (a.query_lens[c] + a.tile_tokens - 1) / a.tile_tokens;
    const int64_t local = item - a.first_items[c];
    const int64_t kv = local / tiles, t0 = local % tiles * a.tile_tokens;
    const Rows tile{a.query_starts[c] + t0, a.start_positions[c] + t0,
                    min64(a.tile_tokens, a.query_lens[c] - t0)};
    start_rows(tile, a.s.group, scratch);
    attend(p, c, kv, tile, scratch);
  }
}

}  // namespace

void pdserve::PDSERVE_RUN_PREFILL_ITEMS(const PrefillArgs& args, int64_t begin, int64_t end) {
  with_element_types(args.query_is_bf16, args.cache_type, [&](auto query, auto cache) {
    run_typed<decltype(query), decltype(cache)>(args, begin, end);
  });
}
