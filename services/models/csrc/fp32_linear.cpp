// fp32 linears of few rows over a weight that oneDNN packed:
//
//   torch.ops.pdserve.fp32_linear(x, weight_address, in_features, out_features, bias, epilogue,
//                                 other, isa) -> out
//       out = epilogue(x @ weight^T + bias), x [num_rows, in_features] fp32, out [num_rows,
//       out_features] fp32; epilogue "none", "silu" or "mul" (times other [num_rows,
//       out_features]).
//
// weight_address is the data of a oneDNN-packed fp32 weight (torch.ops.mkldnn.data_ptr of
// mkldnn._reorder_linear_weight's result) in the [out/64][in][64] layout fp32_linear_isa.h
// describes. The op cannot check that address: its only caller (services/models/fp32_linear.py)
// verified the packed bytes against the plain weight once, and holds the packed tensor while it
// calls. This file checks everything else (a wrong shape is an error, not a stray write), checks
// that this CPU runs the requested variant (cpu_isa.h: an error, never SIGILL), and splits the
// output's 64-column panels over torch's OpenMP threads. The kernels are fp32_linear_kernel.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cpu_isa.h"
#include "few_row_linear_args.h"
#include "fp32_linear_isa.h"

namespace {

pdserve::RunFp32Panels select_kernel(const std::string& isa) {
  pdserve::check_cpu_runs(isa, "fp32_linear");
#if defined(__x86_64__)
  if (isa == "avx2") {
    return pdserve::fp32_linear_panels_avx2;
  }
  if (isa == "avx512" || isa == "avx512_bf16") {
    return pdserve::fp32_linear_panels_avx512;
  }
#endif
  return pdserve::fp32_linear_panels_portable;
}

at::Tensor fp32_linear(const at::Tensor& x, int64_t weight_address, int64_t in_features,
                       int64_t out_features, const std::optional<at::Tensor>& bias,
                       std::string epilogue, const std::optional<at::Tensor>& other,
                       std::string isa) {
  const pdserve::RunFp32Panels run = select_kernel(isa);
  const pdserve::LinearEpilogue kind = pdserve::check_linear_args(
      "fp32_linear", {at::kFloat, "float32"}, x, in_features, out_features, bias, epilogue,
      other);
  const int64_t num_rows = x.size(0);
  TORCH_CHECK(in_features > 0 && out_features > 0 && out_features % pdserve::kFp32Panel == 0,
              "fp32_linear: in_features must be positive and out_features a positive multiple "
              "of 64, got ",
              in_features, " and ", out_features);
  TORCH_CHECK(weight_address != 0, "fp32_linear: weight_address is null");
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) {
    return out;
  }
  pdserve::Fp32LinearArgs args{};
  args.x = x.const_data_ptr<float>();
  args.weight = reinterpret_cast<const float*>(static_cast<uintptr_t>(weight_address));
  args.bias = bias ? bias->const_data_ptr<float>() : nullptr;
  args.other = other ? other->const_data_ptr<float>() : nullptr;
  args.out = out.data_ptr<float>();
  args.num_rows = num_rows;
  args.in_features = in_features;
  args.out_features = out_features;
  args.epilogue = kind;
  at::parallel_for(0, out_features / pdserve::kFp32Panel, 1,
                   [&](int64_t begin, int64_t end) { run(args, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "fp32_linear(Tensor x, int weight_address, int in_features, int out_features, Tensor? "
      "bias, str epilogue, Tensor? other, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("fp32_linear", &fp32_linear);
}
