// Decode attention that reads K/V straight out of the paged cache (CPU, float32 / bfloat16; the
// cache also float8_e5m2).
//
//   torch.ops.pdserve.paged_decode_attention(out, query, key_cache, value_cache,
//                                            block_tables, seq_lens, scale, isa, window=0)
//
// query, out:              [num_seqs, num_heads, head_dim], float32 or bfloat16; out
//                          contiguous, query's rows may lie apart (a view of the fused QKV
//                          output) as long as each row's heads are contiguous
// key_cache, value_cache:  [num_blocks, block_size, num_kv_heads, head_dim], float32,
//                          bfloat16 or float8_e5m2 (both the same), independently of query
//                          (e.g. a bf16 cache, fp32 query)
// block_tables:            [num_seqs, max_blocks] int64; entries past a sequence's length are
//                          never read, so they may hold anything.
// seq_lens:                [num_seqs] int64, context length including the new token, >= 1.
// isa:                     the kernel variant: "avx512_bf16", "avx512", "avx2" or "portable".
// window:                  > 0: each sequence attends to its last `window` tokens only (a
//                          sliding-window layer's, Gemma 3's: positions (p - window, p] for the
//                          new token at p); 0: to its whole context.
//
// This file is the op: it checks every argument (bad metadata is an error, not a crash), checks
// that this CPU runs the requested variant (an error, never SIGILL), cuts the work and calls the
// variant. The kernel itself is paged_attention_kernel.h, compiled once per instruction set in
// paged_attention_<isa>.cpp, all in one library built with the baseline flags: one build serves
// every host, and a test can run each variant the host supports.
//
// A work item is one sequence and a run of its KV heads: all of them when there are at least as
// many sequences as threads (a token's row of all heads is contiguous in the cache and streams
// best), fewer otherwise. The items are cut into one contiguous range per thread of about equal
// context tokens (at::parallel_for, torch's OpenMP pool).
//
// Only light headers (no pybind11, no torch/extension.h) to keep the first build short; the op
// is registered with TORCH_LIBRARY and loaded with torch.ops.load_library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cache_dtype.h"
#include "cpu_isa.h"
#include "paged_attention_isa.h"

namespace {

using pdserve::DecodeArgs;
using pdserve::RunItems;

// The variant named `isa`, after checking that this CPU executes its instructions (cpu_isa.h).
RunItems select_variant(const std::string& isa) {
  pdserve::check_cpu_runs(isa, "paged_decode_attention");
  if (isa == "portable") {
    return pdserve::run_items_portable;
  }
#if defined(__x86_64__)
  return isa == "avx2"     ? pdserve::run_items_avx2
         : isa == "avx512" ? pdserve::run_items_avx512
                           : pdserve::run_items_avx512_bf16;
#else
  return nullptr;  // check_cpu_runs raised
#endif
}

void paged_decode_impl(DecodeArgs& a, RunItems run) {
  const pdserve::DecodeShape& s = a.s;
  const int64_t num_threads = std::max<int64_t>(1, at::get_num_threads());
  // A work item is one sequence and a run of its KV heads. Whole rows (all KV heads of a token,
  // contiguous in the cache) stream best, so a sequence's heads are split only when there are
  // fewer sequences than threads.
  const int64_t num_splits =
      std::min(s.num_kv_heads, (num_threads + s.num_seqs - 1) / s.num_seqs);
  a.heads_per_item = (s.num_kv_heads + num_splits - 1) / num_splits;
  a.items_per_seq = (s.num_kv_heads + a.heads_per_item - 1) / a.heads_per_item;
  const int64_t num_items = s.num_seqs * a.items_per_seq;

  // One contiguous range of items per thread, each with about the same number of context
  // tokens, so that a batch with its long contexts at one end does not leave a thread idle.
  const int64_t num_parts = std::min(num_threads, num_items);
  // The tokens an item reads: its context, or the window's end of it.
  auto read = [&](int64_t seq) {
    return a.window > 0 ? std::min(a.seq_lens[seq], a.window) : a.seq_lens[seq];
  };
  int64_t total_tokens = 0;
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    total_tokens += read(i) * a.items_per_seq;
  }
  std::vector<int64_t> bounds(num_parts + 1, num_items);
  bounds[0] = 0;
  int64_t part = 1, tokens = 0;
  for (int64_t item = 0; item < num_items && part < num_parts; ++item) {
    tokens += read(item / a.items_per_seq);
    if (tokens * num_parts >= total_tokens * part) {
      bounds[part++] = item + 1;
    }
  }

  at::parallel_for(0, num_parts, 1, [&](int64_t begin, int64_t end) {
    run(a, bounds[begin], bounds[end]);
  });
}

void paged_decode_attention(
    at::Tensor& out,
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    double scale,
    std::string isa,
    int64_t window) {
  const RunItems run = select_variant(isa);
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0, got ", window);
  const std::pair<const char*, const at::Tensor*> named[] = {
      {"out", &out},
      {"key_cache", &key_cache},
      {"value_cache", &value_cache},
      {"block_tables", &block_tables},
      {"seq_lens", &seq_lens}};
  for (const auto& [name, t] : named) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: ", name,
                " must be on the CPU, got ", t->device());
    TORCH_CHECK(t->is_contiguous(), "paged_decode_attention: ", name,
                " must be contiguous, got strides ", t->strides(), " for shape ", t->sizes());
  }
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim], got shape ",
              query.sizes());
  // query may be a view of the fused QKV output: rows apart, each row's heads contiguous.
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention: query must be on the CPU, got ",
              query.device());
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) &&
                  (query.size(0) <= 1 || query.stride(0) >= query.size(1) * query.size(2)),
              "paged_decode_attention: query's rows must each be contiguous, got strides ",
              query.strides(), " for shape ", query.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have query's shape ", query.sizes(),
              ", got ", out.sizes());
  TORCH_CHECK(key_cache.dim() == 4,
              "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
              key_cache.sizes());
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache must have key_cache's shape ",
              key_cache.sizes(), ", got ", value_cache.sizes());
  // query and out share one dtype, float32 or bfloat16; the caches another (a bf16 cache under
  // fp32 compute halves the bytes decode reads, an fp8 one quarters them), float32, bfloat16 or
  // float8_e5m2.
  const auto dtype = query.scalar_type();
  const pdserve::CacheType cache_type =
      pdserve::check_cache_dtypes("paged_decode_attention", key_cache, value_cache);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "paged_decode_attention: query must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype, "paged_decode_attention: out must have query's dtype ",
              dtype, ", got ", out.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64, got ", block_tables.scalar_type(), " and ",
              seq_lens.scalar_type());

  pdserve::DecodeShape s;
  s.num_seqs = query.size(0);
  s.num_heads = query.size(1);
  s.head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0);
  s.block_size = key_cache.size(1);
  s.num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == s.head_dim, "key_cache head_dim ", key_cache.size(3),
              " != query head_dim ", s.head_dim);
  // 512: the kernel's kMaxHeadDim.
  TORCH_CHECK(s.head_dim >= 1 && s.head_dim <= 512, "head_dim must be in [1, 512], got ",
              s.head_dim);
  TORCH_CHECK(s.block_size >= 1, "block_size must be >= 1, got ", s.block_size);
  TORCH_CHECK(s.num_kv_heads >= 1 && s.num_heads % s.num_kv_heads == 0, "num_heads ",
              s.num_heads, " is not a multiple of num_kv_heads ", s.num_kv_heads);
  s.group = s.num_heads / s.num_kv_heads;
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == s.num_seqs,
              "block_tables must be [num_seqs=", s.num_seqs, ", max_blocks], got shape ",
              block_tables.sizes());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == s.num_seqs,
              "seq_lens must be [num_seqs=", s.num_seqs, "], got shape ", seq_lens.sizes());
  s.max_blocks = block_tables.size(1);
  if (s.num_seqs == 0) {
    return;
  }

  // Check everything the kernel will dereference, so bad metadata is an error, not a crash.
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();
  int64_t max_seq_len = 0;
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t len = lens[i];
    TORCH_CHECK(len >= 1 && len <= s.max_blocks * s.block_size, "seq_lens[", i, "] = ", len,
                " is outside [1, max_blocks * block_size = ", s.max_blocks * s.block_size, "]");
    max_seq_len = std::max(max_seq_len, len);
    const int64_t num_used_blocks = (len + s.block_size - 1) / s.block_size;
    for (int64_t b = 0; b < num_used_blocks; ++b) {
      const int64_t id = tables[i * s.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", i, ", ", b, "] = ", id,
                  " is outside the cache's ", num_blocks, " blocks");
    }
  }

  DecodeArgs args{};
  args.s = s;
  args.out = out.data_ptr();
  args.query = query.const_data_ptr();
  args.query_row_stride = query.size(0) <= 1 ? s.num_heads * s.head_dim : query.stride(0);
  args.key_cache = key_cache.const_data_ptr();
  args.value_cache = value_cache.const_data_ptr();
  args.block_tables = tables;
  args.seq_lens = lens;
  args.scale = static_cast<float>(scale);
  args.query_is_bf16 = dtype == at::kBFloat16;
  args.cache_type = cache_type;
  args.max_seq_len = window > 0 ? std::min(max_seq_len, window) : max_seq_len;
  args.window = window;
  paged_decode_impl(args, run);
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale, str isa, "
      "int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
