// Prefill attention over paged K/V, every chunk of a step in one call (CPU, float32 / bfloat16;
// the cache also float8_e5m2).
//
//   torch.ops.pdserve.paged_prefill_attention(out, query, key_cache, value_cache, block_tables,
//                                             query_starts, query_lens, start_positions, scale,
//                                             isa)
//
// query, out:              [num_tokens, num_heads, head_dim], float32 or bfloat16: the step's
//                          flat batch; only the chunks' rows of out are written. out is
//                          contiguous; query's rows may be further apart (a view of the fused
//                          QKV projection's output: no copy).
// key_cache, value_cache:  [num_blocks, block_size, num_kv_heads, head_dim], float32,
//                          bfloat16 or float8_e5m2 (both the same), independently of query;
//                          each chunk's own K/V already written (the backend writes before it
//                          attends).
// block_tables:            [num_chunks, max_blocks] int64; entries past a chunk's context are
//                          never read.
// query_starts, query_lens, start_positions: [num_chunks] int64. Chunk c's queries are rows
//                          query_starts[c] .. + query_lens[c] - 1, at positions
//                          start_positions[c] .. (tokens cached before it: a prefix hit or
//                          earlier chunks of its prompt); query i sees keys 0 .. its position.
//                          Chunks are in row order and do not overlap.
// isa:                     the kernel variant, as for paged_decode_attention, or "amx": the
//                          avx512_bf16 one with a bf16 query and cache (and head_dim a
//                          multiple of 32) multiplied on the AMX tiles instead of vdpbf16ps.
//
// Why: the torch path pads the chunks to one length and gathers their queries, K/V and outputs
// around one SDPA call; torch's flash kernel does the full square at 256 tokens (causal is no
// faster) and on a CPU without AMX runs fp32 well below the GEMM rate. This kernel reads the flat
// rows and the cache in place and skips every key block above the diagonal.
//
// This file is the op: it checks every argument (bad metadata is an error, not a crash or a
// stray write), checks that this CPU runs the requested variant (never SIGILL), cuts the work
// into items of one chunk, one KV head and up to kTileRows / group queries, splits them over
// torch's OpenMP threads by their work (a tile late in a long chunk sees more keys), and calls
// the variant. The kernel is prefill_attention_kernel.h, compiled per ISA in
// prefill_attention_<isa>.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "amx_linear_isa.h"
#include "cache_dtype.h"
#include "cpu_isa.h"
#include "prefill_attention_isa.h"

namespace {

using pdserve::PrefillArgs;
using pdserve::RunPrefillItems;

// Query rows (tokens x group) of one work item. More rows amortise the per-block work that
// does not grow with them (reading, widening or interleaving the block's K/V rows): 9 x 256
// tokens, 12 / 4 heads x 64, bf16 on the AMX host, 48 / 96 / 192 rows took 2.81 / 2.72 / 2.56 ms
// a layer with AMX and 5.36 / 5.26 / 4.95 ms without. Fewer rows make more items, for
// threads to share: the op halves the tile, down to kMinTileRows, until every thread has
// kItemsPerThread items.
constexpr int64_t kTileRows = 192;
constexpr int64_t kMinTileRows = 48;
constexpr int64_t kItemsPerThread = 4;

// Query tokens of one work item (see kTileRows).
int64_t choose_tile_tokens(int64_t group, int64_t num_kv_heads, const int64_t* lens,
                           int64_t num_chunks) {
  const int64_t wanted = kItemsPerThread * std::max(1, at::get_num_threads());
  int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  while (tile_tokens * group > kMinTileRows && tile_tokens > 1) {
    int64_t items = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
      items += std::max<int64_t>(lens[c], 0) / tile_tokens * num_kv_heads;
    }
    if (items >= wanted) {
      break;
    }
    tile_tokens /= 2;
  }
  return tile_tokens;
}

RunPrefillItems select_variant(const std::string& isa) {
#if defined(__x86_64__)
  if (isa == "amx") {
    const std::string reason = pdserve::amx_unavailable_reason();
    TORCH_CHECK(reason.empty(), "paged_prefill_attention: the amx kernel is unavailable: ",
                reason);
    return pdserve::run_prefill_items_amx;
  }
#endif
  pdserve::check_cpu_runs(isa, "paged_prefill_attention");
  if (isa == "portable") {
    return pdserve::run_prefill_items_portable;
  }
#if defined(__x86_64__)
  return isa == "avx2"     ? pdserve::run_prefill_items_avx2
         : isa == "avx512" ? pdserve::run_prefill_items_avx512
                           : pdserve::run_prefill_items_avx512_bf16;
#else
  return nullptr;  // check_cpu_runs raised
#endif
}

void check_int64_vector(const at::Tensor& t, const char* name, int64_t num_chunks) {
  TORCH_CHECK(t.scalar_type() == at::kLong, "paged_prefill_attention: ", name,
              " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == num_chunks, "paged_prefill_attention: ", name,
              " must be [num_chunks=", num_chunks, "], got shape ", t.sizes());
}

void paged_prefill_attention(
    at::Tensor& out,
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& query_starts,
    const at::Tensor& query_lens,
    const at::Tensor& start_positions,
    double scale,
    std::string isa) {
  const RunPrefillItems run = select_variant(isa);
  const std::pair<const char*, const at::Tensor*> named[] = {
      {"out", &out},
      {"key_cache", &key_cache},
      {"value_cache", &value_cache},
      {"block_tables", &block_tables},
      {"query_starts", &query_starts},
      {"query_lens", &query_lens},
      {"start_positions", &start_positions}};
  for (const auto& [name, t] : named) {
    TORCH_CHECK(t->device().is_cpu(), "paged_prefill_attention: ", name,
                " must be on the CPU, got ", t->device());
    TORCH_CHECK(t->is_contiguous(), "paged_prefill_attention: ", name,
                " must be contiguous, got strides ", t->strides(), " for shape ", t->sizes());
  }
  TORCH_CHECK(query.device().is_cpu(), "paged_prefill_attention: query must be on the CPU, got ",
              query.device());
  TORCH_CHECK(query.dim() == 3,
              "paged_prefill_attention: query must be [num_tokens, num_heads, head_dim], got "
              "shape ", query.sizes());
  // Each row's heads contiguous; the rows any distance apart that does not overlap them.
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  (query.size(0) <= 1 || query.stride(0) >= query.size(1) * query.size(2)),
              "paged_prefill_attention: query's rows must each be contiguous, got strides ",
              query.strides(), " for shape ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_prefill_attention: out must have query's "
              "shape ", query.sizes(), ", got ", out.sizes());
  TORCH_CHECK(key_cache.dim() == 4,
              "paged_prefill_attention: key_cache must be [num_blocks, block_size, num_kv_heads, "
              "head_dim], got shape ", key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "paged_prefill_attention: value_cache "
              "must have key_cache's shape ", key_cache.sizes(), ", got ", value_cache.sizes());
  const auto dtype = query.scalar_type();
  const pdserve::CacheType cache_type =
      pdserve::check_cache_dtypes("paged_prefill_attention", key_cache, value_cache);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_prefill_attention: query must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype,
              "paged_prefill_attention: out must have query's dtype ", dtype, ", got ",
              out.scalar_type());

  pdserve::PrefillShape s;
  const int64_t num_tokens = query.size(0);
  s.num_heads = query.size(1);
  s.head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0);
  s.block_size = key_cache.size(1);
  s.num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == s.head_dim, "paged_prefill_attention: key_cache head_dim ",
              key_cache.size(3), " != query head_dim ", s.head_dim);
  TORCH_CHECK(s.head_dim >= 1, "paged_prefill_attention: head_dim must be >= 1");
  TORCH_CHECK(s.block_size >= 1, "paged_prefill_attention: block_size must be >= 1");
  TORCH_CHECK(s.num_kv_heads >= 1 && s.num_heads % s.num_kv_heads == 0,
              "paged_prefill_attention: num_heads ", s.num_heads,
              " is not a multiple of num_kv_heads ", s.num_kv_heads);
  s.group = s.num_heads / s.num_kv_heads;
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2,
              "paged_prefill_attention: block_tables must be int64 [num_chunks, max_blocks], "
              "got ", block_tables.scalar_type(), " of shape ", block_tables.sizes());
  s.num_chunks = block_tables.size(0);
  s.max_blocks = block_tables.size(1);
  check_int64_vector(query_starts, "query_starts", s.num_chunks);
  check_int64_vector(query_lens, "query_lens", s.num_chunks);
  check_int64_vector(start_positions, "start_positions", s.num_chunks);

  // Check everything the kernel dereferences or writes, and count each chunk's work items.
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* starts = query_starts.const_data_ptr<int64_t>();
  const int64_t* lens = query_lens.const_data_ptr<int64_t>();
  const int64_t* positions = start_positions.const_data_ptr<int64_t>();
  std::vector<int64_t> first_items(s.num_chunks + 1, 0);
  int64_t next_row = 0;
  for (int64_t c = 0; c < s.num_chunks; ++c) {
    TORCH_CHECK(lens[c] >= 0, "paged_prefill_attention: query_lens[", c, "] = ", lens[c],
                " is negative");
    TORCH_CHECK(starts[c] >= next_row && starts[c] + lens[c] <= num_tokens,
                "paged_prefill_attention: chunk ", c, "'s rows [", starts[c], ", ",
                starts[c] + lens[c], ") overlap an earlier chunk or leave the ", num_tokens,
                " query rows");
    next_row = starts[c] + lens[c];
    const int64_t context = positions[c] + lens[c];
    TORCH_CHECK(positions[c] >= 0 && context <= s.max_blocks * s.block_size,
                "paged_prefill_attention: start_positions[", c, "] = ", positions[c],
                " puts the chunk's context (", context, ") outside [0, max_blocks * block_size "
                "= ", s.max_blocks * s.block_size, "]");
    // The kernel holds positions as fp32 (its causal mask is a vector compare): exact up to 2^24.
    TORCH_CHECK(context <= (int64_t{1} << 24), "paged_prefill_attention: chunk ", c,
                "'s context (", context, ") is past 2^24 positions");
    const int64_t num_used_blocks = lens[c] ? (context + s.block_size - 1) / s.block_size : 0;
    for (int64_t b = 0; b < num_used_blocks; ++b) {
      const int64_t id = tables[c * s.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_prefill_attention: block_tables[", c, ", ",
                  b, "] = ", id, " is outside the cache's ", num_blocks, " blocks");
    }
  }
  const int64_t tile_tokens = choose_tile_tokens(s.group, s.num_kv_heads, lens, s.num_chunks);
  for (int64_t c = 0; c < s.num_chunks; ++c) {
    const int64_t tiles = (lens[c] + tile_tokens - 1) / tile_tokens;
    first_items[c + 1] = first_items[c] + tiles * s.num_kv_heads;
  }
  const int64_t num_items = first_items[s.num_chunks];
  if (num_items == 0) {
    return;
  }

  PrefillArgs args{};
  args.s = s;
  args.out = out.data_ptr();
  args.query = query.const_data_ptr();
  args.query_row_stride = query.size(0) <= 1 ? s.num_heads * s.head_dim : query.stride(0);
  args.key_cache = key_cache.const_data_ptr();
  args.value_cache = value_cache.const_data_ptr();
  args.block_tables = tables;
  args.query_starts = starts;
  args.query_lens = lens;
  args.start_positions = positions;
  args.scale = static_cast<float>(scale);
  args.query_is_bf16 = dtype == at::kBFloat16;
  args.cache_type = cache_type;
  args.tile_tokens = tile_tokens;
  args.first_items = first_items.data();

  // Item work ~ its queries x the keys its last query sees. One contiguous range of items per
  // thread (consecutive items share a chunk's K/V in the cache), each with about equal work.
  std::vector<int64_t> work(num_items);
  int64_t total = 0;
  for (int64_t c = 0, item = 0; c < s.num_chunks; ++c) {
    for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
      for (int64_t t0 = 0; t0 < lens[c]; t0 += tile_tokens, ++item) {
        const int64_t n = std::min(tile_tokens, lens[c] - t0);
        work[item] = n * (positions[c] + t0 + n);
        total += work[item];
      }
    }
  }
  const int64_t num_parts = std::min<int64_t>(std::max(1, at::get_num_threads()), num_items);
  std::vector<int64_t> bounds(num_parts + 1, num_items);
  bounds[0] = 0;
  int64_t part = 1, done = 0;
  for (int64_t item = 0; item < num_items && part < num_parts; ++item) {
    done += work[item];
    if (done * num_parts >= total * part) {
      bounds[part++] = item + 1;
    }
  }
  at::parallel_for(0, num_parts, 1, [&](int64_t begin, int64_t end) {
    run(args, bounds[begin], bounds[end]);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor query_starts, Tensor query_lens, "
      "Tensor start_positions, float scale, str isa) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
