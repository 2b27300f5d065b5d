// bf16 linears of few rows on AMX tiles, over a weight that oneDNN packed:
//
//   torch.ops.pdserve.amx_linear(x, weight_address, in_features, out_features, bias, epilogue,
//                                other) -> out
//       out = epilogue(x @ weight^T + bias), x [num_rows, in_features] bf16, out [num_rows,
//       out_features] bf16; epilogue "none", "silu" or "mul" (times other [num_rows,
//       out_features]).
//   torch.ops.pdserve.amx_linear_unavailable_reason() -> str ("" when this process can run it)
//
// weight_address is the data of a oneDNN-packed weight (torch.ops.mkldnn.data_ptr of
// mkldnn._reorder_linear_weight's result) in the AB16b32a2b layout amx_linear_isa.h describes.
// The op cannot check that address: its only caller (services/models/amx_linear.py) verified the
// packed bytes against the plain weight once, and holds the packed tensor while it calls. This
// file checks everything else (a wrong shape is an error, not a stray write), copies the rows of
// x's last, partial 16-row group into a zero-padded tile's worth (tile loads read 16 rows), and
// splits the output's 32-column blocks over torch's OpenMP threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "amx_linear_isa.h"
#include "few_row_linear_args.h"

namespace {

at::Tensor amx_linear(const at::Tensor& x, int64_t weight_address, int64_t in_features,
                      int64_t out_features, const std::optional<at::Tensor>& bias,
                      std::string epilogue, const std::optional<at::Tensor>& other) {
  const std::string reason = pdserve::amx_unavailable_reason();
  TORCH_CHECK(reason.empty(), "amx_linear: ", reason);
  const pdserve::LinearEpilogue kind = pdserve::check_linear_args(
      "amx_linear", {at::kBFloat16, "bfloat16"}, x, in_features, out_features, bias, epilogue,
      other);
  const int64_t num_rows = x.size(0);
  TORCH_CHECK(in_features > 0 && in_features % 32 == 0 && out_features > 0 &&
                  out_features % 32 == 0,
              "amx_linear: in_features and out_features must be positive multiples of 32, got ",
              in_features, " and ", out_features);
  TORCH_CHECK(weight_address != 0, "amx_linear: weight_address is null");
  at::Tensor out = at::empty({num_rows, out_features}, x.options());
  if (num_rows == 0) {
    return out;
  }
  // A tile load reads 16 rows: the whole groups of 16 are read in place, the rows past them go
  // to a zeroed group of their own. (Padding x whole to a multiple of 32 rows copied every row
  // and, 16 rows past a multiple of 32, multiplied a group of zeros.) The copy is a plain one:
  // at::zeros and copy_, parallel fills of a few KiB, added ~12 us to a call here.
  const int64_t whole_rows = num_rows / 16 * 16;
  at::Tensor tail;
  if (whole_rows != num_rows) {
    tail = at::empty({16, in_features}, x.options());
    const int64_t row_bytes = in_features * 2;
    const int64_t copied = (num_rows - whole_rows) * row_bytes;
    char* tail_bytes = static_cast<char*>(tail.data_ptr());
    memcpy(tail_bytes, static_cast<const char*>(x.data_ptr()) + whole_rows * row_bytes, copied);
    memset(tail_bytes + copied, 0, 16 * row_bytes - copied);
  }
  pdserve::AmxLinearArgs args{};
  args.x = x.data_ptr();
  args.tail = tail.defined() ? tail.data_ptr() : nullptr;
  args.weight = reinterpret_cast<const void*>(static_cast<uintptr_t>(weight_address));
  args.bias = bias ? bias->data_ptr() : nullptr;
  args.other = other ? other->data_ptr() : nullptr;
  args.out = out.data_ptr();
  args.num_rows = num_rows;
  args.in_features = in_features;
  args.out_features = out_features;
  args.epilogue = kind;
  at::parallel_for(0, out_features / 32, 1, [&](int64_t begin, int64_t end) {
    pdserve::amx_linear_blocks(args, begin, end);
  });
  return out;
}

std::string amx_linear_unavailable_reason() {
  return pdserve::amx_unavailable_reason();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "amx_linear(Tensor x, int weight_address, int in_features, int out_features, Tensor? bias, "
      "str epilogue, Tensor? other) -> Tensor");
  m.def("amx_linear_unavailable_reason() -> str", &amx_linear_unavailable_reason);
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("amx_linear", &amx_linear);
}
