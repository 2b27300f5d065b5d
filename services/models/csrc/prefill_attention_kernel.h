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
//   m'[r] = max(m[r], max_j scores_t[j][r]) over the keys row r may see (position <= its own)
//   probs_t[j][r] = exp(scores_t[j][r] - m'[r]), 0 for the keys it may not see
//   l[r] = l[r] * exp(m[r] - m'[r]) + sum_j probs_t[j][r]
//   acc[r][d] = acc[r][d] * exp(m[r] - m'[r]) + sum_j probs_t[j][r] * values[j][d]
//   out[r][d] = acc[r][d] / l[r]
//
// Scores and probabilities are stored transposed, query rows along the vector lanes: the
// softmax's maxima, sums and causal mask are then plain vector operations down the key axis,
// with no horizontal reductions. Both products are register tiles of broadcast scalars times
// vectors (tile_product): a K element times kLanes query rows, a probability times kLanes
// head_dim entries of a V row. The query is transposed once per item on the way in; K and V
// rows are widened to fp32 once per key block; everything accumulates in fp32.
//
// Deliberately free of torch and of standard-library templates, like paged_attention_kernel.h.

#ifndef PDSERVE_RUN_PREFILL_ITEMS
#error "include from a prefill_attention_<isa>.cpp that defines PDSERVE_RUN_PREFILL_ITEMS"
#endif

#include "simd.h"

namespace {

// Register tiles of the two products: kS broadcast scalars times kV vectors, kS x kV
// accumulators. Scores (keys x query-row vectors): AVX-512 8 x 3 = 24 of its 32 registers,
// 16-register ISAs 4 x 2. Values (query rows x head_dim vectors): 6 x 4 and 4 x 2.
#if defined(PDSERVE_AVX512)
constexpr int64_t kScoreScalars = 8, kScoreVecs = 3;
constexpr int64_t kValueRows = 6, kValueVecs = 4;
#else
constexpr int64_t kScoreScalars = 4, kScoreVecs = 2;
constexpr int64_t kValueRows = 4, kValueVecs = 2;
#endif
// Keys per block of the online softmax; a multiple of kScoreScalars.
constexpr int64_t kKeyBlock = 4 * kScoreScalars;
// An item's rows are padded to whole score tiles (a multiple of kValueRows too).
constexpr int64_t kRowMultiple = kScoreVecs * kLanes;
static_assert(kRowMultiple % kValueRows == 0, "value tiles must cover the padded rows");

using Shape = pdserve::PrefillShape;

template <typename Q, typename KV>
struct Problem {
  Shape s;
  Q* out;
  const Q* query;
  const KV* key_cache;
  const KV* value_cache;
  const pdserve::PrefillArgs* args;
};

// A heap array freed with its owner (no std::vector: see paged_attention_kernel.h).
template <typename E>
class Buffer {
 public:
  explicit Buffer(int64_t n) : data_(new E[n]()) {}
  ~Buffer() { delete[] data_; }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  E* data() const { return data_; }

 private:
  E* data_;
};

// Per-thread fp32 scratch for one work item of up to `rows` (a multiple of kRowMultiple) query
// rows, reused across items. V rows and the accumulators are padded to dims (whole vectors).
struct Scratch {
  int64_t rows, dims;
  Buffer<float> query_t;    // [head_dim][rows], pre-scaled
  Buffer<float> keys;       // [kKeyBlock][head_dim]: this block's K rows
  Buffer<float> values;     // [kKeyBlock][dims]: its V rows, zero past head_dim
  Buffer<float> scores_t;   // [kKeyBlock][rows]: scores, then probabilities
  Buffer<float> acc;        // [rows][dims]
  Buffer<float> max_score;  // [rows]: m
  Buffer<float> sum;        // [rows]: l
  Buffer<float> rescale;    // [rows]: exp(m - m') of the current block
  Buffer<float> position;   // [rows]: the position of each row's token (exact below 2^24)

  Scratch(int64_t rows_, int64_t head_dim)
      : rows(rows_),
        dims((head_dim + kLanes - 1) / kLanes * kLanes),
        query_t(head_dim * rows_),
        keys(kKeyBlock * head_dim),
        values(kKeyBlock * dims),
        scores_t(kKeyBlock * rows_),
        acc(rows_ * dims),
        max_score(rows_),
        sum(rows_),
        rescale(rows_),
        position(rows_) {}
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

// Chunk c, KV head kv, queries [t0, t0 + num_tokens) of the chunk.
template <typename Q, typename KV>
void attend(const Problem<Q, KV>& p, int64_t c, int64_t kv, int64_t t0, int64_t num_tokens,
            Scratch& sc) {
  const Shape& s = p.s;
  const pdserve::PrefillArgs& a = *p.args;
  const int64_t G = s.group, D = s.head_dim, R = sc.rows, dims = sc.dims;
  const int64_t real_rows = num_tokens * G;
  const int64_t first_position = a.start_positions[c] + t0;
  const int64_t context = first_position + num_tokens;  // keys the last row sees
  const int64_t* table = a.block_tables + c * s.max_blocks;
  float* query_t = sc.query_t.data();
  float* scores_t = sc.scores_t.data();
  float* acc = sc.acc.data();
  float* max_score = sc.max_score.data();
  float* sum = sc.sum.data();
  float* rescale = sc.rescale.data();
  float* position = sc.position.data();

  // The query, transposed and pre-scaled; padding rows are zero and take the last real row's
  // position, so that they see a key and stay finite.
  const int64_t first_row = a.query_starts[c] + t0;
  for (int64_t r = 0; r < R; ++r) {
    const bool real = r < real_rows;
    const int64_t t = real ? r / G : num_tokens - 1;
    position[r] = static_cast<float>(first_position + t);
    max_score[r] = -__builtin_inff();
    sum[r] = 0.0f;
    const Q* q = p.query + (first_row + t) * a.query_row_stride + (kv * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) {
      query_t[d * R + r] = real ? to_float(q[d]) * a.scale : 0.0f;
    }
  }
  memset(acc, 0, sizeof(float) * R * dims);

  const int64_t full_value_vecs = dims / kLanes / kValueVecs * kValueVecs;
  for (int64_t k0 = 0; k0 < context; k0 += kKeyBlock) {
    const int64_t n = min64(kKeyBlock, context - k0);
    const int64_t keys = (n + kScoreScalars - 1) / kScoreScalars * kScoreScalars;
    widen_rows(p.key_cache, table, s, kv, k0, n, sc.keys.data(), D);
    widen_rows(p.value_cache, table, s, kv, k0, n, sc.values.data(), dims);

    // scores_t[j][r] = keys[j] . query_t[.][r] (keys past n are zero rows: masked below)
    for (int64_t r0 = 0; r0 < R; r0 += kRowMultiple) {
      for (int64_t j0 = 0; j0 < keys; j0 += kScoreScalars) {
        tile_product<kScoreScalars, kScoreVecs, false>(sc.keys.data() + j0 * D, D, 1,
                                                      query_t + r0, R, D, scores_t + j0 * R + r0);
      }
    }

    // Online softmax down the key axis, kLanes rows at a time. Key k0 + j is visible to row r
    // iff k0 + j <= position[r]; a row's first block always holds its key 0, so m is finite
    // from then on (and exp(m - m') of the first block, exp(-inf) clamped to ~1e-38, multiplies
    // a sum of 0).
    const bool needs_mask = k0 + keys - 1 > first_position;
    bool rose = false;
    for (int64_t r = 0; r < R; r += kLanes) {
      const Vec pos = load(position + r);
      const Vec m_old = load(max_score + r);
      Vec m = m_old;
      for (int64_t j = 0; j < keys; ++j) {
        Vec x = load(scores_t + j * R + r);
        if (needs_mask) {
          x = Vec{} + static_cast<float>(k0 + j) <= pos ? x : Vec{} - __builtin_inff();
        }
        m = vmax(m, x);
      }
      const Vec alpha = exp_clamped(m_old - m);
      Vec l = load(sum + r) * alpha;
      for (int64_t j = 0; j < keys; ++j) {
        Vec prob = exp_nonpositive(load(scores_t + j * R + r) - m);
        if (needs_mask) {
          prob = Vec{} + static_cast<float>(k0 + j) <= pos ? prob : Vec{};
        }
        store(scores_t + j * R + r, prob);
        l += prob;
      }
      store(sum + r, l);
      store(max_score + r, m);
      store(rescale + r, alpha);
      for (int64_t i = 0; i < kLanes; ++i) {
        rose = rose || m[i] != m_old[i];
      }
    }
    // Rescale the accumulators of rows whose maximum rose (they are 0 before the first block).
    if (rose && k0 > 0) {
      for (int64_t r = 0; r < R; ++r) {
        if (rescale[r] != 1.0f) {
          const Vec alpha = Vec{} + rescale[r];
          for (int64_t d = 0; d < dims; d += kLanes) {
            store(acc + r * dims + d, load(acc + r * dims + d) * alpha);
          }
        }
      }
    }

    // acc[r][d] += sum_j probs_t[j][r] * values[j][d]
    for (int64_t r0 = 0; r0 < R; r0 += kValueRows) {
      for (int64_t v0 = 0; v0 < full_value_vecs; v0 += kValueVecs) {
        tile_product<kValueRows, kValueVecs, true>(scores_t + r0, 1, R,
                                                   sc.values.data() + v0 * kLanes, dims, keys,
                                                   acc + r0 * dims + v0 * kLanes);
      }
      for (int64_t v0 = full_value_vecs; v0 < dims / kLanes; ++v0) {
        tile_product<kValueRows, 1, true>(scores_t + r0, 1, R, sc.values.data() + v0 * kLanes,
                                          dims, keys, acc + r0 * dims + v0 * kLanes);
      }
    }
  }

  const int64_t full = D / kLanes * kLanes;
  for (int64_t r = 0; r < real_rows; ++r) {
    const float inv = 1.0f / sum[r];
    const float* acc_r = acc + r * dims;
    Q* o = p.out + ((first_row + r / G) * s.num_heads + kv * G + r % G) * D;
    for (int64_t d = 0; d < full; d += kLanes) {
      store(o + d, load(acc_r + d) * inv);
    }
    if (full < D) {
      store_partial(o + full, load(acc_r + full) * inv, D - full);
    }
  }
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
  int64_t c = 0;
  for (int64_t item = begin; item < end; ++item) {
    while (item >= a.first_items[c + 1]) {
      ++c;
    }
    const int64_t tiles = (a.query_lens[c] + a.tile_tokens - 1) / a.tile_tokens;
    const int64_t local = item - a.first_items[c];
    const int64_t kv = local / tiles, t0 = local % tiles * a.tile_tokens;
    attend(p, c, kv, t0, min64(a.tile_tokens, a.query_lens[c] - t0), scratch);
  }
}

}  // namespace

void pdserve::PDSERVE_RUN_PREFILL_ITEMS(const PrefillArgs& args, int64_t begin, int64_t end) {
  // Every pairing of the two element types: the op checks that each is float32 or bf16.
  if (args.query_is_bf16) {
    if (args.cache_is_bf16) {
      run_typed<Bf16, Bf16>(args, begin, end);
    } else {
      run_typed<Bf16, float>(args, begin, end);
    }
  } else if (args.cache_is_bf16) {
    run_typed<float, Bf16>(args, begin, end);
  } else {
    run_typed<float, float>(args, begin, end);
  }
}
