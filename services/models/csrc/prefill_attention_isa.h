// The interface between the prefill attention op (prefill_attention.cpp, built for the baseline
// ISA) and its kernel variants (prefill_attention_<isa>.cpp, each built for its own instruction
// set). Like paged_attention_isa.h it holds no vector types and no templates, so nothing compiled
// for one ISA can be linked into code that runs on another.
#pragma once

#include <cstdint>

#include "cache_type.h"

namespace pdserve {

struct PrefillShape {
  int64_t num_chunks, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

struct PrefillArgs {
  PrefillShape s;
  void* out;                       // [num_tokens, num_heads, head_dim], float or bf16 bits
  const void* query;               // like out, rows query_row_stride elements apart
  int64_t query_row_stride;        // >= num_heads * head_dim: a view of a fused QKV row
  const void* key_cache;           // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;         // like key_cache; of cache_type, independently of query
  const int64_t* block_tables;     // [num_chunks, max_blocks]
  const int64_t* query_starts;     // [num_chunks]: row of each chunk's first query
  const int64_t* query_lens;       // [num_chunks]: its queries, >= 0
  const int64_t* start_positions;  // [num_chunks]: position of its first query (cached before)
  float scale;
  bool query_is_bf16;              // element type of out and query: bf16, else float
  CacheType cache_type;            // element type of the caches
  int64_t tile_tokens;             // query tokens of one work item (times group = its rows)
  const int64_t* first_items;      // [num_chunks + 1]: index of each chunk's first work item
};

// Work items [begin, end) on the calling thread. The items of chunk c are first_items[c] ..
// first_items[c + 1] - 1, ordered by KV head, then by tile of tile_tokens queries.
using RunPrefillItems = void (*)(const PrefillArgs& args, int64_t begin, int64_t end);

void run_prefill_items_portable(const PrefillArgs& args, int64_t begin, int64_t end);
#if defined(__x86_64__)
void run_prefill_items_avx2(const PrefillArgs& args, int64_t begin, int64_t end);
void run_prefill_items_avx512(const PrefillArgs& args, int64_t begin, int64_t end);
void run_prefill_items_avx512_bf16(const PrefillArgs& args, int64_t begin, int64_t end);
// AVX512-BF16 with the products of a bf16 query and cache on the AMX tiles.
void run_prefill_items_amx(const PrefillArgs& args, int64_t begin, int64_t end);
#endif

}  // namespace pdserve
