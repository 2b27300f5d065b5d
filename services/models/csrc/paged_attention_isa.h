// The interface between the dispatching op (paged_attention.cpp, built for the baseline ISA) and
// the kernel variants (paged_attention_<isa>.cpp, each built for its own instruction set). It
// holds no vector types and no templates, so nothing compiled for one ISA can be linked into code
// that runs on another: each variant keeps its kernel in an anonymous namespace and exports only
// its run_items_<isa> function, which the op calls after checking that this CPU runs that ISA.
#pragma once

#include <cstdint>

#include "cache_type.h"

namespace pdserve {

struct DecodeShape {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

struct DecodeArgs {
  DecodeShape s;
  void* out;                    // [num_seqs, num_heads, head_dim], float or bf16 bits
  const void* query;            // like out, rows query_row_stride elements apart
  int64_t query_row_stride;     // >= num_heads * head_dim: a view of a fused QKV row
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_dim], cache_type
  const void* value_cache;      // like key_cache
  const int64_t* block_tables;  // [num_seqs, max_blocks]
  const int64_t* seq_lens;      // [num_seqs], each in [1, max_blocks * block_size], checked
  float scale;
  bool query_is_bf16;           // element type of out and query: bf16, else float
  CacheType cache_type;         // element type of key_cache and value_cache
  int64_t heads_per_item;       // a work item: one sequence and this many of its KV heads
  int64_t items_per_seq;
  int64_t max_seq_len;          // the longest seq_lens entry (sizes the scratch)
  int64_t window;               // > 0: a sequence attends to its last `window` tokens only
};

// Work items [begin, end) on the calling thread; item i is sequence i / items_per_seq, KV heads
// from (i % items_per_seq) * heads_per_item.
using RunItems = void (*)(const DecodeArgs& args, int64_t begin, int64_t end);

// One per kernel variant; the AVX ones exist only in x86-64 builds.
void run_items_portable(const DecodeArgs& args, int64_t begin, int64_t end);
#if defined(__x86_64__)
void run_items_avx2(const DecodeArgs& args, int64_t begin, int64_t end);
void run_items_avx512(const DecodeArgs& args, int64_t begin, int64_t end);
void run_items_avx512_bf16(const DecodeArgs& args, int64_t begin, int64_t end);
#endif

}  // namespace pdserve
