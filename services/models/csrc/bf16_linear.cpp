// bf16 linears of few rows on vdpbf16ps, over a weight that oneDNN packed (CPUs with AVX512-BF16
// and no AMX; with AMX, amx_linear.cpp runs them):
//
//   torch.ops.pdserve.bf16_linear(x, weight_address, in_features, out_features, bias, epilogue,
//                                 other, isa) -> out
//       out = epilogue(x @ weight^T + bias), x [num_rows, in_features] bf16, out [num_rows,
//       out_features] bf16; epilogue "none", "silu" or "mul" (times other [num_rows,
//       out_features]).
//
// weight_address is the data of a oneDNN-packed bf16 weight (torch.ops.mkldnn.data_ptr of
// mkldnn._reorder_linear_weight's result) in the [out/64][in/2][64][2] layout bf16_linear_isa.h
// describes. As for fp32_linear.cpp: the op cannot check that address (its only caller,
// services/models/bf16_linear.py, verified the packed bytes against the plain weight once and
// holds the packed tensor while it calls); this file checks everything else, checks that this
// CPU runs the requested variant (cpu_isa.h: an error, never SIGILL; avx512_bf16 is the only
// one), and splits the output's 64-column panels over torch's OpenMP threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "bf16_linear_isa.h"
#include "cpu_isa.h"
#include "few_row_linear_args.h"

namespace {

at::Tensor bf16_linear(const at::Tensor& x, int64_t weight_address, int64_t in_features,
                       int64_t out_features, const std::optional<at::Tensor>& bias,
                       std::string epilogue, const std::optional<at::Tensor>& other,
                       std::string isa) {
  TORCH_CHECK(isa == "avx512_bf16", "bf16_linear: isa must be avx512_bf16, got '", isa, "'");
  pdserve::check_cpu_runs(isa, "bf16_linear");
  const pdserve::LinearEpilogue kind = pdserve::check_linear_args(
      "bf16_linear", {at::kBFloat16, "bfloat16"}, x, in_features, out_features, bias, epilogue,
      other);
  const int64_t num_rows = x.size(0);
  TORCH_CHECK(in_features > 0 && in_features % 2 == 0 && out_features > 0 &&
                  out_features % pdserve::kBf16Panel == 0,
              "bf16_linear: in_features must be a positive even number and out_features a "
              "positive multiple of 64, got ",
              in_features, " and ", out_features);
  TORCH_CHECK(weight_address != 0, "bf16_linear: weight_address is null");
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) {
    return out;
  }
#if defined(__x86_64__)
  pdserve::Bf16LinearArgs args{};
  const auto bits = [](const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
  };
  args.x = bits(x);
  args.weight = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(weight_address));
  args.bias = bias ? bits(*bias) : nullptr;
  args.other = other ? bits(*other) : nullptr;
  args.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  args.num_rows = num_rows;
  args.in_features = in_features;
  args.out_features = out_features;
  args.epilogue = kind;
  at::parallel_for(0, out_features / pdserve::kBf16Panel, 1, [&](int64_t begin, int64_t end) {
    pdserve::bf16_linear_panels_avx512_bf16(args, begin, end);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "bf16_linear(Tensor x, int weight_address, int in_features, int out_features, Tensor? "
      "bias, str epilogue, Tensor? other, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
}
