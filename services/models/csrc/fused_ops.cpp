// Fused elementwise ops of a decoder layer on the CPU (float32 / bfloat16):
//
//   torch.ops.pdserve.rms_norm(hidden, addend, weight, eps, out, isa)
//       hidden += addend (if given, in place), out = weight * normalise(hidden)
//   torch.ops.pdserve.rotary_(query, key, cos, sin, isa)
//       query, key rotated in place (rotate_half), by cos / sin [num_rows, head_dim]
//   torch.ops.pdserve.silu_and_mul(out, gate_up, isa)
//       out = silu(gate) * up, gate and up the halves of each gate_up row
//   torch.ops.pdserve.argmax_rows(logits, isa) -> indices
//       the first index of each row's maximum (NaN the maximum), int64 [num_rows]: greedy tokens
//   torch.ops.pdserve.write_kv_cache(key_cache, value_cache, key, value, slot_mapping, isa)
//       each token's K and V rows into its cache slot, rounded to the cache's dtype (float32,
//       bfloat16 or float8_e5m2, whatever the rows')
//
// fused_ops_isa.h says exactly what each computes. This file is the ops: it checks every
// argument (a wrong shape is an error, not a stray write), checks that this CPU runs the requested
// variant (cpu_isa.h: an error, never SIGILL), and splits the rows over torch's OpenMP threads.
// The kernels are fused_ops_kernel.h, compiled once per instruction set in fused_ops_<isa>.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "cache_dtype.h"
#include "cpu_isa.h"
#include "fused_ops_isa.h"

namespace {

pdserve::FusedOps select_ops(const std::string& isa, const char* op) {
  pdserve::check_cpu_runs(isa, op);
  if (isa == "portable") {
    return pdserve::fused_ops_portable();
  }
#if defined(__x86_64__)
  if (isa == "avx2") {
    return pdserve::fused_ops_avx2();
  }
  if (isa == "avx512") {
    return pdserve::fused_ops_avx512();
  }
  return pdserve::fused_ops_avx512_bf16();
#else
  TORCH_CHECK(false, op, ": unknown kernel variant '", isa, "'");
#endif
}

bool check_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": ", name,
              " must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  return dtype == at::kBFloat16;
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must be ",
              like.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
}

// Rows per task: enough elements that a task outweighs its scheduling.
int64_t grain(int64_t elements_per_row) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, elements_per_row));
}

void rms_norm(at::Tensor& hidden, const std::optional<at::Tensor>& addend, const at::Tensor& weight,
              double eps, at::Tensor& out, std::string isa) {
  const char* op = "rms_norm";
  const pdserve::FusedOps ops = select_ops(isa, op);
  const bool is_bf16 = check_dtype(hidden, op, "hidden");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "rms_norm: hidden must be a contiguous [num_rows, width], got shape ", hidden.sizes(),
              " strides ", hidden.strides());
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  check_like(weight, hidden, op, "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous [", width, "], got shape ", weight.sizes());
  check_like(out, hidden, op, "out");
  TORCH_CHECK(out.sizes() == hidden.sizes() && out.is_contiguous(),
              "rms_norm: out must be a contiguous ", hidden.sizes(), ", got ", out.sizes());
  if (addend.has_value()) {
    check_like(*addend, hidden, op, "addend");
    TORCH_CHECK(addend->sizes() == hidden.sizes() && addend->is_contiguous(),
                "rms_norm: addend must be a contiguous ", hidden.sizes(), ", got ",
                addend->sizes());
  }
  TORCH_CHECK(width >= 1, "rms_norm: width must be >= 1");
  pdserve::NormArgs args{hidden.data_ptr(),
                         addend.has_value() ? addend->const_data_ptr() : nullptr,
                         weight.const_data_ptr(),
                         out.data_ptr(),
                         width,
                         static_cast<float>(eps),
                         is_bf16};
  at::parallel_for(0, rows, grain(width),
                   [&](int64_t begin, int64_t end) { ops.rms_norm(args, begin, end); });
}

// [num_rows, heads, head_dim] with head_dim and heads contiguous; rows may be strided (a view of
// the fused QKV output).
void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
              "rotary_: ", name, " must be [num_rows, heads, head_dim] with contiguous heads, "
              "got shape ", t.sizes(), " strides ", t.strides());
}

void rotary(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin,
            std::string isa) {
  const char* op = "rotary_";
  const pdserve::FusedOps ops = select_ops(isa, op);
  const bool is_bf16 = check_dtype(query, op, "query");
  check_like(key, query, op, "key");
  check_like(cos, query, op, "cos");
  check_like(sin, query, op, "sin");
  check_heads(query, "query");
  check_heads(key, "key");
  const int64_t rows = query.size(0), dim = query.size(2);
  TORCH_CHECK(key.size(0) == rows && key.size(2) == dim, "rotary_: key must be [", rows,
              ", num_kv_heads, ", dim, "], got shape ", key.sizes());
  TORCH_CHECK(dim % 2 == 0, "rotary_: head_dim must be even, got ", dim);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->numel() == rows * dim && t->size(0) == rows,
                "rotary_: cos and sin must be contiguous [", rows, ", (1,) ", dim,
                "], got shape ", t->sizes());
  }
  pdserve::RotaryArgs args{query.data_ptr(),  key.data_ptr(),   cos.const_data_ptr(),
                           sin.const_data_ptr(), query.stride(0), key.stride(0),
                           query.size(1),     key.size(1),      dim,
                           is_bf16};
  const int64_t per_row = (query.size(1) + key.size(1)) * dim;
  at::parallel_for(0, rows, grain(per_row),
                   [&](int64_t begin, int64_t end) { ops.rotary(args, begin, end); });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up, std::string isa) {
  const char* op = "silu_and_mul";
  const pdserve::FusedOps ops = select_ops(isa, op);
  const bool is_bf16 = check_dtype(gate_up, op, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be a contiguous [num_rows, 2 * width], got shape ",
              gate_up.sizes());
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  check_like(out, gate_up, op, "out");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == width && out.is_contiguous(),
              "silu_and_mul: out must be a contiguous [", rows, ", ", width, "], got shape ",
              out.sizes());
  pdserve::SiluMulArgs args{gate_up.const_data_ptr(), out.data_ptr(), width, is_bf16};
  at::parallel_for(0, rows, grain(2 * width),
                   [&](int64_t begin, int64_t end) { ops.silu_and_mul(args, begin, end); });
}

at::Tensor argmax_rows(const at::Tensor& logits, std::string isa) {
  const char* op = "argmax_rows";
  const pdserve::FusedOps ops = select_ops(isa, op);
  const bool is_bf16 = check_dtype(logits, op, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0 &&
                  logits.size(1) <= INT32_MAX,
              "argmax_rows: logits must be a contiguous [num_rows, vocab_size] with 0 < "
              "vocab_size < 2^31, got shape ",
              logits.sizes());
  const int64_t rows = logits.size(0), width = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  pdserve::ArgmaxArgs args{logits.const_data_ptr(), out.data_ptr<int64_t>(), width, is_bf16};
  at::parallel_for(0, rows, grain(width),
                   [&](int64_t begin, int64_t end) { ops.argmax(args, begin, end); });
  return out;
}

// key, value: [num_tokens, num_kv_heads, head_dim] with contiguous heads (rows may be strided:
// views of the fused QKV output); the caches: contiguous [num_blocks, block_size, num_kv_heads,
// head_dim]; slot_mapping: int64 [num_tokens], each < num_blocks * block_size.
void write_kv_cache(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key,
                    const at::Tensor& value, const at::Tensor& slot_mapping, std::string isa) {
  const char* op = "write_kv_cache";
  const pdserve::FusedOps ops = select_ops(isa, op);
  const bool is_bf16 = check_dtype(key, op, "key");
  check_like(value, key, op, "value");
  const pdserve::CacheType cache_type = pdserve::check_cache_dtypes(op, key_cache, value_cache);
  TORCH_CHECK(key_cache.device().is_cpu(), op, ": key_cache must be on the CPU, got ",
              key_cache.device());
  check_like(value_cache, key_cache, op, "value_cache");
  for (const auto& [t, name] : {std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "write_kv_cache: ", name, " must be [num_tokens, num_kv_heads, head_dim] with "
                "contiguous heads, got shape ", t->sizes(), " strides ", t->strides());
  }
  const int64_t rows = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(value.sizes() == key.sizes(), "write_kv_cache: value must be shaped like key ",
              key.sizes(), ", got ", value.sizes());
  for (const auto& [t, name] :
       {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    TORCH_CHECK(t->dim() == 4 && t->is_contiguous() && t->size(2) == heads && t->size(3) == dim,
                "write_kv_cache: ", name, " must be a contiguous [num_blocks, block_size, ", heads,
                ", ", dim, "], got shape ", t->sizes());
  }
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(),
              "write_kv_cache: value_cache must be shaped like key_cache ", key_cache.sizes(),
              ", got ", value_cache.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == rows && slot_mapping.is_contiguous() &&
                  slot_mapping.device().is_cpu(),
              "write_kv_cache: slot_mapping must be a contiguous int64 [", rows,
              "] on the CPU, got ", slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "write_kv_cache: slot_mapping[", i,
                "] = ", slots[i], " is outside the cache's ", num_slots, " slots");
  }
  pdserve::KvWriteArgs args{};
  args.key = key.const_data_ptr();
  args.value = value.const_data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.slots = slots;
  args.key_stride = key.stride(0);
  args.value_stride = value.stride(0);
  args.row_width = heads * dim;
  args.is_bf16 = is_bf16;
  args.cache_type = cache_type;
  at::parallel_for(0, rows, grain(2 * heads * dim),
                   [&](int64_t begin, int64_t end) { ops.write_kv_cache(args, begin, end); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "rms_norm(Tensor(a!) hidden, Tensor? addend, Tensor weight, float eps, Tensor(b!) out, "
      "str isa) -> ()");
  m.def("rotary_(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin, str isa) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up, str isa) -> ()");
  m.def("argmax_rows(Tensor logits, str isa) -> Tensor");
  m.def(
      "write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
      "Tensor slot_mapping, str isa) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("write_kv_cache", &write_kv_cache);
}
