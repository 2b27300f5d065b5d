// Linears over weights kept quantized (a GGUF file's blocks, services/models/gguf_linear.py):
//
//   torch.ops.pdserve.quantized_linear(x, codes, scales, offsets, group, bias, isa) -> out
//       out = x @ weight^T + bias, x [num_rows, in_features] fp32, out [num_rows, out_features]
//       fp32, weight[64 p + c][k] = codes[p][k][c] * scales[p][k / group][c]
//       (+ offsets[p][k / group][c]); codes int8 [out / 64][in][64], scales and offsets fp32
//       [out / 64][in / group][64], offsets None for a symmetric format.
//
// Every argument is checked here (a wrong shape is an error, not a stray read), and that this CPU
// runs the requested variant (cpu_isa.h: an error, never SIGILL); the output's 64-column panels
// are split over torch's OpenMP threads. The kernels are fp32_linear_kernel.h's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cpu_isa.h"
#include "few_row_linear_args.h"
#include "quantized_linear_isa.h"

namespace {

constexpr int64_t kMinBlock = 64;  // fp32_linear_kernel.h's blocks are whole groups

pdserve::RunQuantizedPanels select_kernel(const std::string& isa) {
  pdserve::check_cpu_runs(isa, "quantized_linear");
#if defined(__x86_64__)
  if (isa == "avx2") {
    return pdserve::quantized_linear_panels_avx2;
  }
  if (isa == "avx512" || isa == "avx512_bf16") {
    return pdserve::quantized_linear_panels_avx512;
  }
#endif
  return pdserve::quantized_linear_panels_portable;
}

void check_panels(const at::Tensor& t, const char* name, at::ScalarType type, const char* dtype,
                  int64_t panels, int64_t inner) {
  TORCH_CHECK(t.scalar_type() == type, "quantized_linear: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "quantized_linear: ", name,
              " must be a contiguous CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == panels && t.size(1) == inner &&
                  t.size(2) == pdserve::kFp32Panel,
              "quantized_linear: ", name, " must be [", panels, ", ", inner, ", 64], got ",
              t.sizes());
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                            int64_t group, const std::optional<at::Tensor>& bias,
                            std::string isa) {
  const pdserve::RunQuantizedPanels run = select_kernel(isa);
  TORCH_CHECK(codes.dim() == 3, "quantized_linear: codes must be [out / 64, in, 64], got ",
              codes.sizes());
  const int64_t panels = codes.size(0), in_features = codes.size(1);
  const int64_t out_features = panels * pdserve::kFp32Panel;
  TORCH_CHECK(group > 0 && kMinBlock % group == 0 && in_features % group == 0 &&
                  in_features > 0 && panels > 0,
              "quantized_linear: group must divide 64 and in_features, got group ", group,
              " and in_features ", in_features);
  check_panels(codes, "codes", at::kChar, "int8", panels, in_features);
  check_panels(scales, "scales", at::kFloat, "float32", panels, in_features / group);
  if (offsets) {
    check_panels(*offsets, "offsets", at::kFloat, "float32", panels, in_features / group);
  }
  pdserve::check_linear_args("quantized_linear", {at::kFloat, "float32"}, x, in_features,
                             out_features, bias, "none", std::nullopt);
  const int64_t num_rows = x.size(0);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) {
    return out;
  }
  pdserve::QuantizedLinearArgs args{};
  args.base.x = x.const_data_ptr<float>();
  args.base.weight = nullptr;
  args.base.bias = bias ? bias->const_data_ptr<float>() : nullptr;
  args.base.other = nullptr;
  args.base.out = out.data_ptr<float>();
  args.base.num_rows = num_rows;
  args.base.in_features = in_features;
  args.base.out_features = out_features;
  args.base.epilogue = pdserve::LinearEpilogue::kNone;
  args.codes = codes.const_data_ptr<int8_t>();
  args.scales = scales.const_data_ptr<float>();
  args.offsets = offsets ? offsets->const_data_ptr<float>() : nullptr;
  args.group = group;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) { run(args, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "quantized_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group, "
      "Tensor? bias, str isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
}
