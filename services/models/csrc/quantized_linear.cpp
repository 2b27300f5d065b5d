// Linears over weights kept quantized (a GGUF file's blocks, services/models/gguf_linear.py):
//
//   torch.ops.pdserve.quantized_linear(x, codes, scales, offsets, group, bits, bias, isa) -> out
//       out = x @ weight^T + bias, x [num_rows, in_features] fp32, out [num_rows, out_features]
//       fp32, weight[64 p + c][k] = codes[p][k][c] * scales[p][k / group][c]
//       (+ offsets[p][k / group][c]); codes int8 [out / 64][in][64] (bits 8) or two 4-bit
//       codes a byte, uint8 [out / 64][in / 2][64] (bits 4, quantized_linear_isa.h), scales and
//       offsets fp32 [out / 64][in / group][64], offsets None for a symmetric 8-bit format.
//   torch.ops.pdserve.quantized_weight_t(codes, scales, offsets, group, bits, panel_begin,
//                                        panel_end, out, isa)
//       those panels' rows of the weight, dequantized, into out [in, 64 (panel_end -
//       panel_begin)] transposed (a prefill step's GEMM multiplies that).
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

struct Kernels {
  pdserve::RunQuantizedPanels linear;
  pdserve::RunDequantizePanels dequantize;
};

Kernels select_kernels(const std::string& isa, const char* op) {
  pdserve::check_cpu_runs(isa, op);
#if defined(__x86_64__)
  if (isa == "avx2") {
    return {pdserve::quantized_linear_panels_avx2, pdserve::dequantize_panels_avx2};
  }
  if (isa == "avx512" || isa == "avx512_bf16") {
    return {pdserve::quantized_linear_panels_avx512, pdserve::dequantize_panels_avx512};
  }
#endif
  return {pdserve::quantized_linear_panels_portable, pdserve::dequantize_panels_portable};
}

void check_panels(const char* op, const at::Tensor& t, const char* name, at::ScalarType type,
                  const char* dtype, int64_t panels, int64_t inner) {
  TORCH_CHECK(t.scalar_type() == type, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), op, ": ", name,
              " must be a contiguous CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == panels && t.size(1) == inner &&
                  t.size(2) == pdserve::kFp32Panel,
              op, ": ", name, " must be [", panels, ", ", inner, ", 64], got ", t.sizes());
}

// The weight's arguments, checked; the op's name in every message.
pdserve::QuantizedLinearArgs weight_args(const char* op, const at::Tensor& codes,
                                         const at::Tensor& scales,
                                         const std::optional<at::Tensor>& offsets, int64_t group,
                                         int64_t bits) {
  TORCH_CHECK(bits == 8 || (bits == 4 && offsets.has_value()), op,
              ": bits must be 8, or 4 with offsets, got ", bits);
  TORCH_CHECK(codes.dim() == 3, op, ": codes must be [out / 64, in * bits / 8, 64], got ",
              codes.sizes());
  const int64_t panels = codes.size(0), in_features = codes.size(1) * 8 / bits;
  TORCH_CHECK(group > 0 && kMinBlock % group == 0 && in_features % group == 0 &&
                  in_features > 0 && panels > 0,
              op, ": group must divide 64 and in_features, got group ", group,
              " and in_features ", in_features);
  if (bits == 8) {
    check_panels(op, codes, "codes", at::kChar, "int8", panels, in_features);
  } else {
    check_panels(op, codes, "codes", at::kByte, "uint8", panels, in_features / 2);
  }
  check_panels(op, scales, "scales", at::kFloat, "float32", panels, in_features / group);
  if (offsets) {
    check_panels(op, *offsets, "offsets", at::kFloat, "float32", panels, in_features / group);
  }
  pdserve::QuantizedLinearArgs args{};
  args.base.in_features = in_features;
  args.base.out_features = panels * pdserve::kFp32Panel;
  args.base.epilogue = pdserve::LinearEpilogue::kNone;
  args.codes = static_cast<const int8_t*>(codes.const_data_ptr());
  args.scales = scales.const_data_ptr<float>();
  args.offsets = offsets ? offsets->const_data_ptr<float>() : nullptr;
  args.group = group;
  args.bits = bits;
  return args;
}

// Panels [panel_begin, panel_end) of the weight, dequantized into `out` [in_features, 64 *
// (panel_end - panel_begin)] fp32: the transpose of those rows of the weight, which a GEMM
// (torch.mm(x, out)) multiplies as fast as oneDNN's packed fp32 weight.
void quantized_weight_t(const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, int64_t group, int64_t bits,
                        int64_t panel_begin, int64_t panel_end, at::Tensor out, std::string isa) {
  constexpr const char* kOp = "quantized_weight_t";
  const pdserve::RunDequantizePanels run = select_kernels(isa, kOp).dequantize;
  pdserve::QuantizedLinearArgs args = weight_args(kOp, codes, scales, offsets, group, bits);
  TORCH_CHECK(0 <= panel_begin && panel_begin < panel_end && panel_end <= codes.size(0), kOp,
              ": panels must be a range within [0, ", codes.size(0), "), got [", panel_begin,
              ", ", panel_end, ")");
  const int64_t columns = (panel_end - panel_begin) * pdserve::kFp32Panel;
  pdserve::check_linear_tensor(kOp, {at::kFloat, "float32"}, out, "out");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == args.base.in_features && out.size(1) == columns,
              kOp, ": out must be [", args.base.in_features, ", ", columns, "], got ",
              out.sizes());
  float* data = out.data_ptr<float>();
  at::parallel_for(panel_begin, panel_end, 1, [&](int64_t begin, int64_t end) {
    run(args, begin, end, panel_begin, data, columns);
  });
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                            int64_t group, int64_t bits, const std::optional<at::Tensor>& bias,
                            std::string isa) {
  const pdserve::RunQuantizedPanels run = select_kernels(isa, "quantized_linear").linear;
  pdserve::QuantizedLinearArgs args =
      weight_args("quantized_linear", codes, scales, offsets, group, bits);
  const int64_t panels = codes.size(0), in_features = args.base.in_features;
  const int64_t out_features = args.base.out_features;
  pdserve::check_linear_args("quantized_linear", {at::kFloat, "float32"}, x, in_features,
                             out_features, bias, "none", std::nullopt);
  const int64_t num_rows = x.size(0);
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) {
    return out;
  }
  args.base.x = x.const_data_ptr<float>();
  args.base.weight = nullptr;
  args.base.bias = bias ? bias->const_data_ptr<float>() : nullptr;
  args.base.other = nullptr;
  args.base.out = out.data_ptr<float>();
  args.base.num_rows = num_rows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) { run(args, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "quantized_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group, "
      "int bits, Tensor? bias, str isa) -> Tensor");
  m.def(
      "quantized_weight_t(Tensor codes, Tensor scales, Tensor? offsets, int group, int bits, "
      "int panel_begin, int panel_end, Tensor(a!) out, str isa) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("quantized_weight_t", &quantized_weight_t);
}
