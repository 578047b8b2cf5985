// Shared by the packed bf16 linears (bf16_linear_avx512.cpp, bf16_linear_amx.cpp): the checks and
// buffers of one call on a weight from bf16_pack_weight ([ceil(N/16), K/2, 32] bf16).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace llmserve {

constexpr int64_t kPackedGroup = 16;  // outputs per packed group

struct PackedBf16Call {
  at::Tensor x;       // [rows, K] contiguous
  at::Tensor bias32;  // [groups * 16] fp32, zero padded (undefined without a bias)
  at::Tensor y;       // [rows, N] bf16
  std::vector<int64_t> shape;  // x's leading dims and N: y's view for the caller
  int64_t rows, k, pairs, used_groups;
};

// x [..., K] bf16, bias [N] or none. op names the caller in errors.
inline PackedBf16Call begin_packed_bf16_call(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                             const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, op, ": bfloat16");
  PackedBf16Call c;
  c.k = x.size(-1);
  TORCH_CHECK(c.k % 2 == 0, op, ": in_features must be even");
  const int64_t groups = packed.size(0);
  c.pairs = packed.size(1);
  TORCH_CHECK(c.pairs * 2 == c.k && groups * kPackedGroup >= n && packed.size(2) == 2 * kPackedGroup, op,
              ": weight shape");
  c.x = x.reshape({-1, c.k}).contiguous();
  c.rows = c.x.size(0);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias shape");
    // Padded to whole groups so the last group's masked load never needs a bound of its own.
    c.bias32 = at::zeros({groups * kPackedGroup}, x.options().dtype(at::kFloat));
    c.bias32.narrow(0, 0, n).copy_(*bias);
  }
  c.shape.assign(x.sizes().begin(), x.sizes().end());
  c.shape.back() = n;
  c.y = at::empty({c.rows, n}, x.options());
  c.used_groups = (n + kPackedGroup - 1) / kPackedGroup;
  return c;
}

}  // namespace llmserve
