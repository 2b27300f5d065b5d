// The paged decode attention kernel, compiled once per instruction set: each
// paged_attention_<isa>.cpp defines PDSERVE_<ISA> macros, switches the compiler's target to that
// ISA and includes this file, which keeps everything in an anonymous namespace (nothing here is
// shared between variants) and defines run_items_<isa>. See paged_attention.cpp for the op.
//
// A work item walks the block table in tiles of kLanes tokens, reads each K/V row once for its
// whole GQA group (query head h uses KV head h / G, HF's repeat_interleave order), and runs two
// passes:
//   1. scores = scale * q . k for every query head, into a per-thread fp32 buffer
//      [heads, seq_len] (a tile's dot products reduced together). K rows are widened to fp32 into
//      a tile, or, with bf16 query and cache on AVX512-BF16, multiplied as bf16 pairs
//      (vdpbf16ps) straight from the cache;
//   2. softmax in place (max-subtracted, exact-enough exp), then out = sum_t p_t * v_t / sum_t p_t,
//      each V row widened once in registers into the sums of up to kGroupTile query heads, also
//      in registers (through a widened tile where they would not fit: AVX2 at head_dim 64).
// The query (and output) hold fp32 or bf16, the caches fp32, bf16 or fp8 E5M2, independently
// (Problem<Q, KV>): a bf16 cache under an fp32 query is widened like any bf16 one, at half an
// fp32 cache's bytes; an fp8 one (a quarter) is widened to fp32 exactly, the same way, on either
// query (simd.h's load: vcvtph2ps on AVX-512, integer operations elsewhere). Its K rows are not
// converted to bf16 for the bf16 dot products: that measured ~8% slower on the Zen 4 host (64
// sequences x 273 tokens, bf16 query) than the fp32 tile.
// Everything accumulates in fp32; nothing past seq_len (garbage table entries, the rest of the
// last block) is read, nor, with a window, anything before the window's first token: the kernel
// then runs on the tokens [first, seq_len) as on a context of their own (scores, tiles and
// prefetches counted from `first`). Rows are prefetched into the L2 two tiles ahead (TilePrefetch), the
// requests spread over the current tile's work: blocks are scattered, so the hardware prefetcher
// cannot follow.
//
// Vectorised with GCC/Clang vector extensions, one register wide (kLanes fp32: 16 for AVX-512, 8
// for AVX2, 4 portable), rather than left to the auto-vectoriser, which keeps fp32 reductions (dot
// products, softmax max and sum) scalar without -ffast-math. head_dim 32, 64 and 128 get
// specialisations with the chunk loops unrolled; others take a generic path. The AVX-512-BF16
// variant differs from AVX-512 in its bf16 dot products and its fp32 -> bf16 stores of the output
// (vcvtneps2bf16).
//
// Deliberately free of torch and of standard-library templates: an inline function instantiated
// here for AVX-512 and also elsewhere could be the copy the linker keeps for both.

#ifndef PDSERVE_RUN_ITEMS
#error "include from a paged_attention_<isa>.cpp that defines PDSERVE_RUN_ITEMS"
#endif

#include "simd.h"

namespace {

// Tiles of kLanes tokens whose rows are requested ahead of the one being read.
constexpr int64_t kPrefetchTiles = 2;
constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kMaxChunks = kMaxHeadDim / kLanes;

// Sums each of kLanes vectors: lane j of the result is the sum of a[j]'s lanes, in log2(kLanes)
// rounds of pairwise shuffle-and-add (45 operations for 16 lanes) instead of kLanes separate
// horizontal sums. A round takes lanes in runs of r from x and y: `lo` the first run of each
// pair, `hi` the second, so lo + hi holds r partial sums each of twice as many vectors.
#if defined(PDSERVE_AVX512)
inline Vec transpose_reduce(const Vec* a) {
  Vec b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k) {  // r = 8: b[k] = 8 partial sums of a[2k], then 8 of a[2k + 1]
    const Vec x = a[2 * k], y = a[2 * k + 1];
    const Vec lo = SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const Vec hi = SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    b[k] = lo + hi;
  }
  for (int k = 0; k < 4; ++k) {  // r = 4: c[k] = 4 partial sums each of a[4k] .. a[4k + 3]
    const Vec x = b[2 * k], y = b[2 * k + 1];
    const Vec lo = SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const Vec hi = SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    c[k] = lo + hi;
  }
  for (int k = 0; k < 2; ++k) {  // r = 2: d[k] = 2 partial sums each of a[8k] .. a[8k + 7]
    const Vec x = c[2 * k], y = c[2 * k + 1];
    const Vec lo = SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const Vec hi = SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    d[k] = lo + hi;
  }
  const Vec x = d[0], y = d[1];  // r = 1
  const Vec lo = SHUFFLE(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const Vec hi = SHUFFLE(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return lo + hi;
}
#elif defined(PDSERVE_AVX2)
inline Vec transpose_reduce(const Vec* a) {
  Vec b[4], c[2];
  for (int k = 0; k < 4; ++k) {  // r = 4
    const Vec x = a[2 * k], y = a[2 * k + 1];
    b[k] = SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int k = 0; k < 2; ++k) {  // r = 2
    const Vec x = b[2 * k], y = b[2 * k + 1];
    c[k] = SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13) + SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  const Vec x = c[0], y = c[1];  // r = 1
  return SHUFFLE(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
inline Vec transpose_reduce(const Vec* a) {
  const Vec b0 = SHUFFLE(a[0], a[1], 0, 1, 4, 5) + SHUFFLE(a[0], a[1], 2, 3, 6, 7);  // r = 2
  const Vec b1 = SHUFFLE(a[2], a[3], 0, 1, 4, 5) + SHUFFLE(a[2], a[3], 2, 3, 6, 7);
  return SHUFFLE(b0, b1, 0, 2, 4, 6) + SHUFFLE(b0, b1, 1, 3, 5, 7);  // r = 1
}
#endif

using Shape = pdserve::DecodeShape;


// Pass 1 multiplies bf16 pairs (vdpbf16ps) when query and cache are both bf16 and head_dim is
// a specialised multiple of 32 (a 512-bit vector of bf16).
template <typename Q, typename KV, int64_t kChunks>
constexpr bool kDotsInBf16 = kSameType<Q, Bf16> && kSameType<KV, Bf16> && kChunks > 0 &&
                             kChunks * kLanes % 32 == 0;

// Q: the element type of query and out; KV: that of the caches (bf16 or fp8 E5M2 under an fp32
// query when the cache is kept narrower than the compute dtype). Both are widened to fp32 on
// load.
template <typename Q, typename KV>
struct Problem {
  Shape s;
  Q* out;
  const Q* query;  // rows query_row_stride elements apart
  int64_t query_row_stride;
  const KV* key_cache;
  const KV* value_cache;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  float scale;
  int64_t window;  // > 0: the last `window` tokens only
};

// Per-thread fp32 scratch for one work item of up to max_kv_heads KV heads, reused across items.
struct Scratch {
  Buffer<Vec> query;       // [num_q, num_chunks], pre-scaled, zero past head_dim
  Buffer<float> scores;    // [num_q, round_up(seq_len, kLanes)], then probabilities
  Buffer<Vec> tile;        // [num_kv, kLanes tokens, num_chunks]: K or V rows in fp32
  Buffer<Vec> acc;         // [num_q, num_chunks]
  Buffer<float> inv_sums;  // [num_q]

  Scratch(const Shape& s, int64_t max_kv_heads, int64_t max_seq_len)
      : query(max_kv_heads * s.group * num_chunks(s)),
        scores(max_kv_heads * s.group * ((max_seq_len + kLanes - 1) / kLanes * kLanes)),
        tile(max_kv_heads * kLanes * num_chunks(s)),
        acc(max_kv_heads * s.group * num_chunks(s)),
        inv_sums(max_kv_heads * s.group) {}

  static int64_t num_chunks(const Shape& s) { return (s.head_dim + kLanes - 1) / kLanes; }
};

// One row widened to fp32 chunks; lanes past head_dim are zero.
template <typename T>
inline void load_row(const T* row, int64_t num_full_chunks, int64_t tail, Vec* chunks) {
  for (int64_t c = 0; c < num_full_chunks; ++c) {
    chunks[c] = load(row + c * kLanes);
  }
  if (tail) {
    chunks[num_full_chunks] = load_partial(row + num_full_chunks * kLanes, tail);
  }
}

// The cache rows of consecutive tokens of one sequence, walked through its block table; a row
// starts at KV head `kv_begin` (the item's heads are contiguous from there).
template <typename T>
class RowCursor {
 public:
  RowCursor(const T* cache, const int64_t* table, const Shape& s, int64_t kv_begin, int64_t token)
      : cache_(cache + kv_begin * s.head_dim),
        table_(table),
        block_size_(s.block_size),
        row_stride_(s.num_kv_heads * s.head_dim),
        block_(token / s.block_size),
        offset_(token % s.block_size) {}

  const T* row() const {
    return cache_ + (table_[block_] * block_size_ + offset_) * row_stride_;
  }

  void next() {
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
  }

 private:
  const T* cache_;
  const int64_t* table_;
  int64_t block_size_, row_stride_, block_, offset_;
};

// Blocks are scattered, so the hardware prefetcher cannot guess the next row; without this every
// row is a cache miss. The kernel reads K's tiles of kLanes tokens, then V's: reading one, it
// asks for the rows of the tile kPrefetchTiles further along that stream, in parts spread over
// the current tile's work (a part per query head in pass 1, per KV head or query head in pass 2):
// issued all at once, 128 lines fill the core's miss buffers and the arithmetic behind them waits
// for the memory instead of running under it (AMD EPYC, sixteenth pass of docs/benchmarks.md: 64
// sequences x 320 tokens, 12 layers, 1.26-1.39 -> 0.92 ms a layer call scattered, 0.95 ->
// 0.62-0.72 in a row; one tile ahead is slower, four no faster). Into the L2, not the L1: on the
// same host (twelfth pass) the kernel read K/V from memory at 5.3-5.9 GB/s a thread with
// prefetcht0 and 9.0-9.8 with prefetcht1; on the Intel host of the eleventh pass the two ran
// alike.
//
// Life cycle: made at the start of a work item; next_tile() once per tile the kernel reads (and
// kPrefetchTiles times before the first), each followed by its parts; done when the item is.
// The rows come from two cursors that only step forward and a part's share from a fixed-point
// scale set once a tile: finding each part's rows afresh took four 64-bit divisions a part, and
// the kernel ran 2-10 % faster without them (AVX2 Zen 3 host, twenty-fourth pass).
template <typename KV>
class TilePrefetch {
 public:
  // The rows of tokens [first, first + seq_len).
  TilePrefetch(const KV* key_cache, const KV* value_cache, const int64_t* table, const Shape& s,
               int64_t kv_begin, int64_t first, int64_t seq_len, int64_t row_bytes)
      : keys_(key_cache, table, s, kv_begin, first),
        values_(value_cache, table, s, kv_begin, first),
        seq_len_(seq_len),
        row_bytes_(row_bytes) {}

  // Moves to the stream's next tile (none past V's last), whose rows the next `num_parts` calls
  // of part() ask for.
  void next_tile(int64_t num_parts) {
    n_ = 0;
    if (token_ < seq_len_) {
      RowCursor<KV>& rows = in_values_ ? values_ : keys_;
      n_ = min64(kLanes, seq_len_ - token_);
      for (int64_t j = 0; j < n_; ++j, rows.next()) {
        rows_[j] = reinterpret_cast<const char*>(rows.row());
      }
      token_ += kLanes;
      if (token_ >= seq_len_ && !in_values_) {
        in_values_ = true;
        token_ = 0;
      }
    }
    scale_ = (kLanes << 16) / num_parts;
    parts_ = 0;
    done_ = 0;
  }

  // The next part of the tile's rows: after part k (from 1), the first ceil(k * kLanes /
  // num_parts) rows, or all n of them, have been asked for.
  void part() {
    ++parts_;
    const int64_t due = min64(n_, (parts_ * scale_ + 0xffff) >> 16);
    for (; done_ < due; ++done_) {
      for (int64_t b = 0; b < row_bytes_; b += 64) {
        prefetch_line_l2(rows_[done_] + b);
      }
    }
  }

 private:
  RowCursor<KV> keys_, values_;
  const int64_t seq_len_, row_bytes_;
  const char* rows_[kLanes];
  int64_t token_ = 0;  // the first token of the next tile of the stream in its cache
  bool in_values_ = false;
  int64_t n_ = 0, scale_ = 0, parts_ = 0, done_ = 0;
};

// acc[g] += sum_j probs[g][j] * v_j for kGroup query heads sharing one KV head: the rows' slices
// at `head` are widened once each and the kGroup x kChunks sums stay in registers. probs[g][j] is
// probs[g * probs_stride + j]; acc[g * kChunks + c] is chunk c of query head g.
template <typename KV, int64_t kChunks, int64_t kGroup>
inline void accumulate_values_of(const KV* const* rows, int64_t n, int64_t head, const float* probs,
                                 int64_t probs_stride, Vec* acc) {
  Vec sums[kGroup][kChunks];
  for (int64_t g = 0; g < kGroup; ++g) {
    for (int64_t c = 0; c < kChunks; ++c) {
      sums[g][c] = acc[g * kChunks + c];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec v[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) {
      v[c] = load(rows[j] + head + c * kLanes);
    }
    for (int64_t g = 0; g < kGroup; ++g) {
      const float prob = probs[g * probs_stride + j];
      for (int64_t c = 0; c < kChunks; ++c) {
        sums[g][c] += prob * v[c];
      }
    }
  }
  for (int64_t g = 0; g < kGroup; ++g) {
    for (int64_t c = 0; c < kChunks; ++c) {
      acc[g * kChunks + c] = sums[g][c];
    }
  }
}

// Vector registers of the ISA (SSE and NEON builds take the portable path with 16 or more).
#if defined(PDSERVE_AVX512)
constexpr int64_t kVectorRegisters = 32;
#else
constexpr int64_t kVectorRegisters = 16;
#endif

// Query heads one pass-2 accumulation holds in registers at once: (tile + 1) x kChunks vectors
// (the sums and one widened row) within the registers, leaving 4 spare; at most 4. AVX-512 with
// head_dim 64: 4 (20 of 32 registers). Where not even one fits (AVX2 with head_dim 64: 16
// vectors), spilled sums cost more than the tile saves, and pass 2 keeps the tile.
template <int64_t kChunks>
constexpr int64_t kGroupTile = kChunks == 0 ? 0
                               : (kVectorRegisters - 4) / kChunks - 1 > 4
                                   ? 4
                                   : (kVectorRegisters - 4) / kChunks - 1;

template <typename KV, int64_t kChunks>
inline void accumulate_values(int64_t group, const KV* const* rows, int64_t n, int64_t head,
                              const float* probs, int64_t probs_stride, Vec* acc) {
  constexpr int64_t kTile = kGroupTile<kChunks>;
  if constexpr (kTile > 1) {
    if (group == 1) {
      return accumulate_values_of<KV, kChunks, 1>(rows, n, head, probs, probs_stride, acc);
    }
  }
  if constexpr (kTile > 2) {
    if (group == 2) {
      return accumulate_values_of<KV, kChunks, 2>(rows, n, head, probs, probs_stride, acc);
    }
  }
  if constexpr (kTile > 3) {
    if (group == 3) {
      return accumulate_values_of<KV, kChunks, 3>(rows, n, head, probs, probs_stride, acc);
    }
  }
  accumulate_values_of<KV, kChunks, kTile>(rows, n, head, probs, probs_stride, acc);
}

// Attention of sequence `seq` for KV heads [kv_begin, kv_end) and their query heads
// [kv_begin * G, kv_end * G), which are adjacent in query and out.
// kChunks: head_dim / kLanes when a specialisation exists (the chunk loops then unroll and a
// tile's dot products stay in registers), else 0 and the shape is read at run time.
template <typename Q, typename KV, int64_t kChunks>
void attend(const Problem<Q, KV>& p, int64_t seq, int64_t kv_begin, int64_t kv_end,
            Scratch& scratch) {
  const Shape& s = p.s;
  const int64_t G = s.group, D = s.head_dim;
  const int64_t num_kv = kv_end - kv_begin, num_q = num_kv * G;
  const int64_t num_full_chunks = kChunks ? kChunks : D / kLanes;
  const int64_t tail = kChunks ? 0 : D % kLanes;
  const int64_t num_chunks = num_full_chunks + (tail ? 1 : 0);
  // With a window, the tokens [first, seq_lens[seq]) as a context of their own.
  const int64_t context = p.seq_lens[seq];
  const int64_t first = p.window > 0 && context > p.window ? context - p.window : 0;
  const int64_t seq_len = context - first;
  const int64_t padded_len = (seq_len + kLanes - 1) / kLanes * kLanes;
  const int64_t* table = p.block_tables + seq * s.max_blocks;

  Vec* q = scratch.query.data();
  float* scores = scratch.scores.data();  // scores[i * padded_len + t] for query head i
  Vec* tile = scratch.tile.data();        // tile[(h * kLanes + j) * num_chunks + c]
  Vec* acc = scratch.acc.data();
  float* inv_sums = scratch.inv_sums.data();

#if defined(PDSERVE_AVX512_BF16)
  constexpr bool kBf16Dots = kDotsInBf16<Q, KV, kChunks>;
#else
  constexpr bool kBf16Dots = false;
#endif
  const int64_t first_q = seq * s.num_heads + kv_begin * G;  // the item's first row of out
  const Q* query = p.query + seq * p.query_row_stride + kv_begin * G * D;  // [num_q, D]
  if constexpr (!kBf16Dots) {  // the bf16 dots read the raw query rows and scale the scores
    for (int64_t i = 0; i < num_q; ++i) {
      load_row(query + i * D, num_full_chunks, tail, q + i * num_chunks);
      for (int64_t c = 0; c < num_chunks; ++c) {
        q[i * num_chunks + c] *= p.scale;
      }
    }
  }

  // Widens the rows of tokens [start, start + n) into the tile, advancing `rows` past them.
  auto load_tile = [&](RowCursor<KV>& rows, int64_t n) {
    for (int64_t j = 0; j < n; ++j, rows.next()) {
      for (int64_t h = 0; h < num_kv; ++h) {
        load_row(rows.row() + h * D, num_full_chunks, tail, tile + (h * kLanes + j) * num_chunks);
      }
    }
  };

  TilePrefetch<KV> prefetch(p.key_cache, p.value_cache, table, s, kv_begin, first, seq_len,
                            num_kv * D * static_cast<int64_t>(sizeof(KV)));
  for (int64_t i = 0; i < kPrefetchTiles; ++i) {
    prefetch.next_tile(1);
    prefetch.part();
  }

  // Pass 1, one tile of kLanes tokens at a time: kLanes dot products per query head, reduced
  // together into one vector of scores.
  RowCursor<KV> key_rows(p.key_cache, table, s, kv_begin, first);
#if defined(PDSERVE_AVX512_BF16)
  if constexpr (kBf16Dots) {
    // bf16 query and cache: vdpbf16ps multiplies the raw bf16 rows in pairs into fp32 sums, so
    // K is neither widened nor copied to the tile (half the multiply instructions). Products of
    // two bf16 are exact in fp32; only the order of the fp32 sums differs from the widened path.
    constexpr int64_t kPairs = kChunks * kLanes / 32;  // 512-bit vectors of 32 bf16 in a row
    for (int64_t start = 0; start < seq_len; start += kLanes) {
      const int64_t n = min64(kLanes, seq_len - start);
      const KV* rows[kLanes];
      for (int64_t j = 0; j < n; ++j, key_rows.next()) {
        rows[j] = key_rows.row();
      }
      for (int64_t j = n; j < kLanes; ++j) {
        rows[j] = rows[0];  // past n: scores land in the padding, overwritten below
      }
      prefetch.next_tile(num_q);
      for (int64_t i = 0; i < num_q; ++i) {
        prefetch.part();
        const Q* q_i = query + i * D;
        const int64_t head = (i / G) * D;
        __m512bh q_pairs[kPairs];
        for (int64_t c = 0; c < kPairs; ++c) {
          q_pairs[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q_i + 32 * c));
        }
        Vec dots[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {
          __m512 sum = _mm512_setzero_ps();
          for (int64_t c = 0; c < kPairs; ++c) {
            const __m512i k = _mm512_loadu_si512(rows[j] + head + 32 * c);
            sum = _mm512_dpbf16_ps(sum, q_pairs[c], reinterpret_cast<__m512bh>(k));
          }
          dots[j] = reinterpret_cast<Vec>(sum);
        }
        store(scores + i * padded_len + start, transpose_reduce(dots) * p.scale);
      }
    }
  } else
#endif
  {
    for (int64_t start = 0; start < seq_len; start += kLanes) {
      const int64_t n = min64(kLanes, seq_len - start);
      load_tile(key_rows, n);
      prefetch.next_tile(num_q);
      // Query head i reads KV head i / G, its group's tile (nested loops: a 64-bit idiv on the
      // path to every load of the tile measured 5 % of the kernel on the AVX2 Zen 3 host).
      for (int64_t h = 0, i = 0; h < num_kv; ++h) {
        const Vec* k_tile = tile + h * kLanes * num_chunks;
        for (int64_t g = 0; g < G; ++g, ++i) {
          prefetch.part();
          const Vec* q_i = q + i * num_chunks;
          // Rows past n hold stale data; their scores land in the padding, overwritten below.
          // Chunk-major: consecutive FMAs go to different tokens' sums, so none waits on the one
          // before it (token-major, each token's sum was one chain of dependent FMAs).
          Vec dots[kLanes];
          for (int64_t j = 0; j < kLanes; ++j) {
            dots[j] = q_i[0] * k_tile[j * num_chunks];
          }
          for (int64_t c = 1; c < num_chunks; ++c) {
            const Vec q_c = q_i[c];
            for (int64_t j = 0; j < kLanes; ++j) {
              dots[j] += q_c * k_tile[j * num_chunks + c];
            }
          }
          store(scores + i * padded_len + start, transpose_reduce(dots));
        }
      }
    }
  }

  // Softmax per query head, in place over whole vectors: the padding past seq_len is set to
  // -inf and comes out as ~1e-38, below an ulp of the sum (>= 1: the max contributes exp(0)),
  // and pass 2 never reads it. 1 / sum is applied to the output.
  for (int64_t i = 0; i < num_q; ++i) {
    float* row_scores = scores + i * padded_len;
    for (int64_t t = seq_len; t < padded_len; ++t) {
      row_scores[t] = -__builtin_inff();
    }
    Vec max_vec = load(row_scores);
    for (int64_t t = kLanes; t < padded_len; t += kLanes) {
      max_vec = vmax(max_vec, load(row_scores + t));
    }
    const float max_score = reduce_max(max_vec);
    Vec sum_vec = {};
    for (int64_t t = 0; t < padded_len; t += kLanes) {
      const Vec prob = exp_nonpositive(load(row_scores + t) - max_score);
      store(row_scores + t, prob);
      sum_vec += prob;
    }
    inv_sums[i] = 1.0f / reduce_add(sum_vec);
  }

  // Pass 2: acc = sum_t p_t * v_t, a tile of kLanes tokens at a time.
  for (int64_t i = 0; i < num_q * num_chunks; ++i) {
    acc[i] = Vec{};
  }
  RowCursor<KV> value_rows(p.value_cache, table, s, kv_begin, first);
  for (int64_t start = 0; start < seq_len; start += kLanes) {
    const int64_t n = min64(kLanes, seq_len - start);
    if constexpr (kGroupTile<kChunks> > 0) {
      // Each KV head's slice of a row is widened once, in registers, and multiplied into the
      // accumulators of its query heads (up to kGroupTile at a time, also in registers): no tile
      // is written and read back.
      const KV* rows[kLanes];
      for (int64_t j = 0; j < n; ++j, value_rows.next()) {
        rows[j] = value_rows.row();
      }
      prefetch.next_tile(num_kv);
      for (int64_t h = 0; h < num_kv; ++h) {
        prefetch.part();
        for (int64_t g = 0; g < G; g += kGroupTile<kChunks>) {
          const int64_t i = h * G + g;
          accumulate_values<KV, kChunks>(min64(kGroupTile<kChunks>, G - g), rows, n, h * D,
                                         scores + i * padded_len + start, padded_len,
                                         acc + i * kChunks);
        }
      }
      continue;
    }
    load_tile(value_rows, n);
    prefetch.next_tile(num_q);
    for (int64_t h = 0, i = 0; h < num_kv; ++h) {  // i / G is h, as in pass 1
      const Vec* v_tile = tile + h * kLanes * num_chunks;
      for (int64_t g = 0; g < G; ++g, ++i) {
        prefetch.part();
        const float* probs = scores + i * padded_len + start;
        Vec* acc_i = acc + i * num_chunks;
        Vec sums[kChunks ? kChunks : kMaxChunks];
        for (int64_t c = 0; c < num_chunks; ++c) {
          sums[c] = acc_i[c];
        }
        for (int64_t j = 0; j < n; ++j) {
          const Vec* v = v_tile + j * num_chunks;
          for (int64_t c = 0; c < num_chunks; ++c) {
            sums[c] += probs[j] * v[c];
          }
        }
        for (int64_t c = 0; c < num_chunks; ++c) {
          acc_i[c] = sums[c];
        }
      }
    }
  }

  for (int64_t i = 0; i < num_q; ++i) {
    Q* out_i = p.out + (first_q + i) * D;
    const Vec* acc_i = acc + i * num_chunks;
    for (int64_t c = 0; c < num_full_chunks; ++c) {
      store(out_i + c * kLanes, acc_i[c] * inv_sums[i]);
    }
    if (tail) {
      store_partial(out_i + num_full_chunks * kLanes, acc_i[num_full_chunks] * inv_sums[i], tail);
    }
  }
}

template <typename Q, typename KV>
void attend(const Problem<Q, KV>& p, int64_t seq, int64_t kv_begin, int64_t kv_end,
            Scratch& scratch) {
  switch (p.s.head_dim) {
    case 32:
      return attend<Q, KV, 32 / kLanes>(p, seq, kv_begin, kv_end, scratch);
    case 64:
      return attend<Q, KV, 64 / kLanes>(p, seq, kv_begin, kv_end, scratch);
    case 128:
      return attend<Q, KV, 128 / kLanes>(p, seq, kv_begin, kv_end, scratch);
    default:
      return attend<Q, KV, 0>(p, seq, kv_begin, kv_end, scratch);
  }
}

template <typename Q, typename KV>
void run_typed(const pdserve::DecodeArgs& a, int64_t begin, int64_t end) {
  const Problem<Q, KV> p{a.s,
                         static_cast<Q*>(a.out),
                         static_cast<const Q*>(a.query),
                         a.query_row_stride,
                         static_cast<const KV*>(a.key_cache),
                         static_cast<const KV*>(a.value_cache),
                         a.block_tables,
                         a.seq_lens,
                         a.scale,
                         a.window};
  Scratch scratch(a.s, a.heads_per_item, a.max_seq_len);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t seq = item / a.items_per_seq;
    const int64_t kv_begin = item % a.items_per_seq * a.heads_per_item;
    const int64_t kv_end = min64(kv_begin + a.heads_per_item, a.s.num_kv_heads);
    attend(p, seq, kv_begin, kv_end, scratch);
  }
}

}  // namespace

void pdserve::PDSERVE_RUN_ITEMS(const DecodeArgs& args, int64_t begin, int64_t end) {
  with_element_types(args.query_is_bf16, args.cache_type, [&](auto query, auto cache) {
    run_typed<decltype(query), decltype(cache)>(args, begin, end);
  });
}
